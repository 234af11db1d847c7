"""pipeline/text.py: text files as their producers write them (byte-order marks, UTF-16, CRLF), what a list line is."""

from __future__ import annotations

import codecs
import gzip
import io

import pytest

from pipeline.text import decode_text, list_lines, open_text

LINES = "# made by hand\r\n\r\ns3://b/a.jpg\r\n   /abs/b c.jpg  \r\n\t# indented comment\r\nrel/d.jpg"
ENTRIES = ["s3://b/a.jpg", "/abs/b c.jpg", "rel/d.jpg"]
# What the tools users have write: PowerShell's Out-File -Encoding utf8 (a mark), Windows PowerShell's '>' and
# Excel's "Unicode Text" (UTF-16 LE with a mark), UTF-16 BE and UTF-32 with marks, old Mac line ends (CR).
PRODUCERS = {
    "utf-8": LINES.encode(),
    "utf-8 with a mark": codecs.BOM_UTF8 + LINES.encode(),
    "utf-16 le with a mark": LINES.encode("utf-16"),
    "utf-16 be with a mark": codecs.BOM_UTF16_BE + LINES.encode("utf-16-be"),
    "utf-32 with a mark": LINES.encode("utf-32"),
    "CR line ends": LINES.replace("\r\n", "\r").encode(),
}


@pytest.mark.parametrize("producer", PRODUCERS)
def test_every_producers_encoding_and_line_ends_read_as_the_same_entries(producer):
    data = PRODUCERS[producer]
    assert list(list_lines(open_text(io.BytesIO(data)))) == ENTRIES
    assert list(list_lines(open_text(gzip.GzipFile(fileobj=io.BytesIO(gzip.compress(data)))))) == ENTRIES
    assert decode_text(data).splitlines() == LINES.replace("\r\n", "\n").replace("\r", "\n").splitlines()


def test_text_in_another_encoding_is_refused_in_one_line_that_says_how_to_fix():
    save = r"save it as UTF-8 \(a byte-order mark and CRLF line ends are fine\)"
    with pytest.raises(ValueError, match=rf"^it is not UTF-8 text \(bytes e9 0a: invalid continuation byte\); {save}$"):
        decode_text("caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^it is not UTF-8 text \(bytes e9 .*\); {save}$"):
        list(list_lines(open_text(io.BytesIO("caf\u00e9.jpg\n".encode("latin-1")))))
    nul = rf"^it holds NUL characters \(UTF-16 without a byte-order mark\?\); {save}$"
    with pytest.raises(ValueError, match=nul):
        decode_text("a.jpg\n".encode("utf-16-le"))
    with pytest.raises(ValueError, match=nul):
        list(list_lines(open_text(io.BytesIO("a.jpg\n".encode("utf-16-le")))))
