"""Which nodes of a model stay in float when it is quantized: the exclusion keywords and the per-layer error (ONNX
Runtime's ``qdq_loss_debug``) that ``QuantizeOptions.exclude_worst`` ranks nodes by; and the calibration reader both
quantizations and the per-layer error run on."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import numpy as np

from pipeline.errors import ConfigError

# The first conv on the input, the last conv before the global pooling, every depthwise conv (group > 1), the global
# pooling before the classifier, the last weighted node (the logits).
EXCLUDE_KEYWORDS = ("stem", "head", "depthwise", "pool", "classifier")
# Images per calibration batch. Every batch must have this many: ONNX Runtime's histogram calibrators (entropy,
# percentile) stack the batches' outputs and fail on a shorter last one, so the calibration part is cut to a multiple.
CALIBRATION_BATCH = 16
# Calibration images the per-layer error (exclude_worst) runs through both models: every float tensor of one batch of
# 16 takes about 0.7 GB per model, so one batch.
LAYER_ERROR_IMAGES = 16
WEIGHTED_OPS = ("Conv", "Gemm", "MatMul")
POOL_OPS = ("GlobalAveragePool", "ReduceMean")
ACTIVATION_OPS = ("Clip", "Relu")


def resolve_exclusions(model_path: Path, exclude: Sequence[str]) -> list[str]:
    """Node names to leave in float: names as given, the EXCLUDE_KEYWORDS looked up in the graph."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    names = {n.name for n in graph.node}
    inputs = {i.name for i in graph.input} - {i.name for i in graph.initializer}
    out: list[str] = []
    for item in exclude:
        if item == "depthwise":
            found = [n.name for n in graph.node if n.op_type == "Conv"
                     and any(a.name == "group" and a.i > 1 for a in n.attribute)]
            if not found:
                raise ConfigError(f"--exclude depthwise: {model_path} has no grouped conv; drop it from --exclude")
            out.extend(found)
            continue
        if item == "stem":
            found = next((n.name for n in graph.node if n.op_type == "Conv" and set(n.input) & inputs), None)
        elif item == "head":
            pool_at = next((i for i in range(len(graph.node) - 1, -1, -1)
                            if graph.node[i].op_type in POOL_OPS), len(graph.node))
            found = next((n.name for n in reversed(graph.node[:pool_at]) if n.op_type == "Conv"), None)
        elif item == "pool":
            found = next((n.name for n in reversed(graph.node) if n.op_type in POOL_OPS), None)
        elif item == "classifier":
            outputs = {o.name for o in graph.output}
            found = next((n.name for n in reversed(graph.node)
                          if n.op_type in WEIGHTED_OPS and set(n.output) & outputs), None)
            if found is None:  # logits behind a reshape or an add: the last weighted node
                found = next((n.name for n in reversed(graph.node) if n.op_type in WEIGHTED_OPS), None)
        else:
            found = item if item in names else None
            if found is None:
                raise ConfigError(f"--exclude {item!r} is not a node of {model_path}; give node names or "
                                  f"{' / '.join(EXCLUDE_KEYWORDS)}")
        if found is None:
            raise ConfigError(f"--exclude {item}: {model_path} has no such node; drop it from --exclude")
        if not found:
            raise ConfigError(f"--exclude {item}: that node of {model_path} has no name; name it, or drop it")
        out.append(found)
    return sorted(set(out))


class _Reader:
    """A CalibrationDataReader over preprocessed images, CALIBRATION_BATCH at a time."""

    def __init__(self, input_name: str, tensors: np.ndarray):
        self.input_name, self.tensors, self.at = input_name, tensors, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.at >= len(self.tensors):
            return None
        batch = self.tensors[self.at:self.at + CALIBRATION_BATCH]
        self.at += CALIBRATION_BATCH
        return {self.input_name: batch}

    def rewind(self) -> None:
        self.at = 0


def calibration_reader(input_name: str, tensors: np.ndarray) -> Any:
    """A ``_Reader`` that is an ONNX Runtime ``CalibrationDataReader`` (imported only when quantizing)."""
    from onnxruntime.quantization import CalibrationDataReader

    return type("CalibrationReader", (_Reader, CalibrationDataReader), {})(input_name, tensors)


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
