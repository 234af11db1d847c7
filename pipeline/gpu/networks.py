"""Torch networks for the GPU paths: EfficientNet-Lite0 from the default checkpoint, a folder's ONNX, ResNet-50.

The default model is rebuilt here as a plain torch module from the same checkpoint arrays that
``pipeline.model.default_model`` turns into ONNX (BatchNorm folded the same way, TF "SAME" padding for 224 px), so the
GPU and the ONNX reference compute the same function; the ``efficientnet-lite-pytorch`` package's code is not used.
Its layouts (``LITE0_LAYOUTS``) compute TF's padding inside the convs instead of as separate pad kernels, with the
same logits; ``DEFAULT_LITE0_LAYOUT`` is the one both the gpu engine and the gpu profile's Triton models run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.model.default_model import (
    BN_EPS,
    HEAD_CHANNELS,
    IMAGE_SIZE,
    LITE0_BLOCKS,
    _same_pads,
    load_checkpoint,
)
from pipeline.errors import ConfigError, EngineError, ModelError
from pipeline.model.folder import MODEL_FILE, TORCHSCRIPT_FILE, is_builtin

LOG = logging.getLogger(__name__)

BENCHMARK_NETWORKS = ("resnet50",)
CONVERTER_MISSING = ("the GPU paths convert model.onnx to torch with onnx2torch and onnxslim, which are not "
                     "installed here: pip install 'bulk-classify[gpu]', or use --engine onnx")
MIRROR = "mirror"


@dataclass(frozen=True, kw_only=True)
class Lite0Layout:
    """How the torch module computes the checkpoint's TF "SAME" padding; every layout computes the same function.

    Each field is one of "pad" (``F.pad``, then the conv without padding: a separate copy of the input),
    "conv" (the conv's own symmetric padding: only for symmetric pads), "kernel" (zero taps in front of the kernel,
    so that the asymmetric pad becomes the conv's own symmetric one), "slice" (the conv's own padding, one stride
    larger in front, and the extra first output row and column dropped after the block's 1x1 projection, where
    the tensor is smallest) or "mirror" (the whole network runs on the image turned by 180 degrees, with every
    kernel turned too: there TF's larger pad is in front, and the conv's own symmetric padding of that size reads
    the same pixels; one flip of the input replaces every pad, with standard kernels and no extra row). "mirror"
    is all or nothing: the stem and the stride-2 layers both, the stride-1 ones "conv".

    ``gemm`` changes where the folded BatchNorm biases are added, not the padding. On the GPU a conv's bias is
    a pass of its own over the conv's output, and these passes were the largest share of the network's GPU time
    (docs/performance.md, ``tests/benchmarks/device/probe_kernels.py``). With ``gemm`` the 1x1 convs run as GEMMs
    over the channels-last rows, with their bias added in the GEMM's epilogue. The depthwise convs have no bias:
    ReLU6's bounds are shifted by it instead, relu6(z + b) - b = clamp(z, -b, 6 - b), and the "- b" is folded into
    the next 1x1 projection's bias (W (v + b) = W v + W b; exact, as the projection reads no padding).

    Attributes:
        symmetric: the stride-1 layers' pads ("pad" or "conv").
        asymmetric: the stride-2 depthwise layers' pads ("pad", "kernel" or "slice").
        stem: the stride-2 stem's pad ("pad" or "kernel").
        inplace: ReLU6 in place.
        gemm: 1x1 convs as GEMMs with the bias in the epilogue, depthwise biases folded into the projections.
    """

    symmetric: str
    asymmetric: str
    stem: str
    inplace: bool
    gemm: bool = False

    def __post_init__(self):
        for name, allowed in (("symmetric", ("pad", "conv")), ("asymmetric", ("pad", "kernel", "slice", MIRROR)),
                              ("stem", ("pad", "kernel", MIRROR))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Lite0Layout.{name} {getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if (self.asymmetric == MIRROR) != (self.stem == MIRROR) or (self.mirrored and self.symmetric != "conv"):
            raise ValueError('Lite0Layout "mirror" turns the whole network: set asymmetric and stem to "mirror" and '
                             'symmetric to "conv"')

    @property
    def mirrored(self) -> bool:
        """The network runs on the input turned by 180 degrees (flipped in height and width)."""
        return self.asymmetric == MIRROR


# Named layouts, measured against each other (and timm's efficientnet_lite0) by tests/benchmarks/bench_network.py.
LITE0_LAYOUTS = {
    "explicit": Lite0Layout(symmetric="pad", asymmetric="pad", stem="pad", inplace=False),
    "conv_pads": Lite0Layout(symmetric="conv", asymmetric="pad", stem="pad", inplace=False),
    "slice": Lite0Layout(symmetric="conv", asymmetric="slice", stem="pad", inplace=False),
    "slice_kstem": Lite0Layout(symmetric="conv", asymmetric="slice", stem="kernel", inplace=False),
    "slice_inplace": Lite0Layout(symmetric="conv", asymmetric="slice", stem="pad", inplace=True),
    "kernel": Lite0Layout(symmetric="conv", asymmetric="kernel", stem="kernel", inplace=False),
    "slice_kstem_inplace": Lite0Layout(symmetric="conv", asymmetric="slice", stem="kernel", inplace=True),
    "kernel_inplace": Lite0Layout(symmetric="conv", asymmetric="kernel", stem="kernel", inplace=True),
    "mirror": Lite0Layout(symmetric="conv", asymmetric=MIRROR, stem=MIRROR, inplace=True),
    "mirror_gemm": Lite0Layout(symmetric="conv", asymmetric=MIRROR, stem=MIRROR, inplace=True, gemm=True),
}
REFERENCE_LITE0_LAYOUT = "explicit"  # TF's padding written out as TF defines it: what every other layout must equal
# No pad kernel, no extra row, no bias pass: the fastest exact layout (docs/performance.md).
DEFAULT_LITE0_LAYOUT = "mirror_gemm"
# Rows of one GEMM: torch adds the bias in cuBLASLt's epilogue only below 65535 * 32 rows (larger GEMMs are cut).
GEMM_ROWS = 65535 * 32 - 1


def _fold(weights: dict[str, np.ndarray], conv: str, bn: str) -> tuple[np.ndarray, np.ndarray]:
    """Conv weight and bias with the following BatchNorm folded in (float64 maths, float32 result)."""
    w = weights[f"{conv}.weight"].astype(np.float64)
    gamma, beta = weights[f"{bn}.weight"].astype(np.float64), weights[f"{bn}.bias"].astype(np.float64)
    mean, var = weights[f"{bn}.running_mean"].astype(np.float64), weights[f"{bn}.running_var"].astype(np.float64)
    factor = gamma / np.sqrt(var + BN_EPS)
    return (w * factor[:, None, None, None]).astype(np.float32), (beta - mean * factor).astype(np.float32)


@dataclass(frozen=True)
class PadPlan:
    """One conv's TF "SAME" padding as a layout computes it.

    Attributes:
        pad: ``F.pad``'s (left, right, top, bottom) before the conv, or None.
        padding: the conv's own symmetric padding.
        front_taps: zero taps put in front of the kernel (rows and columns).
        drop: output rows and columns to drop in front (after the block's projection).
    """

    pad: tuple[int, int, int, int] | None
    padding: int
    front_taps: int
    drop: int


def pad_plan(size: int, kernel: int, stride: int, form: str) -> PadPlan:
    """How a conv of ``kernel`` and ``stride`` on a ``size`` square input gets TF's "SAME" output in ``form``.

    With TF's (before, after) pads, output ``i`` reads input ``stride * i + t - before`` for tap ``t``:
    - "kernel": ``after - before`` zero taps in front and padding ``after`` read input
      ``stride * i + (t + after - before) - after``, the same positions, with as many outputs;
    - "slice": padding ``before + stride`` makes output ``i + 1`` what TF's output ``i`` is, so the first is dropped;
    - "mirror": on the input turned by 180 degrees TF's pads swap sides, so output ``j`` of the turned kernel with
      padding ``after`` reads what TF's output ``out - 1 - j`` reads (TF's pads sum to
      ``stride * (out - 1) + kernel - size``), with as many outputs since ``after - before < stride``.
    """
    before, after = _same_pads(size, kernel, stride)
    if form == MIRROR and after - before < stride:
        return PadPlan(None, after, 0, 0)
    if form == "pad" and (before or after):
        return PadPlan((before, after, before, after), 0, 0, 0)
    if before == after or form == "pad":
        return PadPlan(None, before, 0, 0)
    if form == "kernel":
        return PadPlan(None, after, after - before, 0)
    if form == "slice" and after <= before + stride:
        return PadPlan(None, before + stride, 0, 1)
    raise ValueError(f"padding form {form!r} cannot make the asymmetric pads ({before}, {after})")


def efficientnet_lite0(weights: dict[str, np.ndarray], layout: str | Lite0Layout = DEFAULT_LITE0_LAYOUT):
    """EfficientNet-Lite0 as a torch module (eval only, BatchNorm folded) from the checkpoint's arrays.

    ``layout``: how TF's "SAME" padding is computed (a ``LITE0_LAYOUTS`` name or a ``Lite0Layout``); all give the
    same logits, up to float rounding.
    """
    import torch  # noqa: PLC0415 - optional dependency
    from torch import nn

    if isinstance(layout, str):
        if layout not in LITE0_LAYOUTS:
            raise EngineError(f"unknown EfficientNet-Lite0 layout {layout!r}; use one of {', '.join(LITE0_LAYOUTS)}")
        layout = LITE0_LAYOUTS[layout]
    relu6 = nn.functional.relu6

    class ConvBN(nn.Module):
        """A conv with its BatchNorm folded, then ReLU6 (``act``). ``shift``: no bias; ReLU6's bounds shifted by it
        instead, the output short of it by ``shift_bias`` (``Lite0Layout.gemm``)."""

        def __init__(self, conv: str, bn: str, *, stride: int, size: int, groups: int = 1, act: bool = True,
                     form: str = "pad", shift: bool = False):
            super().__init__()
            w, b = _fold(weights, conv, bn)
            self.shift_bias = b if shift else None
            if layout.mirrored:
                form, w = MIRROR, np.ascontiguousarray(w[:, :, ::-1, ::-1])
            plan = pad_plan(size, w.shape[-1], stride, form)
            if plan.front_taps:
                w = np.pad(w, ((0, 0), (0, 0), (plan.front_taps, 0), (plan.front_taps, 0)))
            self.pad, self.drop = plan.pad, plan.drop
            self.conv = nn.Conv2d(w.shape[1] * groups, w.shape[0], w.shape[-1], stride=stride, padding=plan.padding,
                                  groups=groups, bias=not shift)
            with torch.no_grad():
                self.conv.weight.copy_(torch.from_numpy(w))
                if not shift:
                    self.conv.bias.copy_(torch.from_numpy(b))
            self.act = act
            if shift:
                if not act:
                    raise ValueError("a shifted bias needs the ReLU6 whose bounds it shifts")
                self.register_buffer("low", torch.from_numpy(-b).reshape(1, -1, 1, 1))
                self.register_buffer("high", torch.from_numpy(6 - b).reshape(1, -1, 1, 1))

        def forward(self, x):
            if self.pad is not None:
                x = nn.functional.pad(x, self.pad)
            x = self.conv(x)
            if self.shift_bias is not None:
                return x.clamp_(min=self.low, max=self.high)
            return relu6(x, inplace=layout.inplace) if self.act else x

    class Pointwise(nn.Module):
        """A 1x1 conv with its BatchNorm folded as GEMMs over the channels-last rows, the bias in their epilogue, then
        ReLU6 (``act``); ``shift``: the previous layer's ``shift_bias``, folded into the bias."""

        def __init__(self, conv: str, bn: str, *, act: bool, shift: np.ndarray | None = None):
            super().__init__()
            w, b = _fold(weights, conv, bn)
            w = w[:, :, 0, 0]
            if shift is not None:
                b = (b.astype(np.float64) + w.astype(np.float64) @ shift.astype(np.float64)).astype(np.float32)
            self.weight = nn.Parameter(torch.from_numpy(np.ascontiguousarray(w)), requires_grad=False)
            self.bias = nn.Parameter(torch.from_numpy(b), requires_grad=False)
            self.act = act

        def forward(self, x):
            n, c, h, w = x.shape
            rows = x.permute(0, 2, 3, 1).reshape(n * h * w, c)  # a view where x is channels-last
            out = torch.empty((rows.shape[0], self.weight.shape[0]), dtype=x.dtype, device=x.device)
            weight_t = self.weight.t()
            for start in range(0, rows.shape[0], GEMM_ROWS):
                end = start + GEMM_ROWS
                torch.addmm(self.bias, rows[start:end], weight_t, out=out[start:end])
            y = out.view(n, h, w, -1).permute(0, 3, 1, 2)  # NCHW, channels-last memory
            return relu6(y, inplace=True) if self.act else y

    def pointwise(conv: str, bn: str, *, size: int, act: bool, shift: np.ndarray | None = None):
        if layout.gemm:
            return Pointwise(conv, bn, act=act, shift=shift)
        return ConvBN(conv, bn, stride=1, size=size, act=act)

    class Block(nn.Module):
        def __init__(self, p: str, *, stride: int, expand: int, cin: int, cout: int, size: int):
            super().__init__()
            layers = []
            if expand != 1:
                layers.append(pointwise(f"{p}._expand_conv", f"{p}._bn0", size=size, act=True))
            form = layout.symmetric if stride == 1 else layout.asymmetric
            depthwise = ConvBN(f"{p}._depthwise_conv", f"{p}._bn1", stride=stride, size=size, groups=cin * expand,
                               form=form, shift=layout.gemm)
            layers.append(depthwise)
            layers.append(pointwise(f"{p}._project_conv", f"{p}._bn2", size=-(-size // stride), act=False,
                                    shift=depthwise.shift_bias))
            self.body = nn.Sequential(*layers)
            self.drop, self.out_size = depthwise.drop, -(-size // stride)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.body(x)
            if self.drop:  # the projection is pointwise, so the extra front row and column can go after it
                keep = y.is_contiguous(memory_format=torch.channels_last)
                y = y[:, :, self.drop : self.drop + self.out_size, self.drop : self.drop + self.out_size]
                y = y.contiguous(memory_format=torch.channels_last if keep else torch.contiguous_format)
            return y + x if self.residual else y

    class Lite0(nn.Module):
        def __init__(self):
            super().__init__()
            self.layout = layout
            size = IMAGE_SIZE
            self.stem = ConvBN("_conv_stem", "_bn0", stride=2, size=size, form=layout.stem)
            size = -(-size // 2)
            blocks, index = [], 0
            for repeats, _kernel, stride, expand, in_f, out_f in LITE0_BLOCKS:
                for r in range(repeats):
                    s = stride if r == 0 else 1
                    cin = in_f if r == 0 else out_f
                    blocks.append(Block(f"_blocks.{index}", stride=s, expand=expand, cin=cin, cout=out_f, size=size))
                    size = -(-size // s)
                    index += 1
            self.blocks = nn.Sequential(*blocks)
            self.head = pointwise("_conv_head", "_bn1", size=size, act=True)
            fc_w = weights["_fc.weight"]
            if fc_w.shape[1] != HEAD_CHANNELS:
                raise ModelError(
                    f"the checkpoint's classifier takes {fc_w.shape[1]} features, expected {HEAD_CHANNELS}"
                )
            self.fc = nn.Linear(HEAD_CHANNELS, fc_w.shape[0])
            with torch.no_grad():
                self.fc.weight.copy_(torch.from_numpy(fc_w.astype(np.float32)))
                self.fc.bias.copy_(torch.from_numpy(weights["_fc.bias"].astype(np.float32)))

        def forward(self, x):
            if layout.mirrored:  # one copy of the 3-channel input in place of every pad
                x = x.flip(2, 3)
            x = self.head(self.blocks(self.stem(x)))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    try:
        return Lite0().eval()
    except KeyError as e:
        raise ModelError(f"the checkpoint lacks tensor {e}; is it an EfficientNet-Lite0 checkpoint?") from None


def resnet50_random(num_classes: int = 1000, seed: int = 0):
    """torchvision's ResNet-50 with random weights (seeded): the benchmark's reference network, not a classifier."""
    import torch  # noqa: PLC0415
    from torchvision.models import resnet50  # noqa: PLC0415

    torch.manual_seed(seed)
    return resnet50(weights=None, num_classes=num_classes).eval()


def load_network(bundle, network: str | None = None):
    """The torch network for a model bundle.

    ``network``: None picks by the bundle: the folder's ``model.torchscript`` where it has one, the default model's
    hand-tuned layout, else the folder's ``model.onnx`` converted to torch (``pipeline.gpu.onnx_torch``);
    "resnet50" gives a random-weight ResNet-50 for benchmarks, a ``LITE0_LAYOUTS`` name the default model in that
    layout.

    Raises:
        EngineError: torch, or the converter, is not installed (with what to do instead).
        ModelError: the converter cannot convert the model's graph (the operator, and ``--engine onnx``).
    """
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise EngineError("the gpu engine needs PyTorch; install torch or use --engine onnx") from None
    if network == "resnet50":
        return resnet50_random(len(bundle.labels) or 1000)
    if network in LITE0_LAYOUTS and is_builtin(bundle):  # the default model in another layout (benchmarks)
        return efficientnet_lite0(load_checkpoint(), network)
    if network not in (None, "", "auto", "default"):
        raise EngineError(f"unknown network {network!r}; leave it unset, or use one of "
                          f"{', '.join((*BENCHMARK_NETWORKS, *LITE0_LAYOUTS))}")
    onnx_path = Path(bundle.onnx_path) if getattr(bundle, "onnx_path", None) else None
    scripted = onnx_path.parent / TORCHSCRIPT_FILE if onnx_path else None
    if scripted is not None and scripted.is_file():
        LOG.info("loading TorchScript network %s", scripted)
        return torch.jit.load(str(scripted), map_location="cpu").eval()
    if is_builtin(bundle):  # by digest: a fine-tuned Lite0 in a folder of that name is a user's model
        return efficientnet_lite0(load_checkpoint())
    if onnx_path is None or not onnx_path.is_file():
        raise EngineError(f"model {bundle.name!r} has no {MODEL_FILE} for the GPU paths to convert; pass its folder")
    try:
        from pipeline.gpu.onnx_torch import convert_onnx  # noqa: PLC0415 - onnx2torch: the gpu extra
    except ImportError:
        raise EngineError(CONVERTER_MISSING) from None
    started = time.perf_counter()
    network = convert_onnx(onnx_path)
    LOG.info("converted %s to torch in %.1f s", onnx_path, time.perf_counter() - started)
    return network


def check_runnable(bundle, engine: str) -> None:
    """In the driver, before anything is written: ModelError in one line where the gpu paths cannot run ``bundle``
    (``engine`` names the choice in the message): a layout other than NCHW, or an operator of its ``model.onnx`` that
    the ONNX-to-torch converter lacks (the built-in model and a folder's ``model.torchscript`` are not converted).

    Raises:
        ConfigError: the converter is not installed here.
    """
    onnx_path = Path(bundle.onnx_path) if getattr(bundle, "onnx_path", None) else None
    if bundle.spec.layout != "NCHW":
        raise ModelError(f"{engine} feeds NCHW networks and {bundle.name!r} is {bundle.spec.layout}; run it with "
                         "--engine onnx")
    if is_builtin(bundle) or (onnx_path is not None and (onnx_path.parent / TORCHSCRIPT_FILE).is_file()):
        return
    try:
        from pipeline.gpu.onnx_torch import check_convertible  # noqa: PLC0415 - onnx2torch: the gpu extra
    except ImportError:
        raise ConfigError(CONVERTER_MISSING) from None
    check_convertible(bundle)
