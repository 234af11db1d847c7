"""Torch networks for the gpu engine: EfficientNet-Lite0 from the default checkpoint, TorchScript folders, ResNet-50.

The default model is rebuilt here as a plain torch module from the same checkpoint arrays that
``pipeline.default_model`` turns into ONNX (BatchNorm folded the same way, TF "SAME" padding for 224 px), so the
GPU and the ONNX reference compute the same function; the ``efficientnet-lite-pytorch`` package's code is not used.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from pipeline.default_model import BN_EPS, HEAD_CHANNELS, IMAGE_SIZE, LITE0_BLOCKS, MODEL_NAME, load_checkpoint
from pipeline.errors import EngineError, ModelError
from pipeline.model import TORCHSCRIPT_FILE

log = logging.getLogger(__name__)

BENCHMARK_NETWORKS = ("resnet50",)


def _same_pads(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF 'SAME' padding (before, after) for a static input size, as the checkpoint's training used."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _fold(weights: dict[str, np.ndarray], conv: str, bn: str) -> tuple[np.ndarray, np.ndarray]:
    """Conv weight and bias with the following BatchNorm folded in (float64 maths, float32 result)."""
    w = weights[f"{conv}.weight"].astype(np.float64)
    gamma, beta = weights[f"{bn}.weight"].astype(np.float64), weights[f"{bn}.bias"].astype(np.float64)
    mean, var = weights[f"{bn}.running_mean"].astype(np.float64), weights[f"{bn}.running_var"].astype(np.float64)
    factor = gamma / np.sqrt(var + BN_EPS)
    return (w * factor[:, None, None, None]).astype(np.float32), (beta - mean * factor).astype(np.float32)


def efficientnet_lite0(weights: dict[str, np.ndarray]):
    """EfficientNet-Lite0 as a torch module (eval only, BatchNorm folded) from the checkpoint's arrays."""
    import torch  # noqa: PLC0415 - optional dependency
    from torch import nn

    class ConvBN(nn.Module):
        def __init__(self, conv: str, bn: str, *, stride: int, size: int, groups: int = 1, relu6: bool = True):
            super().__init__()
            w, b = _fold(weights, conv, bn)
            k = w.shape[-1]
            before, after = _same_pads(size, k, stride)
            self.pad = (before, after, before, after)
            self.conv = nn.Conv2d(w.shape[1] * groups, w.shape[0], k, stride=stride, groups=groups, bias=True)
            with torch.no_grad():
                self.conv.weight.copy_(torch.from_numpy(w))
                self.conv.bias.copy_(torch.from_numpy(b))
            self.relu6 = relu6

        def forward(self, x):
            if any(self.pad):
                x = nn.functional.pad(x, self.pad)
            x = self.conv(x)
            return nn.functional.relu6(x) if self.relu6 else x

    class Block(nn.Module):
        def __init__(self, p: str, *, kernel: int, stride: int, expand: int, cin: int, cout: int, size: int):
            super().__init__()
            layers = []
            if expand != 1:
                layers.append(ConvBN(f"{p}._expand_conv", f"{p}._bn0", stride=1, size=size))
            layers.append(ConvBN(f"{p}._depthwise_conv", f"{p}._bn1", stride=stride, size=size, groups=cin * expand))
            layers.append(ConvBN(f"{p}._project_conv", f"{p}._bn2", stride=1, size=-(-size // stride), relu6=False))
            self.body = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.body(x)
            return y + x if self.residual else y

    class Lite0(nn.Module):
        def __init__(self):
            super().__init__()
            size = IMAGE_SIZE
            self.stem = ConvBN("_conv_stem", "_bn0", stride=2, size=size)
            size = -(-size // 2)
            blocks, index = [], 0
            for repeats, kernel, stride, expand, in_f, out_f in LITE0_BLOCKS:
                for r in range(repeats):
                    s = stride if r == 0 else 1
                    cin = in_f if r == 0 else out_f
                    blocks.append(
                        Block(f"_blocks.{index}", kernel=kernel, stride=s, expand=expand, cin=cin, cout=out_f,
                              size=size)
                    )
                    size = -(-size // s)
                    index += 1
            self.blocks = nn.Sequential(*blocks)
            self.head = ConvBN("_conv_head", "_bn1", stride=1, size=size)
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

    ``network``: None picks by the bundle (the default model, or the folder's ``model.torchscript``);
    "resnet50" gives a random-weight ResNet-50 for benchmarks.

    Raises:
        EngineError: the model has no torch form the gpu engine can run (with what to do instead).
    """
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise EngineError("the gpu engine needs PyTorch; install torch or use --engine onnx") from None
    if network == "resnet50":
        return resnet50_random(len(bundle.labels) or 1000)
    if network not in (None, "", "auto", "default"):
        raise EngineError(f"unknown network {network!r}; leave it unset, or use one of {', '.join(BENCHMARK_NETWORKS)}")
    onnx_path = Path(bundle.onnx_path) if getattr(bundle, "onnx_path", None) else None
    scripted = onnx_path.parent / TORCHSCRIPT_FILE if onnx_path else None
    if scripted is not None and scripted.is_file():
        log.info("loading TorchScript network %s", scripted)
        return torch.jit.load(str(scripted), map_location="cpu").eval()
    if bundle.name == MODEL_NAME:
        return efficientnet_lite0(load_checkpoint())
    raise EngineError(
        f"model {bundle.name!r} has no network the gpu engine can run: it runs the default model, or a model folder "
        f"that also holds {TORCHSCRIPT_FILE} (torch.jit.save of the same network, NCHW float input). "
        "For an ONNX-only model use --engine triton (TensorRT on the GPU) or --engine onnx"
    )
