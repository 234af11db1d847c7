"""A user's model.onnx as a torch network for the GPU paths, checked against ONNX Runtime before it runs.

The GPU paths run torch networks (FP16, channels-last, one CUDA graph per batch), and the ONNX file is the model
folder's contract, so a folder without ``model.torchscript`` is converted here by ``onnx2torch``: onnxslim's
graph where ONNX Runtime says slimming kept the outputs (its folded shape arithmetic compiles into one graph), else
the graph in its exact normal form (``pipeline.model.onnx_graph.normalize``: omitted optional inputs, aliased
weights, ``Clip`` with computed bounds). What the converter leaves of the shape arithmetic (``Shape`` of a dynamic batch, ``Reshape``'s target, slice bounds) runs on
the CPU, as in ONNX Runtime: on the GPU each would be a host sync, which a CUDA graph cannot capture.

A converted network is used only after its FP32 outputs on the reference batch (the sample photos of
``pipeline/data/sample`` through the model's own preprocessing, plus seeded tensors) agree with ONNX Runtime's on the
same tensors (``CONVERSION_REL_L2``, and every clearly decided top-1 class). A model whose spec declares an embedding
is converted with its graph's outputs set to the class output, then the embedding's tensor (an intermediate one
becomes an output), so the network returns both, and its embedding is held to ONNX Runtime's the same way. The batch and ONNX Runtime's outputs
travel with the network (``OnnxReference``), so that each GPU instance checks the network it actually runs
(compiled, FP16 or FP32, in its CUDA graph) against them before it classifies anything.

``unsupported_operators`` is the driver's first check: an operator the converter lacks is named before Ray starts.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx2torch
import torch
from onnx2torch.node_converters.constant_of_shape import OnnxConstantOfShape
from onnx2torch.node_converters.expand import OnnxExpand
from onnx2torch.node_converters.pad import OnnxPadDynamic
from onnx2torch.node_converters.registry import get_converter
from onnx2torch.node_converters.reshape import OnnxReshape
from onnx2torch.node_converters.shape import OnnxShape
from onnx2torch.node_converters.slice import OnnxSlice
from onnx2torch.node_converters.tile import OnnxTile

from pipeline.errors import ModelError
from pipeline.model.imaging import load_and_preprocess
from pipeline.gpu.topk_network import split_outputs
from pipeline.model.onnx_graph import faithful_slim, io_names, normalize, run_onnxruntime

LOG = logging.getLogger(__name__)

CONVERTER_FIX = "use --engine onnx (ONNX Runtime on the CPU) for this model"
SAMPLE_DIR = Path(__file__).resolve().parents[1] / "data" / "sample"
# The converted network in FP32 on the CPU against ONNX Runtime FP32: ||torch - ort|| / ||ort|| over the reference
# batch. Measured 3e-7..1.4e-6 on timm's, torchvision's and Hugging Face's exports (tests/integration/
# test_gpu_conversion.py; EfficientNet-Lite1 with its real weights the highest); onnxslim's rewrite of that Lite1 sits
# at 0.2.
CONVERSION_REL_L2 = 1e-3
# On the GPU, the network as it runs (TF32 convolutions in FP32; FP16 where the precision gate keeps it) against the
# same ONNX Runtime outputs; FP16 measured up to 4.6e-3 (EfficientNet-Lite2), docs/performance.md.
DEVICE_REL_L2 = 1e-2
# A top-1 class counts as decided where ONNX Runtime's probability of it leads the second by at least this.
DECIDED_MARGIN = 0.01
REFERENCE_TENSORS = 8  # seeded random tensors in the reference batch, beside the sample photos
REFERENCE_SEED = 48
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


@dataclass(frozen=True)
class Agreement:
    """A network's outputs against ONNX Runtime's on the reference batch."""

    rel_l2: float  # ||got - want|| / ||want||
    top1_differ: int  # images whose top-1 class differs where ONNX Runtime's is decided (DECIDED_MARGIN)
    images: int

    def within(self, rel_l2: float) -> bool:
        return bool(np.isfinite(self.rel_l2)) and self.rel_l2 <= rel_l2 and self.top1_differ == 0

    def describe(self) -> str:
        return (f"outputs {self.rel_l2:.2e} from ONNX Runtime's (relative L2) and {self.top1_differ} of "
                f"{self.images} reference images with another top-1 class")


def agreement(got: np.ndarray, want: np.ndarray, *, probabilities: bool) -> Agreement:
    """How far ``got`` ([images, classes]) is from ONNX Runtime's ``want`` on the same inputs."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    images = len(want)
    if got.shape != want.shape:
        return Agreement(float("inf"), images, images)
    # A row ONNX Runtime cannot compute (NaN or Inf: an engine_error row on every engine) must be one here too.
    finite = np.isfinite(want).all(axis=1)
    mismatch = int((np.isfinite(got).all(axis=1) != finite).sum())
    if mismatch:
        return Agreement(float("inf"), mismatch, images)
    got, want = got[finite], want[finite]
    if not len(want):
        return Agreement(0.0, 0, images)
    rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))
    if probabilities:
        probs = want
    else:
        probs = np.exp(want - want.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
    top2 = np.sort(probs, axis=1)[:, -2:] if probs.shape[1] > 1 else np.hstack([np.zeros_like(probs), probs])
    decided = (top2[:, 1] - top2[:, 0]) >= DECIDED_MARGIN
    differ = int(((got.argmax(axis=1) != want.argmax(axis=1)) & decided).sum())
    return Agreement(rel, differ, images)


def reference_batch(spec) -> np.ndarray:
    """The batch a conversion is checked on: the sample photos through the reference preprocessing (``spec``), then
    ``REFERENCE_TENSORS`` seeded standard-normal tensors; float32 [images, C, H, W]."""
    photos = [load_and_preprocess(p.read_bytes(), spec)[0] for p in sorted(SAMPLE_DIR.glob("*.jpg"))]
    noise = np.random.default_rng(REFERENCE_SEED).standard_normal((REFERENCE_TENSORS, *spec.input_shape))
    return np.concatenate([np.stack(photos), noise]).astype(np.float32)


@dataclass(frozen=True)
class OnnxReference:
    """The reference batch and ONNX Runtime's outputs on it, which every copy of the converted network is held to."""

    inputs: np.ndarray  # float32 [images, C, H, W]
    outputs: np.ndarray  # float32 [images, classes]
    probabilities: bool  # the outputs are probabilities (the spec's output), not logits
    fixed_batch: int | None = None
    embeddings: np.ndarray | None = None  # float32 [images, dim]: the embedding tensor as ONNX Runtime computes it


@dataclass(frozen=True)
class Conversion:
    """A checked conversion: the network (FP32, CPU), its reference, how it agreed, and how it was made."""

    network: torch.nn.Module
    reference: OnnxReference
    agreement: Agreement
    note: str


def run_network(network, inputs: np.ndarray, fixed_batch: int | None = None) -> np.ndarray:
    """``network``'s FP32 class outputs on the CPU for ``inputs`` (in padded runs of ``fixed_batch`` where it is
    set)."""
    return run_outputs(network, inputs, fixed_batch)[0]


def run_outputs(network, inputs: np.ndarray, fixed_batch: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """``network``'s FP32 class outputs and embedding ([images, dim], None where it returns none) on the CPU for
    ``inputs`` (in padded runs of ``fixed_batch`` where it is set)."""
    step = fixed_batch or len(inputs)
    logits, features = [], []
    with torch.inference_mode():
        for start in range(0, len(inputs), step):
            part = torch.from_numpy(np.ascontiguousarray(inputs[start:start + step]))
            n = part.shape[0]
            if fixed_batch and n < fixed_batch:
                part = torch.cat([part, part.new_zeros((fixed_batch - n, *part.shape[1:]))])
            out, embedding = split_outputs(network(part))
            logits.append(out.float()[:n].numpy())
            if embedding is not None:
                features.append(embedding.float()[:n].reshape(n, -1).numpy())
    return np.concatenate(logits), (np.concatenate(features) if features else None)


def embedding_agreement(got: np.ndarray | None, want: np.ndarray) -> Agreement:
    """How far an embedding ``got`` ([images, dim]) is from ONNX Runtime's ``want``: relative L2 over the rows ONNX
    Runtime computes (infinite where the shapes differ or a row is finite in one and not the other); ``top1_differ``
    counts those rows (an embedding has no classes)."""
    images = len(want)
    if got is None or got.shape != want.shape:
        return Agreement(float("inf"), images, images)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want).all(axis=1)
    mismatch = int((np.isfinite(got).all(axis=1) != finite).sum())
    if mismatch:
        return Agreement(float("inf"), mismatch, images)
    got, want = got[finite], want[finite]
    rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12)) if len(want) else 0.0
    return Agreement(rel, 0, images)


