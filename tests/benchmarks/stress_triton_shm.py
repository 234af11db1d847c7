"""Stress the Triton engine's transports: shuffled batches of distinct images, answers checked against ONNX Runtime.

Usage:
    python tests/benchmarks/stress_triton_shm.py [--transport shm|grpc] [--seconds 120] [--concurrency 3]
        [--kill-every-s 7]

Serves the portable profile from a real tritonserver (nvidia-pytriton's binary) and classifies, round after round,
a random subset (random order, random size) of the committed photos plus 120 synthetic JPEGs of random sizes (so the
shared-memory regions are regrown), 8 images a request; each answer's top-1 must equal ONNX Runtime's for that image.
``--kill-every-s`` SIGKILLs the server that often, so requests in flight meet restarts. Prints every mismatch and
a summary line; exits 1 if there was any.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import make_jpeg  # noqa: E402
from pipeline.engine import make_engine  # noqa: E402
from pipeline.model import load_model  # noqa: E402
from pipeline.preprocess import DecodeLimits  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("shm", "grpc"), default="shm")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--kill-every-s", type=float, default=0.0, help="SIGKILL the server this often (0: never)")
    args = parser.parse_args()

    rng = random.Random(0)
    bundle = load_model(None)
    photos = [p.read_bytes() for p in sorted((REPO / "tests" / "data" / "photos").glob("*.jpg"))]
    blobs = photos + [make_jpeg(i, size=(rng.randint(30, 400), rng.randint(30, 400))) for i in range(120)]
    onnx = make_engine("onnx", bundle, top_k=5, limits=DecodeLimits())
    want = [r.class_ids[:1] for r in onnx.classify(blobs)]
    onnx.close()
    engine = make_engine("triton", bundle, top_k=5, limits=DecodeLimits(), request_batch=8,
                         concurrency=args.concurrency, shared_memory=args.transport == "shm")
    stop = threading.Event()

    def killer() -> None:
        while not stop.wait(args.kill_every_s):
            try:
                os.kill(engine.server.pid, signal.SIGKILL)
            except (AttributeError, ProcessLookupError, TypeError):
                pass

    if args.kill_every_s > 0:
        threading.Thread(target=killer, daemon=True).start()
    mismatches = rounds = images = 0
    start = time.monotonic()
    try:
        while time.monotonic() - start < args.seconds:
            order = list(range(len(blobs)))
            rng.shuffle(order)
            chosen = order[: rng.randint(1, len(order))]
            for index, result in zip(chosen, engine.classify([blobs[i] for i in chosen])):
                if result.class_ids[:1] != want[index]:
                    mismatches += 1
                    print(f"MISMATCH image {index}: got {result.class_ids[:1]} ({result.status} {result.error}), "
                          f"ONNX {want[index]}", flush=True)
            rounds += 1
            images += len(chosen)
    finally:
        stop.set()
        restarts = engine.server.restarts if engine.server is not None else 0
        engine.close()
    print(f"{args.transport}: {rounds} rounds, {images} images, {restarts} server restarts, {mismatches} mismatches")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
