"""Benchmark: OnnxEngine img/s on this machine by batch size and decode threads, with ratios to the first row.

Usage:
    python tests/benchmarks/bench_engine.py [--images 192] [--batch-sizes 1,4,8,32,64] [--threads 1,2]
        [--intra-op-threads N] [--big]

Inputs are the committed photos (tests/data/photos, 300-640 px JPEGs), repeated; --big upsizes them to a long
side of 1600 px first (catalog-photo size) so decoding weighs more. Also prints decode-only and model-only rates,
the two stages the engine overlaps. img/CPU-s (images per CPU-second of this process) is the figure to compare
on a machine other work is using; img/s only on an idle one.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.engines.onnx import OnnxEngine  # noqa: E402
from pipeline.model.folder import ONNX_INPUT, load_model  # noqa: E402
from pipeline.model.imaging import load_and_preprocess  # noqa: E402

PHOTOS = REPO / "tests" / "data" / "photos"


def inputs(count: int, big: bool) -> list[bytes]:
    photos = []
    for path in sorted(PHOTOS.glob("*.jpg")):
        if big:
            img = Image.open(path).convert("RGB")
            scale = 1600 / max(img.size)
            img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.BICUBIC)
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            photos.append(buf.getvalue())
        else:
            photos.append(path.read_bytes())
    return [photos[i % len(photos)] for i in range(count)]


def rate(fn, count: int, repeat: int = 3) -> tuple[float, float]:
    """(img/s of the best wall-clock run, img per CPU-second of this process over all runs).

    The second barely moves when other processes share the cores, so it is the one to compare on a busy machine.
    """
    fn()  # warm-up
    best = float("inf")
    cpu_start = time.process_time()
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return count / best, count * repeat / (time.process_time() - cpu_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=192)
    parser.add_argument("--batch-sizes", default="1,4,8,32,64")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--intra-op-threads", type=int, default=None)
    parser.add_argument("--big", action="store_true", help="upsize the photos to 1600 px long side")
    args = parser.parse_args()
    batch_sizes = [int(v) for v in args.batch_sizes.split(",")]
    thread_counts = [int(v) for v in args.threads.split(",")]

    with tempfile.TemporaryDirectory() as cache:
        bundle = load_model(None, cache_dir=Path(cache))
        images = inputs(args.images, args.big)
        mean_kb = np.mean([len(b) for b in images]) / 1024
        print(f"{len(images)} images ({'big, ' if args.big else ''}mean {mean_kb:.0f} KB), {os.cpu_count()} CPUs, "
              f"ORT intra-op threads: {args.intra_op_threads or 'default'}, load average {os.getloadavg()[0]:.1f} "
              "(numbers are only comparable on an otherwise idle machine)")

        decode_rate, decode_cpu = rate(lambda: [load_and_preprocess(b, bundle.spec) for b in images], len(images), 1)
        import onnxruntime as ort

        options = ort.SessionOptions()
        if args.intra_op_threads:
            options.intra_op_num_threads = args.intra_op_threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as OnnxEngine does
        session = ort.InferenceSession(str(bundle.onnx_path), options, providers=["CPUExecutionProvider"])
        x = np.stack([load_and_preprocess(b, bundle.spec)[0] for b in images[:64]])
        model_rate, model_cpu = rate(lambda: session.run(None, {ONNX_INPUT: x}), len(x))
        print(f"stages alone: decode+preprocess (1 thread) {decode_rate:.1f} img/s, {decode_cpu:.1f} img/CPU-s; "
              f"model (batch 64) {model_rate:.1f} img/s, {model_cpu:.1f} img/CPU-s\n")

        rows = []
        for threads in thread_counts:
            for batch in batch_sizes:
                with OnnxEngine(bundle, decode_threads=threads, max_batch=batch,
                                intra_op_threads=args.intra_op_threads) as engine:
                    rows.append((batch, threads, *rate(lambda: engine.classify(images), len(images))))
        base, base_cpu = rows[0][2], rows[0][3]
        print(f"| batch | decode threads | img/s | ratio | img/CPU-s | ratio |   (ratios vs batch {rows[0][0]}, "
              f"{rows[0][1]} thread)")
        print("|---:|---:|---:|---:|---:|---:|")
        for batch, threads, r, cpu in rows:
            print(f"| {batch} | {threads} | {r:.1f} | {r / base:.2f}x | {cpu:.1f} | {cpu / base_cpu:.2f}x |")


if __name__ == "__main__":
    main()
