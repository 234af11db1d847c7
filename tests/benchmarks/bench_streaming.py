"""Benchmark: peak memory of the whole process tree (driver + Ray) classifying N vs 10N small images.

Usage:
    python tests/benchmarks/bench_streaming.py [--sizes 2000,20000] [--interval-s 0.2] [--workdir DIR]
        [-- extra 'bulk-classify run' options, e.g. --batch-size 32]

Each size runs as its own ``bulk-classify run SRC --output DEST --quiet`` subprocess, so each starts a fresh local
Ray (in a private RAY_TMPDIR, so it never joins another Ray on the machine). A thread samples the CLI process and
all its descendants (raylet, gcs_server, Ray Data workers, actors, ...) every ``--interval-s`` seconds from
/proc/PID/smaps_rollup and keeps the peak of each sum:

* PSS (the headline): every resident page counted once, split among the processes that map it. Ray's object
  store is shared memory (/dev/shm) that raylet maps whole and workers map while they read or write objects, so
  its resident pages count once, not once per mapper. Its part of the peak is shown as "shm".
* RSS: counts a shared page once per process that maps it (object store, shared libraries): an overcount.
* USS: private pages only, so shared memory (the object store) is left out: an undercount.

Images are 64x48 JPEGs generated deterministically (a gradient and seeded noise per index); every size is a
prefix of the largest set (hard links), spread over sub-folders of 1000. The run's rows are checked: N rows, all ok.
The goal (issue 3) is a PSS ratio of at most 1.2 between the largest and the smallest size.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
IMAGE_SIZE = (64, 48)
PER_FOLDER = 1000
GOAL_RATIO = 1.2
MIB = 1024 * 1024


def small_image(index: int) -> bytes:
    """A 64x48 JPEG that depends only on ``index``."""
    w, h = IMAGE_SIZE
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 4 + index) % 256, (y * 5 + 3 * index) % 256, ((x + y) * 2 + 7 * index) % 256], -1)
    noise = np.random.default_rng(index).integers(0, 32, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray((base + noise).clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def image_path(root: Path, index: int) -> Path:
    return root / f"d{index // PER_FOLDER:03d}" / f"img{index:06d}.jpg"


def make_images(root: Path, count: int) -> None:
    """Write images 0..count-1 under ``root`` (kept between runs of the same workdir)."""
    for i in range(count):
        path = image_path(root, i)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(small_image(i))


def make_photo_images(root: Path, count: int) -> None:
    """``--photos``: 500x375 crops of the committed photos (about 40 KB each, as bench_vs_naive makes them)."""
    from bench_vs_naive import make_images as make_crops

    flat = root.parent / "photo-crops"
    make_crops(flat, count)
    for i in range(count):
        path = image_path(root, i)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(flat / f"img{i:05d}.jpg", path)


def link_subset(pool: Path, dest: Path, count: int) -> None:
    """``dest`` holds the first ``count`` images of ``pool`` (hard links, copies where links fail)."""
    if dest.exists():
        shutil.rmtree(dest)
    for i in range(count):
        src, dst = image_path(pool, i), image_path(dest, i)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)


def rollup(pid: int) -> dict[str, int] | None:
    """Rss, Pss, Pss_Shmem and private (USS) bytes of one process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024
    if "Pss" not in fields:
        return None
    return {
        "rss": fields.get("Rss", 0),
        "pss": fields["Pss"],
        "shm": fields.get("Pss_Shmem", 0),
        "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
    }


