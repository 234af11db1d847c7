"""Model repositories: the committed profiles are what the generator writes and pass the schema/wiring check;
broken wiring is caught with a precise message; the softmax/top-k head; TensorRT plan keying."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import ConfigError, ModelError
from pipeline.model.folder import load_model
from pipeline.schema import DEFAULT_TOP_K
from pipeline.triton import contract as tn
from pipeline.triton.checks import check_repository
from pipeline.triton.plans import PlanKey, find_plan, write_plan_key
from pipeline.triton.repository import CONFIG_FILE, add_topk_head, build_repository
from support.paths import REPO

MODEL_REPOSITORY = REPO / "model_repository"
COMMITTED_PROFILES = ("portable", "production")


def repository_top_k(path) -> int:
    """The k the repository's classifier returns: the dims of its SCORES output."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((Path(path) / tn.MODEL_NAME / CONFIG_FILE).read_text(), model_config_pb2.ModelConfig())
    return next(int(t.dims[0]) for t in config.output if t.name == tn.OUTPUT_SCORES)


@pytest.fixture(scope="module")
def production(tmp_path_factory) -> Path:
    return build_repository("production", None, str(tmp_path_factory.mktemp("production")), artifacts=False)


@pytest.mark.parametrize("profile", COMMITTED_PROFILES)
def test_committed_profile_is_what_the_generator_writes(profile, tmp_path):
    """Configs come from pipeline.triton.contract: a hand edit of the committed files (or of the names) shows here."""
    fresh = build_repository(profile, None, str(tmp_path), artifacts=False, error_output=True)
    committed = MODEL_REPOSITORY / profile
    fresh_files = {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*") if p.is_file()}
    committed_files = {p.relative_to(committed): p.read_text() for p in committed.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts}
    assert fresh_files == committed_files, f"regenerate with: bulk-classify repo build --profile {profile}"


def test_committed_and_generated_repositories_pass_the_check():
    checked = check_repository(str(MODEL_REPOSITORY))  # a folder of profiles
    assert {"portable/classifier", "production/classifier", "production/classifier_trt",
            "production/preprocess", "gpu/classifier"} <= set(checked)
    assert set(check_repository(None)) == {"gpu/classifier", "portable/classifier", "production/classifier",
                                           "production/classifier_trt", "production/preprocess"}
    assert check_repository(str(MODEL_REPOSITORY / "production")) == ["classifier", "classifier_trt", "preprocess"]
    assert repository_top_k(MODEL_REPOSITORY / "portable") == DEFAULT_TOP_K


def _edit(repo: Path, model: str, old: str, new: str) -> None:
    path = repo / model / "config.pbtxt"
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("model", "old", "new", "message"),
    [
        ("classifier", "max_batch_size: 64", "max_batch_size: 64 nonsense_field: 1", "not a valid Triton model config"),
        ("classifier", 'model_name: "classifier_trt"', 'model_name: "classifier_fp8"',
         "uses model 'classifier_fp8', which is not in"),
        ("classifier", 'value: "WIDTH"\n    }\n  }\n  step',
         'value: "WIDTH"\n    }\n    output_map {\n      key: "NOPE"\n      value: "NOPE"\n    }\n  }\n  step',
         "maps output 'NOPE', which the model does not have"),
        ("classifier_trt", "data_type: TYPE_FP32\n  dims: 3", "data_type: TYPE_FP16\n  dims: 3",
         "'PREPROCESSED' is TYPE_FP32 \\[3, 224, 224\\] but 'classifier_trt' input 'input' wants TYPE_FP16"),
        ("preprocess", 'name: "WIDTH"\n  data_type: TYPE_INT32', 'name: "WIDTH"\n  data_type: TYPE_INT64',
         "ensemble output 'WIDTH' is TYPE_INT32 \\[1\\] but step 'preprocess' produces TYPE_INT64"),
        ("classifier", 'name: "SCORES"\n  data_type: TYPE_FP32\n  dims: 5', 'name: "SCORES"\n  data_type: TYPE_FP32\n  dims: 3',
         "ensemble output 'SCORES' is TYPE_FP32 \\[3\\] but step 'classifier_trt' produces TYPE_FP32 \\[5\\]"),
        ("classifier", 'name: "preprocess"', 'name: "preprocess_x"', "step 0 uses model 'preprocess_x'"),
        ("preprocess", 'name: "preprocess"', 'name: "other"', "differs from its folder 'preprocess'"),
    ],
)
def test_broken_wiring_is_reported_precisely(production, tmp_path, model, old, new, message):
    repo = Path(shutil.copytree(production, tmp_path / "repo"))
    _edit(repo, model, old, new)
    with pytest.raises(ModelError, match=message):
        check_repository(str(repo))


def test_contract_violation_in_the_served_model_is_reported(tmp_path):
    repo = build_repository("portable", None, str(tmp_path), artifacts=False)
    _edit(repo, tn.MODEL_NAME, 'name: "LENGTH"\n  data_type: TYPE_INT32', 'name: "LENGTH"\n  data_type: TYPE_INT64')
    with pytest.raises(ModelError, match=r"input LENGTH must be TYPE_INT32 \[1\], got TYPE_INT64 \[1\]"):
        check_repository(str(repo))


def test_empty_or_missing_repository_is_an_error(tmp_path):
    with pytest.raises(ModelError, match="has no <model>/config.pbtxt"):
        check_repository(str(tmp_path))
    with pytest.raises(ModelError, match="is not a folder"):
        check_repository(str(tmp_path / "missing"))


