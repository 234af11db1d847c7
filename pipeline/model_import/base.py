"""What every source module hands to ``core``: the SourceModel, the spec fields, the weights fitted strictly."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipeline.errors import ModelError
from pipeline.model.spec import RESIZE_SQUASH, UNIT_SCALE


@dataclass
class SourceModel:
    """What a source hands over.

    ``network``: a torch module in eval mode, float32 NCHW batch -> logits [batch, classes]. ``transform``: the
    framework's own eval preprocessing, a decoded RGB PIL image -> CHW float tensor. ``spec``: the preprocess.json
    fields that make the same tensor. ``notes``: what the spec approximates, one line each. ``embedder``: the same
    network as a module returning (logits, its pooled pre-logits features [batch, features]), for ``--embedding``.
    """

    network: Any
    transform: Callable[[Any], Any]
    labels: tuple[str, ...]
    spec: dict[str, Any]
    description: str
    notes: list[str] = field(default_factory=list)
    embedder: Any = None


def spec_fields(*, size: tuple[int, int], resize_shorter: int | None, interpolation: str,
                mean: tuple[float, ...], std: tuple[float, ...], scale: float = UNIT_SCALE) -> dict[str, Any]:
    """preprocess.json fields for an RGB NCHW network: the shorter side to ``resize_shorter`` then the centred
    crop of ``size``, or with ``resize_shorter`` None the whole image squashed to ``size``."""
    fields: dict[str, Any] = {"crop": [int(size[0]), int(size[1])], "interpolation": interpolation,
                              "scale": scale, "mean": [float(v) for v in mean], "std": [float(v) for v in std]}
    if resize_shorter is None:
        fields["resize"] = RESIZE_SQUASH
    else:
        fields["resize_shorter"] = int(resize_shorter)
    return fields


def fit_weights(network: Any, state: dict[str, Any], checkpoint: Path, what: str) -> None:
    """Loads ``state`` into ``network``, every tensor matched, or says in one line what does not fit."""
    expected = network.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in state.items()
             if k in expected and hasattr(v, "shape") and tuple(v.shape) != tuple(expected[k].shape)]
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if wrong or missing or unexpected:
        parts = [f"{len(items)} {kind} (first: {', '.join(items[:2])})" for kind, items in
                 (("tensors of another shape", wrong), ("missing tensors", missing), ("unexpected tensors", unexpected))
                 if items]
        raise ModelError(f"{checkpoint} does not fit {what}: {'; '.join(parts)}; pass the architecture it was trained "
                         "as, and --labels with one name per class it outputs")
    network.load_state_dict(state, strict=True)
