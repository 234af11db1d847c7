"""Benchmark: our job against a naive Ray Data pipeline (read_images + map_batches + write_parquet), same images.

Usage:
    python tests/benchmarks/bench_vs_naive.py [--images 2000] [--size 500x375] [--rounds 2] [--batch-size 64]
        [--naive-actors 1] [--ours-args "--decode-threads 1"] [--tiny 16] [--timeout-s 900] [--workdir DIR]
    python tests/benchmarks/bench_vs_naive.py --size 500x375,1600x1200,4032x3024 --images 2000,1200,300 --rounds 1

Images: ~500x375 JPEGs (quality 90; every fourth one portrait 375x500) cut from the committed photos
(tests/data/photos) by seeded crops and scales, so both pipelines read the same realistic files.

Both sides classify with the same ONNX model (the default EfficientNet-Lite0) and the same preprocessing spec, and
run A, B, A, B, ... (``--rounds``), each as its own subprocess with a fresh local Ray in a private RAY_TMPDIR and
all the machine's CPUs (same ``num_cpus`` for both):

* ours: ``bulk-classify run SRC --output DEST --quiet --batch-size B`` (listing, fetch, ClassifyActor pool,
  atomic Parquet shards, report).
* naive: ``ray.data.read_images(SRC, mode="RGB")`` (decode in read tasks) -> ``map_batches`` with a callable class
  holding an onnxruntime session (default session options), preprocessing each decoded array with the reference
  ``pipeline.model.imaging.preprocess_image`` and the model's spec -> top-k softmax -> ``write_parquet``.
  ``--naive-actors`` actors of 1 CPU each (default 1, as our job uses on 2 CPUs: CPUs // 4, at least 1).

Printed: per run wall seconds (the subprocess: Ray start and stop included), job seconds (ours: elapsed_s from
_REPORT.json, which counts the driver's imports of Ray; naive: from before ``import ray`` to the end of
write_parquet, the same span), img/s, peak PSS of the process tree (see bench_streaming.py; sampled every
``--memory-interval-s``, 2 s, since sampling memory is not free), then medians and the ratio naive/ours (>1 means ours
is faster; issue 3's goal: >= 2).
Top-1 agreement between the two outputs is printed too: they must do the same work. ``--tiny N`` (default 16) adds a
run per side and round on N images to split the fixed start-up cost (Ray, workers, model load) from the per-image rate;
``--size`` makes other sizes (bigger: decode weighs more, and so do the naive pipeline's full-size decoded
arrays in the object store); several sizes run one after the other and end with a table of ratios by size.
``--ours-args`` passes options to our side only (tuning). ``--running-ray`` starts a Ray head for each run
(``tests/support/ray_cluster.py``, outside the measured span) and the run joins it through RAY_ADDRESS, as a job
submitted to a running cluster does: Ray's own start then counts for neither side, and CPU seconds and PSS cover the
driver only (the cluster's processes are not its children).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE.parent))  # tests/ (support)
sys.path.insert(0, str(HERE))

from bench_streaming import MIB, cli_path, ray_env, run_measured  # noqa: E402

PHOTOS = REPO / "tests" / "data" / "photos"
LANDSCAPE = (500, 375)
JPEG_QUALITY = 90
GOAL_RATIO = 2.0


def make_images(root: Path, count: int, size: tuple[int, int] = LANDSCAPE) -> None:
    """``count`` JPEGs of ``size`` (every fourth one portrait) cut from the committed photos; image i depends only
    on i."""
    photos = [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg"))]
    if not photos:
        raise SystemExit(f"no photos in {PHOTOS}; run tests/data/make_photos.py")
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        path = root / f"img{i:05d}.jpg"
        if path.exists():
            continue
        rng = np.random.default_rng(1000 + i)
        src = photos[i % len(photos)]
        out_w, out_h = size if i % 4 else size[::-1]
        aspect = out_w / out_h
        # The largest box of the output's aspect that fits, scaled by 60-100%, at a random position.
        box_w = min(src.width, src.height * aspect) * rng.uniform(0.6, 1.0)
        box_h = box_w / aspect
        left = rng.uniform(0, src.width - box_w)
        top = rng.uniform(0, src.height - box_h)
        img = src.resize((out_w, out_h), Image.Resampling.BICUBIC, box=(left, top, left + box_w, top + box_h))
        img.save(path, "JPEG", quality=JPEG_QUALITY)


class NaiveClassifier:
    """What a first Ray Data pipeline would hold in an actor: one ORT session, per-image preprocessing."""

    def __init__(self, top_k: int):
        import onnxruntime as ort

        from pipeline.model.folder import load_model

        self.bundle = load_model(None)
        options = ort.SessionOptions()
        allowed = len(os.sched_getaffinity(0))
        if allowed < os.sysconf("SC_NPROCESSORS_ONLN"):  # not os.cpu_count(): the device kit's shim changes it
            # Pinned to some of a larger host's CPUs (taskset): ORT's default pool would start one thread per
            # physical core of the host, each pinned to its core outside the mask, so the naive side would use CPUs
            # ours may not. On a machine of that size its default is about one thread per CPU: that is what it gets.
            options.intra_op_num_threads = allowed
        self.session = ort.InferenceSession(str(self.bundle.onnx_path), sess_options=options,
                                            providers=["CPUExecutionProvider"])
        self.top_k = top_k

    def __call__(self, batch: dict) -> dict:
        from pipeline.engines.onnx import topk_softmax
        from pipeline.model.imaging import preprocess_image

        x = np.stack([preprocess_image(Image.fromarray(a), self.bundle.spec) for a in batch["image"]])
        logits = self.session.run([self.bundle.output_name], {self.bundle.input_name: x})[0]
        ids, probs = topk_softmax(logits, self.top_k)
        return {
            "path": batch["path"],
            "class_ids": list(ids.astype(np.int32)),
            "labels": [[self.bundle.labels[j] for j in row] for row in ids],
            "scores": list(probs),
            "width": np.array([a.shape[1] for a in batch["image"]], np.int32),
            "height": np.array([a.shape[0] for a in batch["image"]], np.int32),
        }


def naive_main(src: str, dest: str, batch_size: int, actors: int, top_k: int) -> None:
    """The naive pipeline, run in its own process; writes its job seconds to DEST/_naive.json."""
    import logging

    start = time.perf_counter()  # before Ray is imported: our job's elapsed_s counts its imports of Ray too
    import ray
    from ray.data import DataContext

    ray.init(include_dashboard=False, logging_level=logging.WARNING)  # all CPUs, like our CLI
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ds = ray.data.read_images(src, mode="RGB", include_paths=True)
    ds = ds.map_batches(NaiveClassifier, fn_constructor_kwargs={"top_k": top_k}, batch_size=batch_size,
                        concurrency=actors, num_cpus=1, batch_format="numpy")
    ds.write_parquet(dest)
    elapsed = time.perf_counter() - start
    Path(dest, "_naive.json").write_text(json.dumps({"elapsed_s": elapsed}))
    ray.shutdown()


def top1(dest: Path, path_col: str) -> dict[str, int]:
    """{file name: top-1 class id} of a run's Parquet output."""
    import pyarrow.dataset as pads

    table = pads.dataset(str(dest), format="parquet").to_table(columns=[path_col, "class_ids"])
    return {p.rsplit("/", 1)[-1]: ids[0] for p, ids in zip(table.column(path_col).to_pylist(),
                                                          table.column("class_ids").to_pylist())}


