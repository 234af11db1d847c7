"""The precision gate of the GPU paths: FP16 unless its answers disagree with FP32's on a fixed sample.

FP16 halves the network's time on the GPU, and for most classifiers it changes no answer (docs/performance.md);
a network whose activations overflow FP16, or whose logits move enough to change classes, runs in FP32 instead,
and the classifier says so once. The engine option ``half`` skips the gate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from pipeline.gpu.topk_network import split_outputs
from pipeline.model.imaging import preprocess_image

# FP16 is kept when, on GATE_IMAGES sample images, its logits are within GATE_REL_L2 of FP32's
# (||fp16 - fp32|| / ||fp32||) and every top-1 class whose FP32 margin over the second is at least GATE_NEAR_TIE
# (in probability) is the same. GATE_REL_L2 is measured: EfficientNet-Lite2 at 4.6e-3 on this sample flips 4 of 200
# photos' top-1 in FP16 (near-ties, none in FP32), while ResNet-50, ConvNeXt-T and ViT-B/16 sit at 3e-4..1.3e-3
# (docs/performance.md, "A user's model on the GPU"). The near-tie rule can only vouch for FP16 where FP32 decides
# the sample: a network deciding fewer than GATE_MIN_DECIDED of its images (random weights, an undertrained model:
# convnext_tiny at random decides none, and FP16 moved 3 of 200 photos' top-1 where FP32 moved 1; trained Lite0 and
# Lite2 decide 14 and 15 of 16) runs in FP32.
GATE_IMAGES = 16
GATE_MIN_DECIDED = GATE_IMAGES // 2
GATE_REL_L2 = 0.003
GATE_NEAR_TIE = 0.01
GATE_SEED = 44


@dataclass(frozen=True)
class GateResult:
    """The precision gate's measurements on the sample: FP16 against FP32 logits."""

    half: bool
    rel_l2: float
    top1_differ: int  # images whose top-1 differs while FP32's margin is no near-tie
    images: int
    decided: int  # images whose FP32 top-1 leads the second by GATE_NEAR_TIE or more

    def describe(self) -> str:
        return (f"FP16 logits differ from FP32 by {self.rel_l2:.2e} (relative L2; the gate is {GATE_REL_L2}) and "
                f"{self.top1_differ} of {self.images} sample images change their top-1 class; FP32 decides "
                f"{self.decided} of them (the gate needs {GATE_MIN_DECIDED})")


def gate_sample(spec, images: int = GATE_IMAGES, seed: int = GATE_SEED) -> np.ndarray:
    """Fixed sample images (smooth colour fields with edges, seeded), preprocessed by the reference: float32 NCHW."""
    from PIL import Image  # noqa: PLC0415


    rng = np.random.default_rng(seed)
    out = []
    for _ in range(images):
        coarse = rng.integers(0, 256, size=(rng.integers(2, 9), rng.integers(2, 9), 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((320, 240), Image.Resampling.BICUBIC)
        arr = np.asarray(img).copy()
        y, x = rng.integers(0, 200), rng.integers(0, 280)
        arr[y : y + 40, x : x + 40] = rng.integers(0, 256, size=3, dtype=np.uint8)  # a hard edge or two
        out.append(preprocess_image(Image.fromarray(arr), spec))
    return np.stack(out).astype(np.float32)


def choose_half(network, spec, device) -> GateResult:
    """The precision gate: runs ``network`` in FP32 and in FP16 on ``device`` over ``gate_sample(spec)`` and keeps
    FP16 unless the answers disagree (``GATE_REL_L2``, ``GATE_NEAR_TIE``) or FP32 decides too few of them to tell
    (``GATE_MIN_DECIDED``); non-finite FP16 logits fail it. A network that returns an embedding beside its logits
    (``split_outputs``) keeps FP16 only where its FP16 embedding is finite and within ``GATE_REL_L2`` of FP32's too,
    which ``rel_l2`` then reports where it is the larger."""
    import torch  # noqa: PLC0415 - optional dependency, present where the GPU paths run

    x = torch.from_numpy(gate_sample(spec)).to(device)
    with torch.inference_mode():
        net = copy.deepcopy(network).eval().to(device).float()
        ref, ref_features = split_outputs(net(x))
        ref = ref.float()
        ref_features = None if ref_features is None else ref_features.float().reshape(len(ref), -1)
        half, half_features = split_outputs(net.half()(x.half()))
        half = half.float()
        half_features = None if half_features is None else half_features.float().reshape(len(half), -1)
    del net
    probs = ref.softmax(-1)
    top2 = probs.topk(min(2, probs.shape[-1]), dim=-1).values
    margin = top2[:, 0] - top2[:, -1] if top2.shape[-1] > 1 else torch.ones_like(top2[:, 0])
    decided = margin >= GATE_NEAR_TIE
    differ = int(((ref.argmax(-1) != half.argmax(-1)) & decided).sum())
    finite = bool(torch.isfinite(half).all())
    rel = float((half - ref).norm() / ref.norm().clamp_min(1e-12)) if finite else float("inf")
    if ref_features is not None and half_features is not None:
        finite = finite and bool(torch.isfinite(half_features).all())
        rel = max(rel, float((half_features - ref_features).norm() / ref_features.norm().clamp_min(1e-12))
                  if finite else float("inf"))
    n_decided = int(decided.sum())
    return GateResult(half=finite and rel <= GATE_REL_L2 and differ == 0 and n_decided >= GATE_MIN_DECIDED,
                      rel_l2=rel, top1_differ=differ, images=x.shape[0], decided=n_decided)
