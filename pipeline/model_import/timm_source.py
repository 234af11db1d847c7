"""timm: an architecture name and a checkpoint file; the spec from timm's own pretrained_cfg and eval transform."""

from __future__ import annotations

import argparse
import difflib
import math
from pathlib import Path
from typing import Any

import timm
import timm.data
import torch
from timm.models import load_state_dict

from pipeline.errors import ConfigError, ModelError
from pipeline.model.default_model import labels_path
from pipeline.model.folder import read_labels
from pipeline.model_import.base import SourceModel, fit_weights, spec_fields
from pipeline.model_import.embedding import TimmEmbedder

# Where a checkpoint may keep its class names (timm's own train.py keeps none; many fine-tuning scripts do).
LABEL_KEYS = ("class_names", "classes", "labels", "label_names")
# Where a checkpoint keeps its weights, in the order timm's load_state_dict looks: the EMA copies (train.py's
# --model-ema) only when asked (--use-ema, as timm's validate.py spells it), else the trained weights.
EMA_KEYS = ("state_dict_ema", "model_ema")
WEIGHT_KEYS = ("state_dict", "model")
IMAGENET_CLASSES = 1000


def load(name: str, *, checkpoint: Path | None, labels: tuple[str, ...] | None, preset: str | None,
         use_ema: bool = False) -> SourceModel:
    """The timm architecture ``name`` with the weights of ``checkpoint`` (a state dict, timm's train.py checkpoint,
    or safetensors; ``use_ema``: its EMA weights); nothing is downloaded."""
    if preset:
        raise ConfigError("--preset is for torchvision; timm's preprocessing comes from the model's pretrained_cfg")
    if checkpoint is None:
        raise ConfigError(f"importing timm's {name} needs --checkpoint FILE (the trained weights); nothing is "
                          "downloaded")
    if not timm.is_model(name):  # an architecture, or one with a pretrained tag (resnet50.a1_in1k) whose cfg applies
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        raise ConfigError(f"timm has no architecture {name!r}" + (f"; did you mean {', '.join(close)}?" if close
                                                                  else "; see timm.list_models()"))
    state, names, taken = read_checkpoint(checkpoint, use_ema=use_ema)
    probe = timm.create_model(name, pretrained=False)
    classes = _classes_in(state, probe.pretrained_cfg.get("classifier")) or probe.num_classes
    labels = labels or names
    if labels is not None and len(labels) != classes:
        raise ModelError(f"{checkpoint} has {classes} output classes but there are {len(labels)} labels; pass "
                         "--labels with one name per class")
    network = timm.create_model(name, pretrained=False, num_classes=classes)
    fit_weights(network, state, checkpoint, f"timm's {name} with {classes} classes")
    notes = [taken]
    if labels is None:
        if classes != IMAGENET_CLASSES or timm.data.infer_imagenet_subset(network) != "imagenet-1k":
            raise ConfigError(f"{checkpoint} holds no class names; pass --labels FILE (one per line, {classes} lines)")

        labels = read_labels(labels_path())
        notes.append("labels: ImageNet-1k's, as the architecture's pretrained_cfg says; pass --labels for your own")
    config = timm.data.resolve_data_config({}, model=network)
    return SourceModel(network=network.eval(), transform=timm.data.create_transform(**config), labels=tuple(labels),
                       spec=spec_from_config(config), description=f"timm {name} from {checkpoint.name}", notes=notes,
                       embedder=TimmEmbedder(network).eval())


def spec_from_config(config: dict[str, Any]) -> dict[str, Any]:
    """preprocess.json fields for timm's data config (input_size, crop_pct, crop_mode, interpolation, mean, std),
    following timm's eval transform: the shorter side to floor(size / crop_pct), then the centred crop; with
    crop_mode squash and crop_pct 1 the whole image resized to the input size."""
    _, height, width = config["input_size"]
    crop_pct, mode = config.get("crop_pct") or 1.0, config.get("crop_mode") or "center"
    if mode == "squash" and crop_pct == 1.0:
        resize_shorter = None
    elif mode == "center" and height == width:
        resize_shorter = math.floor(height / crop_pct)
    else:
        raise ModelError(f"timm's eval transform for input size {height}x{width}, crop_pct {crop_pct} and crop_mode "
                         f"{mode} resizes in a way preprocess.json cannot express (the shorter side then a centred "
                         "crop, or a squash to the input size)")
    return spec_fields(size=(height, width), resize_shorter=resize_shorter, interpolation=config["interpolation"],
                       mean=config["mean"], std=config["std"])


def read_checkpoint(path: Path, *, use_ema: bool = False) -> tuple[dict[str, Any], tuple[str, ...] | None, str]:
    """(state dict, class names or None, which weights were taken: one line) of a weights file, read without running
    code from it. A train.py checkpoint gives its ``state_dict``, or with ``use_ema`` its ``state_dict_ema``."""
    if not path.is_file():
        raise ConfigError(f"--checkpoint {path} is not a file")
    names, keys = None, []
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # timm's train.py saves its arguments
            if path.suffix != ".safetensors":
                raw = torch.load(str(path), map_location="cpu", weights_only=True)
                found = [raw[k] for k in LABEL_KEYS if isinstance(raw, dict) and isinstance(raw.get(k), (list, tuple))]
                names = tuple(str(v) for v in found[0]) if found else None
                keys = [k for k in (*EMA_KEYS, *WEIGHT_KEYS) if isinstance(raw, dict) and isinstance(raw.get(k), dict)]
            ema = next((k for k in EMA_KEYS if k in keys), None)
            if use_ema and ema is None:
                raise ConfigError(f"--use-ema: {path} holds no EMA weights ({' or '.join(EMA_KEYS)}); drop --use-ema "
                                  "to import its trained weights")
            state = load_state_dict(str(path), use_ema=use_ema, weights_only=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load and safetensors raise many types
        raise ModelError(f"cannot read {path} as a checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                         "save the weights with torch.save(model.state_dict(), path) or as safetensors") from None
    if use_ema:
        taken = f"weights: the checkpoint's EMA weights ({ema}), as asked by --use-ema"
    else:
        key = next((k for k in WEIGHT_KEYS if k in keys), None)
        taken = f"weights: the checkpoint's {key}" if key else "weights: the file's state dict"
        if ema:
            taken += f"; it also holds EMA weights ({ema}): --use-ema imports those instead"
    return state, names, taken


def _classes_in(state: dict[str, Any], classifier: Any) -> int | None:
    """The class count of the checkpoint's classifier layer (the last one where timm names several)."""
    heads = classifier if isinstance(classifier, (list, tuple)) else [classifier]
    for head in reversed([h for h in heads if h]):
        weight = state.get(f"{head}.weight")
        if weight is not None and weight.ndim >= 1:
            return int(weight.shape[0])
    return None
