"""perf_analyzer against a local tritonserver serving the classifier: throughput and p99 per load level.

Starts a server on a repository (default: the portable profile of the default model, built into a temporary
folder; ``--repository DIR`` for another, e.g. a production or gpu one on the GPU machine; ``--url`` for a running
server), feeds it the photos as the engine does (encoded bytes zero-padded to one length + LENGTH), sweeps
concurrency for each batch size, and prints one table with ratios to the best point of the run. Each sweep's
CSV (perf_analyzer ``-f``) is kept for ``bulk-classify size --curve``. How to read the knee:
docs/gpu.md (sizing a fleet).

perf_analyzer itself: on PATH in NVIDIA's Triton SDK container; otherwise the binary inside the tritonclient
2.51 wheel (``pip download --no-deps tritonclient==2.51.0``, unzip, ``tritonclient-2.51.0.data/data/bin/
perf_analyzer``; the PyPI project "perf-analyzer" resolves only to a placeholder on this project's index).
Give it with ``--perf-analyzer PATH`` or ``$PERF_ANALYZER``. The libraries it links (libb64, libcudart) are taken
from the nvidia-pytriton wheel when the system lacks them.

    python tests/benchmarks/bench_perf_analyzer.py --batch-sizes 1,8,32 --concurrency 1,2,4,8
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.triton import contract as tn  # noqa: E402

PHOTOS = REPO / "tests" / "data" / "photos"
LOG = logging.getLogger("bench_perf_analyzer")


def find_perf_analyzer(explicit: str | None) -> Path:
    candidate = explicit or os.environ.get("PERF_ANALYZER") or shutil.which("perf_analyzer")
    if not candidate or not Path(candidate).is_file():
        sys.exit("perf_analyzer not found: pass --perf-analyzer PATH or set PERF_ANALYZER (see this script's "
                 "docstring for where to get the binary)")
    return Path(candidate)


def library_dir(workdir: Path) -> str:
    """A folder of the sonames perf_analyzer links, pointing at the nvidia-pytriton wheel's copies."""
    import pytriton

    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    out = workdir / "libs"
    out.mkdir(exist_ok=True)
    for pattern, soname in (("libb64-*.so.0d", "libb64.so.0d"), ("libcudart-*.so.12*", "libcudart.so.12")):
        found = sorted(libs.glob(pattern))
        if found and not (out / soname).exists():
            (out / soname).symlink_to(found[0])
    return str(out)


def input_data(images: list[bytes], path: Path) -> Path:
    """perf_analyzer's --input-data JSON: one entry per photo, all padded to one length (one shape per batch)."""
    longest = max(len(b) for b in images)
    entries = [
        {
            tn.INPUT_IMAGE: {"b64": base64.b64encode(b.ljust(longest, b"\0")).decode(), "shape": [longest]},
            tn.INPUT_LENGTH: {"content": [len(b)], "shape": [1]},
            tn.INPUT_TAG: {"content": [i], "shape": [1]},
        }
        for i, b in enumerate(images)
    ]
    path.write_text(json.dumps({"data": entries}))
    return path


def sweep(perf_analyzer: Path, url: str, batch: int, concurrency: list[int], data: Path, csv_path: Path,
          measurement_ms: int, env: dict) -> list[dict]:
    cmd = [
        str(perf_analyzer), "-m", tn.MODEL_NAME, "-u", url, "-i", "grpc", "-b", str(batch),
        "--concurrency-range", f"{min(concurrency)}:{max(concurrency)}:{_step(concurrency)}",
        "--input-data", str(data), "--percentile=99", "--measurement-interval", str(measurement_ms),
        "--stability-percentage", "100", "--max-trials", "8", "-f", str(csv_path),
    ]
    LOG.info("%s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"perf_analyzer failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [
        {"batch": batch, "concurrency": int(r["Concurrency"]), "img_per_s": float(r["Inferences/Second"]),
         "p99_ms": float(r["p99 latency"]) / 1000.0}
        for r in rows if int(r["Concurrency"]) in concurrency
    ]


def _step(values: list[int]) -> int:
    if len(values) < 2:
        return 1
    steps = {b - a for a, b in zip(values, values[1:])}
    return steps.pop() if len(steps) == 1 else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", help="model repository to serve (default: portable profile, built now)")
    parser.add_argument("--url", help="gRPC host:port of a running server instead of starting one")
    parser.add_argument("--perf-analyzer", help="perf_analyzer binary")
    parser.add_argument("--batch-sizes", default="1,8,32", help="images per request, comma separated")
    parser.add_argument("--concurrency", default="1,2,3,4", help="requests in flight, comma separated")
    parser.add_argument("--instances", type=int, default=1, help="model instances when building the repository")
    parser.add_argument("--measurement-ms", type=int, default=4000)
    parser.add_argument("--images", default=str(PHOTOS), help="folder of images to send")
    parser.add_argument("--keep-csv", default=None, help="folder to keep perf_analyzer's CSV per batch size")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    perf_analyzer = find_perf_analyzer(args.perf_analyzer)
    batches = [int(v) for v in args.batch_sizes.split(",")]
    concurrency = sorted(int(v) for v in args.concurrency.split(","))
    images = [p.read_bytes() for p in sorted(Path(args.images).iterdir()) if p.suffix.lower() in (".jpg", ".jpeg", ".png")]
    work = Path(tempfile.mkdtemp(prefix="bench-pa-"))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [library_dir(work), env.get("LD_LIBRARY_PATH")]))
    server = None
    try:
        url = args.url
        if url is None:
            from pipeline.triton.repository import build_repository
            from pipeline.triton.server import TritonServer

            repository = args.repository or str(build_repository(
                "portable", None, str(work / "repo"), instances=args.instances, max_batch_size=max(batches)))
            server = TritonServer(repository).start()
            url = server.grpc_url
        data = input_data(images, work / "input.json")
        points = []
        for batch in batches:
            csv_path = Path(args.keep_csv or work) / f"perf_analyzer_b{batch}.csv"
            csv_path.parent.mkdir(parents=True, exist_ok=True)
            points += sweep(perf_analyzer, url, batch, concurrency, data, csv_path, args.measurement_ms, env)
    finally:
        if server is not None:
            server.stop()
        if args.keep_csv is None:
            shutil.rmtree(work, ignore_errors=True)
    best = max(points, key=lambda p: p["img_per_s"])
    fastest = min(p["p99_ms"] for p in points)
    print(f"\nperf_analyzer on {tn.MODEL_NAME} ({len(images)} images, {os.cpu_count()} CPUs); "
          f"best {best['img_per_s']:.1f} img/s at batch {best['batch']} x concurrency {best['concurrency']}")
    print("| batch | concurrency | img/s | vs best | p99 ms | p99 vs lowest |")
    print("|---:|---:|---:|---:|---:|---:|")
    for p in sorted(points, key=lambda p: (p["batch"], p["concurrency"])):
        print(f"| {p['batch']} | {p['concurrency']} | {p['img_per_s']:.1f} | {p['img_per_s'] / best['img_per_s']:.2f} "
              f"| {p['p99_ms']:.1f} | {p['p99_ms'] / fastest:.2f} |")


if __name__ == "__main__":
    main()
