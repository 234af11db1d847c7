"""The default network in other layouts: how the torch EfficientNet-Lite0 computes the checkpoint's TF "SAME" padding
(``Lite0Layout``, the named ``LITE0_LAYOUTS``), each conv's padding plan (``pad_plan``) and the modules that follow a
layout (``LayoutLite0``), for bench_network.py, device/probe_kernels.py and gpu_networks.py to measure against the
library's ``Lite0`` (``pipeline.gpu.lite0``), which is ``DEFAULT_LITE0_LAYOUT``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.errors import EngineError, ModelError  # noqa: E402
from pipeline.gpu.lite0 import classifier, fold_bn  # noqa: E402
from pipeline.model.default_model import IMAGE_SIZE, LITE0_BLOCKS, _same_pads  # noqa: E402

relu6 = nn.functional.relu6

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

    ``gemm`` changes where the folded BatchNorm biases are added, not the padding: the library's ``Lite0``
    (``pipeline.gpu.lite0``) is "mirror" with ``gemm``, and ``layout_network`` builds that layout with it.

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
DEFAULT_LITE0_LAYOUT = "mirror_gemm"  # pipeline.gpu.lite0.Lite0, the layout the GPU paths run
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


class ConvBN(nn.Module):
    """A conv with its BatchNorm folded, then ReLU6 (``act``), its padding as ``layout`` computes it."""

    def __init__(self, weights: dict[str, np.ndarray], layout: Lite0Layout, conv: str, bn: str, *, stride: int,
                 size: int, groups: int = 1, act: bool = True, form: str = "pad"):
        super().__init__()
        w, b = fold_bn(weights, conv, bn)
        if layout.mirrored:
            form, w = MIRROR, np.ascontiguousarray(w[:, :, ::-1, ::-1])
        plan = pad_plan(size, w.shape[-1], stride, form)
        if plan.front_taps:
            w = np.pad(w, ((0, 0), (0, 0), (plan.front_taps, 0), (plan.front_taps, 0)))
        self.pad, self.drop, self.inplace = plan.pad, plan.drop, layout.inplace
        self.conv = nn.Conv2d(w.shape[1] * groups, w.shape[0], w.shape[-1], stride=stride, padding=plan.padding,
                              groups=groups)
        with torch.no_grad():
            self.conv.weight.copy_(torch.from_numpy(w))
            self.conv.bias.copy_(torch.from_numpy(b))
        self.act = act

    def forward(self, x):
        if self.pad is not None:
            x = nn.functional.pad(x, self.pad)
        x = self.conv(x)
        return relu6(x, inplace=self.inplace) if self.act else x


class Block(nn.Module):
    """One inverted-residual block: the 1x1 expansion (unless ``expand`` is 1), the depthwise conv, the 1x1
    projection, and the residual where the shape stays."""

    def __init__(self, weights: dict[str, np.ndarray], layout: Lite0Layout, p: str, *, stride: int, expand: int,
                 cin: int, cout: int, size: int):
        super().__init__()
        layers = []
        if expand != 1:
            layers.append(ConvBN(weights, layout, f"{p}._expand_conv", f"{p}._bn0", stride=1, size=size))
        form = layout.symmetric if stride == 1 else layout.asymmetric
        depthwise = ConvBN(weights, layout, f"{p}._depthwise_conv", f"{p}._bn1", stride=stride, size=size,
                           groups=cin * expand, form=form)
        layers.append(depthwise)
        layers.append(ConvBN(weights, layout, f"{p}._project_conv", f"{p}._bn2", stride=1, size=-(-size // stride),
                             act=False))
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


class LayoutLite0(nn.Module):
    """The stem, the 16 blocks of ``LITE0_BLOCKS``, the head and the classifier, at 224 px, in ``layout``.

    Raises:
        KeyError: the checkpoint lacks a tensor.
        ModelError: the checkpoint's classifier does not take HEAD_CHANNELS features.
    """

    def __init__(self, weights: dict[str, np.ndarray], layout: Lite0Layout):
        super().__init__()
        if layout.gemm:
            raise ValueError("the gemm layout is the library's Lite0 (pipeline.gpu.lite0): use layout_network")
        self.layout = layout
        size = IMAGE_SIZE
        self.stem = ConvBN(weights, layout, "_conv_stem", "_bn0", stride=2, size=size, form=layout.stem)
        size = -(-size // 2)
        blocks, index = [], 0
        for repeats, _kernel, stride, expand, in_f, out_f in LITE0_BLOCKS:
            for r in range(repeats):
                s = stride if r == 0 else 1
                cin = in_f if r == 0 else out_f
                blocks.append(Block(weights, layout, f"_blocks.{index}", stride=s, expand=expand, cin=cin, cout=out_f,
                                    size=size))
                size = -(-size // s)
                index += 1
        self.blocks = nn.Sequential(*blocks)
        self.head = ConvBN(weights, layout, "_conv_head", "_bn1", stride=1, size=size)
        self.fc = classifier(weights)

    def forward(self, x):
        if self.layout.mirrored:  # one copy of the 3-channel input in place of every pad
            x = x.flip(2, 3)
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def layout_network(weights: dict[str, np.ndarray], layout: str | Lite0Layout):
    """EfficientNet-Lite0 from the checkpoint's arrays in ``layout`` (a ``LITE0_LAYOUTS`` name or a ``Lite0Layout``),
    eval only; ``DEFAULT_LITE0_LAYOUT`` is the library's ``Lite0``. Every layout gives the same logits, up to float
    rounding."""
    from pipeline.gpu.networks import efficientnet_lite0

    if isinstance(layout, str):
        if layout not in LITE0_LAYOUTS:
            raise EngineError(f"unknown EfficientNet-Lite0 layout {layout!r}; use one of {', '.join(LITE0_LAYOUTS)}")
        layout = LITE0_LAYOUTS[layout]
    if layout == LITE0_LAYOUTS[DEFAULT_LITE0_LAYOUT]:
        return efficientnet_lite0(weights)
    try:
        return LayoutLite0(weights, layout).eval()
    except KeyError as e:
        raise ModelError(f"the checkpoint lacks tensor {e}; is it an EfficientNet-Lite0 checkpoint?") from None
