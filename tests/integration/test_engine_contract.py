"""The engine contract, for every registered engine this machine can run: tests/support/oddities.py's inputs in, one
Result per input in order out, with the reference's outcome for each, and the Engine protocol's stage times.

onnx always runs; triton where a tritonserver is found (the nvidia-pytriton wheel here); gpu where torch sees a
GPU. A new engine in pipeline.engines.registry is picked up here without editing this file.
"""

from __future__ import annotations

import pytest

from support.oddities import EXPECTED_SIZES, oddities
from pipeline.engines.base import Engine
from pipeline.engines.registry import REGISTRY, make_engine
from pipeline.errors import ConfigError
from pipeline.schema import STAGE_INFER, STATUS_OK

TOP_K = 3
# Engines that decode with the reference code (Pillow here, in the server for triton): same top-1 as onnx.
MATCHES_REFERENCE = ("onnx", "openvino", "triton")


def _unavailable(name: str) -> str | None:
    """Why engine ``name`` cannot run here, or None."""
    try:
        REGISTRY[name].check({})
    except ConfigError as err:
        return str(err)
    return None


def _options(name: str) -> dict:
    """The gpu engine runs on DALI's CPU backend and torch's CPU where there is no CUDA device."""
    if name == "gpu":
        import torch

        if not torch.cuda.is_available():
            return {"device": "cpu"}
    return {}


@pytest.fixture(scope="module", params=list(REGISTRY))
def engine(request, default_bundle):
    reason = _unavailable(request.param)
    if reason:
        pytest.skip(f"engine {request.param!r} cannot run here: {reason}")
    built = make_engine(request.param, default_bundle, top_k=TOP_K, **_options(request.param))
    yield built
    built.close()


def test_every_input_gets_one_result_in_order_with_the_reference_outcome(engine, onnx_engine):
    assert isinstance(engine, Engine)  # the protocol: classify, close, stage_seconds, name
    odd = oddities()
    names = list(odd)
    images = [odd[n][0] for n in names]
    before = dict(engine.stage_seconds)
    results = engine.classify(images)
    assert len(results) == len(images)
    for name, result in zip(names, results):
        _, status, kind = odd[name]
        assert result.status == status, (engine.name, name, result.error)
        if status == STATUS_OK:
            assert result.error is None and len(result.class_ids) == TOP_K == len(result.labels) == len(result.scores)
            assert result.scores == sorted(result.scores, reverse=True) and 0 < result.scores[0] <= 1
            assert result.width and result.height
        else:
            assert result.error.split(":")[0] == kind and result.class_ids == [], (engine.name, name, result.error)
        if name in EXPECTED_SIZES:
            assert (result.width, result.height) == EXPECTED_SIZES[name], (engine.name, name)
    assert engine.stage_seconds[STAGE_INFER] > before.get(STAGE_INFER, 0.0)
    # Same answers as the reference engine (the gpu engine resizes on the GPU and may flip near-ties).
    if engine.name in MATCHES_REFERENCE:
        reference = onnx_engine.classify(images)
        assert [r.class_ids[:1] for r in results] == [r.class_ids[:1] for r in reference]


def test_an_empty_call_returns_nothing(engine):
    assert engine.classify([]) == []
