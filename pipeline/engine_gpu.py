"""GPU engine: nvJPEG decode, batched resize/crop/normalize, FP16 network and top-k on one GPU, in process or in Triton.

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

import contextlib
import copy
import logging
import math
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pipeline.errors import EngineError, ImageError
from pipeline.preprocess import DecodeLimits, PreprocessSpec, decode_image
from pipeline.results import Result

log = logging.getLogger(__name__)

DECODERS = ("auto", "dali", "nvimgcodec", "torchvision", "pil")
DEFAULT_BATCH_SIZE = 256
# A sub-batch's zero-padded pixel buffer is at most this many pixels (x3 channels, uint8 then fp16): images of
# very different sizes are grouped by area so that one large photo does not pad a whole batch to its size.
MAX_PADDED_PIXELS = 96 * 1024 * 1024
# Pillow's filter supports (Resample.c); "nearest" is a one-tap special case.
FILTER_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0, "lanczos": 3.0}
BICUBIC_A = -0.5  # Pillow's bicubic uses a = -0.5

# JPEG start-of-frame markers: baseline/extended Huffman and progressive decode on the GPU; the rest
# (lossless, arithmetic coding, hierarchical) go to Pillow, which says whether it can read them.
_SOF_GPU = {0xC0: "baseline", 0xC1: "baseline", 0xC2: "progressive"}
_SOF_OTHER = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, 0xD0, 0xD1, 0xD2, 0xD3, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8}
EXIF_ORIENTATION_TAG = 0x0112


# ---------------------------------------------------------------------------------------------------------------
# CPU triage: a JPEG header reader (no decode) and Pillow's resampling coefficients.


@dataclass(frozen=True)
class JpegInfo:
    """What the JPEG header says, before any decoding."""

    width: int
    height: int
    components: int
    precision: int
    process: str  # "baseline", "progressive" or "other"
    orientation: int = 1  # EXIF orientation 1..8 (1 = upright)
    complete: bool = True  # the data ends with the EOI marker

    @property
    def gpu_decodable(self) -> bool:
        """nvJPEG decodes 8-bit gray/YCbCr baseline and progressive files; the rest goes to Pillow."""
        return (
            self.process in ("baseline", "progressive")
            and self.precision == 8
            and self.components in (1, 3)
            and self.complete
            and self.width > 0
            and self.height > 0
        )

    @property
    def upright_size(self) -> tuple[int, int]:
        """(width, height) after the EXIF orientation is applied."""
        return (self.height, self.width) if self.orientation in (5, 6, 7, 8) else (self.width, self.height)


def parse_jpeg_header(data: bytes) -> JpegInfo | None:
    """Reads a JPEG's frame header and EXIF orientation without decoding.

    Returns None when ``data`` is not a JPEG (no SOI marker).

    Raises:
        ImageError: decode_error when the file starts like a JPEG but its header is cut or malformed.
    """
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos = 2
    orientation = 1
    while pos < n:
        if data[pos] != 0xFF:
            raise ImageError("decode_error", f"corrupt JPEG header: expected a marker at byte {pos}")
        while pos < n and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= n:
            break
        marker = data[pos]
        pos += 1
        if marker in _STANDALONE:
            continue
        if marker == 0xD9 or marker == 0xDA:
            raise ImageError("decode_error", "corrupt JPEG: image data starts before the frame header")
        if pos + 2 > n:
            break
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2 or pos + length > n:
            break
        if marker == 0xE1 and data[pos + 2 : pos + 8] == b"Exif\x00\x00":
            orientation = _exif_orientation(bytes(data[pos + 8 : pos + length]))
        elif marker in _SOF_GPU or marker in _SOF_OTHER:
            if length < 8:
                break
            precision = data[pos + 2]
            height = (data[pos + 3] << 8) | data[pos + 4]
            width = (data[pos + 5] << 8) | data[pos + 6]
            components = data[pos + 7]
            complete = data[n - 2] == 0xFF and data[n - 1] == 0xD9
            return JpegInfo(
                width=width,
                height=height,
                components=components,
                precision=precision,
                process=_SOF_GPU.get(marker, "other"),
                orientation=orientation,
                complete=complete,
            )
        pos += length
    raise ImageError("decode_error", "truncated JPEG: the data ends inside the header")


def _exif_orientation(tiff: bytes) -> int:
    """The Orientation tag of IFD0 in an EXIF (TIFF) block; 1 when absent or unreadable."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(tiff):
            return 1
        if int.from_bytes(tiff[entry : entry + 2], order) == EXIF_ORIENTATION_TAG:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            return value if 1 <= value <= 8 else 1
    return 1


