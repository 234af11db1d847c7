"""Odd inputs every engine must answer with exactly one result: `oddities()` -> {name: (bytes, status, error kind)}.

Deterministic (fixed seeds, made from the committed photos in tests/data/photos) and importable by any test:
    from support.oddities import oddities   (with tests/ on sys.path, as pytest and the benchmarks put it)
Expected kinds are those of pipeline.errors.ERROR_KINDS under the default DecodeLimits.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image
from support.paths import PHOTOS

BOMB_SIDE_PX = 40_000
EXIF_ORIENTATION_TAG = 0x0112
# Orientation 6: the stored pixels are the upright picture turned 90 degrees counter-clockwise; a viewer turns
# them 90 degrees clockwise to show it upright.
EXIF_ROTATE_CW = 6


def photo(name: str = "chelsea") -> Image.Image:
    """One of the committed photos, decoded to RGB."""
    with Image.open(PHOTOS / f"{name}.jpg") as img:
        return img.convert("RGB")


def photo_bytes(name: str = "chelsea") -> bytes:
    return (PHOTOS / f"{name}.jpg").read_bytes()


def encode(img: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **params)
    return buf.getvalue()


def photo_set() -> list[bytes]:
    """The committed photos, then one with an EXIF orientation tag and one PNG: the ordinary inputs of the gpu tests."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION_TAG] = EXIF_ROTATE_CW
    datas = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))]
    return datas + [encode(photo(), "JPEG", exif=exif.tobytes()), encode(photo("rocket"), "PNG")]


def exif_rotated_jpeg(name: str = "chelsea") -> bytes:
    """The photo stored turned 90 degrees counter-clockwise, with an EXIF tag saying to turn it back."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION_TAG] = EXIF_ROTATE_CW
    return encode(photo(name).transpose(Image.Transpose.ROTATE_90), "JPEG", quality=90, exif=exif.tobytes())


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


@functools.lru_cache(maxsize=1)
def bomb_png(side_px: int = BOMB_SIDE_PX) -> bytes:
    """A valid 1-bit gray PNG of side_px x side_px zeros: ~200 KB on disk, 1.6 G pixels decoded."""
    row = b"\x00" * (1 + (side_px + 7) // 8)  # filter byte + packed bits
    comp = zlib.compressobj(9)
    parts = [comp.compress(row * 1000) for _ in range(side_px // 1000)]
    parts.append(comp.compress(row * (side_px % 1000)))
    parts.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", side_px, side_px, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", b"".join(parts)) + _png_chunk(b"IEND", b"")


def _jpeg_header_only(data: bytes) -> bytes:
    """The JPEG up to and including its start-of-scan header, without any scan data."""
    sos = data.index(b"\xff\xda")
    (length,) = struct.unpack(">H", data[sos + 2 : sos + 4])
    return data[: sos + 2 + length]


def _rgba_cutout() -> Image.Image:
    img = photo("coffee").resize((300, 200)).convert("RGBA")
    alpha = np.zeros((200, 300), np.uint8)
    alpha[30:170, 50:250] = 255  # opaque centre, transparent border
    img.putalpha(Image.fromarray(alpha))
    return img


@functools.lru_cache(maxsize=1)
def _oddities() -> dict[str, tuple[bytes, str, str | None]]:
    cat = photo("chelsea")
    jpeg = encode(cat, "JPEG", quality=90)
    rng = np.random.default_rng(7)
    gray16 = (np.asarray(cat.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    return {
        "empty": (b"", "error", "empty"),
        "plain_text": (b"Hello, this is not an image.\n" * 20, "error", "unsupported"),
        "random_bytes": (rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "error", "unsupported"),
        "truncated_jpeg": (jpeg[: len(jpeg) // 2], "error", "decode_error"),
        "header_only_jpeg": (_jpeg_header_only(jpeg), "error", "decode_error"),
        "bomb_png": (bomb_png(), "error", "too_many_pixels"),
        "jpeg": (jpeg, "ok", None),
        "progressive_jpeg": (encode(cat, "JPEG", quality=90, progressive=True), "ok", None),
        "cmyk_jpeg": (encode(cat.convert("CMYK"), "JPEG", quality=90), "ok", None),
        "gray_jpeg": (encode(cat.convert("L"), "JPEG", quality=90), "ok", None),
        "exif_rotated_jpeg": (exif_rotated_jpeg(), "ok", None),
        "rgba_png": (encode(_rgba_cutout(), "PNG"), "ok", None),
        "palette_png_transparent": (encode(_rgba_cutout().convert("P"), "PNG", transparency=0), "ok", None),
        "gray16_png": (encode(Image.fromarray(gray16), "PNG"), "ok", None),
        "webp": (encode(cat, "WEBP", quality=85), "ok", None),
        "tiff": (encode(cat, "TIFF", compression="tiff_deflate"), "ok", None),
        "bmp": (encode(cat, "BMP"), "ok", None),
        "gif": (encode(cat.convert("P"), "GIF"), "ok", None),
        "tiny_8x6": (encode(cat.resize((8, 6)), "PNG"), "ok", None),
        "extreme_aspect_2000x120": (encode(cat.resize((2000, 120)), "JPEG", quality=90), "ok", None),
    }


def oddities() -> dict[str, tuple[bytes, str, str | None]]:
    """{name: (encoded bytes, expected status "ok"/"error", expected error kind or None)}; a fresh dict."""
    return dict(_oddities())


EXPECTED_SIZES = {  # (width, height) a result must report for these ok inputs; after EXIF rotation
    "jpeg": (451, 300),
    "exif_rotated_jpeg": (451, 300),
    "tiny_8x6": (8, 6),
    "extreme_aspect_2000x120": (2000, 120),
}
