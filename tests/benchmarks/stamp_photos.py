"""A folder of ordinary-photo-like JPEGs for the INT8 gate: the photographic stamps of Debian's
``tuxpaint-stamps-default`` package (animals, food, vehicles, objects; PNGs with alpha), 500x375 (every fourth
375x500), composited onto blurred crops of tests/data/photos or, with ``--background white``, onto white as a product
catalog shows its items. Built from the installed package, never committed.

Usage:
    apt-get install tuxpaint-stamps-default
    python tests/benchmarks/stamp_photos.py OUT [--images 1000] [--background photo|white]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS.parents[1]), str(BENCHMARKS.parent)]

from support.paths import PHOTOS  # noqa: E402

STAMPS = Path("/usr/share/tuxpaint/stamps")
# Drawings, not photos: cartoon folders, symbols and the seasonal clip art.
SKIP_PARTS = {"cartoon", "symbols", "seasonal"}
LANDSCAPE = (500, 375)
JPEG_QUALITY = 90


def stamp_paths(root: Path = STAMPS) -> list[Path]:
    """The photographic stamps of the installed package."""
    paths = sorted(p for p in root.rglob("*.png") if not SKIP_PARTS & set(p.relative_to(root).parts))
    if not paths:
        raise SystemExit(f"no stamps under {root}; apt-get install tuxpaint-stamps-default")
    return paths


def make_stamp_photos(out: Path, count: int, background: str = "photo") -> None:
    """``count`` JPEGs; image i depends only on i (its stamp, background, scale and position)."""
    from PIL import Image, ImageFilter

    stamps = stamp_paths()
    photos = [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg"))]
    out.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        rng = np.random.default_rng(5000 + i)
        w, h = LANDSCAPE if i % 4 else LANDSCAPE[::-1]
        if background == "white":
            bg = Image.new("RGB", (w, h), (255, 255, 255))
        else:
            src = photos[int(rng.integers(len(photos)))]
            box_w = min(src.width, src.height * w / h) * rng.uniform(0.4, 1.0)
            left, top = rng.uniform(0, src.width - box_w), rng.uniform(0, src.height - box_w * h / w)
            bg = src.resize((w, h), Image.Resampling.BICUBIC, box=(left, top, left + box_w, top + box_w * h / w))
            bg = bg.filter(ImageFilter.GaussianBlur(float(rng.uniform(2, 6))))  # a background, not a second subject
        stamp = Image.open(stamps[i % len(stamps)]).convert("RGBA")
        scale = rng.uniform(0.55, 0.9) * min(w / stamp.width, h / stamp.height)
        stamp = stamp.resize((max(1, int(stamp.width * scale)), max(1, int(stamp.height * scale))),
                             Image.Resampling.LANCZOS)
        if rng.random() < 0.5:
            stamp = stamp.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x, y = int(rng.integers(0, w - stamp.width + 1)), int(rng.integers(0, h - stamp.height + 1))
        bg.paste(stamp, (x, y), stamp)
        bg.save(out / f"stamp{i:05d}.jpg", "JPEG", quality=JPEG_QUALITY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--background", choices=("photo", "white"), default="photo",
                        help="blurred crops of the committed photos, or white as in a product catalog")
    args = parser.parse_args()
    make_stamp_photos(args.out, args.images, args.background)
    print(f"{args.images} images in {args.out} from {len(stamp_paths())} stamps")


if __name__ == "__main__":
    main()
