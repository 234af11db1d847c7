"""The ``onnx`` engine: ONNX Runtime on the actor's CPU cores, decoding on a thread pool; top-k of the scores the
spec's ``output`` makes of the network's outputs (``pipeline.model.scores``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from pipeline.engines.base import NONFINITE_ERROR, EngineSpec, Result, positive_int, results_from_topk
from pipeline.errors import ConfigError, EngineError, ImageError
from pipeline.model.contract import fixed_batches
from pipeline.model.folder import ModelBundle
from pipeline.model.imaging import MAX_DECODE_THREADS, DecodeLimits, decode_image, preprocess_image
from pipeline.model.onnx_graph import network_outputs, runtime_graph
from pipeline.model.scores import embeddings_of, scores_of, top_scores
from pipeline.model.spec import OUTPUT_LOGITS, OUTPUT_PROBABILITIES, EmbeddingSpec
from pipeline.schema import DEFAULT_TOP_K, STAGE_DECODE, STAGE_INFER, STATUS_OK

LOG = logging.getLogger(__name__)

# Images per ORT run: small batches are the most CPU-efficient for this depthwise-conv network
# (tests/benchmarks/bench_engine.py measures them).
DEFAULT_MAX_BATCH = 8
# ONNX Runtime threads per run of an engine built on its own: one, because an actor runs several calls at once (the
# onnx engine's calls_per_actor), which overlap decoding better than one run on every core. In a job each call gets
# the actor's share of the node's cores instead (call_threads_option), which is also 1 on 2 cores.
DEFAULT_INTRA_OP_THREADS = 1

# The decoding pool's option, shared by the engines built on this one (openvino).
DECODE_THREADS_OPTION = positive_int("decode_threads", "threads decoding images per actor, e.g. 4 (default: the "
                                     f"machine's CPUs, at most {MAX_DECODE_THREADS})")
# What a job gives each call's compute threads by default on a CPU node (``pipeline.job.stages.call_threads``).
CALL_THREADS_DEFAULT = "default in a job: the actor's share of the cores over its calls, 1 on 2 cores, 2 on 16"

SPEC = EngineSpec(
    name="onnx",
    factory=f"{__name__}:OnnxEngine",
    summary="ONNX Runtime on the actor's CPU cores (auto's choice without GPUs)",
    options=(
        DECODE_THREADS_OPTION,
        positive_int("intra_op_threads", f"ONNX Runtime threads per run, e.g. 2 ({CALL_THREADS_DEFAULT})"),
        positive_int("max_batch", "images per ONNX Runtime run, e.g. 8"),
    ),
    decode_threads_option="decode_threads",
    call_threads_option="intra_op_threads",
    # Two calls, each running ONNX Runtime on its half of the actor's cores (one thread on 2 cores): one call's batch
    # decodes on the pool while the other's runs the network, so the stages overlap instead of taking turns
    # (docs/performance.md).
    calls_per_actor=2,
    several_models=True,
)


def topk_softmax(logits: np.ndarray, k: int, *, probabilities: bool = False,
                 output: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The k highest scores per row: of the softmax over the classes, of the rows as given (``probabilities``), or per
    ``output`` (the spec's kind: ``pipeline.model.scores``).

    Args:
        logits: (N, C) array.
        k: how many classes to keep; capped at C.

    Returns:
        (ids (N, k) int64, scores (N, k) float32), descending; a row holding NaN or infinity scores NaN.
    """
    kind = output or (OUTPUT_PROBABILITIES if probabilities else OUTPUT_LOGITS)
    return top_scores(scores_of(logits, kind), k)


def results_from_logits(
    logits: np.ndarray, labels: Sequence[str], top_k: int, sizes: Sequence[tuple[int, int]], *,
    output: str = OUTPUT_LOGITS,
) -> list[Result]:
    """Results from a batch of raw outputs, scored per ``output`` (the spec's), and the original (width, height) of
    each image; a row holding NaN or infinity is an engine_error row."""
    ids, scores = topk_softmax(logits, top_k, output=output)
    return results_from_topk(ids, scores, labels, sizes)


@dataclass(frozen=True)
class _Model:
    """One model an engine runs: its folder, its network (``OnnxEngine._network``) and its top-k."""

    bundle: ModelBundle
    forward: Callable[[np.ndarray], np.ndarray]
    top_k: int


