"""Benchmark: quantization choices of ``bulk-classify model quantize``, each judged by the gate on held-out images.

Usage:
    python tests/benchmarks/int8_search.py --folder IMAGES [--samples 800] [--calibration-images 192]
        [--eval simulate,cpu] [--candidate NAME='KEY=VALUE ...' ...] [--layer-errors] [--json FILE]

The sample is drawn as the command draws it (``draw_sample``: ranked by sha256(seed:uri), the first
``--calibration-images`` calibrate, the rest are held out and never calibrate); the images are read once. Each
candidate is a ``QuantizeOptions`` of ``pipeline/quantize.py`` written as ``KEY=VALUE`` words, plus ``exclude_worst``
(``int8_layers.py``) (``types=s8s8
method=percentile percentile=99.99 per_channel=false exclude=classifier,depthwise exclude_worst=4
calibration_images=96 quant_format=qoperator``; ``x.NAME=VALUE`` is an ONNX Runtime ``extra_options`` entry, e.g.
``x.ActivationSymmetric=true``; ``pre_process=true`` quantizes the output of ONNX Runtime's ``quant_pre_process``
instead of the FP32 model itself); its model is quantized by ``quantize_onnx`` and compared with FP32 by
``pipeline/int8/gate.py``'s ``gate`` on the held-out images, in each ``--eval`` mode:

* ``cpu``: ONNX Runtime with its default graph optimizations, as the command's gate runs it: the integer kernels of
  the CPU in use (on x86 without VNNI, u8s8 and s8s8 saturate);
* ``simulate``: graph optimizations off, so each DequantizeLinear feeds a float op: the fake-quant result that
  integer kernels without saturation (VNNI, AMX, ARM's dot products) reproduce up to rounding. A proxy for choosing
  on a CPU that cannot run the integers faithfully; never what the command's gate judges.

Printed: one row per candidate and mode: top-1 agreement, decisive agreement (of how many), top-5 overlap, gated
classes below the class threshold (of how many) and the worst three, quantize and evaluate seconds.
``--layer-errors`` prints the per-layer error (``layer_errors``) of the first candidate's model.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from pipeline.config import DEFAULT_EXTENSIONS  # noqa: E402
from pipeline.int8.gate import GateThresholds, gate  # noqa: E402
from pipeline.model.folder import load_model  # noqa: E402
from pipeline.int8.quantize import EVAL_BATCH, QuantizeOptions, draw_sample, load_tensors  # noqa: E402
from pipeline.int8.quantize_nodes import CALIBRATION_BATCH  # noqa: E402

from int8_layers import check_worst, layer_errors, quantize_excluding_worst  # noqa: E402

EVAL_MODES = ("simulate", "cpu")
DEFAULT_CANDIDATES = ("default=",)


class Candidate(NamedTuple):
    """One ``--candidate``: its name, QuantizeOptions, whether to pre-process first, the worst nodes to leave in
    float and ONNX Runtime ``extra_options`` entries."""

    name: str
    options: QuantizeOptions
    pre_process: bool
    exclude_worst: int
    extra_options: dict


def parse_candidate(text: str) -> Candidate:
    """``NAME=KEY=VALUE KEY=VALUE ...`` as a Candidate."""
    name, _, words = text.partition("=")
    fields: dict = {}
    pre = False
    worst = 0
    extra: dict = {}
    for word in shlex.split(words):
        key, _, raw = word.partition("=")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    pass
        if key == "pre_process":
            pre = bool(value)
        elif key == "exclude_worst":
            worst = check_worst(value)
        elif key.startswith("x."):
            extra[key[2:]] = value
        elif key == "exclude":
            fields[key] = tuple(raw.split(","))
        else:
            fields[key] = value
    return Candidate(name, QuantizeOptions(**fields), pre, worst, extra)


def logits(model_path: Path, input_name: str, output_name: str, tensors: np.ndarray, mode: str) -> np.ndarray:
    """Logits through ONNX Runtime on 2 threads, graph optimizations off in ``simulate`` mode."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if mode == "simulate":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model_path), sess_options=options, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run([output_name], {input_name: tensors[i:i + EVAL_BATCH]})[0]
                           for i in range(0, len(tensors), EVAL_BATCH)])


