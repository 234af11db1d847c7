"""The benchmark JPEG sets, made deterministically from the repository's photos (tests/data/photos): ``imagenet``
(500x375 or 375x500 crops with grain, about 100 KB, like ImageNet's files), ``light`` (the same crops at quality 85,
about 35 KB) and ``varied`` (the parity set: varied sizes, some gray)."""

from __future__ import annotations

import io
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS.parents[1]), str(BENCHMARKS.parent)]  # the repository (pipeline) and tests/ (support)

from support.paths import PHOTOS  # noqa: E402

NOISE_SIGMA = 5.0
QUALITY = (94, 98)


def _photos() -> list:
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg"))]


def _make_one(args) -> bytes:
    """One deterministic JPEG: crop, resize, mirror, brightness and quality drawn from ``seed``."""
    seed, size_mode = args
    from PIL import Image, ImageEnhance

    rng = np.random.default_rng(seed)
    photos = _photos_cache()
    img = photos[seed % len(photos)]
    w, h = img.size
    portrait = rng.random() < 0.3
    aspect = 3 / 4 if portrait else 4 / 3
    area = rng.uniform(0.35, 1.0) * w * h
    cw = min(w, int(round((area * aspect) ** 0.5)))
    ch = min(h, int(round(cw / aspect)))
    cw = min(cw, int(round(ch * aspect)))
    x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    crop = img.crop((x0, y0, x0 + cw, y0 + ch))
    if size_mode in ("imagenet", "light"):
        out_w, out_h = (375, 500) if portrait else (500, 375)
    else:  # parity set: varied sizes, some upscaled, some small
        long_side = int(rng.integers(160, 1100))
        out_w, out_h = (int(long_side * 3 / 4), long_side) if portrait else (long_side, int(long_side * 3 / 4))
    crop = crop.resize((out_w, out_h), Image.Resampling.LANCZOS)
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    crop = ImageEnhance.Brightness(crop).enhance(float(rng.uniform(0.8, 1.2)))
    if size_mode == "imagenet":
        # Sensor-like grain: the photos are at most 640 px, so upscaled crops are smoother (and their JPEGs
        # smaller) than camera photos; mild noise brings the files to ImageNet's ~100 KB at 500x375.
        arr = np.asarray(crop, dtype=np.float32)
        arr = arr + rng.normal(0.0, NOISE_SIGMA, arr.shape).astype(np.float32)
        crop = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8))
        quality = int(rng.integers(QUALITY[0], QUALITY[1] + 1))
    elif size_mode == "light":  # the light files of the earlier device notes (~40 KB): quality 85, no grain
        quality = 85
    else:
        quality = int(rng.integers(80, 96))
        if rng.random() < 0.1:
            crop = crop.convert("L")
    buf = io.BytesIO()
    crop.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


_PHOTO_CACHE: list = []


def _photos_cache() -> list:
    if not _PHOTO_CACHE:
        _PHOTO_CACHE.extend(_photos())
    return _PHOTO_CACHE


def make_set(count: int, size_mode: str, seed0: int) -> list[bytes]:
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(_make_one, [(seed0 + i, size_mode) for i in range(count)], chunksize=32))
