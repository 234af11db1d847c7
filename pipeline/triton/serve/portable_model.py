"""The portable profile's Triton python-backend model: reference decode (pipeline.model.imaging) + ONNX Runtime top-k.

Runs inside the tritonserver of the ``nvidia-pytriton`` wheel (no GPU needed). Its folder holds
``model.onnx`` (the classifier with softmax and top-k appended, see ``pipeline.triton.repository.add_topk_head``) and
``preprocess.json``, and for a model set each further model's in ``model_1/``, ``model_2/``, ...: each image is decoded
once and preprocessed per model. It serves the contract of ``pipeline.triton.contract``: a bad image gives an ``ERROR``
string for that image only, never a failed request.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pipeline.errors import ImageError
from pipeline.model.imaging import DecodeLimits, PreprocessSpec, load_and_preprocess_each
from pipeline.model.folder import MODEL_FILE, SPEC_FILE
from pipeline.triton import contract as tn
from pipeline.triton.serve.backend import as_numpy, bad_input, config_limits, config_param, request_limits

LOG = logging.getLogger(__name__)

# Config parameters (config.pbtxt `parameters`) of the portable model's threads.
PARAM_INTRA_OP_THREADS = "intra_op_threads"
PARAM_DECODE_THREADS = "decode_threads"


def _int_param(config: dict, key: str, default: int) -> int:
    return int(config_param(config, key, str(default)))


NUMPY_2 = int(np.__version__.split(".")[0]) >= 2


def _to_tensor(pb, name: str, value: np.ndarray):
    # Under numpy 2, pb_utils.Tensor(name, ndarray) sends numeric tensors empty: go through DLPack. Under numpy 1
    # it is the other way round: numpy's own DLPack capsule crashes the stub ("PyCapsule_GetPointer called with
    # incorrect name"). BYTES tensors cannot travel by DLPack at all (hence error_output=False under numpy 2).
    if NUMPY_2 and value.dtype != np.object_:
        return pb.Tensor.from_dlpack(name, dlpack_ready(value))
    return pb.Tensor(name, value)


def dlpack_ready(value: np.ndarray) -> np.ndarray:
    """``value`` as numpy exports it by DLPack: contiguous and writeable (numpy refuses read-only arrays, such as an
    input echoed back)."""
    value = np.ascontiguousarray(value)
    return value if value.flags.writeable else value.copy()


class Network:
    """One model of the served folder: its spec and its ONNX Runtime session with the top-k head (and EMBEDDING where
    its spec declares one)."""

    def __init__(self, folder: Path, intra_op_threads: int):
        import onnxruntime as ort  # noqa: PLC0415 - heavy; only where a model is served

        self.spec = PreprocessSpec.from_json((folder / SPEC_FILE).read_text(encoding="utf-8"))
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(folder / MODEL_FILE), options, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        shapes = {o.name: o.shape for o in self.session.get_outputs()}
        if tn.OUTPUT_SCORES not in shapes or tn.OUTPUT_CLASS_IDS not in shapes:
            raise ValueError(
                f"{folder / MODEL_FILE} has outputs {sorted(shapes)}, not {tn.OUTPUT_SCORES}/{tn.OUTPUT_CLASS_IDS}; "
                "build the repository with `bulk-classify repo build`, which appends softmax and top-k"
            )
        self.k = int(shapes[tn.OUTPUT_SCORES][-1])
        self.outputs = [tn.OUTPUT_SCORES, tn.OUTPUT_CLASS_IDS]
        self.embedding_dim = None
        if tn.OUTPUT_EMBEDDING in shapes:
            self.outputs.append(tn.OUTPUT_EMBEDDING)
            self.embedding_dim = int(shapes[tn.OUTPUT_EMBEDDING][-1])
        batch = self.session.get_inputs()[0].shape[0]
        self.fixed_batch = batch if isinstance(batch, int) and batch > 0 else None  # runs exactly that many, padded

    def answers(self, arrays: list[np.ndarray], rows: list[int], n: int) -> dict[str, np.ndarray]:
        """SCORES and CLASS_IDS [n, k] (and EMBEDDING [n, dim]) of the images ``rows`` (their inputs ``arrays``);
        zeros (ids -1) elsewhere."""
        out = {tn.OUTPUT_SCORES: np.zeros((n, self.k), dtype=np.float32),
               tn.OUTPUT_CLASS_IDS: np.full((n, self.k), -1, dtype=np.int32)}
        if self.embedding_dim is not None:
            out[tn.OUTPUT_EMBEDDING] = np.zeros((n, self.embedding_dim), dtype=np.float32)
        if not rows:
            return out
        batch = np.stack(arrays)
        step = self.fixed_batch or len(batch)
        for start in range(0, len(batch), step):
            part = batch[start : start + step]
            if len(part) < step:  # a fixed batch axis: pad the last run, drop its padded rows
                part = np.concatenate([part, np.zeros((step - len(part), *part.shape[1:]), part.dtype)])
            done = rows[start : start + step]
            for name, value in zip(self.outputs, self.session.run(self.outputs, {self.input_name: part})):
                out[name][done] = value[: len(done)]
        return out


class Classifier:
    """Decodes, preprocesses and classifies one request's images with every model of the folder (one, or a model
    set's); no Triton types, so it is testable alone."""

    def __init__(self, folder: Path, *, intra_op_threads: int = 0, decode_threads: int = 0, limits=None):
        self.networks = [Network(folder, intra_op_threads)]
        while (folder / tn.SET_FOLDER.format(index=len(self.networks))).is_dir():
            self.networks.append(Network(folder / tn.SET_FOLDER.format(index=len(self.networks)), intra_op_threads))
        self.specs = [net.spec for net in self.networks]
        self.spec, self.k = self.specs[0], self.networks[0].k
        self.limits = limits or DecodeLimits()
        self.pool = ThreadPoolExecutor(max(1, decode_threads or (os.cpu_count() or 1)), thread_name_prefix="decode")

    def _one(self, data: bytes, limits: DecodeLimits):
        try:
            arrays, width, height = load_and_preprocess_each(data, self.specs, limits)
            return arrays, width, height, ""
        except ImageError as err:
            return None, 0, 0, str(err)
        except Exception as err:  # noqa: BLE001 - one input's surprise must stay that input's row
            return None, 0, 0, f"decode_error: {type(err).__name__}: {err}"

    def classify(self, images: np.ndarray, lengths: np.ndarray, limits: DecodeLimits | None = None,
                 tags: np.ndarray | None = None) -> dict:
        """images: UINT8 [n, L] padded; lengths: INT32 [n, 1]; tags: INT64 [n, 1], echoed as ECHO (zeros when
        None). Returns the output tensors by name."""
        limits = limits or self.limits
        n = images.shape[0]
        blobs = [images[i, : int(lengths[i].reshape(-1)[0])].tobytes() for i in range(n)]
        decoded = list(self.pool.map(lambda b: self._one(b, limits), blobs))
        good = [i for i, d in enumerate(decoded) if d[0] is not None]
        result = {
            tn.OUTPUT_WIDTH: np.array([[d[1]] for d in decoded], dtype=np.int32).reshape(n, 1),
            tn.OUTPUT_HEIGHT: np.array([[d[2]] for d in decoded], dtype=np.int32).reshape(n, 1),
            tn.OUTPUT_ERROR: np.array([[d[3].encode("utf-8")] for d in decoded], dtype=np.object_).reshape(n, 1),
            tn.OUTPUT_ECHO: (np.zeros((n, 1), np.int64) if tags is None
                             else np.ascontiguousarray(tags, dtype=np.int64).reshape(n, 1)),
        }
        for index, net in enumerate(self.networks):
            for name, value in net.answers([decoded[i][0][index] for i in good], good, n).items():
                result[tn.set_output(name, index)] = value
        return result


