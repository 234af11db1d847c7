"""Runs a command and prints the CPU seconds each process of its tree used (Ray workers by their actor/task name).

Usage:
    python tests/benchmarks/cpu_by_process.py bulk-classify run SRC --output DEST --quiet

Where a job's CPU goes besides the engine: Ray's driver, raylet, GCS and agents, and one worker process per task
pool or support actor. Samples the tree every 0.5 s with psutil (a process that lives less than that is missed).
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time

import psutil

SYSTEM = ("gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py")


def _kind(proc: psutil.Process) -> str:
    try:
        name, cmdline = proc.name(), " ".join(proc.cmdline())[:300]
    except psutil.Error:
        return "?"
    for key in SYSTEM:
        if key in cmdline:
            return key
    if name.startswith("ray::"):
        return name.split(".", 1)[0]  # ray::MapWorker(MapBatches(ClassifyActor)), ray::IDLE, ...
    return "worker" if "default_worker" in cmdline else f"command ({name})"


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    start = time.perf_counter()
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = psutil.Process(proc.pid)
    seen: dict[int, tuple[str, float]] = {}
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                times = p.cpu_times()
            except psutil.Error:
                continue
            kind = _kind(p)
            if kind in ("?", "worker", "ray::IDLE") and p.pid in seen:
                kind = seen[p.pid][0] if seen[p.pid][0] not in ("?", "worker") else kind
            seen[p.pid] = (kind, times.user + times.system)
        time.sleep(0.5)
    wall = time.perf_counter() - start
    by_kind: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for kind, cpu in seen.values():
        by_kind[kind] += cpu
        count[kind] += 1
    print(f"exit {proc.returncode}; wall {wall:.1f} s; CPU {sum(by_kind.values()):.1f} s over {len(seen)} processes")
    for kind, cpu in by_kind.most_common():
        print(f"  {cpu:7.1f} s  {count[kind]:>2} × {kind}")


if __name__ == "__main__":
    main()
