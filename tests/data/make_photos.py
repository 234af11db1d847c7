"""Regenerates tests/data/photos/: scikit-image's bundled photos re-encoded as JPEG (quality 90, long side <= 640).

A maintainer tool, not run by the tests; needs scikit-image (pip install scikit-image).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from skimage import data

PHOTOS = {
    "chelsea": data.chelsea,  # Chelsea the cat, CC0 (Stefan van der Walt)
    "coffee": data.coffee,  # coffee cup, CC0 (Rachel Michetti)
    "rocket": data.rocket,  # Falcon 9 / DSCOVR launch, public domain (SpaceX)
    "astronaut": data.astronaut,  # Eileen Collins, public domain (NASA)
    "camera": data.camera,  # man with camera, gray, CC0 (Lav Varshney)
    "coins": data.coins,  # Greek coins from Pompeii, gray, no known restrictions (Brooklyn Museum)
    "clock": data.clock,  # motion-blurred wall clock, gray, public domain (Stefan van der Walt)
    "hubble_deep_field": data.hubble_deep_field,  # public domain (NASA)
    "retina": data.retina,  # fundus photograph, CC0 (Mikael Haggstrom)
    "immunohistochemistry": data.immunohistochemistry,  # no known restrictions (CMMI)
}
MAX_SIDE_PX = 640
JPEG_QUALITY = 90


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, load in PHOTOS.items():
        img = Image.fromarray(np.asarray(load()))
        if max(img.size) > MAX_SIDE_PX:
            scale = MAX_SIDE_PX / max(img.size)
            img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.LANCZOS)
        img.save(out_dir / f"{name}.jpg", quality=JPEG_QUALITY)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "photos")
