"""Run reports: the numbers of one run (``_REPORT.json``) and summaries of any finished output (``report DEST``)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any, Mapping

from pipeline.errors import LIST_ERROR, ConfigError, OutputError
from pipeline.io.iceberg_output import is_iceberg, table_parts
from pipeline.io.reader import committed_parts, read_json
from pipeline.io.stats import STAGES, value_counts
from pipeline.schema import PART_PREFIX, REPORT, STATUS_ERROR, STATUS_OK, SUCCESS

LOG = logging.getLogger(__name__)

REPORT_VERSION = 1
TOP_LABELS = 10
# Columns summarize_output reads; everything else in the shards is left on storage.
SUMMARY_COLUMNS = ("status", "error", "labels", "model")


def build_run_report(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Turn the job's raw counters into the JSON-safe run report written as ``_REPORT.json``.

    Args:
        stats: ``counts`` {status: n}, ``error_kinds`` {kind: n}, ``images`` (rows this run), ``classified``,
            ``carried``, ``elapsed_s``, ``stage_seconds`` {list, fetch, decode_preprocess, infer, write}
            (seconds summed over tasks; a stage may be None when the engine cannot separate it),
            ``engine_calls``, ``model``, ``model_digest``, ``engine``, ``started_at``, ``finished_at``; optional ``already_done``,
            ``engine_events`` {event: n} (the triton engine's server starts, restarts, failovers, answers checked)
            and ``writer_actors`` (0: the driver committed the classified shards).

    Returns:
        The report: the inputs cleaned up plus ``images_per_s`` (rows classified per wall second),
        ``rows_per_s`` (all rows written, carried included), ``avg_batch_size`` (classified / engine calls)
        and ``stage_share`` (each stage's fraction of the summed stage time).
    """
    counts = {str(k): _count(v, f"counts[{k!r}]") for k, v in dict(stats.get("counts") or {}).items()}
    kinds = {str(k): _count(v, f"error_kinds[{k!r}]") for k, v in dict(stats.get("error_kinds") or {}).items()}
    images = _count(stats.get("images", sum(counts.values())), "images")
    classified = _count(stats.get("classified", images), "classified")
    carried = _count(stats.get("carried", 0), "carried")
    elapsed_s = _seconds(stats.get("elapsed_s"), "elapsed_s")
    engine_calls = _count(round(float(stats.get("engine_calls") or 0)), "engine_calls")
    stage_in = dict(stats.get("stage_seconds") or {})
    unknown = set(stage_in) - set(STAGES)
    if unknown:
        raise ConfigError(f"stage_seconds has unknown stage(s) {sorted(unknown)}; use {', '.join(STAGES)}")
    stage_seconds = {s: (None if stage_in.get(s) is None else _seconds(stage_in[s], f"stage_seconds[{s}]"))
                     for s in STAGES}
    stage_total = sum(v for v in stage_seconds.values() if v is not None)
    report: dict[str, Any] = {
        "version": REPORT_VERSION,
        "model": stats.get("model"),
        "model_digest": _text(stats.get("model_digest")),
        "engine": stats.get("engine"),
        "writer_actors": _count(stats.get("writer_actors", 0), "writer_actors"),
        "started_at": _text(stats.get("started_at")),
        "finished_at": _text(stats.get("finished_at")),
        "elapsed_s": round(elapsed_s, 3),
        "images": images,
        "classified": classified,
        "carried": carried,
        "already_done": _count(stats.get("already_done", 0), "already_done"),
        "counts": dict(sorted(counts.items())),
        "error_kinds": dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
        "images_per_s": round(classified / elapsed_s, 2) if elapsed_s > 0 else None,
        "rows_per_s": round(images / elapsed_s, 2) if elapsed_s > 0 else None,
        "engine_calls": engine_calls,
        "engine_events": {str(k): _count(v, f"engine_events[{k!r}]")
                          for k, v in sorted(dict(stats.get("engine_events") or {}).items())},
        "avg_batch_size": round(classified / engine_calls, 2) if engine_calls else None,
        "stage_seconds": {s: (None if v is None else round(v, 3)) for s, v in stage_seconds.items()},
        "stage_share": {s: (None if v is None or stage_total <= 0 else round(v / stage_total, 4))
                        for s, v in stage_seconds.items()},
    }
    errors = counts.get(STATUS_ERROR, 0)
    if kinds and sum(kinds.values()) != errors:
        LOG.warning("error kinds add up to %d but %d error rows were counted", sum(kinds.values()), errors)
    return report


