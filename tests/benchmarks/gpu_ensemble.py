"""The gpu profile's ensemble shape, a measured alternative to its single model (docs/engines.md): ``PreprocessModel``
(triage + DALI + the reference) and ``NetworkModel`` (the torch network + top-k), two python-backend models joined by
the ``classifier`` ensemble, which ``build_ensemble_repository`` writes.

The production profile's shape with the gpu engine's parts: ``preprocess`` runs ``GpuPreparer`` (a
``GpuClassifier`` without its network: the same triage, DALI batches and Pillow reference as the single model) and sends ``PREPROCESSED`` as a GPU
tensor through DLPack; ``network`` reads it on the GPU (``FORCE_CPU_ONLY_INPUT_TENSORS: no``) and runs
``TopKNetwork`` (the single model's CUDA graph, softmax and top-k). ``STATUS`` tells the network which rows failed
(they get no class). A bad image: with the ``ERROR`` output (numpy 1 in the stub) the preprocess model sends its text
and the ensemble passes it on; without it (numpy 2: BYTES cannot be sent) the request fails with the first error and
the client isolates the bad file, as with the single model.

Each image's ``TAG`` goes with its tensor: the preprocess model sends it on (``PREPROCESSED_TAG``) and the network
model echoes it in ``ECHO`` beside its classes, so the client checks both models' batching of every image.

Each model builds its part in one method (``PreprocessModel._build_classifier``, ``NetworkModel._load_network``), and
the network model runs it in another (``_classify``), so a subclass can serve other parts: the hop (hop_model.py)
does. The repository's shims import this module, so ``build_ensemble_repository`` puts this folder on the PYTHONPATH
a server started from this process passes to its stubs (as gpu_networks.served does).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from pipeline.errors import ConfigError  # noqa: E402
from pipeline.gpu.classifier import Chunk  # noqa: E402
from pipeline.gpu.defaults import GPU_DEFAULT_BATCH_SIZE  # noqa: E402
from pipeline.model.folder import SPEC_FILE  # noqa: E402
from pipeline.model.imaging import DecodeLimits, PreprocessSpec  # noqa: E402
from pipeline.triton import contract as tn  # noqa: E402
from pipeline.triton.configs import (  # noqa: E402
    GPU_INSTANCES,
    GpuModelOptions,
    _contract_io,
    _place,
    _set_parameters,
    _tensor,
    _text,
    declares_error,
    model_config,
    prep_parameters,
)
from pipeline.triton.repository import CONFIG_FILE, SHIM_FILE, VERSION, gpu_model_files  # noqa: E402
from pipeline.triton.serve.backend import as_numpy, bad_input, config_limits, config_param, request_limits  # noqa: E402
from pipeline.triton.serve.gpu_model import (  # noqa: E402
    SERVED_CUDNN_AUTOTUNE,
    _FolderBundle,
    build_classifier,
    output_tensor,
    request_images,
    request_tags,
)
from pipeline.triton.server import STUB_PATH_ENV  # noqa: E402

# preprocess (triage + DALI, python backend) -> network (torch), GPU tensors between them; PREPROCESSED is FP16 there
# (FP32 when built with half "false").
NETWORK_MODEL = "network"
STATUS = "STATUS"  # INT32 [1], preprocess -> network: 0 prepared, 1 failed (the network gives it no class)
PREPROCESSED_TAG = "PREPROCESSED_TAG"  # INT64 [1], preprocess's ECHO -> network's TAG: each image's TAG with its tensor
# Preprocess instances do what the single model's instances spend their time on (triage, DALI, the reference), one
# execute() at a time each: as many as the single model's instances. One network instance: the dynamic batcher merges
# every preprocess instance's output into its batches and one CUDA graph replays them; a second would halve them.
PREPROCESS_INSTANCES = GPU_INSTANCES
NETWORK_INSTANCES = 1
SINGLE_ONLY_OPTIONS = ("max_delay_ms", "max_backlog")  # the single shape's request stream, which this shape lacks
_SHIM = '''"""Triton python-backend entry of the gpu profile's ensemble shape: tests/benchmarks/gpu_ensemble.{cls}
(written by build_ensemble_repository)."""

import os
import sys

sys.path[:0] = [p for p in os.environ.get("{env}", "").split(os.pathsep) if p and p not in sys.path]

from gpu_ensemble import {cls} as TritonPythonModel  # noqa: E402,F401
'''


LOG = logging.getLogger(__name__)


@dataclass
class Preprocessed:
    """Per-image outputs of ``GpuPreparer.preprocess``: the network's input, without the network."""

    inputs: Any  # torch [N, 3, H, W] (NCHW, contiguous) on the classifier's device; zeros where the image failed
    width: np.ndarray  # int32 [N]
    height: np.ndarray  # int32 [N]
    errors: list[str]  # "" when the image was prepared


