"""The whole job as a user types it: ``bulk-classify run IMAGES --output OUT [ARGS]``, one table of variants.

Run on a GPU node (the device kit: tests/benchmarks/device/README.md)::

    python tests/benchmarks/bench_job.py --images 100000 --work /tmp/job \\
        --variant default= --variant inproc='--engine gpu --batch-size 2048'

Each variant is ``NAME=ARGS``: the CLI (``python -m pipeline.cli -v run IMAGES --output OUT ARGS``) runs as a
subprocess on a fresh output, and the table gives, from the rows and the shard files it wrote:

- steady img/s: rows whose actor call started (``classified_at``) between those of the rows at 15 % and 90 %;
- start: the command's start to the first committed shard; tail: the last committed shard to the command's exit;
- wall, every row exactly once, GPU busy over the steady window (``nvidia-smi`` every 0.25 s);
- the machine's CPU busy % over the steady window, and the GPU's JPEG-engine use where ``nvidia-smi`` has it;
- tritonserver processes (the most at once, and all seen), and the log lines that report a server failover;
- CPU seconds by process over the whole run (``bench_streaming.TreeSampler``), and each process's share of one core
  over the steady window.

``--gpu-repo NAME:KEY=VALUE,...`` builds a gpu-profile repository with those ``gpu_config`` options (e.g.
``none:network=none`` for the Triton hop without decode or network, ``t2:dali_threads=2``; ``model=DIR`` and
``more=DIR+DIR`` serve a user's model and a model set's other models, ``default`` the built-in one) into
WORK/repos/NAME, and ``@NAME`` in a variant's ARGS stands for ``--engine-option repository=WORK/repos/NAME``.

``--profile NAME`` runs variant NAME once more after the table with py-spy (``--native``, on PATH) attached to every
Triton python-backend stub as it appears, and prints where the stubs' busy samples go outside their start
(``initialize``): by function (self samples) and by the pipeline function they run under. A profiled run is slower,
so it gives no row of the table.

The images are ImageNet-like JPEGs (500x375, ~100 KB) from ``bench_scaleout.make_images``, hard-linked.
``--dry-run-cpu`` checks the script end to end on a machine without a GPU (a few hundred images).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

LOG = logging.getLogger("bench_job")
FAILOVER_MARKERS = ("stopped answering", "tritonserver restarted")


class ServerCounter:
    """Samples the tritonserver processes of this machine every ``period_s``: the most at once and every pid."""

    def __init__(self, period_s: float = 0.25):
        self.period_s, self.most, self.pids = period_s, 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            now = {p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "") == "tritonserver"}
            self.most = max(self.most, len(now))
            self.pids |= now
            self._stop.wait(self.period_s)

    def __enter__(self) -> "ServerCounter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


class MachineSampler:
    """The machine's CPU (``/proc/stat``) every ``period_s``, and the GPU's JPEG engines and video decoders through
    ``nvidia-smi`` where its query has them: what the GPU-busy figure does not show."""

    JPEG_FIELDS = ("utilization.jpeg", "utilization.decoder")

    def __init__(self, folder: Path, period_s: float = 0.25):
        self.period_s, self.cpu = period_s, []  # (unix time, busy jiffies, all jiffies)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.fields = self._smi_fields()
        self.smi_path = folder / "nvidia_smi_engines.csv"
        self._smi = None
        if self.fields:
            self._file = open(self.smi_path, "w")  # noqa: SIM115 - closed in stop()
            self._smi = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu=timestamp,{','.join(self.fields)}", "--format=csv,noheader,nounits",
                 f"-lms={int(period_s * 1000)}"], stdout=self._file, stderr=subprocess.DEVNULL)
        self._thread.start()

    def _smi_fields(self) -> list[str]:
        if shutil.which("nvidia-smi") is None:
            return []
        helptext = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True).stdout
        return [f for f in self.JPEG_FIELDS if f'"{f}"' in helptext]

    def _loop(self) -> None:
        while not self._stop.is_set():
            with open("/proc/stat") as f:
                parts = [int(v) for v in f.readline().split()[1:]]
            idle = parts[3] + parts[4]  # idle + iowait
            self.cpu.append((time.time(), sum(parts) - idle, sum(parts)))
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait(10)
            self._file.close()

    def summary(self, start: float, end: float) -> dict:
        """CPU busy % of all cores over [start, end], and each engine field's mean % there."""
        inside = [s for s in self.cpu if start <= s[0] <= end]
        out: dict = {"cpus": os.cpu_count()}
        if len(inside) >= 2:
            (_, b0, t0), (_, b1, t1) = inside[0], inside[-1]
            out["cpu_busy_pct"] = round(100 * (b1 - b0) / max(t1 - t0, 1), 1)
        if self.fields and self.smi_path.is_file():
            from bench_scaleout import smi_time

            values: dict[str, list[float]] = {f: [] for f in self.fields}
            for line in self.smi_path.read_text().splitlines():
                parts = [p.strip() for p in line.split(",")]
                try:
                    when = smi_time(parts[0])
                except ValueError:
                    continue
                if start <= when <= end:
                    for f, v in zip(self.fields, parts[1:]):
                        with contextlib.suppress(ValueError):
                            values[f].append(float(v))
            out.update({f: round(sum(v) / len(v), 1) for f, v in values.items() if v})
        return out


