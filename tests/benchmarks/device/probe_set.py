"""What a model set costs the GPU, without Ray or Triton: the gpu engine in process on the same JPEGs, per variant.

    python tests/benchmarks/device/probe_set.py IMAGES_DIR [--images 8192] [--seconds 12] \
        --variant builtin= --variant pair=taxonomy=default,r50=DIR ...

Each variant is NAME=MODELS: empty for the built-in model alone, one folder, or NAME=REF items joined by commas (a
model set). The engine (``--engine gpu``'s defaults: its calls at once, its batch) classifies the files held in
memory again and again for at least ``--seconds`` after one warm pass; printed per variant: img/s, the GPU's busy
% (``nvidia-smi`` every 0.25 s), the networks' precision (the classifier's start report), and img/s over the first
variant's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from pipeline.engines.registry import REGISTRY  # noqa: E402
from pipeline.model.folder import load_model  # noqa: E402
from pipeline.model.imaging import DecodeLimits  # noqa: E402


def gpu_busy(stop: threading.Event, samples: list[float]) -> None:
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
        except FileNotFoundError:  # no GPU here: the --device cpu check
            return
        if out:
            samples.append(float(out[0]))
        stop.wait(0.25)


def measure(models: str, images: list[bytes], seconds: float, options: dict) -> dict:
    refs = [item.split("=", 1) for item in models.split(",")] if models else [[None, None]]
    bundles = [load_model(ref) for _name, ref in refs]
    spec = REGISTRY["gpu"]
    engine = spec.build(bundles[0], top_k=5, limits=DecodeLimits(), options=options, more=bundles[1:])
    calls, batch = spec.calls_per_actor, spec.gpu_batch_size
    chunks = [images[i:i + batch] for i in range(0, len(images), batch)]
    try:
        with ThreadPoolExecutor(calls) as pool:
            list(pool.map(engine.classify, chunks))  # warm: graphs, compile, DALI
            samples: list[float] = []
            stop = threading.Event()
            sampler = threading.Thread(target=gpu_busy, args=(stop, samples), daemon=True)
            sampler.start()
            done, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                results = list(pool.map(engine.classify, chunks))
                done += sum(len(r) for r in results)
            wall = time.perf_counter() - started
            stop.set()
            ok = sum(r.status == "ok" for chunk in results for r in chunk)
    finally:
        report = engine.classifier.start_report() if hasattr(engine, "classifier") else ""
        engine.close()
    return {"img_s": done / wall, "window_s": wall, "gpu": sum(samples) / max(1, len(samples)), "ok": ok,
            "n": len(images), "report": report}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("images_dir")
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--variant", action="append", required=True, metavar="NAME=MODELS")
    p.add_argument("--device", help="the gpu engine's device option (cpu: a check of this script without a GPU)")
    args = p.parse_args()
    files = sorted(Path(args.images_dir).rglob("*.jpg"))[: args.images]
    images = [f.read_bytes() for f in files]
    rows = []
    for variant in args.variant:
        name, _, models = variant.partition("=")
        got = measure(models, images, args.seconds, {"device": args.device} if args.device else {})
        rows.append((name, got))
        print(f"{name}: {got['img_s']:,.0f} img/s over {got['window_s']:.1f} s, GPU {got['gpu']:.0f} %, ok "
              f"{got['ok']} of {got['n']}; {got['report']}", flush=True)
    base = rows[0][1]["img_s"]
    print(f"{'variant':<14} {'img/s':>9} {'x':>6} {'GPU %':>6}")
    for name, got in rows:
        print(f"{name:<14} {got['img_s']:>9,.0f} {got['img_s'] / base:>6.2f} {got['gpu']:>6.0f}")


if __name__ == "__main__":
    main()
