"""Text files as their producers write them: the encoding a byte-order mark names (UTF-8, UTF-16, UTF-32), else
UTF-8; any line ending; and what a line of a list file means.

PowerShell writes UTF-8 with a byte-order mark (``Out-File -Encoding utf8``) or UTF-16 with one (Windows
PowerShell's ``>``), Excel's "Unicode Text" is UTF-16, Notepad and Windows tools end lines with CRLF: all read as
the same text. A file in another encoding (Latin-1, UTF-16 without a mark) is refused in one line that says so.
"""

from __future__ import annotations

import codecs
import io
from typing import BinaryIO, Iterable, Iterator, TextIO

UTF8 = "utf-8"
# Byte-order marks and the codec that reads past each; the longest first, as UTF-32-LE's starts with UTF-16-LE's.
BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
        (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
BOM_BYTES = max(len(bom) for bom, _ in BOMS)
COMMENT = "#"  # a list line whose first character (after blanks) is this is a comment
SAVE_AS = "save it as UTF-8 (a byte-order mark and CRLF line ends are fine)"
NUL_TEXT = f"it holds NUL characters (UTF-16 without a byte-order mark?); {SAVE_AS}"


def encoding_of(head: bytes) -> str:
    """The codec that reads a text whose first bytes are ``head``: the one its byte-order mark names (the codec
    drops the mark), else UTF-8."""
    return next((codec for bom, codec in BOMS if head.startswith(bom)), UTF8)


def decode_text(data: bytes) -> str:
    """A whole text file's content, decoded as ``encoding_of`` says, without its byte-order mark.

    Raises:
        ValueError: one line, when the bytes are not text in that encoding (e.g. Latin-1, or UTF-16 without a mark).
    """
    try:
        text = data.decode(encoding_of(data[:BOM_BYTES]))
    except UnicodeDecodeError as err:
        raise ValueError(not_text(err)) from None
    if "\0" in text:
        raise ValueError(NUL_TEXT)
    return text


def open_text(raw: BinaryIO) -> TextIO:
    """A seekable binary stream as text, decoded as ``decode_text`` does, whatever its line ends (LF, CRLF, CR)."""
    head = raw.read(BOM_BYTES)
    raw.seek(0)
    return io.TextIOWrapper(raw, encoding=encoding_of(head), errors="strict", newline=None)


def list_lines(lines: Iterable[str]) -> Iterator[str]:
    """The entries of a list file (one per line): each line without the blanks around it; blank lines and comments
    (a line whose first character is ``#``) are no entries.

    Raises:
        ValueError: one line, for a line that holds a NUL character (UTF-16 without a byte-order mark read as UTF-8).
    """
    try:
        for line in lines:
            line = line.strip()
            if line and line[0] != COMMENT:
                if "\0" in line:
                    raise ValueError(NUL_TEXT)
                yield line
    except UnicodeDecodeError as err:
        raise ValueError(not_text(err)) from None



def not_text(err: UnicodeDecodeError) -> str:
    """One line for bytes that are not text in the encoding they were read as."""
    bad = err.object[err.start:err.start + 4].hex(" ")
    return f"it is not {err.encoding.upper().replace('-SIG', '')} text (bytes {bad}: {err.reason}); {SAVE_AS}"