def _filter(name: str, x: np.ndarray) -> np.ndarray:
    ax = np.abs(x)
    if name == "bilinear":
        return np.where(ax < 1.0, 1.0 - ax, 0.0)
    if name == "bicubic":
        a = BICUBIC_A
        near = ((a + 2.0) * ax - (a + 3.0)) * ax * ax + 1.0
        far = (((ax - 5.0) * ax + 8.0) * ax - 4.0) * a
        return np.where(ax < 1.0, near, np.where(ax < 2.0, far, 0.0))
    if name == "lanczos":
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(ax < 3.0, np.sinc(x) * np.sinc(x / 3.0), 0.0)
    raise ValueError(f"no resampling filter {name!r}")


def resample_coefficients(
    in_sizes: np.ndarray, box_starts: np.ndarray, box_lengths: np.ndarray, out_size: int, interpolation: str
) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's resampling coefficients (``precompute_coeffs`` in Resample.c) for many images along one axis.

    Output pixel ``j`` of image ``i`` is ``sum_k weights[i, j, k] * src[starts[i, j] + k]``; taps past the image
    edge have weight 0. Computing them as Pillow does (box in source pixels, kernel widened by the downscale
    factor, edge taps dropped and renormalised) is what makes the GPU resize match the CPU reference.

    Returns:
        (starts int64 [N, out], weights float32 [N, out, taps])
    """
    in_sizes = np.asarray(in_sizes, dtype=np.float64)
    box_starts = np.asarray(box_starts, dtype=np.float64)
    scale = np.asarray(box_lengths, dtype=np.float64) / out_size
    centers = box_starts[:, None] + (np.arange(out_size, dtype=np.float64)[None, :] + 0.5) * scale[:, None]
    if interpolation == "nearest":
        # Pillow resizes NEAREST through an affine transform that samples floor(center).
        starts = np.clip(np.floor(centers), 0, in_sizes[:, None] - 1).astype(np.int64)
        return starts, np.ones(starts.shape + (1,), dtype=np.float32)
    support0 = FILTER_SUPPORT[interpolation]
    filterscale = np.maximum(scale, 1.0)
    support = support0 * filterscale
    taps = int(math.ceil(float(support.max()))) * 2 + 1
    xmin = np.maximum(np.trunc(centers - support[:, None] + 0.5), 0.0)
    xmax = np.minimum(np.trunc(centers + support[:, None] + 0.5), in_sizes[:, None]) - xmin
    k = np.arange(taps, dtype=np.float64)
    arg = (k[None, None, :] + xmin[..., None] - centers[..., None] + 0.5) / filterscale[:, None, None]
    weights = _filter(interpolation, arg)
    weights = np.where(k[None, None, :] < xmax[..., None], weights, 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    return xmin.astype(np.int64), weights.astype(np.float32)


def resample_coefficients_torch(in_sizes, box_starts, box_lengths, out_size: int, interpolation: str, device):
    """``resample_coefficients`` computed on the device with torch (float64), same results; tensors out."""
    import torch  # noqa: PLC0415

    f64 = torch.float64
    in_sizes = torch.as_tensor(np.asarray(in_sizes, dtype=np.float64), device=device)
    box_starts = torch.as_tensor(np.asarray(box_starts, dtype=np.float64), device=device)
    scale = torch.as_tensor(np.asarray(box_lengths, dtype=np.float64), device=device) / out_size
    j = torch.arange(out_size, dtype=f64, device=device)
    centers = box_starts[:, None] + (j[None, :] + 0.5) * scale[:, None]
    if interpolation == "nearest":
        starts = torch.minimum(torch.clamp(torch.floor(centers), min=0), in_sizes[:, None] - 1).to(torch.int64)
        return starts, torch.ones(starts.shape + (1,), dtype=torch.float32, device=device)
    filterscale = torch.clamp(scale, min=1.0)
    support = FILTER_SUPPORT[interpolation] * filterscale
    taps = int(math.ceil(float(support.max()))) * 2 + 1
    xmin = torch.clamp(torch.trunc(centers - support[:, None] + 0.5), min=0.0)
    xmax = torch.minimum(torch.trunc(centers + support[:, None] + 0.5), in_sizes[:, None]) - xmin
    k = torch.arange(taps, dtype=f64, device=device)
    x = (k[None, None, :] + xmin[..., None] - centers[..., None] + 0.5) / filterscale[:, None, None]
    ax = x.abs()
    if interpolation == "bilinear":
        w = torch.clamp(1.0 - ax, min=0.0)
    elif interpolation == "bicubic":
        a = BICUBIC_A
        near = ((a + 2.0) * ax - (a + 3.0)) * ax * ax + 1.0
        far = (((ax - 5.0) * ax + 8.0) * ax - 4.0) * a
        w = torch.where(ax < 1.0, near, torch.where(ax < 2.0, far, torch.zeros_like(ax)))
    elif interpolation == "lanczos":
        w = torch.where(ax < 3.0, torch.sinc(x) * torch.sinc(x / 3.0), torch.zeros_like(ax))
    else:
        raise ValueError(f"no resampling filter {interpolation!r}")
    w = torch.where(k[None, None, :] < xmax[..., None], w, torch.zeros_like(w))
    total = w.sum(dim=-1, keepdim=True)
    w = torch.where(total != 0, w / torch.where(total != 0, total, torch.ones_like(total)), w)
    return xmin.to(torch.int64), w.to(torch.float32)


def crop_boxes(widths: np.ndarray, heights: np.ndarray, spec: PreprocessSpec) -> tuple[np.ndarray, ...]:
    """The source-pixel box each image's crop covers (as ``pipeline.preprocess.preprocess_image`` computes it).

    Returns:
        (left, top, box_width, box_height), float64 arrays.
    """
    widths = np.asarray(widths, dtype=np.float64)
    heights = np.asarray(heights, dtype=np.float64)
    crop_h, crop_w = spec.crop
    factor = spec.resize_shorter / np.minimum(widths, heights)
    box_w, box_h = crop_w / factor, crop_h / factor
    return (widths - box_w) / 2.0, (heights - box_h) / 2.0, box_w, box_h


# ---------------------------------------------------------------------------------------------------------------
# GPU side (torch imported lazily).


def _torch():
    try:
        import torch  # noqa: PLC0415 - optional dependency, present on GPU machines
    except ImportError:
        raise EngineError(
            "the gpu engine needs PyTorch with CUDA (the GPU worker image has it); install torch, "
            "or use --engine onnx / --engine triton"
        ) from None
    return torch


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


class _NvImageCodecDecoder:
    """nvImageCodec: the GPU's hardware JPEG engines first, CUDA nvJPEG for what they cannot take."""

    name = "nvimgcodec"
    layout = "HWC"

    def __init__(self, device_id: int, hw_load: float = 1.0, cpu_threads: int = 0):
        from nvidia import nvimgcodec  # noqa: PLC0415 - optional

        kind = nvimgcodec.BackendKind
        backends = []
        if hw_load > 0:
            backends.append(nvimgcodec.Backend(kind.HW_GPU_ONLY, load_hint=float(hw_load)))
        backends += [nvimgcodec.Backend(kind.GPU_ONLY), nvimgcodec.Backend(kind.HYBRID_CPU_GPU)]
        self._decoder = nvimgcodec.Decoder(device_id=device_id, max_num_cpu_threads=cpu_threads, backends=backends)
        params = {"apply_exif_orientation": False}
        spec = getattr(nvimgcodec, "ColorSpec", None)
        rgb = getattr(spec, "RGB", None) or getattr(spec, "SRGB", None)  # the enum's name changed across versions
        if rgb is not None:
            params["color_spec"] = rgb
        self._params = nvimgcodec.DecodeParams(**params)
        self._code_stream = nvimgcodec.CodeStream
        self._wrap = False  # whether decode() wants CodeStream objects rather than bytes
        self._torch = _torch()

    def decode(self, datas: list[bytes], stream) -> list:
        if not self._wrap:
            try:
                images = self._decoder.decode(datas, params=self._params, cuda_stream=stream.cuda_stream)
            except TypeError:
                self._wrap = True
        if self._wrap:
            srcs = [self._code_stream(d) for d in datas]
            images = self._decoder.decode(srcs, params=self._params, cuda_stream=stream.cuda_stream)
        from_dlpack = self._torch.from_dlpack
        return [None if img is None else from_dlpack(img) for img in images]


