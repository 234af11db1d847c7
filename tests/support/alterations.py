"""Ways a night's images go wrong without anything crashing: the altered copies the drift tests classify."""

from __future__ import annotations

import io

from PIL import Image


def rotate90(data: bytes) -> bytes:
    """Turned a quarter (the pixels, not an EXIF tag: what a broken upload path does)."""
    img = Image.open(io.BytesIO(data))
    return _jpeg(img.transpose(Image.Transpose.ROTATE_90), quality=95)


def bgr(data: bytes) -> bytes:
    """Red and blue swapped (an OpenCV array saved as if it were RGB)."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    r, g, b = img.split()
    return _jpeg(Image.merge("RGB", (b, g, r)), quality=95)


def recompress(data: bytes, quality: int = 10) -> bytes:
    """Re-encoded as a very low quality JPEG (a thumbnailer or a CDN set too aggressively)."""
    return _jpeg(Image.open(io.BytesIO(data)), quality=quality)


def _jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


ALTERATIONS = {"rotate90": rotate90, "bgr": bgr, "recompress": recompress}