def format_run_report(report: Mapping[str, Any]) -> str:
    """The short table the CLI prints at the end of a run."""
    counts = report.get("counts") or {}
    lines = [
        f"model {report.get('model')}  engine {report.get('engine')}  elapsed {_fmt_s(report.get('elapsed_s'))}",
        _row("rows", report.get("images", 0), "  ".join(f"{k} {_n(v)}" for k, v in counts.items())),
        _row("classified", report.get("classified", 0),
             f"carried {_n(report.get('carried', 0))}  already done {_n(report.get('already_done', 0))}"),
        _row("img/s", report.get("images_per_s"), f"rows/s {_num(report.get('rows_per_s'))}"),
        _row("avg batch", report.get("avg_batch_size"), f"{_n(report.get('engine_calls', 0))} engine calls"),
    ]
    kinds = report.get("error_kinds") or {}
    if kinds:
        lines.append(_row("errors", sum(kinds.values()), ", ".join(f"{k} {_n(v)}" for k, v in kinds.items())))
    if report.get("engine_events"):
        lines.append(_events_row(report["engine_events"]))
    lines.append(f"{'stage':<20}{'seconds':>10}{'share':>8}")
    shares = report.get("stage_share") or {}
    for stage, seconds in (report.get("stage_seconds") or {}).items():
        share = shares.get(stage)
        lines.append(f"  {stage:<18}{_num(seconds):>10}{'-' if share is None else f'{share:.0%}':>8}")
    return "\n".join(lines)


