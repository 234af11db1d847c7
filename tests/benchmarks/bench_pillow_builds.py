"""Two Pillow builds side by side (e.g. Pillow-SIMD against the wheel): the engine's decoding speed and its pixels.

Usage:
    python tests/benchmarks/bench_pillow_builds.py --other PYTHON [--folder DIR ...] [--images 300] [--rounds 3]

PYTHON is an interpreter whose ``PIL`` is the other build and that imports this repository's dependencies (e.g. a
virtualenv with only Pillow-SIMD installed and a ``.pth`` line ``import site; site.addsitedir(...)`` pointing at
the project's site-packages: docs/performance.md says how). Each round runs a fresh subprocess per interpreter, in
turn, over the first ``--images`` files of each folder (default: the 200 parity inputs and the sample photos):
``decode_image`` alone and ``load_and_preprocess`` (the onnx engine's decode step), one thread, ms per image; then
``OnnxEngine.classify`` as the job's actor runs it here (its calls at once, the job's ORT threads), img/s. Then, in
this interpreter, the two builds' preprocessed pixels per folder (max and mean level difference, share of values
that differ) and the built-in model's top-1 on them (all images, and decisive ones: top-1 margin >= 0.1 on this
build's pixels).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}
DECISIVE_MARGIN = 0.1


def pillow_build() -> str:
    """The distribution whose ``PIL`` this interpreter imports, e.g. "Pillow-SIMD 12.1.1.post0": the one installed
    with the version ``PIL`` reports (both builds install the same ``PIL`` package)."""
    from importlib.metadata import PackageNotFoundError, version

    import PIL

    for name in ("Pillow-SIMD", "Pillow"):
        try:
            if version(name) == PIL.__version__:
                return f"{name} {PIL.__version__}"
        except PackageNotFoundError:
            continue
    return f"PIL {PIL.__version__}"


def list_files(folders: list[Path], images: int) -> list[tuple[str, Path]]:
    out = []
    for folder in folders:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:images]
        if not files:
            raise SystemExit(f"no images in {folder}")
        out += [(folder.name, p) for p in files]
    return out


def worker(files: list[Path], arrays_out: Path | None) -> dict:
    """One interpreter's timings (and, when asked, its preprocessed inputs)."""
    from pipeline.config import RunConfig
    from pipeline.engines.onnx import SPEC, OnnxEngine
    from pipeline.model.imaging import DecodeLimits, decode_image, load_and_preprocess
    from pipeline.job.stages import actor_engine_options, actor_plan
    from pipeline.model.folder import load_model

    bundle = load_model(None)
    blobs = [p.read_bytes() for p in files]
    n = len(blobs)
    t = time.perf_counter()
    for b in blobs:
        decode_image(b)
    decode_ms = (time.perf_counter() - t) / n * 1e3
    t = time.perf_counter()
    arrays = [load_and_preprocess(b, bundle.spec, DecodeLimits())[0] for b in blobs]
    preprocess_ms = (time.perf_counter() - t) / n * 1e3
    if arrays_out:
        np.save(arrays_out, np.stack(arrays))
    cores = os.cpu_count() or 1
    config = RunConfig(source=str(files[0].parent), output="unused", engine=SPEC.name)
    actors, _cpus, _gpus = actor_plan(config, cores, 0)
    options = actor_engine_options(SPEC, config.engine_options, cores, actors, SPEC.calls_per_actor, on_gpu=False)
    engine = OnnxEngine(bundle, **options)
    engine.classify(blobs[:16])
    chunks = [blobs[i : i + 64] for i in range(0, n, 64)]
    with ThreadPoolExecutor(SPEC.calls_per_actor) as pool:
        t = time.perf_counter()
        list(pool.map(engine.classify, chunks))
        engine_rate = n / (time.perf_counter() - t)
    engine.close()
    return {"build": pillow_build(), "decode_ms": decode_ms, "preprocess_ms": preprocess_ms, "engine_img_s": engine_rate}


