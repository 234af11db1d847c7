"""`bulk-classify model import --embedding` with small networks (random weights made here, nothing downloaded): the
pooled pre-logits features become a second ONNX output declared in preprocess.json, ONNX Runtime gives the
framework's features on the repository's photos, a user's declaration of the same tensor inside the graph gives the
same vectors through ``runtime_graph`` (external data too), and a mismatch or a network without features is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import timm
import torch
import torchvision
from click.testing import CliRunner

from conftest import PHOTOS
from pipeline.cli import main
from pipeline.errors import ModelError, ParityFailed
from pipeline.model.contract import check_contract, reference_run
from pipeline.model.folder import LABELS_FILE, MODEL_FILE, ONNX_EMBEDDING, ONNX_OUTPUT, SPEC_FILE
from pipeline.model.imaging import load_and_preprocess
from pipeline.model.onnx_graph import runtime_graph
from pipeline.model.scores import embeddings_of
from pipeline.model_import import core
from pipeline.model_import.core import import_model

SHOP = ("shoe", "bag", "hat")
MIN_COSINE = 0.9999  # the same input tensors through torch and ONNX Runtime: float32 rounding only


def _photos(spec) -> np.ndarray:
    """The photos as this folder's preprocessing makes them (the same tensors go to torch and to ONNX Runtime)."""
    return np.stack([load_and_preprocess(p.read_bytes(), spec)[0] for p in sorted(PHOTOS.glob("*.jpg"))])


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """timm's test_resnet (random weights, 3 classes): its checkpoint and the network."""
    torch.manual_seed(0)
    network = timm.create_model("test_resnet", num_classes=3).eval()
    checkpoint = tmp_path_factory.mktemp("ckpt") / "test_resnet.pth"
    torch.save({"state_dict": network.state_dict(), "class_names": SHOP}, checkpoint)
    return checkpoint, network


def test_timm_import_with_embedding_gives_torchs_pre_logits_features(tmp_path, resnet):
    checkpoint, network = resnet
    out = tmp_path / "model"
    result = CliRunner().invoke(main, ["model", "import", "timm", "test_resnet", "--checkpoint", str(checkpoint),
                                       "--output", str(out), "--embedding"])
    assert result.exit_code == 0, result.output
    assert f"embedding {ONNX_EMBEDDING!r} ({network.num_features} features, L2-normalised" in result.output
    assert sorted(p.name for p in out.iterdir()) == sorted([MODEL_FILE, LABELS_FILE, SPEC_FILE])
    declared = json.loads((out / SPEC_FILE).read_text())["embedding"]
    assert declared == {"output": ONNX_EMBEDDING, "dim": network.num_features, "normalize": True}
    import onnx

    assert [o.name for o in onnx.load(str(out / MODEL_FILE)).graph.output] == [ONNX_OUTPUT, ONNX_EMBEDDING]

    bundle = check_contract(out)  # the driver's contract runs the embedding too
    assert runtime_graph(bundle) == str(bundle.onnx_path)  # a graph output already: the file itself
    photos = _photos(bundle.spec)
    logits, features = reference_run(bundle, photos)
    with torch.no_grad():
        x = torch.from_numpy(photos)
        expected = network.forward_head(network.forward_features(x), pre_logits=True).numpy()
        expected_logits = network(x).numpy()
    assert features.shape == (len(photos), network.num_features) == expected.shape
    assert _cosines(features, expected).min() > MIN_COSINE
    np.testing.assert_allclose(features, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-4, atol=1e-5)
    unit = embeddings_of(features, bundle.spec.embedding)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-6)


