"""Per-layer quantization error for tests/benchmarks/int8_search.py: each weighted node's error in a QDQ model (ONNX
Runtime's ``qdq_loss_debug``), and ``quantize_excluding_worst``, which leaves the K worst nodes in float.

Leaving the worst nodes in float measured worse than none on EfficientNet-Lite0 (docs/int8.md), so the command has no
such choice; the search reaches it through ``QuantizeOptions.exclude``, which takes node names.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.errors import ConfigError  # noqa: E402
from pipeline.int8.quantize import QuantizeOptions, quantize_onnx  # noqa: E402
from pipeline.int8.quantize_nodes import WEIGHTED_OPS, calibration_reader, resolve_exclusions  # noqa: E402

# Calibration images the per-layer error runs through both models: every float tensor of one batch of 16 takes about
# 0.7 GB per model, so one batch.
LAYER_ERROR_IMAGES = 16
ACTIVATION_OPS = ("Clip", "Relu")


def check_worst(count: Any) -> int:
    """``exclude_worst``'s value, a count of nodes (0 or more)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ConfigError(f"exclude_worst {count!r} must be a number of nodes, 0 or more, e.g. 4")
    return count


def quantize_excluding_worst(model_path: Path, output_path: Path, input_name: str, calibration: np.ndarray,
                             options: QuantizeOptions, exclude_worst: int, *,
                             extra_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``quantize_onnx`` that also leaves in float the ``exclude_worst`` weighted nodes whose per-layer error is
    largest in a first quantization with ``options.exclude``; the model is then quantized again. The method it
    returns adds ``exclude_worst`` and ``worst_nodes``."""
    worst: list[dict[str, Any]] = []
    exclude = list(options.exclude)
    if check_worst(exclude_worst):
        quantize_onnx(model_path, output_path, input_name, calibration, options, extra_options=extra_options)
        nodes = resolve_exclusions(model_path, options.exclude)
        errors = layer_errors(model_path, output_path, input_name, calibration[:LAYER_ERROR_IMAGES])
        worst = [e for e in errors if e["node"] not in nodes][:exclude_worst]
        options = dataclasses.replace(options, exclude=(*nodes, *(e["node"] for e in worst)))
    method = quantize_onnx(model_path, output_path, input_name, calibration, options, extra_options=extra_options)
    return {**method, "exclude": exclude, "exclude_worst": exclude_worst, "worst_nodes": worst}


def layer_errors(model_path: Path, qdq_path: Path, input_name: str, tensors: np.ndarray) -> list[dict[str, Any]]:
    """Each weighted node's per-layer error in the QDQ model, largest first.

    ONNX Runtime's ``qdq_loss_debug`` saves every float tensor of both models on ``tensors`` (graph optimizations
    off, so the QDQ model runs as float simulation of its integers: the same on every CPU). A tensor's error is its
    SQNR in dB between the FP32 model and the QDQ model as its consumers see it (after its DequantizeLinear); a
    node's error is the noise-to-signal power ratio it adds: its output's (through a following Clip or Relu) less
    its input's. Excluded nodes add about none.
    """
    import onnx
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations, compute_signal_to_quantization_noice_ratio, modify_model_output_intermediate_tensors,
    )
    from onnxruntime.quantization.quant_utils import DEQUANT_OUTPUT_SUFFIX

    with tempfile.TemporaryDirectory(prefix=".layer-error-") as tmp:
        acts = []
        for path in (model_path, qdq_path):
            augmented = Path(tmp) / f"augmented-{len(acts)}.onnx"
            modify_model_output_intermediate_tensors(str(path), str(augmented))
            acts.append(collect_activations(str(augmented), calibration_reader(input_name, tensors)))
    fp32, qdq = acts
    graph = onnx.load(str(model_path), load_external_data=False).graph
    consumers: dict[str, list[Any]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def sqnr(name: str) -> float | None:
        seen = qdq.get(name + DEQUANT_OUTPUT_SUFFIX) or qdq.get(name)
        if name == input_name:
            return math.inf if not seen else compute_signal_to_quantization_noice_ratio(tensors, seen)
        ref = fp32.get(name)
        return compute_signal_to_quantization_noice_ratio(ref, seen) if ref and seen else None

    out = []
    for n in graph.node:
        if n.op_type not in WEIGHTED_OPS or not n.name:
            continue
        after = n.output[0]
        nxt = consumers.get(after, [])
        if len(nxt) == 1 and nxt[0].op_type in ACTIVATION_OPS:
            after = nxt[0].output[0]
        before_db, after_db = sqnr(n.input[0]), sqnr(after)
        if before_db is None or after_db is None:
            continue
        # Noise adds in power, not in dB: a node's error is the noise-to-signal power it adds to its output.
        added = 10 ** (-after_db / 10) - (10 ** (-before_db / 10) if math.isfinite(before_db) else 0.0)
        out.append({"node": n.name, "input_sqnr_db": round(min(before_db, 999.0), 2),
                    "output_sqnr_db": round(after_db, 2), "added_noise": round(added, 6)})
    out.sort(key=lambda e: -e["added_noise"])
    return out
