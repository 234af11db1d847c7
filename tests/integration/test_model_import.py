"""`bulk-classify model import` with small networks of each source (random weights made here, nothing downloaded):
the written folder loads like any model folder, the onnx engine's rows follow the framework's own transform and
forward, and every refusal is one line that leaves the output as it was."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest
import timm
import torch
import torchvision
from click.testing import CliRunner

from conftest import PHOTOS
from pipeline.cli import main
from pipeline.engines.onnx import OnnxEngine
from pipeline.errors import ConfigError, ModelError
from pipeline.model.imaging import PreprocessSpec, decode_image
from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE, load_model_folder
from pipeline.model.onnx_graph import run_onnxruntime
from pipeline.model_import import core, timm_source
from pipeline.model_import.core import ImportOptions, ParityFailed, import_model

SHOP = ("shoe", "bag", "hat")  # a user's own taxonomy


def _framework_top1(source: str, name: str, checkpoint, labels=None) -> list[int]:
    """The framework's own transform and forward on the photos, top-1 ids."""
    model = core._loader(source)(name, checkpoint=checkpoint, labels=labels, preset=None)
    files = sorted(p for p in PHOTOS.iterdir() if p.suffix == ".jpg")
    with torch.no_grad():
        logits = model.network(torch.stack([model.transform(decode_image(p.read_bytes())) for p in files]))
    return logits.argmax(dim=1).tolist()


def _engine_top1(folder) -> list[int]:
    files = sorted(p for p in PHOTOS.iterdir() if p.suffix == ".jpg")
    with OnnxEngine(load_model_folder(folder), top_k=1) as engine:
        rows = engine.classify([p.read_bytes() for p in files])
    assert all(r.status == "ok" for r in rows)
    return [r.class_ids[0] for r in rows]


def test_timm_import_through_the_cli_writes_a_folder_the_engines_load(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "test_resnet.pth"
    torch.save({"state_dict": timm.create_model("test_resnet", num_classes=3).state_dict(), "class_names": SHOP},
               checkpoint)
    out = tmp_path / "model"
    result = CliRunner().invoke(main, ["model", "import", "timm", "test_resnet", "--checkpoint", str(checkpoint),
                                       "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "written:" in result.output and "parity on 10 images" in result.output
    assert sorted(p.name for p in out.iterdir()) == sorted([MODEL_FILE, LABELS_FILE, SPEC_FILE])
    bundle = load_model_folder(out)
    assert bundle.labels == SHOP  # the checkpoint's class names
    # timm's pretrained_cfg for test_resnet: 160 px, crop_pct 0.95, bilinear, mean/std 0.5
    spec = json.loads((out / SPEC_FILE).read_text())
    assert (spec["resize_shorter"], spec["crop"], spec["interpolation"]) == (168, [160, 160], "bilinear")
    assert spec["mean"] == [0.5] * 3 and spec["std"] == [0.5] * 3 and spec["scale"] == pytest.approx(1 / 255)
    import onnx

    dims = onnx.load(str(out / MODEL_FILE)).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and not dims[0].dim_value  # a dynamic batch axis
    assert _engine_top1(out) == _framework_top1("timm", "test_resnet", checkpoint)


def test_torchvision_import_with_a_labels_file(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), checkpoint)
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(SHOP) + "\n")
    result = import_model("torchvision", "resnet18", tmp_path / "model", checkpoint=str(checkpoint),
                          labels=str(labels))
    # ResNet18_Weights.DEFAULT's transforms: the shorter side to 256, a 224 crop, bilinear, ImageNet mean/std
    assert result.spec.resize_shorter == 256 and result.spec.crop == (224, 224)
    assert result.spec.interpolation == "bilinear" and result.spec.mean == pytest.approx((0.485, 0.456, 0.406))
    assert result.parity.median_logit_diff < core.DEFAULT_MAX_LOGIT_DIFF and result.parity.export_diff < 1e-4
    assert load_model_folder(result.folder).labels == SHOP
    assert _engine_top1(result.folder) == _framework_top1("torchvision", "resnet18", checkpoint, SHOP)


def test_huggingface_folder_import_takes_labels_and_spec_from_its_files(tmp_path):
    from transformers import ConvNextConfig, ConvNextForImageClassification, ConvNextImageProcessor

    torch.manual_seed(0)
    source = tmp_path / "hf"
    config = ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=3,
                            id2label=dict(enumerate(SHOP)), label2id={s: i for i, s in enumerate(SHOP)})
    ConvNextForImageClassification(config).save_pretrained(source)
    ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=0.875).save_pretrained(source)
    result = import_model("huggingface", str(source), tmp_path / "model")
    # ConvNeXt's processor below 384: the shorter side to 224 / 0.875, then a centred 224 crop
    assert result.spec.resize_shorter == 256 and result.spec.crop == (224, 224)
    assert result.spec.interpolation == "bicubic" and load_model_folder(result.folder).labels == SHOP
    assert _engine_top1(result.folder) == _framework_top1("huggingface", str(source), None)


