"""The gpu profile's ensemble shape in Triton: ``PreprocessModel`` (triage + DALI + the reference) and
``NetworkModel`` (the torch network + top-k), two python-backend models joined by the ``classifier`` ensemble.

The production profile's shape with the gpu engine's parts: ``preprocess`` runs ``GpuClassifier.preprocess`` (the
same triage, DALI batches and Pillow reference as the single model, no network) and sends ``PREPROCESSED`` as a GPU
tensor through DLPack; ``network`` reads it on the GPU (``FORCE_CPU_ONLY_INPUT_TENSORS: no``) and runs
``TopKNetwork`` (the single model's CUDA graph, softmax and top-k). ``STATUS`` tells the network which rows failed
(they get no class). A bad image: with the ``ERROR`` output (numpy 1 in the stub) the preprocess model sends its text
and the ensemble passes it on; without it (numpy 2: BYTES cannot be sent) the request fails with the first error and
the client isolates the bad file, as with the single model.

Each image's ``TAG`` goes with its tensor: the preprocess model sends it on (``PREPROCESSED_TAG``) and the network
model echoes it in ``ECHO`` beside its classes, so the client checks both models' batching of every image.

Each model builds its part in one method (``PreprocessModel._build_classifier``, ``NetworkModel._load_network``), and
the network model runs it in another (``_classify``), so a subclass can serve other parts: the benchmarks' hop
(tests/benchmarks/hop_model.py) does.
"""

from __future__ import annotations

import logging

import numpy as np

from pipeline.gpu.classifier import Preprocessed
from pipeline.model.imaging import DecodeLimits
from pipeline.triton import contract as tn
from pipeline.triton.serve.backend import as_numpy, bad_input, config_limits, config_param, request_limits
from pipeline.triton.serve.gpu_model import (
    SERVED_CUDNN_AUTOTUNE,
    _FolderBundle,
    build_classifier,
    instance_device,
    model_setup,
    output_tensor,
    request_images,
    request_tags,
)

LOG = logging.getLogger(__name__)


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
        batch_size = int(config_param(config, tn.GPU_PARAM_BATCH_SIZE, str(tn.GPU_DEFAULT_BATCH_SIZE)))
        device = instance_device(args)
        self.classifier = self._build_classifier(config, spec, device, batch_size)
        LOG.info("preprocess model ready on %s", device)

    def _build_classifier(self, config: dict, spec, device: str, batch_size: int):
        """What prepares the images (``preprocess(blobs, limits)``): ``GpuClassifier`` without its network."""
        return build_classifier(config, spec, None, device=device, top_k=1, limits=self.limits,
                                batch_size=batch_size, half=self.half)

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
            output_tensor(pb, tn.STATUS, status),
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
        self.batch_size = int(config_param(config, tn.GPU_PARAM_BATCH_SIZE, str(tn.GPU_DEFAULT_BATCH_SIZE)))
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
        status = [pb.get_input_tensor_by_name(r, tn.STATUS) for r in requests]
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
