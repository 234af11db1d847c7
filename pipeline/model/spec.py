"""The preprocessing spec (preprocess.json): its fields, their defaults and checks, and timm's names for them."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.errors import ModelError

INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos")
# Other names for them, as timm, torchvision (InterpolationMode.BICUBIC), OpenCV and DALI write them; any case.
INTERPOLATION_ALIASES = {"cubic": "bicubic", "linear": "bilinear", "lanczos3": "lanczos", "nn": "nearest",
                         "inter_cubic": "bicubic", "inter_linear": "bilinear", "inter_lanczos4": "lanczos",
                         "inter_nearest": "nearest"}
CHANNEL_ORDERS = ("RGB", "BGR")
LAYOUTS = ("NCHW", "NHWC")
# How the image becomes the input size: the shorter side to resize_shorter then the centred crop, or the whole image
# stretched to the crop size (aspect ratio not kept, nothing cut off; common for product classifiers).
RESIZE_SHORTER, RESIZE_SQUASH = "shorter", "squash"
RESIZE_MODES = (RESIZE_SHORTER, RESIZE_SQUASH)
# What the model's output holds and how the engines score it: logits of one class out of many (a softmax over the
# classes), probabilities already (as given), or logits of independent classes, a multi-label model (a sigmoid each).
OUTPUT_LOGITS, OUTPUT_PROBABILITIES, OUTPUT_SIGMOID = "logits", "probabilities", "sigmoid"
OUTPUT_KINDS = (OUTPUT_LOGITS, OUTPUT_PROBABILITIES, OUTPUT_SIGMOID)
# The scale that turns 0..255 pixels into 0..1, written as a spec needs it (repr of 1/255).
UNIT_SCALE = 1 / 255
# timm's pretrained_cfg fields that preprocess.json accepts too; its crop_pct when only input_size is given.
TIMM_FIELDS = ("input_size", "crop_pct", "crop_mode")
TIMM_DEFAULT_CROP_PCT = 0.875
_TIMM_CROP_MODES = {"center": RESIZE_SHORTER, "squash": RESIZE_SQUASH}

@dataclass(frozen=True, kw_only=True)
class EmbeddingSpec:
    """A model's embedding (``"embedding"`` in preprocess.json): the ONNX tensor that holds it (a graph output, or a
    named intermediate tensor the engines fetch as one), its width, and whether each row is L2-normalised before it
    is written (what cosine-similarity search wants)."""

    output: str
    dim: int
    normalize: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.output, str) or not self.output:
            problems.append(f"embedding.output must name an ONNX tensor, got {self.output!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            problems.append(f"embedding.dim must be a positive integer (the tensor's width), got {self.dim!r}")
        if not isinstance(self.normalize, bool):
            problems.append(f"embedding.normalize must be true or false, got {self.normalize!r}")
        if problems:
            raise ModelError("bad preprocessing spec: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, data: Any) -> "EmbeddingSpec":
        """``{"output": NAME, "dim": D, "normalize": true}``; ModelError for anything else."""
        if isinstance(data, EmbeddingSpec):
            return data
        known = {"output", "dim", "normalize"}
        if not isinstance(data, dict) or not {"output", "dim"} <= set(data) or set(data) - known:
            raise ModelError('bad preprocessing spec: "embedding" must be {"output": TENSOR, "dim": WIDTH, '
                             f'"normalize": true|false}}, got {data!r}')
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class PreprocessSpec:
    """How a model wants its input tensor made from a decoded RGB image (docs/models.md, "The folder").

    With ``resize`` "shorter" (the default) the image is scaled (same factor on both axes) so that its shorter side
    becomes ``resize_shorter``, then the centred ``crop`` (height, width) of that is taken; with "squash" the whole
    image is resized to ``crop`` (no ``resize_shorter``). Pixel values v in 0..255 become
    ``(v * scale - mean[c]) / std[c]`` per channel, in ``channel_order``, laid out as ``layout``.
    The scale factor is exact (no rounding of the intermediate size): equivalent to cropping the source to
    ``crop * shorter / resize_shorter`` pixels around its centre and resizing that region to ``crop``.
    ``antialias`` means the resampling kernel is widened when downscaling (Pillow always does this; DALI's
    ``fn.resize(antialias=True)`` matches it). ``output`` says what the network gives: logits (scored by a softmax),
    probabilities (scored as given) or independent logits of a multi-label model (scored by a sigmoid each).
    ``embedding`` (an ``EmbeddingSpec``, or None) names the tensor of the model's embedding, if it has one.
    ``to_dict`` leaves out ``resize``, ``output`` and ``embedding`` at their defaults, so specs written before them keep
    their canonical JSON (and the model digest that hashes it).
    """

    resize_shorter: int | None = None
    interpolation: str = "bicubic"
    antialias: bool = True
    crop: tuple[int, int] = (224, 224)
    channel_order: str = "RGB"
    scale: float = 1.0
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    layout: str = "NCHW"
    resize: str = RESIZE_SHORTER
    output: str = OUTPUT_LOGITS
    embedding: EmbeddingSpec | None = None

    def __post_init__(self) -> None:
        if self.embedding is not None:
            object.__setattr__(self, "embedding", EmbeddingSpec.from_dict(self.embedding))
        problems: list[str] = []
        crop = _pair(self.crop, problems)
        mean, std = _triple(self.mean, "mean", problems), _triple(self.std, "std", problems)
        object.__setattr__(self, "crop", crop)
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        if isinstance(self.interpolation, str):
            name = self.interpolation.strip().lower().removeprefix("interpolationmode.")
            object.__setattr__(self, "interpolation", INTERPOLATION_ALIASES.get(name, name))
        if self.resize not in RESIZE_MODES:
            problems.append(f"resize must be one of {', '.join(RESIZE_MODES)}, got {self.resize!r}")
        elif self.resize == RESIZE_SQUASH:
            if self.resize_shorter is not None:
                problems.append("resize_shorter has no meaning with resize 'squash' (the whole image becomes the crop "
                                "size); drop it")
        elif self.resize_shorter is None:
            problems.append("resize_shorter is required (e.g. 256 for a 224 crop), or set resize 'squash' to resize "
                            "the whole image to the crop size")
        elif isinstance(self.resize_shorter, bool) or not isinstance(self.resize_shorter, int) \
                or self.resize_shorter < 1:
            problems.append(f"resize_shorter must be a positive integer, got {self.resize_shorter!r}")
        elif len(crop) == 2 and max(crop) > self.resize_shorter:
            problems.append(f"crop {list(crop)} must fit inside resize_shorter {self.resize_shorter}")
        if self.interpolation not in INTERPOLATIONS:
            problems.append(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {self.interpolation!r}")
        if not isinstance(self.antialias, bool):
            problems.append(f"antialias must be true or false, got {self.antialias!r}")
        elif not self.antialias and self.interpolation != "nearest":
            # Pillow cannot resample without antialiasing; the reference must be able to run every spec.
            problems.append("antialias false is only supported with interpolation 'nearest'; set antialias true")
        if self.channel_order not in CHANNEL_ORDERS:
            problems.append(f"channel_order must be one of {', '.join(CHANNEL_ORDERS)}, got {self.channel_order!r}")
        if self.layout not in LAYOUTS:
            problems.append(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.output not in OUTPUT_KINDS:
            problems.append(f"output must be one of {', '.join(OUTPUT_KINDS)}, got {self.output!r}")
        if isinstance(self.scale, bool) or not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)
                                                and self.scale > 0):
            problems.append(f"scale must be a positive finite number, got {self.scale!r}")
        if len(std) == 3 and any(v <= 0 for v in std):
            problems.append(f"std must have 3 positive values, got {list(std)!r}")
        if problems:
            raise ModelError("bad preprocessing spec: " + "; ".join(problems))
        if self.scale == 1 and mean + std != (0.0, 0.0, 0.0, 1.0, 1.0, 1.0) \
                and all(0 <= v <= 1 for v in mean) and all(0 < v <= 1 for v in std):
            # torchvision's and timm's mean/std are fractions of 0..1 pixels: with 0..255 pixels the network would
            # see values up to about 1,100 and answer one class for everything.
            raise ModelError(
                f"mean {list(mean)} and std {list(std)} are in 0..1 units but scale is 1 (pixels 0..255); add "
                f'"scale": {UNIT_SCALE!r} (1/255) to make pixels 0..1 first, or write mean and std in 0..255 units')

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Shape of one preprocessed image (no batch axis)."""
        h, w = self.crop
        return (3, h, w) if self.layout == "NCHW" else (h, w, 3)

    @property
    def probabilities(self) -> bool:
        """Whether the network's output is already probabilities (no softmax after it)."""
        return self.output == OUTPUT_PROBABILITIES

    @property
    def sigmoid(self) -> bool:
        """Whether each class is scored alone, by a sigmoid of its logit (a multi-label model; no softmax)."""
        return self.output == OUTPUT_SIGMOID

    def to_dict(self) -> dict[str, Any]:
        """The canonical form: every field, except ``resize``/``output`` at their defaults and ``resize_shorter``
        where squashing has none (the lead's model digest hashes this)."""
        d = asdict(self)
        d["crop"] = list(self.crop)
        d["mean"] = list(self.mean)
        d["std"] = list(self.std)
        for name, default in (("resize", RESIZE_SHORTER), ("output", OUTPUT_LOGITS), ("resize_shorter", None),
                              ("embedding", None)):
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PreprocessSpec":
        """Builds a spec from a dict (e.g. preprocess.json); unknown fields raise ModelError.

        Scalars are accepted where a pair or a triple is meant (``"crop": 224``, ``"mean": 127``), and timm's own
        fields (``input_size``, ``crop_pct``, ``crop_mode``) stand for ``crop``, ``resize_shorter`` and ``resize``.
        """
        if not isinstance(data, dict):
            raise ModelError(f"bad preprocessing spec: expected a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known - set(TIMM_FIELDS))
        if unknown:
            raise ModelError(f"bad preprocessing spec: unknown field(s) {', '.join(unknown)}; allowed: "
                             f"{', '.join(sorted(known))} (and timm's {', '.join(TIMM_FIELDS)})")
        data = _from_timm(dict(data)) if set(data) & set(TIMM_FIELDS) else dict(data)
        if "resize_shorter" not in data and data.get("resize", RESIZE_SHORTER) == RESIZE_SHORTER:
            raise ModelError("bad preprocessing spec: 'resize_shorter' is required (e.g. 256 for a 224 crop), or "
                             "set \"resize\": \"squash\" to resize the whole image to the crop size")
        try:
            return cls(**data)
        except TypeError as e:
            raise ModelError(f"bad preprocessing spec: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "PreprocessSpec":
        """The spec of a JSON text; a key written twice is refused (json keeps the last silently)."""
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            raise ModelError(f"bad preprocessing spec: not valid JSON ({e})") from None
        return cls.from_dict(data)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, or ModelError naming the first key written twice."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ModelError(f"bad preprocessing spec: {key!r} is written twice (JSON keeps the last one silently); "
                             "keep one")
        seen[key] = value
    return seen


def _pair(value: Any, problems: list[str]) -> tuple[int, ...]:
    """``crop`` as (height, width): a scalar means a square."""
    values = [value, value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    try:
        pair = tuple(int(v) for v in values)
        if len(pair) == 2 and min(pair) >= 1 and all(float(v) == int(v) for v in values):
            return pair
    except (TypeError, ValueError):
        pass
    problems.append(f"crop must be [height, width] of positive integers (or one for a square), got {value!r}")
    return ()


def _triple(value: Any, name: str, problems: list[str]) -> tuple[float, ...]:
    """``mean``/``std`` per channel: a scalar means the same for all three; NaN and infinity are refused (Python's
    json reads them)."""
    try:
        triple = (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)
        if len(triple) == 3 and all(math.isfinite(v) for v in triple):
            return triple
    except (TypeError, ValueError):
        pass
    problems.append(f"{name} must have 3 values (one per channel) or one for all, finite numbers, got {value!r}")
    return ()


def _from_timm(data: dict[str, Any]) -> dict[str, Any]:
    """timm's ``input_size`` ([3, H, W]), ``crop_pct`` and ``crop_mode`` as this spec's fields; ModelError for a
    combination the spec cannot express or that contradicts the spec's own fields."""
    size = data.pop("input_size", None)
    crop_pct = data.pop("crop_pct", None)
    mode = data.pop("crop_mode", None)
    if size is not None:
        if "crop" in data:
            raise ModelError("bad preprocessing spec: give crop or timm's input_size, not both")
        if not isinstance(size, (list, tuple)) or len(size) not in (2, 3) or (len(size) == 3 and size[0] != 3):
            raise ModelError(f"bad preprocessing spec: input_size must be [3, height, width] as timm writes it, got "
                             f"{size!r}")
        data["crop"] = list(size[-2:])
    if mode is not None:
        if mode not in _TIMM_CROP_MODES or "resize" in data:
            raise ModelError(f"bad preprocessing spec: crop_mode {mode!r} cannot be used here; timm's center or "
                             "squash (crop_pct 1) map to resize shorter or squash, give one of them, not resize too")
        data["resize"] = _TIMM_CROP_MODES[mode]
    if data.get("resize") == RESIZE_SQUASH:
        if crop_pct not in (None, 1, 1.0):
            raise ModelError(f"bad preprocessing spec: crop_pct {crop_pct} with squash would crop after squashing, "
                             "which the spec cannot express; use crop_pct 1, or crop_mode center")
        return data
    if "resize_shorter" in data:
        if crop_pct is not None:
            raise ModelError("bad preprocessing spec: give resize_shorter or timm's crop_pct, not both")
        return data
    crop = data.get("crop", 224)
    crop = [crop, crop] if isinstance(crop, (int, float)) else list(crop)
    pct = TIMM_DEFAULT_CROP_PCT if crop_pct is None else crop_pct
    if not isinstance(pct, (int, float)) or not 0 < pct <= 1:
        raise ModelError(f"bad preprocessing spec: crop_pct must be within 0..1 (e.g. 0.875), got {crop_pct!r}")
    if len(crop) != 2 or crop[0] != crop[1]:
        # timm squashes a non-square input to input_size / crop_pct before cropping: not the shorter-side resize.
        raise ModelError(f"bad preprocessing spec: crop_pct needs a square input_size (got {crop}); write "
                         "resize_shorter and crop instead")
    data["resize_shorter"] = math.floor(crop[0] / pct)  # what timm's eval transform resizes the shorter side to
    return data