def with_outputs(model, names: list[str]):
    """A copy of ``model`` (an ``onnx.ModelProto``) whose graph outputs are ``names``, in that order; a name that is
    not an output of the graph (an intermediate tensor) becomes one, with the type ONNX's shape inference gives it
    (onnxslim refuses an output without one)."""
    from onnx import helper  # noqa: PLC0415

    model = onnx.ModelProto.FromString(model.SerializeToString())
    declared = {o.name: o for o in model.graph.output}
    if any(name not in declared for name in names):
        try:
            inferred = onnx.shape_inference.infer_shapes(model).graph.value_info
        except Exception:  # noqa: BLE001 - inference is a best effort: an untyped output still runs
            inferred = []
        declared = {**{v.name: v for v in inferred if v.type.HasField("tensor_type")}, **declared}
    outputs = [declared.get(name) or helper.make_empty_tensor_value_info(name) for name in names]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    return model


def onnx_embeddings(model, spec, inputs: np.ndarray, fixed_batch: int | None) -> np.ndarray:
    """ONNX Runtime's embedding tensor (``spec.embedding``) for ``inputs``, [images, dim] float32.

    Raises:
        ModelError: the graph has no such tensor, or its width is not the spec's ``dim``.
    """
    embedding = spec.embedding
    try:
        values = run_onnxruntime(with_outputs(model, [embedding.output]), inputs, fixed_batch=fixed_batch)
    except Exception as err:  # noqa: BLE001 - ONNX Runtime's own error types
        raise ModelError(f"the model's embedding {embedding.output!r} cannot be read from its graph "
                         f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}); set "
                         "embedding.output in preprocess.json to one of its tensors") from None
    values = values.reshape(len(inputs), -1).astype(np.float32)
    if values.shape[1] != embedding.dim:
        raise ModelError(f"the model's embedding {embedding.output!r} is {values.shape[1]} wide and its spec says dim "
                         f"{embedding.dim}; set embedding.dim to {values.shape[1]} in preprocess.json")
    return values


