"""Decoding and preprocessing on the CPU (Pillow + numpy): the reference every engine is checked against."""

from __future__ import annotations

import functools
import io
import logging
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from pipeline.errors import ConfigError, ImageError
from pipeline.model.spec import (  # noqa: F401 - the spec's names, re-exported where callers look
    CHANNEL_ORDERS, INTERPOLATIONS, LAYOUTS, OUTPUT_KINDS, OUTPUT_LOGITS, OUTPUT_PROBABILITIES, RESIZE_MODES,
    RESIZE_SHORTER, RESIZE_SQUASH, PreprocessSpec,
)
from pipeline.schema import MIB

LOG = logging.getLogger(__name__)

# Threads decoding in an actor by default (--decode-threads): the CPU count, at most this; past it threads only wait.
MAX_DECODE_THREADS = 8
DEFAULT_MAX_BYTES = 64 * MIB
DEFAULT_MAX_PIXELS = 100_000_000
# Transparent pixels are composited on this background: catalog cut-outs are meant to be seen on white,
# and the RGB under fully transparent pixels is arbitrary (often black), so dropping alpha misleads the model.
ALPHA_BACKGROUND_RGB = (255, 255, 255)

_PIL_FILTERS = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
# Half-width of each filter's kernel in output pixels (Pillow's filter supports); widened by the downscale factor.
FILTER_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0, "lanczos": 3.0}

# We enforce our own pixel cap from the header (DecodeLimits.max_pixels); Pillow's own warning between
# its limit and twice it would only be noise. Above twice its limit Pillow raises, which we map to too_many_pixels.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def follow_pixel_cap(max_pixels: int) -> None:
    """Raise Pillow's own bomb limit (``Image.MAX_IMAGE_PIXELS``, a process global) to ``max_pixels`` where it is
    lower, so that our cap, not Pillow's, decides which images are too large."""
    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels


@dataclass(frozen=True, kw_only=True)
class DecodeLimits:
    """Caps checked before a full decode: encoded size, and width*height read from the header."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_pixels < 1:
            raise ConfigError(
                f"max_bytes and max_pixels must be positive, got max_bytes={self.max_bytes} max_pixels={self.max_pixels}"
            )


def decode_image(data: bytes, limits: DecodeLimits = DecodeLimits()) -> Image.Image:
    """Decodes encoded bytes to an upright 8-bit RGB image.

    Any format Pillow reads (first frame of multi-frame files). EXIF orientation is applied; CMYK, gray,
    palette and 16-bit images are converted to RGB; transparency is composited on white.

    Raises:
        ImageError: empty, too_large, too_many_pixels, unsupported or decode_error.
    """
    if len(data) == 0:
        raise ImageError("empty", "the object has zero bytes")
    if len(data) > limits.max_bytes:
        raise ImageError(
            "too_large", f"{len(data)} bytes is over max_bytes={limits.max_bytes}; raise the limit to accept it"
        )
    follow_pixel_cap(limits.max_pixels)
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageError("too_many_pixels", f"{e}") from None
    except UnidentifiedImageError:
        raise ImageError("unsupported", f"not an image format Pillow can read (first bytes {data[:8]!r})") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as e:
        raise ImageError("decode_error", f"cannot read the header: {e}") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError("decode_error", f"header says {width}x{height} pixels")
    if width * height > limits.max_pixels:
        raise ImageError(
            "too_many_pixels",
            f"{width}x{height} = {width * height} pixels is over max_pixels={limits.max_pixels}; "
            "raise the limit to accept it",
        )
    try:
        # No img.draft(): libjpeg's DCT-domain downscaling gives different pixels than the spec's full decode +
        # bicubic resize; parity with the other engines matters more than the speed it would buy.
        img.load()
        img = _upright(img)
        return _to_rgb(img)
    except Image.DecompressionBombError as e:
        raise ImageError("too_many_pixels", f"{e}") from None
    except MemoryError:
        raise ImageError("too_many_pixels", f"{width}x{height} did not fit in memory; lower max_pixels") from None
    except Exception as e:  # Pillow's plugins raise many types for corrupt data; each is one bad input.
        raise ImageError("decode_error", f"{type(e).__name__}: {e}") from None


def _upright(img: Image.Image) -> Image.Image:
    """Applies the EXIF orientation; a corrupt EXIF block leaves the pixels as stored rather than failing them."""
    try:
        # In place: without an orientation tag exif_transpose would otherwise copy the whole decoded image, a
        # cost on every photo; with one, the pixels are the same either way.
        ImageOps.exif_transpose(img, in_place=True)
        return img
    except Exception as e:  # Pillow's EXIF parser raises assorted types on corrupt blocks
        LOG.debug("ignoring unreadable EXIF: %s", e)
        return img


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(img)
        if mode.startswith("I;16"):
            gray = (arr.astype(np.uint32) >> 8).astype(np.uint8)  # 16-bit range 0..65535 -> 0..255
        elif mode == "I":
            # 16-bit PNG/TIFF gray opens as "I" on some Pillow versions: values above 255 mean 16-bit data.
            arr = arr.astype(np.int64)
            gray = (arr >> 8 if arr.max(initial=0) > 255 else arr).clip(0, 255).astype(np.uint8)
        else:
            gray = np.asarray(arr, dtype=np.float64)
            gray = (gray * 255.0 if np.nanmax(gray, initial=0.0) <= 1.0 else gray)
            gray = np.nan_to_num(gray).clip(0, 255).round().astype(np.uint8)
        return Image.fromarray(gray, "L").convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, ALPHA_BACKGROUND_RGB + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode in ("L", "1", "P", "CMYK", "YCbCr", "LAB", "HSV"):
        return img.convert("RGB")
    raise ImageError("unsupported", f"pixel mode {mode!r} cannot be converted to RGB")


def preprocess_image(img: Image.Image, spec: PreprocessSpec) -> np.ndarray:
    """Turns an RGB image into the model's float32 input for one image (CHW or HWC, per ``spec.layout``)."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    left, top, box_w, box_h = crop_box(w, h, spec)
    return normalize_array(np.asarray(_resample(img, spec, left, top, box_w, box_h)), spec)


