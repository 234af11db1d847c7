"""The gpu engine on a real GPU: agreement with the onnx engine, blocking CUDA waits, DALI's GPU decode against the
reference preprocessing."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model.default_model import DEFAULT_SPEC
from pipeline.gpu.classifier import ClassifierOptions, GpuClassifier
from pipeline.engines.gpu import GpuEngine
from pipeline.model.imaging import load_and_preprocess
from support.oddities import photo_set


def test_gpu_engine_agrees_with_the_onnx_engine_on_photos():
    from pipeline.engines.onnx import OnnxEngine
    from pipeline.model.folder import load_model

    bundle = load_model(None)
    datas = photo_set()
    ref = OnnxEngine(bundle, top_k=5).classify(datas)
    gpu = GpuEngine(bundle, top_k=5)
    got = gpu.classify(datas)
    gpu.close()
    assert [r.status for r in got] == ["ok"] * len(datas)
    assert sum(g.class_ids[0] == r.class_ids[0] for g, r in zip(got, ref)) >= len(datas) - 1
    assert [(g.width, g.height) for g in got] == [(r.width, r.height) for r in ref]


def test_blocking_sync_is_in_force_and_classifies_the_same():
    from pipeline.engines.onnx import OnnxEngine
    from pipeline.model.folder import load_model

    bundle = load_model(None)
    datas = photo_set()
    ref = OnnxEngine(bundle, top_k=5).classify(datas)
    gpu = GpuEngine(bundle, top_k=5, cuda_sync="block")
    assert gpu.classifier.cuda_sync_in_force == "block"
    got = gpu.classify(datas)
    gpu.close()
    assert sum(g.class_ids[0] == r.class_ids[0] for g, r in zip(got, ref)) >= len(datas) - 1


def test_dali_inputs_on_the_gpu_match_the_reference_preprocessing():
    """DALI's "mixed" decode (hardware JPEG engines, nvJPEG) and resize against the reference, row by row."""
    torch = pytest.importorskip("torch")
    from pipeline.gpu.classifier import Chunk, triage

    clf = GpuClassifier(torch.nn.Identity(), DEFAULT_SPEC,
                        ClassifierOptions(cuda_graph=False, half=False, pipeline=False))
    datas = photo_set()
    chunk = Chunk([triage(i, d, clf.limits) for i, d in enumerate(datas)])
    clf._prepare(chunk)
    assert chunk.ok == list(range(len(datas))) and not chunk.errors
    for row, pos in enumerate(chunk.ok):
        ref, _, _ = load_and_preprocess(chunk.items[pos].data, DEFAULT_SPEC)
        levels = np.abs(chunk.inputs[row].float().cpu().numpy() - ref) * np.array(DEFAULT_SPEC.std)[:, None, None]
        # nvJPEG's IDCT rounds a few edge pixels differently from libjpeg (520 photos: max 4, mean 0.012 levels)
        assert levels.max() <= 8.0 and levels.mean() < 0.1
    clf.close()
