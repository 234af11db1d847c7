"""The INT8 gate's maths: INT8 against FP32 on the same held-out images, overall, on decisive images, per class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from pipeline.errors import ConfigError

WORST_CLASSES = 5  # classes the report and the failure line list, lowest agreement first


@dataclass(frozen=True, kw_only=True)
class GateThresholds:
    """What the held-out images must show for an INT8 model to be written.

    Attributes:
        decisive_margin: an image is decisive when FP32's top-1 probability leads its second by at least this.
        min_decisive_agreement: share of decisive images whose INT8 top-1 is FP32's.
        min_top1_agreement: share of all held-out images whose INT8 top-1 is FP32's.
        min_top5_overlap: mean share of FP32's top-5 classes that INT8's top-5 holds.
        min_class_images: a FP32 top-1 class with at least this many held-out images is gated on its own.
        min_class_agreement: top-1 agreement every such class must reach.
        min_held_out: fewest held-out images that can say anything.
        min_decisive_images: fewest decisive held-out images.
        max_class_share: largest share of the held-out images one FP32 top-1 class may take (a sample of one
            kind of image cannot show how the model does on the others).
    """

    decisive_margin: float = 0.1
    min_decisive_agreement: float = 0.99
    # Below FP32's own agreement under half a pixel level of input noise (89-94 % on the sets of docs/int8.md): the
    # near-ties of ordinary photos flip under any rounding, so the overall figure only catches broad damage.
    min_top1_agreement: float = 0.85
    min_top5_overlap: float = 0.85
    min_class_images: int = 20
    min_class_agreement: float = 0.95
    min_held_out: int = 100
    min_decisive_images: int = 50
    max_class_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("decisive_margin", "min_decisive_agreement", "min_top1_agreement", "min_top5_overlap",
                     "min_class_agreement", "max_class_share"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ConfigError(f"--{name.replace('_', '-')} {value!r} must be a fraction in [0, 1], e.g. 0.95")
        for name in ("min_class_images", "min_held_out", "min_decisive_images"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {value!r} must be a positive integer, e.g. 20")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (N, C) logits, in float64."""
    import numpy as np  # noqa: PLC0415 - numpy only when the command runs, not for every CLI call

    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=1, keepdims=True)


def held_out_figures(fp32_logits: np.ndarray, thresholds: GateThresholds = GateThresholds(),
                     labels: Sequence[str] | None = None) -> dict[str, Any]:
    """What FP32 alone says of the held-out images: how many, how many decisive, how spread over classes."""
    import numpy as np  # noqa: PLC0415 - numpy only when the command runs, not for every CLI call

    p32 = softmax(fp32_logits)
    n, classes = p32.shape
    top1 = p32.argmax(axis=1)
    ordered = np.sort(p32, axis=1)
    margin = ordered[:, -1] - (ordered[:, -2] if classes > 1 else 0.0)
    ids, counts = np.unique(top1, return_counts=True)
    return {
        "images": int(n),
        "decisive_images": int((margin >= thresholds.decisive_margin).sum()),
        "distinct_classes": int(len(ids)),
        "largest_class_share": int(counts.max()) / n if n else 0.0,
        "largest_class": _label(labels, int(ids[counts.argmax()])) if n else None,
    }


def gate(fp32_logits: np.ndarray, int8_logits: np.ndarray, thresholds: GateThresholds = GateThresholds(),
         labels: Sequence[str] | None = None, noisy_logits: np.ndarray | None = None) -> dict[str, Any]:
    """Compare INT8 with FP32 on the same held-out images; the figures, and the failures as one-line texts.

    ``noisy_logits``, FP32's logits of the same images under ``pixel_noise``, add the yardstick: FP32 against itself
    (``fp32_pixel_noise``, overall and in each class entry), how much of any disagreement the images' near-ties alone
    make. It is reported, never gated.

    Returns:
        ``{"passed", "failures", "figures"}``: ``figures`` holds ``held_out_figures``' and ``top1_agreement``,
        ``decisive_agreement``, ``top5_overlap``, ``classes`` (one entry per FP32 top-1 class with at least
        ``min_class_images`` images: id, label, images, agreement; worst first) and ``worst_classes`` (the first
        WORST_CLASSES of those).
    """
    import numpy as np  # noqa: PLC0415 - numpy only when the command runs, not for every CLI call

    fp32, int8 = np.asarray(fp32_logits), np.asarray(int8_logits)
    if fp32.shape != int8.shape or fp32.ndim != 2 or not len(fp32):
        raise ValueError(f"logits must be two (N, C) arrays of one shape, N > 0, got {fp32.shape} and {int8.shape}")
    t = thresholds
    classes = fp32.shape[1]
    p32, p8 = softmax(fp32), softmax(int8)
    top1_32, top1_8 = p32.argmax(axis=1), p8.argmax(axis=1)
    agree = top1_32 == top1_8
    k = min(5, classes)
    ordered = np.sort(p32, axis=1)
    margin = ordered[:, -1] - (ordered[:, -2] if classes > 1 else 0.0)
    decisive = margin >= t.decisive_margin
    top5_32 = np.argsort(-p32, axis=1, kind="stable")[:, :k]
    top5_8 = np.argsort(-p8, axis=1, kind="stable")[:, :k]
    overlap = np.array([len(set(a) & set(b)) / k for a, b in zip(top5_32, top5_8)])
    ids, counts = np.unique(top1_32, return_counts=True)
    per_class = []
    for cid, count in zip(ids, counts):
        if count >= t.min_class_images:
            per_class.append({"class_id": int(cid), "label": _label(labels, int(cid)), "images": int(count),
                              "agreement": float(agree[top1_32 == cid].mean())})
    per_class.sort(key=lambda c: (c["agreement"], -c["images"], c["class_id"]))
    figures = {
        **held_out_figures(fp32, t, labels),
        "top1_agreement": float(agree.mean()),
        "decisive_agreement": float(agree[decisive].mean()) if decisive.any() else 0.0,
        "top5_overlap": float(overlap.mean()),
        "classes_gated": len(per_class),
        "classes": per_class,
        "worst_classes": per_class[:WORST_CLASSES],
    }
    if noisy_logits is not None:
        floor = gate(fp32, noisy_logits, t)["figures"]
        figures["fp32_pixel_noise"] = {k: floor[k] for k in ("top1_agreement", "decisive_agreement", "top5_overlap")}
        by_class = {c["class_id"]: c["agreement"] for c in floor["classes"]}
        for c in per_class:
            c["fp32_pixel_noise"] = by_class[c["class_id"]]
    failures = sample_failures(figures, t) + accuracy_failures(figures, t)
    return {"passed": not failures, "failures": failures, "figures": figures}


