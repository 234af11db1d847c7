"""How the torch EfficientNet-Lite0 computes the checkpoint's TF "SAME" padding (``Lite0Layout``, the named
``LITE0_LAYOUTS``), each conv's padding plan, and the BatchNorm folded into a conv's weights; torch-free."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.model.default_model import BN_EPS, _same_pads

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


def fold_bn(weights: dict[str, np.ndarray], conv: str, bn: str) -> tuple[np.ndarray, np.ndarray]:
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
