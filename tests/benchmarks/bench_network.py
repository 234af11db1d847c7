"""The default network alone: each EfficientNet-Lite0 layout against timm's, img/s and top-1 parity, in one run.

The layouts are ``lite0_layouts.LITE0_LAYOUTS``: one definition from the checkpoint, differing only
in how TF's "SAME" padding is computed ("explicit" writes every pad out with ``F.pad``; the others fold the pads into
the convs). For each layout, and for timm's ``efficientnet_lite0`` and ``tf_efficientnet_lite0`` (random weights,
the same architecture: reference rates only), it prints:

- img/s at each batch (default 128 and 256): ``TopKNetwork`` as the gpu engine and the gpu profile's network model
  run it (channels-last, FP16, CUDA graph, softmax + top-5, cuDNN's autotuner on unless ``--cudnn off``), on a
  ready batch; each timed window at least ``--seconds`` long;
- exactness: max |logit - explicit layout's logit| in FP32 on the CPU (``--cpu-check`` images of the parity set) and
  on the device (FP32, no TF32, the whole parity set), and max |logit - ONNX Runtime's| on the device;
- parity: top-1 agreement of the FP16 network (batch 128 CUDA graph) with ONNX Runtime on the CPU (the repository's
  ONNX build of the default model) over image_sets.py's 520-image parity set (``make_set(520, "varied", 10_000)``),
  both fed the reference preprocessing (``pipeline.model.imaging``), so only the network differs; each disagreement's
  margin is ONNX Runtime's probability of its own top-1 minus its probability of the network's top-1 (a near-tie
  is < 0.01).

A layout that fails prints its error in its row and the run goes on. Rows past ``--budget-s`` are skipped.

Usage (repository root; the H200: < 3 minutes)::

    python tests/benchmarks/bench_network.py [--out DIR]
    python tests/benchmarks/bench_network.py --device cpu --quick    # the script itself, on a laptop
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from image_sets import make_set  # noqa: E402

from pipeline.model.default_model import DEFAULT_SPEC, load_checkpoint  # noqa: E402
from lite0_layouts import (  # noqa: E402
    DEFAULT_LITE0_LAYOUT,
    LITE0_LAYOUTS,
    REFERENCE_LITE0_LAYOUT,
    layout_network,
)
from pipeline.model.imaging import decode_image, preprocess_image  # noqa: E402

LOG = logging.getLogger("bench_network")
TIMM_MODELS = ("efficientnet_lite0", "tf_efficientnet_lite0")
GOAL_IMG_S = 28_000  # issue 26: the default network alone, FP16, at its batch
GOAL_TOP1 = 0.99
NEAR_TIE = 0.01
PARITY_BATCH = 128
TOP_K = 5


def reference_inputs(blobs: list[bytes]) -> np.ndarray:
    """The reference preprocessing (Pillow) of each file, float32 NCHW, as the onnx engine feeds ONNX Runtime."""
    with ThreadPoolExecutor(8) as pool:
        return np.stack(list(pool.map(lambda b: preprocess_image(decode_image(b), DEFAULT_SPEC), blobs)))


def onnx_file_or_export(torch, onnx_file: Path | None, weights, folder: Path) -> tuple[Path, str]:
    """The default model's ONNX build (pipeline.model.folder.load_model), or where that cannot run (no ``onnx`` package),
    torch's export of the explicit layout; with a line saying which."""
    if onnx_file is not None:
        return onnx_file, f"{onnx_file} (--onnx)"
    try:
        from pipeline.model.folder import load_model

        path = load_model(None).onnx_path
        return path, f"{path} (the repository's ONNX build)"
    except Exception as e:  # noqa: BLE001 - fall back, and say so in the table's heading
        LOG.warning("load_model failed (%s); exporting the explicit layout with torch.onnx instead", e)
        path = folder / "lite0_explicit.onnx"
        net = layout_network(weights, REFERENCE_LITE0_LAYOUT)
        torch.onnx.export(net, (torch.zeros(1, 3, *DEFAULT_SPEC.crop),), str(path), input_names=["input"],
                          output_names=["logits"], dynamic_axes={"input": {0: "n"}}, dynamo=False)
        return path, f"torch.onnx export of the explicit layout (load_model failed: {str(e).splitlines()[0][:120]})"