def run_timed(cmd: list[str], env: dict[str, str], timeout_s: float):
    """Runs ``cmd`` while sampling its process tree; (wall s, sampler, output with each line's arrival time)."""
    from bench_streaming import TreeSampler, stop_tree

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(f"{time.perf_counter() - start:8.2f} {line.rstrip()}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with TreeSampler(proc.pid, 0.5, 5.0, keep_history=True) as sampler:
            proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid)
        raise SystemExit(f"{' '.join(cmd)} ran past {timeout_s:.0f} s:\n" + "\n".join(lines[-60:])) from None
    except BaseException:
        stop_tree(proc.pid)
        raise
    finally:
        reader.join(10)
    wall = time.perf_counter() - start
    log = "\n".join(lines)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {proc.returncode}:\n{log[-4000:]}")
    return wall, sampler, log


def run_variant(name: str, args_text: str, images: Path, root: Path, opts, sampler, machine=None) -> dict:
    import pyarrow.dataset as pads

    from bench_scaleout import gpu_summary, steady_rate
    from bench_streaming import cpu_by_role

    out = root / f"out-{name}"
    shutil.rmtree(out, ignore_errors=True)
    args = [f"--engine-option=repository={root / 'repos' / a[1:]}" if a.startswith("@") else a
            for a in shlex.split(args_text)]
    cmd = [sys.executable, "-m", "pipeline.cli", "-v", "run", str(images), "--output", str(out), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    LOG.warning("variant %s: %s", name, " ".join(cmd))
    t0 = time.time()
    with ServerCounter() as servers:
        wall, tree, log = run_timed(cmd, env, opts.timeout_s)
    t_end = t0 + wall
    (opts.out / f"log-{name}.txt").write_text(log)
    table = pads.dataset(str(out), format="parquet").to_table(columns=["uri", "classified_at", "status", "error"])
    uris = table.column("uri").to_pylist()
    starts = [t.timestamp() for t in table.column("classified_at").to_pylist() if t is not None]
    rate, lo, hi = steady_rate(starts)
    commits = sorted(p.stat().st_mtime for p in out.rglob("part-*.parquet"))
    report = json.loads((out / "_REPORT.json").read_text()) if (out / "_REPORT.json").is_file() else {}
    cpu = cpu_by_role(tree)[0]
    span, steady_cpu = tree.cpu_between(lo, hi) if rate else (0.0, {})
    steady_by_role = cpu_by_role(tree, steady_cpu)[0]
    total = opts.images
    row = {
        "variant": name, "args": args_text, "images": total, "rows": len(uris), "unique_rows": len(set(uris)),
        "every_row_once": len(uris) == len(set(uris)) == total,
        "ok": table.column("status").to_pylist().count("ok"),
        "errors": collections.Counter(e[:160] for e in table.column("error").to_pylist() if e).most_common(3),
        "wall_s": round(wall, 1), "start_s": round(commits[0] - t0, 1) if commits else None,
        "first_call_s": round(min(starts) - t0, 1) if starts else None,
        "tail_s": round(t_end - commits[-1], 1) if commits else None,
        "steady_img_s": round(rate, 1) if rate else None, "steady_window_s": round(hi - lo, 1),
        "job_img_s": round(total / wall, 1),
        "gpu_steady": gpu_summary(sampler.samples(), lo, hi) if rate else {},
        "machine_steady": machine.summary(lo, hi) if machine is not None and rate else {},
        "servers_at_once": servers.most, "servers_seen": len(servers.pids),
        "failover_lines": [ln[:200] for ln in log.splitlines() if any(m in ln for m in FAILOVER_MARKERS)],
        "engine": report.get("engine"), "serving": report.get("serving"),
        "cpu_s_by_process": {k: round(v, 1) for k, v in cpu.most_common(12)},
        "cpu_s_total": round(tree.cpu_total_s, 1),
        "steady_core_pct_by_process": {k: round(100 * v / span, 1) for k, v in steady_by_role.most_common(8)}
        if span else {},
    }
    LOG.warning("result %s", json.dumps(row))
    return row


class StubSpy:
    """py-spy on every ``triton_python_backend_stub`` process that appears while it runs; raw stacks per pid."""

    def __init__(self, folder: Path, rate: int = 40):
        self.folder, self.rate = folder, rate
        self.procs: dict[int, subprocess.Popen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            for proc in psutil.process_iter(["name", "cmdline"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                if "triton_python_backend_stub" in cmd and proc.pid not in self.procs:
                    out = self.folder / f"spy-{proc.pid}.txt"
                    self.procs[proc.pid] = subprocess.Popen(
                        ["py-spy", "record", "--pid", str(proc.pid), "--rate", str(self.rate), "--native",
                         "--format", "raw", "--output", str(out)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._stop.wait(0.2)

    def __enter__(self) -> "StubSpy":
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for spy in self.procs.values():
            try:
                spy.wait(timeout=20)  # py-spy writes its file when the stub exits
            except subprocess.TimeoutExpired:
                spy.terminate()


def summarize_spy(folder: Path, top: int = 25) -> None:
    """Self samples by function, and samples by the pipeline function they run under, over every stub's stacks
    outside the instance's start (``initialize``, ``warmup`` and imports)."""
    own, under, total, start = collections.Counter(), collections.Counter(), 0, 0
    marks = ("execute", "_prepare", "_infer", "_emit", "_respond", "submit", "_triage_all", "run_stream", "consume",
             "prepare", "request_images", "_tensors", "feed_ndarray")
    for path in sorted(folder.glob("spy-*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            names = [f.split(" ")[0].rpartition(".")[2] for f in frames]  # "Class.method (file:line)" -> method
            if any(name in ("initialize", "warmup", "<module>", "_find_and_load") for name in names):
                start += n
                continue
            total += n
            own[frames[-1][:140]] += n
            under[next((m for m in reversed(names) if m in marks), names[1] if len(names) > 1 else names[0])] += n
    print(f"py-spy: {total} busy samples of the stubs past their start ({start} in initialize/warmup), "
          f"{len(list(folder.glob('spy-*.txt')))} stubs")
    for name, n in under.most_common(15):
        print(f"  under {name:<40} {n:>7} {100 * n / max(total, 1):5.1f} %")
    for name, n in own.most_common(top):
        print(f"  self  {n:>7} {100 * n / max(total, 1):5.1f} %  {name}")


def print_table(rows: list[dict]) -> None:
    base = rows[0]["steady_img_s"] if rows else None
    header = (f"{'variant':<14} {'engine':<22} {'rows once':>9} {'steady img/s':>12} {'x first':>7} {'window s':>8} "
              f"{'GPU %':>6} {'wall s':>7} {'start s':>7} {'tail s':>6} {'servers':>7} {'failovers':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = f"{r['steady_img_s'] / base:.2f}" if base and r["steady_img_s"] else "-"
        gpu = "/".join(f"{g['util_mean']:.0f}" for g in r["gpu_steady"].values()) or "-"
        print(f"{r['variant']:<14} {str(r['engine'])[:22]:<22} {str(r['every_row_once']):>9} "
              f"{str(r['steady_img_s']):>12} {ratio:>7} {r['steady_window_s']:>8} {gpu:>6} {r['wall_s']:>7} "
              f"{str(r['start_s']):>7} {str(r['tail_s']):>6} {r['servers_at_once']:>3}/{r['servers_seen']:<3} "
              f"{len(r['failover_lines']):>9}")
    for r in rows:
        if r["errors"]:
            print(f"errors {r['variant']}: {r['rows'] - r['ok']} rows, most common: {r['errors']}")
    for r in rows:
        if r.get("machine_steady"):
            print(f"steady window {r['variant']}: " + ", ".join(f"{k} {v}" for k, v in r["machine_steady"].items()))
    for r in rows:
        cpu = ", ".join(f"{k} {v}" for k, v in r["cpu_s_by_process"].items())
        print(f"CPU s {r['variant']}: total {r['cpu_s_total']} over {r['wall_s']} s wall: {cpu}")
    for r in rows:
        if r.get("steady_core_pct_by_process"):
            shares = ", ".join(f"{k} {v}" for k, v in r["steady_core_pct_by_process"].items())
            print(f"% of one core over the steady window {r['variant']}: {shares}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=100_000, help="files in the source (hard links)")
    p.add_argument("--unique", type=int, default=2048, help="distinct JPEGs behind them")
    p.add_argument("--set", default="imagenet", help="image_sets set: imagenet (~100 KB) or light (~35 KB)")
    p.add_argument("--work", type=Path, required=True, help="folder for the images and outputs (images reused)")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON and logs (default WORK/results)")
    p.add_argument("--variant", action="append", default=[], help="NAME=ARGS for 'bulk-classify run' (repeatable)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="per variant")
    p.add_argument("--oddities", default="", help="also run tests/support/oddities.py's files through these variants "
                   "(comma-separated NAMEs) and compare each file's status and error kind with the expected ones")
    p.add_argument("--mps", action="store_true", help="every variant under a private CUDA MPS daemon (gpu_mps.py)")
    p.add_argument("--dry-run-cpu", action="store_true", help="a few hundred images, for a machine without a GPU")
    p.add_argument("--gpu-repo", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="build a gpu-profile repository with these gpu_config options; @NAME in a variant uses it")
    p.add_argument("--profile", default="", help="run this variant once more under py-spy (no table row)")
    opts = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if opts.dry_run_cpu:
        opts.images, opts.unique = min(opts.images, 240), min(opts.unique, 48)
    opts.out = opts.out or opts.work / "results"
    opts.out.mkdir(parents=True, exist_ok=True)
    variants = [v.partition("=")[::2] for v in opts.variant] or [("default", "")]

    from bench_scaleout import SmiSampler, make_images

    from pipeline.model.folder import load_model

    load_model(None)  # the default model's ONNX in the cache, as after a user's first run
    images = make_images(opts.work, opts.images, opts.unique, opts.set)
    for spec in opts.gpu_repo:
        build_repo(spec, opts.work / "repos")
    sampler = SmiSampler(opts.out / "nvidia_smi.csv", period_ms=250)
    machine = MachineSampler(opts.out)
    rows = []
    stack = contextlib.ExitStack()
    if opts.mps:
        from gpu_mps import mps

        stack.enter_context(mps(opts.work / "mps"))
    try:
        for name, args_text in variants:
            try:
                rows.append(run_variant(name, args_text, images, opts.work, opts, sampler, machine))
            except SystemExit as err:  # one failing variant does not lose the others' rows
                LOG.warning("variant %s failed: %s", name, str(err)[-3000:])
            (opts.out / "bench_job.json").write_text(json.dumps(rows, indent=2))
    finally:
        stack.close()
        sampler.stop()
        machine.stop()
    print()
    print_table(rows)
    for name in filter(None, opts.oddities.split(",")):
        check_oddities(name, dict(variants).get(name, ""), opts)
    if opts.profile:
        spy_dir = opts.out / f"spy-{opts.profile}"
        shutil.rmtree(spy_dir, ignore_errors=True)
        try:
            with StubSpy(spy_dir):
                run_variant(f"{opts.profile}_spy", dict(variants).get(opts.profile, ""), images, opts.work, opts,
                            sampler)
        except SystemExit as err:
            print(f"profiled run failed: {str(err)[-1500:]}")
        summarize_spy(spy_dir)


def build_repo(spec: str, root: Path) -> Path:
    """``NAME:KEY=VALUE,...``: a gpu-profile repository with those ``GpuModelOptions`` (numbers as numbers); a
    ``network`` of tests/benchmarks/gpu_networks.py (resnet50, a layout name) is served from there,
    ``network=none`` serves the hop alone (hop_model.py)."""
    from gpu_networks import served
    from hop_model import serve_hop

    from pipeline.triton.repository import build_gpu_repository

    name, _, text = spec.partition(":")
    options: dict = {}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        try:
            options[key] = float(value) if "." in value else int(value)
        except ValueError:
            options[key] = {"true": True, "false": False}.get(value.lower(), value)
    hop = options.get("network") == "none"  # the hop alone: hop_model.py's models
    if hop:
        del options["network"]
    elif options.get("network") not in (None, "auto"):
        options["network"] = served(options["network"])
    # model=DIR and more=DIR+DIR: a user's model, a model set's other models ("default": the built-in model)
    model = str(options.pop("model", "default"))
    model = None if model == "default" else model
    more = [None if m == "default" else m for m in str(options.pop("more", "")).split("+") if m]
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    build_gpu_repository(model, str(out), more=more, **options)
    if hop:
        serve_hop(out)
    LOG.warning("repository %s: %s", name, options)
    return out


def check_oddities(name: str, args_text: str, opts) -> None:
    """Every odd input through variant ``name``: one row each, with the status and error kind oddities() expects."""
    import pyarrow.dataset as pads

    sys.path.insert(0, str(REPO / "tests"))
    from support.oddities import oddities

    folder = opts.work / "odd"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    expected = {}
    for odd, (blob, status, kind) in oddities().items():
        (folder / f"{odd}.jpg").write_bytes(blob)
        expected[odd] = (status, kind)
    out = opts.work / f"odd-out-{name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(folder), "--output", str(out), "--quiet",
           *shlex.split(args_text)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=opts.timeout_s)
    if proc.returncode != 0:
        print(f"oddities {name}: the run failed ({proc.returncode}): {proc.stderr[-1500:]}")
        return
    rows = pads.dataset(str(out), format="parquet").to_table(columns=["uri", "status", "error"]).to_pylist()
    got = {}
    for row in rows:
        odd = Path(row["uri"]).stem
        kind = (row["error"] or "").split(":", 1)[0] or None
        got.setdefault(odd, []).append((row["status"], kind))
    bad = {k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != [v]}
    texts = {Path(row["uri"]).stem: (row["error"] or "")[:160] for row in rows if Path(row["uri"]).stem in bad}
    print(f"oddities {name}: {len(expected) - len(bad)}/{len(expected)} as expected, {len(rows)} rows"
          + ("" if not bad else f"; differ: {bad}; their errors: {texts}"))


if __name__ == "__main__":
    main()