class TritonPythonModel:
    """Triton's python-backend entry points."""

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 - exists only inside the stub

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        folder = Path(args["model_repository"]) / args["model_version"]
        # Without the BYTES ERROR output (numpy 2 in this Python cannot send BYTES tensors), a request with a
        # bad image fails with that image's error text and the client splits it to isolate the input.
        self.has_error = any(o["name"] == tn.OUTPUT_ERROR for o in config.get("output", []))
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        cpus = os.cpu_count() or 1
        limits = config_limits(config)
        self.classifier = Classifier(
            folder,
            # Instances share the cores: without a cap each ONNX Runtime session would spawn one thread per core.
            intra_op_threads=_int_param(config, PARAM_INTRA_OP_THREADS, max(1, cpus // instances)),
            decode_threads=_int_param(config, PARAM_DECODE_THREADS, max(1, cpus // instances)),
            limits=limits,
        )

    def execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            try:
                images = as_numpy(pb.get_input_tensor_by_name(request, tn.INPUT_IMAGE))
                lengths = as_numpy(pb.get_input_tensor_by_name(request, tn.INPUT_LENGTH))
                tags = as_numpy(pb.get_input_tensor_by_name(request, tn.INPUT_TAG))
                if images.ndim != 2 or lengths.shape[0] != images.shape[0] or tags.shape[0] != images.shape[0]:
                    raise ValueError(f"{tn.INPUT_IMAGE} must be [n, bytes], {tn.INPUT_LENGTH} and {tn.INPUT_TAG} "
                                     "[n, 1]")
                outputs = self.classifier.classify(images, lengths, request_limits(request, self.classifier.limits), tags)
                if not self.has_error:
                    errors = [e.decode("utf-8") for e in outputs.pop(tn.OUTPUT_ERROR).reshape(-1) if e]
                    if errors:
                        responses.append(pb.InferenceResponse(
                            output_tensors=[], error=bad_input(pb, tn.failure_message(errors, len(images)))))
                        continue
                tensors = [_to_tensor(pb, name, value) for name, value in outputs.items()]
                responses.append(pb.InferenceResponse(output_tensors=tensors))
            except Exception as err:  # noqa: BLE001 - a malformed request fails alone, with the reason
                LOG.exception("request failed")
                responses.append(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(str(err))))
        return responses

    def finalize(self):
        self.classifier.pool.shutdown(wait=False)
