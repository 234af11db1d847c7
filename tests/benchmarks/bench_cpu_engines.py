"""Benchmark: the CPU engines (onnx, openvino) side by side on the same models and images, shaped as a job's actor.

Usage:
    python tests/benchmarks/bench_cpu_engines.py [--int8 DIR ...] [--folder IMAGES] [--images 256] [--rounds 3]
        [--engine onnx --engine openvino]

Each engine is built with the options a job's classify actor on this machine gets (``actor_engine_options``: its
calls at once, each call's threads), for the built-in FP32 model and each ``--int8`` folder (``bulk-classify model
quantize``). Images: the first ``--images`` of ``--folder``, or 500x375 crops of tests/data/photos. Rounds are
interleaved (every engine and model once per round); printed, medians:

* network, ms/image: the engine's runs on tensors decoded once, as many at once as the actor runs calls;
* engine, img/s: ``classify`` of the encoded images in 64-image calls, as many at once (decode on its pool): the
  ceiling of a job's rate past start-up on this machine;
* each against the onnx engine on the same model, and top-1 agreement with onnx on the FP32 model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from bench_int8 import CALL_IMAGES, images_from, time_runs  # noqa: E402
from pipeline.config import RunConfig  # noqa: E402
from pipeline.engines.registry import engine_spec, make_engine  # noqa: E402
from pipeline.model.imaging import load_and_preprocess  # noqa: E402
from pipeline.job.stages import actor_engine_options, actor_plan  # noqa: E402
from pipeline.model.folder import load_model  # noqa: E402

REFERENCE = "onnx"


def engine_rate(engine, images: list[bytes], calls: int) -> float:
    """img/s of classify() over ``images`` in CALL_IMAGES-image calls, ``calls`` at a time."""
    chunks = [images[i:i + CALL_IMAGES] for i in range(0, len(images), CALL_IMAGES)]
    start = time.perf_counter()
    with ThreadPoolExecutor(calls) as pool:
        list(pool.map(engine.classify, chunks))
    return len(images) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--int8", type=Path, action="append", default=[], help="an INT8 model folder (repeatable)")
    parser.add_argument("--engine", action="append", default=None, help="a CPU engine (repeatable; default: onnx "
                        "and openvino)")
    parser.add_argument("--folder", type=Path, default=None, help="images to use (default: made from the photos)")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    names = args.engine or [REFERENCE, "openvino"]
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    for name in names:
        engine_spec(name).check({})  # a missing runtime fails here, in one line
    cores = os.cpu_count() or 1
    images = images_from(args.folder, args.images)
    models = {"fp32": load_model(None)}
    for folder in args.int8:
        models[folder.resolve().name if folder.resolve().name not in models else str(folder)] = load_model(folder)
    tensors = np.stack([load_and_preprocess(b, models["fp32"].spec)[0] for b in images])
    engines, calls = {}, {}
    for name in names:
        config = RunConfig(source="images", output="unused", engine=name)
        actors, _cpus, _gpus = actor_plan(config, cores, 0)
        calls[name] = config.calls_per_actor or engine_spec(name).calls_per_actor
        options = actor_engine_options(engine_spec(config.engine), config.engine_options, cores, actors, calls[name], on_gpu=False)
        for m, bundle in models.items():
            engines[(name, m)] = make_engine(name, bundle, **options)
        print(f"{name}: {actors} actor(s) on {cores} CPUs, {calls[name]} calls at once, options {options}", flush=True)
    print(f"{len(images)} images, load average before {os.getloadavg()[0]:.1f}", flush=True)
    for key, engine in engines.items():  # warm-up: the first runs allocate
        time_runs(engine, tensors[:16], calls[key[0]])
        engine.classify(images[:8])
    nets: dict[tuple[str, str], list[float]] = {k: [] for k in engines}
    rates: dict[tuple[str, str], list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        for key, engine in engines.items():
            nets[key].append(time_runs(engine, tensors, calls[key[0]]))
        for key, engine in engines.items():
            rates[key].append(engine_rate(engine, images, calls[key[0]]))
        print(f"  round {r}: " + ", ".join(f"{n}/{m} {nets[(n, m)][-1]:.2f} ms {rates[(n, m)][-1]:.0f} img/s"
                                          for n, m in engines), flush=True)
    ref_engine = engines[(REFERENCE, "fp32")]
    reference = np.argmax(np.concatenate([ref_engine._run(ref_engine.models[0], tensors[i:i + 8])
                                          for i in range(0, len(tensors), 8)]), axis=1)
    print()
    print(f"{'engine':<10}{'model':<26}{'network ms/img':>15}{'vs onnx':>9}{'engine img/s':>14}{'vs onnx':>9}"
          f"{'top-1 = onnx FP32':>19}")
    for (name, m), engine in engines.items():
        net, rate = statistics.median(nets[(name, m)]), statistics.median(rates[(name, m)])
        ref_net, ref_rate = statistics.median(nets[(REFERENCE, m)]), statistics.median(rates[(REFERENCE, m)])
        top1 = np.argmax(np.concatenate([engine._run(engine.models[0], tensors[i:i + 8])
                                         for i in range(0, len(tensors), 8)]), axis=1)
        print(f"{name:<10}{m[:25]:<26}{net:>15.2f}{ref_net / net:>8.2f}x{rate:>14.1f}{rate / ref_rate:>8.2f}x"
              f"{np.mean(top1 == reference):>18.1%}")
    print(f"load average after {os.getloadavg()[0]:.1f}")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
