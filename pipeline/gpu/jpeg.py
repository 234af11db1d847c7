"""JPEG triage on the CPU for the gpu engine: dimensions, EXIF orientation and coding read from the header."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import ImageError

# JPEG start-of-frame markers: baseline/extended Huffman and progressive decode on the GPU; the rest
# (lossless, arithmetic coding, hierarchical) go to Pillow, which says whether it can read them.
_SOF_GPU = {0xC0: "baseline", 0xC1: "baseline", 0xC2: "progressive"}
_SOF_OTHER = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, 0xD0, 0xD1, 0xD2, 0xD3, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8}
EXIF_ORIENTATION_TAG = 0x0112


@dataclass(frozen=True)
class JpegInfo:
    """What the JPEG header says, before any decoding."""

    width: int
    height: int
    components: int
    precision: int
    process: str  # "baseline", "progressive" or "other"
    orientation: int = 1  # EXIF orientation 1..8 (1 = upright)
    complete: bool = True  # the data ends with the EOI marker

    @property
    def gpu_decodable(self) -> bool:
        """nvJPEG decodes 8-bit gray/YCbCr baseline and progressive files; the rest goes to Pillow."""
        return (
            self.process in ("baseline", "progressive")
            and self.precision == 8
            and self.components in (1, 3)
            and self.complete
            and self.width > 0
            and self.height > 0
        )

    @property
    def upright_size(self) -> tuple[int, int]:
        """(width, height) after the EXIF orientation is applied."""
        return (self.height, self.width) if self.orientation in (5, 6, 7, 8) else (self.width, self.height)


def parse_jpeg_header(data: bytes) -> JpegInfo | None:
    """Reads a JPEG's frame header and EXIF orientation without decoding.

    Returns None when ``data`` is not a JPEG (no SOI marker).

    Raises:
        ImageError: decode_error when the file starts like a JPEG but its header is cut or malformed.
    """
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos = 2
    orientation = 1
    while pos < n:
        if data[pos] != 0xFF:
            raise ImageError("decode_error", f"corrupt JPEG header: expected a marker at byte {pos}")
        while pos < n and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= n:
            break
        marker = data[pos]
        pos += 1
        if marker in _STANDALONE:
            continue
        if marker == 0xD9 or marker == 0xDA:
            raise ImageError("decode_error", "corrupt JPEG: image data starts before the frame header")
        if pos + 2 > n:
            break
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2 or pos + length > n:
            break
        if marker == 0xE1 and data[pos + 2 : pos + 8] == b"Exif\x00\x00":
            orientation = _exif_orientation(bytes(data[pos + 8 : pos + length]))
        elif marker in _SOF_GPU or marker in _SOF_OTHER:
            if length < 8:
                break
            precision = data[pos + 2]
            height = (data[pos + 3] << 8) | data[pos + 4]
            width = (data[pos + 5] << 8) | data[pos + 6]
            components = data[pos + 7]
            complete = data[n - 2] == 0xFF and data[n - 1] == 0xD9
            return JpegInfo(
                width=width,
                height=height,
                components=components,
                precision=precision,
                process=_SOF_GPU.get(marker, "other"),
                orientation=orientation,
                complete=complete,
            )
        pos += length
    raise ImageError("decode_error", "truncated JPEG: the data ends inside the header")


def _exif_orientation(tiff: bytes) -> int:
    """The Orientation tag of IFD0 in an EXIF (TIFF) block; 1 when absent or unreadable."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(tiff):
            return 1
        if int.from_bytes(tiff[entry : entry + 2], order) == EXIF_ORIENTATION_TAG:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            return value if 1 <= value <= 8 else 1
    return 1
