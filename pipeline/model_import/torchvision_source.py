"""torchvision: a classification model name and a weights file; transforms and categories from its weights entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torchvision.models as models

from pipeline.errors import ConfigError, ModelError
from pipeline.model_import.base import SourceModel, fit_weights, spec_fields
from pipeline.model_import.embedding import HeadInputEmbedder


def load(name: str, *, checkpoint: Path | None, labels: tuple[str, ...] | None, preset: str | None,
         use_ema: bool = False) -> SourceModel:
    """torchvision's ``name`` with the state dict in ``checkpoint``; ``preset`` names the weights entry (default:
    the model's DEFAULT) whose eval transforms and categories apply. Its weights are never downloaded."""
    if use_ema:
        raise ConfigError("--use-ema is for timm's train.py checkpoints; a torchvision state dict holds one set of "
                          "weights")
    if name not in models.list_models(module=models):
        raise ConfigError(f"torchvision has no classification model {name!r}; see "
                          "torchvision.models.list_models(module=torchvision.models)")
    if checkpoint is None:
        raise ConfigError(f"importing torchvision's {name} needs --checkpoint FILE (its state dict); nothing is "
                          "downloaded")
    entries = models.get_model_weights(name)
    try:
        entry = entries[preset] if preset else entries.DEFAULT
    except KeyError:
        raise ConfigError(f"--preset {preset!r} is not one of {name}'s weights entries "
                          f"({', '.join(e.name for e in entries)})") from None
    if not checkpoint.is_file():
        raise ConfigError(f"--checkpoint {checkpoint} is not a file")
    try:
        state = torch.load(str(checkpoint), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types
        raise ModelError(f"cannot read {checkpoint} as a state dict ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}); save it with torch.save(model.state_dict(), path)") from None
    for key in ("model", "state_dict"):  # torchvision's reference train.py nests it under "model"
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    labels = labels or tuple(entry.meta["categories"])
    network = models.get_model(name, weights=None, num_classes=len(labels))
    fit_weights(network, state, checkpoint, f"torchvision's {name} with {len(labels)} classes")
    transform = entry.transforms()
    description = f"torchvision {name} from {checkpoint.name}"
    return SourceModel(network=network.eval(), transform=transform, labels=tuple(labels),
                       spec=spec_from_transform(transform), description=description,
                       notes=[f"preprocessing: torchvision's {entries.__name__}.{entry.name} transforms"],
                       embedder=_embedder(network, len(labels), description))


def spec_from_transform(transform: Any) -> dict[str, Any]:
    """preprocess.json fields for torchvision's ImageClassification transform: the shorter side to resize_size,
    then the centred crop_size."""
    resize, crop = list(transform.resize_size), list(transform.crop_size)
    if len(resize) != 1:
        raise ModelError(f"torchvision's transform resizes to {resize}, not the shorter side to one size; "
                         "preprocess.json cannot express it")
    return spec_fields(size=(crop[0], crop[-1]), resize_shorter=resize[0],
                       interpolation=transform.interpolation.value, mean=transform.mean, std=transform.std)


def _embedder(network: Any, classes: int, description: str) -> Any:
    """The network with the input of its final fc / classifier[-1] as the embedding, or None where it has none (a
    classifier of 1x1 convolutions: SqueezeNet); ``--embedding`` then says so."""
    try:
        return HeadInputEmbedder(network, classes, description).eval()
    except ModelError:
        return None
