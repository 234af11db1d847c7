"""A user's model.onnx as a torch network for the GPU paths: onnxslim, then onnx2torch, shape arithmetic on the host.

The GPU paths run torch networks (FP16, channels-last, one CUDA graph per batch), and the ONNX file is the model
folder's contract, so a folder without ``model.torchscript`` is converted here, in every process that runs it:
``onnxslim`` first (torch's legacy exporter aliases shared initializers through ``Identity`` nodes, which
``onnx2torch`` cannot look up; slimming also folds constant shape arithmetic), then ``onnx2torch``. What the
converter leaves of the shape arithmetic (``Shape`` of a dynamic batch, ``Reshape``'s target, slice bounds) runs on
the CPU, as in ONNX Runtime: on the GPU each would be a host sync, which a CUDA graph cannot capture.

``unsupported_operators`` is the driver's check: an operator the converter lacks is named before Ray starts.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import onnx
import onnx2torch
import onnxslim
import torch
from onnx2torch.node_converters.registry import get_converter
from onnx2torch.node_converters.expand import OnnxExpand
from onnx2torch.node_converters.reshape import OnnxReshape
from onnx2torch.node_converters.shape import OnnxShape

from pipeline.errors import ModelError

LOG = logging.getLogger(__name__)

CONVERTER_FIX = "use --engine onnx (ONNX Runtime on the CPU) for this model"


def unsupported_operators(onnx_path: str | Path) -> list[str]:
    """The operators of the graph that ``onnx2torch`` has no converter for, as ``domain::Op (opset N)``.

    Reads the graph without its weights; the converter's registry decides, per operator and opset.
    """
    model = onnx.load(str(onnx_path), load_external_data=False)
    opsets = {o.domain: o.version for o in model.opset_import}
    missing: dict[str, None] = {}
    for node in _all_nodes(model.graph):
        domain = node.domain or ""
        try:
            get_converter(operation_type=node.op_type, version=opsets.get(domain, opsets.get("", 1)), domain=domain)
        except NotImplementedError:
            missing[f"{(domain + '::') if domain else ''}{node.op_type} (opset {opsets.get(domain, '?')})"] = None
    return list(missing)


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                yield from _all_nodes(attr.g)


def check_convertible(bundle) -> None:
    """Refuses, in one line, a model whose graph the GPU paths cannot convert (before anything is written).

    Raises:
        ModelError: the operators the converter lacks, and the engine that runs the model.
    """
    missing = unsupported_operators(bundle.onnx_path)
    if missing:
        raise ModelError(f"model {bundle.name!r} cannot run on the GPU: its graph uses {', '.join(missing)}, which "
                         f"the ONNX-to-torch converter (onnx2torch) lacks; {CONVERTER_FIX}")


def convert_onnx(onnx_path: str | Path):
    """``model.onnx`` as an eval-mode FP32 torch module on the CPU (``HostShapes`` around onnx2torch's graph).

    Raises:
        ModelError: the converter fails on the graph (the operator, and ``--engine onnx``).
    """
    model = onnx.load(str(onnx_path))
    try:
        model = onnxslim.slim(model)
    except Exception as err:  # noqa: BLE001 - slimming is an optimisation; the converter may still take the graph
        LOG.warning("onnxslim could not simplify %s (%s: %s); converting it as it is", onnx_path,
                    type(err).__name__, str(err)[:200])
    try:
        graph = onnx2torch.convert(model)
    except NotImplementedError as err:
        op = re.search(r"operation_type='([^']+)'", str(err))
        what = f"operator {op.group(1)}" if op else str(err)[:200]
        raise ModelError(f"{onnx_path} cannot run on the GPU: onnx2torch cannot convert its {what}; "
                         f"{CONVERTER_FIX}") from None
    except Exception as err:  # noqa: BLE001 - the converter's own failures: one line, with the way out
        raise ModelError(f"{onnx_path} cannot run on the GPU: converting it to torch failed ({type(err).__name__}: "
                         f"{str(err)[:200]}); {CONVERTER_FIX}") from None
    return HostShapes(graph).eval()


class HostShape(OnnxShape):
    """onnx2torch's ``Shape`` with its result on the CPU, where the shape arithmetic after it runs."""

    def forward(self, input_tensor):
        return torch.tensor(input_tensor.shape[self._start : self._end], dtype=torch.int64)


def host_ints(shape) -> list[int]:
    """A shape operand (a CPU tensor of the converted graph) as Python ints: ``torch.Size`` of a traced tensor fails
    under torch.compile, and the operand is on the CPU, so reading it waits for nothing."""
    return [int(d) for d in shape.tolist()]


class HostReshape(OnnxReshape):
    """onnx2torch's ``Reshape`` with its target read as Python ints."""

    def forward(self, input_tensor, shape):
        dims = host_ints(shape)
        return torch.reshape(input_tensor, [input_tensor.shape[i] if d == 0 else d for i, d in enumerate(dims)])


class HostExpand(OnnxExpand):
    """onnx2torch's ``Expand`` (a two-way broadcast) with its shape read as Python ints."""

    def forward(self, input_tensor, shape):
        return input_tensor * torch.ones(host_ints(shape), dtype=input_tensor.dtype, device=input_tensor.device)


# onnx2torch's modules whose shape operand the converted graph reads on the host, and their replacements.
HOST_MODULES = {OnnxShape: HostShape, OnnxReshape: HostReshape, OnnxExpand: HostExpand}


class HostShapes(torch.nn.Module):
    """A converted graph whose integer constants (shapes, axes, indices) and ``Shape`` results stay on the CPU when
    the module moves to a GPU, so that its shape arithmetic never waits for the GPU."""

    # onnx2torch runs the graph one module per ONNX node; on the GPU ``TopKNetwork`` compiles it with torch.compile,
    # which fuses them (ResNet-50 alone: twice the eager rate, docs/performance.md).
    compile_by_default = True

    def __init__(self, graph):
        super().__init__()
        for module in graph.modules():
            host = HOST_MODULES.get(type(module))
            if host is not None:
                module.__class__ = host
        self.graph = graph

    def _apply(self, fn, recurse=True):
        return super()._apply(lambda t: fn(t) if t.is_floating_point() else t, recurse)

    def forward(self, x):
        return self.graph(x)

