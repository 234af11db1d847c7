"""GpuClassifier: nvJPEG decode, batched resize/crop/normalize, FP16 network and top-k on one GPU, in process or in Triton.

One implementation, two hosts: ``GpuEngine`` runs it in the calling process (``--engine gpu``) and the ``gpu``
profile's Triton python model (``model_repository/gpu``) runs the same ``GpuClassifier`` inside tritonserver.

The hot path per batch, with no per-image Python loop on the GPU side:

1. triage on the CPU: size limits and the JPEG header (dimensions, EXIF orientation) read by a small parser;
   baseline/progressive 8-bit JPEGs go to the GPU decoder, anything else (PNG, CMYK, truncated, ...) to Pillow;
2. decode on the GPU: nvImageCodec (hardware JPEG engines first, then CUDA) or torchvision's batched nvJPEG;
3. pack the decoded images into one zero-padded batch with a single gather;
4. resize + crop as two batched matrix products with Pillow's own resampling coefficients (exact antialiasing,
   any filter), then normalize, in FP16 (or FP32) channels-last;
5. the network (a CUDA graph captured at start), softmax and top-k on the GPU: only k values per image
   come back.

Decode (step 2) and resize (3-4) of the next batches run in two helper threads, each on its own high-priority
CUDA stream, while the network runs the current batch; events order the three streams.
A bad image becomes that image's error; the rest of the batch still succeeds.

torch is not a dependency of the package: it is imported when a GPU engine is built (GPU machines and the
worker image have it).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pipeline.errors import EngineError, ImageError
from pipeline.triton import contract as tn
from pipeline.imaging import DecodeLimits, PreprocessSpec, decode_image
from pipeline.engines.gpu.cuda_sync import check_cuda_sync, set_cuda_sync
from pipeline.engines.gpu.decoders import DECODERS, _make_decoder, _orient, _torch
from pipeline.engines.gpu.jpeg import JpegInfo, parse_jpeg_header
from pipeline.engines.gpu.resample import crop_boxes, resample_coefficients_torch

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = tn.GPU_DEFAULT_BATCH_SIZE
# How the classifier's threads wait for the GPU (pipeline.engines.gpu.cuda_sync).
DEFAULT_CUDA_SYNC = "auto"
# A sub-batch's zero-padded pixel buffer is at most this many pixels (x3 channels, uint8 then fp16): images of
# very different sizes are grouped by area so that one large photo does not pad a whole batch to its size.
MAX_PADDED_PIXELS = 96 * 1024 * 1024
# What a stream's source gives when the stream ends (GpuClassifier.run_stream).
STOP = object()



@dataclass
class _Item:
    index: int  # position in the caller's list
    data: bytes
    info: JpegInfo | None  # None: not a JPEG (Pillow path)
    width: int = 0  # upright, after EXIF
    height: int = 0


@dataclass
class _Chunk:
    items: list[_Item]
    inputs: Any = None  # fp16 [n, 3, h, w] on the GPU, rows in items order
    ok: list[int] = field(default_factory=list)  # positions in items that made it into ``inputs``
    errors: dict[int, str] = field(default_factory=dict)  # caller index -> "kind: detail"
    ready: Any = None  # CUDA event: inputs are complete
    keep: list = field(default_factory=list)  # buffers that must live until the network has read them
    decode_s: float = 0.0
    preprocess_s: float = 0.0


@dataclass
class RawResults:
    """Per-image outputs of ``GpuClassifier.classify``, as arrays (the Triton model sends these as they are)."""

    class_ids: np.ndarray  # int32 [N, K]
    scores: np.ndarray  # float32 [N, K]
    width: np.ndarray  # int32 [N]
    height: np.ndarray  # int32 [N]
    errors: list[str]  # "" when the image was classified


@dataclass
class StageTimes:
    """Wall seconds spent per stage since the last reset (decode and preprocess overlap the network)."""

    images: int = 0
    triage_s: float = 0.0
    decode_s: float = 0.0
    preprocess_s: float = 0.0
    network_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)



def triage(index: int, data: bytes, limits: DecodeLimits, *, gpu: bool = True) -> _Item:
    """CPU triage of one encoded file, no decode: caps, then the JPEG header. The item's ``info`` is set when the
    GPU decoder can take it (8-bit gray/YCbCr baseline or progressive JPEG ending with EOI); ``None`` sends it to
    Pillow (the reference), which says what is wrong with it.

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
    return _Item(index, data, info if (info.gpu_decodable and gpu) else None, w, h)