def test_a_users_intermediate_tensor_gives_the_same_vectors_through_runtime_graph(tmp_path, resnet):
    import onnx

    checkpoint, _ = resnet
    declared = import_model("timm", "test_resnet", tmp_path / "declared", checkpoint=str(checkpoint),
                            embedding=True).folder
    plain = import_model("timm", "test_resnet", tmp_path / "plain", checkpoint=str(checkpoint)).folder
    model = onnx.load(str(plain / MODEL_FILE))
    assert [o.name for o in model.graph.output] == [ONNX_OUTPUT]
    # what a user does: name the tensor that feeds the classifier (the Gemm's input), a node's output
    head = next(n for n in model.graph.node if ONNX_OUTPUT in n.output)
    assert head.op_type == "Gemm"
    tensor = head.input[0]
    spec = json.loads((plain / SPEC_FILE).read_text())
    spec["embedding"] = {"output": tensor, "dim": 96}
    (plain / SPEC_FILE).write_text(json.dumps(spec))
    external = tmp_path / "external"  # the same folder with its weights in an external data file
    external.mkdir()
    onnx.save_model(model, str(external / MODEL_FILE), save_as_external_data=True, location="weights.bin",
                    size_threshold=0)
    for name in (LABELS_FILE, SPEC_FILE):
        (external / name).write_bytes((plain / name).read_bytes())

    reference = check_contract(declared)
    photos = _photos(reference.spec)
    expected = reference_run(reference, photos)[1]
    for folder in (plain, external):
        bundle = check_contract(folder)
        assert isinstance(runtime_graph(bundle), bytes)  # the tensor added as a graph output
        logits, features = reference_run(bundle, photos)
        assert _cosines(features, expected).min() > MIN_COSINE
        np.testing.assert_allclose(features, expected, rtol=1e-5, atol=1e-6)
    assert check_contract(external).data_files == ("weights.bin",)


def test_torchvision_and_huggingface_embeddings_are_the_input_of_the_final_linear(tmp_path):
    from transformers import ConvNextConfig, ConvNextForImageClassification, ConvNextImageProcessor

    torch.manual_seed(0)
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"{s}\n" for s in SHOP))
    resnet = torchvision.models.resnet18(num_classes=3).eval()
    checkpoint = tmp_path / "resnet18.pth"
    torch.save(resnet.state_dict(), checkpoint)
    tv = import_model("torchvision", "resnet18", tmp_path / "tv", checkpoint=str(checkpoint), labels=str(labels),
                      embedding=True)
    assert tv.spec.embedding.dim == 512 and tv.parity.embedding.median_cosine > 0.999
    pooled = torch.nn.Sequential(*list(resnet.children())[:-1])  # everything before fc

    source = tmp_path / "hf"
    config = ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=3,
                            id2label=dict(enumerate(SHOP)), label2id={s: i for i, s in enumerate(SHOP)})
    hf_model = ConvNextForImageClassification(config).eval()
    hf_model.save_pretrained(source)
    ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=0.875).save_pretrained(source)
    hf = import_model("huggingface", str(source), tmp_path / "hfmodel", embedding=True)
    assert hf.spec.embedding.dim == 64

    for result, features_of in ((tv, lambda x: pooled(x).flatten(1)),
                                (hf, lambda x: hf_model.convnext(pixel_values=x).pooler_output)):
        bundle = check_contract(result.folder)
        photos = _photos(bundle.spec)
        with torch.no_grad():
            expected = features_of(torch.from_numpy(photos)).numpy()
        assert _cosines(reference_run(bundle, photos)[1], expected).min() > MIN_COSINE


def test_an_embedding_unlike_the_frameworks_is_refused_and_nothing_written(tmp_path, resnet, monkeypatch):
    checkpoint, _ = resnet
    export = core.export_onnx

    class Reversed(torch.nn.Module):  # an export whose features come out in another order
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            logits, features = self.inner(x)
            return logits, features.flip(1)

    monkeypatch.setattr(core, "export_onnx", lambda network, spec: export(Reversed(network), spec))
    out = tmp_path / "model"
    with pytest.raises(ParityFailed, match=r"the exported embedding alone differs from the framework's features on "
                                           r"its own tensors \(cosine .*\): the ONNX export is wrong.*nothing written"):
        import_model("timm", "test_resnet", out, checkpoint=str(checkpoint), embedding=True)
    assert not out.exists()


def test_a_network_without_a_final_linear_is_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "squeezenet.pth"
    torch.save(torchvision.models.squeezenet1_1(num_classes=3).state_dict(), checkpoint)
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"{s}\n" for s in SHOP))
    with pytest.raises(ModelError, match=r"^torchvision squeezenet1_1 from squeezenet.pth has no final Linear layer "
                                         r"whose input is its pooled features, so --embedding cannot find them; "
                                         r"import it without --embedding and declare a tensor of its model.onnx as "
                                         r'"embedding" in preprocess.json$'):
        import_model("torchvision", "squeezenet1_1", tmp_path / "model", checkpoint=str(checkpoint),
                     labels=str(labels), embedding=True)
    assert not (tmp_path / "model").exists()
