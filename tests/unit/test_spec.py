"""The preprocessing spec as users write it: scalars, timm's fields and names, squash, the output kind, and the
canonical form that the model digest hashes (unchanged for specs written before the new fields)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from pipeline.model.default_model import DEFAULT_SPEC, spec_path
from pipeline.errors import ModelError
from pipeline.model.imaging import preprocess_image
from pipeline.model.spec import UNIT_SCALE, PreprocessSpec

IMAGENET = {"scale": UNIT_SCALE, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def test_the_built_in_spec_keeps_its_canonical_json_byte_for_byte():
    data = json.loads(spec_path().read_text())
    assert list(DEFAULT_SPEC.to_dict().items()) == list(data.items())  # the same keys, in the same order
    assert DEFAULT_SPEC.to_json() == json.dumps(data, indent=2) + "\n"
    assert "resize" not in DEFAULT_SPEC.to_dict() and "output" not in DEFAULT_SPEC.to_dict()


def test_scalars_stand_for_pairs_and_triples():
    spec = PreprocessSpec.from_dict({"resize_shorter": 256, "crop": 224, "mean": 127, "std": 128})
    assert spec.crop == (224, 224) and spec.mean == (127.0,) * 3 and spec.std == (128.0,) * 3
    assert spec.to_dict()["crop"] == [224, 224]
    with pytest.raises(ModelError, match=r"crop must be \[height, width\] of positive integers"):
        PreprocessSpec.from_dict({"resize_shorter": 256, "crop": [224, 224, 3]})


@pytest.mark.parametrize("name, canonical", [("Bicubic", "bicubic"), ("InterpolationMode.BILINEAR", "bilinear"),
                                             ("cubic", "bicubic"), ("lanczos3", "lanczos"), ("nn", "nearest")])
def test_interpolation_names_of_timm_torchvision_and_opencv(name, canonical):
    spec = PreprocessSpec.from_dict({"resize_shorter": 256, "interpolation": name,
                                     **({"antialias": False} if canonical == "nearest" else {})})
    assert spec.interpolation == canonical and spec.to_dict()["interpolation"] == canonical


def test_timm_fields_become_crop_and_resize_shorter():
    spec = PreprocessSpec.from_dict({"input_size": [3, 224, 224], "crop_pct": 0.95, "interpolation": "bicubic",
                                     **IMAGENET})
    assert spec.crop == (224, 224) and spec.resize_shorter == 235  # floor(224 / 0.95), timm's eval resize
    assert PreprocessSpec.from_dict({"input_size": [3, 224, 224], **IMAGENET}).resize_shorter == 256  # 0.875
    squash = PreprocessSpec.from_dict({"input_size": [3, 240, 240], "crop_mode": "squash", "crop_pct": 1.0,
                                       **IMAGENET})
    assert squash.resize == "squash" and squash.resize_shorter is None
    assert PreprocessSpec.from_dict(squash.to_dict()) == squash
    with pytest.raises(ModelError, match="crop_pct needs a square input_size"):
        PreprocessSpec.from_dict({"input_size": [3, 224, 320], "crop_pct": 0.9, **IMAGENET})
    with pytest.raises(ModelError, match="give crop or timm's input_size, not both"):
        PreprocessSpec.from_dict({"input_size": [3, 224, 224], "crop": 224, "resize_shorter": 256})


def test_squash_resizes_the_whole_image_to_the_crop():
    spec = PreprocessSpec.from_dict({"resize": "squash", "crop": [4, 8], "interpolation": "nearest",
                                     "antialias": False})
    img = Image.new("RGB", (80, 20))
    img.paste((255, 0, 0), (0, 0, 10, 20))  # the leftmost eighth red: a centre crop would lose it
    out = preprocess_image(img, spec)
    assert out.shape == (3, 4, 8) and (out[0, :, 0] == 255).all() and (out[0, :, 1:] == 0).all()
    with pytest.raises(ModelError, match="resize_shorter has no meaning with resize 'squash'"):
        PreprocessSpec.from_dict({"resize": "squash", "resize_shorter": 256})
    with pytest.raises(ModelError, match=r"'resize_shorter' is required .* \"resize\": \"squash\""):
        PreprocessSpec.from_dict({"crop": 224})


def test_fractional_mean_and_std_need_a_scale():
    with pytest.raises(ModelError, match=r'add "scale": 0.00392156862745098 \(1/255\)'):
        PreprocessSpec.from_dict({"resize_shorter": 256, "mean": IMAGENET["mean"], "std": IMAGENET["std"]})
    assert PreprocessSpec.from_dict({"resize_shorter": 256, **IMAGENET}).scale == pytest.approx(1 / 255)
    assert PreprocessSpec.from_dict({"resize_shorter": 256}).std == (1.0,) * 3  # raw 0..255 input stays allowed


def test_output_kind_is_declared_and_canonical_only_when_not_the_default():
    spec = PreprocessSpec.from_dict({"resize_shorter": 256, "output": "probabilities"})
    assert spec.probabilities and spec.to_dict()["output"] == "probabilities"
    assert not PreprocessSpec.from_dict({"resize_shorter": 256, "output": "logits"}).probabilities
    with pytest.raises(ModelError, match="output must be one of logits, probabilities, sigmoid, got 'softmax'"):
        PreprocessSpec.from_dict({"resize_shorter": 256, "output": "softmax"})
    assert np.isfinite(spec.scale)


def test_sigmoid_is_an_output_kind_of_its_own():
    spec = PreprocessSpec.from_json('{"resize_shorter": 256, "output": "sigmoid"}')
    assert spec.sigmoid and not spec.probabilities and spec.to_dict()["output"] == "sigmoid"


@pytest.mark.parametrize("text, problem", [
    ('{"resize_shorter": 256, "mean": NaN}',
     "mean must have 3 values (one per channel) or one for all, finite numbers, got nan"),
    ('{"resize_shorter": 256, "std": [1, Infinity, 1]}',
     "std must have 3 values (one per channel) or one for all, finite numbers, got [1, inf, 1]"),
    ('{"resize_shorter": 256, "scale": -Infinity}', "scale must be a positive finite number, got -inf"),
])
def test_nan_and_infinity_which_pythons_json_reads_are_refused(text, problem):
    with pytest.raises(ModelError) as info:
        PreprocessSpec.from_json(text)
    assert str(info.value) == f"bad preprocessing spec: {problem}"


def test_a_key_written_twice_is_refused_naming_it():
    with pytest.raises(ModelError) as info:
        PreprocessSpec.from_json('{"resize_shorter": 256, "crop": 224, "resize_shorter": 288}')
    assert str(info.value) == ("bad preprocessing spec: 'resize_shorter' is written twice (JSON keeps the last one "
                               "silently); keep one")
