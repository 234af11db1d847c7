"""Rewriting a model's ONNX graph without changing what it computes: the exact normal form the GPU paths convert,
onnxslim kept only where ONNX Runtime gives the same numbers, and the graph a runtime loads to fetch an embedding.

Exporters write graphs that ONNX Runtime runs but converters trip on (omitted optional inputs written as empty names,
weights aliased through ``Identity``, a ``Clip`` whose bounds are tensors). ``normalize`` rewrites those by ONNX's own
semantics, exactly; ``faithful_slim`` is the one rule for onnxslim, which has changed the outputs of some graphs (timm's
TF-padded EfficientNets with real weights, relative L2 0.19): its graph is kept only where ONNX Runtime's outputs on a
probe batch stay within ``SLIM_TOLERANCE`` of the original's.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

LOG = logging.getLogger(__name__)

# Largest output change onnxslim may make, relative to the largest output (float32 rounding).
SLIM_TOLERANCE = 1e-4
# Protobuf's limit on one serialized message: a bigger network cannot be handed to a runtime as bytes.
PROTOBUF_LIMIT_BYTES = 2**31 - 1


def network_outputs(bundle: Any) -> tuple[str, ...]:
    """The tensors a runtime fetches from ``bundle``'s network (a ``ModelBundle``), in this order: the class output,
    then the embedding tensor where the spec declares one."""
    embedding = bundle.spec.embedding
    return (bundle.output_name,) if embedding is None else (bundle.output_name, embedding.output)


def intermediate_outputs(bundle: Any) -> tuple[str, ...]:
    """The tensors of ``network_outputs(bundle)`` that are not graph outputs of its file (read without its weights)."""
    import onnx  # noqa: PLC0415

    graph_outputs = {o.name for o in onnx.load(str(bundle.onnx_path), load_external_data=False).graph.output}
    return tuple(name for name in network_outputs(bundle) if name not in graph_outputs)


def runtime_graph(bundle: Any) -> str | bytes:
    """What a runtime (``onnxruntime.InferenceSession``, OpenVINO's ``read_model``) loads so that every tensor of
    ``network_outputs(bundle)`` is a graph output: the model's path where they all are, else the serialized graph
    with the intermediate tensors added as outputs (external data read from the folder into it).

    Raises:
        ModelError: the graph with its weights exceeds protobuf's 2 GB, so it cannot be handed over as bytes.
    """
    import onnx  # noqa: PLC0415

    from pipeline.errors import ModelError  # noqa: PLC0415

    path = str(bundle.onnx_path)
    missing = intermediate_outputs(bundle)
    if not missing:
        return path
    model = onnx.load(path, load_external_data=True)
    value_info = {v.name: v for v in model.graph.value_info}
    for name in missing:
        model.graph.output.append(value_info.get(name) or onnx.helper.make_empty_tensor_value_info(name))
    if model.ByteSize() > PROTOBUF_LIMIT_BYTES:
        raise ModelError(f"{path}: embedding {missing[0]!r} is an intermediate tensor of a network over 2 GB, which "
                         "cannot be rewritten in memory; export it as a graph output (bulk-classify model import "
                         "--embedding does)")
    return model.SerializeToString()


def normalize(model: Any) -> tuple[Any, list[str]]:
    """An exact copy of ``model`` (an ``onnx.ModelProto``, not modified) in the form converters read, and what changed.

    - trailing empty inputs (an omitted optional input, as torch's exporter writes ``Clip(x, min, '')``) are dropped;
    - an ``Identity`` of an initializer (the legacy exporter's alias of a shared weight) is replaced by that
      initializer wherever its output is read (not where it is a graph output);
    - a ``Clip`` whose bounds are computed tensors becomes ``Max``/``Min`` (the same function in ONNX's definition,
      including ``min > max``, where both give ``max``).
    """
    import onnx  # noqa: PLC0415 - a dependency of the package; kept local like the callers' other ONNX imports
    from onnx import helper  # noqa: PLC0415

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    notes: list[str] = []
    initializers = {i.name for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    constants = initializers | {o for n in graph.node if n.op_type == "Constant" for o in n.output}

    dropped = 0
    for node in graph.node:
        while node.input and node.input[-1] == "":
            node.input.pop()
            dropped += 1
    if dropped:
        notes.append(f"{dropped} omitted optional inputs dropped")

    alias = {n.output[0]: n.input[0] for n in graph.node
             if n.op_type == "Identity" and n.input and n.input[0] in initializers and n.output[0] not in outputs}
    if alias:
        kept = [n for n in graph.node if not (n.op_type == "Identity" and n.output and n.output[0] in alias)]
        for node in kept:
            for i, name in enumerate(node.input):
                if name in alias:
                    node.input[i] = alias[name]
        del graph.node[:]
        graph.node.extend(kept)
        notes.append(f"{len(alias)} Identity aliases of initializers resolved")

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    rewritten, nodes = 0, []
    for node in graph.node:
        bounds = list(node.input[1:3])
        if node.op_type != "Clip" or opset < 11 or all(b in constants for b in bounds if b):
            nodes.append(node)
            continue
        rewritten += 1
        current = node.input[0]
        for op, bound, suffix in (("Max", bounds[0] if bounds else "", "_min"),
                                  ("Min", bounds[1] if len(bounds) > 1 else "", "_max")):
            if not bound:
                continue
            out = f"{node.output[0]}{suffix}"
            nodes.append(helper.make_node(op, [current, bound], [out], name=f"{node.name}{suffix}"))
            current = out
        if current == node.input[0]:
            nodes.append(helper.make_node("Identity", [current], list(node.output), name=node.name))
        else:
            nodes[-1].output[0] = node.output[0]
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
        notes.append(f"{rewritten} Clip with computed bounds as Max/Min")
    return model, notes


def io_names(model: Any) -> tuple[str, str]:
    """The graph's one real input (not an initializer) and its first output."""
    initializers = {i.name for i in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    return inputs[0], model.graph.output[0].name


def run_onnxruntime(model: Any, batch: np.ndarray, *, fixed_batch: int | None = None,
                    every_output: bool = False) -> np.ndarray:
    """ONNX Runtime's (CPU provider, FP32) first output for ``batch`` through ``model`` (a ModelProto, serialized
    bytes or a path), or with ``every_output`` all outputs side by side, each flattened per image; a model with a
    fixed batch size runs in padded runs of exactly that size."""
    import onnxruntime as ort  # noqa: PLC0415

    source = model if isinstance(model, (bytes, str)) else (
        model.SerializeToString() if hasattr(model, "SerializeToString") else str(model))
    options = ort.SessionOptions()
    options.log_severity_level = 3  # its warnings about unused initializers are not the user's concern here
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    step = fixed_batch or len(batch)
    parts = []
    for start in range(0, len(batch), step):
        part = batch[start:start + step]
        n = len(part)
        if fixed_batch and n < fixed_batch:
            part = np.concatenate([part, np.zeros((fixed_batch - n, *part.shape[1:]), part.dtype)])
        outs = session.run(None, {name: np.ascontiguousarray(part, dtype=np.float32)})
        parts.append(np.concatenate([o[:n].reshape(n, -1) for o in outs], axis=1) if every_output else outs[0][:n])
    return np.concatenate(parts)


def faithful_slim(model: Any, probe: np.ndarray, *, fixed_batch: int | None = None,
                  tolerance: float = SLIM_TOLERANCE) -> tuple[Any | None, str]:
    """onnxslim's simplification of ``model`` where ONNX Runtime gives the original's outputs on ``probe`` (within
    ``tolerance`` of the largest output), else None; and a note saying which.

    Needs onnxslim (the ``import`` and ``gpu`` extras); without it the graph stays as it is.
    """
    import onnx  # noqa: PLC0415

    try:
        import onnxslim  # noqa: PLC0415
    except ImportError:
        return None, "onnxslim is not installed"
    try:
        slim = onnxslim.slim(onnx.ModelProto.FromString(model.SerializeToString()))
        onnx.checker.check_model(slim)
    except Exception as e:  # noqa: BLE001 - a failed simplification leaves the original graph, which is valid
        return None, f"onnxslim failed ({type(e).__name__})"
    before = run_onnxruntime(model, probe, fixed_batch=fixed_batch, every_output=True)
    try:
        after = run_onnxruntime(slim, probe, fixed_batch=fixed_batch, every_output=True)
    except Exception as e:  # noqa: BLE001 - a graph ONNX Runtime cannot run is no simplification
        return None, f"ONNX Runtime cannot run onnxslim's graph ({type(e).__name__})"
    change = float(np.abs(before - after).max() / max(1.0, float(np.abs(before).max())))
    if not np.isfinite(change) or change > tolerance:
        return None, f"onnxslim's graph changed the outputs by {change:.1e}"
    return slim, "simplified by onnxslim"

