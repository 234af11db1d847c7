"""The names every floor shares: statuses, stage names, the top-k default, the output's columns and one model's schema
(a run's models lay theirs out in ``pipeline.columns``), the listing's schema, bookkeeping files and working columns."""

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
EMBEDDING = "embedding"  # a model's embedding, where its spec declares one (list<float32>, dim values a row)

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
WORK_SCHEMA = pa.schema(list(OUTPUT_SCHEMA) + list(WORK_COLUMNS))  # one unnamed model's (pipeline.columns)

