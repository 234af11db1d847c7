"""The ``gpu`` engine: ``GpuClassifier`` in the actor's process, returning ``Result`` rows.

Calls share one pipeline: every ``classify`` call queues its images into one ``RequestStream`` (the same one the gpu
profile's Triton model runs), so with several calls at once (``--calls-per-actor``; the engine's default in ``SPEC``)
the next call's images are decoded while the network runs this one's, and network batches are full across calls.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

from pipeline.engines.base import INT8_FIX, EngineSpec, Option, Result, positive_int, results_from_topk
from pipeline.errors import ConfigError, EngineError
from pipeline.gpu.classifier import RawResults
from pipeline.gpu.dali import DALI_INSTALL
from pipeline.gpu.defaults import CUDA_SYNC_MODES, NO_INT8
from pipeline.model.folder import ModelBundle, is_builtin
from pipeline.model.imaging import DecodeLimits
from pipeline.node import importable
from pipeline.schema import DEFAULT_TOP_K, STAGE_INFER, STATUS_OK

SPEC = EngineSpec(
    name="gpu",
    factory=f"{__name__}:GpuEngine",
    summary="DALI decode + resize and a PyTorch network on the actor's GPU",
    options=(
        Option("network", str, "'auto' (the model's) or a network registered with "
               "pipeline.gpu.networks.register_network"),
        positive_int("dali_threads", "DALI's CPU threads per pipeline, e.g. 4"),
        positive_int("dali_depth", "batches in flight on one DALI pipeline (1: a pipeline per prep worker), e.g. 2"),
        positive_int("batch_size", "images per network call, e.g. 256"),
        Option("device", str, "a torch device, e.g. cuda:0; cpu runs DALI's CPU backend and torch on the CPU (slow, "
                              "for tests)"),
        Option("cuda_graph", bool, "capture the network in a CUDA graph: true or false"),
        Option("half", bool, "FP16 network: true or false (default: FP16 where the precision gate passes)"),
        Option("compile", bool, "torch.compile the network: true or false (default: a converted model.onnx on "
                                "CUDA)"),
        positive_int("cpu_decode_threads", "Pillow threads decoding what DALI does not take, e.g. 4"),
        Option("pipeline", bool, "prepare the next batches while the network runs: true or false"),
        positive_int("prep_workers", "threads preparing batches (at dali_depth 1: one DALI pipeline each), e.g. 2"),
        Option("hw_decoder_load", float, "share of each batch for DALI's hardware JPEG decoder, 0..1"),
        Option("cuda_sync", str, "how threads wait for the GPU: auto (CUDA's: spin), spin, yield or block",
               choices=CUDA_SYNC_MODES),
    ),
    needs_gpu=True,
    gpu_only=True,
    decode_threads_option="cpu_decode_threads",
    preflight=f"{__name__}:check_requirements",
    model_check=f"{__name__}:check_model",
    # Calls share one pipeline (RequestStream), so the next call decodes while the network runs this one;
    # three actors keep one GPU busiest (docs/performance.md).
    calls_per_actor=3,
    actors_per_gpu=3,
    gpu_batch_size=2048,
    runs_int8=False,
    int8=f"INT8 models: none ({NO_INT8}); {INT8_FIX}",
    several_models=True,
)


class GpuEngine:
    """The ``gpu`` engine: ``GpuClassifier`` in this process, returning ``Result`` rows.

    Args:
        bundle: the model (``pipeline.model.folder.ModelBundle``). The default EfficientNet-Lite0 runs as a torch module
            built from its checkpoint; a user's model as its ``model.onnx`` converted to torch
            (``pipeline.gpu.onnx_torch``), or its ``model.torchscript`` where the folder has one.
        top_k: classes per image.
        limits: decode limits.
        more: a model set's other models (bundles): decoded once with this one, each through its own preprocessing
            and network (``SetModel``), its answers in each ``Result.more``, its top-k capped at its classes.
        **options: ``network`` (a torch module, or a name ``networks.register_network`` knows), and the
            ``ClassifierOptions`` fields: batch_size, device, cuda_graph, half, cpu_decode_threads, pipeline,
            prep_workers, hw_decoder_load, dali_threads, dali_depth, cuda_sync, compile.
    """

    name = "gpu"

    def __init__(self, bundle, *, top_k: int = DEFAULT_TOP_K, limits: DecodeLimits = DecodeLimits(),
                 more: Sequence[ModelBundle] = (), **options: Any):
        from pipeline.gpu.classifier import ClassifierOptions, GpuClassifier, SetModel  # noqa: PLC0415 - torch, DALI
        from pipeline.gpu.networks import load_network  # noqa: PLC0415 - needs torch

        if options.get("device") is None:
            _require_cuda()
        network = options.pop("network", None)
        if network is None or isinstance(network, str):
            network = load_network(bundle, network)
        self.labels = tuple(bundle.labels)
        self.more_labels = [tuple(b.labels) for b in more]
        self.limits = limits
        self.stage_seconds = {STAGE_INFER: 0.0}  # decode and network overlap on the GPU: one stage
        set_models = [SetModel(load_network(b), b.spec, top_k=min(top_k, b.num_classes),
                               fixed_batch=getattr(b, "fixed_batch", None),
                               precision_gate=options.get("precision_gate", not is_builtin(b))) for b in more]
        options.setdefault("precision_gate", not is_builtin(bundle))
        self.classifier = GpuClassifier(network, bundle.spec, ClassifierOptions(
            top_k=top_k, limits=limits, fixed_batch=getattr(bundle, "fixed_batch", None), **options), more=set_models)
        self._stream = None
        if self.classifier.pipeline:
            from pipeline.gpu.stream import RequestStream  # noqa: PLC0415

            self._stream = RequestStream(self.classifier, _respond, top_k=top_k)

    def classify(self, images: Sequence[bytes]) -> list[Result]:
        start = time.perf_counter()
        if self._stream is None:
            raw = self.classifier.classify(images)
        else:
            done: Future = Future()
            self._stream.submit(done, list(images), self.limits)
            raw = done.result()
        self.stage_seconds[STAGE_INFER] += time.perf_counter() - start
        return results_from_raw(raw, self.labels, self.more_labels)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.classifier.close()

    def __enter__(self) -> "GpuEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NO_GPU = ("--engine gpu runs on a GPU and {where} has none that it can use; use --engine onnx, or "
          "--engine-option device=cpu to run DALI's CPU backend and torch on the CPU (slow; for tests)")


def _require_cuda() -> None:
    """An actor without a CUDA device refuses, rather than running the GPU pipeline on its CPU unasked."""
    import torch  # noqa: PLC0415 - the gpu engine's own requirement

    if not torch.cuda.is_available():
        raise EngineError(NO_GPU.format(where="this actor"))


def _respond(done: Future, raw: RawResults, n: int) -> None:
    done.set_result(raw)


def results_from_raw(raw: RawResults, labels: Sequence[str], more_labels: Sequence[Sequence[str]] = ()) -> list[Result]:
    """Turns ``RawResults`` arrays into one ``Result`` per image; a model set's other models' answers (``raw.more``,
    with ``more_labels``) go in its ``more``, except for an image with an error of its own (every model's). Each
    model's embedding (``raw.embedding``, ``ModelScores.embedding``) goes in its ok rows' ``embedding``; a row whose
    embedding was not finite already has NaN scores, so it is that model's NONFINITE error row."""
    sizes = [(int(w) or None, int(h) or None) for w, h in zip(raw.width, raw.height)]
    results = _with_embeddings(results_from_topk(raw.class_ids, raw.scores, labels, sizes, raw.errors), raw.embedding)
    others = [_with_embeddings(results_from_topk(m.class_ids, m.scores, names, sizes), m.embedding)
              for m, names in zip(raw.more, more_labels)]
    for i, result in enumerate(results):
        if others and not raw.errors[i]:
            result.more = [rows[i] for rows in others]
    return results


def _with_embeddings(results: list[Result], embedding) -> list[Result]:
    """``results`` with each ok row's embedding from its row of ``embedding`` (float32 [N, dim], or None)."""
    if embedding is not None:
        for result, vector in zip(results, embedding):
            if result.status == STATUS_OK:
                result.embedding = vector
    return results


def check_requirements(options: Mapping[str, Any]) -> None:
    """The gpu engine's preflight (its ``EngineSpec.preflight``): PyTorch and DALI importable here, and a GPU unless
    the ``device`` option names one (``cpu`` for tests)."""
    if importlib.util.find_spec("torch") is None:
        raise ConfigError("--engine gpu needs PyTorch with CUDA (the GPU worker image has it); install torch, "
                          "or use --engine onnx or --engine triton")
    if not importable("nvidia.dali"):
        raise ConfigError(f"--engine gpu {DALI_INSTALL} (the gpu extra includes it), or use --engine onnx")


def check_model(bundle: ModelBundle, options: Mapping[str, Any], gpus: tuple[int, str]) -> None:
    """The gpu engine's ``EngineSpec.model_check``, in the driver: a model the gpu paths can run (also the triton
    engine's gpu profile, which runs the same classifier), on the cluster's ``gpus`` (count, where it was taken)."""
    from pipeline.gpu.networks import check_runnable  # noqa: PLC0415 - cheap: torch loads inside functions

    if options.get("device") is None:  # on a cluster too, where the preflight is skipped
        count, where = gpus
        if count <= 0:
            raise ConfigError(NO_GPU.format(where=where))
    if options.get("network") in (None, "", "auto", "default"):  # not a benchmark network
        check_runnable(bundle, "--engine gpu")