def row(name: str, mode: str, figures: dict, t: GateThresholds, quantize_s: float, eval_s: float) -> str:
    below = [c for c in figures["classes"] if c["agreement"] < t.min_class_agreement]
    worst = ", ".join(f"{c['label']} {c['agreement']:.0%}" for c in figures["classes"][:3]) or "-"
    return (f"{name:<28} {mode:<8} {figures['top1_agreement']:7.2%} {figures['decisive_agreement']:7.2%} "
            f"({figures['decisive_images']}) {figures['top5_overlap']:6.2%} {len(below):>2}/{figures['classes_gated']:<2} "
            f"{quantize_s:6.1f} {eval_s:6.1f}  {worst}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="images to sample (a folder the job reads)")
    parser.add_argument("--samples", type=int, default=800)
    parser.add_argument("--calibration-images", type=int, default=192,
                        help="the sample's calibration part (a candidate's calibration_images below it uses fewer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval", default="simulate,cpu", help=f"comma-separated of {', '.join(EVAL_MODES)}")
    parser.add_argument("--candidate", action="append", default=None, metavar="NAME='KEY=VALUE ...'")
    parser.add_argument("--layer-errors", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per row here")
    args = parser.parse_args()
    modes = [m for m in args.eval.split(",") if m]
    if not modes or set(modes) - set(EVAL_MODES):
        parser.error(f"--eval: comma-separated of {', '.join(EVAL_MODES)}")
    candidates = [parse_candidate(c) for c in (args.candidate or DEFAULT_CANDIDATES)]

    bundle = load_model(None)
    t = GateThresholds()
    t0 = time.perf_counter()
    sample = draw_sample(args.folder, {}, samples=args.samples, calibration_images=args.calibration_images,
                         seed=args.seed, extensions=DEFAULT_EXTENSIONS)
    cal, _, _ = load_tensors([e[0] for e in sample.calibration], {}, bundle.spec)
    held, _, _ = load_tensors([e[0] for e in sample.held_out], {}, bundle.spec)
    fp32 = logits(bundle.onnx_path, bundle.input_name, bundle.output_name, held, "cpu")
    print(f"{len(cal)} calibration, {len(held)} held-out images of {args.folder} ({sample.listed} listed), read and "
          f"FP32 in {time.perf_counter() - t0:.1f} s; thresholds: decisive >= {t.min_decisive_agreement:.0%}, "
          f"classes of >= {t.min_class_images} images >= {t.min_class_agreement:.0%}", flush=True)
    print(f"{'candidate':<28} {'eval':<8} {'top-1':>7} {'decisive':>7} {'':5} {'top-5':>6} {'<95%':>5} "
          f"{'quant':>6} {'eval s':>6}  worst classes", flush=True)
    with tempfile.TemporaryDirectory(prefix="int8-search-") as tmp:
        for index, (name, options, pre, worst, extra) in enumerate(candidates):
            n = options.calibration_images // CALIBRATION_BATCH * CALIBRATION_BATCH
            path = Path(tmp) / f"{index}.onnx"
            t1 = time.perf_counter()
            source = bundle.onnx_path
            if pre:
                from onnxruntime.quantization.shape_inference import quant_pre_process

                source = Path(tmp) / f"{index}-pre.onnx"
                quant_pre_process(str(bundle.onnx_path), str(source))
            method = quantize_excluding_worst(source, path, bundle.input_name, cal[:n], options, worst,
                                              extra_options=extra)
            quantize_s = time.perf_counter() - t1
            for mode in modes:
                t2 = time.perf_counter()
                int8 = logits(path, bundle.input_name, bundle.output_name, held, mode)
                figures = gate(fp32, int8, t, bundle.labels)["figures"]
                print(row(name, mode, figures, t, quantize_s, time.perf_counter() - t2), flush=True)
                if args.json:
                    with args.json.open("a") as f:
                        f.write(json.dumps({"candidate": name, "eval": mode, "folder": args.folder,
                                            "calibration": n, "held_out": len(held), "method": method,
                                            "figures": {k: v for k, v in figures.items() if k != "classes"},
                                            "classes": figures["classes"]}) + "\n")
            if method.get("worst_nodes"):
                print(f"  {name}: left in float by per-layer error: "
                      + ", ".join(f"{w['node']} {w['added_noise']:.4f}" for w in method["worst_nodes"]))
            if args.layer_errors and index == 0:
                errors = layer_errors(bundle.onnx_path, path, bundle.input_name, cal[:16])
                print(f"  per-layer error of {name} (noise-to-signal power added; input -> output SQNR dB), "
                      "largest first:")
                for e in errors:
                    print(f"    {e['node']:<36} {e['added_noise']:8.5f}  {e['input_sqnr_db']:6.1f} -> "
                          f"{e['output_sqnr_db']:6.1f}")


if __name__ == "__main__":
    main()
