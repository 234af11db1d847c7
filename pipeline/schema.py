"""The names every floor shares: statuses, stage names, the top-k default, the output's columns and table schema, the
listing's schema, its bookkeeping files and layout, and the working columns between stages."""

from __future__ import annotations

import pyarrow as pa

STATUS_OK = "ok"
STATUS_ERROR = "error"
# The stages an engine times (``Engine.stage_seconds``); an engine that cannot tell them apart reports STAGE_INFER.
STAGE_DECODE = "decode_preprocess"
STAGE_INFER = "infer"
DEFAULT_TOP_K = 5
DEFAULT_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
MIB = 1024 * 1024

# The output's columns.
URI = "uri"
STATUS = "status"
ERROR = "error"
CLASS_IDS = "class_ids"
LABELS = "labels"
SCORES = "scores"
MODEL = "model"
MODEL_DIGEST = "model_digest"
ENGINE = "engine"
SIZE_BYTES = "size_bytes"
WIDTH = "width"
HEIGHT = "height"
ETAG = "etag"
MTIME = "mtime"
CLASSIFIED_AT = "classified_at"
CARRIED = "carried"
EMBEDDING = "embedding"  # a model's embedding, where its spec declares one (fixed_size_list<float32>[dim])

# What users read: one row per listed input object.
OUTPUT_SCHEMA = pa.schema(
    [
        (URI, pa.string()),
        (STATUS, pa.string()),  # STATUS_OK or STATUS_ERROR
        (ERROR, pa.string()),  # "kind: detail", null when ok
        (CLASS_IDS, pa.list_(pa.int32())),
        (LABELS, pa.list_(pa.string())),
        (SCORES, pa.list_(pa.float32())),  # softmax probabilities, descending
        (MODEL, pa.string()),
        (MODEL_DIGEST, pa.string()),  # sha256 of the model's files, labels and spec (pipeline.model.folder.model_digest)
        (ENGINE, pa.string()),
        (SIZE_BYTES, pa.int64()),
        (WIDTH, pa.int32()),
        (HEIGHT, pa.int32()),
        (ETAG, pa.string()),
        (MTIME, pa.timestamp("us", tz="UTC")),
        (CLASSIFIED_AT, pa.timestamp("us", tz="UTC")),
        (CARRIED, pa.bool_()),  # copied from the previous run's output: the object had not changed
    ]
)
# A model's answer in the rows, as the top-level columns of one unnamed model or one struct column per named model.
MODEL_FIELDS = (CLASS_IDS, LABELS, SCORES, MODEL, MODEL_DIGEST)


def embedding_type(dim: int) -> pa.DataType:
    """An embedding column's type: float32, the type vector stores (Lance, DuckDB's FLOAT[n], pgvector) and Iceberg
    take without conversion (neither Iceberg nor pgvector has float16)."""
    return pa.list_(pa.float32(), dim)


def model_struct(embedding_dim: int | None = None) -> pa.StructType:
    """One named model's column: its top-k, its model and digest, and its embedding where it has one."""
    fields = [OUTPUT_SCHEMA.field(name) for name in MODEL_FIELDS]
    if embedding_dim:
        fields.append(pa.field(EMBEDDING, embedding_type(embedding_dim)))
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
        return OUTPUT_SCHEMA.insert(at, pa.field(EMBEDDING, embedding_type(dim)))
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


# One row per listed object (and per listing error) between the listing and the fetch.
LISTING_SCHEMA = pa.schema(
    [
        (URI, pa.string()),
        (SIZE_BYTES, pa.int64()),
        (ETAG, pa.string()),
        (MTIME, pa.timestamp("us", tz="UTC")),
        (CARRIED, pa.bool_()),
        (STATUS, pa.string()), (ERROR, pa.string()),  # set only on a list_error row
    ]
)

# Bookkeeping files in DEST. They start with "_" (or "." while being written) so Parquet readers skip them.
SUCCESS = "_SUCCESS"  # JSON: counts, options, times; written last, only when a run completes
REPORT = "_REPORT.json"  # the last run's report
RUN_INFO = "_RUN.json"  # model, model digest and top-k of the rows in DEST
LEASE = "_LEASE.json"  # the run writing DEST now: host, pid, start time, last renewal (pipeline.job.lease)
PART_PREFIX = "part-"  # committed shards: part-<content hash>.parquet
PART_SUFFIX = ".parquet"
# Shards live in DEST/<group>/, the group being the first GROUP_CHARS hex digits of the shard's content hash:
# 256 folders, so 100 M rows in 1,000-row shards put ~400 files in a folder (10,000 at 2.5 G rows).
GROUP_CHARS = 2
# This tool's JSON files in DEST; --overwrite deletes one only if it reads as ours (a JSON object with these keys).
BOOKKEEPING = (SUCCESS, REPORT, RUN_INFO)
BOOKKEEPING_KEYS = ("model", "started_at")
# Each shard's Parquet footer carries its commit record (counts, model, sorted int64 URI hashes and the
# identity hashes of its carryable rows), so resume, carry-over and counts read footers, not rows.
RECORD_KEY = b"bulk_classify.record"
SHARD_META_KEY = b"bulk_classify.shard"
QUALITY_KEY = b"bulk_classify.quality"  # the shard's quality counters (pipeline.quality.statistics.QualityStats state)

# Columns that exist only between stages: encoded bytes and per-row shares of stage time.
DATA = "_data"
FETCH_S = "_fetch_s"
DECODE_S = "_decode_s"
INFER_S = "_infer_s"
CALLS = "_engine_calls"
# JSON {event: count} of what the engine counted since its actor's previous call (server starts, restarts,
# failovers, answers checked), on one row of the call; null on the others.
ENGINE_EVENTS = "_engine_events"
WORK_COLUMNS = pa.schema([(DATA, pa.binary()), (FETCH_S, pa.float64()), (DECODE_S, pa.float64()),
                          (INFER_S, pa.float64()), (CALLS, pa.float64()), (ENGINE_EVENTS, pa.string())])
WORK_SCHEMA = work_schema()


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