class GpuPreparer:
    """A ``GpuClassifier`` built without a network, whose triage, DALI and reference prepare the network's input."""

    def __init__(self, classifier):
        self.classifier = classifier

    def preprocess(self, images: Sequence[bytes], limits: DecodeLimits | None = None) -> Preprocessed:
        """Triage, DALI and the reference for encoded images, as ``classify`` does, without the network: one row
        per input, in input order, on the classifier's device (synchronized: ready for another process to read).

        ``limits`` overrides the classifier's caps for this call's triage (a request's parameters).
        """
        clf = self.classifier
        with clf._lock:
            return self._preprocess(clf, images, limits or clf.limits)

    @staticmethod
    def _preprocess(clf, images: Sequence[bytes], limits: DecodeLimits) -> Preprocessed:
        torch = clf._torch
        n = len(images)
        out = torch.zeros((n, 3, *clf.spec.crop), dtype=clf.dtype, device=clf.device)
        width = np.zeros(n, dtype=np.int32)
        height = np.zeros(n, dtype=np.int32)
        items, errors = clf._triage_all(images, limits)
        chunks = [Chunk(items[s : s + clf.batch_size]) for s in range(0, len(items), clf.batch_size)]
        preparing = [clf._submit(chunk) for chunk in chunks]  # all chunks at once: the pool bounds the work
        keep = []  # the chunks' buffers live until the copies below are done
        here = torch.cuda.current_stream(clf.device) if clf.is_cuda else None
        for chunk, future in zip(chunks, preparing):
            try:
                future.result() if future is not None else clf._prepare(chunk)
            except Exception as err:  # noqa: BLE001 - this chunk's images fail; the others go on
                LOG.exception("preparing a batch of %d images failed", len(chunk.items))
                msg = f"engine_error: the batch failed on the GPU ({type(err).__name__}: {str(err)[:300]})"
                chunk.errors = {item.index: msg for item in chunk.items}
                chunk.inputs = None
            for index, msg in chunk.errors.items():
                errors[index] = msg
            if chunk.inputs is None:
                continue
            if chunk.ready is not None:
                here.wait_event(chunk.ready)
            items_ok = [chunk.items[p] for p in chunk.ok]
            rows = [it.index for it in items_ok]
            out[torch.as_tensor(rows, device=clf.device)] = chunk.inputs
            width[rows] = [it.width for it in items_ok]
            height[rows] = [it.height for it in items_ok]
            keep.append(chunk.keep)
        if here is not None:
            here.synchronize()
        return Preprocessed(out, width, height, errors)

    def close(self) -> None:
        self.classifier.close()


def model_setup(args: dict) -> tuple[dict, Path, Any]:
    """What each python model reads first: its parsed config, version folder and spec."""
    config = json.loads(args["model_config"])
    folder = Path(args["model_repository"]) / args["model_version"]
    return config, folder, PreprocessSpec.from_json((folder / SPEC_FILE).read_text(encoding="utf-8"))


