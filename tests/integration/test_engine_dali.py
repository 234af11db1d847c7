"""The gpu engine's DALI preparation (pipeline.gpu.dali) where it runs without a GPU: DALI's CPU backend
through the same graph and the same triage / refusal / reference fallback the GPU runs (the classifier around it:
tests/integration/test_engine_gpu.py, with torch on the CPU; on a GPU: tests/gpu/test_dali_on_gpu.py)."""

from __future__ import annotations


import numpy as np
import pytest
from support.oddities import EXPECTED_SIZES, oddities

from pipeline.model.default_model import DEFAULT_SPEC
from pipeline.gpu.classifier import triage
from pipeline.errors import ImageError
from pipeline.model.imaging import DecodeLimits, load_and_preprocess

pytest.importorskip("nvidia.dali", reason="the DALI path needs nvidia-dali-cuda130 (the test extra)")
from pipeline.gpu.dali import DaliPrep, DaliRefused, host_array  # noqa: E402
from support.paths import PHOTOS

DALI_UNDECODABLE_ALPHA = {"rgba_png", "palette_png_transparent"}
# Level = 1/128 in this model's normalized units. DALI's CPU decode + resize against the reference, measured on the
# photos (tests/integration/test_dali_parity.py): mean <= 0.0001 (0.0018 before the two-pass resize).
MEAN_ABS_BOUND = 0.001


@pytest.fixture(scope="module")
def prep():
    return DaliPrep(DEFAULT_SPEC, device="cpu", batch_size=32, num_threads=2, layout="CHW", pipelines=2)


def _prepare(prep, datas, limits=DecodeLimits()):
    """Triage + prepare as GpuClassifier does; returns (Prepared, {pos: DALI row}, {pos: triage error})."""
    items, triaged = [], {}
    for i, data in enumerate(datas):
        try:
            items.append(triage(i, data, limits))
        except ImageError as e:
            triaged[i] = str(e)
    rows: dict[int, np.ndarray] = {}
    seen = []
    res = prep.prepare([it.data for it in items], [it.info is not None for it in items], limits,
                       lambda out: seen.append(host_array(out)))
    if res.dali:
        assert len(seen) == 1 and seen[0].shape[0] == len(res.dali)
        rows = {items[p].index: seen[0][r] for r, p in enumerate(res.dali)}
    res.errors = {items[p].index: e for p, e in res.errors.items()}
    res.reference = {items[p].index: v for p, v in res.reference.items()}
    res.dali = [items[p].index for p in res.dali]
    return res, rows, triaged


def test_dali_batches_match_the_reference_on_photos(prep):
    datas = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))]
    res, rows, triaged = _prepare(prep, datas)
    assert not triaged and not res.errors and not res.refused
    assert sorted(res.dali) == list(range(len(datas))), "every photo is a baseline JPEG: all go to DALI"
    for i, data in enumerate(datas):
        ref, _, _ = load_and_preprocess(data, DEFAULT_SPEC)
        assert rows[i].shape == ref.shape == DEFAULT_SPEC.input_shape
        assert np.abs(rows[i] - ref).mean() < MEAN_ABS_BOUND


def test_half_precision_nhwc_output_is_the_same_tensor():
    datas = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))[:4]]
    chw = DaliPrep(DEFAULT_SPEC, device="cpu", batch_size=8, num_threads=2, layout="CHW")
    hwc = DaliPrep(DEFAULT_SPEC, device="cpu", batch_size=8, num_threads=2, layout="HWC", half=True)
    outs = []
    for p in (chw, hwc):
        got = []
        p.prepare(datas, [True] * len(datas), DecodeLimits(), lambda out, got=got: got.append(host_array(out)))
        outs.append(got[0])
    crop_h, crop_w = DEFAULT_SPEC.crop
    assert outs[1].dtype == np.float16 and outs[1].shape == (4, crop_h, crop_w, 3)
    assert np.abs(outs[1].astype(np.float32).transpose(0, 3, 1, 2) - outs[0]).max() < 0.01  # fp16 rounding only


