"""Scale-out benchmark: the same Ray job on 1, 2, ... GPUs (one classify actor and one local Triton per GPU).

Run on a GPU machine (ray, torch, tritonclient, a tritonserver binary; see docs/gpu.md)::

    python tests/benchmarks/bench_scaleout.py --gpus 1,2 --out results/

For each GPU count N it starts a fresh local Ray with N GPUs and runs one ``pipeline.job.run_job`` with
``engine="triton"``, ``num_actors=N`` and the ``gpu`` profile repository, so Ray gives every actor its own GPU
(CUDA_VISIBLE_DEVICES) and every actor starts its own tritonserver on loopback. The images are ImageNet-like JPEGs
(500x375, ~100 KB) made from the repository's photos by ``image_sets.make_set``, hard-linked many times into
sub-folders. It prints, per N: images, wall seconds, start-up (job start to the first actor call), steady img/s
(rows whose actor call started between those of the rows at 15% and 90%, by the rows' own ``classified_at``,
so actor and server start-up and the tail are excluded), the whole job's img/s, the ratio to the first N, and each
GPU's mean utilization and peak memory (``nvidia-smi`` sampled every 0.5 s) over the steady window; and it checks
that every input has exactly one output row.

``--dry-run-cpu`` runs the same code without GPUs (portable profile, ONNX Runtime on the CPU, a few hundred
images), to check the script end to end on a laptop; its rates mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

LOG = logging.getLogger("bench_scaleout")
# The python backend moves inputs through shared memory that starts at 1 MB and grows 1 MB at a time: start it
# large enough for several multi-MB requests (as gpu_triton.py does).
GPU_SERVER_ARGS = ["--backend-config=python,shm-default-byte-size=268435456",
                   "--backend-config=python,shm-growth-byte-size=67108864"]
STEADY = (0.15, 0.90)
SMI_FIELDS = "timestamp,index,utilization.gpu,memory.used"


# ---- inputs -----------------------------------------------------------------------------------------------


def make_images(root: Path, total: int, unique: int, set_name: str, per_folder: int = 1000) -> Path:
    """``total`` JPEG paths under ``root/images/dNNN/`` hard-linked from ``unique`` generated files; reused."""
    images = root / "images"
    marker = images / ".done"
    want = f"{total} {unique} {set_name}"
    if marker.is_file() and marker.read_text() == want:
        return images
    from image_sets import make_set

    shutil.rmtree(images, ignore_errors=True)
    shutil.rmtree(root / "unique", ignore_errors=True)
    (root / "unique").mkdir(parents=True)
    blobs = make_set(unique, set_name, 0)
    sources = []
    for i, blob in enumerate(blobs):
        path = root / "unique" / f"u{i:05d}.jpg"
        path.write_bytes(blob)
        sources.append(path)
    for i in range(total):
        folder = images / f"d{i // per_folder:03d}"
        if i % per_folder == 0:
            folder.mkdir(parents=True)
        os.link(sources[i % unique], folder / f"img{i:06d}.jpg")
    marker.write_text(want)
    LOG.info("%d images (%d unique, mean %.1f KB) under %s", total, unique,
             sum(map(len, blobs)) / len(blobs) / 1024, images)
    return images


def make_repository(root: Path, dry_run: bool, args) -> Path:
    """The gpu profile (or, dry run, the portable profile) for the default model, written afresh for this run's
    options (a repository reused by name once kept an earlier run's instance count)."""
    repo = root / ("repo-portable" if dry_run else "repo-gpu")
    shutil.rmtree(repo, ignore_errors=True)
    if dry_run:
        from pipeline.triton.repository import build_repository

        build_repository("portable", None, str(repo), instances=args.instances)
    else:
        from pipeline.triton.repository import build_gpu_repository

        batch = {} if args.triton_batch is None else {"batch_size": args.triton_batch}
        build_gpu_repository(None, str(repo), instances=args.instances, **batch,
                             max_batch_size=args.triton_max_batch, queue_delay_us=args.queue_delay_us,
                             prep_workers=args.prep_workers,
                             hw_decoder_load=args.hw_decoder_load, half=args.half,
                             dali_depth=args.dali_depth, dali_threads=args.dali_threads, cuda_sync=args.cuda_sync)
    return repo


# ---- GPU sampling -----------------------------------------------------------------------------------------


def smi_time(text: str) -> float:
    """Unix time of an ``nvidia-smi --query-gpu=timestamp`` value.

    Raises:
        ValueError: not a timestamp (a partly written line).
    """
    return datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()


class SmiSampler:
    """``nvidia-smi -lms`` in the background, raw lines kept in a CSV; no-op where nvidia-smi is missing."""

    def __init__(self, path: Path, period_ms: int = 500):
        self.path = path
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            LOG.warning("nvidia-smi not found: no GPU readings")
            return
        self.file = open(path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", f"-lms={period_ms}"],
            stdout=self.file, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.file.close()

    def samples(self) -> list[tuple[float, int, float, float]]:
        """(unix time, gpu index, utilization %, memory MiB) for every complete line so far."""
        if self.proc is None or not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 4:
                continue
            try:
                when = smi_time(parts[0])
                out.append((when, int(parts[1]), float(parts[2]), float(parts[3])))
            except ValueError:
                continue
        return out


def gpu_summary(samples, start: float, end: float) -> dict[int, dict[str, float]]:
    """Per GPU: mean utilization over [start, end] and peak memory used."""
    per: dict[int, list[tuple[float, float]]] = {}
    for when, index, util, mem in samples:
        if start <= when <= end:
            per.setdefault(index, []).append((util, mem))
    return {i: {"util_mean": round(sum(u for u, _ in v) / len(v), 1), "mem_peak_mib": max(m for _, m in v),
                "samples": len(v)} for i, v in sorted(per.items())}


# ---- one run ----------------------------------------------------------------------------------------------


def steady_rate(starts: list[float]) -> tuple[float | None, float, float]:
    """img/s over the middle of the run from the rows' own ``classified_at`` (the start of their actor call).

    The window runs from the call start of the row at 15% to that of the row at 90% (rows sorted by time); the
    rows counted are those whose calls started inside it, which have finished by its end (one call at a time
    per actor), so actor and server start-up and the tail are left out.
    """
    if len(starts) < 10:
        return None, 0.0, 0.0
    ordered = sorted(starts)
    lo, hi = ordered[int(STEADY[0] * len(ordered))], ordered[int(STEADY[1] * len(ordered))]
    if hi - lo < 0.5:  # too few actor calls to tell start-up apart
        return None, lo, hi
    inside = sum(1 for t in ordered if lo <= t < hi)
    return inside / (hi - lo), lo, hi


def run_once(n: int, images: Path, repo: Path, root: Path, args, sampler: SmiSampler,
             variant: tuple[int, int, bool] = (1, 1, False)) -> dict:
    """One job on ``n`` GPUs; ``variant`` = (actors per GPU, engine calls per actor, one server shared per GPU)."""
    import pyarrow.dataset as pads
    import ray

    from pipeline.config import RunConfig
    from pipeline.job import run_job

    per_gpu, calls, shared = variant
    out = root / f"out-{n}-{per_gpu}-{calls}-{int(shared)}"
    shutil.rmtree(out, ignore_errors=True)
    total = sum(1 for _ in images.rglob("*.jpg"))
    ray.init(num_gpus=0 if args.dry_run_cpu else n, include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=True)
    points: list[tuple[float, int]] = []

    spied: list = []

    def progress(done: int, listed, errors: int) -> None:
        points.append((time.time(), done))
        if args.py_spy and not spied and done >= total * 0.25:
            spied.append(spy_all(args.out / f"spy-{n}-{per_gpu}-{calls}-{int(shared)}.txt"))
        LOG.info("%d GPU(s): %d/%s rows, %d errors", n, done, listed, errors)

    options = {"repository": str(repo), "request_batch": args.request_batch, "concurrency": args.concurrency,
               "startup_timeout_s": args.startup_timeout_s}
    if not args.dry_run_cpu:
        options["server_args"] = GPU_SERVER_ARGS
    if shared:
        options["share_server"] = True
    if args.engine == "gpu":  # the same classifier in the actor's own process: no Triton hop
        options = {"prep_workers": args.prep_workers}
        options.update({k: v for k, v in (("dali_depth", args.dali_depth), ("dali_threads", args.dali_threads),
                                          ("hw_decoder_load", args.hw_decoder_load), ("cuda_sync", args.cuda_sync))
                        if v is not None})
        if args.half != "auto":
            options["half"] = args.half == "true"
    config = RunConfig(source=str(images), output=str(out), engine=args.engine, num_actors=n * per_gpu,
                       num_gpus_per_actor=None if args.dry_run_cpu else 1.0 / per_gpu, calls_per_actor=calls,
                       batch_size=args.batch_size, shard_size=args.shard_size, engine_options=options,
                       fetch_ahead_bytes=args.fetch_ahead_mb * 2**20 if args.fetch_ahead_mb else None)
    t0 = time.time()
    try:
        summary = run_job(config, progress=progress)
        for th in spied:
            th.join(timeout=60)
    finally:
        ray.shutdown()
    wall = time.time() - t0
    table = pads.dataset(str(out), format="parquet").to_table(columns=["uri", "classified_at"])
    uris = table.column("uri").to_pylist()
    starts = [t.timestamp() for t in table.column("classified_at").to_pylist() if t is not None]
    rate, lo, hi = steady_rate(starts)
    row = {
        "gpus": n, "actors_per_gpu": per_gpu, "calls_per_actor": calls, "shared_server": shared,
        "engine": args.engine, "instances": args.instances, "mps": args.mps, "cuda_sync": args.cuda_sync,
        "images": total, "rows": len(uris), "unique_rows": len(set(uris)),
        "every_row_once": len(uris) == len(set(uris)) == total, "counts": summary.counts,
        "wall_s": round(wall, 1), "startup_s": round(min(starts) - t0, 1) if starts else None,
        "steady_img_s": round(rate, 1) if rate else None, "steady_window_s": round(hi - lo, 1),
        "job_img_s": round(total / wall, 1),
        "gpu": gpu_summary(sampler.samples(), lo, hi) if rate else {},
        "gpu_whole_run": gpu_summary(sampler.samples(), t0, t0 + wall),
        "progress": [(round(t - t0, 2), d) for t, d in points],
    }
    LOG.warning("run %s", json.dumps({k: v for k, v in row.items() if k != "progress"}))
    return row


def spy_all(path: Path, seconds: int = 3) -> threading.Thread:
    """Where the job's CPU goes, mid-run: CPU % of every process of this machine over ``seconds`` (by name), and
    py-spy samples (collapsed stacks, thread names) of the Ray workers and Triton stubs, all at once."""
    import psutil

    def go():
        procs = [p for p in psutil.process_iter(["pid", "name", "cmdline"]) if p.pid != os.getpid()]
        for p in procs:
            try:
                p.cpu_percent(None)
            except psutil.Error:
                pass
        pythons = [p for p in procs if any(k in " ".join(p.info["cmdline"] or []) for k in
                                           ("ray::", "triton_python_backend_stub", "bench_scaleout"))]
        spies = [(p, subprocess.Popen(["py-spy", "record", "--pid", str(p.pid), "--duration", str(seconds),
                                       "--rate", "100", "--format", "raw", "--threads", "--nonblocking",
                                       "--output", f"{path}.{p.pid}"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT)) for p in pythons if shutil.which("py-spy")]
        time.sleep(seconds)
        usage = []
        for p in procs:
            try:
                usage.append((p.cpu_percent(None), p.pid, " ".join(p.info["cmdline"] or [p.info["name"] or ""])[:90]))
            except psutil.Error:
                pass
        for _, proc in spies:
            try:
                proc.wait(timeout=seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
        with path.open("w") as f:
            f.write(f"# CPU % over {seconds} s, busiest first\n")
            for pct, pid, cmd in sorted(usage, reverse=True)[:40]:
                f.write(f"{pct:7.1f} {pid:>8} {cmd}\n")
            for p, _ in spies:
                part = Path(f"{path}.{p.pid}")
                if part.is_file():
                    f.write(f"\n# py-spy {p.pid} {' '.join(p.info['cmdline'] or [])[:90]}\n{part.read_text()}")
                    part.unlink()

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


def print_table(rows: list[dict]) -> None:
    base = rows[0]["steady_img_s"] if rows else None
    header = (f"{'GPUs':>4} {'actors/GPU, calls, server':>26} {'images':>7} {'rows once':>9} {'wall s':>7} {'start-up s':>10} {'steady img/s':>12} "
              f"{'x first':>7} {'job img/s':>9}  mean GPU util % (steady) / peak MiB")
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = f"{r['steady_img_s'] / base:.2f}" if base and r["steady_img_s"] else "-"
        gpus = ", ".join(f"gpu{i}: {g['util_mean']:.0f}% / {g['mem_peak_mib']:.0f}" for i, g in r["gpu"].items())
        shape = f"{r.get('actors_per_gpu', 1)}, {r.get('calls_per_actor', 1)}, " + (
            "shared" if r.get("shared_server") else "own")
        print(f"{r['gpus']:>4} {shape:>26} {r['images']:>7} {str(r['every_row_once']):>9} {r['wall_s']:>7.1f} "
              f"{r['startup_s']:>10.1f} {str(r['steady_img_s']):>12} {ratio:>7} {str(r['job_img_s']):>9}"
              f"  {gpus or '-'}")


def _variants(text: str) -> list[tuple[int, int, bool]]:
    out = []
    for item in text.split(","):
        per_gpu, calls, server = item.split(":")
        if server not in ("own", "shared"):
            raise argparse.ArgumentTypeError(f"{item!r}: the third field is own or shared")
        out.append((int(per_gpu), int(calls), server == "shared"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="1,2", help="GPU counts to run, comma-separated (one actor per GPU)")
    p.add_argument("--out", type=Path, default=Path("bench_scaleout_out"))
    p.add_argument("--work", type=Path, default=None, help="folder for images, repository and outputs (reused)")
    p.add_argument("--images", type=int, default=None, help="files in the source (hard links); 36000, dry run 240")
    p.add_argument("--unique", type=int, default=None, help="distinct JPEGs behind them; 2048, dry run 48")
    p.add_argument("--set", default="imagenet", help="image_sets set: imagenet (~100 KB) or light (~35 KB)")
    p.add_argument("--batch-size", type=int, default=1536, help="images per actor call (RunConfig.batch_size)")
    p.add_argument("--shard-size", type=int, default=1000, help="rows per Parquet shard (progress granularity)")
    p.add_argument("--request-batch", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--variants", type=_variants, default=_variants("1:2:own"),
                   help="job shapes to run, comma-separated ACTORS_PER_GPU:CALLS_PER_ACTOR:own|shared, e.g. "
                        "1:2:own,2:2:shared (shared: the actors of a GPU share one server)")
    p.add_argument("--instances", type=int, default=1, help="Triton model instances per server")
    p.add_argument("--triton-batch", type=int, default=None, help="network batch inside the gpu model (its default)")
    p.add_argument("--triton-max-batch", type=int, default=1024)
    p.add_argument("--queue-delay-us", type=int, default=100)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--fetch-ahead-mb", type=int, default=0,
                   help="object-store budget for fetched bytes (RunConfig.fetch_ahead_bytes); 0: the job's default. "
                        "Keep it several actor batches (batch-size x ~100 KB) large, or the actor starves")
    p.add_argument("--engine", default="triton", choices=("triton", "gpu"),
                   help="triton: a local tritonserver per actor (gpu profile); gpu: the classifier in the actor")
    p.add_argument("--hw-decoder-load", type=float, default=None, help="DALI's hardware-decoder share (model default)")
    p.add_argument("--half", default="auto", help="network precision in the gpu model: auto, true, false")
    p.add_argument("--prep-workers", type=int, default=2, help="preparing threads per model instance")
    p.add_argument("--dali-depth", type=int, default=None, help="DALI batches in flight on one pipeline (default: the model's)")
    p.add_argument("--dali-threads", type=int, default=None, help="DALI's CPU threads (default: the model's)")
    p.add_argument("--py-spy", action="store_true", help="a quarter in, CPU by process and py-spy stacks to OUT/spy-*.txt")
    p.add_argument("--cuda-sync", default=None, choices=("auto", "spin", "block"),
                   help="how the classifier's threads wait for the GPU (default: the model's)")
    p.add_argument("--mps", action="store_true",
                   help="run the jobs under a private CUDA MPS daemon (tests/benchmarks/gpu_mps.py): the processes "
                        "sharing a GPU run their kernels at once instead of taking turns")
    p.add_argument("--prepare-only", action="store_true", help="build images, model cache and repository, then stop")
    p.add_argument("--dry-run-cpu", action="store_true", help="no GPUs: portable profile, few images (script check)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("ray", "ray.data", "pipeline"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.dry_run_cpu:
        args.images, args.unique = args.images or 240, args.unique or 48
        args.batch_size, args.request_batch, args.concurrency, args.instances = 32, 16, 2, 1
        args.shard_size = min(args.shard_size, max(10, args.images // 12))
    args.images, args.unique = args.images or 36000, args.unique or 2048
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.work or Path(tempfile.mkdtemp(prefix="scaleout-"))
    root.mkdir(parents=True, exist_ok=True)

    from pipeline.model.folder import load_model

    t0 = time.perf_counter()
    load_model(None)  # builds the default model's ONNX into the cache once, before any actor
    images = make_images(root, args.images, args.unique, args.set)
    repo = make_repository(root, args.dry_run_cpu, args)
    LOG.warning("prepared in %.1f s: %s, %s", time.perf_counter() - t0, images, repo)
    if args.prepare_only:
        return
    sampler = SmiSampler(args.out / "nvidia_smi.csv")
    rows = []
    stack = contextlib.ExitStack()
    if args.mps:
        from gpu_mps import mps

        stack.enter_context(mps(Path(tempfile.mkdtemp(prefix="mps-"))))
    try:
        for n in (int(v) for v in args.gpus.split(",")):
            for variant in args.variants:
                rows.append(run_once(n, images, repo, root, args, sampler, variant))
            (args.out / "bench_scaleout.json").write_text(json.dumps(rows, indent=2))
    finally:
        stack.close()
        sampler.stop()
    print()
    print_table(rows)
    if not all(r["every_row_once"] for r in rows):
        raise SystemExit("some input has no row or more than one row: see bench_scaleout.json")


if __name__ == "__main__":
    main()