def attach_embeddings(results: list[Result], values: np.ndarray, spec: EmbeddingSpec) -> None:
    """Each ok result's embedding from its row of ``values`` (N, dim), L2-normalised where ``spec`` says; a row that
    is not finite makes its result the NONFINITE_ERROR row."""
    for i, (result, vector) in enumerate(zip(results, embeddings_of(values, spec))):
        if result.status != STATUS_OK:
            continue
        if not np.isfinite(vector).all():
            results[i] = Result.failed(NONFINITE_ERROR, result.width, result.height)
        else:
            result.embedding = vector


class OnnxEngine:
    """Classifies encoded images with ONNX Runtime on the CPU; decoding runs on a thread pool.

    Args:
        bundle: the model (see ``pipeline.model.folder.load_model``).
        top_k: classes per result.
        limits: caps on encoded bytes and header pixels.
        decode_threads: threads decoding and preprocessing (Pillow releases the GIL); default the CPU count, at most MAX_DECODE_THREADS.
        intra_op_threads: ONNX Runtime's threads per run; default DEFAULT_INTRA_OP_THREADS.
        max_batch: images per ORT run; larger inputs to ``classify`` are split.
        more: a model set's other models: each image is decoded once, then each model's preprocessing and network
            run on it, their answers in ``Result.more``.
    """

    name = "onnx"

    def __init__(
        self,
        bundle: ModelBundle,
        *,
        top_k: int = DEFAULT_TOP_K,
        limits: DecodeLimits = DecodeLimits(),
        decode_threads: int | None = None,
        intra_op_threads: int | None = DEFAULT_INTRA_OP_THREADS,
        max_batch: int = DEFAULT_MAX_BATCH,
        more: Sequence[ModelBundle] = (),
    ):
        if max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {max_batch}")
        self.bundle = bundle
        self.top_k = min(top_k, bundle.num_classes)
        self.limits = limits
        self.max_batch = max_batch
        threads = decode_threads or min(MAX_DECODE_THREADS, os.cpu_count() or 1)
        if threads < 1:
            raise ConfigError(f"decode_threads must be at least 1, got {decode_threads}")
        if intra_op_threads is not None and intra_op_threads < 1:
            raise ConfigError(f"intra_op_threads must be at least 1, got {intra_op_threads}")
        # Each model of the run (one, or a model set's): its network, its top-k capped at its classes; every model
        # runs on one decode of each image.
        self.models = [_Model(b, self._network(b, intra_op_threads), min(top_k, b.num_classes))
                       for b in (bundle, *more)]
        if bundle.fixed_batch and not more:  # the graph takes no other batch size: run exactly that many
            self.max_batch = bundle.fixed_batch
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="decode")
        self.decode_threads = threads
        # Cumulative seconds per stage, read by the actor for the run report. decode_preprocess sums the
        # pool threads' time (it overlaps inference), infer is the network's wall time.
        self.stage_seconds = {STAGE_DECODE: 0.0, STAGE_INFER: 0.0}
        self._stage_lock = threading.Lock()

    def _network(self, bundle: ModelBundle, threads: int | None) -> Callable[[np.ndarray], np.ndarray]:
        """``bundle``'s network as one array a batch: its class outputs, then its embedding's where it declares one
        (``_open_runtime`` fetches both), in runs of its fixed batch where it has one."""
        forward = self._open_runtime(bundle, threads)
        return fixed_batches(forward, bundle.fixed_batch) if bundle.fixed_batch else forward

    def _open_runtime(self, bundle: ModelBundle, threads: int | None) -> Callable[[np.ndarray], np.ndarray]:
        """The network as a function of a batch (N, C, H, W float32) to its logits, safe to call from several
        threads at once; ``threads``: compute threads per call (None: the runtime's default)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.inter_op_num_threads = 1
        # ORT's worker threads spin while idle by default; here they share cores with the decode threads (and, in
        # a Ray job, with other actors), where spinning only steals CPU from the work.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads is not None:
            options.intra_op_num_threads = threads
        try:
            session = ort.InferenceSession(runtime_graph(bundle), sess_options=options,
                                           providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types
            raise EngineError(f"ONNX Runtime cannot load {bundle.onnx_path}: {e}; check the file with onnx.checker") from None
        outputs, input_name = list(network_outputs(bundle)), bundle.input_name
        if len(outputs) == 1:
            return lambda batch: session.run(outputs, {input_name: batch})[0]
        return lambda batch: np.concatenate(
            [o.reshape(len(batch), -1) for o in session.run(outputs, {input_name: batch})], axis=1)

    def classify(self, images: Sequence[bytes]) -> list[Result]:
        """One Result per encoded image, same order; bad images become error results."""
        chunks = [images[i : i + self.max_batch] for i in range(0, len(images), self.max_batch)]
        results: list[Result] = []
        # Decode the next chunk on the pool while ONNX Runtime runs the current one.
        pending = [self._pool.submit(self._decode, data) for data in chunks[0]] if chunks else []
        for index in range(len(chunks)):
            decoded = [f.result() for f in pending]
            if index + 1 < len(chunks):
                pending = [self._pool.submit(self._decode, data) for data in chunks[index + 1]]
            results.extend(self._classify_decoded(decoded))
        return results

    def _decode(self, data: bytes) -> tuple[list[np.ndarray], int, int] | Result:
        """One image decoded once, then each model's input made from it (models with one spec share it)."""
        start = time.perf_counter()
        try:
            img = decode_image(bytes(data), self.limits)
            made: dict[Any, np.ndarray] = {}
            try:
                for m in self.models:
                    if m.bundle.spec not in made:
                        made[m.bundle.spec] = preprocess_image(img, m.bundle.spec)
                arrays = [made[m.bundle.spec] for m in self.models]
            except MemoryError:
                raise ImageError("too_many_pixels", f"{img.width}x{img.height} did not fit in memory; lower "
                                 "max_pixels") from None
            return arrays, img.width, img.height
        except ImageError as e:
            return Result.failed(str(e))
        finally:
            with self._stage_lock:
                self.stage_seconds[STAGE_DECODE] += time.perf_counter() - start

    def _classify_decoded(self, decoded: list[tuple[list[np.ndarray], int, int] | Result]) -> list[Result]:
        ok = [i for i, d in enumerate(decoded) if not isinstance(d, Result)]
        out: list[Any] = list(decoded)
        if ok:
            sizes = [(decoded[i][1], decoded[i][2]) for i in ok]
            answers = []
            for m, model in enumerate(self.models):
                results = self._infer(model, np.stack([decoded[i][0][m] for i in ok]), sizes)
                if len(results) > 1 and all(r.status != STATUS_OK and r.error != NONFINITE_ERROR for r in results):
                    # Every image failing alone means the model or runtime is broken, not the inputs.
                    raise EngineError(f"ONNX Runtime failed on every image of a batch of {len(results)} with model "
                                      f"{model.bundle.name!r}: {results[0].error}")
                answers.append(results)
            for j, i in enumerate(ok):
                out[i] = answers[0][j]
                out[i].more = [a[j] for a in answers[1:]]
        return out

    def _infer(self, model: _Model, batch: np.ndarray, sizes: list[tuple[int, int]]) -> list[Result]:
        try:
            values = self._run(model, batch)
        except EngineError:
            raise
        except Exception as e:  # ORT's own error types; a run error may be one input's fault
            if len(batch) == 1:
                LOG.warning("ONNX Runtime failed on one image: %s", e)
                return [Result.failed(f"engine_error: {e}", width=sizes[0][0], height=sizes[0][1])]
            # Split to find the input(s) to blame; the others still get their results.
            LOG.warning("ONNX Runtime failed on a batch of %d; retrying in halves: %s", len(batch), e)
            half = len(batch) // 2
            return self._infer(model, batch[:half], sizes[:half]) + self._infer(model, batch[half:], sizes[half:])
        bundle, classes = model.bundle, model.bundle.num_classes
        results = results_from_logits(values[:, :classes], bundle.labels, model.top_k, sizes,
                                      output=bundle.spec.output)
        if bundle.spec.embedding is not None:
            attach_embeddings(results, values[:, classes:], bundle.spec.embedding)
        return results

    def _run(self, model: _Model, batch: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        values = model.forward(batch)
        self.stage_seconds[STAGE_INFER] += time.perf_counter() - start
        bundle = model.bundle
        width = bundle.num_classes + (bundle.spec.embedding.dim if bundle.spec.embedding else 0)
        if values.ndim != 2 or values.shape[1] != width:
            embedding = bundle.spec.embedding
            raise EngineError(
                f"model {bundle.name!r} returned shape {values.shape}, expected (batch, {bundle.num_classes})"
                + (f" and its embedding {embedding.output!r} (batch, {embedding.dim})" if embedding else "")
                + "; labels.txt must have one line per output class"
            )
        return values

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "OnnxEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
