"""A user's ONNX model on the GPU, network alone: conversion, logits against ONNX Runtime FP32 on the CPU, the
precision gate, and img/s of the candidates at the served batch, side by side in one run.

    python tests/benchmarks/device/bench_user_networks.py [--reference] [--compile NAME,...] MODEL_DIR...

For each folder (``export_models.py`` writes them): the time ``onnx_torch.convert_checked`` takes (converting and checking against ONNX Runtime); on 8 seeded random
inputs, the converted network's FP32 and FP16 logits on the GPU against ONNX Runtime's FP32 on the CPU
(||a - b|| / ||b||, the largest absolute difference, top-1 agreement); the precision gate's verdict; then img/s of
``TopKNetwork`` (FP16, channels-last, one CUDA graph at the served batch: the classifier's own network step), and
with ``--compile`` (folder names) the same after ``torch.compile``. ``--reference`` adds torchvision's ResNet-50
built in torch (the built-in path's ``network=resnet50``) for the ratio. ``--tunings`` runs the compiled network
again per tuning, side by side: ``off`` (cuDNN's heuristics, as the served instances of one model run it) or ``on``
(cuDNN's autotuner), each with ``+freeze`` (inductor's ``freezing``: weights folded as constants) and/or ``+max``
(inductor's ``max_autotune``: each conv and matmul timed against Triton templates too). Steady windows of
``--seconds`` each; a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))


def rate(network, crop, batch: int, seconds: float, half: bool = True, compile: bool = False, row=None,
         tuning: str = "off") -> float:
    import torch
    import torch._dynamo
    import torch._inductor.config

    from pipeline.gpu.topk_network import TopKNetwork

    cudnn, *flags = tuning.split("+")
    torch.backends.cudnn.benchmark = cudnn == "on"
    torch._inductor.config.freezing = "freeze" in flags
    torch._inductor.config.max_autotune = "max" in flags
    if compile:  # each candidate compiles under its own settings, not from the last one's cached graph
        torch._dynamo.reset()
    net = TopKNetwork(network, crop=crop, device=torch.device("cuda"), half=half, batch_size=batch, cuda_graph=True,
                      top_k=5, compile=compile)
    started = time.perf_counter()
    net.warmup()
    if row is not None:
        row.update(compiled=net.compiled, compile_problem=net.compile_problem,
                   warmup_s=round(time.perf_counter() - started, 1))
    dtype = torch.float16 if half else torch.float32
    inputs = [torch.randn(batch, 3, *crop, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
              for _ in range(4)]
    for x in inputs:
        net.scores(x)
    torch.cuda.synchronize()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for x in inputs:
            net.scores(x)
        torch.cuda.synchronize()
        done += batch * len(inputs)
    return done / (time.perf_counter() - start)


def compiled_rate(network, crop, batch: int, seconds: float, row: dict, tuning: str = "off"):
    """(img/s of the compiled network, or why it failed: a candidate that fails is a row, not the end of the run;
    seconds taken, its compile included)."""
    started = time.perf_counter()
    try:
        got = round(rate(network, crop, batch, seconds, compile=True, row=row, tuning=tuning))
    except Exception as err:  # noqa: BLE001 - any failure of the candidate
        got = f"failed: {type(err).__name__}: {str(err)[:200]}"
    return got, round(time.perf_counter() - started, 1)


def logits_check(network, onnx_path: Path, crop, input_name: str) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    x = np.random.default_rng(0).standard_normal((8, 3, *crop)).astype(np.float32)
    ref = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {input_name: x})[0]
    out = {}
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        net = network.to("cuda").to(dtype).eval()
        with torch.inference_mode():
            got = net(torch.from_numpy(x).to("cuda", dtype))
            got = (got[0] if isinstance(got, (tuple, list)) else got).float().cpu().numpy()  # the class output
        out[name] = {"rel_l2": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                     "max_abs": float(np.abs(got - ref).max()), "ref_max_abs": float(np.abs(ref).max()),
                     "top1_agree": float((got.argmax(1) == ref.argmax(1)).mean())}
    network.float()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--batch", type=int, default=None, help="the served batch (default: the gpu profile's)")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--compile", default="", help="comma-separated folder names to also run after torch.compile")
    p.add_argument("--tunings", default="", help="comma-separated: off or on, +freeze, +max (the compiled network again)")
    p.add_argument("--reference", action="store_true", help="also torchvision's ResNet-50 built in torch")
    p.add_argument("--out", type=Path, default=None, help="JSON of the rows")
    opts = p.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/benchmarks: gpu_networks
    from gpu_networks import resnet50_random
    from pipeline.gpu.onnx_torch import convert_checked
    from pipeline.gpu.precision import choose_half
    from pipeline.model.folder import load_model
    from pipeline.triton.configs import GPU_TRITON_BATCH_SIZE

    batch = opts.batch or GPU_TRITON_BATCH_SIZE
    print(f"card: {torch.cuda.get_device_name()}, torch {torch.__version__}, batch {batch}", flush=True)
    rows = []
    if opts.reference:
        rows.append({"model": "resnet50 (torch)", "img_s": round(rate(resnet50_random(37), (224, 224), batch,
                                                                     opts.seconds))})
        print(rows[-1], flush=True)
    for folder in opts.models:
        bundle = load_model(folder)
        crop = tuple(bundle.spec.crop)
        t0 = time.perf_counter()
        net = convert_checked(bundle.onnx_path, bundle.spec).network
        row = {"model": folder.name, "convert_s": round(time.perf_counter() - t0, 1)}
        row["logits"] = logits_check(net, bundle.onnx_path, crop, bundle.input_name)
        gate = choose_half(net, bundle.spec, torch.device("cuda"))
        row["gate"] = {"half": gate.half, "rel_l2": gate.rel_l2, "top1_differ": gate.top1_differ}
        row["img_s"] = round(rate(net, crop, batch, opts.seconds, compile=False))
        row["img_s_fp32"] = round(rate(net, crop, batch, opts.seconds / 2, half=False, compile=False))
        if folder.name in opts.compile.split(","):
            # TopKNetwork's own compile step, as the GPU paths run it (checked against the eager network)
            row["compiled_img_s"], row["compile_s"] = compiled_rate(net, crop, batch, opts.seconds, row)
            for tuning in filter(None, opts.tunings.split(",")):
                info: dict = {}
                got, took = compiled_rate(net, crop, batch, opts.seconds, info, tuning)
                row.setdefault("tunings", {})[tuning] = {"img_s": got, "warmup_s": info.get("warmup_s"),
                                                         "compiled": info.get("compiled"), "s": took}
                print(tuning, row["tunings"][tuning], flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del net
        torch.cuda.empty_cache()
    if opts.out:
        opts.out.write_text(json.dumps(rows, indent=2))
    print()
    print(f"{'model':<22} {'convert s':>9} {'fp16 img/s':>10} {'fp32 img/s':>10} {'compiled':>9} {'gate':>5} "
          f"{'fp32 rel':>9} {'fp16 rel':>9} {'fp16 max':>9} {'|ref| max':>9} {'top1':>5}")
    for r in rows:
        lg = r.get("logits", {})
        f32, f16 = lg.get("fp32", {}), lg.get("fp16", {})
        print(f"{r['model']:<22} {r.get('convert_s', '-'):>9} {r['img_s']:>10} {r.get('img_s_fp32', '-'):>10} "
              f"{str(r.get('compiled_img_s', '-'))[:9]:>9} {str(r.get('gate', {}).get('half', '-')):>5} "
              f"{f32.get('rel_l2', 0):>9.1e} {f16.get('rel_l2', 0):>9.1e} {f16.get('max_abs', 0):>9.2e} "
              f"{f16.get('ref_max_abs', 0):>9.2f} {f16.get('top1_agree', 0):>5.2f}")


if __name__ == "__main__":
    main()
