"""GPU JPEG decoders for the gpu engine (nvImageCodec, torchvision's nvJPEG) and EXIF orientation on tensors.

torch is imported when a decoder is built: it is not a dependency of the package.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from pipeline.errors import EngineError

log = logging.getLogger(__name__)

DECODERS = ("auto", "dali", "nvimgcodec", "torchvision", "pil")  # "dali": pipeline.engines.gpu.dali


def _torch():
    try:
        import torch  # noqa: PLC0415 - optional dependency, present on GPU machines
    except ImportError:
        raise EngineError(
            "the gpu engine needs PyTorch with CUDA (the GPU worker image has it); install torch, "
            "or use --engine onnx / --engine triton"
        ) from None
    return torch




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