def summarize_output(dest: str, storage_options: Mapping[str, Any] | None = None,
                     catalog_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Summarise a finished (or partial) output folder, or an Iceberg table's current (or ``@``) snapshot:
    counts, error kinds, top labels, models (and a model set's top labels by model).

    Reads only the ``status``, ``error``, ``labels`` and ``model`` columns (a model set's model columns), one shard at
    a time, so it works on outputs far larger than memory.

    Raises:
        OutputError: DEST cannot be read or holds no ``part-*.parquet`` shard.
    """
    import fsspec
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq


    try:
        if is_iceberg(dest):
            fs, root, parts = table_parts(dest, catalog_options, storage_options)
            names = parts
        else:
            fs, root = fsspec.core.url_to_fs(dest, **dict(storage_options or {}))
            names = fs.ls(root, detail=False) if fs.isdir(root) else []
            parts = committed_parts(fs, root) if names else []
    except (ImportError, ValueError, TypeError, OSError) as err:
        raise OutputError(f"cannot read {dest!r}: {err}; check the URL, credentials and AWS_ENDPOINT_URL") from None
    if not parts:
        runs = sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in names if fs.isdir(n) and any(
            p.rsplit("/", 1)[-1].startswith(PART_PREFIX) for p in fs.ls(n, detail=False)))
        inside = f" (it holds run folders: {', '.join(runs[-3:])}; give one of them)" if runs else ""
        raise OutputError(f"{dest!r} holds no part-*.parquet shard; point 'report' at a run's --output folder{inside}")

    status: Counter = Counter()
    kinds: Counter = Counter()
    labels: Counter = Counter()
    models: Counter = Counter()
    each: dict[str, Counter] = {}  # a model set's top-1 labels, by model
    for path in parts:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            named = [f.name for f in pf.schema_arrow if pa.types.is_struct(f.type)
                     and f.type.get_field_index("labels") >= 0]
            present = [c for c in SUMMARY_COLUMNS if c in pf.schema_arrow.names]
            table = pf.read(columns=present + named)
        for name in named:
            answered = pc.struct_field(table.column(name).filter(pc.is_valid(table.column(name))), "labels")
            answered = answered.filter(pc.greater(pc.list_value_length(answered), 0))
            each.setdefault(name, Counter()).update(value_counts(pc.list_element(answered, 0)) if len(answered)
                                                    else {})
        if "status" in present:
            status.update(value_counts(table.column("status")))
        if "error" in present:
            errors = pc.drop_null(table.column("error"))
            if len(errors):
                kind = pc.list_element(pc.split_pattern(errors, ":", max_splits=1), 0)
                kinds.update(value_counts(pc.utf8_trim_whitespace(kind)))
        if "labels" in present and "status" in present:
            ok = table.filter(pc.equal(table.column("status"), STATUS_OK)).column("labels")
            ok = ok.filter(pc.greater(pc.list_value_length(ok), 0))
            if len(ok):
                labels.update(value_counts(pc.list_element(ok, 0)))
        if "model" in present:
            models.update(value_counts(table.column("model")))

    success = read_json(fs, root, SUCCESS)
    run = read_json(fs, root, REPORT)
    rows = sum(status.values())
    return {
        "dest": dest,
        "complete": success is not None,
        "shards": len(parts),
        "rows": rows,
        "counts": dict(sorted(status.items())),
        "error_kinds": dict(kinds.most_common()),
        "list_errors": kinds.get(LIST_ERROR, 0),  # folders and links the listing could not read: rows of their own
        "top_labels": [{"label": k, "count": v, "share": round(v / rows, 4) if rows else 0.0}
                       for k, v in labels.most_common(TOP_LABELS)],
        "models": dict(models.most_common()),
        **({"model_top_labels": {name: [{"label": k, "count": v, "share": round(v / rows, 4) if rows else 0.0}
                                        for k, v in c.most_common(TOP_LABELS)] for name, c in each.items()}}
           if each else {}),
        "finished_at": (success or {}).get("finished_at"),
        "last_run": None if run is None else {k: run.get(k) for k in (
            "engine", "elapsed_s", "images", "classified", "carried", "images_per_s", "avg_batch_size",
            "engine_events")},
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """The table ``bulk-classify report DEST`` prints."""
    state = "complete" if summary.get("complete") else "INCOMPLETE (no _SUCCESS: interrupted or still running)"
    counts = summary.get("counts") or {}
    lines = [
        f"{summary.get('dest')}: {state}",
        _row("rows", summary.get("rows", 0),
             f"{'  '.join(f'{k} {_n(v)}' for k, v in counts.items())}  in {_n(summary.get('shards', 0))} shards"),
        _row("model", ", ".join(f"{m} ({_n(n)})" for m, n in (summary.get("models") or {}).items()) or "-", ""),
    ]
    last = summary.get("last_run")
    if last:
        lines.append(_row("last run", f"{_fmt_s(last.get('elapsed_s'))}",
                          f"engine {last.get('engine')}  {_num(last.get('images_per_s'))} img/s  "
                          f"classified {_n(last.get('classified') or 0)}  carried {_n(last.get('carried') or 0)}"))
        if last.get("engine_events"):
            lines.append(_events_row(last["engine_events"]))
    if summary.get("list_errors"):
        lines.append(_row("not listed", summary["list_errors"],
                          f"folders or links the listing could not read (their {LIST_ERROR} rows say why)"))
    kinds = summary.get("error_kinds") or {}
    if kinds:
        lines.append(f"{'error kind':<20}{'rows':>10}")
        lines += [f"  {k:<18}{_n(v):>10}" for k, v in kinds.items()]
    tops = [("top-1 label", summary.get("top_labels") or [])]
    tops += [(f"top-1 of {name}", top) for name, top in (summary.get("model_top_labels") or {}).items()]
    for title, top in tops:
        if top:
            lines.append(f"{title[:28]:<28}{'rows':>10}{'share':>8}")
            lines += [f"  {t['label'][:26]:<26}{_n(t['count']):>10}{t['share']:>8.1%}" for t in top]
    return "\n".join(lines)


def _events_row(events: Mapping[str, int]) -> str:
    """The engine's counters in one line: "server starts 1  server restarts 0  ..."."""
    return f"{'engine events':<20}" + "  ".join(f"{k.replace('_', ' ')} {_n(v)}" for k, v in events.items())


def _count(value: Any, name: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"run stats {name}={value!r} is not a count") from None
    if n < 0 or n != value and not (isinstance(value, float) and n == round(value)):
        raise ConfigError(f"run stats {name}={value!r} is not a non-negative whole number")
    return n


def _seconds(value: Any, name: str) -> float:
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"run stats {name}={value!r} is not a number of seconds") from None
    if s < 0 or math.isnan(s) or math.isinf(s):
        raise ConfigError(f"run stats {name}={value!r} must be a finite number of seconds >= 0")
    return s


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _n(value: Any) -> str:
    return f"{int(value):,}"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"


def _fmt_s(value: Any) -> str:
    return "-" if value is None else f"{float(value):,.1f} s"


def _row(name: str, value: Any, rest: str) -> str:
    shown = value if isinstance(value, str) else _num(value)
    return f"{name:<12}{shown:>10}  {rest}".rstrip()
