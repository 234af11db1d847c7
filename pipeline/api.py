"""The Python API: run a job as the CLI does (``run``), or classify inside your own Ray Data pipeline (``Classifier``).

``run`` takes the ``RunConfig`` that ``bulk-classify run`` builds and returns the run's counts. ``Classifier`` is a
callable class for ``ds.map_batches``: give it a column of URIs (any fsspec store, S3 included) or of encoded bytes;
it adds the job's result columns to each batch and passes every other column through. A bad image or a missing
object is a row with ``status == "error"`` and its ``error``, never an exception. docs/api.md shows both.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import pyarrow as pa

from pipeline.actor import ClassifyActor
from pipeline.columns import conform, output_schema, work_schema
from pipeline.config import RunConfig, check_top_k
from pipeline.engines.registry import DEFAULT_ENGINE
from pipeline.errors import ConfigError, LIST_ERROR
from pipeline.io.fetch import fetch_batch
from pipeline.io.keys import object_uri
from pipeline.model.imaging import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS
from pipeline.model.model_set import parse_model_args
from pipeline.schema import DATA, DEFAULT_TOP_K, OUTPUT_SCHEMA, STATUS_ERROR, STATUS_OK

# The columns ``Classifier`` adds to a batch for one model, typed as in the job's output
# (pipeline.schema.OUTPUT_SCHEMA); a model set's answers replace MODEL_COLUMNS with a struct column per model.
RESULT_COLUMNS = ("status", "error", "class_ids", "labels", "scores", "width", "height", "model", "model_digest",
                  "engine")
MODEL_COLUMNS = ("class_ids", "labels", "scores", "embedding")
DEFAULT_URI_COLUMN = "uri"
DEFAULT_BYTES_COLUMN = "bytes"  # the column ``ray.data.read_binary_files`` gives


@dataclass(frozen=True)
class RunResult:
    """What a run did.

    Attributes:
        output: where the rows are (the output folder, URL or ``iceberg://`` table).
        rows: the output's committed rows, this run's and earlier runs' (one per listed object).
        ok, errors: of those, the rows with ``status == "ok"`` and with ``status == "error"``.
        classified: objects this run classified (error rows included).
        carried: rows this run copied from ``previous`` (unchanged objects).
        already_done: objects skipped because the output already had their rows (a resumed run).
        error_kinds: the output's error rows by kind (``not_found``, ``decode_error``, ``list_error``, ...).
        list_errors: folders or links the listing could not read (also counted in ``error_kinds``).
        elapsed_s: the run's wall time, checks included.
    """

    output: str
    rows: int
    ok: int
    errors: int
    classified: int
    carried: int
    already_done: int
    error_kinds: Mapping[str, int]
    list_errors: int
    elapsed_s: float


def run(config: RunConfig | None = None, /, *, progress: Callable[[int, int | None, int], None] | None = None,
        **options: Any) -> RunResult:
    """Classify every image under ``source`` that has no row in ``output`` yet, as ``bulk-classify run`` does.

    Args:
        config: the run's ``RunConfig``; or leave it out and give its fields as keyword arguments
            (``source=``, ``output=``, ``engine=``, ...), merged as the CLI merges them: defaults <
            ``BULK_CLASSIFY_*`` environment < these. With both, the keywords replace the config's fields.
        progress: called now and then with (objects done, objects listed so far or None, rows written).

    Returns:
        The run's counts (``RunResult``); the rows themselves are in the output.

    Raises:
        ConfigError, SourceError, OutputError, ModelError (``pipeline.errors``): before any work, when the options,
        storage or model are unusable; the message says the fix. Bad images become error rows and never raise.
    """
    from pipeline.job.run import run_job  # noqa: PLC0415 - the job (Ray) loads only where a job runs

    if config is None:
        config = RunConfig.build(options)
    elif options:
        config = dataclasses.replace(config, **options)
    summary = run_job(config, progress=progress)
    kinds = dict(summary.report.get("quality", {}).get("error_kinds", {}))
    return RunResult(
        output=summary.output, rows=summary.total, ok=summary.counts.get(STATUS_OK, 0),
        errors=summary.counts.get(STATUS_ERROR, 0), classified=summary.classified, carried=summary.carried,
        already_done=summary.already_done, error_kinds=kinds, list_errors=kinds.get(LIST_ERROR, 0),
        elapsed_s=summary.elapsed_s,
    )


class Classifier:
    """A ``map_batches`` callable: images in a column of URIs or of bytes in, the job's result columns out.

    Use it as the class itself, so each Ray actor loads the model once::

        ds.map_batches(Classifier, fn_constructor_kwargs={"engine": "onnx"}, concurrency=2, batch_size=64)

    Each batch (pyarrow, pandas or numpy format) comes back in its own format with every input column unchanged
    and ``RESULT_COLUMNS`` added (replacing columns of the same names): ``status`` ("ok"/"error"), ``error``
    ("kind: detail", null when ok), ``class_ids``, ``labels`` and ``scores`` (top ``top_k``, best first),
    ``width``, ``height``, ``model``, ``model_digest`` and ``engine``.

    Args:
        model: a model folder (``model.onnx``, ``labels.txt``, ``preprocess.json``), or None for the built-in
            EfficientNet-Lite0; or a list of ``NAME=DIR`` items, a model set run on one decode of each image, each
            model's answer in its column NAME (a struct: class_ids, labels, scores, model, model_digest, embedding)
            instead of ``class_ids``, ``labels`` and ``scores``.
        engine: ``auto``, the default as for ``bulk-classify run`` (the triton engine's gpu profile where this
            process sees a GPU, onnx elsewhere), or a registered engine (``bulk-classify engines`` lists them): onnx,
            openvino, triton, gpu. A GPU engine wants ``num_gpus=`` in ``map_batches``.
        engine_options: the engine's options, as ``--engine-option NAME=VALUE`` takes them.
        top_k: labels per image.
        uri_column: the column of object URIs (``s3://…``, ``file://…``, any fsspec URL, or a local path), read
            where the batch has no ``bytes_column``.
        bytes_column: the column of encoded images; used when the batch has it.
        storage_options: fsspec options for reading the URIs (credentials, endpoint), as ``--storage-option``.
        fetch_threads, retries: concurrent reads per batch, and retries of a transient storage error.
        max_bytes, max_pixels: larger images become error rows (``too_large``, ``too_many_pixels``).
        decode_threads: threads decoding in the actor (the engine's default when None).

    Raises:
        ConfigError: an unknown engine or option, or a batch with neither column. ModelError: an unusable model.
    """

    def __init__(self, *, model: str | os.PathLike | list[str] | None = None, engine: str = DEFAULT_ENGINE,
                 engine_options: Mapping[str, Any] | None = None, top_k: int = DEFAULT_TOP_K,
                 uri_column: str = DEFAULT_URI_COLUMN, bytes_column: str = DEFAULT_BYTES_COLUMN,
                 storage_options: Mapping[str, Any] | None = None, fetch_threads: int = 16, retries: int = 5,
                 max_bytes: int = DEFAULT_MAX_BYTES, max_pixels: int = DEFAULT_MAX_PIXELS,
                 decode_threads: int | None = None):
        from pipeline.job.plan import classifier_engine  # noqa: PLC0415

        check_top_k(top_k, "top_k")
        spec, options = classifier_engine(engine, engine_options, decode_threads)  # ConfigError lists the engines
        self.uri_column, self.bytes_column = uri_column, bytes_column
        self.storage_options = dict(storage_options or {})
        self.fetch_threads, self.retries, self.max_bytes = fetch_threads, retries, max_bytes
        ref, named = parse_model_args([str(m) for m in model]) if isinstance(model, (list, tuple)) else (
            None if model is None else str(model), ())
        if len(named) > 1 and not spec.several_models:
            raise ConfigError(f"engine {spec.name!r} runs one model a pass; use engine='onnx' for a model set")
        self._actor = ClassifyActor(model=ref, models=[(name, path, None) for name, path in named], engine=spec,
                                    top_k=top_k, max_bytes=max_bytes, max_pixels=max_pixels, engine_options=options)
        for bundle in self._actor.bundles:
            spec.check_model(bundle, options)  # INT8 or a layout this engine cannot run: refused here
        self.model_name, self.model_digest = self._actor.identity.name, self._actor.identity.digest
        # The output's columns for these models: one model's top-level ones, or a struct column per named model.
        self.schema = output_schema(tuple((n, b.spec.embedding.dim if b.spec.embedding else None)
                                          for n, b in zip([*self._actor.names] or [None], self._actor.bundles)))
        answers = list(self._actor.names) or [c for c in MODEL_COLUMNS if c in self.schema.names]
        self.result_columns = ["status", "error", *answers, "width", "height", "model", "model_digest", "engine"]

    def __call__(self, batch: Any) -> Any:
        """``batch`` with the result columns added; the input's format (pyarrow, pandas or dict) is kept."""
        names = list(batch.column_names) if isinstance(batch, pa.Table) else list(batch.keys())
        if self.bytes_column in names:
            work = self._from_bytes(_values(batch, self.bytes_column))
        elif self.uri_column in names:
            work = self._from_uris(_values(batch, self.uri_column))
        else:
            raise ConfigError(f"the batch has neither a {self.uri_column!r} column (URIs) nor a "
                              f"{self.bytes_column!r} column (encoded images); its columns are {names}: pass "
                              "uri_column= or bytes_column= to Classifier")
        results = self._actor(work)
        return _with_columns(batch, {name: results.column(name) for name in self.result_columns}, self.schema)

    def _from_bytes(self, data: list[Any]) -> pa.Table:
        missing = [value is None for value in data]
        return _work_table(
            self.schema,
            uri=[None] * len(data),
            data=[None if value is None else bytes(value) for value in data],
            status=[STATUS_ERROR if m else None for m in missing],
            error=[f"empty: the {self.bytes_column!r} column is null" if m else None for m in missing],
        )

    def _from_uris(self, uris: list[Any]) -> pa.Table:
        status = [None if uri else STATUS_ERROR for uri in uris]
        error = [None if uri else f"not_found: the {self.uri_column!r} column is null or empty" for uri in uris]
        work = _work_table(self.schema, uri=[_as_uri(uri) if uri else None for uri in uris],
                           data=[None] * len(uris), status=status, error=error)
        return fetch_batch(work, source=None, storage_options=self.storage_options, threads=self.fetch_threads,
                           max_bytes=self.max_bytes, retries=self.retries)

    def close(self) -> None:
        """Stops the engine (a local tritonserver, the GPU's memory); Ray calls it at the actor's exit too."""
        self._actor.close()


def _as_uri(uri: Any) -> str:
    """A URL as it is; a local path as its ``file://`` URI, which the fetch code reads back as the same file."""
    text = str(uri)
    return text if "://" in text else object_uri("file", os.path.abspath(text))


def _work_table(schema: pa.Schema, **columns: list[Any]) -> pa.Table:
    """The job's working columns for an output of ``schema`` (``pipeline.columns.work_schema``) for rows that are
    neither listed nor carried."""
    n = len(columns["uri"])
    table = pa.table({"uri": pa.array(columns["uri"], pa.string()), "status": pa.array(columns["status"], pa.string()),
                      "error": pa.array(columns["error"], pa.string()), DATA: pa.array(columns["data"], pa.binary()),
                      "carried": pa.array([False] * n, pa.bool_())})
    return conform(table, work_schema(schema))


def _values(batch: Any, name: str) -> list[Any]:
    column = batch[name]
    if isinstance(column, (pa.ChunkedArray, pa.Array)):
        return column.to_pylist()
    return [None if _is_null(v) else v for v in column.tolist()]


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)  # pandas gives NaN for a missing value


def _with_columns(batch: Any, results: dict[str, pa.ChunkedArray], schema: pa.Schema = OUTPUT_SCHEMA) -> Any:
    """``batch`` in its own format with ``results`` (columns of ``schema``) set, every other column untouched."""
    if isinstance(batch, pa.Table):
        out = batch
        for name, column in results.items():
            field = schema.field(name)
            index = out.schema.get_field_index(name)
            out = out.set_column(index, field, column) if index >= 0 else out.append_column(field, column)
        return out
    if isinstance(batch, dict):
        import numpy as np  # noqa: PLC0415

        out = dict(batch)
        for name, column in results.items():
            # Python values (lists, ints, None) in object arrays: Ray turns each back into its Arrow type, nulls kept.
            array = np.empty(len(column), dtype=object)
            array[:] = column.to_pylist()
            out[name] = array
        return out
    out = batch.copy()  # pandas
    for name, column in results.items():
        out[name] = column.to_pylist() if pa.types.is_list(column.type) else column.to_pandas().to_numpy()
    return out
