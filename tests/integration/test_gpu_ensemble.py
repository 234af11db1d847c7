"""The gpu profile's ensemble shape (tests/benchmarks/gpu_ensemble.py: preprocess + network python models joined by an
ensemble) in a real tritonserver, on the CPU.

Serving the hop (tests/benchmarks/hop_model.py), both models run without torch or DALI: preprocess triages and writes a number derived from
each file's bytes into its tensor, the network model turns it into classes, so every answer can be checked against
its own image (as tests/integration/test_gpu_stream.py does for the single shape). With torch installed, the default network
runs (DALI's CPU backend, torch on the CPU) and must agree with the single shape.
"""

from __future__ import annotations


import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.engines.triton import TritonEngine
from pipeline.errors import ConfigError
from pipeline.model.folder import SPEC_FILE, load_model
from pipeline.triton import contract as tn
from pipeline.triton.repository import build_gpu_repository
from pipeline.triton.server import TritonServer
from support.oddities import encode, photo
from test_gpu_stream import _check, _classify_together, _images, serve_hop
from gpu_ensemble import NETWORK_MODEL, build_ensemble_repository  # test_gpu_stream puts tests/benchmarks on the path


def _repo(path, shape="ensemble", **options):
    """A gpu repository on KIND_CPU, FP32 between the models (what the CPU runs)."""
    build = build_ensemble_repository if shape == "ensemble" else build_gpu_repository
    repo = build(None, path, half="false", **options)
    for config in repo.glob("*/config.pbtxt"):
        config.write_text(config.read_text().replace("KIND_GPU", "KIND_CPU"))
    return repo


def _hop_repo(path, **options):
    """The ensemble on KIND_CPU serving the hop: no torch, no DALI."""
    return serve_hop(_repo(path, **options))


def test_the_ensemble_shape_is_three_models_with_gpu_tensors_between_them(tmp_path):
    repo = build_ensemble_repository(None, tmp_path / "repo", network_instances=2)
    assert sorted(p.name for p in repo.iterdir()) == [tn.MODEL_NAME, NETWORK_MODEL, tn.PREPROCESS_MODEL]
    ensemble = (repo / tn.MODEL_NAME / "config.pbtxt").read_text()
    network = (repo / NETWORK_MODEL / "config.pbtxt").read_text()
    preprocess = (repo / tn.PREPROCESS_MODEL / "config.pbtxt").read_text()
    assert 'platform: "ensemble"' in ensemble and 'model_name: "network"' in ensemble
    assert 'key: "FORCE_CPU_ONLY_INPUT_TENSORS"' in network and "count: 2" in network
    assert "TYPE_FP16" in preprocess and "KIND_GPU" in preprocess and "count: 3" in preprocess
    assert "allow_ragged_batch: true" in preprocess
    for name in (tn.PREPROCESS_MODEL, NETWORK_MODEL):
        assert (repo / name / "1" / "model.py").is_file() and (repo / name / "1" / SPEC_FILE).is_file()


@pytest.mark.parametrize("options, message", [
    ({"max_delay_ms": 1.0}, "the gpu profile's ensemble shape has no max_delay_ms; drop it"),
    ({"half": "maybe"}, "half 'maybe' is unknown; use auto, true or false"),
    ({"network_instances": 0}, "network_instances=0 must be at least 1"),
])
def test_bad_ensemble_options_fail_before_anything_is_written(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        build_ensemble_repository(None, tmp_path / "repo", **options)
    assert not (tmp_path / "repo").exists()


def test_the_single_shape_has_no_ensemble_options_and_the_cli_no_shape(tmp_path):
    with pytest.raises(TypeError, match="network_instances"):
        build_gpu_repository(None, tmp_path / "repo", network_instances=2)
    bad = CliRunner().invoke(main, ["repo", "build", "--profile", "gpu", "--shape", "ensemble", "--output",
                                    str(tmp_path / "x")])
    assert bad.exit_code != 0 and "No such option '--shape'" in bad.output
    assert not (tmp_path / "repo").exists() and not (tmp_path / "x").exists()


def test_every_answer_is_its_own_images_through_the_ensemble(tmp_path):
    bundle = load_model(None)
    datas = _images(600)
    repo = _hop_repo(tmp_path / "repo", preprocess_instances=2, batch_size=64, error_output=True)
    with TritonServer(repo) as server:
        parts = [datas[k * 200 : (k + 1) * 200] for k in range(3)]
        for part, rows in zip(parts, _classify_together(server.grpc_url, bundle, parts, [(7, 8), (64, 4), (1, 16)])):
            _check(rows, part, bundle)
            assert all(row.width == 64 and row.height == 48 for row in rows)


@pytest.mark.parametrize("error_output", [True, False], ids=["error-output", "request-fails"])
def test_bad_inputs_are_their_own_rows_through_the_ensemble(tmp_path, error_output):
    """With ERROR the preprocess model's text comes back per image; without it (numpy 2 in the stub) the request
    fails and the engine isolates the bad file, which keeps its own kind behind Triton's ensemble prefix."""
    bundle = load_model(None)
    good = _images(30, seed=1)
    truncated = good[0][: len(good[0]) // 2]
    datas = good[:10] + [b"not an image at all", truncated] + good[10:]
    repo = _hop_repo(tmp_path / "repo", preprocess_instances=1, batch_size=16,
                 error_output=error_output)
    with TritonServer(repo) as server:
        with TritonEngine(bundle, url=server.grpc_url, request_batch=8, concurrency=4) as engine:
            rows = engine.classify(datas)
    for row in rows[10:12]:
        assert row.status == "error" and row.error.startswith("unsupported: not a JPEG"), row.error
        assert not row.labels
    _check(rows[:10] + rows[12:], datas[:10] + datas[12:], bundle)


@pytest.mark.slow
def test_the_default_network_in_the_ensemble_agrees_with_the_single_shape(tmp_path):
    """DALI (CPU backend) and torch on the CPU in both shapes: same rows, same top-1, bad files their own rows."""
    pytest.importorskip("torch")
    pytest.importorskip("nvidia.dali")
    bundle = load_model(None)
    images = [encode(photo().resize((300 + 10 * i, 200 + 7 * i)), "JPEG") for i in range(6)]
    images += [images[0][: len(images[0]) // 2], b"not an image", encode(photo(), "PNG")]
    rows = {}
    for shape, options in (("single", {"instances": 1}), ("ensemble", {"preprocess_instances": 1})):
        repo = _repo(tmp_path / shape, shape=shape, batch_size=8, error_output=True, **options)
        with TritonServer(repo, startup_timeout_s=300) as server:
            with TritonEngine(bundle, url=server.grpc_url, request_batch=4, concurrency=2) as engine:
                rows[shape] = engine.classify(images)
    for single, ens in zip(rows["single"], rows["ensemble"]):
        assert (ens.status, ens.error, ens.width, ens.height) == (single.status, single.error, single.width,
                                                                    single.height)
        assert ens.labels[:1] == single.labels[:1]
        if single.status == "ok":
            assert abs(float(ens.scores[0]) - float(single.scores[0])) < 1e-3
    assert [r.status for r in rows["ensemble"]] == ["ok"] * 6 + ["error", "error", "ok"]