def instance_device(args: dict) -> str:
    """The torch device of a model instance: its GPU for KIND_GPU, else the CPU."""
    if args.get("model_instance_kind", "GPU") == "GPU":
        return f"cuda:{int(args.get('model_instance_device_id', 0))}"
    return "cpu"


def _dims(config: dict, section: str, name: str) -> tuple[dict, list[int]]:
    tensor = next(t for t in config[section] if t["name"] == name)
    return tensor, [int(d) for d in tensor["dims"]]


class PreprocessModel:
    """Triton's entry points of the ``preprocess`` model."""

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 - exists only inside the stub

        self.pb = pb_utils
        config, _, spec = model_setup(args)
        out, self.shape = _dims(config, "output", tn.PREPROCESSED)
        self.half = out["data_type"] == "TYPE_FP16"
        self.has_error = any(t["name"] == tn.OUTPUT_ERROR for t in config["output"])
        self.limits = config_limits(config)
        batch_size = int(config_param(config, tn.GPU_PARAM_BATCH_SIZE, str(GPU_DEFAULT_BATCH_SIZE)))
        device = instance_device(args)
        self.classifier = self._build_classifier(config, spec, device, batch_size)
        LOG.info("preprocess model ready on %s", device)

    def _build_classifier(self, config: dict, spec, device: str, batch_size: int):
        """What prepares the images (``preprocess(blobs, limits)``): ``GpuClassifier`` without its network."""
        return GpuPreparer(build_classifier(config, spec, None, device=device, top_k=1, limits=self.limits,
                                            batch_size=batch_size, half=self.half))

    def execute(self, requests):
        pb = self.pb
        blobs, tags, limits, spans, failed = [], [], [], [], {}
        for r, request in enumerate(requests):
            try:
                images = request_images(pb, request)
                tags.append(request_tags(pb, request, len(images)))
            except Exception as err:  # noqa: BLE001 - a malformed request fails alone, with the reason
                failed[r] = pb.TritonError(str(err))
                images = []
            spans.append((len(blobs), len(blobs) + len(images)))
            blobs += images
            limits.append(request_limits(request, self.limits))
        all_tags = np.concatenate(tags) if tags else np.zeros(0, np.int64)
        if len(set(limits)) <= 1:  # the usual case: one pass over every request's images
            prepared = [self._prepare(blobs, limits[0] if limits else self.limits)]
            parts = [(prepared[0], all_tags, start, end) for start, end in spans]
        else:
            parts = [(self._prepare(blobs[s:e], lim), all_tags[s:e], 0, e - s)
                     for (s, e), lim in zip(spans, limits)]
        return [pb.InferenceResponse(output_tensors=[], error=failed[r]) if r in failed else self._response(*part)
                for r, part in enumerate(parts)]

    def _prepare(self, blobs: list[bytes], limits: DecodeLimits) -> Preprocessed:
        return self.classifier.preprocess(blobs, limits)

    def _response(self, prep: Preprocessed, tags: np.ndarray, start: int, end: int):
        pb = self.pb
        errors = prep.errors[start:end]
        failed = [e for e in errors if e]
        if failed and not self.has_error:
            return pb.InferenceResponse(output_tensors=[],
                                        error=bad_input(pb, tn.failure_message(failed, end - start)))
        status = np.array([[1 if e else 0] for e in errors], dtype=np.int32).reshape(-1, 1)
        out = [
            output_tensor(pb, tn.PREPROCESSED, prep.inputs[start:end]),
            output_tensor(pb, tn.OUTPUT_WIDTH, prep.width[start:end, None]),
            output_tensor(pb, tn.OUTPUT_HEIGHT, prep.height[start:end, None]),
            output_tensor(pb, STATUS, status),
            output_tensor(pb, tn.OUTPUT_ECHO, tags[start:end, None]),
        ]
        if self.has_error:
            out.append(pb.Tensor(tn.OUTPUT_ERROR, np.array([[e.encode("utf-8")] for e in errors], dtype=np.object_)))
        return pb.InferenceResponse(output_tensors=out)

    def finalize(self):
        self.classifier.close()


