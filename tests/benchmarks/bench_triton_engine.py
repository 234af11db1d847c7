"""--engine triton against --engine onnx on the same images in one run.

Measures what an actor sees (classify() of a batch of encoded files, decode included). One server serves every
triton row, so rows differ only in the client: request size x requests in flight. On this machine's CPUs the
portable profile decodes with the reference code, so the ratio to onnx is the cost of Triton's transport and
scheduling; on the GPU machine use ``--profile gpu`` (and ``--baseline none`` where ONNX Runtime is absent).

    python tests/benchmarks/bench_triton_engine.py --images 200 --rounds 3
    python tests/benchmarks/bench_triton_engine.py --profile gpu --baseline none --images 4096 --client 128x12,256x8
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.engines.triton import TritonEngine  # noqa: E402
from pipeline.triton.server import TritonServer  # noqa: E402

PHOTOS = REPO / "tests" / "data" / "photos"
# The python backend copies inputs through its own shared memory, which starts at 1 MB and grows 1 MB at a time.
PYTHON_SHM_ARGS = ["--backend-config=python,shm-default-byte-size=268435456",
                   "--backend-config=python,shm-growth-byte-size=67108864"]


class LabelsOnly:
    """What the triton engine needs of a bundle when the server holds the model: class names."""

    labels = tuple(str(i) for i in range(1000))


def measure(engine, blobs: list[bytes], rounds: int) -> float:
    engine.classify(blobs[: min(len(blobs), 64)])  # warm-up: sessions, threads, connections
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        results = engine.classify(blobs)
        elapsed = time.perf_counter() - start
        bad = [r.error for r in results if r.status != "ok"]
        assert len(results) == len(blobs) and not bad, bad[:3]
        best = max(best, len(blobs) / elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=200, help="images per classify() call")
    parser.add_argument("--rounds", type=int, default=3, help="calls per row; the best is reported")
    parser.add_argument("--profile", default="portable", help="repository profile to build (portable, gpu)")
    parser.add_argument("--repository", default=None, help="serve this repository instead of building one")
    parser.add_argument("--client", default="8x2,32x2", help="request batch x concurrency pairs, comma separated")
    parser.add_argument("--baseline", default="onnx", choices=("onnx", "none"))
    parser.add_argument("--instances", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    photos = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))]
    blobs = [photos[i % len(photos)] for i in range(args.images)]
    rows = []
    if args.baseline == "onnx":
        from pipeline.engines.registry import make_engine
        from pipeline.model.folder import load_model

        bundle = load_model(None)
        onnx = make_engine("onnx", bundle, top_k=5)
        try:
            rows.append(("onnx", "-", measure(onnx, blobs, args.rounds)))
        finally:
            onnx.close()
    else:
        bundle = LabelsOnly()
    repository = args.repository
    if repository is None:
        from pipeline.triton.repository import build_repository

        repository = str(build_repository(args.profile, None, tempfile.mkdtemp(prefix="bench-repo-"),
                                          instances=args.instances))
    clients = [tuple(int(v) for v in pair.split("x")) for pair in args.client.split(",")]
    with TritonServer(repository, startup_timeout_s=300, extra_args=PYTHON_SHM_ARGS) as server:
        for request_batch, concurrency in clients:
            engine = TritonEngine(bundle, top_k=5, url=server.grpc_url, request_batch=request_batch,
                                  concurrency=concurrency)
            try:
                rows.append(("triton", f"{request_batch} x {concurrency}", measure(engine, blobs, args.rounds)))
            finally:
                engine.close()
    base = rows[0][2]
    print(f"\n{args.images} photos per call, best of {args.rounds}; profile {args.profile}; "
          f"ratio = img/s / first row's img/s")
    print("| engine | request batch x concurrency | img/s | ratio |")
    print("|---|---|---:|---:|")
    for engine, shape, rate in rows:
        print(f"| {engine} | {shape} | {rate:.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
