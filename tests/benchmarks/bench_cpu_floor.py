"""Per-image CPU cost of the ONNX engine's parts on a folder of images: what bounds any CPU pipeline of this model.

Usage:
    python tests/benchmarks/bench_cpu_floor.py FOLDER [--images 192] [--batch 8]

Prints, for the first ``--images`` files of FOLDER (e.g. one made by bench_vs_naive.py --workdir DIR), in one run:
decode + preprocess with the reference (Pillow, one thread), ONNX Runtime on those tensors (one thread, and two),
their sum (the floor: no pipeline running this model and this preprocessing spends less CPU per image),
``OnnxEngine.classify`` in 64-image calls as the job's actor makes them, one at a time and then as many at once as a
job's actor runs (its ``calls_per_actor``, each ONNX Runtime on the threads the job would give it), as wall and CPU
milliseconds per image. The last row's rate is what one classify actor can do on this machine with no Ray around it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.config import RunConfig  # noqa: E402
from pipeline.engines.onnx import SPEC, OnnxEngine  # noqa: E402
from pipeline.job.stages import actor_engine_options, actor_plan  # noqa: E402
from pipeline.model.folder import load_model  # noqa: E402
from pipeline.model.imaging import DecodeLimits, load_and_preprocess  # noqa: E402

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _measure(fn, count: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per image of fn()."""
    wall, cpu = time.perf_counter(), _cpu()
    fn()
    return (time.perf_counter() - wall) / count * 1e3, (_cpu() - cpu) / count * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--images", type=int, default=192)
    parser.add_argument("--batch", type=int, default=8, help="ONNX Runtime batch (the engine's default is 8)")
    args = parser.parse_args()
    files = sorted(p for p in args.folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[: args.images]
    if not files:
        raise SystemExit(f"no images in {args.folder}; make some with bench_vs_naive.py --workdir DIR")
    blobs = [p.read_bytes() for p in files]
    n = len(blobs)
    bundle = load_model(None)
    rows = []
    arrays: list[np.ndarray] = []
    rows.append(("decode + preprocess, 1 thread",
                 *_measure(lambda: arrays.extend(load_and_preprocess(b, bundle.spec, DecodeLimits())[0] for b in blobs), n)))
    import onnxruntime as ort

    ort_cpu = {}
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(str(bundle.onnx_path), options, providers=["CPUExecutionProvider"])
        session.run(None, {bundle.input_name: np.stack(arrays[: args.batch])})

        def run_all(session=session):
            for i in range(0, n, args.batch):
                session.run(None, {bundle.input_name: np.stack(arrays[i : i + args.batch])})

        wall, cpu = _measure(run_all, n)
        ort_cpu[threads] = cpu
        rows.append((f"ONNX Runtime, {threads} thread(s), batch {args.batch}", wall, cpu))
    floor = rows[0][2] + ort_cpu[1]
    cores = os.cpu_count() or 1
    rows.append((f"floor = decode + model (at most {1e3 / floor * cores:.0f} img/s on {cores} CPUs)", floor / cores, floor))
    engine = OnnxEngine(bundle)
    engine.classify(blobs[:16])
    rows.append(("OnnxEngine.classify, 64-image calls",
                 *_measure(lambda: [engine.classify(blobs[i : i + 64]) for i in range(0, n, 64)], n)))
    engine.close()
    calls = SPEC.calls_per_actor
    config = RunConfig(source=str(args.folder), output="unused", engine=SPEC.name)
    actors, _cpus, _gpus = actor_plan(config, cores, 0)
    options = actor_engine_options(SPEC, config.engine_options, cores, actors, calls, on_gpu=False)  # what the job's actors are given
    threads = options[SPEC.call_threads_option]
    engine = OnnxEngine(bundle, **options)
    engine.classify(blobs[:16])
    chunks = [blobs[i : i + 64] for i in range(0, n, 64)]
    with ThreadPoolExecutor(calls) as pool:
        wall, cpu = _measure(lambda: list(pool.map(engine.classify, chunks)), n)
    rows.append((f"OnnxEngine, {calls} calls at once x {threads} ORT thread(s): {1e3 / wall:.0f} img/s", wall, cpu))
    engine.close()
    mean_kb = sum(map(len, blobs)) / n / 1e3
    print(f"{n} images from {args.folder} (mean {mean_kb:.0f} KB), {cores} CPUs")
    print(f"{'what':<62} {'wall ms/img':>11} {'CPU ms/img':>10} {'x floor':>7}")
    for name, wall, cpu in rows:
        print(f"{name:<62} {wall:>11.2f} {cpu:>10.2f} {cpu / floor:>7.2f}")


if __name__ == "__main__":
    main()