def convert_checked(onnx_path: str | Path, spec, *, fixed_batch: int | None = None) -> Conversion:
    """``model.onnx`` as an eval-mode FP32 torch module on the CPU (``HostShapes`` around onnx2torch's graph), whose
    outputs on the reference batch agree with ONNX Runtime's on the same tensors.

    onnxslim's graph is converted first where slimming kept ONNX Runtime's outputs (``faithful_slim``), then the
    graph's exact normal form; the first conversion that agrees is kept.

    Raises:
        ModelError: no conversion agrees with ONNX Runtime, or the converter fails (the operator or the difference
            found, and ``--engine onnx``).
    """
    inputs = reference_batch(spec)
    source = onnx.load(str(onnx_path))
    # The class output (the graph's output that is not the embedding), then the embedding's tensor: what the converted
    # network returns (``split_outputs``).
    embedding_name = spec.embedding.output if spec.embedding is not None else None
    class_output = next((o.name for o in source.graph.output if o.name != embedding_name), io_names(source)[1])
    names = [class_output] + ([embedding_name] if embedding_name else [])
    first = source if source.graph.output[0].name == class_output else with_outputs(source, [class_output])
    wanted = run_onnxruntime(str(onnx_path) if first is source else first, inputs, fixed_batch=fixed_batch)
    features = onnx_embeddings(source, spec, inputs, fixed_batch) if spec.embedding is not None else None
    reference = OnnxReference(inputs, wanted.astype(np.float32), bool(spec.probabilities), fixed_batch, features)
    normal, notes = normalize(with_outputs(source, names))
    failures: list[str] = []
    for graph, how in _candidates(normal, notes, inputs, fixed_batch):
        try:
            network = HostShapes(_to_torch(graph, onnx_path), _example(inputs, fixed_batch)).eval()
        except ModelError as err:
            failures.append(str(err))
            continue
        logits, embedding = run_outputs(network, inputs, fixed_batch)
        found = agreement(logits, wanted, probabilities=reference.probabilities)
        if not found.within(CONVERSION_REL_L2):
            failures.append(f"{onnx_path} cannot run on the GPU: its network converted to torch ({how}) gives "
                            f"{found.describe()} (allowed {CONVERSION_REL_L2:g}); {CONVERTER_FIX}")
            continue
        if features is not None:
            close = embedding_agreement(embedding, features)
            if not close.within(CONVERSION_REL_L2):
                failures.append(f"{onnx_path} cannot run on the GPU: its network converted to torch ({how}) gives an "
                                f"embedding {close.rel_l2:.2e} from ONNX Runtime's (relative L2; allowed "
                                f"{CONVERSION_REL_L2:g}); {CONVERTER_FIX}")
                continue
        problem = off_host_problem(network, _example(inputs, fixed_batch))
        if problem:
            failures.append(f"{onnx_path} cannot run on the GPU: its network converted to torch ({how}) fails "
                            f"off the CPU ({problem}); {CONVERTER_FIX}")
            continue
        return Conversion(network, reference, found, how)
    raise ModelError(failures[0])


