"""The output's columns for a run's models: one unnamed model's top-level columns (with its embedding), or one struct
column per named model of a set, the working columns between stages for either, a row's columns from an engine's
answers, and a table made to fit a schema."""

from __future__ import annotations

from typing import Any, Sequence

import pyarrow as pa

from pipeline.schema import (
    CLASS_IDS, EMBEDDING, LABELS, MODEL, MODEL_DIGEST, OUTPUT_SCHEMA, SCORES, STATUS_ERROR, STATUS_OK, WORK_COLUMNS,
    WORK_SCHEMA,
)

# A model's answer in the rows, as the top-level columns of one unnamed model or one struct column per named model.
MODEL_FIELDS = (CLASS_IDS, LABELS, SCORES, MODEL, MODEL_DIGEST)


# An embedding column's type: a list of the model's ``dim`` float32 values a row (``embedding_column``), null where
# there is none. float32: what vector stores (Lance, DuckDB's FLOAT[n], pgvector) and Iceberg take (neither Iceberg nor
# pgvector has float16). A plain list, not ``fixed_size_list``: Parquet stores either as a list, and Arrow's Parquet
# writer refuses a fixed-size list with a null row between others while its reader refuses one with a null row
# anywhere (apache/arrow#35697), and an error row's embedding is null.
EMBEDDING_TYPE = pa.list_(pa.float32())


def model_struct(embedding_dim: int | None = None) -> pa.StructType:
    """One named model's column: its top-k, its model and digest, and its embedding where it has one."""
    fields = [OUTPUT_SCHEMA.field(name) for name in MODEL_FIELDS]
    if embedding_dim:
        fields.append(pa.field(EMBEDDING, EMBEDDING_TYPE))
    return pa.struct(fields)


def output_schema(models: tuple[tuple[str | None, int | None], ...] = ()) -> pa.Schema:
    """The output's schema for the run's models, given as (name, embedding width or None) each.

    No models or one unnamed model: OUTPUT_SCHEMA (with an ``embedding`` column after ``scores`` where the model has
    one). Named models: OUTPUT_SCHEMA's columns with ``class_ids``, ``labels`` and ``scores`` replaced by one struct
    column per model (``model_struct``), in the order given; ``model`` and ``model_digest`` are then the set's.
    """
    if not models or (len(models) == 1 and models[0][0] is None):
        dim = models[0][1] if models else None
        if not dim:
            return OUTPUT_SCHEMA
        at = OUTPUT_SCHEMA.get_field_index(SCORES) + 1
        return OUTPUT_SCHEMA.insert(at, pa.field(EMBEDDING, EMBEDDING_TYPE))
    fields = []
    for f in OUTPUT_SCHEMA:
        if f.name == CLASS_IDS:
            fields.extend(pa.field(name, model_struct(dim)) for name, dim in models)
        elif f.name not in (LABELS, SCORES):
            fields.append(f)
    return pa.schema(fields)


def output_schema_like(schema: pa.Schema) -> pa.Schema:
    """The output schema whose models' columns are those of ``schema`` (a shard's, or a batch's between stages):
    one unnamed model's top-level columns (and its embedding), or the struct column of each named model."""
    if CLASS_IDS in schema.names:
        if EMBEDDING not in schema.names:
            return OUTPUT_SCHEMA
        return OUTPUT_SCHEMA.insert(OUTPUT_SCHEMA.get_field_index(SCORES) + 1, schema.field(EMBEDDING))
    named = [f for f in schema if pa.types.is_struct(f.type) and f.type.get_field_index(MODEL_DIGEST) >= 0]
    if not named:
        return OUTPUT_SCHEMA
    at = OUTPUT_SCHEMA.get_field_index(CLASS_IDS)
    kept = [f for f in OUTPUT_SCHEMA if f.name not in (CLASS_IDS, LABELS, SCORES)]
    return pa.schema(kept[:at] + named + kept[at:])


def work_schema(output: pa.Schema = OUTPUT_SCHEMA) -> pa.Schema:
    """The columns between stages for an output of schema ``output``: its columns and the working ones."""
    return pa.schema(list(output) + list(WORK_COLUMNS))


