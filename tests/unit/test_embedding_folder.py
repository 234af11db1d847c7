"""A model folder's embedding (preprocess.json's "embedding"): the spec's field, the refusals at load and in the
contract (each message), the graph a runtime loads to fetch an intermediate tensor, and the L2 normalisation, on small
real ONNX graphs run by ONNX Runtime over the repository's photos."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import PHOTOS
from pipeline.errors import ModelError
from pipeline.model.contract import check_contract, reference_run
from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE, load_model_folder
from pipeline.model.imaging import load_and_preprocess
from pipeline.model.onnx_graph import network_outputs, runtime_graph
from pipeline.model.scores import embeddings_of
from pipeline.model.spec import EmbeddingSpec, PreprocessSpec

SIZE, CHANNELS, FEATURES, CLASSES = 16, 3, 4, 3
SPEC = {"resize_shorter": SIZE, "crop": SIZE, "interpolation": "bilinear", "scale": 1 / 255}


def _network(extra_outputs: tuple[str, ...] = (), batch: int | str = "batch"):
    """image -> 1x1 Conv -> Relu ("act", 4-D) -> GlobalAveragePool ("pooled", 4-D) -> Flatten ("features", [N, 4])
    -> Gemm -> "logits"; beside it "exploded" (features / 0: never finite) and "wide" (act reshaped by a computed
    shape to [N, 1024], a width shape inference cannot know). ``extra_outputs`` become graph outputs too; ``batch``
    a number fixes the batch axis."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.normal(0, 1, (FEATURES, CHANNELS, 1, 1)).astype(np.float32), "conv_w"),
             numpy_helper.from_array(rng.normal(0, 1, FEATURES).astype(np.float32), "conv_b"),
             numpy_helper.from_array(rng.normal(0, 2, (CLASSES, FEATURES)).astype(np.float32), "fc_w"),
             numpy_helper.from_array(rng.normal(0, 1, CLASSES).astype(np.float32), "fc_b"),
             numpy_helper.from_array(np.zeros(1, np.float32), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "first"),
             numpy_helper.from_array(np.array([-1], np.int64), "rest")]
    nodes = [helper.make_node("Conv", ["image", "conv_w", "conv_b"], ["fmap"]),
             helper.make_node("Relu", ["fmap"], ["act"]),
             helper.make_node("GlobalAveragePool", ["act"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["features"]),
             helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"], transB=1),
             helper.make_node("Div", ["features", "zero"], ["exploded"]),
             helper.make_node("Shape", ["act"], ["act_shape"]),
             helper.make_node("Gather", ["act_shape", "first"], ["batch"]),
             helper.make_node("Concat", ["batch", "rest"], ["wide_shape"], axis=0),
             helper.make_node("Reshape", ["act", "wide_shape"], ["wide"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, CLASSES])]
    outputs += [helper.make_empty_tensor_value_info(name) for name in extra_outputs]
    graph = helper.make_graph(nodes, "embedder", [helper.make_tensor_value_info(
        "image", TensorProto.FLOAT, [batch, CHANNELS, SIZE, SIZE])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _folder(tmp_path: Path, embedding: dict | None, *, extra_outputs: tuple[str, ...] = (), external: bool = False,
            name: str = "m", batch: int | str = "batch") -> Path:
    import onnx

    folder = tmp_path / name
    folder.mkdir()
    network = _network(extra_outputs, batch)
    if external:
        onnx.save_model(network, str(folder / MODEL_FILE), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    else:
        onnx.save_model(network, str(folder / MODEL_FILE))
    (folder / LABELS_FILE).write_text("a\nb\nc\n")
    spec = dict(SPEC, **({"embedding": embedding} if embedding is not None else {}))
    (folder / SPEC_FILE).write_text(json.dumps(spec))
    return folder


def _photos() -> np.ndarray:
    spec = PreprocessSpec.from_dict(SPEC)
    return np.stack([load_and_preprocess(p.read_bytes(), spec)[0] for p in sorted(PHOTOS.glob("*.jpg"))])


def test_the_spec_field_reads_and_refuses_in_one_line():
    spec = PreprocessSpec.from_dict(dict(SPEC, embedding={"output": "features", "dim": 4}))
    assert spec.embedding == EmbeddingSpec(output="features", dim=4, normalize=True)
    assert spec.to_dict()["embedding"] == {"output": "features", "dim": 4, "normalize": True}
    assert "embedding" not in PreprocessSpec.from_dict(SPEC).to_dict()  # old specs keep their canonical form
    with pytest.raises(ModelError, match=r'"embedding" must be \{"output": TENSOR, "dim": WIDTH'):
        PreprocessSpec.from_dict(dict(SPEC, embedding={"output": "features"}))
    with pytest.raises(ModelError, match=r"embedding.dim must be a positive integer \(the tensor's width\), got 0"):
        PreprocessSpec.from_dict(dict(SPEC, embedding={"output": "features", "dim": 0}))


def test_an_intermediate_tensor_loads_and_runs_like_the_same_tensor_as_a_graph_output(tmp_path):
    inner = check_contract(_folder(tmp_path, {"output": "features", "dim": FEATURES}, name="inner"))
    outer = check_contract(_folder(tmp_path, {"output": "features", "dim": FEATURES}, name="outer",
                                   extra_outputs=("features",)))
    assert network_outputs(inner) == ("logits", "features") == network_outputs(outer)
    assert isinstance(runtime_graph(inner), bytes)  # the tensor added as an output
    assert runtime_graph(outer) == str(outer.onnx_path)  # already one: the file itself
    photos = _photos()
    logits_in, emb_in = reference_run(inner, photos)
    logits_out, emb_out = reference_run(outer, photos)
    assert emb_in.shape == (len(photos), FEATURES)
    np.testing.assert_array_equal(emb_in, emb_out)
    np.testing.assert_array_equal(logits_in, logits_out)
    # the features are the pooled activations: the mean over the image of relu(conv(x))
    weights = {t.name: t for t in _network().graph.initializer}
    from onnx import numpy_helper

    w, b = (numpy_helper.to_array(weights[n]) for n in ("conv_w", "conv_b"))
    expected = np.maximum(np.einsum("fc,nchw->nfhw", w[:, :, 0, 0], photos) + b[None, :, None, None], 0).mean((2, 3))
    np.testing.assert_allclose(emb_in, expected, rtol=1e-5, atol=1e-6)


def test_external_data_models_fetch_an_intermediate_embedding(tmp_path):
    folder = _folder(tmp_path, {"output": "features", "dim": FEATURES}, external=True)
    bundle = check_contract(folder)
    assert bundle.data_files == ("weights.bin",)
    plain = check_contract(_folder(tmp_path, {"output": "features", "dim": FEATURES}, name="plain"))
    photos = _photos()
    np.testing.assert_array_equal(reference_run(bundle, photos)[1], reference_run(plain, photos)[1])


def test_a_fixed_batch_runs_the_embedding_in_padded_runs_and_the_declaration_is_part_of_the_digest(tmp_path):
    dynamic = check_contract(_folder(tmp_path, {"output": "features", "dim": FEATURES}, name="dynamic"))
    fixed = check_contract(_folder(tmp_path, {"output": "features", "dim": FEATURES}, name="fixed", batch=4))
    assert fixed.fixed_batch == 4
    photos = _photos()  # 10: runs of 4, 4 and 2 padded to 4
    for got, want in zip(reference_run(fixed, photos), reference_run(dynamic, photos)):
        assert got.shape == want.shape and got.shape[0] == len(photos)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    plain = load_model_folder(_folder(tmp_path, None, name="plain"))
    other = load_model_folder(_folder(tmp_path, {"output": "features", "dim": FEATURES, "normalize": False},
                                      name="other"))
    assert len({plain.digest, dynamic.digest, other.digest}) == 3  # a declaration changes what the rows hold


def test_two_outputs_without_a_declaration_name_the_field(tmp_path):
    with pytest.raises(ModelError, match=r'has 1 inputs and 2 outputs; .* \(or declare the second as the embedding: '
                                         r'"embedding": \{"output": NAME, "dim": WIDTH\} in preprocess.json\)'):
        load_model_folder(_folder(tmp_path, None, extra_outputs=("features",)))


@pytest.mark.parametrize(("embedding", "message"), [
    ({"output": "nope", "dim": 4},
     r"declares embedding 'nope', but model.onnx has no tensor of that name \(its outputs: 'logits'\); name a graph "
     r"output or a node's output, or re-import with bulk-classify model import --embedding$"),
    ({"output": "logits", "dim": 3},
     r"declares embedding 'logits', which is the class output; name the tensor of the features before the classifier"),
    ({"output": "features", "dim": 8},
     r"declares embedding 'features' of dim 8, but the tensor is 4 wide; set \"dim\": 4$"),
    ({"output": "pooled", "dim": 4},
     r"declares embedding 'pooled', of shape \[\?, 4, 1, 1\], not \[batch, 4\]; pool and flatten it in the graph "
     r"\(GlobalAveragePool \+ Flatten\) or name the pooled tensor after it$"),
    ({"output": "act", "dim": 4},
     r"declares embedding 'act', of shape \[\?, 4, 16, 16\], not \[batch, 4\]; pool and flatten it"),
])
def test_a_bad_declaration_is_refused_at_load_in_one_line(tmp_path, embedding, message):
    folder = _folder(tmp_path, embedding)
    with pytest.raises(ModelError, match=message) as caught:
        load_model_folder(folder)
    assert "\n" not in str(caught.value) and str(folder / SPEC_FILE) in str(caught.value)


def test_the_contract_refuses_a_width_only_the_network_shows_and_a_non_finite_embedding(tmp_path):
    wide = _folder(tmp_path, {"output": "wide", "dim": 4}, name="wide")
    load_model_folder(wide)  # shape inference cannot tell its width
    with pytest.raises(ModelError, match=r"declares embedding 'wide' of dim 4, but the network returns shape "
                                         r"\[2, 1024\] for 2 images; set \"dim\": 1024$"):
        check_contract(wide)
    exploded = _folder(tmp_path, {"output": "exploded", "dim": 4}, name="exploded")
    with pytest.raises(ModelError, match=r"declares embedding 'exploded', but the network's embedding is NaN or "
                                         r"infinite for 2 of the 2 sample images; check its weights"):
        check_contract(exploded)


def test_embeddings_are_float32_unit_rows_a_zero_row_stays_zero_and_a_non_finite_one_stays_non_finite():
    spec = EmbeddingSpec(output="e", dim=3)
    values = np.array([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0], [1.0, np.nan, 0.0], [np.inf, 1.0, 0.0],
                       [1e-30, 0.0, 0.0], [3e38, 3e38, 0.0]], np.float32)
    out = embeddings_of(values, spec)
    assert out.dtype == np.float32 and out.shape == (6, 3)
    np.testing.assert_allclose(out[0], [0.6, 0.8, 0.0], rtol=1e-7)
    np.testing.assert_array_equal(out[1], [0.0, 0.0, 0.0])
    assert not np.isfinite(out[2]).all() and not np.isfinite(out[3]).all()
    np.testing.assert_allclose(out[4], [1.0, 0.0, 0.0])  # tiny and huge rows normalise too
    np.testing.assert_allclose(out[5], [2 ** -0.5, 2 ** -0.5, 0.0], rtol=1e-6)
    raw = embeddings_of(values[:1], EmbeddingSpec(output="e", dim=3, normalize=False))
    np.testing.assert_array_equal(raw, values[:1])
    with pytest.raises(ValueError, match=r"embedding 'e' must be \(batch, 3\), got shape \(2, 4\)"):
        embeddings_of(np.zeros((2, 4)), spec)


def test_model_check_prints_the_embedding_and_compares_each_engines_with_the_reference(tmp_path, monkeypatch):
    from pipeline.model_check import check_model_folder, format_report

    inner = _folder(tmp_path, {"output": "features", "dim": FEATURES}, name="inner")
    report = check_model_folder(str(inner), engines=("onnx",), images=str(PHOTOS))
    assert report.passed
    assert report.engines[0].min_cosine > 1 - 1e-6  # the engine's embeddings against ONNX Runtime's own tensor
    text = format_report(report).splitlines()
    assert text[1] == "embedding: tensor 'features' (an intermediate tensor), dim 4, L2-normalised"
    assert "embedding cos" in text[2] and text[3].split()[4] == f"{report.engines[0].min_cosine:.6f}"
    outer = _folder(tmp_path, {"output": "features", "dim": FEATURES, "normalize": False}, name="outer",
                    extra_outputs=("features",))
    assert format_report(check_model_folder(str(outer), engines=("onnx",), images=str(PHOTOS))).splitlines()[1] \
        == "embedding: tensor 'features' (a graph output), dim 4, as given (not normalised)"
    # an engine whose embeddings go wrong fails the check
    from pipeline.engines import onnx

    real = onnx.attach_embeddings
    monkeypatch.setattr(onnx, "attach_embeddings", lambda results, values, spec: real(results, values[:, ::-1], spec))
    broken = check_model_folder(str(inner), engines=("onnx",), images=str(PHOTOS))
    assert not broken.passed and broken.engines[0].problem.startswith("an embedding's cosine with the reference's")
