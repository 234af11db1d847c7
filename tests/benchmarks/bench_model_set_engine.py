"""Benchmark: what a model set costs inside the ONNX engine, without Ray: each model alone against both in one pass.

Usage:
    python tests/benchmarks/bench_model_set_engine.py [--images 256] [--size 500x375] [--workdir DIR]

Images: JPEGs of --size cut from the committed photos (bench_vs_naive.make_images), read into memory. Models: the
built-in EfficientNet-Lite0 (``default``) and a user's model whose network costs nearly nothing (``small``,
tests/support/odd_models.py), as bench_model_set.py pairs them. Each engine classifies all images in 64-image calls
(one warm-up call first), timed as wall and CPU (this process) milliseconds per image. First printed: the decode alone
(Pillow, one thread), the part one pass shares. Then per case: each model alone, the pair as a model set (one decode per image), the sum of the two alone, and what one pass adds over the
first model alone: the second model's own preprocessing and network, which no pass can share. The ratio
alone-sum / pair is the most a job's one pass can gain over two runs from the engine's side; a job's own per-run
costs (Ray's start, listing, fetch, write) add to both runs. Each model's top-1 in the pair is checked against its own
engine's on every image.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]  # the repository, tests/ (support), benchmarks

from bench_vs_naive import make_images  # noqa: E402

from pipeline.engines.onnx import OnnxEngine  # noqa: E402
from pipeline.model.imaging import decode_image  # noqa: E402
from pipeline.model.folder import load_model  # noqa: E402

CALL = 64  # images per classify call, as a job's actor makes them
CASES = (("default", "small"), ("default", "default"))


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def measure(bundle, more, blobs: list[bytes]) -> tuple[float, float, list]:
    """(wall ms, CPU ms) per image and the results of one engine over all blobs."""
    engine = OnnxEngine(bundle, more=more)
    try:
        engine.classify(blobs[:CALL])
        wall, cpu = time.perf_counter(), _cpu()
        results = [r for i in range(0, len(blobs), CALL) for r in engine.classify(blobs[i:i + CALL])]
        n = len(blobs)
        return (time.perf_counter() - wall) / n * 1e3, (_cpu() - cpu) / n * 1e3, results
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256, help="how many JPEGs (default 256)")
    parser.add_argument("--size", default="500x375", help="WIDTHxHEIGHT of the JPEGs (default 500x375)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep images and models here (default: temp)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-set-engine-"))
    try:
        from support.odd_models import model_folder

        src = workdir / f"images-{args.size}"
        width, height = (int(v) for v in args.size.lower().split("x"))
        make_images(src, args.images, (width, height))
        blobs = [p.read_bytes() for p in sorted(src.glob("*.jpg"))[: args.images]]
        bundles = {"default": load_model(None), "small": load_model(str(model_folder(workdir / "models" / "small")))}
        alone = {name: measure(bundle, (), blobs) for name, bundle in bundles.items()}
        print(f"{len(blobs)} images of {args.size}, {os.cpu_count()} CPUs; the onnx engine in {CALL}-image calls; "
              "ms per image")
        print(f"{'case':<16} {'engine':<26} {'wall ms':>8} {'CPU ms':>8}")
        wall, cpu = time.perf_counter(), _cpu()
        for blob in blobs:
            decode_image(blob)
        n = len(blobs)
        print(f"{'-':<16} {'decode only, 1 thread':<26} {(time.perf_counter() - wall) / n * 1e3:>8.2f} "
              f"{(_cpu() - cpu) / n * 1e3:>8.2f}")
        for first, second in CASES:
            wall, cpu, results = measure(bundles[first], (bundles[second],), blobs)
            for j, name in enumerate((first, second)):
                own = alone[name][2]
                pair = [r.class_ids[0] if j == 0 else r.more[0].class_ids[0] for r in results]
                same = sum(a == b.class_ids[0] for a, b in zip(pair, own))
                assert same == len(blobs), f"{first}+{second}: {name}'s top-1 equals its own engine's on {same}"
            case = f"{first}+{second}"
            sums = [alone[first][k] + alone[second][k] for k in (0, 1)]
            rows = [(f"{first} alone", *alone[first][:2]), (f"{second} alone", *alone[second][:2]),
                    ("two alone, summed", *sums), ("both in one pass", wall, cpu),
                    (f"one pass - {first} alone", wall - alone[first][0], cpu - alone[first][1])]
            for label, w, c in rows:
                print(f"{case:<16} {label:<26} {w:>8.2f} {c:>8.2f}")
            print(f"{case:<16} {'two alone / one pass':<26} {sums[0] / wall:>7.2f}x {sums[1] / cpu:>7.2f}x")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