@dataclass
class TreeSampler:
    """Samples the summed memory of a process and all its descendants in a thread; keeps the peaks."""

    root_pid: int
    interval_s: float = 0.2
    # Reading smaps_rollup costs ~3 ms of CPU per Ray process (~45 ms per sample of a job's tree, a quarter of a
    # core at 0.2 s); a benchmark that times CPU-bound work samples memory less often (None: every sample).
    memory_interval_s: float | None = None
    peak: dict[str, int] = field(default_factory=lambda: {"rss": 0, "pss": 0, "shm": 0, "uss": 0})
    peak_pss_shm: int = 0  # the shm part of the sample that had the peak PSS
    max_procs: int = 0
    samples: int = 0
    names: set[str] = field(default_factory=set)
    cpu_s: dict[int, float] = field(default_factory=dict)  # last user+sys seconds seen per process
    keep_history: bool = False  # also keep every sample's cpu_s with its unix time (CPU over a window: cpu_between)
    history: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    proc_peak: dict[int, tuple[str, int]] = field(default_factory=dict)  # pid -> (name, peak PSS)

    @property
    def cpu_total_s(self) -> float:
        """CPU seconds of the tree (each process as last sampled: up to one interval short per process)."""
        return sum(self.cpu_s.values())

    def __post_init__(self) -> None:
        self._next_memory = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        now = time.monotonic()
        with_memory = now >= self._next_memory
        if with_memory and self.memory_interval_s is not None:
            self._next_memory = now + self.memory_interval_s
        for proc in procs:
            try:
                times = proc.cpu_times()
                self.cpu_s[proc.pid] = times.user + times.system
            except psutil.Error:
                pass
        if self.keep_history:
            self.history.append((time.time(), dict(self.cpu_s)))
        if with_memory:
            self._sample_memory(procs)

    def cpu_between(self, start: float, end: float) -> tuple[float, dict[int, float]]:
        """(seconds, CPU seconds per pid) between the first and last samples inside [start, end] (unix times);
        needs ``keep_history``; (0, {}) when fewer than two samples fall inside."""
        inside = [h for h in self.history if start <= h[0] <= end]
        if len(inside) < 2:
            return 0.0, {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        return t1 - t0, {pid: cpu - first.get(pid, 0.0) for pid, cpu in last.items()}

    def _sample_memory(self, procs: list[psutil.Process]) -> None:
        total = {"rss": 0, "pss": 0, "shm": 0, "uss": 0}
        alive = 0
        for proc in procs:
            mem = rollup(proc.pid)
            if mem is None:
                continue
            alive += 1
            for key in total:
                total[key] += mem[key]
            try:
                name = _label(proc, self.root_pid)
            except psutil.Error:
                continue
            self.names.add(name)
            if mem["pss"] > self.proc_peak.get(proc.pid, ("", 0))[1]:
                self.proc_peak[proc.pid] = (name, mem["pss"])
        if not alive:
            return
        self.samples += 1
        self.max_procs = max(self.max_procs, alive)
        if total["pss"] > self.peak["pss"]:
            self.peak_pss_shm = total["shm"]
        for key in total:
            self.peak[key] = max(self.peak[key], total[key])

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)


def _label(proc: psutil.Process, root_pid: int) -> str:
    """A short role name: Ray workers show their task or actor in the title (ray::MapWorker(...))."""
    if proc.pid == root_pid:
        return "driver (bulk-classify)"
    cmdline = proc.cmdline()
    title = cmdline[0] if cmdline else proc.name()
    if title.startswith("ray::"):
        return title.split(".")[0][:48]
    for part in cmdline[:3]:
        if part.endswith(".py"):
            return Path(part).name
    return proc.name()


def cpu_by_role(sampler: TreeSampler, seconds_by_pid: dict[int, float] | None = None
                ) -> tuple[collections.Counter, collections.Counter]:
    """(CPU seconds, processes) summed by role, each process named as it was at its peak memory; ``seconds_by_pid``
    defaults to the whole run's (``sampler.cpu_s``)."""
    seconds: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for pid, cpu in (sampler.cpu_s if seconds_by_pid is None else seconds_by_pid).items():
        role = sampler.proc_peak.get(pid, ("?", 0))[0]
        seconds[role] += cpu
        count[role] += 1
    return seconds, count


def print_cpu_by_role(sampler: TreeSampler, heading: str) -> None:
    """``heading``, then a line per role of ``cpu_by_role``: CPU seconds, processes, role; the most CPU first."""
    seconds, count = cpu_by_role(sampler)
    print(heading)
    for role, cpu in seconds.most_common():
        print(f"  {cpu:7.2f} s  {count[role]:>2} x {role}")


def role_peaks(sampler: TreeSampler) -> dict[str, tuple[int, int]]:
    """(processes, peak PSS summed) per role name; each process at its own peak, so sums exceed the tree's peak."""
    out: dict[str, tuple[int, int]] = {}
    for name, pss in sampler.proc_peak.values():
        role = "ray::IDLE/worker" if name in ("ray::IDLE", "default_worker.py") else name
        count, total = out.get(role, (0, 0))
        out[role] = (count + 1, total + pss)
    return out


def cli_path() -> str:
    local = Path(sys.executable).parent / "bulk-classify"
    found = str(local) if local.exists() else shutil.which("bulk-classify")
    if not found:
        raise SystemExit("bulk-classify is not installed in this environment; run pip install -e . first")
    return found


