"""Which nodes of a model stay in float when it is quantized (the exclusion keywords), and the calibration reader
ONNX Runtime's quantization runs on."""

from __future__ import annotations

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
WEIGHTED_OPS = ("Conv", "Gemm", "MatMul")
POOL_OPS = ("GlobalAveragePool", "ReduceMean")


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