class GpuClassifier:
    """Decode, preprocess and classify batches of encoded images on one device; the shared core of the gpu engine.

    Args:
        network: a torch module mapping float [N, 3, H, W] (the spec's crop) to logits [N, classes].
        spec: the model's preprocessing (resize, crop, filter, normalisation, channel order).
        top_k: how many classes to return per image.
        limits: encoded-size and pixel caps, as for every engine.
        decoder: "auto" (nvImageCodec if installed, else torchvision), "nvimgcodec", "torchvision" or "pil".
        batch_size: images per network call; also the CUDA graph's batch.
        device: "cuda", "cuda:N" or "cpu" (the CPU runs the same code slowly; for tests).
        cuda_graph: capture the network in a CUDA graph per batch size (pays for small, launch-bound networks).
        half: run the network in FP16 (default on CUDA).
        cpu_decode_threads: Pillow threads for inputs the GPU decoder cannot take.
        pipeline: overlap decode/preprocessing of the next batch with the network on this one.
        prep_workers: threads preparing batches ahead of the network, each with its own CUDA stream and decoder
            (more than one keeps the hardware JPEG engines busy while another batch is resized).
        hw_decode_load: with nvImageCodec, the share of each batch given to the hardware JPEG engines; the rest
            goes to CUDA nvJPEG on the SMs (1.0: all to the engines, which leaves the SMs to the network).
        cuda_sync: how threads wait for the GPU: "block" sleeps, "spin" and CUDA's "auto" spin on a core
            (``pipeline.engines.gpu.cuda_sync``).
    """

    def __init__(
        self,
        network,
        spec: PreprocessSpec,
        *,
        top_k: int = 5,
        limits: DecodeLimits = DecodeLimits(),
        decoder: str = "auto",
        batch_size: int = DEFAULT_BATCH_SIZE,
        device: str | None = None,
        cuda_graph: bool = True,
        half: bool | None = None,
        cpu_decode_threads: int | None = None,
        pipeline: bool = True,
        prep_workers: int = 2,
        hw_decode_load: float = 1.0,
        cuda_sync: str = DEFAULT_CUDA_SYNC,
    ):
        torch = _torch()
        check_cuda_sync(cuda_sync)
        if decoder not in DECODERS:
            raise EngineError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
        if decoder == "dali":
            raise EngineError("decoder 'dali' is pipeline.engines.gpu.dali.DaliClassifier: build it with make_classifier")
        if batch_size < 1:
            raise EngineError(f"batch_size must be positive, got {batch_size}")
        if spec.layout != "NCHW":
            raise EngineError(
                f"the gpu engine feeds NCHW networks; this model's spec says layout {spec.layout!r}. "
                "Use --engine onnx or --engine triton for it"
            )
        self._torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda_sync = cuda_sync
        self.cuda_sync_in_force = "none"  # what the driver reports after setting it (CPU: none)
        if self.is_cuda:
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True
            self.cuda_sync_in_force = set_cuda_sync(self.device.index, cuda_sync)
        self.spec = spec
        self.top_k = top_k
        self.limits = limits
        self.batch_size = batch_size
        self.half = self.is_cuda if half is None else half
        self.dtype = torch.float16 if self.half else torch.float32
        self.use_graph = cuda_graph and self.is_cuda
        self.pipeline = pipeline
        self._decoder_args = (decoder, self.device, hw_decode_load)
        self._local = threading.local()  # per preparing thread: its CUDA stream and decoder
        self._state_lock = threading.Lock()
        self.decoder = _make_decoder(*self._decoder_args)
        self.decoder_name = self.decoder.name if self.decoder else "pil"
        self.layout = self.decoder.layout if self.decoder else "HWC"
        # A private copy: converting dtype/layout in place would change a module another classifier holds.
        net = copy.deepcopy(network).eval().to(self.device)
        net = net.to(memory_format=torch.channels_last)
        self.network = net.half() if self.half else net.float()
        crop_h, crop_w = spec.crop
        self._scale = torch.tensor(
            [spec.scale / s for s in spec.std], dtype=torch.float32, device=self.device
        ).view(1, 3, 1, 1)
        self._shift = torch.tensor(
            [-m / s for m, s in zip(spec.mean, spec.std)], dtype=torch.float32, device=self.device
        ).view(1, 3, 1, 1)
        self._graphs: dict[int, tuple] = {}
        self._net_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.prep_workers = max(1, prep_workers) if pipeline else 1
        # Two stages ahead of the network: decode thread(s), then one resize thread, each on its own stream.
        self._prep_pool = ThreadPoolExecutor(self.prep_workers, thread_name_prefix="gpu-decode") if pipeline else None
        self._resize_pool = ThreadPoolExecutor(1, thread_name_prefix="gpu-resize") if pipeline else None
        self._cpu_pool = ThreadPoolExecutor(cpu_decode_threads or min(8, os.cpu_count() or 1), "gpu-pil")
        self._lock = threading.Lock()
        self.times = StageTimes()
        self._num_classes: int | None = None
        log.info(
            "gpu classifier on %s: decoder %s, batch %d, %s, cuda graph %s, cuda sync %s",
            self.device,
            self.decoder_name,
            batch_size,
            "fp16" if self.half else "fp32",
            self.use_graph,
            self.cuda_sync_in_force,
        )
        if self.use_graph:
            self.warmup()  # capture now: a capture must not overlap the preparing threads' first CUDA calls

    # ---- public ---------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Builds the CUDA graph and cudnn plans for the full batch so the first real batch is not slow."""
        torch = self._torch
        crop_h, crop_w = self.spec.crop
        x = torch.zeros(self.batch_size, 3, crop_h, crop_w, dtype=self.dtype, device=self.device)
        x = x.contiguous(memory_format=torch.channels_last)
        self._run_network(x)
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def classify(self, images: Sequence[bytes]) -> RawResults:
        """Classifies encoded images; one output row per input, errors included, in input order."""
        with self._lock:
            return self._classify(images)

    def close(self) -> None:
        if self._prep_pool:
            self._prep_pool.shutdown(wait=True)
            self._resize_pool.shutdown(wait=True)
        self._cpu_pool.shutdown(wait=True)
        self._graphs.clear()

    # ---- steps ----------------------------------------------------------------------------------

    def _classify(self, images: Sequence[bytes]) -> RawResults:
        t0 = time.perf_counter()
        n = len(images)
        k = self.top_k
        ids = np.zeros((n, k), dtype=np.int32)
        scores = np.zeros((n, k), dtype=np.float32)
        width = np.zeros(n, dtype=np.int32)
        height = np.zeros(n, dtype=np.int32)
        errors = [""] * n
        items = []
        for i, data in enumerate(images):
            try:
                items.append(self._triage(i, data))
            except ImageError as e:
                errors[i] = str(e)
        self.times.triage_s += time.perf_counter() - t0
        chunks = iter([_Chunk(items[s : s + self.batch_size]) for s in range(0, len(items), self.batch_size)])
        failure: list[BaseException] = []

        def sink(chunk: _Chunk, idx_np, vals_np, error: BaseException | None) -> None:
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

        self.run_stream(lambda block: next(chunks, STOP), sink)
        if failure:
            raise failure[0]
        self.times.images += n
        self.times.total_s += time.perf_counter() - t0
        return RawResults(ids, scores, width, height, errors)

    def run_stream(self, source, sink) -> None:
        """The pipeline over a stream of chunks: decode/resize of the next ``prep_workers + 2`` chunks run while
        the network runs this one, and across the caller's batches (the Triton model feeds it from its queue).

        Args:
            source: ``source(block)`` gives the next ``_Chunk``, ``None`` when none is ready (only asked with
                ``block=False``, while work is in flight) or ``STOP`` when the stream ends.
            sink: ``sink(chunk, class_ids, scores, error)`` for each chunk, in order, once its results are on the
                host (``class_ids`` is None when no image of the chunk reached the network; ``error`` is the
                exception that failed the whole chunk, else None).
        """
        ahead = self.prep_workers + 2  # chunks in the decode and resize stages: hides them, bounds memory
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
                t = time.perf_counter()
                pending.append((chunk, *self._infer(chunk)))
                self.times.network_s += time.perf_counter() - t
            except Exception as err:  # noqa: BLE001 - this chunk fails; the stream goes on
                log.exception("a batch of %d images failed", len(chunk.items))
                sink(chunk, None, None, err)
            self.times.decode_s += chunk.decode_s
            self.times.preprocess_s += chunk.preprocess_s
            if len(pending) > 1:
                self._emit(pending.popleft(), sink)

    def _submit(self, chunk: _Chunk):
        if self._prep_pool is None:
            return None
        return self._resize_pool.submit(self._resize_after, chunk, self._prep_pool.submit(self._decode_stage, chunk))

    def _emit(self, pending, sink) -> None:
        chunk, idx_h, vals_h, done = pending
        try:
            if done is not None:
                done.synchronize()
            idx_np = None if idx_h is None else idx_h.numpy()
            vals_np = None if vals_h is None else vals_h.numpy()
        except Exception as err:  # noqa: BLE001 - the chunk's network run failed
            sink(chunk, None, None, err)
            return
        finally:
            chunk.keep = []
            chunk.inputs = None
        sink(chunk, idx_np, vals_np, None)

    def _triage(self, index: int, data: bytes) -> _Item:
        return triage(index, data, self.limits, gpu=bool(self.decoder))

    def _thread_stream(self):
        local = self._local
        if not hasattr(local, "stream"):
            # High priority: the short decode/resize kernels go ahead of the network's queued ones, so the
            # next batch is ready when the network finishes this one.
            local.stream = self._torch.cuda.Stream(self.device, priority=-1) if self.is_cuda else None
        return local.stream

    def _thread_state(self):
        """This thread's preparation stream and decoder (decoders are not shared between threads)."""
        local = self._local
        stream = self._thread_stream()
        if not hasattr(local, "decoder"):
            with self._state_lock:
                first = not getattr(self, "_decoder_taken", False)
                self._decoder_taken = True
            local.decoder = self.decoder if first else _make_decoder(*self._decoder_args)
        return stream, local.decoder

    def _stream_ctx(self, stream):
        return self._torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _pil_decode(self, item: _Item):
        """Pillow path (non-JPEG, CMYK, truncated, or what the GPU decoder refused): HWC uint8 numpy."""
        img = decode_image(item.data, self.limits)
        return np.array(img, dtype=np.uint8)  # writable: torch.from_numpy wants it

    def _prepare(self, chunk: _Chunk) -> None:
        """Decode, then pack + resize + normalise one chunk in this thread (no pipelining)."""
        self._resize_stage(chunk, self._decode_stage(chunk))

    def _resize_after(self, chunk: _Chunk, decoding) -> None:
        """The resize stage of a chunk whose decode runs (or ran) in the decode thread(s)."""
        self._resize_stage(chunk, decoding.result())

    def _decode_stage(self, chunk: _Chunk):
        """GPU decode (Pillow for the rest) on this thread's stream; returns (decoded, on_gpu, event)."""
        torch = self._torch
        t0 = time.perf_counter()
        stream, decoder = self._thread_state()
        with self._stream_ctx(stream):
            gpu_items = [it for it in chunk.items if it.info is not None]
            decoded: dict[int, Any] = {}
            on_gpu: set[int] = set()  # decoded by the GPU decoder: EXIF orientation still to apply
            if gpu_items:
                outs = decoder.decode([it.data for it in gpu_items], stream)
                for it, img in zip(gpu_items, outs):
                    if img is not None:
                        decoded[it.index] = img
                        on_gpu.add(it.index)
            # Pillow for the rest, and for anything the GPU decoder refused (it may still be readable).
            cpu_items = [it for it in chunk.items if it.index not in decoded]
            for it, res in zip(cpu_items, self._cpu_pool.map(self._safe_pil, cpu_items)):
                if isinstance(res, str):
                    chunk.errors[it.index] = res
                    continue
                arr = torch.from_numpy(res).to(self.device, non_blocking=False)
                if self.layout == "CHW":
                    arr = arr.permute(2, 0, 1)
                it.width, it.height = int(res.shape[1]), int(res.shape[0])
                decoded[it.index] = arr
            event = None
            if self.is_cuda:
                event = torch.cuda.Event()
                event.record(stream)
        chunk.decode_s = time.perf_counter() - t0
        return decoded, on_gpu, event

    def _resize_stage(self, chunk: _Chunk, decoding) -> None:
        """Pack + resize + crop + normalise decoded images on this thread's stream; records ``chunk.ready``."""
        torch = self._torch
        decoded, on_gpu, event = decoding
        t1 = time.perf_counter()
        stream = self._thread_stream()
        with self._stream_ctx(stream):
            if event is not None:
                stream.wait_event(event)
            tensors, sizes = [], []
            for pos, it in enumerate(chunk.items):
                img = decoded.get(it.index)
                if img is None:
                    continue
                if it.index in on_gpu and it.info.orientation != 1:
                    img = _orient(img, it.info.orientation, self.layout)
                if img.dim() == 2:
                    img = img.unsqueeze(-1 if self.layout == "HWC" else 0)
                if self.layout == "HWC":
                    h, w, c = img.shape
                else:
                    c, h, w = img.shape
                if c != 3:
                    img = img.expand(*((h, w, 3) if self.layout == "HWC" else (3, h, w)))
                chunk.ok.append(pos)
                tensors.append(img.contiguous())
                sizes.append((h, w))
                it.width, it.height = w, h
            chunk.keep = [decoded, tensors]  # alive until the network has read this chunk
            if tensors:
                chunk.inputs = self._preprocess(tensors, np.asarray(sizes, dtype=np.int64))
            if self.is_cuda:
                chunk.ready = torch.cuda.Event()
                chunk.ready.record(stream)
        chunk.preprocess_s = time.perf_counter() - t1

    def _safe_pil(self, item: _Item):
        try:
            return self._pil_decode(item)
        except ImageError as e:
            return str(e)

    def _preprocess(self, tensors: list, sizes: np.ndarray):
        """Packs decoded images into padded sub-batches and resizes + crops + normalises them with two matmuls."""
        torch = self._torch
        crop_h, crop_w = self.spec.crop
        out = torch.empty(len(tensors), 3, crop_h, crop_w, dtype=self.dtype, device=self.device)
        for group in _area_groups(sizes, MAX_PADDED_PIXELS):
            sub = [tensors[i] for i in group]
            padded = self._pad(sub, sizes[group])  # [n, 3, Hmax, Wmax] in compute dtype
            res = self._resize(padded, sizes[group])
            out[torch.as_tensor(group, device=self.device)] = res
        return out.contiguous(memory_format=torch.channels_last)

    def _pad(self, tensors: list, sizes: np.ndarray):
        """One gather from the concatenated images into a zero-padded [n, 3, Hmax, Wmax] batch."""
        torch = self._torch
        dev = self.device
        n = len(tensors)
        hmax, wmax = int(sizes[:, 0].max()), int(sizes[:, 1].max())
        flat = torch.cat([t.reshape(-1) for t in tensors] + [torch.zeros(3, dtype=torch.uint8, device=dev)])
        pix = sizes[:, 0] * sizes[:, 1]
        offsets = np.concatenate([[0], np.cumsum(pix * 3)[:-1]])
        zero_at = int(pix.sum() * 3)  # the 3 zero bytes appended above
        meta = torch.as_tensor(np.stack([offsets, sizes[:, 0], sizes[:, 1]], axis=1), device=dev)
        off, h, w = meta[:, 0].view(n, 1, 1), meta[:, 1].view(n, 1, 1), meta[:, 2].view(n, 1, 1)
        ys = torch.arange(hmax, device=dev).view(1, hmax, 1)
        xs = torch.arange(wmax, device=dev).view(1, 1, wmax)
        inside = (ys < h) & (xs < w)
        if self.layout == "HWC":
            # Pixel index into flat viewed as [P, 3]: gather whole pixels, then move channels first.
            pixel = torch.where(inside, off // 3 + ys * w + xs, zero_at // 3)
            out = flat.view(-1, 3)[pixel.view(-1)].view(n, hmax, wmax, 3).permute(0, 3, 1, 2)
        else:
            plane = torch.where(inside, off + ys * w + xs, zero_at)  # channel 0's index
            cs = (torch.arange(3, device=dev).view(1, 3, 1, 1) * (h * w).view(n, 1, 1, 1)).where(
                inside.unsqueeze(1), torch.zeros((), dtype=torch.int64, device=dev)
            )
            out = flat[(plane.unsqueeze(1) + cs).view(-1)].view(n, 3, hmax, wmax)
        return out.to(self.dtype).contiguous()

    def _weights(self, in_sizes, starts_len, out_size: int, src_max: int):
        """Dense [n, out, src_max] resampling matrices from Pillow's coefficients (one scatter on the device)."""
        torch = self._torch
        starts, weights = resample_coefficients_torch(
            in_sizes, starts_len[0], starts_len[1], out_size, self.spec.interpolation, self.device
        )
        n, _, taps = weights.shape
        idx = starts[..., None] + torch.arange(taps, device=self.device)[None, None, :]
        weights = torch.where(idx < src_max, weights, torch.zeros_like(weights))
        dense = torch.zeros(n, out_size, src_max, dtype=torch.float32, device=self.device)
        dense.scatter_add_(2, idx.clamp_(max=src_max - 1), weights)
        return dense.to(self.dtype)

    def _resize(self, padded, sizes: np.ndarray):
        """Resize + crop: horizontal then vertical pass (Pillow's order), each rounded to 0..255 like Pillow's."""
        torch = self._torch
        n, _, hmax, wmax = padded.shape
        crop_h, crop_w = self.spec.crop
        left, top, box_w, box_h = crop_boxes(sizes[:, 1], sizes[:, 0], self.spec)
        wx = self._weights(sizes[:, 1], (left, box_w), crop_w, wmax)  # [n, crop_w, W]
        wy = self._weights(sizes[:, 0], (top, box_h), crop_h, hmax)  # [n, crop_h, H]
        # [n, 3*H, W] @ [n, W, crop_w] -> [n, 3, H, crop_w]
        x = torch.bmm(padded.view(n, 3 * hmax, wmax), wx.transpose(1, 2))
        x = x.round_().clamp_(0, 255).view(n, 3, hmax, crop_w)
        # [n, crop_h, H] @ [n, H, 3*crop_w] -> [n, crop_h, 3, crop_w]
        x = torch.bmm(wy, x.permute(0, 2, 1, 3).reshape(n, hmax, 3 * crop_w))
        x = x.round_().clamp_(0, 255).view(n, crop_h, 3, crop_w).permute(0, 2, 1, 3).float()
        if self.spec.channel_order == "BGR":
            x = x.flip(1)
        return (x * self._scale + self._shift).to(self.dtype)

    def _run_network(self, x):
        """Logits for a batch; a CUDA graph per padded batch size when enabled."""
        torch = self._torch
        with torch.inference_mode():
            if not self.use_graph:
                return self.network(x)
            n = x.shape[0]
            size = self.batch_size if n <= self.batch_size else n
            graph = self._graphs.get(size)
            if graph is None:
                graph = self._capture(size, x)
            g, static_in, static_out = graph
            static_in[:n].copy_(x)
            g.replay()
            return static_out[:n]

    def _capture(self, size: int, like):
        torch = self._torch
        static_in = torch.zeros((size,) + tuple(like.shape[1:]), dtype=like.dtype, device=self.device)
        static_in = static_in.contiguous(memory_format=torch.channels_last)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # cudnn autotuning and lazy init happen outside the graph
                self.network(static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # thread_local: the preprocessing threads' CUDA calls must not invalidate this capture
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            static_out = self.network(static_in)
        self._graphs[size] = (g, static_in, static_out)
        log.info("captured a CUDA graph for batch %d", size)
        return self._graphs[size]

    def _infer(self, chunk: _Chunk):
        """Queues network + softmax + top-k for a prepared chunk; returns host buffers and their event."""
        torch = self._torch
        if chunk.inputs is None:
            return None, None, None
        with self._stream_ctx(self._net_stream):
            if chunk.ready is not None:
                self._net_stream.wait_event(chunk.ready)
                chunk.inputs.record_stream(self._net_stream)
            logits = self._run_network(chunk.inputs)
            probs = logits.float().softmax(dim=-1)
            k = min(self.top_k, probs.shape[-1])
            top = probs.topk(k, dim=-1)
            vals = top.values
            idx = top.indices.to(torch.int32)
            if self.is_cuda:
                vals_h = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
                idx_h = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
                vals_h.copy_(vals, non_blocking=True)
                idx_h.copy_(idx, non_blocking=True)
                done = torch.cuda.Event(blocking=self.cuda_sync == "block")
                done.record(self._net_stream)
                return idx_h, vals_h, done
            return idx, vals, None


def _area_groups(sizes: np.ndarray, max_pixels: int) -> list[list[int]]:
    """Splits images into groups whose padded buffer (count x max H x max W) stays under ``max_pixels``.

    Usually one group: the whole chunk. Sorting by area only happens when a chunk would not fit.
    """
    n = len(sizes)
    if n * int(sizes[:, 0].max()) * int(sizes[:, 1].max()) <= max_pixels:
        return [list(range(n))]
    order = np.argsort(sizes[:, 0] * sizes[:, 1], kind="stable")
    groups, cur, hmax, wmax = [], [], 0, 0
    for i in order.tolist():
        h, w = int(sizes[i, 0]), int(sizes[i, 1])
        nh, nw = max(hmax, h), max(wmax, w)
        if cur and (len(cur) + 1) * nh * nw > max_pixels:
            groups.append(cur)
            cur, nh, nw = [], h, w
        cur.append(i)
        hmax, wmax = nh, nw
    if cur:
        groups.append(cur)
    return groups