def test_odd_inputs_get_the_onnx_engines_statuses_and_kinds(prep):
    """All oddities in one batch: each gets the status and error kind the onnx engine gives (tests/support/oddities.py),
    the good ones their size; non-JPEGs and what triage routes away are decoded by the reference."""
    odd = oddities()
    names = list(odd)
    res, rows, triaged = _prepare(prep, [odd[n][0] for n in names])
    for i, name in enumerate(names):
        _, status, kind = odd[name]
        error = triaged.get(i) or res.errors.get(i, "")
        got_status = "error" if error else "ok"
        assert got_status == status, f"{name}: {error}"
        if kind:
            assert error.split(":", 1)[0] == kind, f"{name}: {error}"
        else:
            assert i in rows or i in res.reference, name
        if name in EXPECTED_SIZES and i in res.reference:
            assert res.reference[i][1:] == EXPECTED_SIZES[name], name
    assert names.index("jpeg") in rows and names.index("exif_rotated_jpeg") in rows  # the GPU path took them
    assert names.index("gif") in res.reference and names.index("cmyk_jpeg") in res.reference


def test_a_file_dali_refuses_sends_its_batch_to_the_reference_and_the_pipeline_recovers(prep):
    good = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))[:3]]
    header_only = good[0][: good[0].index(b"\xff\xda")] + b"\xff\xd9"  # frame header, no scan, then EOI
    assert triage(0, header_only, DecodeLimits()).info is not None, "triage cannot see it: DALI must refuse it"
    res, rows, triaged = _prepare(prep, [good[0], header_only, good[1], good[2]])
    assert res.refused and not rows and not triaged
    assert res.errors[1].startswith("decode_error: ")
    assert sorted(res.reference) == [0, 2, 3]
    for i in (0, 2, 3):
        ref, _, _ = load_and_preprocess([good[0], None, good[1], good[2]][i], DEFAULT_SPEC)
        assert np.array_equal(res.reference[i][0], ref)  # the reference itself
    again, rows, _ = _prepare(prep, good)  # the rebuilt pipeline works
    assert not again.refused and sorted(rows) == [0, 1, 2]


def test_depth_two_keeps_batches_in_flight_and_gives_a_refusal_to_its_own_batch():
    """``depth=2``: one pipeline, batches from several threads scheduled ahead. Each caller gets its own batch's
    output (the same tensors as a depth-1 pipeline gives), and a batch DALI refuses fails alone: the runs in flight
    beside it are run again on a rebuilt pipeline and succeed."""
    import threading

    photos = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))]
    header_only = photos[0][: photos[0].index(b"\xff\xda")] + b"\xff\xd9"
    batches = [photos[0:3], [photos[3], header_only], photos[3:6], photos[6:9], photos[0:1]]
    one = DaliPrep(DEFAULT_SPEC, device="cpu", batch_size=4, num_threads=2, layout="CHW")
    want = {}
    for k, b in enumerate(batches):
        if k != 1:
            got = []
            one.run(b, lambda out, got=got: got.append(host_array(out)))
            want[k] = got[0]
    deep = DaliPrep(DEFAULT_SPEC, device="cpu", batch_size=4, num_threads=2, layout="CHW", depth=2)
    got: dict = {}

    def submit(k):
        try:
            deep.run(batches[k], lambda out: got.__setitem__(k, host_array(out)))
        except DaliRefused as err:
            got[k] = err

    for _ in range(2):  # twice: the pipeline rebuilt after the refusal serves the second round
        got.clear()
        threads = [threading.Thread(target=submit, args=(k,)) for k in range(len(batches))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert isinstance(got[1], DaliRefused)
        for k, arr in want.items():
            assert np.array_equal(got[k], arr), k
    deep.close()
