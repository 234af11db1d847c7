"""EfficientNet-Lite0 as torch modules built from the default checkpoint's arrays: the folded conv (``ConvBN``), the
1x1 conv as a GEMM (``Pointwise``), the inverted-residual ``Block`` and the whole ``Lite0``, each laid out as a
``Lite0Layout`` says (``pipeline.gpu.lite0_layout``). Imports torch: reached through
``pipeline.gpu.networks.efficientnet_lite0``."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pipeline.model.default_model import HEAD_CHANNELS, IMAGE_SIZE, LITE0_BLOCKS
from pipeline.gpu.lite0_layout import GEMM_ROWS, MIRROR, Lite0Layout, fold_bn, pad_plan
from pipeline.errors import ModelError

relu6 = nn.functional.relu6


class ConvBN(nn.Module):
    """A conv with its BatchNorm folded, then ReLU6 (``act``). ``shift``: no bias; ReLU6's bounds shifted by it
    instead, the output short of it by ``shift_bias`` (``Lite0Layout.gemm``)."""

    def __init__(self, weights: dict[str, np.ndarray], layout: Lite0Layout, conv: str, bn: str, *, stride: int,
                 size: int, groups: int = 1, act: bool = True, form: str = "pad", shift: bool = False):
        super().__init__()
        w, b = fold_bn(weights, conv, bn)
        self.shift_bias = b if shift else None
        if layout.mirrored:
            form, w = MIRROR, np.ascontiguousarray(w[:, :, ::-1, ::-1])
        plan = pad_plan(size, w.shape[-1], stride, form)
        if plan.front_taps:
            w = np.pad(w, ((0, 0), (0, 0), (plan.front_taps, 0), (plan.front_taps, 0)))
        self.pad, self.drop, self.inplace = plan.pad, plan.drop, layout.inplace
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
        return relu6(x, inplace=self.inplace) if self.act else x


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


def pointwise(weights: dict[str, np.ndarray], layout: Lite0Layout, conv: str, bn: str, *, size: int, act: bool,
              shift: np.ndarray | None = None) -> nn.Module:
    """A 1x1 conv as the layout computes it: a GEMM (``gemm``) or a folded conv."""
    if layout.gemm:
        return Pointwise(weights, conv, bn, act=act, shift=shift)
    return ConvBN(weights, layout, conv, bn, stride=1, size=size, act=act)


class Block(nn.Module):
    """One inverted-residual block: the 1x1 expansion (unless ``expand`` is 1), the depthwise conv, the 1x1
    projection, and the residual where the shape stays."""

    def __init__(self, weights: dict[str, np.ndarray], layout: Lite0Layout, p: str, *, stride: int, expand: int,
                 cin: int, cout: int, size: int):
        super().__init__()
        layers = []
        if expand != 1:
            layers.append(pointwise(weights, layout, f"{p}._expand_conv", f"{p}._bn0", size=size, act=True))
        form = layout.symmetric if stride == 1 else layout.asymmetric
        depthwise = ConvBN(weights, layout, f"{p}._depthwise_conv", f"{p}._bn1", stride=stride, size=size,
                           groups=cin * expand, form=form, shift=layout.gemm)
        layers.append(depthwise)
        layers.append(pointwise(weights, layout, f"{p}._project_conv", f"{p}._bn2", size=-(-size // stride),
                                act=False, shift=depthwise.shift_bias))
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
    """The stem, the 16 blocks of ``LITE0_BLOCKS``, the head and the classifier, at 224 px.

    Raises:
        KeyError: the checkpoint lacks a tensor.
        ModelError: the checkpoint's classifier does not take HEAD_CHANNELS features.
    """

    def __init__(self, weights: dict[str, np.ndarray], layout: Lite0Layout):
        super().__init__()
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
        self.head = pointwise(weights, layout, "_conv_head", "_bn1", size=size, act=True)
        fc_w = weights["_fc.weight"]
        if fc_w.shape[1] != HEAD_CHANNELS:
            raise ModelError(f"the checkpoint's classifier takes {fc_w.shape[1]} features, expected {HEAD_CHANNELS}")
        self.fc = nn.Linear(HEAD_CHANNELS, fc_w.shape[0])
        with torch.no_grad():
            self.fc.weight.copy_(torch.from_numpy(fc_w.astype(np.float32)))
            self.fc.bias.copy_(torch.from_numpy(weights["_fc.bias"].astype(np.float32)))

    def forward(self, x):
        if self.layout.mirrored:  # one copy of the 3-channel input in place of every pad
            x = x.flip(2, 3)
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
