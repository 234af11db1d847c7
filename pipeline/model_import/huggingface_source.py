"""Hugging Face: a local image-classification folder; labels from config.json's id2label, the spec from the image
processor's settings (preprocessor_config.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification
from transformers.utils import logging as hf_logging

from pipeline.errors import ConfigError, ModelError
from pipeline.model.spec import OUTPUT_LOGITS, OUTPUT_SIGMOID
from pipeline.model_import.base import SourceModel, spec_fields
from pipeline.model_import.embedding import HeadInputEmbedder

CONFIG_FILE = "config.json"
PROCESSOR_FILE = "preprocessor_config.json"
CONVNEXT_SQUASH_FROM = 384  # ConvNextImageProcessor squashes to shortest_edge from this size on
# config.json's problem_type -> how its logits are scored (the spec's output); None is how most configs leave it.
PROBLEM_OUTPUTS = {None: OUTPUT_LOGITS, "single_label_classification": OUTPUT_LOGITS,
                   "multi_label_classification": OUTPUT_SIGMOID}


class Logits(torch.nn.Module):
    """A transformers classifier as a plain function of the pixel batch, returning its logits."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def load(name: str, *, checkpoint: Path | None, labels: tuple[str, ...] | None, preset: str | None,
         use_ema: bool = False) -> SourceModel:
    """The model folder ``name`` as ``from_pretrained`` reads it, local files only; a ``multi_label_classification``
    model's spec declares ``"output": "sigmoid"``."""
    folder = Path(name).expanduser()
    if checkpoint or preset or use_ema:
        raise ConfigError("a Hugging Face folder holds its weights and preprocessing; drop --checkpoint, --preset and "
                          "--use-ema")
    missing = [f for f in (CONFIG_FILE, PROCESSOR_FILE) if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"{folder} is not a Hugging Face image-classification folder: it lacks {', '.join(missing)} "
                          "(save_pretrained writes both, beside the weights)")
    hf_logging.disable_progress_bar()  # the CLI owns the terminal
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        # eager attention: the ONNX exporter traces it; the fused kernels give the same numbers
        model = AutoModelForImageClassification.from_pretrained(folder, local_files_only=True,
                                                                attn_implementation="eager")
        processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True, backend="pil")
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"transformers cannot load {folder} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None
    problem = getattr(config, "problem_type", None)
    if problem not in PROBLEM_OUTPUTS:
        raise ModelError(f"{folder / CONFIG_FILE} has problem_type {problem!r}, not a classifier; import a model whose "
                         f"problem_type is one of {', '.join(str(p) for p in PROBLEM_OUTPUTS)}")
    classes = int(config.num_labels)
    if labels is None:
        labels = tuple(str(config.id2label[i]) for i in range(classes))
    elif len(labels) != classes:
        raise ModelError(f"{folder / CONFIG_FILE} has {classes} labels (id2label) but --labels has {len(labels)}; "
                         "pass one name per class")

    def transform(image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(processor(images=image, return_tensors="np")["pixel_values"][0])

    notes = [f"preprocessing: {type(processor).__name__} of {PROCESSOR_FILE}"]
    spec = spec_from_processor(processor)
    if PROBLEM_OUTPUTS[problem] != OUTPUT_LOGITS:
        spec["output"] = PROBLEM_OUTPUTS[problem]
        notes.append(f'scores: "output": "{spec["output"]}", a sigmoid per class (problem_type {problem})')
    network, description = Logits(model).eval(), f"{type(model).__name__} from {folder.name}"
    try:  # the pooled output before the classifier head: the input of its final Linear
        embedder = HeadInputEmbedder(network, classes, description).eval()
    except ModelError:
        embedder = None  # --embedding then says the model has none
    return SourceModel(network=network, transform=transform, labels=labels, spec=spec, description=description,
                       notes=notes, embedder=embedder)


def spec_from_processor(processor: Any) -> dict[str, Any]:
    """preprocess.json fields for an image processor: a ``size`` of height and width with no crop is a squash;
    ``shortest_edge`` (divided by ``crop_pct`` where the processor has one, as ConvNeXt's does) then
    ``crop_size`` is the shorter side then a centred crop."""
    size = dict(getattr(processor, "size", None) or {})
    crop = dict(getattr(processor, "crop_size", None) or {}) if getattr(processor, "do_center_crop", False) else {}
    if not getattr(processor, "do_resize", True):
        raise ModelError(f"{type(processor).__name__} does not resize; preprocess.json needs a resize to the input")
    if "height" in size and "width" in size and not crop:
        out, shorter = (size["height"], size["width"]), None
    elif "shortest_edge" in size:
        edge = int(size["shortest_edge"])
        crop_pct = getattr(processor, "crop_pct", None)
        if crop_pct and not crop:  # ConvNeXt: below 384 the shorter side to edge / crop_pct and a centred crop
            out, shorter = (edge, edge), (int(edge / crop_pct) if edge < CONVNEXT_SQUASH_FROM else None)
        elif crop:
            out, shorter = (crop["height"], crop["width"]), edge
        else:
            raise ModelError(f"{type(processor).__name__} resizes the shorter side to {edge} without a crop, so the "
                             "input size varies; a network of this project needs a fixed input size")
    else:
        raise ModelError(f"{type(processor).__name__} resizes to {size} then crops {crop or 'nothing'}; "
                         "preprocess.json cannot express it (the shorter side then a centred crop, or a squash)")
    resample = getattr(processor, "resample", Image.Resampling.BILINEAR)
    rescale = float(processor.rescale_factor) if getattr(processor, "do_rescale", True) else 1.0
    normalize = getattr(processor, "do_normalize", True)
    return spec_fields(size=out, resize_shorter=shorter, interpolation=Image.Resampling(int(resample)).name.lower(),
                       mean=processor.image_mean if normalize else (0.0,) * 3,
                       std=processor.image_std if normalize else (1.0,) * 3, scale=rescale)
