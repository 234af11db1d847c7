"""A user's converted network on a real GPU: held to ONNX Runtime's outputs on each instance, and its per-card results
(the precision gate's verdict, torch.compile's artifacts) kept for the next instance."""

from __future__ import annotations

import logging

import pytest

from pipeline.errors import EngineError
from pipeline.model.folder import load_model

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    from support.user_models import TinyNet, model_folder

    monkeypatch.setenv("BULK_CLASSIFY_CACHE_DIR", str(tmp_path / "cache"))
    # A fresh process's compile: dynamo would otherwise reuse, in memory, the same network an earlier test compiled
    # in this process, and write nothing to this card's folder.
    torch._dynamo.reset()
    return model_folder(tmp_path / "tiny", TinyNet(scale=20.0))


def test_the_second_instance_on_a_card_reuses_the_conversion_the_gate_and_the_compiled_kernels(folder, caplog):
    from pipeline.engines.gpu import GpuEngine
    from pipeline.gpu import network_cache

    bundle = load_model(folder)
    caplog.set_level(logging.INFO)
    with GpuEngine(bundle, top_k=5) as first:
        assert first.classifier.network.compiled, first.classifier.network.compile_problem
    cards = list(network_cache.cache_root().glob("*/cards/*"))
    assert len(cards) == 1 and (cards[0] / network_cache.GATE_FILE).is_file()
    kernels = list((cards[0] / network_cache.INDUCTOR_FOLDER).rglob("*"))
    assert kernels, "torch.compile wrote nothing into the card's folder"
    caplog.clear()
    with GpuEngine(bundle, top_k=5) as second:
        report = second.classifier.start_report()
    assert "network loaded from the cache" in report
    assert "precision gate: the verdict recorded for this card" in caplog.text
    assert "agrees with ONNX Runtime" in caplog.text


def test_an_instance_whose_network_disagrees_on_the_gpu_refuses_to_start(folder):
    from pipeline.engines.gpu import GpuEngine
    from pipeline.gpu.networks import load_network

    bundle = load_model(folder)
    network = load_network(bundle)
    with torch.no_grad():
        next(p for p in network.parameters() if p.dim() == 4).mul_(-1)
    with pytest.raises(EngineError, match=r"^the converted network on cuda:\d \(fp(16|32)\) gives outputs .*; run this "
                                          r"model with --engine onnx$"):
        GpuEngine(bundle, top_k=5, network=network)