def onnx_logits(x: np.ndarray, onnx_file: Path) -> np.ndarray:
    """ONNX Runtime (CPU) logits over ``x``."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i : i + 64]})[0] for i in range(0, len(x), 64)])


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(torch, device, step, images_per_step: int, min_s: float) -> float:
    """img/s of ``step`` over one window of at least ``min_s`` seconds (after one untimed step)."""
    step()
    sync(torch, device)
    steps, t0 = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        sync(torch, device)
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return steps * images_per_step / dt


def topk_network(torch, net, device, *, batch: int, half: bool):
    from pipeline.gpu.topk_network import TopKNetwork

    tk = TopKNetwork(net, crop=DEFAULT_SPEC.crop, device=device, half=half, batch_size=batch,
                     cuda_graph=device.type == "cuda", top_k=TOP_K)
    tk.warmup()
    return tk


def throughput(torch, net, device, *, batch: int, half: bool, seconds: float, replays: int):
    """img/s of ``TopKNetwork.scores`` on a ready channels-last batch; also returns the TopKNetwork."""
    tk = topk_network(torch, net, device, batch=batch, half=half)
    x = torch.randn(batch, 3, *DEFAULT_SPEC.crop, device=device).to(tk.dtype)
    x = x.contiguous(memory_format=torch.channels_last)

    def step():
        for _ in range(replays):
            tk.scores(x)

    return rate(torch, device, step, replays * batch, seconds), tk


def device_logits(torch, module, device, x: np.ndarray, *, half: bool, batch: int) -> np.ndarray:
    """Logits over ``x`` in chunks of ``batch``: ``module`` a TopKNetwork (its graph) or a torch module (FP32)."""
    out = []
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            chunk = torch.from_numpy(x[i : i + batch]).to(device)
            chunk = chunk.to(torch.float16 if half else torch.float32).contiguous(memory_format=torch.channels_last)
            y = module.run(chunk) if hasattr(module, "run") else module(chunk)
            out.append(y.float().cpu().numpy())
    return np.concatenate(out)


def fp32_logits(torch, net, device, x: np.ndarray, batch: int) -> np.ndarray:
    """FP32 logits on ``device`` (no TF32), without cudnn's autotuner: a check of values, not of speed."""
    import copy

    module = copy.deepcopy(net).to(device).float().to(memory_format=torch.channels_last).eval()
    tuned, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, False
    try:
        return device_logits(torch, module, device, x, half=False, batch=batch)
    finally:
        torch.backends.cudnn.benchmark = tuned


def parity(logits: np.ndarray, ref_logits: np.ndarray) -> dict:
    """Top-1 agreement with the reference, and the reference's margin (its top-1's probability minus that of our
    top-1) for each disagreement."""
    p_ref = softmax(ref_logits.astype(np.float64))
    top_ref, top = ref_logits.argmax(1), logits.argmax(1)
    wrong = np.nonzero(top_ref != top)[0]
    margins = [round(float(p_ref[i, top_ref[i]] - p_ref[i, top[i]]), 4) for i in wrong]
    return {"agree": float((top_ref == top).mean()), "disagreements": len(wrong), "margins": margins,
            "images": [int(i) for i in wrong]}


