"""Regenerates tests/data/parity/inputs/: 200 small JPEGs cut deterministically from scikit-image's photos."""

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


def make(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    images = [Image.fromarray(np.asarray(getattr(data, name)())).convert("RGB") for name in SOURCES]
    for i in range(COUNT):
        img = images[i % len(images)]
        w, h = img.size
        cw = int(w * rng.uniform(0.35, 1.0))
        ch = int(h * rng.uniform(0.35, 1.0))
        left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        crop = img.crop((left, top, left + cw, top + ch))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if rng.random() < 0.15:
            crop = crop.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        long_side = int(rng.integers(96, 321))
        scale = long_side / max(crop.size)
        crop = crop.resize((max(1, round(crop.width * scale)), max(1, round(crop.height * scale))), Image.Resampling.BILINEAR)
        crop.save(out_dir / f"{i:04d}.jpg", quality=int(rng.integers(70, 96)))


if __name__ == "__main__":
    make(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "parity" / "inputs")