def row_answers(result: Any, models: int, engine: str) -> list[Any]:
    """Each of ``models`` models' answer in engine ``engine``'s ``result`` (``pipeline.engines.base.Result``): the
    result itself, then its ``more``; None for a model without one (an image that failed to decode answers for no
    model)."""
    if result.status != STATUS_OK and not result.more:
        return [result] + [None] * (models - 1)
    answers = [result, *result.more]
    if len(answers) != models:
        raise RuntimeError(f"engine {engine} answered for {len(answers)} models of {models}")
    return answers


def row_status(result: Any, names: Sequence[str]) -> tuple[str, str | None]:
    """A row's status and error for the models ``names`` (empty: one unnamed model): ok when every model answered;
    else each failed model's error, by its name (one error for an image that failed to decode)."""
    if not result.more or not names:
        return result.status, result.error
    failed = [(name, r.error) for name, r in zip(names, [result, *result.more]) if r.status != STATUS_OK]
    if not failed:
        return STATUS_OK, None
    kind = (failed[0][1] or "engine_error").split(":", 1)[0]
    return STATUS_ERROR, f"{kind}: " + "; ".join(f"model {name}: {e}" for name, e in failed)


def model_columns(names: Sequence[str], bundles: Sequence[Any], answers: Sequence[Sequence[Any]],
                  batch: pa.Table) -> list[tuple[str, list | pa.Array]]:
    """(column, values) of the models' answers (``row_answers`` per row, by model): one unnamed model's top-level
    columns (and its embedding where ``batch`` has one; the batch's own values where a row has no answer), or one
    struct per named model of ``bundles`` (null where that model has no ok answer). Embeddings go in as arrays
    (``embedding_column``)."""
    if not names:
        columns = [(name, [getattr(r, name) if r is not None else given for r, given in
                           zip(answers[0], batch.column(name).to_pylist())]) for name in (CLASS_IDS, LABELS, SCORES)]
        if EMBEDDING in batch.schema.names:
            given = batch.column(EMBEDDING)
            columns.append((EMBEDDING, embedding_column(
                [r.embedding if r is not None else given[i].values for i, r in enumerate(answers[0])],
                bundles[0].spec.embedding.dim)))
        return columns
    columns = []
    for name, bundle, rows in zip(names, bundles, answers):
        kept = [r if r is not None and r.status == STATUS_OK else None for r in rows]
        struct = model_struct(bundle.spec.embedding.dim if bundle.spec.embedding else None)
        children = [pa.array([getattr(r, f) if r else None for r in kept], struct.field(f).type)
                    for f in (CLASS_IDS, LABELS, SCORES)]
        children += [pa.array([value if r else None for r in kept], struct.field(f).type)
                     for f, value in ((MODEL, bundle.name), (MODEL_DIGEST, bundle.digest))]
        if bundle.spec.embedding:
            children.append(embedding_column([r.embedding if r else None for r in kept], bundle.spec.embedding.dim))
        columns.append((name, pa.StructArray.from_arrays(children, fields=list(struct),
                                                         mask=pa.array([r is None for r in kept]))))
    return columns


def embedding_column(vectors: Sequence[Any], dim: int) -> pa.ListArray:
    """An embedding column of ``vectors`` (each ``dim`` float32 values as a numpy or Arrow array, or None for a null
    row, which holds no values), built from one numpy block rather than row by row (docs/performance.md, "A model
    set's columns"). A vector of another width is a RuntimeError: it would shift every row after it."""
    import numpy as np  # noqa: PLC0415 - the driver imports this module for its schemas alone

    kept = [i for i, v in enumerate(vectors) if v is not None]
    block = np.empty((len(kept), dim), np.float32)
    for row, i in enumerate(kept):
        vector = np.asarray(vectors[i], np.float32)
        if vector.shape != (dim,):
            raise RuntimeError(f"an embedding of shape {vector.shape} where the model declares {dim} values")
        block[row] = vector
    lengths = np.zeros(len(vectors), np.int32)
    lengths[kept] = dim
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(block.reshape(-1)), type=EMBEDDING_TYPE,
                                    mask=pa.array([v is None for v in vectors]))


def conform(table: pa.Table, schema: pa.Schema = WORK_SCHEMA) -> pa.Table:
    """Return ``table`` with exactly ``schema``'s columns, missing ones as nulls, cast to its types."""
    n = table.num_rows
    columns = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            columns.append(col if col.type == f.type else col.cast(f.type))
        else:
            columns.append(pa.nulls(n, type=f.type))
    return pa.Table.from_arrays(columns, schema=schema)
