"""The gpu profile's Triton python-backend model: ``GpuClassifier`` (pipeline.gpu.classifier) behind the contract.

Runs inside tritonserver on a GPU (KIND_GPU instances). Its version folder holds ``preprocess.json`` and, for a
user's model, its ``model.onnx`` (converted to torch at start) and any ``model.torchscript``; with neither it serves
the default EfficientNet-Lite0 from its checkpoint. A model set's other models have theirs in ``model_1/``,
``model_2/``, ... (``pipeline.triton.contract``): each image is decoded once, and each model's preprocessing and network
run on that decode (``SetModel``), its answers in ``CLASS_IDS_i``/``SCORES_i`` and, where its spec declares one, its
embedding in ``EMBEDDING(_i)``.
It serves ``pipeline.triton.contract``' contract: a bad image gives an ``ERROR`` string for that image only.

The dynamic batcher may hand ``execute`` several requests at once: ``IMAGE`` is declared ragged
(``allow_ragged_batch``), so requests padded to different lengths still reach one ``execute`` call, where all their
images go through one pipelined ``GpuClassifier.classify`` (decode of batch n+1 overlapping the network on n).
Tensors cross the backend through DLPack: with numpy 2 in the stub's Python, ``as_numpy()`` mis-reads them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.gpu.defaults import (
    DALI_THREADS, GPU_DEFAULT_BATCH_SIZE, GPU_DEFAULT_MAX_DELAY_MS, GPU_DEFAULT_PREP_WORKERS,
)
from pipeline.gpu.stream import RequestStream
from pipeline.model.imaging import DecodeLimits, PreprocessSpec
from pipeline.model.folder import MODEL_FILE, SPEC_FILE
from pipeline.triton import contract as tn
from pipeline.triton.serve.backend import as_numpy, bad_input, config_limits, config_param, request_limits

_IMPORTED = time.perf_counter()  # the stub imports this module first: instance start times count from here

LOG = logging.getLogger(__name__)

# A served folder's class count where its network files are absent (the built-in model's ImageNet classes).
BUILTIN_CLASSES = 1000

# A server's instances build at every job's start: cuDNN's autotuner lengthens each build for little of the
# network's rate, and the served path is not bound by the GPU (docs/performance.md).
SERVED_CUDNN_AUTOTUNE = False
# The stub's pybind11 reads numpy-1 arrays right; under numpy 2 tensors go through DLPack (see the module doc).
_NUMPY_1 = int(np.__version__.split(".")[0]) < 2

def output_tensor(pb, name: str, arr):
    """A ``pb_utils.Tensor`` of a numpy array or a torch tensor (kept on its device: GPU tensors stay there)."""
    if not isinstance(arr, np.ndarray):
        return pb.Tensor.from_dlpack(name, arr.contiguous())
    arr = np.ascontiguousarray(arr)
    if _NUMPY_1:
        return pb.Tensor(name, arr)
    import torch  # noqa: PLC0415 - present wherever this model runs under numpy 2

    # Through torch's DLPack capsule: numpy's own capsule crashed the stub ("PyCapsule_GetPointer called
    # with incorrect name"), and pb.Tensor(name, ndarray) mis-reads numpy-2 arrays.
    return pb.Tensor.from_dlpack(name, torch.from_numpy(arr))


def request_images(pb, request) -> list[bytes]:
    """A request's encoded files: ``IMAGE`` rows cut to their ``LENGTH``.

    Raises:
        ValueError: the tensors' shapes do not match the contract.
    """
    images = as_numpy(pb.get_input_tensor_by_name(request, tn.INPUT_IMAGE))
    lengths = as_numpy(pb.get_input_tensor_by_name(request, tn.INPUT_LENGTH)).reshape(-1)
    if images.ndim != 2 or lengths.shape[0] != images.shape[0]:
        raise ValueError(f"{tn.INPUT_IMAGE} must be [n, bytes] and {tn.INPUT_LENGTH} [n, 1]")
    return [images[i, : int(lengths[i])].tobytes() for i in range(images.shape[0])]


def request_tags(pb, request, n: int) -> np.ndarray:
    """A request's ``TAG`` column (int64 [n]), echoed in ``ECHO``.

    Raises:
        ValueError: not one tag per image.
    """
    tags = as_numpy(pb.get_input_tensor_by_name(request, tn.INPUT_TAG)).reshape(-1).astype(np.int64)
    if tags.shape[0] != n:
        raise ValueError(f"{tn.INPUT_TAG} must be [n, 1] for the {n} images of {tn.INPUT_IMAGE}")
    return tags


@dataclass(frozen=True)
class SetMember:
    """One model of the served folder (the first, or a model set's ``index``-th in ``model_<index>/``): its folder,
    spec and the k its config declares."""

    index: int
    folder: Path
    spec: PreprocessSpec
    top_k: int


def set_members(folder: Path, spec: PreprocessSpec, outputs: dict) -> list[SetMember]:
    """The served models of the version ``folder`` (``spec``: the first's), checked against the config's ``outputs``:
    each model's CLASS_IDS_i, and EMBEDDING_i exactly where its spec declares an embedding.

    Raises:
        ValueError: the folder and its config disagree (a repository not built by ``bulk-classify``).
    """
    members = [SetMember(0, folder, spec, int(outputs[tn.OUTPUT_CLASS_IDS]["dims"][0]))]
    while (folder / tn.SET_FOLDER.format(index=len(members))).is_dir():
        index, sub = len(members), folder / tn.SET_FOLDER.format(index=len(members))
        ids = outputs.get(tn.set_output(tn.OUTPUT_CLASS_IDS, index))
        if ids is None:
            raise ValueError(f"{sub} has no {tn.set_output(tn.OUTPUT_CLASS_IDS, index)} output in its config; "
                             "rebuild the repository with bulk-classify")
        members.append(SetMember(index, sub, PreprocessSpec.from_json((sub / SPEC_FILE).read_text(encoding="utf-8")),
                                 int(ids["dims"][0])))
    for member in members:
        name = tn.set_output(tn.OUTPUT_EMBEDDING, member.index)
        declared = [int(d) for d in outputs[name]["dims"]] if name in outputs else None
        wanted = None if member.spec.embedding is None else [member.spec.embedding.dim]
        if declared != wanted:
            raise ValueError(f"the config's {name} is {declared or 'absent'} but {member.folder / SPEC_FILE} declares "
                             f"{wanted or 'no embedding'}; rebuild the repository with bulk-classify")
    return members


class _FolderBundle:
    """What ``pipeline.gpu.networks.load_network`` needs from a bundle, read from the version folder: a
    user's model has its ``model.onnx`` (and any ``model.torchscript``) there, the default model neither."""

    def __init__(self, folder: Path, spec: PreprocessSpec, classes: int):
        from pipeline.model.folder import (  # noqa: PLC0415
            BUILTIN_NAME, TORCHSCRIPT_FILE, builtin_digest, default_cache_dir, onnx_fixed_batch,
        )

        self.onnx_path = folder / MODEL_FILE
        self.labels = tuple(str(i) for i in range(classes))
        self.spec = spec
        # The repository builder leaves the network files out only for the built-in model (pipeline.model.folder.is_builtin).
        user = (folder / MODEL_FILE).is_file() or (folder / TORCHSCRIPT_FILE).is_file()
        self.name = f"user model in {folder}" if user else BUILTIN_NAME
        self.digest = "" if user else builtin_digest(str(default_cache_dir()))
        self.fixed_batch = onnx_fixed_batch(self.onnx_path, spec) if self.onnx_path.is_file() else None

    @property
    def num_classes(self) -> int:
        return len(self.labels)


def served_cudnn_autotune(config: dict) -> bool:
    """Whether the model of ``config`` (Triton's JSON of its config.pbtxt) lets cuDNN time each conv's algorithms:
    its ``cudnn_autotune`` parameter, else ``SERVED_CUDNN_AUTOTUNE``."""
    return config_param(config, tn.GPU_PARAM_CUDNN_AUTOTUNE, str(SERVED_CUDNN_AUTOTUNE)).lower() == "true"


def build_classifier(config: dict, spec: PreprocessSpec, network, *, device: str, top_k: int, limits: DecodeLimits,
                     batch_size: int, half: bool | None = None, precision_gate: bool = True,
                     fixed_batch: int | None = None, more: Sequence = ()):
    """A ``GpuClassifier`` set up by a model's config.pbtxt parameters (``network`` None: preparation only); ``more``:
    a model set's other models (``SetModel``), run on the same decode.

    ``half`` None reads the ``half`` parameter ("auto": the classifier's default, FP16 on a GPU, where it agrees
    with the reference as often as FP32 (docs/performance.md); FP32 on the CPU).
    """
    from pipeline.gpu.classifier import (  # noqa: PLC0415 - torch and DALI
        DEFAULT_CUDA_SYNC, ClassifierOptions, GpuClassifier,
    )
    from pipeline.gpu.dali import (  # noqa: PLC0415
        DEFAULT_DALI_DEPTH,
        DEFAULT_HW_DECODER_LOAD,
    )

    if half is None:
        value = config_param(config, tn.GPU_PARAM_HALF, "auto").lower()
        half = None if value == "auto" else value == "true"
    return GpuClassifier(network, spec, ClassifierOptions(
        hw_decoder_load=float(config_param(config, tn.GPU_PARAM_HW_DECODER_LOAD, str(DEFAULT_HW_DECODER_LOAD))),
        top_k=top_k,
        limits=limits,
        batch_size=batch_size,
        device=device,
        cuda_graph=config_param(config, tn.GPU_PARAM_CUDA_GRAPH, "true").lower() == "true",
        prep_workers=int(config_param(config, tn.GPU_PARAM_PREP_WORKERS, str(GPU_DEFAULT_PREP_WORKERS))),
        dali_depth=int(config_param(config, tn.GPU_PARAM_DALI_DEPTH, str(DEFAULT_DALI_DEPTH))),
        dali_threads=int(config_param(config, tn.GPU_PARAM_DALI_THREADS, str(DALI_THREADS))),
        half=half,
        precision_gate=precision_gate,
        fixed_batch=fixed_batch,
        cuda_sync=config_param(config, tn.GPU_PARAM_CUDA_SYNC, DEFAULT_CUDA_SYNC),
        cudnn_autotune=served_cudnn_autotune(config),
    ), more=tuple(more))


class TritonPythonModel:
    """Triton's python-backend entry points."""

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 - exists only inside the stub

        self.pb = pb_utils
        started = time.perf_counter()
        config = json.loads(args["model_config"])
        folder = Path(args["model_repository"]) / args["model_version"]
        spec = PreprocessSpec.from_json((folder / SPEC_FILE).read_text(encoding="utf-8"))
        outputs = {o["name"]: o for o in config["output"]}
        self.top_k = int(outputs[tn.OUTPUT_CLASS_IDS]["dims"][0])
        self.members = set_members(folder, spec, outputs)
        self.has_error = tn.OUTPUT_ERROR in outputs
        on_gpu = args.get("model_instance_kind", "GPU") == "GPU"  # a KIND_GPU instance runs on its GPU
        device = f"cuda:{int(args.get('model_instance_device_id', 0))}" if on_gpu else "cpu"
        self.instance = args.get("model_instance_name", "?")
        net_name = config_param(config, tn.GPU_PARAM_NETWORK, "auto")
        self.limits = config_limits(config)
        batch_size = int(config_param(config, tn.GPU_PARAM_BATCH_SIZE, str(GPU_DEFAULT_BATCH_SIZE)))
        self.classifier = self._build_classifier(config, folder, spec, device, net_name, batch_size)
        built = time.perf_counter()
        self.classifier.warmup()
        # Each instance's start, in the server's log: where a job's start goes (docs/performance.md).
        report = getattr(self.classifier, "start_report", lambda: "")()
        pb_utils.Logger.log_info(f"{tn.START_REPORT}gpu model {self.instance}: classifier built in "
                                 f"{built - started:.1f} s ({report}), warmed up in {time.perf_counter() - built:.1f} s, "
                                 f"{time.perf_counter() - _IMPORTED:.1f} s after its module was imported")
        self.stream = RequestStream(self.classifier, self._respond, top_k=self.top_k,
                                    max_delay_s=float(config_param(config, tn.GPU_PARAM_MAX_DELAY_MS, str(GPU_DEFAULT_MAX_DELAY_MS))) / 1000,
                                    max_backlog=float(config_param(config, tn.GPU_PARAM_MAX_BACKLOG, "0")))
        LOG.info("gpu model ready on %s (decoder %s)", device, self.classifier.decoder_name)

    def _build_classifier(self, config: dict, folder: Path, spec: PreprocessSpec, device: str, net_name: str,
                          batch_size: int):
        """The classifier the request stream feeds (a subclass may serve another: the benchmarks' hop)."""
        from pipeline.gpu.classifier import SetModel  # noqa: PLC0415 - torch and DALI
        from pipeline.gpu.networks import load_network  # noqa: PLC0415 - torch
        from pipeline.model.folder import is_builtin  # noqa: PLC0415

        bundle = _FolderBundle(folder, spec, BUILTIN_CLASSES)
        more = []
        for member in self.members[1:]:  # each through the same conversion, cache and FP16 gate as the first
            other = _FolderBundle(member.folder, member.spec, BUILTIN_CLASSES)
            more.append(SetModel(load_network(other), member.spec, top_k=member.top_k, fixed_batch=other.fixed_batch,
                                 precision_gate=not is_builtin(other)))
        return build_classifier(config, spec, load_network(bundle, net_name), device=device, top_k=self.top_k,
                                limits=self.limits, batch_size=batch_size, precision_gate=not is_builtin(bundle),
                                fixed_batch=bundle.fixed_batch, more=more)

    def execute(self, requests):
        """Queues each request's images for the pipeline and returns at once: the responses are sent by the
        pipeline's thread when their images are done (the response sender, in the default transaction policy),
        so the next requests arrive while this batch is still on the GPU."""
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                blobs = request_images(pb, request)
                tags = request_tags(pb, request, len(blobs))
                limits = request_limits(request, self.limits)
            except Exception as err:  # noqa: BLE001 - a malformed request fails alone, with the reason
                self._send(sender, pb.InferenceResponse(output_tensors=[], error=pb.TritonError(str(err))))
                continue
            self.stream.submit(sender, blobs, limits, tags)
        return None

    def _respond(self, sender, raw, n: int) -> None:
        """The response of one request (called by the stream's thread once all its images are done)."""
        pb = self.pb
        failed = [e for e in raw.errors if e]
        if failed and not self.has_error:
            # No ERROR output (numpy 2 in this Python): fail the request; the client splits it to
            # isolate the bad input, whose own one-image request then carries its error text.
            response = pb.InferenceResponse(output_tensors=[], error=bad_input(pb, tn.failure_message(failed, n)))
        else:
            response = pb.InferenceResponse(output_tensors=self._tensors(raw, 0, n))
        self._send(sender, response)

    def _send(self, sender, response) -> None:
        sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _tensors(self, raw, start: int, end: int) -> list:
        pb = self.pb

        def out_tensor(name: str, arr: np.ndarray):
            return output_tensor(pb, name, arr)

        out = [
            out_tensor(tn.OUTPUT_CLASS_IDS, raw.class_ids[start:end]),
            out_tensor(tn.OUTPUT_SCORES, raw.scores[start:end]),
            out_tensor(tn.OUTPUT_WIDTH, raw.width[start:end, None]),
            out_tensor(tn.OUTPUT_HEIGHT, raw.height[start:end, None]),
            out_tensor(tn.OUTPUT_ECHO, raw.echo[start:end, None]),
        ]
        for index, theirs in enumerate(raw.more, 1):
            out += [out_tensor(tn.set_output(tn.OUTPUT_CLASS_IDS, index), theirs.class_ids[start:end]),
                    out_tensor(tn.set_output(tn.OUTPUT_SCORES, index), theirs.scores[start:end])]
        for member, embedding in zip(self.members, [raw.embedding, *(m.embedding for m in raw.more)]):
            if member.spec.embedding is not None:
                out.append(out_tensor(tn.set_output(tn.OUTPUT_EMBEDDING, member.index), embedding[start:end]))
        if self.has_error:
            errors = np.array([[e.encode("utf-8")] for e in raw.errors[start:end]], dtype=np.object_)
            out.append(pb.Tensor(tn.OUTPUT_ERROR, errors))
        return out

    def finalize(self):
        self.stream.close()
        # In the server's log: how this instance's share of the work went (several instances share the requests).
        logger = getattr(self.pb, "Logger", None)
        if logger is not None:
            logger.log_info(f"gpu stream of instance {self.instance}: {self.stream.stats()}")
        self.classifier.close()
