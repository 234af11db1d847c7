"""Benchmark: two models in one pass against two separate runs, same images, side by side in one run.

Usage:
    python tests/benchmarks/bench_model_set.py [--images 2000] [--cases default+small,default+default]
        [--batch-size 64] [--timeout-s 900] [--workdir DIR] [--size 500x375]

Images: JPEGs of --size (every fourth one portrait) cut from the committed photos by bench_vs_naive.make_images.

Each case is a pair of models:

* ``default+small``: the built-in EfficientNet-Lite0 and a user's small model (tests/support/odd_models.py: the mean
  colour through a Gemm), where decoding is nearly all of the second model's cost.
* ``default+default``: the built-in model twice under two names, a second network of realistic cost.

Per case: ``bulk-classify run SRC --output D --model a=A --model b=B`` (one pass: one decode per image), then
``--model A`` and ``--model B`` as two runs. Each run is its own subprocess with a fresh local Ray (a private
RAY_TMPDIR), its process tree sampled for CPU seconds (bench_streaming.run_measured). Printed: wall seconds of the
process (Ray's start included), job seconds (``elapsed_s`` of _REPORT.json), CPU seconds, each per image, and the
ratio two runs / one pass (issue 51's goal: >= 1.6x); the pair's rows are checked against each run's top-1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow.dataset as pads

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]  # the repository, tests/ (support), benchmarks

from bench_streaming import ray_env, run_measured  # noqa: E402
from bench_vs_naive import make_images  # noqa: E402

GOAL_RATIO = 1.6
CASES = {"default+small": ("default", "small"), "default+default": ("default", "default")}
NAMES = ("first", "second")


def model_ref(kind: str, workdir: Path) -> str:
    if kind == "default":
        return "default"
    from support.odd_models import model_folder

    return str(model_folder(workdir / "models" / kind))


def run(src: Path, dest: Path, models: list[str], args: argparse.Namespace, env: dict[str, str]) -> dict:
    """One measured ``bulk-classify run`` with these ``--model`` values; its times and rows."""
    shutil.rmtree(dest, ignore_errors=True)
    # this checkout's pipeline (run_measured runs in the repository root), not whichever one is installed
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(src), "--output", str(dest), "--quiet", "--batch-size", str(args.batch_size)]
    for model in models:
        cmd += ["--model", model]
    wall, sampler, tail = run_measured(cmd, env, 0.2, args.timeout_s, 2.0)
    report = dest / "_REPORT.json"
    if not report.exists():
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{tail}")
    rows = pads.dataset(str(dest), format="parquet").to_table().to_pylist()
    return {"wall": wall, "job": json.loads(report.read_text())["elapsed_s"], "cpu": sampler.cpu_total_s,
            "rows": {r["uri"]: r for r in rows}}


def bench_case(case: str, src: Path, n: int, args: argparse.Namespace, env: dict[str, str], workdir: Path) -> dict:
    refs = [model_ref(kind, workdir) for kind in CASES[case]]
    pair = run(src, workdir / "out-pair", [f"{name}={ref}" for name, ref in zip(NAMES, refs)], args, env)
    alone = [run(src, workdir / f"out-{name}", [ref], args, env) for name, ref in zip(NAMES, refs)]
    ok = [u for u, r in pair["rows"].items() if r["status"] == "ok"]
    assert len(pair["rows"]) == n == len(ok), f"{case}: {len(ok)} ok rows of {len(pair['rows'])}, {n} images"
    for name, single in zip(NAMES, alone):  # one pass answers as each model's own run does
        same = sum(pair["rows"][u][name]["labels"][0] == single["rows"][u]["labels"][0] for u in ok)
        assert same == n, f"{case}: model {name}'s top-1 equals its own run's on {same} of {n} images"
    sums = {k: sum(r[k] for r in alone) for k in ("wall", "job", "cpu")}
    return {"case": case, "pair": pair, "alone": alone, "sums": sums,
            "ratio": {k: sums[k] / pair[k] for k in ("wall", "job", "cpu")}}


def print_table(rows: list[dict], n: int, size: str) -> None:
    print(f"\n{n} images of {size}; per image: wall ms (process, Ray start included), job ms (_REPORT.json elapsed_s), "
          "CPU ms (the process tree)")
    print(f"{'case':<16} {'runs':<18} {'wall ms':>8} {'job ms':>8} {'CPU ms':>8}")
    for row in rows:
        sides = [("one pass", row["pair"]), (f"run {NAMES[0]}", row["alone"][0]), (f"run {NAMES[1]}", row["alone"][1]),
                 ("two runs", row["sums"])]
        for label, side in sides:
            print(f"{row['case']:<16} {label:<18} {1000 * side['wall'] / n:>8.1f} {1000 * side['job'] / n:>8.1f} "
                  f"{1000 * side['cpu'] / n:>8.1f}")
        r = row["ratio"]
        print(f"{row['case']:<16} {'two runs/one pass':<18} {r['wall']:>7.2f}x {r['job']:>7.2f}x {r['cpu']:>7.2f}x")
    print(f"goal: two runs / one pass >= {GOAL_RATIO}x (issue 51)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000, help="how many JPEGs (default 2000)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--batch-size", type=int, default=64, help="images per model call (default 64)")
    parser.add_argument("--timeout-s", type=float, default=900, help="stop a run that takes longer (default 900)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep images and outputs here (default: temp)")
    parser.add_argument("--size", default="500x375", help="WIDTHxHEIGHT of the JPEGs (default 500x375, ImageNet's; "
                        "1600x1200 is a catalog's)")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases {','.join(unknown)}: unknown; choose from {', '.join(CASES)}")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-model-set-"))
    ray_tmp = Path(tempfile.mkdtemp(prefix="bcs", dir="/tmp"))  # short: Ray's socket paths must fit 107 chars
    env = ray_env(ray_tmp)
    try:
        src = workdir / f"images-{args.size}"
        width, height = (int(v) for v in args.size.lower().split("x"))
        make_images(src, args.images, (width, height))
        rows = [bench_case(case, src, args.images, args, env, workdir) for case in cases]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows, args.images, args.size)


if __name__ == "__main__":
    main()