class NetworkModel:
    """Triton's entry points of the ``network`` model."""

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 - exists only inside the stub

        self.pb = pb_utils
        config, folder, spec = model_setup(args)
        tensor, shape = _dims(config, "input", tn.PREPROCESSED)
        _, (self.top_k,) = _dims(config, "output", tn.OUTPUT_CLASS_IDS)
        self.batch_size = int(config_param(config, tn.GPU_PARAM_BATCH_SIZE, str(GPU_DEFAULT_BATCH_SIZE)))
        self._load_network(args, config, folder, spec, tensor, shape)

    def _load_network(self, args: dict, config: dict, folder, spec, tensor: dict, shape: list[int]) -> None:
        """The torch network in a CUDA graph with softmax and top-k (``TopKNetwork``), warmed up."""
        import torch  # noqa: PLC0415 - the gpu profile's models run where torch is

        from pipeline.gpu.classifier import DEFAULT_CUDA_SYNC  # noqa: PLC0415
        from pipeline.gpu.cuda_sync import use_cuda_device  # noqa: PLC0415
        from pipeline.gpu.networks import load_network  # noqa: PLC0415
        from pipeline.gpu.topk_network import TopKNetwork  # noqa: PLC0415

        self.torch = torch
        self.device = torch.device(instance_device(args))
        use_cuda_device(torch, self.device, config_param(config, tn.GPU_PARAM_CUDA_SYNC, DEFAULT_CUDA_SYNC),
                        SERVED_CUDNN_AUTOTUNE)
        module = load_network(_FolderBundle(folder, spec, 1000), config_param(config, tn.GPU_PARAM_NETWORK, "auto"))
        self.network = TopKNetwork(module, crop=tuple(shape[1:]), device=self.device,
                                   half=tensor["data_type"] == "TYPE_FP16", batch_size=self.batch_size,
                                   cuda_graph=config_param(config, tn.GPU_PARAM_CUDA_GRAPH, "true").lower() == "true",
                                   top_k=self.top_k, probabilities=spec.probabilities)
        self.network.warmup()
        LOG.info("network model ready on %s", self.device)

    def execute(self, requests):
        pb = self.pb
        inputs = [pb.get_input_tensor_by_name(r, tn.PREPROCESSED) for r in requests]
        status = [pb.get_input_tensor_by_name(r, STATUS) for r in requests]
        tags = np.concatenate([as_numpy(pb.get_input_tensor_by_name(r, tn.INPUT_TAG)).reshape(-1).astype(np.int64)
                               for r in requests])
        ids, scores, failed, sizes = self._classify(inputs, status)
        ids[failed], scores[failed] = 0, 0.0  # an image that was not prepared gets no class
        responses, start = [], 0
        for size in sizes:
            end = start + size
            responses.append(pb.InferenceResponse(output_tensors=[
                output_tensor(pb, tn.OUTPUT_CLASS_IDS, ids[start:end]),
                output_tensor(pb, tn.OUTPUT_SCORES, scores[start:end]),
                output_tensor(pb, tn.OUTPUT_ECHO, tags[start:end, None]),
            ]))
            start = end
        return responses

    def _classify(self, inputs, status):
        """Classes and scores of the requests' rows, which rows failed, and each request's size."""
        torch = self.torch
        parts = [torch.from_dlpack(t) for t in inputs]
        x = torch.cat(parts).to(self.device, self.network.dtype)
        ids = np.zeros((len(x), self.top_k), np.int32)
        scores = np.zeros((len(x), self.top_k), np.float32)
        for s in range(0, len(x), self.batch_size):
            vals, idx = self.network.scores(x[s : s + self.batch_size])
            k = idx.shape[1]
            ids[s : s + len(idx), :k] = idx.cpu().numpy()
            scores[s : s + len(idx), :k] = vals.cpu().numpy()
        failed = torch.cat([torch.from_dlpack(t).reshape(-1).cpu() for t in status]).numpy() != 0
        return ids, scores, failed, [len(p) for p in parts]

    def finalize(self):
        self.network.clear()


