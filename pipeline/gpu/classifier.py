"""GpuClassifier: DALI decode + resize, FP16 network and top-k on one GPU, in process or in Triton.

One implementation, two hosts: ``GpuEngine`` runs it in the calling process (``--engine gpu``) and the ``gpu``
profile's Triton python model (``model_repository/gpu``) runs the same ``GpuClassifier`` inside tritonserver.

The hot path per batch, with no per-image Python loop on the GPU side:

1. triage on the CPU: size limits and the JPEG header (dimensions, EXIF orientation) read by a small parser;
   baseline/progressive 8-bit JPEGs go to DALI, anything else (PNG, CMYK, truncated, ...) to the reference
   (``pipeline.model.imaging``, Pillow);
2. DALI (``pipeline.gpu.dali.DaliPrep``, the production ensemble's graph): "mixed" decode (the hardware JPEG
   engines take ``hw_decoder_load`` of each batch, CUDA nvJPEG the rest), resize + crop + normalize per the model's
   ``PreprocessSpec``, FP16 or FP32 NHWC on the GPU; the reference's arrays join the batch as uploads;
3. the batch is copied on the GPU into the network's input (channels-last), the network (a CUDA graph captured at
   start), softmax and top-k: only k values per image come back.

A model set (``more``: ``SetModel``) decodes each image once; each model's network runs on its own spec's DALI branch
(equal specs share one) and its top-k comes back in ``RawResults.more``. A model whose spec declares an embedding
returns it beside its top-k (float32, L2-normalised on the GPU per its spec): ``RawResults.embedding`` and
``ModelScores.embedding``.

Preparing the next batches runs in ``prep_workers`` threads, each on its own high-priority CUDA stream, while the
network runs the current batch; events order the streams. A file DALI refuses fails DALI's whole batch: that batch
is then decoded by the reference, so a bad image is that image's error row and the rest of the batch succeeds.
DALI is the only GPU preprocessing; on a CPU device the same code runs DALI's CPU backend (tests).

torch is not a dependency of the package: it is imported when a GPU engine is built (GPU machines and the
worker image have it); DALI is the ``dali`` extra.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pipeline.errors import EngineError, ImageError
from pipeline.gpu.cuda_sync import check_cuda_sync, use_cuda_device
from pipeline.gpu.dali import (
    DALI_MISSING, DEFAULT_DALI_DEPTH, DEFAULT_HW_DECODER_LOAD, DaliPrep, dali_available, host_array,
)
from pipeline.gpu.dali_graph import branch_plan
from pipeline.gpu.defaults import DALI_THREADS, GPU_DEFAULT_BATCH_SIZE, GPU_DEFAULT_PREP_WORKERS
from pipeline.gpu.jpeg import JpegInfo, parse_jpeg_header
from pipeline.gpu.topk_network import TopKNetwork
from pipeline.model.imaging import MAX_DECODE_THREADS, DecodeLimits, PreprocessSpec
from pipeline.schema import DEFAULT_TOP_K

LOG = logging.getLogger(__name__)

# How the classifier's threads wait for the GPU (pipeline.gpu.cuda_sync).
DEFAULT_CUDA_SYNC = "auto"
# What a stream's source gives when the stream ends (GpuClassifier.run_stream).
STOP = object()


@dataclass
class _Item:
    index: int  # position in the caller's list
    data: bytes
    info: JpegInfo | None  # None: not for DALI (the reference, Pillow, decodes it)
    width: int = 0  # upright, after EXIF
    height: int = 0
    tag: int = 0  # the caller's tag of this image (a served model's TAG), travelling with it to its answer


@dataclass
class Chunk:
    """One network batch on its way through the pipeline: its images, then their tensors on the GPU."""

    items: list[_Item]
    inputs: Any = None  # fp16 [n, 3, h, w] on the GPU, rows in items order
    branch_inputs: list = field(default_factory=list)  # a model set's: one such tensor per DALI branch (inputs first)
    more_host: list = field(default_factory=list)  # a model set's other models: (ids, scores, embedding) host buffers
    more_scores: list = field(default_factory=list)  # ... and as arrays, once on the host: [(ids [n, k], scores,
    # embedding [n, dim] or None)]
    embedding_host: Any = None  # the first model's embedding host buffer, where its spec declares one
    embedding: np.ndarray | None = None  # ... as an array, once on the host: float32 [n, dim], rows as the ids
    ok: list[int] = field(default_factory=list)  # positions in items that made it into ``inputs``
    errors: dict[int, str] = field(default_factory=dict)  # caller index -> "kind: detail"
    ready: Any = None  # CUDA event: inputs are complete
    keep: list = field(default_factory=list)  # buffers that must live until the network has read them
    prepare_s: float = 0.0


@dataclass
class ModelScores:
    """One model's top-k of a model set's other models (``RawResults.more``); a row of an image with an error, or
    whose output was not finite (NaN scores), is that model's error."""

    class_ids: np.ndarray  # int32 [N, K of this model]
    scores: np.ndarray  # float32 [N, K of this model]
    embedding: np.ndarray | None = None  # float32 [N, dim] where this model's spec declares an embedding