def off_host_problem(network, example: np.ndarray) -> str:
    """Why ``network`` cannot run with its data on another device than its shape arithmetic ("" where it can): a copy
    on the meta device (shapes only, no arithmetic) runs ``example``'s shape, so an operator that would see tensors
    of the GPU and of the CPU fails here, in the driver, before any GPU does."""
    import copy  # noqa: PLC0415

    try:
        with torch.inference_mode():
            copy.deepcopy(network).to("meta")(torch.empty(example.shape, device="meta"))
    except Exception as err:  # noqa: BLE001 - any failure off the host is the answer
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    return ""


def _example(inputs: np.ndarray, fixed_batch: int | None) -> np.ndarray:
    """One batch the converted graph takes: a row, or ``fixed_batch`` rows (repeated where the batch has fewer)."""
    rows = fixed_batch or 1
    return np.resize(inputs, (rows, *inputs.shape[1:])).astype(np.float32)


def _candidates(normal, notes: list[str], inputs: np.ndarray, fixed_batch: int | None):
    """The graphs to convert, in order: onnxslim's where it keeps ONNX Runtime's outputs (its folded shape arithmetic
    compiles into one graph), then the exact normal form."""
    written = "the graph as written" + (f" ({', '.join(notes)})" if notes else "")
    slim, note = faithful_slim(normal, inputs[-min(2, len(inputs)):], fixed_batch=fixed_batch)
    if slim is not None:
        yield slim, note
    else:
        written += f"; {note}"
    yield normal, written


def _to_torch(graph, onnx_path):
    try:
        return onnx2torch.convert(graph)
    except NotImplementedError as err:
        op = re.search(r"operation_type='([^']+)'", str(err))
        what = f"operator {op.group(1)}" if op else str(err)[:200]
        raise ModelError(f"{onnx_path} cannot run on the GPU: onnx2torch cannot convert its {what}; "
                         f"{CONVERTER_FIX}") from None
    except Exception as err:  # noqa: BLE001 - the converter's own failures: one line, with the way out
        raise ModelError(f"{onnx_path} cannot run on the GPU: converting it to torch failed ({type(err).__name__}: "
                         f"{str(err)[:200]}); {CONVERTER_FIX}") from None


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


class HostConstantOfShape(OnnxConstantOfShape):
    """onnx2torch's ``ConstantOfShape`` with its shape read as Python ints (the unsimplified export of ``expand(n, -1,
    -1)`` builds one), its value broadcast where it lives (no ``.item()``, which would wait for the GPU)."""

    def forward(self, shape):
        return self.value.reshape([]).expand(host_ints(shape)).clone()


class HostTile(OnnxTile):
    """onnx2torch's ``Tile`` with its repeats read as Python ints."""

    def forward(self, input_tensor, repeats):
        return input_tensor.repeat(host_ints(repeats))