def ensemble_configs(spec, options: GpuModelOptions = GpuModelOptions(), *, preprocess_instances: int | None = None,
                     network_instances: int = NETWORK_INSTANCES) -> dict[str, str]:
    """config.pbtxt of each model of the gpu profile's ensemble shape: ``preprocess`` (python backend: triage, DALI
    and the reference; ragged ``IMAGE`` in, ``PREPROCESSED`` + ``WIDTH``/``HEIGHT``/``STATUS`` out), ``network``
    (python backend: the torch network + top-k, ``PREPROCESSED`` read on the GPU) and the ``classifier`` ensemble
    joining them, with the contract's inputs and outputs.

    ``half``: "auto" and "true" pass FP16 between the models (declared in the configs, so the same on any device),
    "false" FP32.

    Raises:
        ConfigError: instance counts below 1.
    """
    o = options
    pre_count = preprocess_instances or o.instances or PREPROCESS_INSTANCES
    if pre_count < 1 or network_instances < 1:
        raise ConfigError(f"preprocess_instances={pre_count} and network_instances={network_instances} must be "
                          "at least 1")
    batch_size = GPU_DEFAULT_BATCH_SIZE if o.batch_size is None else o.batch_size
    error_output = declares_error(o.error_output)
    top_k, max_batch_size = o.top_k, o.max_batch_size
    mc = model_config()
    dtype = "FP32" if o.half == "false" else "FP16"
    shape = list(spec.input_shape)
    configs = {}

    pre = mc.ModelConfig(name=tn.PREPROCESS_MODEL, backend="python", max_batch_size=max_batch_size)
    for name, kind in tn.INPUTS.items():
        _tensor(pre.input, name, kind, [-1] if name == tn.INPUT_IMAGE else [1])
    pre.input[0].allow_ragged_batch = True  # requests padded to different lengths share one execute()
    _tensor(pre.output, tn.PREPROCESSED, dtype, shape)
    for name in (tn.OUTPUT_WIDTH, tn.OUTPUT_HEIGHT, STATUS):
        _tensor(pre.output, name, "INT32", [1])
    _tensor(pre.output, tn.OUTPUT_ECHO, tn.OUTPUTS[tn.OUTPUT_ECHO], [1])
    if error_output:
        _tensor(pre.output, tn.OUTPUT_ERROR, "BYTES", [1])
    _place(pre, "GPU", pre_count, o.queue_delay_us)
    _set_parameters(pre, prep_parameters(o, batch_size))
    configs[tn.PREPROCESS_MODEL] = _text(pre)

    net = mc.ModelConfig(name=NETWORK_MODEL, backend="python", max_batch_size=max_batch_size)
    _tensor(net.input, tn.PREPROCESSED, dtype, shape)
    _tensor(net.input, STATUS, "INT32", [1])
    _tensor(net.input, tn.INPUT_TAG, tn.INPUTS[tn.INPUT_TAG], [1])
    _tensor(net.output, tn.OUTPUT_CLASS_IDS, "INT32", [top_k])
    _tensor(net.output, tn.OUTPUT_SCORES, "FP32", [top_k])
    _tensor(net.output, tn.OUTPUT_ECHO, tn.OUTPUTS[tn.OUTPUT_ECHO], [1])
    _place(net, "GPU", network_instances, o.queue_delay_us)
    _set_parameters(net, {
        tn.GPU_PARAM_NETWORK: o.network,
        tn.GPU_PARAM_BATCH_SIZE: batch_size,
        tn.GPU_PARAM_CUDA_GRAPH: "true" if o.cuda_graph else "false",
        # the python backend copies inputs to the CPU unless told not to: PREPROCESSED stays on the GPU
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        tn.GPU_PARAM_CUDA_SYNC: o.cuda_sync,
    })
    configs[NETWORK_MODEL] = _text(net)

    ens = mc.ModelConfig(name=tn.MODEL_NAME, platform="ensemble", max_batch_size=max_batch_size)
    _contract_io(ens, top_k, with_error=error_output)
    ens.parameters[tn.PARAM_CHECKS_CAPS].string_value = "true"  # the preprocess model's triage checks both caps
    step = ens.ensemble_scheduling.step.add(model_name=tn.PREPROCESS_MODEL, model_version=-1)
    for name in tn.INPUTS:
        step.input_map[name] = name
    passed = (tn.OUTPUT_WIDTH, tn.OUTPUT_HEIGHT) + ((tn.OUTPUT_ERROR,) if error_output else ())
    for name in (tn.PREPROCESSED, STATUS) + passed:
        step.output_map[name] = name
    step.output_map[tn.OUTPUT_ECHO] = PREPROCESSED_TAG
    step = ens.ensemble_scheduling.step.add(model_name=NETWORK_MODEL, model_version=-1)
    for name in (tn.PREPROCESSED, STATUS):
        step.input_map[name] = name
    step.input_map[tn.INPUT_TAG] = PREPROCESSED_TAG
    for name in (tn.OUTPUT_CLASS_IDS, tn.OUTPUT_SCORES, tn.OUTPUT_ECHO):
        step.output_map[name] = name
    configs[tn.MODEL_NAME] = _text(ens)
    return configs