@dataclass
class RawResults:
    """Per-image outputs of ``GpuClassifier.classify``, as arrays (the Triton model sends these as they are)."""

    class_ids: np.ndarray  # int32 [N, K]
    scores: np.ndarray  # float32 [N, K]
    width: np.ndarray  # int32 [N]
    height: np.ndarray  # int32 [N]
    errors: list[str]  # "" when the image was classified
    echo: np.ndarray | None = None  # int64 [N]: each answer's image TAG (the Triton stream's; None elsewhere)
    more: list[ModelScores] = field(default_factory=list)  # a model set's other models, in ``more``'s order
    # float32 [N, dim]: the model's embedding per image, L2-normalised where its spec says, where its spec declares
    # one (None otherwise); zeros in error rows. A row whose embedding is not finite has NaN scores, so it is the
    # NONFINITE error row like a non-finite class output.
    embedding: np.ndarray | None = None


def empty_embedding(n: int, dim: int) -> np.ndarray | None:
    """Zeroed embeddings of ``n`` images (float32 [n, dim]), or None for a model without one (``dim`` 0)."""
    return np.zeros((n, dim), np.float32) if dim else None


def empty_scores(n: int, top_ks: Sequence[int], dims: Sequence[int] = ()) -> list[ModelScores]:
    """Zeroed ``ModelScores`` of ``n`` images for each of a model set's other models (``GpuClassifier.more_top_k``,
    and ``more_embedding_dims``: 0 for a model without an embedding)."""
    dims = tuple(dims) or (0,) * len(top_ks)
    return [ModelScores(np.zeros((n, k), np.int32), np.zeros((n, k), np.float32), empty_embedding(n, d))
            for k, d in zip(top_ks, dims)]


def write_scores(into: Sequence[ModelScores], rows, scores: Sequence[tuple], src=None):
    """The other models' chunk results (``Chunk.more_scores``: ids, scores, embedding or None) into their
    ``ModelScores`` at ``rows`` (from the chunk's rows ``src``, all when None)."""
    for model, (ids, vals, embedding) in zip(into, scores):
        ids, vals = (ids, vals) if src is None else (ids[src], vals[src])
        model.class_ids[rows, : ids.shape[-1]] = ids
        model.scores[rows, : vals.shape[-1]] = vals
        if embedding is not None and model.embedding is not None:
            model.embedding[rows] = embedding if src is None else embedding[src]


@dataclass(frozen=True)
class SetModel:
    """Another model of a model set that a ``GpuClassifier`` runs on the same decode (its ``more``).

    Attributes:
        network: a torch module, as ``GpuClassifier``'s ``network``.
        spec: its preprocessing: a DALI branch of its own unless another model's spec is the same.
        top_k: its classes per image (at most its classes); None: the classifier's ``top_k``.
        fixed_batch: its fixed batch size, if its batch axis is a number.
        precision_gate: run the FP16 gate for it where ``half`` is None (False: the built-in network).
        half: its precision where given (True: FP16), over the classifier's ``half`` option; None: as the
            classifier's other networks decide theirs.
    """

    network: Any
    spec: PreprocessSpec
    top_k: int | None = None
    fixed_batch: int | None = None
    precision_gate: bool = True
    half: bool | None = None


@dataclass
class _Model:
    """One network of the classifier, as it runs: its ``TopKNetwork``, precision and DALI branch."""

    network: Any
    half: bool
    dtype: Any
    branch: int
    top_k: int