@contextlib.contextmanager
def run_env(env: dict[str, str], *, running_ray: bool) -> Iterator[dict[str, str]]:
    """The environment of one run: ``env``, or with ``running_ray`` that of a Ray head started for this run alone and
    stopped after it, outside the measured span (Ray Data's named actors and idle workers never serve the next run)."""
    if not running_ray:
        yield env
        return
    from support.ray_cluster import LocalRayCluster

    cluster = LocalRayCluster(num_cpus=os.cpu_count() or 1, object_store_bytes=None, job_api=False)
    cluster.start()
    try:
        yield {**env, **{k: cluster.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")},
               "RAY_ADDRESS": cluster.gcs_address}
    finally:
        cluster.stop()


def run_side(side: str, src: Path, dest: Path, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """One measured subprocess run of ``side`` ("ours" or "naive") over ``src``; its times and memory."""
    shutil.rmtree(dest, ignore_errors=True)
    if side == "ours":
        cmd = [cli_path(), "run", str(src), "--output", str(dest), "--quiet",
               "--batch-size", str(args.batch_size), "--top-k", str(args.top_k), *shlex.split(args.ours_args)]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--naive", str(src), str(dest),
               "--batch-size", str(args.batch_size), "--naive-actors", str(args.naive_actors),
               "--top-k", str(args.top_k)]
    # bench_cpu_shape.py's runs have no --running-ray
    with run_env(env, running_ray=getattr(args, "running_ray", False)) as run_with:
        wall, sampler, _ = run_measured(cmd, run_with, args.interval_s, args.timeout_s, args.memory_interval_s)
    info = dest / ("_REPORT.json" if side == "ours" else "_naive.json")
    return {"side": side, "wall": wall, "job": json.loads(info.read_text())["elapsed_s"],
            "cpu": sampler.cpu_total_s, "pss": sampler.peak["pss"]}


def parse_sizes(sizes: str, images: str) -> list[tuple[tuple[int, int], int]]:
    """``--size 500x375,4032x3024`` and ``--images 2000,300`` (or one count for all) -> [((w, h), count), ...]."""
    try:
        parsed = [tuple(int(v) for v in item.lower().split("x")) for item in sizes.split(",")]
        assert all(len(size) == 2 and min(size) >= 224 for size in parsed)
    except (ValueError, AssertionError):
        raise SystemExit(f"--size {sizes!r} must be WIDTHxHEIGHT[,WIDTHxHEIGHT...], each side at least 224, "
                         "e.g. 500x375,1600x1200") from None
    try:
        counts = [int(v) for v in images.split(",")]
        assert all(c >= 1 for c in counts) and len(counts) in (1, len(parsed))
    except (ValueError, AssertionError):
        raise SystemExit(f"--images {images!r} must be one positive count, or one per --size "
                         f"({len(parsed)}), e.g. 2000,600") from None
    return list(zip(parsed, counts * len(parsed) if len(counts) == 1 else counts))


def bench_size(size: tuple[int, int], images: int, args: argparse.Namespace, env: dict[str, str],
               workdir: Path) -> dict:
    """All rounds of both sides on ``images`` JPEGs of ``size``; prints its runs and returns its summary."""
    src = workdir / f"src-{size[0]}x{size[1]}-{images}"
    t0 = time.perf_counter()
    make_images(src, images, size)
    size_mb = sum(p.stat().st_size for p in src.iterdir()) / 1e6
    print(f"{images} JPEGs ({size[0]}x{size[1]}, {size_mb:.1f} MB) in {src} ({time.perf_counter() - t0:.1f}s); "
          f"{os.cpu_count()} CPUs; batch size {args.batch_size}; naive actors {args.naive_actors}; "
          f"ours extra options: {args.ours_args or '-'}", flush=True)
    tag = f"{size[0]}x{size[1]}"
    runs: list[dict] = []
    tiny_runs: list[dict] = []
    tiny_src = workdir / f"src-{tag}-{args.tiny}"
    if args.tiny:
        make_images(tiny_src, args.tiny, size)
    for r in range(args.rounds):
        for side in ("ours", "naive"):
            run = run_side(side, src, workdir / f"out-{tag}-{side}-{r}", args, env)
            runs.append({**run, "round": r})
            print(f"  round {r} {side:>5}: wall {run['wall']:6.1f}s job {run['job']:6.1f}s CPU {run['cpu']:6.1f}s "
                  f"{images / run['job']:6.1f} img/s, peak PSS {run['pss'] / MIB:.0f} MiB", flush=True)
        for side in ("ours", "naive") if args.tiny else ():
            run = run_side(side, tiny_src, workdir / f"out-{tag}-{side}-tiny", args, env)
            tiny_runs.append(run)
            print(f"  round {r} {side:>5} on {args.tiny} images: job {run['job']:6.1f}s", flush=True)
    ours_top1 = top1(workdir / f"out-{tag}-ours-0", "uri")
    naive_top1 = top1(workdir / f"out-{tag}-naive-0", "path")
    if len(ours_top1) != images or len(naive_top1) != images:
        raise SystemExit(f"row counts differ from {images}: ours {len(ours_top1)}, naive {len(naive_top1)}")
    agree = sum(ours_top1[k] == naive_top1.get(k) for k in ours_top1) / len(ours_top1)

    print()
    print(f"{'run':>12} {'round':>5} {'wall s':>7} {'job s':>7} {'img/s':>7} {'CPU s':>7} {'peak PSS MiB':>12}")
    for run in runs:
        print(f"{run['side']:>12} {run['round']:>5} {run['wall']:>7.1f} {run['job']:>7.1f} "
              f"{images / run['job']:>7.1f} {run['cpu']:>7.1f} {run['pss'] / MIB:>12.0f}")
    med = {side: {k: statistics.median(run[k] for run in runs if run["side"] == side)
                  for k in ("wall", "job", "cpu", "pss")} for side in ("ours", "naive")}
    for side in ("ours", "naive"):
        m = med[side]
        print(f"{side + ' median':>12} {'':>5} {m['wall']:>7.1f} {m['job']:>7.1f} {images / m['job']:>7.1f} "
              f"{m['cpu']:>7.1f} {m['pss'] / MIB:>12.0f}")
    ratio = {k: med["naive"][k] / med["ours"][k] for k in ("wall", "job", "cpu", "pss")}
    verdict = "meets" if ratio["job"] >= GOAL_RATIO else "MISSES"
    if args.running_ray:
        print("(--running-ray: CPU s and peak PSS are the drivers' alone; the workers belong to the cluster)")
    print(f"speed-up ours vs naive (naive time / ours time, medians): job {ratio['job']:.2f}x, wall "
          f"{ratio['wall']:.2f}x ({verdict} the >= {GOAL_RATIO}x goal); CPU seconds naive/ours {ratio['cpu']:.2f}x; "
          f"top-1 agreement {agree:.1%}")
    rate = {"ours": float("nan"), "naive": float("nan")}
    if tiny_runs:
        # Fixed cost = the tiny runs' job time; per-image rate = the other images over the rest of the time.
        fixed = {side: statistics.median(t["job"] for t in tiny_runs if t["side"] == side)
                 for side in ("ours", "naive")}
        rate = {side: (images - args.tiny) / (med[side]["job"] - fixed[side])
                if med[side]["job"] - fixed[side] > 1.0 else float("nan") for side in ("ours", "naive")}
        print(f"fixed start-up (median job s on {args.tiny} images): ours {fixed['ours']:.1f}s, naive "
              f"{fixed['naive']:.1f}s; per-image rate past start-up: ours {rate['ours']:.1f} img/s, naive "
              f"{rate['naive']:.1f} img/s, ratio {rate['ours'] / rate['naive']:.2f}x (a difference of medians: "
              f"noisy when the machine is busy)")
    print(flush=True)
    return {"size": tag, "mp": size[0] * size[1] / 1e6, "images": images, "kb": size_mb * 1e3 / images,
            "ours": med["ours"]["job"], "naive": med["naive"]["job"], "ratio": ratio["job"], "cpu_ratio": ratio["cpu"],
            "pss_ratio": ratio["pss"], "rate_ratio": rate["ours"] / rate["naive"], "agree": agree}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="2000",
                        help="how many JPEGs: one count, or one per --size (default 2000)")
    parser.add_argument("--size", default="500x375",
                        help="landscape WxH of the JPEGs; several, comma-separated, run one after the other and end "
                             "with a table of ratios by size (default 500x375)")
    parser.add_argument("--rounds", type=int, default=2, help="A,B rounds, interleaved (default 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per model call, both sides (default 64)")
    parser.add_argument("--naive-actors", type=int, default=1, help="actors of the naive pipeline (default 1)")
    parser.add_argument("--ours-args", default="", help="extra 'bulk-classify run' options for our side, quoted")
    parser.add_argument("--tiny", type=int, default=16,
                        help="also run each side once on this many images to split the fixed start-up cost from "
                             "the per-image rate (default 16; 0: off)")
    parser.add_argument("--running-ray", action="store_true",
                        help="each run joins a Ray head started for it (RAY_ADDRESS), as a job on a running cluster "
                             "(`ray job submit`) does, instead of starting a local Ray: Ray's own start is then "
                             "outside both sides' times")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--interval-s", type=float, default=0.2, help="CPU sampling period (default 0.2 s)")
    parser.add_argument("--memory-interval-s", type=float, default=2.0,
                        help="memory sampling period (default 2 s: reading every Ray process's smaps_rollup costs "
                             "~45 ms of CPU, which at 0.2 s took ~12%% of this 2-core machine from the runs)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep images and outputs here (default: temp)")
    parser.add_argument("--timeout-s", type=float, default=900, help="stop a run that takes longer (default 900)")
    parser.add_argument("--naive", nargs=2, metavar=("SRC", "DEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive:
        naive_main(*args.naive, args.batch_size, args.naive_actors, args.top_k)
        return
    plan = parse_sizes(args.size, args.images)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-vs-naive-"))
    ray_tmp = Path(tempfile.mkdtemp(prefix="bcb", dir="/tmp"))  # short: Ray's socket paths must fit 107 chars
    env = ray_env(ray_tmp)
    try:
        rows = [bench_size(size, images, args, env, workdir) for size, images in plan]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if len(rows) > 1:
        print(f"{'size':>10} {'MP':>5} {'images':>6} {'KB/img':>6} {'ours s':>7} {'naive s':>7} {'ratio':>6} "
              f"{'CPU-s':>6} {'PSS':>6} {'past start-up':>13} {'top-1 agree':>11}")
        for row in rows:
            print(f"{row['size']:>10} {row['mp']:>5.2f} {row['images']:>6} {row['kb']:>6.0f} {row['ours']:>7.1f} "
                  f"{row['naive']:>7.1f} {row['ratio']:>5.2f}x {row['cpu_ratio']:>5.2f}x {row['pss_ratio']:>5.2f}x "
                  f"{row['rate_ratio']:>12.2f}x {row['agree']:>11.1%}")
        print(f"ratio: naive job time / ours (>= {GOAL_RATIO}x is the goal); CPU-s and PSS: naive / ours; past "
              "start-up: per-image rate ours / naive")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
