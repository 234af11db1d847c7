"""The gpu engine's DALI preparation on a real GPU: the odd inputs through GpuClassifier."""

from __future__ import annotations

import pytest

from support.oddities import EXPECTED_SIZES, oddities

pytest.importorskip("nvidia.dali", reason="the DALI path needs nvidia-dali-cuda130 (the test extra)")


def test_dali_classifier_gives_the_onnx_engines_statuses_on_odd_inputs():
    """tests/support/oddities.py through GpuClassifier on the GPU (one batch, DALI and the reference mixed): the onnx
    engine's status and error kind for every input, the same top-1 for the ok ones (seen 20/20 on an H200)."""
    pytest.importorskip("torch")
    from pipeline.gpu.classifier import ClassifierOptions, GpuClassifier
    from pipeline.gpu.networks import load_network
    from pipeline.engines.onnx import OnnxEngine
    from pipeline.model.folder import load_model

    bundle = load_model(None)
    odd = oddities()
    names = list(odd)
    datas = [odd[n][0] for n in names]
    ref = OnnxEngine(bundle, top_k=5).classify(datas)
    clf = GpuClassifier(load_network(bundle, None), bundle.spec, ClassifierOptions(top_k=5, batch_size=8, half=False))
    raw = clf.classify(datas)
    clf.close()
    for i, name in enumerate(names):
        got = ("error", raw.errors[i].split(":", 1)[0]) if raw.errors[i] else ("ok", None)
        want = (ref[i].status, ref[i].error.split(":", 1)[0] if ref[i].error else None)
        assert got == want, name
        if name in EXPECTED_SIZES:
            assert (int(raw.width[i]), int(raw.height[i])) == EXPECTED_SIZES[name], name
    agree = sum(int(raw.class_ids[i, 0]) == ref[i].class_ids[0] for i in range(len(names)) if not raw.errors[i])
    assert agree >= sum(1 for r in ref if r.status == "ok") - 1