def build_rows(torch, args, weights) -> list[tuple[str, object]]:
    """(name, torch module, or the exception that stopped it) per row, most needed first, so that a run cut short by
    the budget still has them: the reference layout, the default, timm's efficientnet_lite0, the other layouts,
    timm's tf_efficientnet_lite0."""
    names = [n for n in args.layouts.split(",") if n] if args.layouts else list(LITE0_LAYOUTS)
    first = [n for n in (REFERENCE_LITE0_LAYOUT, DEFAULT_LITE0_LAYOUT) if n in names]
    order = first + ([] if args.no_timm else [f"timm {TIMM_MODELS[0]}"])
    order += [n for n in names if n not in first] + ([] if args.no_timm else [f"timm {m}" for m in TIMM_MODELS[1:]])
    rows: list[tuple[str, object]] = []
    for name in order:
        try:
            if name.startswith("timm "):
                import timm

                torch.manual_seed(0)
                rows.append((name, timm.create_model(name.removeprefix("timm "), pretrained=False).eval()))
            else:
                rows.append((name, layout_network(weights, name)))
        except Exception as e:  # noqa: BLE001 - a broken layout, or timm missing: a row with its error
            rows.append((name, e))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (GPU 0) or cpu")
    p.add_argument("--quick", action="store_true",
                   help="a check of the script: batches 2,4, 0.2 s windows, 8 parity images, 2 CPU-check images, "
                        "no time budget")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 128,256)")
    p.add_argument("--seconds", type=float, default=None, help="each timed window at least this long (default 2)")
    p.add_argument("--replays", type=int, default=10, help="network calls per timed step")
    p.add_argument("--count", type=int, default=None, help="images of the parity set (default 520)")
    p.add_argument("--cpu-check", type=int, default=None, help="parity images for the FP32 CPU check (default 16)")
    p.add_argument("--layouts", default="", help="comma-separated LITE0_LAYOUTS names (default: all)")
    p.add_argument("--no-timm", action="store_true", help="leave out timm's rows")
    p.add_argument("--cudnn", choices=("benchmark", "off"), default="benchmark",
                   help="cuDNN's autotuner on (the in-process engine's choice) or off (the served instances')")
    p.add_argument("--onnx", type=Path, default=None, help="the default model's ONNX file (default: load_model)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip rows not started this many seconds after the start (default 150; --quick: none)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench_network.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    batches = [int(b) for b in (args.batches or ("2,4" if args.quick else "128,256")).split(",")]
    seconds = args.seconds if args.seconds is not None else (0.2 if args.quick else 2.0)
    count = args.count if args.count is not None else (8 if args.quick else 520)
    cpu_count = args.cpu_check if args.cpu_check is not None else (2 if args.quick else 16)
    budget_s = args.budget_s if args.budget_s is not None else (float("inf") if args.quick else 150.0)
    replays = 1 if args.quick else args.replays
    t_start = time.perf_counter()

    import torch

    from pipeline.gpu.classifier import DEFAULT_CUDA_SYNC
    from pipeline.gpu.cuda_sync import use_cuda_device

    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    use_cuda_device(torch, device, DEFAULT_CUDA_SYNC, autotune=args.cudnn == "benchmark")
    half = device.type == "cuda"
    torch.backends.cudnn.allow_tf32 = False  # FP32 comparisons in true FP32; the FP16 timing does not use TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    LOG.info("torch %s on %s", torch.__version__, gpu)

    blobs = make_set(count, "varied", 10_000)
    x = reference_inputs(blobs)
    weights = load_checkpoint()
    ref_logits = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            onnx_file, onnx_source = onnx_file_or_export(torch, args.onnx, weights, Path(tmp))
            ref_logits = onnx_logits(x, onnx_file)
    except Exception as e:  # noqa: BLE001 - the rates still come out; the parity columns say why they are empty
        onnx_source = f"NO ONNX Runtime reference ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
        LOG.warning("%s", traceback.format_exc())
    LOG.info("parity set: %d JPEGs, ONNX Runtime logits from %s (%.0f s so far)", len(blobs), onnx_source,
             time.perf_counter() - t_start)
    rows = build_rows(torch, args, weights)
    reference = dict(rows).get(REFERENCE_LITE0_LAYOUT)
    if reference is None or isinstance(reference, Exception):
        reference = layout_network(weights, REFERENCE_LITE0_LAYOUT)
    x_cpu = torch.from_numpy(x[:cpu_count])
    with torch.inference_mode():
        ref_cpu = reference(x_cpu).numpy()
    ref_dev = fp32_logits(torch, reference, device, x, PARITY_BATCH)

    if device.type == "cuda":  # clocks and cudnn's lazy set-up before the first timed row
        throughput(torch, reference, device, batch=batches[0], half=half, seconds=1.0, replays=replays)
    results = []
    for name, net in rows:
        row = {"network": name, "img_s": {}, "error": ""}
        results.append(row)
        if isinstance(net, Exception):
            row["error"] = f"{type(net).__name__}: {net}"
            continue
        if time.perf_counter() - t_start > budget_s:
            row["error"] = f"skipped: past --budget-s {budget_s:.0f}"
            continue
        layout = not name.startswith("timm ")
        try:
            if layout:
                with torch.inference_mode():
                    row["cpu_fp32_max_diff"] = float(np.abs(net(x_cpu).numpy() - ref_cpu).max())
                logits32 = fp32_logits(torch, net, device, x, PARITY_BATCH)
                row["device_fp32_max_diff"] = float(np.abs(logits32 - ref_dev).max())
                row["device_fp32_vs_onnx_max_diff"] = (float(np.abs(logits32 - ref_logits).max())
                                                       if ref_logits is not None else float("nan"))
            parity_batch = PARITY_BATCH if PARITY_BATCH in batches else batches[0]
            for b in batches:
                r, tk = throughput(torch, net, device, batch=b, half=half, seconds=seconds, replays=replays)
                row["img_s"][b] = r
                if layout and ref_logits is not None and b == parity_batch:
                    logits16 = device_logits(torch, tk, device, x, half=half, batch=b)
                    row["parity"] = parity(logits16, ref_logits)
                del tk
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - one failing row must not end the run
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            LOG.warning("%s failed:\n%s", name, traceback.format_exc())
        LOG.info("%s: %s", name, {k: v for k, v in row.items() if k != "network"})

    drift = {}
    for name in (REFERENCE_LITE0_LAYOUT, DEFAULT_LITE0_LAYOUT):  # the first rows again: how much the GPU drifted
        net, first = dict(rows).get(name), next((r for r in results if r["network"] == name), {})
        if isinstance(net, Exception) or not first.get("img_s") or time.perf_counter() - t_start > budget_s:
            continue
        try:
            again, _ = throughput(torch, net, device, batch=batches[-1], half=half, seconds=seconds, replays=replays)
            drift[name] = (first["img_s"][batches[-1]], again)
        except Exception as e:  # noqa: BLE001
            LOG.warning("re-timing %s failed: %s", name, e)
    report(results, batches, drift, gpu=gpu, torch_version=torch.__version__, count=len(blobs), half=half,
           cudnn=args.cudnn, seconds=seconds, onnx_source=onnx_source, wall_s=time.perf_counter() - t_start)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_network.json").write_text(json.dumps(
            {"gpu": gpu, "torch": torch.__version__, "batches": batches, "seconds": seconds, "onnx": onnx_source,
             "rows": results, "retimed": drift},
            indent=2, default=str))
    return 0


