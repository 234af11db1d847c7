"""What the precision gate sees of a timm ResNet-50 at random weights (seed 0), with its classifier's weights scaled.

    python tests/benchmarks/gate_decided.py [--scales 1,200]

Per scale of the ``fc`` weights (bias zero where scaled), on the gate's 16 sample images (``gate_sample``) on this
machine's CPU: how many FP32 decides (top-1 ahead of the second by ``GATE_NEAR_TIE`` or more; the gate needs
``GATE_MIN_DECIDED``), FP16's relative L2 to FP32 (torch's CPU half kernels, not the GPU's) and the decided images
whose top-1 FP16 changes. The device kit's ``r50d``/``r50demb`` folders are the x200 network (gpu_answers.sh).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.gpu.precision import GATE_MIN_DECIDED, GATE_NEAR_TIE, GATE_REL_L2, gate_sample  # noqa: E402
from pipeline.model.spec import PreprocessSpec  # noqa: E402

TIMM_RESNET50 = {"resize_shorter": 235, "interpolation": "bicubic", "antialias": True, "crop": [224, 224],
                 "channel_order": "RGB", "scale": 1 / 255, "mean": [0.485, 0.456, 0.406],
                 "std": [0.229, 0.224, 0.225], "layout": "NCHW"}


def main() -> None:
    import timm
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scales", default="1,200")
    args = p.parse_args()
    x = torch.from_numpy(gate_sample(PreprocessSpec.from_dict(TIMM_RESNET50)))
    print(f"scale  decided (of {len(x)}, gate needs {GATE_MIN_DECIDED})  FP16 rel L2 (gate {GATE_REL_L2})  "
          "decided top-1 changed")
    for scale in (float(s) for s in args.scales.split(",")):
        torch.manual_seed(0)
        net = timm.create_model("resnet50").eval()
        with torch.no_grad():
            if scale != 1:
                net.fc.weight.mul_(scale)
                net.fc.bias.zero_()
            ref = net(x)
            half = copy.deepcopy(net).half()(x.half()).float()
        top2 = ref.softmax(-1).topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) >= GATE_NEAR_TIE
        rel = float((half - ref).norm() / ref.norm())
        changed = int(((ref.argmax(-1) != half.argmax(-1)) & decided).sum())
        print(f"{scale:>5g}  {int(decided.sum()):>7}  {rel:>10.2e}  {changed:>5}")


if __name__ == "__main__":
    main()