def _shape_only_tensors(graph, example=None) -> list[str]:
    """The tensors of ``graph`` (an onnx2torch ``GraphModule``) that only shape arithmetic reads, by name.

    A node is shape arithmetic where it depends on no input data, only on ``Shape`` results and constants, and its
    value is integer or read only by shape arithmetic (the float steps of a padding computed from the input's size).
    A float value computed from constants that data meets (a ViT's class token expanded to the batch) is data: it
    goes to the device. Which values are float is read from one run on ``example`` (without it, every float value
    counts as data).
    """
    if not isinstance(graph, torch.fx.GraphModule):
        return []
    static: set = set()
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_module" and isinstance(graph.get_submodule(node.target), HostShape):
            static.add(node)
        elif node.op != "output" and all(arg in static for arg in node.all_input_nodes):
            static.add(node)
    floating = _floating_values(graph, example)
    host: set = set()
    for node in reversed(list(graph.graph.nodes)):
        if node in static and (not floating.get(node, True)
                               or (node.users and all(u in host or _reads_on_host(graph, u, node) for u in node.users))):
            host.add(node)
    names = []
    for node in graph.graph.nodes:
        if node not in host:
            continue
        if node.op == "get_attr":
            names.append(node.target)
        elif node.op == "call_module":  # its own constants stay beside its inputs
            module = graph.get_submodule(node.target)
            names += [f"{node.target}.{n}" for n, t in module.named_buffers() if t.is_floating_point()]
            names += [f"{node.target}.{n}" for n, t in module.named_parameters() if t.is_floating_point()]
    return names


def _reads_on_host(graph, user, node) -> bool:
    """Does ``user`` read ``node`` only as an operand it takes as Python numbers (a shape, pads, a fill value)?"""
    if user.op != "call_module":
        return False
    positions = HOST_OPERANDS.get(type(graph.get_submodule(user.target)), ())
    return all(i in positions for i, arg in enumerate(user.args) if arg is node) and node not in user.kwargs.values()


def _floating_values(graph, example) -> dict:
    """For each node of ``graph``: is its value a float tensor (one run on ``example``, on the CPU); empty without an
    example."""
    if example is None:
        return {}
    found: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            found[node] = isinstance(value, torch.Tensor) and value.is_floating_point()
            return value

    with torch.inference_mode():
        Recorder(graph).run(torch.from_numpy(np.ascontiguousarray(example)))
    return found


# onnx2torch's modules whose shape operand the converted graph reads on the host, and their replacements.
HOST_MODULES = {OnnxShape: HostShape, OnnxReshape: HostReshape, OnnxExpand: HostExpand,
                OnnxConstantOfShape: HostConstantOfShape, OnnxTile: HostTile}
# The operands (positions) each module reads as Python numbers: where they come from constants, they stay on the host.
HOST_OPERANDS = {HostReshape: (1,), HostExpand: (1,), HostTile: (1,), HostConstantOfShape: (0,),
                 OnnxPadDynamic: (1, 2), OnnxSlice: (1, 2, 3, 4)}


class HostShapes(torch.nn.Module):
    """A converted graph whose shape arithmetic stays on the CPU when the module moves to a GPU, so that it never waits
    for the GPU: integer constants (shapes, axes, indices), ``Shape`` results, and every constant that only shape
    arithmetic reads (the float steps of a TF "SAME" padding computed from the input's size, as timm's ``tf_`` models
    export it)."""

    # onnx2torch runs the graph one module per ONNX node; on the GPU ``TopKNetwork`` compiles it with torch.compile,
    # which fuses them (ResNet-50 alone: twice the eager rate, docs/performance.md).
    compile_by_default = True
    # Set by pipeline.gpu.networks.load_network on the checked network it hands out (never saved with it): the
    # reference every copy is held to, its cache entry (for per-card results) and how it was had.
    onnx_reference: OnnxReference | None = None
    cache_entry: Path | None = None
    load_note = ""

    def __init__(self, graph, example: np.ndarray | None = None):
        super().__init__()
        for module in graph.modules():
            host = HOST_MODULES.get(type(module))
            if host is not None:
                module.__class__ = host
        self.graph = graph
        # names in ``graph`` of the float tensors kept on the CPU (integer ones always are)
        self.host_tensors = _shape_only_tensors(graph, example)

    def _apply(self, fn, recurse=True):
        keep = set()
        for name in getattr(self, "host_tensors", ()):
            owner, _, leaf = name.rpartition(".")
            keep.add(id(getattr(self.graph.get_submodule(owner) if owner else self.graph, leaf)))
        return super()._apply(lambda t: fn(t) if t.is_floating_point() and id(t) not in keep else t, recurse)

    def forward(self, x):
        return self.graph(x)

