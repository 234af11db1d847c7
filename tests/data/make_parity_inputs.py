"""Regenerates tests/data/parity/inputs/: 200 JPEGs of 224x224 cut deterministically from scikit-image's photos.

A maintainer tool, not run by the tests; needs scikit-image. After regenerating, rerun make_parity_fixture.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from skimage import data

SOURCES = (
    "chelsea", "coffee", "rocket", "astronaut", "camera", "coins", "clock", "hubble_deep_field", "retina",
    "immunohistochemistry", "brick", "grass", "gravel", "moon", "page", "text", "colorwheel", "cell",
)
COUNT = 200
SEED = 20261129
CROP_PX = 224


def make(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    images = [Image.fromarray(np.asarray(getattr(data, name)())).convert("RGB") for name in SOURCES]
    for i in range(COUNT):
        img = images[i % len(images)]
        w, h = img.size
        cw = int(w * rng.uniform(0.35, 1.0))
        ch = min(h, int(cw * rng.uniform(0.75, 1.33)))
        left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        crop = img.crop((left, top, left + cw, top + ch))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if rng.random() < 0.15:
            crop = crop.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        # Already the model's input size: the fixture feeds decode + normalise, no resize, because Pillow's
        # bicubic resize changed between 12.3 and 13.0 (up to 4/255 on ~20% of images) and the fixture must
        # test the model conversion, not Pillow's version. JPEG decoding gave identical pixels on both.
        crop = crop.resize((CROP_PX, CROP_PX), Image.Resampling.BILINEAR)
        crop.save(out_dir / f"{i:04d}.jpg", quality=int(rng.integers(70, 91)))


if __name__ == "__main__":
    make(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "parity" / "inputs")