def test_a_spec_that_does_not_match_the_framework_is_refused_and_nothing_written(tmp_path, monkeypatch):
    torch.manual_seed(0)
    checkpoint = tmp_path / "test_resnet.pth"
    torch.save(timm.create_model("test_resnet").state_dict(), checkpoint)
    translate = timm_source.spec_from_config
    # The classic mistake: ImageNet's mean and std for a network trained with 0.5/0.5.
    monkeypatch.setattr(timm_source, "spec_from_config",
                        lambda config: {**translate(config), "mean": [0.485, 0.456, 0.406],
                                        "std": [0.229, 0.224, 0.225]})
    out = tmp_path / "models" / "shop"
    result = CliRunner().invoke(main, ["model", "import", "timm", "test_resnet", "--checkpoint", str(checkpoint),
                                       "--output", str(out)])
    assert result.exit_code == 3, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "does not classify like the framework" in result.output and "nothing written" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == [checkpoint]  # no half-written folder either


def test_bad_arguments_fail_in_one_line_before_any_work(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "test_resnet.pth"
    torch.save(timm.create_model("test_resnet").state_dict(), checkpoint)
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(SHOP) + "\n")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(ModelError, match=r"has 1000 output classes but there are 3 labels; pass --labels"):
        import_model("timm", "test_resnet", tmp_path / "a", checkpoint=str(checkpoint), labels=str(labels))
    with pytest.raises(ConfigError, match=r"exists and is not an empty folder; pass a new --output"):
        import_model("timm", "test_resnet", full, checkpoint=str(checkpoint))
    with pytest.raises(ConfigError, match=r"timm has no architecture 'resnet_50'; did you mean resnet50"):
        import_model("timm", "resnet_50", tmp_path / "a", checkpoint=str(checkpoint))
    with pytest.raises(ConfigError, match=r"needs --checkpoint FILE .*nothing is downloaded"):
        import_model("torchvision", "resnet18", tmp_path / "a")
    with pytest.raises(ModelError, match=r"does not fit torchvision's resnet18 with 1000 classes: .*missing tensors"):
        import_model("torchvision", "resnet18", tmp_path / "a", checkpoint=str(checkpoint))
    with pytest.raises(ConfigError, match=r"is not a Hugging Face image-classification folder: it lacks config.json"):
        import_model("huggingface", str(tmp_path), tmp_path / "a")
    with pytest.raises(ConfigError, match=r"no images .* under .*none; pass --images FOLDER"):
        import_model("timm", "test_resnet", tmp_path / "a", checkpoint=str(checkpoint),
                     options=ImportOptions(images=str(tmp_path / "none")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "labels.txt", "test_resnet.pth"]
    assert [p.name for p in full.iterdir()] == ["keep.txt"]


def test_parity_numbers():
    framework = np.array([[0.0, 4.0, 1.0], [2.0, 0.0, 1.9], [0.0, 0.0, 0.1]])
    ours = framework + np.array([[0.0, 0.4, 0.0], [0.0, 0.0, 0.3], [0.0, 0.0, 0.0]])
    parity = core.parity_of(framework, ours)
    assert parity.top1_agreement == pytest.approx(2 / 3)  # the second image flips to class 2
    assert parity.decisive == 1 and parity.decisive_agreement == 1.0  # only the first is clearly decided
    assert parity.max_logit_diff == pytest.approx(0.3 / 2.0) and parity.max_abs_logit_diff == pytest.approx(0.4)
    assert parity.median_logit_diff == pytest.approx(0.1)  # 0.4/4, 0.3/2 and 0 of the ranges
    assert parity.problems(ImportOptions()) == ["logits differ by a median 10.0% of their range (allowed 8.0%)"]
    assert parity.problems(ImportOptions(max_logit_diff=0.2)) == []
    broken = dataclasses.replace(parity, export_diff=0.01)
    assert broken.problems(ImportOptions(max_logit_diff=0.2)) == ["the exported network alone differs by 1.0e-02 of the logit range on "
                                                "the framework's own tensors (allowed 1e-03): the ONNX export is wrong"]
    assert isinstance(ParityFailed("x"), ModelError)


def test_a_simplification_that_changes_the_outputs_is_not_kept(monkeypatch):
    import onnxslim
    from onnx import numpy_helper

    slim = onnxslim.slim

    def changing(model):  # what onnxslim 0.1.98 did to EfficientNet-Lite1's real weights: other logits
        out = slim(model)
        last = out.graph.initializer[-1]
        last.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(last) * 2 + 1, last.name))
        return out

    torch.manual_seed(0)
    network = timm.create_model("test_resnet", num_classes=3).eval()
    spec = PreprocessSpec.from_dict(
        {"resize_shorter": 168, "crop": [160, 160], "scale": 1 / 255, "mean": [0.5] * 3, "std": [0.5] * 3})
    batch = np.random.default_rng(1).standard_normal((2, 3, 160, 160)).astype(np.float32)
    with torch.no_grad():
        expected = network(torch.from_numpy(batch)).numpy()
    kept, note = core.export_onnx(network, spec)
    assert note == "onnx: simplified by onnxslim"
    monkeypatch.setattr(onnxslim, "slim", changing)
    kept, note = core.export_onnx(network, spec)
    assert note.startswith("onnx: the exporter's graph (onnxslim's graph changed the outputs by")
    assert np.abs(run_onnxruntime(kept, batch) - expected).max() < 1e-4