class _TorchvisionDecoder:
    """torchvision's batched nvJPEG (``decode_jpeg(list, device='cuda')``); on the CPU, libjpeg-turbo."""

    name = "torchvision"
    layout = "CHW"

    def __init__(self, device):
        from torchvision.io import ImageReadMode, decode_jpeg  # noqa: PLC0415 - optional

        self._decode_jpeg = decode_jpeg
        self._mode = ImageReadMode.RGB
        self._device = device
        self._torch = _torch()

    def _tensor(self, data: bytes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: decode_jpeg only reads it
            return self._torch.frombuffer(data, dtype=self._torch.uint8)

    def decode(self, datas: list[bytes], stream) -> list:
        tensors = [self._tensor(d) for d in datas]
        try:
            return list(self._decode_jpeg(tensors, mode=self._mode, device=self._device))
        except RuntimeError as e:
            # One bad file fails nvJPEG's whole batch: decode one by one so only the bad ones fail.
            log.debug("batched decode failed (%s); isolating", e)
        out = []
        for t in tensors:
            try:
                out.append(self._decode_jpeg(t, mode=self._mode, device=self._device))
            except RuntimeError:
                out.append(None)
        return out


def _make_decoder(name: str, device, hw_load: float = 1.0) -> Any:
    if name == "pil":
        return None
    if name in ("auto", "nvimgcodec") and device.type == "cuda":
        try:
            return _NvImageCodecDecoder(device.index or 0, hw_load=hw_load)
        except ImportError:
            if name == "nvimgcodec":
                raise EngineError(
                    "decoder 'nvimgcodec' needs the nvidia-nvimgcodec-cu13 (or -cu12) package; install it or "
                    "use decoder 'torchvision'"
                ) from None
            log.info("nvImageCodec is not installed; decoding with torchvision's nvJPEG")
    if name == "nvimgcodec":
        raise EngineError("decoder 'nvimgcodec' needs a CUDA device; use decoder 'torchvision' or 'pil' on the CPU")
    try:
        return _TorchvisionDecoder(device)
    except ImportError:
        raise EngineError("decoder 'torchvision' needs torchvision; install it or use decoder 'pil'") from None


def _orient(img, orientation: int, layout: str):
    """Applies an EXIF orientation to one decoded image tensor (as Pillow's ``ImageOps.exif_transpose``)."""
    h_axis, w_axis = (0, 1) if layout == "HWC" else (1, 2)
    if orientation == 2:
        return img.flip(w_axis)
    if orientation == 3:
        return img.flip(h_axis).flip(w_axis)
    if orientation == 4:
        return img.flip(h_axis)
    t = img.transpose(h_axis, w_axis)
    if orientation == 5:
        return t
    if orientation == 6:  # rotate 90 degrees clockwise
        return t.flip(w_axis)
    if orientation == 7:
        return t.flip(h_axis).flip(w_axis)
    if orientation == 8:  # rotate 90 degrees counter-clockwise
        return t.flip(h_axis)
    return img


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
    ):
        torch = _torch()
        if decoder not in DECODERS:
            raise EngineError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
        if decoder == "dali":
            raise EngineError("decoder 'dali' is pipeline.engine_dali.DaliClassifier: build it with make_classifier")
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
        if self.is_cuda:
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True
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
            "gpu classifier on %s: decoder %s, batch %d, %s, cuda graph %s",
            self.device,
            self.decoder_name,
            batch_size,
            "fp16" if self.half else "fp32",
            self.use_graph,
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
        t1 = time.perf_counter()
        chunks = [_Chunk(items[s : s + self.batch_size]) for s in range(0, len(items), self.batch_size)]
        pending: list = []  # (chunk, ids_host, scores_host, done_event)
        net_s = 0.0
        futures = []
        ahead = self.prep_workers + 2  # batches in the decode and resize stages: hides them, bounds memory

        def submit(c):
            return self._resize_pool.submit(self._resize_after, c, self._prep_pool.submit(self._decode_stage, c))

        if self._prep_pool:
            for c in chunks[:ahead]:
                futures.append(submit(c))
        for ci, chunk in enumerate(chunks):
            if self._prep_pool:
                futures[ci].result()
                if ci + ahead < len(chunks):
                    futures.append(submit(chunks[ci + ahead]))
            else:
                self._prepare(chunk)
            tn = time.perf_counter()
            pending.append((chunk, *self._infer(chunk)))
            net_s += time.perf_counter() - tn
            if len(pending) > 1:
                self._collect(pending.pop(0), ids, scores, width, height, errors)
        for p in pending:
            self._collect(p, ids, scores, width, height, errors)
        t2 = time.perf_counter()
        times = self.times
        times.images += n
        times.triage_s += t1 - t0
        times.decode_s += sum(c.decode_s for c in chunks)
        times.preprocess_s += sum(c.preprocess_s for c in chunks)
        times.network_s += net_s
        times.total_s += t2 - t0
        return RawResults(ids, scores, width, height, errors)

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
                done = torch.cuda.Event()
                done.record(self._net_stream)
                return idx_h, vals_h, done
            return idx, vals, None

    def _collect(self, pending, ids, scores, width, height, errors) -> None:
        chunk, idx_h, vals_h, done = pending
        if done is not None:
            done.synchronize()
        for index, msg in chunk.errors.items():
            errors[index] = msg
        if idx_h is None:
            return
        idx_np, vals_np = idx_h.numpy(), vals_h.numpy()
        k = idx_np.shape[1]
        rows = np.asarray([chunk.items[p].index for p in chunk.ok], dtype=np.int64)
        ids[rows, :k] = idx_np
        scores[rows, :k] = vals_np
        width[rows] = [chunk.items[p].width for p in chunk.ok]
        height[rows] = [chunk.items[p].height for p in chunk.ok]
        chunk.keep = []
        chunk.inputs = None


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


