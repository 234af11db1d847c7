"""Issue 41's cases 4-9 with a user's own 37-class model (a small torch CNN exported to ONNX here): each gives the
right rows, or one line on stderr with a non-zero exit and DEST exactly as before; `model check` catches each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.engines.onnx import OnnxEngine
from pipeline.model.imaging import load_and_preprocess
from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE, load_model
from pipeline.model.spec import UNIT_SCALE
from support.paths import PHOTOS

torch = pytest.importorskip("torch")

CLASSES = 37
SIZE = 64
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
SPEC = {"resize_shorter": 73, "crop": SIZE, "interpolation": "bilinear", "scale": UNIT_SCALE, **IMAGENET}
PHOTO_NAMES = ("astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg")


class _Net(torch.nn.Module):
    """37 classes from a [N, 3, 64, 64] (or NHWC) image; ``head``: what follows the logits."""

    def __init__(self, head: str = "logits", nhwc: bool = False):
        super().__init__()
        torch.manual_seed(41)
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 5, stride=4), torch.nn.ReLU(),
                                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.fc = torch.nn.Linear(16, CLASSES)
        with torch.no_grad():
            self.fc.weight.mul_(8.0)  # spread the logits so that top-1 is decided by the image, not rounding
        self.head, self.nhwc = head, nhwc

    def forward(self, x):
        if self.nhwc:
            x = x.permute(0, 3, 1, 2)
        y = self.fc(self.features(x))
        if self.head == "softmax":
            return y.softmax(dim=-1)
        if self.head == "normalized":  # probabilities without a Softmax node: only the sample can tell
            y = torch.relu(y) + 1e-3
            return y / y.sum(dim=-1, keepdim=True)
        return y


def _export(path: Path, net: torch.nn.Module, *, batch: int | None = None, nhwc: bool = False) -> None:
    shape = (batch or 2, SIZE, SIZE, 3) if nhwc else (batch or 2, 3, SIZE, SIZE)
    axes = None if batch else {"image": {0: "batch"}, "scores": {0: "batch"}}
    torch.onnx.export(net.eval(), torch.zeros(shape), str(path), input_names=["image"], output_names=["scores"],
                      dynamic_axes=axes, dynamo=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Model folders by case: one export per network, folders sharing it with other labels or specs."""
    root = tmp_path_factory.mktemp("own-models")
    labels = "\n".join(f"class_{i:02d}" for i in range(CLASSES)) + "\n"
    exports = {"logits": (_Net(), {}), "softmax": (_Net("softmax"), {}), "normalized": (_Net("normalized"), {}),
               "fixed1": (_Net(), {"batch": 1}), "fixed4": (_Net(), {"batch": 4}),
               "nhwc": (_Net(nhwc=True), {"nhwc": True})}
    folders = {}
    for name, (net, options) in exports.items():
        folder = root / name
        folder.mkdir()
        _export(folder / MODEL_FILE, net, **options)
        (folder / LABELS_FILE).write_text(labels)
        (folder / SPEC_FILE).write_text(json.dumps({**SPEC, **({"layout": "NHWC"} if name == "nhwc" else {})}))
        folders[name] = folder

    def variant(name: str, base: str, *, spec: dict | None = None, labels_text: str | None = None) -> None:
        folder = root / name
        shutil.copytree(folders[base], folder)
        if spec is not None:
            (folder / SPEC_FILE).write_text(json.dumps(spec))
        if labels_text is not None:
            (folder / LABELS_FILE).write_text(labels_text)
        folders[name] = folder

    folder = root / "fixed_probabilities"
    folder.mkdir()
    _export(folder / MODEL_FILE, _Net("softmax"), batch=4)
    (folder / LABELS_FILE).write_text(labels)
    (folder / SPEC_FILE).write_text(json.dumps({**SPEC, "output": "probabilities"}))
    folders["fixed_probabilities"] = folder
    variant("probabilities", "softmax", spec={**SPEC, "output": "probabilities"})
    variant("normalized_declared", "normalized", spec={**SPEC, "output": "probabilities"})
    variant("unscaled", "logits", spec={**{k: v for k, v in SPEC.items() if k != "scale"}})
    variant("nhwc_as_nchw", "nhwc", spec=SPEC)
    variant("labels36", "logits", labels_text="\n".join(f"c{i}" for i in range(36)) + "\n")
    variant("timm", "logits", spec={"input_size": [3, SIZE, SIZE], "crop_pct": 0.875, "interpolation": "Bilinear",
                                    "scale": UNIT_SCALE, **IMAGENET})
    variant("squash", "logits", spec={**{k: v for k, v in SPEC.items() if k != "resize_shorter"}, "resize": "squash"})
    return folders


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [(PHOTOS / name).read_bytes() for name in PHOTO_NAMES]