def crop_box(width: float, height: float, spec: PreprocessSpec) -> tuple[float, float, float, float]:
    """(left, top, width, height) of the source region resampled to ``spec.crop``: exact floats, so no rounding of
    an intermediate resized size. Squashing takes the whole image."""
    if spec.resize == RESIZE_SQUASH:
        return 0.0, 0.0, float(width), float(height)
    crop_h, crop_w = spec.crop
    shorter = min(width, height)
    # Multiplied before dividing: a crop as large as resize_shorter spans the shorter side exactly, where dividing
    # by the factor first could overshoot it by an ulp (a negative offset, which Pillow refuses).
    box_w, box_h = crop_w * shorter / spec.resize_shorter, crop_h * shorter / spec.resize_shorter
    return max(0.0, (width - box_w) / 2.0), max(0.0, (height - box_h) / 2.0), box_w, box_h


def _resample(
    img: Image.Image, spec: PreprocessSpec, left: float, top: float, box_w: float, box_h: float
) -> Image.Image:
    """The crop box resampled to ``spec.crop``: a horizontal pass, rounded to 8 bits, then a vertical pass.

    The order is fixed on purpose. One ``Image.resize`` call runs the passes in that order up to Pillow 12, but
    Pillow 13 runs the vertical pass first when it drops more than twice as many rows as columns (Pillow#9549):
    on tall photos that moves pixels by up to 12 levels. Two explicit calls keep the reference the same on every
    Pillow, and let DALI (``pipeline.gpu.dali_graph``, also the gpu engine's resize) do exactly what it does.
    """
    crop_h, crop_w = spec.crop
    resample = _PIL_FILTERS[spec.interpolation]
    if spec.interpolation == "nearest":  # a point sample per axis: the order cannot matter
        return img.resize((crop_w, crop_h), resample, box=(left, top, left + box_w, top + box_h))
    w, h = img.size
    # Only the rows the vertical pass reads go through the horizontal one (what a single resize call does too).
    support = FILTER_SUPPORT[spec.interpolation] * max(box_h / crop_h, 1.0)
    first, last = max(0, math.floor(top - support) - 1), min(h, math.ceil(top + box_h + support) + 1)
    rows = img if (first, last) == (0, h) else img.crop((0, first, w, last))
    mid = rows.resize((crop_w, last - first), resample, box=(left, 0, left + box_w, last - first))
    return mid.resize((crop_w, crop_h), resample, box=(0, top - first, crop_w, top - first + box_h))


@functools.lru_cache(maxsize=16)
def _value_table(scale: float, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[3, 256] float32: the normalized value of each 8-bit level per output channel, computed with the same float32
    arithmetic as the array expression in normalize_array, so looking values up gives identical numbers."""
    levels = np.arange(256, dtype=np.float32)[:, None].repeat(3, axis=1)
    table = (levels * np.float32(scale) - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(table.T, dtype=np.float32)


def normalize_array(rgb: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """The value part of the spec: uint8 HWC RGB (already cropped) -> float32 in the spec's range, order, layout."""
    rgb = np.asarray(rgb)
    if rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3:
        # 8-bit input: one table lookup per value is faster than the arithmetic and gives the same float32 results.
        table = _value_table(float(spec.scale), tuple(map(float, spec.mean)), tuple(map(float, spec.std)))
        source = rgb[:, :, ::-1] if spec.channel_order == "BGR" else rgb
        if spec.layout == "NCHW":
            return np.stack([table[c][source[:, :, c]] for c in range(3)])
        return np.stack([table[c][source[:, :, c]] for c in range(3)], axis=-1)
    arr = np.asarray(rgb, dtype=np.float32)
    if spec.channel_order == "BGR":
        arr = arr[:, :, ::-1]
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    arr = (arr * np.float32(spec.scale) - mean) / std
    if spec.layout == "NCHW":
        arr = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr, dtype=np.float32)


def load_and_preprocess(
    data: bytes, spec: PreprocessSpec, limits: DecodeLimits = DecodeLimits()
) -> tuple[np.ndarray, int, int]:
    """Decodes and preprocesses one encoded image.

    Returns:
        (input array, original width, original height); width/height are after EXIF rotation.

    Raises:
        ImageError: the input cannot be used (see ``decode_image``).
    """
    (arr,), width, height = load_and_preprocess_each(data, (spec,), limits)
    return arr, width, height


def load_and_preprocess_each(
    data: bytes, specs: Sequence[PreprocessSpec], limits: DecodeLimits = DecodeLimits()
) -> tuple[list[np.ndarray], int, int]:
    """Decodes one encoded image once and preprocesses it per each of ``specs`` (a model set's models).

    Returns:
        (an input array per spec, original width, original height), as ``load_and_preprocess``.

    Raises:
        ImageError: the input cannot be used (see ``decode_image``).
    """
    img = decode_image(data, limits)
    try:
        arrs = [preprocess_image(img, spec) for spec in specs]
    except MemoryError:
        raise ImageError("too_many_pixels", f"{img.width}x{img.height} did not fit in memory; lower max_pixels") from None
    return arrs, img.width, img.height