def pixel_noise(tensors: np.ndarray, spec: Any, *, seed: int = 0) -> np.ndarray:
    """``tensors`` (model inputs made by ``spec``) with every pixel value moved by a uniform draw within half a level
    (+-0.5 of 0..255): the rounding an 8-bit image already carries, and the smallest change a decoder makes."""
    import numpy as np  # noqa: PLC0415 - numpy only when the command runs, not for every CLI call

    x = np.asarray(tensors, dtype=np.float32)
    levels = np.random.default_rng(seed).uniform(-0.5, 0.5, x.shape).astype(np.float32)
    # One level of channel c is scale / std[c] in the model's input (PreprocessSpec: (v * scale - mean) / std).
    step = np.float32(spec.scale) / np.asarray(spec.std, dtype=np.float32)
    shape = (1, 3, 1, 1) if spec.layout == "NCHW" else (1, 1, 1, 3)
    return x + levels * step.reshape(shape)


def sample_failures(figures: Mapping[str, Any], t: GateThresholds) -> list[str]:
    """What makes the held-out sample too small or too narrow to judge by (one line each)."""
    out = []
    if figures["images"] < t.min_held_out:
        out.append(f"only {figures['images']} held-out images (at least {t.min_held_out}): give more images or "
                   "raise --samples")
    if figures["decisive_images"] < t.min_decisive_images:
        out.append(f"only {figures['decisive_images']} decisive held-out images (at least {t.min_decisive_images}): "
                   "give more, and more ordinary, photos")
    if figures["images"] and figures["largest_class_share"] > t.max_class_share:
        out.append(f"{figures['largest_class_share']:.0%} of the held-out images are one class "
                   f"({figures['largest_class']}; at most {t.max_class_share:.0%}): the sample must cover the "
                   "kinds of image the job will see")
    return out


def accuracy_failures(figures: Mapping[str, Any], t: GateThresholds) -> list[str]:
    """Where INT8 falls below a threshold against FP32 (one line each)."""
    out = []
    if figures["decisive_images"] and figures["decisive_agreement"] < t.min_decisive_agreement:
        out.append(f"decisive-image agreement {figures['decisive_agreement']:.2%} < {t.min_decisive_agreement:.0%}")
    if figures["images"] and figures["top1_agreement"] < t.min_top1_agreement:
        out.append(f"top-1 agreement {figures['top1_agreement']:.2%} < {t.min_top1_agreement:.0%}")
    if figures["images"] and figures["top5_overlap"] < t.min_top5_overlap:
        out.append(f"top-5 overlap {figures['top5_overlap']:.2%} < {t.min_top5_overlap:.0%}")
    low = [c for c in figures["classes"] if c["agreement"] < t.min_class_agreement]
    if low:
        listed = ", ".join(f"{c['label']} {c['agreement']:.0%} of {c['images']}{class_noise(c)}"
                           for c in low[:WORST_CLASSES])
        near_ties = all(c.get("fp32_pixel_noise", 1.0) < t.min_class_agreement for c in low)
        # Said so because no model whose arithmetic differs from FP32's by rounding holds such labels at the bar.
        why = (f": near-tie labels, each below {t.min_class_agreement:.0%} for FP32 itself under pixel noise"
               if near_ties else "")
        out.append(f"{len(low)} class(es) below {t.min_class_agreement:.0%} agreement: {listed}{why}")
    return out


def noise_summary(floor: Mapping[str, Any]) -> str:
    """The yardstick's overall figures (``figures["fp32_pixel_noise"]``) as one text for the command's lines."""
    return (f"FP32 against itself under half a pixel level of noise: top-1 {floor['top1_agreement']:.2%}, "
            f"decisive {floor['decisive_agreement']:.2%}")


def class_noise(entry: Mapping[str, Any]) -> str:
    """A gated class's yardstick for the one-line texts: " (FP32 with pixel noise 85%)", or nothing."""
    return f" (FP32 with pixel noise {entry['fp32_pixel_noise']:.0%})" if "fp32_pixel_noise" in entry else ""


def _label(labels: Sequence[str] | None, cid: int) -> str:
    return labels[cid] if labels is not None and 0 <= cid < len(labels) else str(cid)
