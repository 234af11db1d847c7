"""pipeline/columns.py: a row's model columns from engines' Results, embeddings kept as arrays to the column."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa

from pipeline.columns import EMBEDDING_TYPE, embedding_column, model_columns, output_schema, work_schema
from pipeline.engines.base import Result
from pipeline.model.spec import EmbeddingSpec
from pipeline.schema import EMBEDDING, STATUS_OK

DIM = 4


def _ok(seed: int, embedding: bool = True) -> Result:
    vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32) if embedding else None
    return Result(STATUS_OK, class_ids=[seed, 1], labels=[f"c{seed}", "c1"], scores=[0.75, 0.25], width=5, height=4,
                  embedding=vector)


def _bundle(name: str, dim: int | None):
    spec = SimpleNamespace(embedding=EmbeddingSpec(output="features", dim=dim) if dim else None)
    return SimpleNamespace(name=name, digest=f"{name}-digest", spec=spec)


def test_an_embedding_column_holds_each_vector_exactly_and_nulls_where_none():
    vectors = [np.arange(DIM, dtype=np.float32), None, pa.array([9, 8, 7, 6], pa.float32()),
               np.float32([0.5, -1e-30, 3e38, 0])]
    column = embedding_column(vectors, DIM)
    assert column.type == EMBEDDING_TYPE and column.null_count == 1 and column[1].as_py() is None
    assert column.to_pylist()[0] == [0, 1, 2, 3] and column.to_pylist()[2] == [9, 8, 7, 6]
    assert np.array_equal(np.asarray(column[3].values), vectors[3])  # float32 bits unchanged


def test_a_model_sets_struct_columns_hold_each_models_answer_and_null_where_it_failed():
    first, second = _ok(3), _ok(5, embedding=False)
    failed = Result.failed("engine_error: this model's network failed")
    names, bundles = ("taxonomy", "safety"), (_bundle("emb", DIM), _bundle("plain", None))
    schema = work_schema(output_schema((("taxonomy", DIM), ("safety", None))))
    batch = pa.table({f.name: pa.nulls(3, f.type) for f in schema}, schema=schema)
    answers = [[first, failed, None], [second, _ok(7, embedding=False), None]]
    got = dict(model_columns(names, bundles, answers, batch))
    for name in names:
        assert isinstance(got[name], pa.StructArray) and got[name].type == schema.field(name).type
    taxonomy, safety = got["taxonomy"].to_pylist(), got["safety"].to_pylist()
    assert taxonomy[1] is None and taxonomy[2] is None and safety[2] is None  # a failed model, no answer at all
    assert taxonomy[0] == {"class_ids": [3, 1], "labels": ["c3", "c1"], "scores": [0.75, 0.25], "model": "emb",
                           "model_digest": "emb-digest", EMBEDDING: first.embedding.tolist()}
    assert safety[1]["class_ids"] == [7, 1] and safety[1]["model"] == "plain" and EMBEDDING not in safety[1]


def test_one_models_embedding_keeps_a_rows_own_value_where_the_engine_did_not_answer():
    schema = work_schema(output_schema(((None, DIM),)))
    carried = [1.0, 2.0, 3.0, 4.0]
    columns = {f.name: pa.nulls(3, f.type) for f in schema}
    columns[EMBEDDING] = pa.array([None, carried, None], EMBEDDING_TYPE)
    batch = pa.table(columns, schema=schema)
    answered = _ok(2)
    got = dict(model_columns((), (_bundle("m", DIM),), [[answered, None, Result.failed("decode_error: bad")]], batch))
    assert got[EMBEDDING].type == EMBEDDING_TYPE
    assert got[EMBEDDING].to_pylist() == [answered.embedding.tolist(), carried, None]
    assert got["class_ids"] == [[2, 1], None, []]


def test_embeddings_with_null_rows_between_others_round_trip_through_parquet(tmp_path):
    """Arrow's Parquet writer refuses a fixed-size list with a null row between others and its reader one with a null
    row anywhere (apache/arrow#35697): an error row among ok rows must still write and read back, alone and in a
    model's struct."""
    import pyarrow.parquet as pq

    vectors = [np.full(DIM, i, np.float32) if i % 3 else None for i in range(7)]  # nulls first, between and last
    column = embedding_column(vectors, DIM)
    struct = pa.StructArray.from_arrays([column], names=[EMBEDDING], mask=pa.array([v is None for v in vectors]))
    pq.write_table(pa.table({EMBEDDING: column, "model": struct}), tmp_path / "rows.parquet")
    back = pq.read_table(tmp_path / "rows.parquet")
    expected = [None if v is None else v.tolist() for v in vectors]
    assert back.column(EMBEDDING).to_pylist() == expected
    assert [None if r is None else r[EMBEDDING] for r in back.column("model").to_pylist()] == expected


def test_an_embedding_of_another_width_is_refused_not_shifted_into_the_next_row():
    import pytest

    for wrong in (np.ones(DIM - 1, np.float32), np.ones(1, np.float32), np.ones((DIM, 1), np.float32)):
        with pytest.raises(RuntimeError, match=f"where the model declares {DIM} values"):
            embedding_column([np.ones(DIM, np.float32), wrong], DIM)
