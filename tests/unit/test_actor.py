"""pipeline/actor.py: ClassifyActor's ``__call__`` as a plain column transform, without Ray."""

from __future__ import annotations

from datetime import datetime

import pyarrow as pa
import pytest

from support.oddities import oddities
from pipeline.actor import ClassifyActor
from pipeline.engines.registry import REGISTRY
from pipeline.schema import CALLS, DATA, DECODE_S, INFER_S, WORK_SCHEMA


@pytest.fixture(scope="module")
def actor(default_bundle, model_cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("BULK_CLASSIFY_CACHE_DIR", str(model_cache))  # the session's built model, not the user's cache
    a = ClassifyActor(model=None, engine=REGISTRY["onnx"], top_k=3, max_bytes=10_000_000, max_pixels=50_000_000,
                      engine_options={"max_batch": 4, "decode_threads": 2})
    yield a
    a.close()
    mp.undo()


def _batch(rows: list[dict]) -> pa.Table:
    columns = {f.name: [r.get(f.name) for r in rows] for f in WORK_SCHEMA}
    columns["carried"] = [bool(r.get("carried")) for r in rows]
    return pa.table(columns, schema=WORK_SCHEMA)


def test_one_row_out_per_row_in_with_the_reference_outcome(actor):
    odd = oddities()
    names = list(odd)
    rows = [{"uri": f"file:///{n}", DATA: odd[n][0]} for n in names]
    rows.append({"uri": "file:///fetch-failed", "status": "error", "error": "not_found: gone"})
    out = actor(_batch(rows))
    assert out.schema == WORK_SCHEMA and out.num_rows == len(rows)
    got = out.to_pylist()
    for name, row in zip(names, got):
        _, status, kind = odd[name]
        assert row["status"] == status, (name, row["error"])
        if status == "ok":
            assert row["error"] is None and len(row["class_ids"]) == 3 and len(row["labels"]) == 3
            assert row["scores"] == sorted(row["scores"], reverse=True)
        else:
            assert row["error"].split(":")[0] == kind, (name, row["error"])
        assert row["model"] == "efficientnet-lite0" and row["engine"] == "onnx"
        assert isinstance(row["classified_at"], datetime) and row[DATA] is None
    fetch_failed = got[-1]
    assert (fetch_failed["status"], fetch_failed["error"]) == ("error", "not_found: gone")
    assert fetch_failed["class_ids"] is None and fetch_failed[INFER_S] == 0.0 and fetch_failed[CALLS] == 0.0
    # The engine's stage times are shared out over the rows it classified: one engine call in all.
    classified = got[:-1]
    assert sum(r[CALLS] for r in classified) == pytest.approx(1.0)
    assert all(r[INFER_S] > 0 and r[DECODE_S] is not None for r in classified)


def test_a_batch_with_nothing_to_classify_does_not_call_the_engine(actor):
    calls = []
    real = actor.engine.classify
    actor.engine.classify = lambda images: calls.append(images) or real(images)
    try:
        out = actor(_batch([{"uri": "file:///x", "status": "error", "error": "too_large: 9 bytes"}]))
    finally:
        actor.engine.classify = real
    assert calls == [] and out.column("status").to_pylist() == ["error"]


def test_an_engine_returning_the_wrong_number_of_results_fails_the_batch(actor):
    real = actor.engine.classify
    actor.engine.classify = lambda images: real(images)[:-1]
    try:
        with pytest.raises(RuntimeError, match="engine onnx returned 1 results for 2 images"):
            actor(_batch([{"uri": f"file:///{i}", DATA: oddities()["jpeg"][0]} for i in range(2)]))
    finally:
        actor.engine.classify = real


def test_decode_threads_reaches_the_engine_under_its_own_option_name(actor):
    assert actor.engine.decode_threads == 2  # --decode-threads, passed as the onnx engine's decode_threads
    assert actor.engine.max_batch == 4
