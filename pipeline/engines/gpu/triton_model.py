"""The gpu profile's Triton python-backend model: ``GpuClassifier`` (pipeline.engines.gpu.classifier) behind the shared contract.

Runs inside tritonserver on a GPU (KIND_GPU instances). Its version folder holds ``preprocess.json`` and, for a
user's model, ``model.torchscript``; without one it serves the default EfficientNet-Lite0 from its checkpoint.
It serves ``pipeline.triton.contract``' contract: a bad image gives an ``ERROR`` string for that image only.

The dynamic batcher may hand ``execute`` several requests at once: ``IMAGE`` is declared ragged
(``allow_ragged_batch``), so requests padded to different lengths still reach one ``execute`` call, where all their
images go through one pipelined ``GpuClassifier.classify`` (decode of batch n+1 overlapping the network on n).
Tensors cross the backend through DLPack: with numpy 2 in the stub's Python, ``as_numpy()`` mis-reads them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from pipeline.triton import contract as tn
from pipeline.imaging import DecodeLimits, PreprocessSpec

LOG = logging.getLogger(__name__)

def _param(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return value.strip() or default


def _as_numpy(tensor) -> np.ndarray:
    try:
        return np.from_dlpack(tensor)
    except (AttributeError, TypeError, RuntimeError, BufferError):
        return tensor.as_numpy()


class _FolderBundle:
    """What ``pipeline.engines.gpu.networks.load_network`` needs from a bundle, read from the version folder."""

    def __init__(self, folder: Path, spec: PreprocessSpec, classes: int):
        from pipeline.default_model import MODEL_NAME  # noqa: PLC0415

        self.name = MODEL_NAME
        self.onnx_path = folder / "model.onnx"  # only its folder is used: model.torchscript beside it
        self.labels = tuple(str(i) for i in range(classes))
        self.spec = spec


class TritonPythonModel:
    """Triton's python-backend entry points."""

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 - exists only inside the stub

        from pipeline.engines.gpu.dali import DEFAULT_HW_DECODER_LOAD, make_classifier, uses_dali  # noqa: PLC0415
        from pipeline.engines.gpu.networks import default_network, load_network  # noqa: PLC0415

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        folder = Path(args["model_repository"]) / args["model_version"]
        spec = PreprocessSpec.from_json((folder / tn.SPEC_FILE).read_text(encoding="utf-8"))
        outputs = {o["name"]: o for o in config["output"]}
        self.top_k = int(outputs[tn.OUTPUT_CLASS_IDS]["dims"][0])
        self.has_error = tn.OUTPUT_ERROR in outputs
        kind = args.get("model_instance_kind", "GPU")
        device = f"cuda:{int(args.get('model_instance_device_id', 0))}" if kind == "GPU" else "cpu"
        bundle = _FolderBundle(folder, spec, 1000)
        net_name = _param(config, tn.GPU_PARAM_NETWORK, "auto")
        half = _param(config, tn.GPU_PARAM_HALF, "auto").lower()
        decoder = _param(config, tn.GPU_PARAM_DECODER, "auto")
        if half == "auto":
            # FP16, except the default model on the hand-written resampler, whose FP32 network is what meets parity
            # there; on DALI the FP32 network agrees no better than FP16 (GPU_NOTES.md).
            half = uses_dali(decoder, device) or not default_network(bundle, net_name)
        else:
            half = half == "true"
        network = load_network(bundle, net_name)
        self.limits = DecodeLimits(
            max_bytes=int(_param(config, tn.GPU_PARAM_MAX_BYTES, str(DecodeLimits().max_bytes))),
            max_pixels=int(_param(config, tn.GPU_PARAM_MAX_PIXELS, str(DecodeLimits().max_pixels))),
        )
        self.classifier = make_classifier(
            network,
            spec,
            hw_decode_load=float(_param(config, tn.GPU_PARAM_HW_DECODER_LOAD, str(DEFAULT_HW_DECODER_LOAD))),
            top_k=self.top_k,
            limits=self.limits,
            decoder=decoder,
            batch_size=int(_param(config, tn.GPU_PARAM_BATCH_SIZE, str(tn.GPU_DEFAULT_BATCH_SIZE))),
            device=device,
            cuda_graph=_param(config, tn.GPU_PARAM_CUDA_GRAPH, "true").lower() == "true",
            prep_workers=int(_param(config, tn.GPU_PARAM_PREP_WORKERS, "1")),
            half=half,
        )
        self.classifier.warmup()
        LOG.info("gpu model ready on %s (decoder %s)", device, self.classifier.decoder_name)

    def _request_limits(self, request) -> DecodeLimits:
        try:
            params = json.loads(request.parameters() or "{}")
        except (AttributeError, ValueError):
            params = {}
        return DecodeLimits(
            max_bytes=int(params.get(tn.GPU_PARAM_MAX_BYTES, self.limits.max_bytes)),
            max_pixels=int(params.get(tn.GPU_PARAM_MAX_PIXELS, self.limits.max_pixels)),
        )

    def execute(self, requests):
        pb = self.pb
        responses: list = [None] * len(requests)
        # All requests with the same limits go through one classify call: one pipeline over all their images.
        groups: dict[DecodeLimits, list[tuple[int, list[bytes]]]] = {}
        for r, request in enumerate(requests):
            try:
                images = _as_numpy(pb.get_input_tensor_by_name(request, tn.INPUT_IMAGE))
                lengths = _as_numpy(pb.get_input_tensor_by_name(request, tn.INPUT_LENGTH)).reshape(-1)
                if images.ndim != 2 or lengths.shape[0] != images.shape[0]:
                    raise ValueError(f"{tn.INPUT_IMAGE} must be [n, bytes] and {tn.INPUT_LENGTH} [n, 1]")
                blobs = [images[i, : int(lengths[i])].tobytes() for i in range(images.shape[0])]
                groups.setdefault(self._request_limits(request), []).append((r, blobs))
            except Exception as err:  # noqa: BLE001 - a malformed request fails alone, with the reason
                responses[r] = pb.InferenceResponse(output_tensors=[], error=pb.TritonError(str(err)))
        for limits, members in groups.items():
            blobs = [b for _, bl in members for b in bl]
            try:
                self.classifier.limits = limits
                raw = self.classifier.classify(blobs)
            except Exception as err:  # noqa: BLE001 - reported on each request of the group
                LOG.exception("gpu classify failed")
                for r, _ in members:
                    responses[r] = pb.InferenceResponse(output_tensors=[], error=pb.TritonError(str(err)))
                continue
            start = 0
            for r, bl in members:
                end = start + len(bl)
                failed = [e for e in raw.errors[start:end] if e]
                if failed and not self.has_error:
                    # No ERROR output (numpy 2 in this Python): fail the request; the client splits it to
                    # isolate the bad input, whose own one-image request then carries its error text.
                    msg = failed[0] if len(bl) == 1 else f"{len(failed)} of {len(bl)} images failed; first: {failed[0]}"
                    responses[r] = pb.InferenceResponse(output_tensors=[], error=self._bad_input(msg))
                else:
                    responses[r] = pb.InferenceResponse(output_tensors=self._tensors(raw, start, end))
                start = end
        return responses

    def _bad_input(self, msg: str):
        """An INVALID_ARG error (not INTERNAL, which clients read as a failing server)."""
        code = getattr(self.pb.TritonError, "INVALID_ARG", None)
        return self.pb.TritonError(msg, code) if code is not None else self.pb.TritonError(msg)

    def _tensors(self, raw, start: int, end: int) -> list:
        import torch  # noqa: PLC0415 - present wherever this model runs

        pb = self.pb

        def out_tensor(name: str, arr: np.ndarray):
            # Through torch's DLPack capsule: numpy's own capsule crashed the stub ("PyCapsule_GetPointer called
            # with incorrect name"), and pb.Tensor(name, ndarray) mis-reads numpy-2 arrays.
            return pb.Tensor.from_dlpack(name, torch.from_numpy(np.ascontiguousarray(arr)))

        out = [
            out_tensor(tn.OUTPUT_CLASS_IDS, raw.class_ids[start:end]),
            out_tensor(tn.OUTPUT_SCORES, raw.scores[start:end]),
            out_tensor(tn.OUTPUT_WIDTH, raw.width[start:end, None]),
            out_tensor(tn.OUTPUT_HEIGHT, raw.height[start:end, None]),
        ]
        if self.has_error:
            errors = np.array([[e.encode("utf-8")] for e in raw.errors[start:end]], dtype=np.object_)
            out.append(pb.Tensor(tn.OUTPUT_ERROR, errors))
        return out

    def finalize(self):
        self.classifier.close()