# ---------------------------------------------------------------------------------------------------------------
# The Engine.


class GpuEngine:
    """The ``gpu`` engine: ``GpuClassifier`` in this process, returning ``Result`` rows.

    Args:
        bundle: the model (``pipeline.model.ModelBundle``). The default EfficientNet-Lite0 runs as a torch module
            built from its checkpoint. A user's model runs if its folder holds ``model.torchscript`` (TorchScript
            of the same network); ONNX alone cannot run here (PyTorch does not execute ONNX): use
            ``--engine triton`` (TensorRT) or ``--engine onnx`` for those.
        top_k: classes per image.
        limits: decode limits.
        **options: ``network`` (a torch module, or "resnet50" for random-weight benchmarking), and the
            ``GpuClassifier`` options: decoder, batch_size, device, cuda_graph, half, cpu_decode_threads, pipeline.
    """

    name = "gpu"

    def __init__(self, bundle, *, top_k: int = 5, limits: DecodeLimits = DecodeLimits(), **options: Any):
        from pipeline.torch_models import default_network, load_network  # noqa: PLC0415 - needs torch

        network = options.pop("network", None)
        if network is None or isinstance(network, str):
            from pipeline.engine_dali import uses_dali  # noqa: PLC0415

            on_dali = uses_dali(options.get("decoder", "auto"), options.get("device"))
            if "half" not in options and default_network(bundle, network) and not on_dali:
                # FP32 for the default model on the hand-written resampler: FP16 flips its near-ties there; on
                # DALI the FP32 network agrees no better (GPU_NOTES.md).
                options["half"] = False
            network = load_network(bundle, network)
        self.labels = tuple(bundle.labels)
        from pipeline.engine_dali import make_classifier  # noqa: PLC0415 - DALI is optional

        self.classifier = make_classifier(network, bundle.spec, top_k=top_k, limits=limits, **options)

    def classify(self, images: Sequence[bytes]) -> list[Result]:
        raw = self.classifier.classify(images)
        return results_from_raw(raw, self.labels)

    def close(self) -> None:
        self.classifier.close()

    def __enter__(self) -> "GpuEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def results_from_raw(raw: RawResults, labels: Sequence[str]) -> list[Result]:
    """Turns ``RawResults`` arrays into one ``Result`` per image."""
    out = []
    for i, err in enumerate(raw.errors):
        if err:
            out.append(Result.failed(err))
            continue
        ids = raw.class_ids[i].tolist()
        out.append(
            Result(
                status="ok",
                class_ids=ids,
                labels=[labels[c] if 0 <= c < len(labels) else str(c) for c in ids],
                scores=[float(s) for s in raw.scores[i]],
                width=int(raw.width[i]),
                height=int(raw.height[i]),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------------------------
# The gpu profile of the model repository.

GPU_MAX_BATCH_SIZE = 1024  # images per execute() at most; the model cuts them into batch_size network calls
GPU_INSTANCES = 3  # stub processes, each with its own GIL: one's CPU work and decode fill the others' GPU gaps
GPU_QUEUE_DELAY_US = 2000
GPU_SHIM_FILE = "model.py"
_GPU_SHIM_TEXT = '''"""Triton python-backend entry of the gpu profile; the model is pipeline.gpu_model (written by
`bulk-classify repo build --profile gpu`, do not edit)."""

import os
import sys

sys.path[:0] = [p for p in os.environ.get("{env}", "").split(os.pathsep) if p and p not in sys.path]

from pipeline.gpu_model import TritonPythonModel  # noqa: E402,F401
'''


def gpu_config(
    *,
    top_k: int = 5,
    instances: int = GPU_INSTANCES,
    max_batch_size: int = GPU_MAX_BATCH_SIZE,
    batch_size: int = DEFAULT_BATCH_SIZE,
    decoder: str = "auto",
    network: str = "auto",
    cuda_graph: bool = True,
    queue_delay_us: int = GPU_QUEUE_DELAY_US,
    error_output: bool | None = None,
    prep_workers: int = 1,
    hw_decoder_load: float | None = None,
    half: str = "auto",
) -> str:
    """config.pbtxt of the gpu profile's one model (python backend, KIND_GPU, ragged IMAGE input).

    ``error_output``: declare the optional BYTES ``ERROR`` output. The python backend of the nvidia-pytriton
    wheel cannot send BYTES tensors when its Python has numpy 2 (they arrive empty), so the default is to declare
    it only under numpy 1; without it a request holding a bad image fails as a whole and the client isolates it.
    """
    from pipeline import gpu_model as gm  # noqa: PLC0415
    from pipeline import tensor_names as tn  # noqa: PLC0415
    from pipeline.repo import _contract_io, _mc, _text  # noqa: PLC0415 - one definition of the contract's tensors

    mc = _mc()
    config = mc.ModelConfig(name=tn.MODEL_NAME, backend="python", max_batch_size=max_batch_size)
    if error_output is None:
        error_output = int(np.__version__.split(".")[0]) < 2
    _contract_io(config, top_k, with_error=error_output)
    for tensor in config.input:
        if tensor.name == tn.INPUT_IMAGE:
            # Requests padded to different lengths can then share one execute() (the backend sees each request).
            tensor.allow_ragged_batch = True
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_GPU, count=instances)
    config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    params = {
        gm.PARAM_NETWORK: network,
        gm.PARAM_DECODER: decoder,
        gm.PARAM_BATCH_SIZE: str(batch_size),
        gm.PARAM_CUDA_GRAPH: "true" if cuda_graph else "false",
        gm.PARAM_PREP_WORKERS: str(prep_workers),
    }
    if hw_decoder_load is not None:
        params[gm.PARAM_HW_DECODER_LOAD] = str(hw_decoder_load)
    if half != "auto":
        params[gm.PARAM_HALF] = str(half).lower()
    for key, value in params.items():
        config.parameters[key].string_value = value
    return _text(config)


def build_gpu_repository(model: str | None, output: str, **options: Any):
    """Writes the gpu profile for ``model`` (a model folder, or None for the default) into ``output``.

    The folder gets ``classifier/config.pbtxt``, ``classifier/1/model.py`` (a shim importing
    ``pipeline.gpu_model``), ``preprocess.json`` and, for a user's model, its ``model.torchscript``.
    ``options`` go to ``gpu_config`` (top_k, instances, max_batch_size, batch_size, decoder, network, ...).

    Returns:
        the repository folder.
    """
    import shutil  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from pipeline import tensor_names as tn  # noqa: PLC0415
    from pipeline.default_model import DEFAULT_SPEC  # noqa: PLC0415
    from pipeline.gpu_model import SPEC_FILE  # noqa: PLC0415
    from pipeline.torch_models import TORCHSCRIPT_FILE  # noqa: PLC0415
    from pipeline.triton_server import STUB_PATH_ENV  # noqa: PLC0415

    out = Path(output).expanduser()
    version = out / tn.MODEL_NAME / "1"
    version.mkdir(parents=True, exist_ok=True)
    spec = DEFAULT_SPEC
    if model not in (None, "", "default"):
        from pipeline.model import load_model  # noqa: PLC0415

        bundle = load_model(model)
        scripted = Path(model) / TORCHSCRIPT_FILE
        if not scripted.is_file():
            raise EngineError(
                f"the gpu profile runs torch networks: {model} has no {TORCHSCRIPT_FILE}. Add one "
                "(torch.jit.save of the network) or use --profile production (TensorRT) / portable"
            )
        shutil.copyfile(scripted, version / TORCHSCRIPT_FILE)
        spec = bundle.spec
    (out / tn.MODEL_NAME / "config.pbtxt").write_text(gpu_config(**options), encoding="utf-8")
    (version / GPU_SHIM_FILE).write_text(_GPU_SHIM_TEXT.replace("{env}", STUB_PATH_ENV), encoding="utf-8")
    (version / SPEC_FILE).write_text(spec.to_json(), encoding="utf-8")
    return out