def top1_and_margin(arrays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from pipeline.engines.onnx import OnnxEngine
    from pipeline.model.folder import load_model

    engine = OnnxEngine(load_model(None))
    logits = np.concatenate([engine._run(arrays[i : i + 32]) for i in range(0, len(arrays), 32)])
    engine.close()
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.sort(p, 1)
    return logits.argmax(1), top[:, -1] - top[:, -2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, help="the interpreter whose PIL is the other build")
    parser.add_argument("--folder", type=Path, action="append", default=None,
                        help="images (repeatable; default: tests/data/parity/inputs and tests/data/photos)")
    parser.add_argument("--images", type=int, default=300, help="files per folder (default 300)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # FILES_JSON[:ARRAYS_NPY], in a subprocess
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        result = worker([Path(p) for p in spec["files"]], Path(spec["arrays"]) if spec["arrays"] else None)
        print(json.dumps(result))
        return
    folders = args.folder or [REPO / "tests/data/parity/inputs", REPO / "tests/data/photos"]
    files = list_files(folders, args.images)
    pythons = {"this": sys.executable, "other": args.other}
    work = Path(tempfile.mkdtemp(prefix="bench-pillow-"))
    runs: dict[str, list[dict]] = {k: [] for k in pythons}
    for r in range(args.rounds):
        for name, python in pythons.items():
            spec = work / f"{name}-{r}.json"
            arrays = work / f"{name}.npy" if r == 0 else None
            spec.write_text(json.dumps({"files": [str(p) for _, p in files], "arrays": str(arrays or "")}))
            done = subprocess.run([python, __file__, "--other", args.other, "--worker", str(spec)], cwd=REPO,
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{python} failed:\n{done.stderr[-3000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            got = runs[name][-1]
            print(f"  round {r} {got['build']:<28} decode {got['decode_ms']:.2f} ms, decode + preprocess "
                  f"{got['preprocess_ms']:.2f} ms, engine {got['engine_img_s']:.1f} img/s", flush=True)
    med = {name: {k: statistics.median(run[k] for run in rs) for k in ("decode_ms", "preprocess_ms", "engine_img_s")}
           for name, rs in runs.items()}
    builds = {name: rs[0]["build"] for name, rs in runs.items()}
    print(f"\n{len(files)} images ({', '.join(f.name for f in folders)}), {os.cpu_count()} CPUs, medians of "
          f"{args.rounds} interleaved rounds")
    print(f"{'build':<30} {'decode ms':>10} {'decode+preprocess ms':>21} {'engine img/s':>13}")
    for name in pythons:
        m = med[name]
        print(f"{builds[name]:<30} {m['decode_ms']:>10.2f} {m['preprocess_ms']:>21.2f} {m['engine_img_s']:>13.1f}")
    print(f"{'other / this':<30} {med['this']['decode_ms'] / med['other']['decode_ms']:>9.2f}x "
          f"{med['this']['preprocess_ms'] / med['other']['preprocess_ms']:>20.2f}x "
          f"{med['other']['engine_img_s'] / med['this']['engine_img_s']:>12.2f}x")

    a, b = np.load(work / "this.npy"), np.load(work / "other.npy")
    spec = json.loads(Path(REPO / "pipeline/data/efficientnet_lite0_preprocess.json").read_text())
    levels = np.abs(a - b) * np.asarray(spec["std"], np.float32)[:, None, None] / spec["scale"]  # back to 8-bit levels
    top_a, margin = top1_and_margin(a)
    top_b, _ = top1_and_margin(b)
    print(f"\npixels and top-1, {builds['other']} against {builds['this']} (decisive: margin >= {DECISIVE_MARGIN} "
          "on this build's pixels)")
    print(f"{'folder':<16} {'images':>6} {'max levels':>10} {'mean':>7} {'values differ':>13} {'top-1 =':>8} "
          f"{'decisive =':>14}")
    names = np.array([folder for folder, _ in files])
    for folder in [f.name for f in folders]:
        sel = names == folder
        lv, agree, dec = levels[sel], top_a[sel] == top_b[sel], margin[sel] >= DECISIVE_MARGIN
        print(f"{folder:<16} {sel.sum():>6} {lv.max():>10.1f} {lv.mean():>7.4f} {(lv > 0.5).mean():>12.3%} "
              f"{agree.mean():>8.2%} {agree[dec].mean():>8.2%} of {dec.sum()}")


if __name__ == "__main__":
    main()
