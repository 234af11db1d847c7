"""A model set's DALI graph (pipeline.gpu.dali_graph.preprocess_graphs) on DALI's CPU backend: one decode, one branch
per distinct spec, each branch against the reference preprocessing (pipeline.model.imaging) of its own spec on real
photos, the first branch identical to the one-model graph's output, equal specs sharing one branch."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model.default_model import DEFAULT_SPEC
from pipeline.model.imaging import DecodeLimits, PreprocessSpec, load_and_preprocess

pytest.importorskip("nvidia.dali", reason="the DALI path needs nvidia-dali-cuda130 (the test extra)")
from pipeline.gpu.dali import DaliPrep, host_array  # noqa: E402
from pipeline.gpu.dali_graph import branch_plan  # noqa: E402
from support.paths import PARITY  # noqa: E402

# ImageNet's recipe (torchvision's): another resize, crop, filter and normalisation than the default model's.
IMAGENET = PreprocessSpec(resize_shorter=256, interpolation="bilinear", crop=(224, 224), scale=1 / 255,
                          mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
# Caffe's: BGR, a non-square crop, so the branch swaps the decoded channels.
CAFFE_BGR = PreprocessSpec(resize_shorter=240, interpolation="bicubic", crop=(200, 232), channel_order="BGR",
                           mean=(103.5, 116.3, 123.7), std=(57.4, 57.1, 58.4))
# Mean |DALI - reference| in 0..255 levels per image, and the worst pixel: DALI's CPU decode gives Pillow's pixels,
# what is left is DALI's tabulated filter kernel (tests/integration/test_dali_parity.py: mean <= 0.013 levels there).
MEAN_LEVELS = 0.1
MAX_LEVELS = 3.0
PHOTOS_USED = 24  # of the parity set's 200, for a 2-core CI


@pytest.fixture(scope="module")
def photos():
    paths = sorted((PARITY / "inputs").glob("*.jpg"))[:PHOTOS_USED]
    assert len(paths) == PHOTOS_USED
    return [p.read_bytes() for p in paths]


def _run(prep, datas):
    got = []
    res = prep.prepare(datas, [True] * len(datas), DecodeLimits(), lambda out: got.append(out))
    assert not res.errors and not res.refused and res.dali == list(range(len(datas)))
    out = got[0]
    return [host_array(o) for o in out] if isinstance(out, tuple) else [host_array(out)]


def _levels(got: np.ndarray, ref: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    return np.abs(got - ref) * np.array(spec.std)[:, None, None] / spec.scale


def test_each_branch_follows_its_own_spec_like_the_reference(photos):
    specs = (DEFAULT_SPEC, IMAGENET, CAFFE_BGR, IMAGENET)
    branches, index = branch_plan(specs)
    assert index == [0, 1, 2, 1] and branches == [DEFAULT_SPEC, IMAGENET, CAFFE_BGR]
    prep = DaliPrep(DEFAULT_SPEC, device="cpu", batch_size=len(photos), num_threads=2, layout="CHW", more=specs[1:])
    outs = _run(prep, photos)
    assert len(outs) == 3  # the repeated spec shares its branch
    worst = {}
    for b, spec in enumerate(branches):
        assert outs[b].shape == (len(photos), 3, *spec.crop)
        means = []
        for i, data in enumerate(photos):
            levels = _levels(outs[b][i], load_and_preprocess(data, spec)[0], spec)
            means.append(levels.mean())
            assert levels.max() <= MAX_LEVELS, (b, i, levels.max())
        worst[b] = max(means)
        assert worst[b] < MEAN_LEVELS, (b, worst[b])
    prep.close()


def test_the_first_branch_is_the_one_model_graphs_output_and_the_reference_gives_every_branch(photos):
    datas = photos[:6]
    alone = DaliPrep(DEFAULT_SPEC, device="cpu", batch_size=8, num_threads=2, layout="HWC", half=True)
    pair = DaliPrep(DEFAULT_SPEC, device="cpu", batch_size=8, num_threads=2, layout="HWC", half=True,
                    more=(CAFFE_BGR,))
    (one,) = _run(alone, datas)
    first, _ = _run(pair, datas)
    assert one.dtype == np.float16 and np.array_equal(one, first)
    res = pair.prepare(datas, [False] * len(datas), DecodeLimits(), lambda out: None)  # all to the reference
    for i, data in enumerate(datas):
        ref0, w, h = load_and_preprocess(data, DEFAULT_SPEC)
        ref1, _, _ = load_and_preprocess(data, CAFFE_BGR)
        assert res.reference[i][1:] == (w, h)
        assert np.array_equal(res.reference[i][0], ref0.transpose(1, 2, 0))
        assert np.array_equal(res.reference_more[i][0], ref1.transpose(1, 2, 0))
    alone.close()
    pair.close()
