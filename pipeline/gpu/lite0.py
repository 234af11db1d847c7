"""EfficientNet-Lite0 as torch modules built from the default checkpoint's arrays, in the layout the GPU paths run:
the folded conv (``ConvBN``), the 1x1 conv as a GEMM (``Pointwise``), the inverted-residual ``Block`` and the whole
``Lite0``. Imports torch: reached through ``pipeline.gpu.networks.efficientnet_lite0``.

The checkpoint's convs use TF's "SAME" padding, larger behind than in front at stride 2. The whole network runs on the
image turned by 180 degrees, with every kernel turned too: there the larger pad is in front, and the conv's own
symmetric padding of that size reads the same pixels, so one flip of the input replaces every pad kernel.

The folded BatchNorm biases cost a pass of their own over each conv's output on the GPU, the largest share of the
network's GPU time (docs/performance.md). So the 1x1 convs run as GEMMs over the channels-last rows with their bias in
the GEMM's epilogue, and the depthwise convs have no bias: ReLU6's bounds are shifted by it instead,
relu6(z + b) - b = clamp(z, -b, 6 - b), and the "- b" is folded into the next 1x1 projection's bias
(W (v + b) = W v + W b; exact, as the projection reads no padding). The other ways of computing the padding, measured
against this one, are the benchmarks' (tests/benchmarks/lite0_layouts.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pipeline.errors import ModelError
from pipeline.model.default_model import BN_EPS, HEAD_CHANNELS, IMAGE_SIZE, LITE0_BLOCKS, _same_pads

relu6 = nn.functional.relu6
# Rows of one GEMM: torch adds the bias in cuBLASLt's epilogue only below 65535 * 32 rows (larger GEMMs are cut).
GEMM_ROWS = 65535 * 32 - 1


def fold_bn(weights: dict[str, np.ndarray], conv: str, bn: str) -> tuple[np.ndarray, np.ndarray]:
    """Conv weight and bias with the following BatchNorm folded in (float64 maths, float32 result)."""
    w = weights[f"{conv}.weight"].astype(np.float64)
    gamma, beta = weights[f"{bn}.weight"].astype(np.float64), weights[f"{bn}.bias"].astype(np.float64)
    mean, var = weights[f"{bn}.running_mean"].astype(np.float64), weights[f"{bn}.running_var"].astype(np.float64)
    factor = gamma / np.sqrt(var + BN_EPS)
    return (w * factor[:, None, None, None]).astype(np.float32), (beta - mean * factor).astype(np.float32)


class ConvBN(nn.Module):
    """A conv with its BatchNorm folded and its kernel turned, on the turned input, then ReLU6 (``act``).
    ``shift``: no bias; ReLU6's bounds shifted by it instead, the output short of it by ``shift_bias``."""

    def __init__(self, weights: dict[str, np.ndarray], conv: str, bn: str, *, stride: int, size: int,
                 groups: int = 1, act: bool = True, shift: bool = False):
        super().__init__()
        w, b = fold_bn(weights, conv, bn)
        self.shift_bias = b if shift else None
        w = np.ascontiguousarray(w[:, :, ::-1, ::-1])
        # On the turned input TF's pads swap sides: the larger one ("after") is in front, and the conv's own padding
        # of that size gives TF's outputs, turned, with as many of them (TF's pads differ by less than the stride).
        _, after = _same_pads(size, w.shape[-1], stride)
        self.conv = nn.Conv2d(w.shape[1] * groups, w.shape[0], w.shape[-1], stride=stride, padding=after,
                              groups=groups, bias=not shift)
        with torch.no_grad():
            self.conv.weight.copy_(torch.from_numpy(w))
            if not shift:
                self.conv.bias.copy_(torch.from_numpy(b))
        self.act = act
        if shift:
            self.register_buffer("low", torch.from_numpy(-b).reshape(1, -1, 1, 1))
            self.register_buffer("high", torch.from_numpy(6 - b).reshape(1, -1, 1, 1))

    def forward(self, x):
        x = self.conv(x)
        if self.shift_bias is not None:
            return x.clamp_(min=self.low, max=self.high)
        return relu6(x, inplace=True) if self.act else x


class Pointwise(nn.Module):
    """A 1x1 conv with its BatchNorm folded as GEMMs over the channels-last rows, the bias in their epilogue, then
    ReLU6 (``act``); ``shift``: the previous layer's ``shift_bias``, folded into the bias."""

    def __init__(self, weights: dict[str, np.ndarray], conv: str, bn: str, *, act: bool,
                 shift: np.ndarray | None = None):
        super().__init__()
        w, b = fold_bn(weights, conv, bn)
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


class Block(nn.Module):
    """One inverted-residual block: the 1x1 expansion (unless ``expand`` is 1), the depthwise conv, the 1x1
    projection, and the residual where the shape stays."""

    def __init__(self, weights: dict[str, np.ndarray], p: str, *, stride: int, expand: int, cin: int, cout: int,
                 size: int):
        super().__init__()
        layers = []
        if expand != 1:
            layers.append(Pointwise(weights, f"{p}._expand_conv", f"{p}._bn0", act=True))
        depthwise = ConvBN(weights, f"{p}._depthwise_conv", f"{p}._bn1", stride=stride, size=size,
                           groups=cin * expand, shift=True)
        layers.append(depthwise)
        layers.append(Pointwise(weights, f"{p}._project_conv", f"{p}._bn2", act=False, shift=depthwise.shift_bias))
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.body(x)
        return y + x if self.residual else y


def classifier(weights: dict) -> nn.Linear:
    """The checkpoint's final linear layer (``_fc``), checked against the head's width."""
    fc_w = weights["_fc.weight"]
    if fc_w.shape[1] != HEAD_CHANNELS:
        raise ModelError(f"the checkpoint's classifier takes {fc_w.shape[1]} features, expected {HEAD_CHANNELS}")
    fc = nn.Linear(HEAD_CHANNELS, fc_w.shape[0])
    with torch.no_grad():
        fc.weight.copy_(torch.from_numpy(fc_w.astype(np.float32)))
        fc.bias.copy_(torch.from_numpy(weights["_fc.bias"].astype(np.float32)))
    return fc


class Lite0(nn.Module):
    """The stem, the 16 blocks of ``LITE0_BLOCKS``, the head and the classifier, at 224 px.

    Raises:
        KeyError: the checkpoint lacks a tensor.
        ModelError: the checkpoint's classifier does not take HEAD_CHANNELS features.
    """

    def __init__(self, weights: dict[str, np.ndarray]):
        super().__init__()
        size = IMAGE_SIZE
        self.stem = ConvBN(weights, "_conv_stem", "_bn0", stride=2, size=size)
        size = -(-size // 2)
        blocks, index = [], 0
        for repeats, _kernel, stride, expand, in_f, out_f in LITE0_BLOCKS:
            for r in range(repeats):
                s = stride if r == 0 else 1
                cin = in_f if r == 0 else out_f
                blocks.append(Block(weights, f"_blocks.{index}", stride=s, expand=expand, cin=cin, cout=out_f,
                                    size=size))
                size = -(-size // s)
                index += 1
        self.blocks = nn.Sequential(*blocks)
        self.head = Pointwise(weights, "_conv_head", "_bn1", act=True)
        self.fc = classifier(weights)

    def forward(self, x):
        x = x.flip(2, 3)  # one copy of the 3-channel input in place of every pad
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