def test_timm_checkpoints_as_training_scripts_save_them(tmp_path):
    from safetensors.torch import save_file

    network = timm.create_model("test_resnet")
    train = tmp_path / "model_best.pth.tar"  # timm's train.py: its arguments, the optimizer, the EMA weights
    torch.save({"state_dict": network.state_dict(), "args": argparse.Namespace(model="test_resnet", lr=0.1),
                "optimizer": torch.optim.SGD(network.parameters(), lr=0.1).state_dict(), "epoch": 3}, train)
    save_file(network.state_dict(), tmp_path / "model.safetensors")
    for path in (train, tmp_path / "model.safetensors"):
        state, names, _taken = timm_source.read_checkpoint(path)
        assert set(state) == set(network.state_dict()) and names is None
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match=r"cannot read .*junk.pth as a checkpoint .*save the weights with torch.save"):
        timm_source.read_checkpoint(tmp_path / "junk.pth")


def test_huggingface_vit_squashes_to_its_size_and_passes_model_check(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    from pipeline.model_check import check_model_folder

    torch.manual_seed(0)
    source = tmp_path / "hf"
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       initializer_range=0.2, num_labels=3, id2label=dict(enumerate(SHOP)),
                       label2id={s: i for i, s in enumerate(SHOP)})
    ViTForImageClassification(config).save_pretrained(source)
    ViTImageProcessor().save_pretrained(source)  # 224 x 224, no crop: a squash, bilinear, mean and std 0.5
    result = import_model("huggingface", str(source), tmp_path / "model")
    assert result.spec.resize == "squash" and result.spec.crop == (224, 224)
    assert result.spec.interpolation == "bilinear" and result.spec.mean == (0.5, 0.5, 0.5)
    assert _engine_top1(result.folder) == _framework_top1("huggingface", str(source), None)
    report = check_model_folder(str(result.folder), engines=("onnx",))
    assert report.passed and report.engines[0].agreement == 1.0
