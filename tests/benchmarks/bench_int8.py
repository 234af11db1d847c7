"""Benchmark: an INT8 model against its FP32 original through the onnx engine, side by side in one run.

Usage:
    python tests/benchmarks/bench_int8.py --int8 DIR [--int8 DIR ...] [--fp32 DIR] [--folder IMAGES] [--images 256]
        [--rounds 3]

``--int8`` is a folder written by ``bulk-classify model quantize`` (repeatable: each INT8 model gets its own columns,
named by its folder, so quantization choices compare in one run); ``--fp32`` the model they were made from
(default: the built-in EfficientNet-Lite0). Images: the first ``--images`` of ``--folder``, or that many 500x375
crops of tests/data/photos made as bench_vs_naive.py makes them.

Printed, rounds interleaved (FP32, INT8, FP32, ...), the median of each:
* inference alone: ``OnnxEngine``'s ONNX Runtime runs (its ``max_batch`` images a run) on tensors decoded once, with
  1 ORT thread, with one thread per core, and as ``--calls`` concurrent calls of 1 thread each (what an actor
  running that many calls does), in ms per image of wall time;
* the whole engine: ``OnnxEngine.classify`` of the encoded images in 64-image calls (decode on its pool), img/s;
* top-1 agreement of each INT8 model with FP32 on these images, and the INT8/FP32 ratios.
The machine's load average before and after is printed: other processes skew both sides alike only when the rounds
are interleaved, so compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from pipeline.engines.onnx import OnnxEngine  # noqa: E402
from pipeline.model.imaging import load_and_preprocess  # noqa: E402
from pipeline.model.folder import load_model  # noqa: E402

CALL_IMAGES = 64  # images per classify() call, the job's default --batch-size


def images_from(folder: Path | None, count: int) -> list[bytes]:
    """The encoded images: the first ``count`` files of ``folder``, or crops made like bench_vs_naive.py's."""
    if folder is None:
        from bench_vs_naive import make_images  # noqa: PLC0415

        folder = Path(tempfile.mkdtemp(prefix="bench-int8-"))
        make_images(folder, count)
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"))[:count]
    if not paths:
        raise SystemExit(f"no images in {folder}")
    return [p.read_bytes() for p in paths]


def time_runs(engine: OnnxEngine, tensors: np.ndarray, calls: int) -> float:
    """Wall ms per image of the engine's ORT runs over ``tensors``, ``calls`` runs at a time."""
    batches = [tensors[i:i + engine.max_batch] for i in range(0, len(tensors), engine.max_batch)]
    start = time.perf_counter()
    if calls == 1:
        for batch in batches:
            engine._run(batch)
    else:
        with ThreadPoolExecutor(calls) as pool:
            list(pool.map(engine._run, batches))
    return (time.perf_counter() - start) * 1000 / len(tensors)


def time_classify(engine: OnnxEngine, images: list[bytes]) -> float:
    """img/s of classify() over ``images`` in CALL_IMAGES-image calls."""
    start = time.perf_counter()
    for i in range(0, len(images), CALL_IMAGES):
        engine.classify(images[i:i + CALL_IMAGES])
    return len(images) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--int8", type=Path, action="append", required=True,
                        help="an INT8 model folder (repeatable)")
    parser.add_argument("--fp32", default=None, help="the FP32 model folder (default: built-in)")
    parser.add_argument("--folder", type=Path, default=None, help="images to use (default: made from the photos)")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2, help="concurrent 1-thread calls in the third row")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    images = images_from(args.folder, args.images)
    models = {"fp32": load_model(args.fp32)}
    for folder in args.int8:
        name = folder.resolve().name
        models[name if name not in models else str(folder)] = load_model(folder)
    tensors = np.stack([load_and_preprocess(b, models["fp32"].spec)[0] for b in images])
    print(f"{len(images)} images, {cores} CPUs, load average before {os.getloadavg()[0]:.1f}", flush=True)
    shapes = {"1 thread": (1, 1), f"{cores} threads": (cores, 1), f"{args.calls} calls x 1 thread": (1, args.calls)}
    engines = {(m, s): OnnxEngine(models[m], intra_op_threads=t, decode_threads=cores)
               for m in models for s, (t, _c) in shapes.items()}
    times: dict[tuple[str, str], list[float]] = {k: [] for k in engines}
    rates: dict[str, list[float]] = {m: [] for m in models}
    for key, engine in engines.items():  # warm-up: the first runs allocate
        time_runs(engine, tensors[:16], shapes[key[1]][1])
    for r in range(args.rounds):
        for shape, (_threads, calls) in shapes.items():
            for m in models:
                times[(m, shape)].append(time_runs(engines[(m, shape)], tensors, calls))
        for m in models:
            rates[m].append(time_classify(engines[(m, f"{args.calls} calls x 1 thread")], images))
        print(f"  round {r}: " + ", ".join(f"{m} {s} {times[(m, s)][-1]:.2f} ms" for s in shapes for m in models)
              + ", classify " + ", ".join(f"{m} {rates[m][-1]:.1f} img/s" for m in models), flush=True)
    top1 = {m: np.argmax(np.concatenate([engines[(m, "1 thread")]._run(tensors[i:i + 8])
                                         for i in range(0, len(tensors), 8)]), axis=1) for m in models}
    int8s = [m for m in models if m != "fp32"]
    print()
    print(f"{'inference, ms/image (median)':<34}{'FP32':>9}" + "".join(f"{m[:24]:>26}{'speed-up':>10}" for m in int8s))
    for shape in shapes:
        fp32 = statistics.median(times[("fp32", shape)])
        cells = [statistics.median(times[(m, shape)]) for m in int8s]
        print(f"{shape:<34}{fp32:>9.2f}" + "".join(f"{c:>26.2f}{fp32 / c:>9.2f}x" for c in cells))
    fp32 = statistics.median(rates["fp32"])
    cells = [statistics.median(rates[m]) for m in int8s]
    print(f"{'classify() img/s (decode + infer)':<34}{fp32:>9.1f}" + "".join(f"{c:>26.1f}{c / fp32:>9.2f}x"
                                                                           for c in cells))
    print("top-1 agreement with FP32 on these images: " + ", ".join(
        f"{m} {np.mean(top1['fp32'] == top1[m]):.1%}" for m in int8s)
        + f"; load average after {os.getloadavg()[0]:.1f}")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