def _ort_rows(folder: Path, photos: list[bytes]) -> np.ndarray:
    """What ONNX Runtime itself gives on the reference inputs, one image at a time (any batch axis runs that)."""
    bundle = load_model(folder)
    session = ort.InferenceSession(str(folder / MODEL_FILE), providers=["CPUExecutionProvider"])
    x = np.stack([load_and_preprocess(p, bundle.spec)[0] for p in photos])
    batch = bundle.fixed_batch or 1
    rows = []
    for i in range(len(x)):
        part = np.concatenate([x[i : i + 1], np.zeros((batch - 1, *x.shape[1:]), np.float32)])
        rows.append(session.run(None, {"image": part})[0][0])
    return np.stack(rows)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _cli(*args: str):
    return CliRunner().invoke(main, list(map(str, args)))


def _run_refused(tmp_path: Path, folder: Path, *extra: str) -> str:
    """`bulk-classify run` with the model: it must fail in one line on stderr and leave DEST as it was."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir(exist_ok=True)
    shutil.copy(PHOTOS / PHOTO_NAMES[0], src / PHOTO_NAMES[0])
    dest.mkdir(exist_ok=True)
    (dest / "keep.txt").write_text("untouched")
    result = _cli("run", src, "--output", dest, "--model", folder, *extra)
    assert result.exit_code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt"] and (dest / "keep.txt").read_text() == "untouched"
    return lines[0]


# ---- case 4: 0..1 mean and std with scale 1 ------------------------------------------------------------------


def test_case4_fractional_mean_and_std_without_scale_are_refused_before_anything_is_written(tmp_path, models):
    line = _run_refused(tmp_path, models["unscaled"], "--engine", "onnx")
    assert '"scale": 0.00392156862745098' in line and SPEC_FILE in line


# ---- case 5: probabilities get no second softmax, on every engine here ----------------------------------------


@pytest.mark.parametrize("engine", ["onnx", "openvino"])
def test_case5_declared_probabilities_are_written_as_the_model_gives_them(models, photos, engine):
    pytest.importorskip(engine)
    from pipeline.engines.registry import make_engine

    expected = _ort_rows(models["probabilities"], photos)
    with make_engine(engine, load_model(models["probabilities"]), top_k=3) as eng:
        results = eng.classify(photos)
    for row, want in zip(results, expected):
        assert row.status == "ok" and row.class_ids[0] == int(want.argmax())
        assert row.scores[0] == pytest.approx(float(want.max()), abs=1e-5)
    assert max(r.scores[0] for r in results) > 3.0 / CLASSES  # the second softmax flattened these to ~1/37


def test_case5_the_triton_head_and_the_gpu_network_skip_softmax_for_probabilities(tmp_path, models, photos):
    from pipeline.gpu.topk_network import TopKNetwork
    from pipeline.triton.repository import add_topk_head
    from pipeline.triton.serve.portable_model import Classifier

    bundle = load_model(models["probabilities"])
    version = tmp_path / "1"
    version.mkdir()
    add_topk_head(bundle.onnx_path, version / MODEL_FILE, k=3, probabilities=True)
    (version / SPEC_FILE).write_text(bundle.spec.to_json())
    lengths = np.array([[len(p)] for p in photos], np.int32)
    images = np.stack([np.frombuffer(p.ljust(int(lengths.max()), b"\0"), np.uint8) for p in photos])
    served = Classifier(version, intra_op_threads=1, decode_threads=1).classify(images, lengths)
    expected = _ort_rows(models["probabilities"], photos)
    np.testing.assert_allclose(served["SCORES"][:, 0], expected.max(axis=1), atol=1e-5)

    net = _Net("softmax")
    topk = TopKNetwork(net, crop=(SIZE, SIZE), device=torch.device("cpu"), half=False, batch_size=4,
                       cuda_graph=False, top_k=3, probabilities=True)
    x = torch.from_numpy(np.stack([load_and_preprocess(p, bundle.spec)[0] for p in photos]))
    scores, _ids = topk.scores(x)
    np.testing.assert_allclose(scores[:, 0].numpy(), net(x).max(dim=-1).values.detach().numpy(), atol=1e-6)


def test_case5_an_undeclared_softmax_is_refused_and_model_check_notices_sums_of_one(tmp_path, models):
    line = _run_refused(tmp_path, models["softmax"], "--engine", "onnx")
    assert '"output": "probabilities"' in line
    result = _cli("model", "check", models["normalized"], "--engine", "onnx", "--sample", 3)
    assert result.exit_code == 1 and "sums to 1" in result.stderr and '"output": "probabilities"' in result.stderr


def test_cases5_and_6_a_job_writes_the_models_own_probabilities_through_its_fixed_batch(tmp_path, models, ray_local,
                                                                                       caplog):
    import pyarrow.dataset as pads

    from pipeline.config import RunConfig
    from pipeline.job import run_job

    src = tmp_path / "src"
    src.mkdir()
    for name in PHOTO_NAMES + ("camera.jpg", "clock.jpg"):  # 6 images: batches of 4, the last padded
        shutil.copy(PHOTOS / name, src / name)
    with caplog.at_level("WARNING"):
        summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "out"), engine="onnx",
                                    model=str(models["fixed_probabilities"]), top_k=3, batch_size=6))
    assert summary.classified == 6
    assert sum("batch axis is fixed at 4" in r.getMessage() for r in caplog.records) == 1
    rows = {r["uri"].rsplit("/", 1)[-1]: r for r in pads.dataset(str(tmp_path / "out"), format="parquet")
            .to_table().to_pylist()}
    names = sorted(rows)
    expected = _ort_rows(models["fixed_probabilities"], [(src / n).read_bytes() for n in names])
    for name, want in zip(names, expected):
        assert rows[name]["status"] == "ok" and rows[name]["class_ids"][0] == int(want.argmax()), name
        assert rows[name]["scores"][0] == pytest.approx(float(want.max()), abs=1e-5), name


# ---- case 6: a fixed batch axis ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fixed1", "fixed4"])
def test_case6_a_fixed_batch_is_used_without_failures(models, photos, name, caplog):
    bundle = load_model(models[name])
    assert bundle.fixed_batch == int(name[-1])
    expected = _softmax(_ort_rows(models[name], photos + photos[:1]))
    with caplog.at_level("WARNING"), OnnxEngine(bundle, top_k=3, max_batch=8) as engine:
        results = engine.classify(photos + photos[:1])  # 5 images: runs of 4 and a padded 1, or five of 1
    assert [r.class_ids[0] for r in results] == list(expected.argmax(axis=1))
    np.testing.assert_allclose([r.scores[0] for r in results], expected.max(axis=1), atol=1e-5)
    assert not [r for r in caplog.records if "retrying" in r.getMessage() or "failed" in r.getMessage()]


def test_case6_the_gpu_network_runs_only_the_fixed_batch_size():
    from pipeline.gpu.topk_network import TopKNetwork

    net, sizes = _Net(), []
    net.register_forward_pre_hook(lambda _module, args: sizes.append(args[0].shape[0]))
    topk = TopKNetwork(net, crop=(SIZE, SIZE), device=torch.device("cpu"), half=False, batch_size=64,
                       cuda_graph=False, top_k=3, fixed_batch=4)
    x = torch.rand(6, 3, SIZE, SIZE)
    scores, ids = topk.scores(x)
    assert sizes == [4, 4]  # 6 images: a run of 4 and a padded one (the hook travels with TopKNetwork's copy)
    want = net(x).softmax(dim=-1).topk(3)
    np.testing.assert_allclose(scores.numpy(), want.values.detach().numpy(), atol=1e-6)
    assert (ids.numpy() == want.indices.numpy()).all()


def test_case6_the_portable_triton_model_pads_a_fixed_batch(tmp_path, models, photos):
    from pipeline.triton.repository import add_topk_head
    from pipeline.triton.serve.portable_model import Classifier

    bundle = load_model(models["fixed4"])
    add_topk_head(bundle.onnx_path, tmp_path / MODEL_FILE, k=3)
    (tmp_path / SPEC_FILE).write_text(bundle.spec.to_json())
    blobs = photos + photos[:2]  # 6: a run of 4 and a padded run of 2
    lengths = np.array([[len(p)] for p in blobs], np.int32)
    images = np.stack([np.frombuffer(p.ljust(int(lengths.max()), b"\0"), np.uint8) for p in blobs])
    served = Classifier(tmp_path, intra_op_threads=1, decode_threads=1).classify(images, lengths)
    expected = _softmax(_ort_rows(models["fixed4"], blobs))
    assert list(served["CLASS_IDS"][:, 0]) == list(expected.argmax(axis=1))


# ---- case 7: the GPU paths' model errors come first, in one line, with advice that works ---------------------


@pytest.mark.parametrize("engine", ["gpu", "triton"])
def test_case7_a_model_the_gpu_paths_cannot_run_fails_before_ray_and_the_output(tmp_path, models, engine):
    pytest.importorskip("nvidia.dali")
    extra = ["--engine-option", "profile=gpu"] if engine == "triton" else []
    line = _run_refused(tmp_path, models["logits"], "--engine", engine, *extra)
    # Its model.onnx converts (tests/integration/test_gpu_user_model.py): what refuses it here is the missing GPU.
    assert "on a GPU" in line and "--engine onnx" in line
    assert "TensorRT" not in line and "--profile" not in line


# ---- case 8: a spec that is easy to write --------------------------------------------------------------------


def test_case8_scalars_timm_fields_and_squash_give_the_reference_rows(models, photos):
    timm = load_model(models["timm"])
    assert timm.spec == load_model(models["logits"]).spec  # input_size + crop_pct 0.875 = resize 73, crop 64
    assert timm.spec.to_dict()["crop"] == [SIZE, SIZE] and "resize" not in timm.spec.to_dict()
    squash = load_model(models["squash"])
    expected = _softmax(_ort_rows(models["squash"], photos))
    with OnnxEngine(squash, top_k=3) as engine:
        results = engine.classify(photos)
    assert [r.class_ids[0] for r in results] == list(expected.argmax(axis=1))


# ---- case 9: quantize calibration sub-folders named with =, #, % and spaces ------------------------------------


def test_case9_calibration_images_under_hive_style_folders_are_read(tmp_path):
    from pipeline.int8.quantize import draw_sample, load_tensors

    src = tmp_path / "calib"
    folders = ["part=0", "date=2026-12-05#1", "x%41y", "with space"]
    for i, folder in enumerate(folders):
        (src / folder).mkdir(parents=True)
        for name in PHOTO_NAMES[:2]:
            shutil.copy(PHOTOS / name, src / folder / f"{i}-{name}")
    sample = draw_sample(str(src), {}, samples=8, calibration_images=4, seed=1, extensions=("jpg",))
    uris = sample.calibration + sample.held_out
    assert any("%3D" in u[0] for u in uris)  # the listing percent-encodes; the reader must decode
    tensors, kept, errors = load_tensors([u[0] for u in uris], {}, load_model(None).spec)
    assert errors == {} and len(kept) == 8 and tensors.shape == (8, 3, 224, 224)


# ---- model check: each mistake in one line -----------------------------------------------------------------


@pytest.mark.parametrize("name, message", [
    ("labels36", "has 36 labels but the model outputs 37 classes"),
    ("unscaled", '"scale": 0.00392156862745098'),
    ("softmax", '"output": "probabilities"'),
    ("nhwc_as_nchw", '"layout": "NHWC"'),
])
def test_model_check_catches_each_mistake_in_one_line(models, name, message):
    result = _cli("model", "check", models[name], "--engine", "onnx", "--sample", 2)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and message in lines[0], result.stderr


def test_model_check_passes_a_good_model_and_notes_a_fixed_batch(models):
    result = _cli("model", "check", models["fixed4"], "--engine", "onnx", "--engine", "openvino", "--sample", 5)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "batch axis is fixed at 4" in out and out.count("note:") == 1
    assert [line.split()[0] for line in out.splitlines() if line.endswith("ok")][:2] == ["onnx", "openvino"]
    assert "100.0%" in out
    declared = _cli("model", "check", models["normalized_declared"], "--engine", "onnx", "--sample", 3)
    assert declared.exit_code == 0, declared.output
