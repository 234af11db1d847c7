"""What Ray Data alone costs to start on this machine: the floor under any Ray Data job's fixed start.

    python tests/benchmarks/probe_ray_floor.py [--runs 3]

Each run is a fresh process, timed from before ``import ray`` as the job's ``elapsed_s`` and the naive pipeline of
bench_vs_naive.py are: a local Ray started as the job starts one (the loopback environment of
``pipeline.job.local_ray``, no dashboard), then one of three pipelines over ``range(16)`` iterated by the driver:
``none`` (the read alone), ``task`` (one map_batches task) and ``actor`` (one map_batches actor that does nothing, as
the job's classify stage is one). Prints each run and the medians; a job whose 16-image start is near the ``actor``
figure spends its start in Ray, not in its own work.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = ("none", "task", "actor")


def one_run(mode: str) -> tuple[float, float]:
    """(seconds to Ray's start, seconds to the last row) of one pipeline, in this process."""
    start = time.perf_counter()
    sys.path.insert(0, str(REPO))
    from pipeline.node import local_ray_env

    local_ray_env()
    import logging

    import ray

    ray.init(include_dashboard=False, logging_level=logging.ERROR)
    started = time.perf_counter()
    from ray.data import ActorPoolStrategy, DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars, ctx.print_on_execution_start = False, False

    class Nothing:
        def __call__(self, batch):
            return batch

    ds = ray.data.range(16)
    if mode == "task":
        ds = ds.map_batches(lambda batch: batch, batch_size=16)
    elif mode == "actor":
        ds = ds.map_batches(Nothing, compute=ActorPoolStrategy(size=1), batch_size=16)
    rows = sum(len(b["id"]) for b in ds.iter_batches(batch_size=None))
    assert rows == 16, rows
    done = time.perf_counter()
    ray.shutdown()
    return started - start, done - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a single run, in a subprocess
    args = parser.parse_args()
    if args.one:
        ray_s, total_s = one_run(args.one)
        print(f"{ray_s:.3f} {total_s:.3f}")
        return
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for r in range(args.runs):
        for mode in MODES:  # interleaved, each a fresh process
            out = subprocess.run([sys.executable, __file__, "--one", mode], capture_output=True, text=True,
                                 check=True, timeout=300).stdout.split()
            results[mode].append((float(out[-2]), float(out[-1])))
            ray_s, total_s = results[mode][-1]
            print(f"  run {r} {mode:<6} Ray started {ray_s:5.2f} s, last row {total_s:5.2f} s", flush=True)
    print(f"\n{'pipeline':<8} {'Ray started s':>14} {'last row s':>11}  (medians of {args.runs})")
    for mode in MODES:
        print(f"{mode:<8} {statistics.median(r[0] for r in results[mode]):14.2f} "
              f"{statistics.median(r[1] for r in results[mode]):11.2f}")


if __name__ == "__main__":
    main()