def ray_env(ray_tmp: Path) -> dict[str, str]:
    """The environment of a benchmark subprocess: a private Ray temp dir, no RAY_ADDRESS to join."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_TMPDIR"] = str(ray_tmp)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def stop_tree(pid: int) -> None:
    """SIGINT the benchmark's own subprocess (Ray shuts down), then kill what is left of its tree."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    root.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(procs, timeout=15)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def run_measured(cmd: list[str], env: dict[str, str], interval_s: float,
                 timeout_s: float | None = None, memory_interval_s: float | None = None,
                 ) -> tuple[float, TreeSampler, str]:
    """Run ``cmd`` to completion while sampling its process tree; (wall seconds, sampler, output tail).

    A run past ``timeout_s`` (or an interrupted benchmark) stops the subprocess and everything it started.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with TreeSampler(proc.pid, interval_s, memory_interval_s) as sampler:
            out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid)
        out, _ = proc.communicate()
        raise SystemExit(f"{' '.join(cmd)} ran past {timeout_s:.0f}s and was stopped:\n{out[-4000:]}") from None
    except BaseException:
        stop_tree(proc.pid)
        raise
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {proc.returncode}:\n{out[-4000:]}")
    return wall, sampler, out


def check_output(dest: Path, count: int) -> dict:
    """The run wrote ``count`` rows, all ok; returns its _REPORT.json."""
    import pyarrow.dataset as pads

    table = pads.dataset(str(dest), format="parquet").to_table(columns=["status"])
    statuses = table.column("status").to_pylist()
    if len(statuses) != count or statuses.count("ok") != count:
        raise SystemExit(f"{dest}: expected {count} ok rows, got {len(statuses)} rows, {statuses.count('ok')} ok")
    return json.loads((dest / "_REPORT.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000,20000", help="comma-separated image counts (default 2000,20000)")
    parser.add_argument("--interval-s", type=float, default=0.2, help="sampling period (default 0.2 s)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep images and outputs here (default: temp)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="stop a run that takes longer (default 1800)")
    parser.add_argument("--photos", action="store_true",
                        help="500x375 crops of tests/data/photos (about 40 KB each) instead of 64x48 JPEGs")
    parser.add_argument("extra", nargs="*", help="options passed to 'bulk-classify run' (after --)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise SystemExit("--sizes must be positive integers, e.g. 2000,20000")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="bcb", dir="/tmp"))  # short: Ray's socket paths must fit 107 chars
    pool = workdir / "pool"
    t0 = time.perf_counter()
    (make_photo_images if args.photos else make_images)(pool, max(sizes))
    shape = "500x375 photo crops" if args.photos else f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}"
    print(f"{max(sizes)} images of {shape} in {pool} ({time.perf_counter() - t0:.1f}s); "
          f"{os.cpu_count()} CPUs; sampling every {args.interval_s}s", flush=True)

    rows = []
    try:
        for n in sizes:
            src, dest = workdir / f"src-{n}", workdir / f"out-{n}"
            link_subset(pool, src, n)
            shutil.rmtree(dest, ignore_errors=True)
            cmd = [cli_path(), "run", str(src), "--output", str(dest), "--quiet", *args.extra]
            wall, sampler, _ = run_measured(cmd, ray_env(ray_tmp), args.interval_s, args.timeout_s)
            report = check_output(dest, n)
            rows.append((n, wall, report.get("elapsed_s") or wall, sampler))
            print(f"  {n} images: {wall:.1f}s, peak PSS {sampler.peak['pss'] / MIB:.0f} MiB "
                  f"({sampler.samples} samples, up to {sampler.max_procs} processes)", flush=True)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    base = rows[0][3].peak["pss"]
    print()
    print("Peak memory of the process tree (CLI driver + all descendants: raylet, gcs, workers, actors)")
    print(f"{'images':>7} {'wall s':>7} {'job s':>7} {'img/s':>7} {'CPU s':>7} {'PSS MiB':>8} {'shm MiB':>8} "
          f"{'RSS MiB':>8} {'USS MiB':>8} {'procs':>5} {'PSS ratio':>9}")
    for n, wall, job_s, s in rows:
        print(f"{n:>7} {wall:>7.1f} {job_s:>7.1f} {n / wall:>7.1f} {s.cpu_total_s:>7.0f} {s.peak['pss'] / MIB:>8.0f} "
              f"{s.peak_pss_shm / MIB:>8.0f} {s.peak['rss'] / MIB:>8.0f} {s.peak['uss'] / MIB:>8.0f} "
              f"{s.max_procs:>5} {s.peak['pss'] / base:>9.2f}")
    print("wall s: the CLI subprocess, Ray start and stop included; job s: elapsed_s of _REPORT.json; "
          "img/s = images / wall s; "
          "CPU s: user+sys seconds of the whole tree.")
    print("PSS: summed proportional set size, shared pages (incl. Ray's /dev/shm object store) counted once; "
          "shm: the object-store (shared memory) part of the peak PSS sample; RSS overcounts shared pages, "
          "USS leaves them out.")
    roles = [role_peaks(r[3]) for r in rows]
    names = sorted(set().union(*roles), key=lambda k: -roles[-1].get(k, (0, 0))[1])
    print()
    print("Peak PSS MiB by process role (each process at its own peak; in brackets: how many processes), per size")
    print(f"{'role':>48} " + " ".join(f"{n:>11}" for n, *_ in rows))
    for name in names[:10]:
        cells = [r.get(name, (0, 0)) for r in roles]
        print(f"{name:>48} " + " ".join(f"{total / MIB:>6.0f} ({count:>2})" for count, total in cells))
    ratio = rows[-1][3].peak["pss"] / base
    verdict = "meets" if ratio <= GOAL_RATIO else "MISSES"
    print(f"growth {rows[0][0]} -> {rows[-1][0]} images: {ratio:.2f}x peak PSS ({verdict} the <= {GOAL_RATIO}x goal)")


if __name__ == "__main__":
    main()
