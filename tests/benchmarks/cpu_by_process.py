"""Runs a command and prints the CPU seconds each process of its tree used (Ray workers by their actor/task name).

Usage:
    python tests/benchmarks/cpu_by_process.py bulk-classify run SRC --output DEST --quiet

Where a job's CPU goes besides the engine: Ray's driver, raylet, GCS and agents, and one worker process per task
pool or support actor. Samples the tree with bench_streaming's TreeSampler every 0.5 s (a process that lives less
than that is missed; memory, which names the processes, every 2 s: reading it costs CPU). A worker is named as it
was at its peak memory, so a task worker (e.g. fetch_batch) may show as ray::IDLE.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_streaming import print_cpu_by_role, run_measured  # noqa: E402


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    wall, sampler, _ = run_measured(sys.argv[1:], dict(os.environ), interval_s=0.5, memory_interval_s=2.0)
    print_cpu_by_role(sampler, f"wall {wall:.1f} s; CPU {sampler.cpu_total_s:.1f} s over {len(sampler.cpu_s)} "
                               "processes")


if __name__ == "__main__":
    main()
