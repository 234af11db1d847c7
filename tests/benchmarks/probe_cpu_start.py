"""Where a CPU run's fixed start goes: the driver's steps, then Ray's own timeline of the workers, in seconds from
the command's start.

    python tests/benchmarks/probe_cpu_start.py SRC OUT [RUN OPTIONS ...]     (OUT is replaced)

Runs ``bulk-classify run SRC --output OUT --quiet [RUN OPTIONS]`` in this process with the run's steps wrapped
(source and output checks, model load, Ray's start with its imports, the pipeline until its last row, the report,
Ray's stop), and before the run closes writes ``ray.timeline()``: every worker's constructor (``__init__``, with the
time spent importing and deserializing its class) and every task and actor call over 20 ms, and last the CPU seconds
of each process of the run (this one and Ray's, by role; sampled every PROCESS_SAMPLE_S until Ray stops). A small SRC
(16 images) shows the start alone. Writing the timeline takes about a second, between the pipeline's end and the
report.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

T0 = time.perf_counter()
EPOCH0 = time.time()
STEPS: list[tuple[float, float, str]] = []
PROCESS_SAMPLE_S = 0.25  # each sample reads every process's smaps_rollup (~3 ms a process) for its role name


def timed(owner: object, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            STEPS.append((start - T0, time.perf_counter() - T0, label))

    setattr(owner, name, wrapper)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    src, out, *options = sys.argv[1:]
    shutil.rmtree(out, ignore_errors=True)
    from pipeline.node import local_ray_env

    local_ray_env()  # before Ray is imported, as the CLI does
    import ray

    import pipeline.job.run as run
    import pipeline.job.stages as stages
    import pipeline.model.folder as model
    import pipeline.io.source as source
    from pipeline.cli import main as cli

    trace = Path(tempfile.mkdtemp(prefix="probe-start-")) / "timeline.json"
    for owner, name, label in ((source, "check_source", "check the source"), (model, "load_model", "load the model"),
                               (run, "index_output", "read the output's index"),
                               (stages, "init_ray", "start Ray (its imports included)"),
                               (run._Run, "_drain", "the pipeline, to its last row"),
                               (run, "_finish", "report"), (ray, "shutdown", "stop Ray")):
        timed(owner, name, label)
    close = run._Run.close

    def close_after_timeline(self):
        ray.timeline(str(trace))
        return close(self)

    run._Run.close = close_after_timeline
    sys.argv = ["bulk-classify", "run", src, "--output", out, "--quiet", *options]
    from bench_streaming import TreeSampler, print_cpu_by_role

    sampler = TreeSampler(os.getpid(), interval_s=PROCESS_SAMPLE_S)
    shutdown = ray.shutdown

    def sample_then_shutdown(*args, **kwargs):
        sampler.sample()  # Ray's processes as they end the run
        return shutdown(*args, **kwargs)

    ray.shutdown = sample_then_shutdown
    try:
        with sampler:
            cli(standalone_mode=False)
    finally:
        print("driver (s from the command's start):")
        for start, end, label in sorted(STEPS):
            print(f"  {start:6.2f} - {end:6.2f}  {end - start:5.2f} s  {label}")
        if trace.is_file():
            print("Ray's timeline (s from the command's start; constructors, and calls over 20 ms):")
            events = [e for e in json.loads(trace.read_text()) if e.get("ph") == "X"]
            for e in sorted(events, key=lambda e: e["ts"]):
                name = str(e.get("name", ""))
                if name.startswith("task:") or (e["dur"] < 20_000 and name != "__init__"):
                    continue
                print(f"  {e['ts'] / 1e6 - EPOCH0:6.2f} +{e['dur'] / 1e6:5.2f} s  {name[:70]}  "
                      f"({str(e.get('tid', ''))[:18]})")
        shutil.rmtree(trace.parent, ignore_errors=True)
        print_cpu_by_role(sampler, f"CPU seconds by process ({sampler.cpu_total_s:.1f} s in {len(sampler.cpu_s)} "
                                   "processes, by role: the name each had at its peak memory):")


if __name__ == "__main__":
    main()
