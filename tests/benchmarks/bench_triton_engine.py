"""--engine triton against --engine onnx on the same images in one run: img/s side by side, with ratios.

Measures what an actor sees (classify() of a batch of encoded files, decode included), on this machine's CPUs:
the portable profile's server decodes with the reference code and runs ONNX Runtime, so the ratio is the cost
of Triton's transport and scheduling on the CPU; on the GPU machine pass ``--repository`` of a GPU profile.

    python tests/benchmarks/bench_triton_engine.py --images 200 --rounds 3
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.engine import make_engine  # noqa: E402
from pipeline.model import load_model  # noqa: E402

PHOTOS = REPO / "tests" / "data" / "photos"


def measure(engine, blobs: list[bytes], rounds: int) -> float:
    engine.classify(blobs[:8])  # warm-up: sessions, threads, connections
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        results = engine.classify(blobs)
        elapsed = time.perf_counter() - start
        assert len(results) == len(blobs) and all(r.status == "ok" for r in results)
        best = max(best, len(blobs) / elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=200, help="images per classify() call")
    parser.add_argument("--rounds", type=int, default=3, help="calls per engine; the best is reported")
    parser.add_argument("--repository", default=None, help="repository for the triton engine (default: portable)")
    parser.add_argument("--request-batch", default="8,32", help="triton request sizes to compare, comma separated")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--instances", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    bundle = load_model(None)
    photos = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))]
    blobs = [photos[i % len(photos)] for i in range(args.images)]
    rows = []
    onnx = make_engine("onnx", bundle, top_k=5)
    try:
        rows.append(("onnx", "-", measure(onnx, blobs, args.rounds)))
    finally:
        onnx.close()
    for request_batch in (int(v) for v in args.request_batch.split(",")):
        triton = make_engine("triton", bundle, top_k=5, repository=args.repository, instances=args.instances,
                             request_batch=request_batch, concurrency=args.concurrency)
        try:
            rows.append(("triton", f"{request_batch} x {args.concurrency}", measure(triton, blobs, args.rounds)))
        finally:
            triton.close()
    base = rows[0][2]
    print(f"\n{args.images} photos per call, best of {args.rounds}; ratio = img/s / onnx img/s")
    print("| engine | request batch x concurrency | img/s | ratio |")
    print("|---|---|---:|---:|")
    for engine, shape, rate in rows:
        print(f"| {engine} | {shape} | {rate:.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