def triage(index: int, data: bytes, limits: DecodeLimits) -> _Item:
    """CPU triage of one encoded file, no decode: caps, then the JPEG header. The item's ``info`` is set when
    DALI's GPU decoder can take it (8-bit gray/YCbCr baseline or progressive JPEG ending with EOI); ``None`` sends it
    to Pillow (the reference), which says what is wrong with it.

    Raises:
        ImageError: empty, too_large, too_many_pixels, or a cut/malformed JPEG header.
    """
    if len(data) == 0:
        raise ImageError("empty", "the object has zero bytes")
    if len(data) > limits.max_bytes:
        raise ImageError(
            "too_large",
            f"{len(data)} bytes is over max_bytes={limits.max_bytes}; raise the limit to accept it",
        )
    info = parse_jpeg_header(data)
    if info is None:
        return _Item(index, data, None)
    if info.width * info.height > limits.max_pixels:
        raise ImageError(
            "too_many_pixels",
            f"{info.width}x{info.height} = {info.width * info.height} pixels is over "
            f"max_pixels={limits.max_pixels}; raise the limit to accept it",
        )
    w, h = info.upright_size
    return _Item(index, data, info if info.gpu_decodable else None, w, h)


@dataclass(frozen=True, kw_only=True)
class ClassifierOptions:
    """How a ``GpuClassifier`` runs (every field has the engine's default).

    Attributes:
        top_k: how many classes to return per image.
        limits: encoded-size and pixel caps, as for every engine.
        batch_size: images per network call; also the CUDA graph's batch.
        device: "cuda", "cuda:N" or "cpu" (the CPU runs the same code with DALI's CPU backend, slowly; for tests);
            None: "cuda" where torch sees a GPU, else "cpu".
        cuda_graph: capture the network in a CUDA graph per batch size (pays for small, launch-bound networks).
        half: run the network, and DALI's output, in FP16; None: FP16 on CUDA where the precision gate
            (``pipeline.gpu.precision``) passes, else FP32; FP32 on the CPU.
        precision_gate: run the gate where ``half`` is None (False: FP16 on CUDA unchecked, for the built-in
            network, whose FP16 answers were measured against the reference).
        cpu_decode_threads: Pillow threads for inputs DALI does not take.
        pipeline: prepare the next batches while the network runs this one.
        prep_workers: threads preparing batches ahead of the network, each with its own CUDA stream (at least
            ``dali_depth + 1`` when ``dali_depth`` > 1; with depth 1 each has a DALI pipeline of its own).
        hw_decoder_load: the share of each batch DALI gives the hardware JPEG engines; the rest goes to CUDA nvJPEG on
            the SMs (1.0: all to the engines, which leaves the SMs to the network).
        dali_threads: DALI's CPU threads per pipeline.
        dali_depth: batches scheduled at once on one DALI pipeline (``pipeline.gpu.dali_runner``).
        cuda_sync: how threads wait for the GPU: "block" sleeps, "spin" and CUDA's "auto" spin on a core
            (``pipeline.gpu.cuda_sync``).
        cudnn_autotune: let cuDNN time its algorithms for each conv at the first batch (a longer build, a
            slightly faster network).
        fixed_batch: the model's fixed batch size, if its batch axis is a number (``ModelBundle.fixed_batch``).
        compile: ``torch.compile`` the network (None: a converted ``model.onnx`` on CUDA; ``TopKNetwork``).

    Raises:
        EngineError: a batch size below 1 or an unknown ``cuda_sync``.
    """

    top_k: int = DEFAULT_TOP_K
    limits: DecodeLimits = DecodeLimits()
    batch_size: int = GPU_DEFAULT_BATCH_SIZE
    device: str | None = None
    cuda_graph: bool = True
    half: bool | None = None
    precision_gate: bool = True
    cpu_decode_threads: int | None = None
    pipeline: bool = True
    prep_workers: int = GPU_DEFAULT_PREP_WORKERS
    hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD
    dali_threads: int = DALI_THREADS
    dali_depth: int = DEFAULT_DALI_DEPTH
    cuda_sync: str = DEFAULT_CUDA_SYNC
    cudnn_autotune: bool = True
    fixed_batch: int | None = None
    compile: bool | None = None

    def __post_init__(self) -> None:
        check_cuda_sync(self.cuda_sync)
        if self.batch_size < 1:
            raise EngineError(f"batch_size must be positive, got {self.batch_size}")