def test_build_rejects_unknown_profile_and_bad_top_k(tmp_path):
    with pytest.raises(ConfigError, match="unknown profile 'fast'; use one of portable, production, gpu"):
        build_repository("fast", None, str(tmp_path))
    with pytest.raises(ConfigError, match="top_k=0"):
        build_repository("portable", None, str(tmp_path), top_k=0)


def test_topk_head_gives_softmax_probabilities_of_the_logits(tmp_path):
    import onnxruntime as ort

    bundle = load_model(None)
    head = add_topk_head(bundle.onnx_path, tmp_path / "head.onnx", k=7)
    x = np.random.default_rng(0).standard_normal((3, *bundle.spec.input_shape)).astype(np.float32)
    logits = ort.InferenceSession(str(bundle.onnx_path)).run(None, {bundle.input_name: x})[0]
    scores, ids = ort.InferenceSession(str(head)).run([tn.OUTPUT_SCORES, tn.OUTPUT_CLASS_IDS], {bundle.input_name: x})
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    want_ids = np.argsort(-probs, axis=1)[:, :7]
    assert ids.dtype == np.int32 and ids.shape == (3, 7)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, np.take_along_axis(probs, want_ids, axis=1), atol=1e-6)
    with pytest.raises(ConfigError, match="between 1 and the model's 1000 classes"):
        add_topk_head(bundle.onnx_path, tmp_path / "bad.onnx", k=1001)


def test_plan_key_names_the_plan_by_architecture_and_tensorrt():
    key = PlanKey("9.0", "10.3.0")
    assert key.filename == "model.sm90.trt10.3.plan"
    assert key.json_filename == "model.sm90.trt10.3.json"


def _plan(model_dir: Path, key: PlanKey) -> Path:
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / key.filename).write_bytes(b"plan bytes")
    write_plan_key(model_dir, key, precision="fp16")
    return model_dir / "1" / key.filename


def test_find_plan_matches_the_machine_or_fails_fast_naming_both(tmp_path):
    h200 = PlanKey("9.0", "10.3.0")
    a100 = PlanKey("8.0", "10.3.0")
    plan = _plan(tmp_path, h200)
    assert json.loads((tmp_path / "1" / h200.json_filename).read_text())["compute_capability"] == "9.0"
    assert find_plan(tmp_path, h200) == plan
    with pytest.raises(ModelError, match=r"no TensorRT plan for this machine \(compute capability 8.0, TensorRT "
                                         r"10.3.0\); it has: sm9.0 TensorRT 10.3.0\. Plans only load where"):
        find_plan(tmp_path, a100)
    # Same architecture, another TensorRT patch release: plans are not portable across versions either.
    with pytest.raises(ModelError, match="TensorRT 10.3.1"):
        find_plan(tmp_path, PlanKey("9.0", "10.3.1"))
    with pytest.raises(ModelError, match="it has: none"):
        find_plan(tmp_path / "elsewhere", h200)


def test_the_engine_builds_each_profile_once_into_the_cache(tmp_path):
    """`--engine triton` builds its profile's repository once per model, top-k and shape, and every actor and later
    run reuses it (a shared server is found by its repository's path)."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.triton.profiles import PROFILES
    from pipeline.triton.repository_cache import cached_repository

    bundle = load_model(None)
    portable, gpu = PROFILES["portable"], PROFILES["gpu"]
    with ThreadPoolExecutor(4) as pool:  # actors of one node asking at once get one folder
        built = set(pool.map(lambda _: cached_repository(portable, bundle, top_k=5, cache_dir=tmp_path), range(4)))
    assert len(built) == 1
    folder = built.pop()
    assert check_repository(str(folder)) == ["classifier"] and repository_top_k(str(folder)) == 5
    assert cached_repository(portable, bundle, top_k=5, cache_dir=tmp_path) == folder
    assert cached_repository(portable, bundle, top_k=7, cache_dir=tmp_path) != folder
    assert not list((tmp_path / "repositories").glob(".build-*"))  # no half-built folder left
    served = cached_repository(gpu, bundle, top_k=5, cache_dir=tmp_path)
    text = (served / tn.MODEL_NAME / "config.pbtxt").read_text()
    assert f"count: {gpu.instances}" in text and f'string_value: "{gpu.max_backlog:g}"' in text
    assert not (served / tn.MODEL_NAME / "1" / "model.torchscript").exists()  # the default network, from its weights
    assert 'key: "half"' not in text  # the precision gate's verdict per network
    forced = cached_repository(gpu, bundle, top_k=5, cache_dir=tmp_path, half=True)  # --engine-option half=true
    assert forced != served and 'key: "half"\n  value {\n    string_value: "true"' in (
        forced / tn.MODEL_NAME / "config.pbtxt").read_text()
    with pytest.raises(ConfigError, match="half is the gpu profile's"):
        cached_repository(portable, bundle, top_k=5, cache_dir=tmp_path, half=False)
    from pipeline.triton.client_checks import check_model

    for served in ({"url": "127.0.0.1:8001"}, {"repository": str(served)}):  # built already: its precision holds
        with pytest.raises(ConfigError, match="half sets the precision of a repository the engine builds"):
            check_model(bundle, {**served, "half": True}, (1, "this machine"))