def build_ensemble_repository(model: str | None, output, *, preprocess_instances: int | None = None,
                              network_instances: int = NETWORK_INSTANCES, **options) -> Path:
    """Writes the ensemble shape for ``model`` (a model folder, or None for the default) into ``output``: ``preprocess``
    and ``network`` (shims importing this module, with the model's ``preprocess.json``; the network's folder gets a
    user's model files) and the ``classifier`` ensemble (``ensemble_configs``). ``options`` are ``GpuModelOptions``
    fields, ``instances`` the preprocess instances unless ``preprocess_instances`` is given.

    Raises:
        ConfigError: an option of the single shape only, or a bad value (before anything is written).
    """
    extra = sorted(set(options) & set(SINGLE_ONLY_OPTIONS))
    if extra:
        raise ConfigError(f"the gpu profile's ensemble shape has no {', '.join(extra)}; drop it, or use shape single")
    spec, network_files = gpu_model_files(model)
    configs = ensemble_configs(spec, GpuModelOptions(**options), preprocess_instances=preprocess_instances,
                               network_instances=network_instances)
    folders = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(HERE) not in folders:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, folders)])
    out = Path(output).expanduser()
    for name, cls in ((tn.PREPROCESS_MODEL, "PreprocessModel"), (NETWORK_MODEL, "NetworkModel")):
        version = out / name / VERSION
        version.mkdir(parents=True, exist_ok=True)
        (version / SHIM_FILE).write_text(_SHIM.format(cls=cls, env=STUB_PATH_ENV), encoding="utf-8")
        (version / SPEC_FILE).write_text(spec.to_json(), encoding="utf-8")
    for path in network_files:
        shutil.copyfile(path, out / NETWORK_MODEL / VERSION / path.name)
    (out / tn.MODEL_NAME / VERSION).mkdir(parents=True, exist_ok=True)
    (out / tn.MODEL_NAME / VERSION / SHIM_FILE).unlink(missing_ok=True)  # a single shape built here before
    for name, text in configs.items():
        (out / name / CONFIG_FILE).write_text(text, encoding="utf-8")
    return out