class GpuClassifier:
    """Decode, preprocess and classify batches of encoded images on one device; the shared core of the gpu engine.

    Args:
        network: a torch module mapping float [N, 3, H, W] (the spec's crop) to logits [N, classes]; None prepares
            only (``_triage_all`` and ``_prepare``, for a caller that runs the network elsewhere), with no
            network on the device.
        spec: the model's preprocessing (resize, crop, filter, normalisation, channel order).
        options: how it runs (``ClassifierOptions``).
        more: a model set's other models (``SetModel``): each image is decoded once, each distinct spec is a DALI
            branch, each network runs on its branch's tensor; their top-k come back in ``RawResults.more``, in this
            order. ``options.half`` applies to each; else each has its own precision gate.

    Raises:
        EngineError: DALI or torch is not installed, or a network/spec this engine cannot run.
    """

    def __init__(self, network, spec: PreprocessSpec, options: ClassifierOptions = ClassifierOptions(),
                 more: Sequence[SetModel] = ()):
        if not dali_available():
            raise EngineError(DALI_MISSING)
        for one in (spec, *(m.spec for m in more)):
            if one.layout != "NCHW":
                raise EngineError(
                    f"the gpu engine feeds NCHW networks; this model's spec says layout {one.layout!r}. "
                    "Use --engine onnx or --engine triton for it"
                )
        o = self.options = options
        batch_size, half, pipeline, prep_workers = o.batch_size, o.half, o.pipeline, o.prep_workers
        dali_depth, hw_decoder_load = o.dali_depth, o.hw_decoder_load
        torch = _torch()
        self._torch = torch
        self.device = torch.device(o.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda_sync = o.cuda_sync
        # as the driver reports it
        self.cuda_sync_in_force = use_cuda_device(torch, self.device, o.cuda_sync, o.cudnn_autotune)
        self.spec = spec
        self.top_k = top_k = o.top_k
        self.limits = o.limits
        self.batch_size = batch_size
        # What the start took, said in one line at its end: where a small job's time goes.
        self.start_seconds: dict[str, float] = {}
        mark = time.perf_counter()
        self.more = tuple(more)
        self.more_top_k = tuple(m.top_k or top_k for m in self.more)  # each other model's classes per image
        _, self.branch_of = branch_plan((spec, *(m.spec for m in self.more)))
        self.half = self._half_for(network, spec, half, o.precision_gate)
        more_half = [self._half_for(m.network, m.spec, half if m.half is None else m.half, m.precision_gate)
                     for m in self.more]
        if half is None and self.is_cuda and network is not None and (o.precision_gate or any(
                m.precision_gate and m.half is None for m in self.more)):
            mark = self._took("precision gate", mark)
        self.dtype = torch.float16 if self.half else torch.float32
        # DALI's output is FP16 where every network runs FP16; an FP32 network's branch is cast on the GPU otherwise.
        self.dali_half = self.half and all(more_half)
        self._dali_dtype = torch.float16 if self.dali_half else torch.float32
        self.use_graph = o.cuda_graph and self.is_cuda
        self.pipeline = pipeline
        self.decoder_name = "dali"
        self.hw_decoder_load = hw_decoder_load
        self.refused_batches = 0  # DALI batches that went to the reference because DALI refused a file
        self._local = threading.local()  # per preparing thread: its CUDA stream
        # None: preparation only, no network on this device.
        self.network = None if network is None else TopKNetwork(
            network, crop=spec.crop, device=self.device, half=self.half, batch_size=batch_size,
            cuda_graph=self.use_graph, top_k=top_k, probabilities=spec.probabilities, fixed_batch=o.fixed_batch,
            compile=o.compile, sigmoid=spec.sigmoid, embedding=spec.embedding)
        # Each model's embedding width (0: none), as RawResults carries them.
        self.embedding_dim = spec.embedding.dim if spec.embedding is not None else 0
        self.more_embedding_dims = tuple(m.spec.embedding.dim if m.spec.embedding is not None else 0 for m in self.more)
        self._models: list[_Model] = []
        if self.network is not None:
            self._models.append(_Model(self.network, self.half, self.dtype, 0, top_k))
            for m, m_half, branch, m_top_k in zip(self.more, more_half, self.branch_of[1:], self.more_top_k):
                self._models.append(_Model(TopKNetwork(
                    m.network, crop=m.spec.crop, device=self.device, half=m_half, batch_size=batch_size,
                    cuda_graph=self.use_graph, top_k=m_top_k, probabilities=m.spec.probabilities,
                    fixed_batch=m.fixed_batch, compile=o.compile, sigmoid=m.spec.sigmoid, embedding=m.spec.embedding),
                    m_half, torch.float16 if m_half else torch.float32, branch, m_top_k))
        self._net_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        if dali_depth > 1:
            # Each preparing thread waits for its batch: depth + 1 threads keep ``depth`` batches scheduled.
            prep_workers = max(prep_workers, dali_depth + 1)
        self.prep_workers = max(1, prep_workers) if pipeline else 1
        self._prep_pool = ThreadPoolExecutor(self.prep_workers, thread_name_prefix="gpu-prep") if pipeline else None
        self._cpu_pool = ThreadPoolExecutor(o.cpu_decode_threads or min(MAX_DECODE_THREADS, os.cpu_count() or 1),
                                            "gpu-pil")
        self._lock = threading.Lock()
        LOG.info(
            "gpu classifier on %s: DALI (hw_decoder_load %.2f, depth %d), batch %d, %s, cuda graph %s, cuda sync %s",
            self.device,
            hw_decoder_load,
            dali_depth,
            batch_size,
            "fp16" if self.half else "fp32",
            self.use_graph,
            self.cuda_sync_in_force,
        )
        if self.use_graph and self.network is not None:
            self.warmup()  # capture now: a capture must not overlap the preparing threads' first CUDA calls
            mark = self._took("warmup", mark)
        references = [getattr(net, "onnx_reference", None) for net in (network, *(m.network for m in self.more))]
        if any(r is not None for r in references) and self._models:
            for model, reference in zip(self._models, references):
                if reference is not None:  # a converted model.onnx (pipeline.gpu.onnx_torch)
                    self._check_reference(model, reference)
            mark = self._took("ONNX Runtime check", mark)
        # DALI after the capture: its pipelines and runner thread make CUDA calls of their own.
        self._prep = DaliPrep(
            spec,
            device="mixed" if self.is_cuda else "cpu",
            device_id=self.device.index if self.is_cuda else None,
            batch_size=batch_size,
            num_threads=o.dali_threads,
            hw_decoder_load=hw_decoder_load,
            half=self.dali_half,
            layout="HWC",
            pipelines=self.prep_workers,
            depth=dali_depth,
            more=[m.spec for m in self.more],
        )
        self._took("DALI", mark)
        self._load_note = getattr(network, "load_note", "")
        LOG.info("gpu classifier start on %s: %s", self.device, self.start_report())

    def start_report(self) -> str:
        """What this classifier's start took, step by step (the network's load or conversion included)."""
        compiled = getattr(self.network, "compile_seconds", 0.0)
        steps = ", ".join(f"{what} {seconds:.1f} s" for what, seconds in self.start_seconds.items())
        precision = ", ".join("fp16" if m.half else "fp32" for m in self._models)
        return (steps + (f" (torch.compile {compiled:.1f} s of the warmup)" if compiled else "")
                + (f"; network {self._load_note}" if self._load_note else "")
                + (f"; {'networks' if len(self._models) > 1 else 'network'} in {precision}" if precision else ""))

    def _took(self, what: str, since: float) -> float:
        now = time.perf_counter()
        self.start_seconds[what] = now - since
        return now

    def _half_for(self, network, spec: PreprocessSpec, half: bool | None, gate: bool) -> bool:
        """FP16 or not for one network: ``half`` where given, else the precision gate's verdict on CUDA (where
        ``gate``), else FP16 on CUDA and FP32 on the CPU."""
        card = self._card_folder(network)
        if half is None and self.is_cuda and network is not None and gate:
            half = _gated_half(network, spec, self.device, card)
        return self.is_cuda if half is None else half

    def _card_folder(self, network):
        """The network's cache folder for this kind of card (precision verdict, compiled kernels), or None: only a
        converted network on CUDA has one (pipeline.gpu.network_cache)."""
        entry = getattr(network, "cache_entry", None)
        if entry is None or not self.is_cuda:
            return None
        from pipeline.gpu.network_cache import card_folder, use_compile_cache  # noqa: PLC0415

        folder = card_folder(entry, self._torch, self.device)
        if use_compile_cache(folder):
            # Compiled before on this kind of card: inductor finds its kernels, and a pool of compile workers would
            # only cost its start (seconds of CPU per instance).
            import torch._inductor.config  # noqa: PLC0415

            torch._inductor.config.compile_threads = 1
        return folder

    def _check_reference(self, model: _Model, reference) -> None:
        """The network as it runs here (compiled, FP16 or FP32, in its CUDA graph) against ONNX Runtime's outputs on
        the reference batch, its embedding too where it has one; a network that does not agree never classifies.

        Raises:
            EngineError: the outputs differ beyond ``DEVICE_REL_L2`` or a decided top-1 class changes.
        """
        from pipeline.gpu.onnx_torch import (  # noqa: PLC0415 - onnx2torch: converted only
            DEVICE_REL_L2, agreement, embedding_agreement,
        )
        from pipeline.gpu.topk_network import split_outputs  # noqa: PLC0415

        torch = self._torch
        x = torch.from_numpy(reference.inputs).to(self.device, model.dtype)
        out, features = split_outputs(model.network.run(x.contiguous(memory_format=torch.channels_last)))
        out = out.float().cpu().numpy()
        found = agreement(out, reference.outputs, probabilities=reference.probabilities)
        precision = "fp16" if model.half else "fp32"
        if not found.within(DEVICE_REL_L2):
            raise EngineError(f"the converted network on {self.device} ({precision}) gives "
                              f"{found.describe()} (allowed {DEVICE_REL_L2:g}); run this model with --engine onnx")
        if reference.embeddings is not None:
            got = None if features is None else features.float().reshape(len(out), -1).cpu().numpy()
            close = embedding_agreement(got, reference.embeddings)
            if not close.within(DEVICE_REL_L2):
                raise EngineError(f"the converted network on {self.device} ({precision}) gives an embedding "
                                  f"{close.rel_l2:.2e} from ONNX Runtime's (relative L2; allowed {DEVICE_REL_L2:g}); "
                                  "run this model with --engine onnx")
        LOG.info("the network on %s agrees with ONNX Runtime: %s", self.device, found.describe())

    # ---- public ---------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Builds the CUDA graph and cudnn plans for the full batch so the first real batch is not slow."""
        for model in self._models:
            model.network.warmup()

    def classify(self, images: Sequence[bytes]) -> RawResults:
        """Classifies encoded images; one output row per input, errors included, in input order."""
        with self._lock:
            return self._classify(images)

    def close(self) -> None:
        if self._prep_pool:
            self._prep_pool.shutdown(wait=True)
        self._cpu_pool.shutdown(wait=True)
        self._prep.close()
        for model in self._models:
            model.network.clear()

    # ---- steps ----------------------------------------------------------------------------------

    def _classify(self, images: Sequence[bytes]) -> RawResults:
        n = len(images)
        k = self.top_k
        ids = np.zeros((n, k), dtype=np.int32)
        scores = np.zeros((n, k), dtype=np.float32)
        width = np.zeros(n, dtype=np.int32)
        height = np.zeros(n, dtype=np.int32)
        more = empty_scores(n, self.more_top_k, self.more_embedding_dims)
        embedding = empty_embedding(n, self.embedding_dim)
        items, errors = self._triage_all(images, self.limits)
        chunks = iter([Chunk(items[s : s + self.batch_size]) for s in range(0, len(items), self.batch_size)])
        failure: list[BaseException] = []

        def sink(chunk: Chunk, idx_np, vals_np, error: BaseException | None) -> None:
            if error is not None:
                failure.append(error)
                return
            for index, msg in chunk.errors.items():
                errors[index] = msg
            if idx_np is None:
                return
            rows = np.asarray([chunk.items[p].index for p in chunk.ok], dtype=np.int64)
            ids[rows, : idx_np.shape[1]] = idx_np
            scores[rows, : vals_np.shape[1]] = vals_np
            width[rows] = [chunk.items[p].width for p in chunk.ok]
            height[rows] = [chunk.items[p].height for p in chunk.ok]
            if embedding is not None:
                embedding[rows] = chunk.embedding
            write_scores(more, rows, chunk.more_scores)

        self.run_stream(lambda block: next(chunks, STOP), sink)
        if failure:
            raise failure[0]
        return RawResults(ids, scores, width, height, errors, more=more, embedding=embedding)

    def run_stream(self, source, sink) -> None:
        """The pipeline over a stream of chunks: preparation of the next ``prep_workers + 2`` chunks runs while the
        network runs this one, and across the caller's batches (the Triton model feeds it from its queue).

        Args:
            source: ``source(block)`` gives the next ``Chunk``, ``None`` when none is ready (only asked with
                ``block=False``, while work is in flight) or ``STOP`` when the stream ends.
            sink: ``sink(chunk, class_ids, scores, error)`` for each chunk, in order, once its results are on the
                host (``class_ids`` is None when no image of the chunk reached the network; ``error`` is the
                exception that failed the whole chunk, else None); the first model's embedding is then in
                ``chunk.embedding`` and a model set's other models' answers in ``chunk.more_scores``, rows as
                ``class_ids``'.
        """
        ahead = self.prep_workers + 2  # chunks being prepared or queued for it: hides preparation, bounds memory
        window: collections.deque = collections.deque()  # (chunk, future of its preparation)
        pending: collections.deque = collections.deque()  # (chunk, ids_host, scores_host, done_event)
        exhausted = False
        while True:
            while not exhausted and len(window) < ahead:
                chunk = source(not (window or pending))  # block only when nothing is in flight
                if chunk is STOP:
                    exhausted = True
                elif chunk is not None:
                    window.append((chunk, self._submit(chunk)))
                    continue
                break
            if not window:
                while pending:
                    self._emit(pending.popleft(), sink)
                if exhausted:
                    return
                continue
            chunk, preparing = window.popleft()
            try:
                if preparing is not None:
                    preparing.result()
                else:
                    self._prepare(chunk)
                pending.append((chunk, *self._infer(chunk)))
            except Exception as err:  # noqa: BLE001 - this chunk fails; the stream goes on
                LOG.exception("a batch of %d images failed", len(chunk.items))
                sink(chunk, None, None, err)
            if len(pending) > 1:
                self._emit(pending.popleft(), sink)

    def _submit(self, chunk: Chunk):
        if self._prep_pool is None:
            return None
        return self._prep_pool.submit(self._prepare, chunk)

    def _emit(self, pending, sink) -> None:
        chunk, idx_h, vals_h, done = pending
        try:
            if done is not None:
                done.synchronize()
            idx_np = None if idx_h is None else idx_h.numpy()
            vals_np = None if vals_h is None else vals_h.numpy()
            chunk.more_scores = [(i.numpy(), v.numpy(), None if e is None else e.numpy()) for i, v, e in chunk.more_host]
            chunk.embedding = None if chunk.embedding_host is None else chunk.embedding_host.numpy()
        except Exception as err:  # noqa: BLE001 - the chunk's network run failed
            sink(chunk, None, None, err)
            return
        finally:
            chunk.keep = []
            chunk.inputs = None
            chunk.branch_inputs = []
            chunk.more_host = []
            chunk.embedding_host = None
        sink(chunk, idx_np, vals_np, None)

    @staticmethod
    def _triage_all(images: Sequence[bytes], limits: DecodeLimits) -> tuple[list[_Item], list[str]]:
        """Triage of a call's images: the items that go on, and each image's error ("" where none)."""
        items, errors = [], [""] * len(images)
        for i, data in enumerate(images):
            try:
                items.append(triage(i, data, limits))
            except ImageError as e:
                errors[i] = str(e)
        return items, errors

    def _thread_stream(self):
        local = self._local
        if not hasattr(local, "stream"):
            # High priority: the short preparation kernels go ahead of the network's queued ones, so the next
            # batch is ready when the network finishes this one.
            local.stream = self._torch.cuda.Stream(self.device, priority=-1) if self.is_cuda else None
        return local.stream

    def _stream_ctx(self, stream):
        return self._torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _prepare(self, chunk: Chunk) -> None:
        """DALI (and the reference for the rest) into one NHWC batch per DALI branch on this thread's stream; sets
        ``chunk.inputs`` (the first branch's NCHW view, channels-last memory), ``chunk.branch_inputs`` (every
        branch's), ``chunk.ok``, ``chunk.errors`` and records ``chunk.ready``."""
        torch = self._torch
        t0 = time.perf_counter()
        stream = self._thread_stream()
        crops = [b.crop for b in self._prep.branches]
        dtype = self._dali_dtype
        holder: dict[str, Any] = {}

        def consume(out):
            # With dali_depth > 1 this runs in the DALI runner's thread: allocate and copy on this batch's stream
            # all the same.
            bufs = []
            with self._stream_ctx(stream):
                for (crop_h, crop_w), one in zip(crops, out if isinstance(out, tuple) else (out,)):
                    buf = torch.empty((len(one), crop_h, crop_w, 3), dtype=dtype, device=self.device)
                    if self.is_cuda:
                        from nvidia.dali.plugin.pytorch import feed_ndarray  # noqa: PLC0415 - optional, heavy

                        # A blocking copy on this stream: DALI reuses its output buffers on its next run.
                        feed_ndarray(one.as_tensor(), buf, cuda_stream=stream)
                    else:
                        buf.copy_(torch.from_numpy(host_array(one)))
                    bufs.append(buf)
            holder["dali"] = bufs

        with self._stream_ctx(stream):
            items = chunk.items
            res = self._prep.prepare([it.data for it in items], [it.info is not None for it in items],
                                     self.limits, consume, self._cpu_pool)
            if res.refused:
                self.refused_batches += 1
            for pos, msg in res.errors.items():
                chunk.errors[items[pos].index] = msg
            for pos, (_, w, h) in res.reference.items():
                items[pos].width, items[pos].height = w, h
            ok = sorted(res.dali + list(res.reference))
            if ok:
                row = {p: r for r, p in enumerate(ok)}
                refs = sorted(res.reference)
                batches = []
                for b, (crop_h, crop_w) in enumerate(crops):
                    if not res.reference:
                        batch = holder["dali"][b]  # positions ascending: rows already in ``ok`` order
                    else:
                        batch = torch.empty((len(ok), crop_h, crop_w, 3), dtype=dtype, device=self.device)
                        if res.dali:
                            rows = torch.as_tensor([row[p] for p in res.dali], device=self.device)
                            batch[rows] = holder["dali"][b]
                        arrays = [res.reference[p][0] if b == 0 else res.reference_more[p][b - 1] for p in refs]
                        host = torch.from_numpy(np.stack(arrays))
                        rows = torch.as_tensor([row[p] for p in refs], device=self.device)
                        batch[rows] = host.to(self.device).to(dtype)
                    batches.append(batch.permute(0, 3, 1, 2))  # NCHW view, channels-last memory
                chunk.ok = ok
                chunk.inputs = batches[0]
                chunk.branch_inputs = batches
                chunk.keep = [holder]  # alive until the network has read this chunk
            if self.is_cuda:
                chunk.ready = torch.cuda.Event()
                chunk.ready.record(stream)
        chunk.prepare_s = time.perf_counter() - t0

    def _infer(self, chunk: Chunk):
        """Queues network + softmax + top-k (and embedding) of every model for a prepared chunk; returns the first
        model's host buffers and their event (its embedding's: ``chunk.embedding_host``; the other models':
        ``chunk.more_host``)."""
        torch = self._torch
        if chunk.inputs is None:
            return None, None, None
        with self._stream_ctx(self._net_stream):
            if chunk.ready is not None:
                self._net_stream.wait_event(chunk.ready)
                for x in chunk.branch_inputs:
                    x.record_stream(self._net_stream)
            outs = []
            for model in self._models:
                x = chunk.branch_inputs[model.branch]
                vals, idx, embedding = model.network.answers(x if x.dtype == model.dtype else x.to(model.dtype))
                if self.is_cuda:
                    vals, idx, embedding = (None if t is None else _to_host(torch, t) for t in (vals, idx, embedding))
                outs.append((idx, vals, embedding))
            chunk.embedding_host = outs[0][2]
            chunk.more_host = outs[1:]
            done = None
            if self.is_cuda:
                done = torch.cuda.Event(blocking=self.cuda_sync == "block")
                done.record(self._net_stream)
            return (*outs[0][:2], done)


def _to_host(torch, tensor):
    """A pinned host copy of ``tensor``, queued on the current stream (read once its event has passed)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _gated_half(network, spec: PreprocessSpec, device, card=None) -> bool:
    """The precision gate's verdict for ``network`` on ``device``, said in the log when it is FP32; read from and
    written to ``card`` (the network's cache folder for this kind of card) where there is one."""
    from pipeline.gpu.network_cache import read_gate, write_gate  # noqa: PLC0415
    from pipeline.gpu.precision import GateResult, choose_half  # noqa: PLC0415

    found = read_gate(card) if card is not None else None
    try:
        gate = GateResult(**found) if found is not None else None
    except TypeError:  # a record of other fields: measured again
        gate = None
    if gate is not None:
        LOG.info("precision gate: the verdict recorded for this card in %s (%s)", card, "fp16" if gate.half else "fp32")
    else:
        gate = choose_half(network, spec, device)
        if card is not None:
            write_gate(card, dataclasses.asdict(gate))
    if not gate.half:
        LOG.warning("the network's %s: it runs in FP32 on the GPU (slower); --engine-option half=true forces FP16",
                    gate.describe())
    return gate.half


def _torch():
    try:
        import torch  # noqa: PLC0415 - optional dependency, present on GPU machines
    except ImportError:
        raise EngineError(
            "the gpu engine needs PyTorch with CUDA (the GPU worker image has it); install torch, "
            "or use --engine onnx / --engine triton"
        ) from None
    return torch