def report(results: list[dict], batches: list[int], drift: dict, *, gpu: str, torch_version: str, count: int,
           half: bool, seconds: float, onnx_source: str, wall_s: float, cudnn: str = "benchmark") -> None:
    """The table, then one line per answer the issue asks for."""
    by_name = {r["network"]: r for r in results}
    base = by_name.get(REFERENCE_LITE0_LAYOUT, {}).get("img_s", {})
    timm = by_name.get(f"timm {TIMM_MODELS[0]}", {}).get("img_s", {})
    how = ("FP16, CUDA graph" if half else "FP32, no CUDA graph") + f", cuDNN {cudnn}"
    print(f"\nbench_network: {gpu}, torch {torch_version}, TopKNetwork ({how}, channels-last, softmax + "
          f"top-{TOP_K}), windows >= {seconds:g} s; parity: {count} images vs ONNX Runtime CPU on {onnx_source}\n")
    cols = " | ".join(f"img/s b{b}" for b in batches)
    print(f"| network | {cols} | vs explicit (b{batches[-1]}) | vs timm (b{batches[-1]}) | CPU FP32 max dlogit vs "
          f"explicit | device FP32 max dlogit vs explicit / vs ORT | top-1 vs ORT | disagreements: ORT margins |")
    print("|---|" + "---|" * len(batches) + "---|---|---|---|---|---|")
    for r in results:
        name = r["network"] + (" (default)" if r["network"] == DEFAULT_LITE0_LAYOUT else "")
        if r["error"] and not r["img_s"]:
            print(f"| {name} | " + " | ".join("-" for _ in batches) + f" | - | - | - | - | - | {r['error']} |")
            continue
        rates = " | ".join(_rate(r["img_s"].get(b)) for b in batches)
        last = r["img_s"].get(batches[-1])
        vs_base = f"{last / base[batches[-1]]:.3f}x" if last and base.get(batches[-1]) else "-"
        vs_timm = f"{last / timm[batches[-1]]:.3f}x" if last and timm.get(batches[-1]) else "-"
        cpu = f"{r['cpu_fp32_max_diff']:.2e}" if "cpu_fp32_max_diff" in r else "-"
        dev = (f"{r['device_fp32_max_diff']:.2e} / {r['device_fp32_vs_onnx_max_diff']:.2e}"
               if "device_fp32_max_diff" in r else "-")
        par = r.get("parity")
        agree = f"{par['agree'] * 100:.2f}%" if par else "-"
        margins = (f"{par['disagreements']}: {', '.join(map(str, par['margins'])) or '-'}" if par else "-")
        if r["error"]:
            margins += f" ({r['error']})"
        print(f"| {name} | {rates} | {vs_base} | {vs_timm} | {cpu} | {dev} | {agree} | {margins} |")

    exact = [r for r in results if not r["network"].startswith("timm ") and r["img_s"] and not r["error"]
             and r.get("cpu_fp32_max_diff", 1.0) < 1e-3 and r.get("device_fp32_max_diff", 1.0) < 1e-3]
    print()
    for b in batches:
        timed = [r for r in exact if b in r["img_s"]]
        if timed:
            best = max(timed, key=lambda r: r["img_s"][b])
            t = f", {best['img_s'][b] / timm[b]:.3f}x timm" if timm.get(b) else ""
            print(f"fastest exact layout at batch {b}: {best['network']} {_rate(best['img_s'][b])} img/s{t}")
    default = by_name.get(DEFAULT_LITE0_LAYOUT)
    if default and default["img_s"] and default.get("parity"):
        best_rate = max(default["img_s"].values())
        par = default["parity"]
        near = all(m < NEAR_TIE for m in par["margins"])
        print(f"default layout {DEFAULT_LITE0_LAYOUT}: {_rate(best_rate)} img/s (goal {GOAL_IMG_S:,}: "
              f"{'met' if best_rate >= GOAL_IMG_S else 'NOT met'}), top-1 {par['agree'] * 100:.2f}% (goal "
              f"{GOAL_TOP1 * 100:.0f}%: {'met' if par['agree'] >= GOAL_TOP1 else 'NOT met'}), disagreements "
              f"{par['disagreements']}, all near-ties (< {NEAR_TIE}): {'yes' if near else 'NO'}")
    else:
        missing = "no result (see its row)" if default else "not in this run"
        print(f"default layout {DEFAULT_LITE0_LAYOUT}: {missing}")
    for name, (first, again) in drift.items():
        print(f"re-timed at the end, batch {batches[-1]}: {name} {_rate(again)} img/s (first {_rate(first)}, "
              f"{again / first:.3f}x)")
    print(f"to make another layout the default: build it in pipeline/gpu/lite0.py; "
          f"wall {wall_s:.0f} s")


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
