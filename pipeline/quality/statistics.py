"""Quality statistics of an output (confidence, margin, labels, errors) and the drift gate between two outputs.

Every run writes :func:`output_quality` of its committed rows into ``_REPORT.json`` (key ``quality``);
``bulk-classify report DEST --against PREV`` compares two outputs with :func:`compare_outputs`:

* PSI (population stability index) of the top-1 confidence histogram, over fixed bins;
* Jensen–Shannon divergence (base 2, so 0 ≤ JS ≤ 1) of the top-1 label distribution;
* the labels whose share moved most, with counts;
* the change in error rate by kind (error rows of that kind / all rows).

A comparison that crosses a threshold has ``passed = False``; the CLI then exits with
:data:`DRIFT_EXIT_CODE`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from pipeline.errors import ConfigError, OutputError
from pipeline.io.iceberg_output import is_iceberg, table_parts
from pipeline.io.reader import committed_parts, iter_footers, read_json
from pipeline.io.stats import value_counts
from pipeline.io.writer import write_json
from pipeline.schema import QUALITY_KEY, STATUS_OK
from pipeline.storage import open_fs

QUALITY_VERSION = 1
# Fixed bins, so two nights' histograms always line up: 20 bins of 0.05 over [0, 1].
CONFIDENCE_EDGES = tuple(round(i * 0.05, 2) for i in range(21))
CONFIDENCE_FLOOR = 0.3  # top-1 below this counts as "unsure"
QUALITY_COLUMNS = ("status", "error", "labels", "scores", "carried")
# Shares of an empty bin/label are floored at this before the logarithm (PSI is infinite otherwise).
PSI_EPSILON = 1e-4
LABEL_SHIFTS = 10
# Exit status of `bulk-classify report --against` when a threshold is crossed (1 is a usage or storage
# error from click, 2 a bad option), so a scheduler can tell drift from a failure to compare.
DRIFT_EXIT_CODE = 3
AGAINST_RECORDED = "previous"  # `--against previous`: the output the night compared itself with


@dataclass(frozen=True, kw_only=True)
class DriftThresholds:
    """Where the gate trips. Defaults, and why, are in the README's "Quality gate" section.

    Attributes:
        psi_max: largest PSI of the top-1 confidence histogram that passes (0.25 is the conventional
            "major shift" line; plain resampling of the same photos stays far below it).
        js_max: largest Jensen–Shannon divergence (bits) of the top-1 label distribution that passes.
        error_rate_max_increase: largest rise of any error kind's rate (fraction of rows, 0.02 = 2 points).
        min_rows: below this many rows on either side the comparison is reported but never fails
            (a histogram of a handful of images moves by chance).
    """

    psi_max: float = 0.25
    js_max: float = 0.05
    error_rate_max_increase: float = 0.02
    min_rows: int = 20

    def __post_init__(self) -> None:
        for name in ("psi_max", "js_max", "error_rate_max_increase"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a number >= 0, e.g. --{name.replace('_', '-')} 0.1")
        if not isinstance(self.min_rows, int) or self.min_rows < 0:
            raise ConfigError(f"min_rows={self.min_rows!r} must be a whole number >= 0")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class QualityStats:
    """Counts that merge: one per shard, summed over an output. ``carried_*`` count the carried rows alone."""

    rows: int = 0
    ok: int = 0
    carried: int = 0
    confidence: np.ndarray = field(default_factory=lambda: np.zeros(len(CONFIDENCE_EDGES) - 1, np.int64))
    carried_confidence: np.ndarray = field(default_factory=lambda: np.zeros(len(CONFIDENCE_EDGES) - 1, np.int64))
    margin: np.ndarray = field(default_factory=lambda: np.zeros(len(CONFIDENCE_EDGES) - 1, np.int64))
    confidence_sum: float = 0.0
    margin_sum: float = 0.0
    margin_rows: int = 0
    below_floor: int = 0
    labels: Counter = field(default_factory=Counter)
    error_kinds: Counter = field(default_factory=Counter)
    # A model set's: each model's own counts (its column's rows with an answer as its ok rows), by name.
    models: dict[str, "QualityStats"] = field(default_factory=dict)

    def add_table(self, table: Any) -> "QualityStats":
        """Add the rows of one shard (a pyarrow Table with some of ``QUALITY_COLUMNS``)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        n = table.num_rows
        if n == 0:
            return self
        names = table.column_names
        self.rows += n
        status = table.column("status") if "status" in names else pa.nulls(n, pa.string())
        ok_mask = pc.fill_null(pc.equal(status, STATUS_OK), False)
        carried = (pc.fill_null(table.column("carried"), False) if "carried" in names
                   else pa.array(np.zeros(n, bool)))
        self.carried += int(pc.sum(carried).as_py() or 0)
        if "error" in names:
            errors = pc.drop_null(table.column("error"))
            if len(errors):
                kind = pc.utf8_trim_whitespace(pc.list_element(pc.split_pattern(errors, ":", max_splits=1), 0))
                self.error_kinds.update(value_counts(kind))
        if "scores" not in names:
            self._add_models(table, ok_mask)
            return self
        ok = table.filter(ok_mask)
        scores = ok.column("scores")
        has = pc.fill_null(pc.greater(pc.list_value_length(scores), 0), False)
        ok = ok.filter(has)
        self.ok += ok.num_rows
        if ok.num_rows == 0:
            return self
        top1 = pc.list_element(ok.column("scores"), 0).to_numpy(zero_copy_only=False).astype(np.float64)
        self.confidence += _bin(top1)
        okc = (pc.fill_null(ok.column("carried"), False).to_numpy(zero_copy_only=False).astype(bool)
               if "carried" in ok.column_names else np.zeros(len(top1), bool))
        self.carried_confidence += _bin(top1[okc])
        self.confidence_sum += float(top1.sum())
        self.below_floor += int((top1 < CONFIDENCE_FLOOR).sum())
        two = pc.greater_equal(pc.list_value_length(ok.column("scores")), 2).to_numpy(zero_copy_only=False)
        if two.any():
            second = pc.list_element(ok.column("scores").filter(pa.array(two)), 1).to_numpy(zero_copy_only=False)
            margin = top1[two] - second.astype(np.float64)
            self.margin += _bin(margin)
            self.margin_sum += float(margin.sum())
            self.margin_rows += int(two.sum())
        if "labels" in ok.column_names:
            labels = ok.column("labels")
            labels = labels.filter(pc.fill_null(pc.greater(pc.list_value_length(labels), 0), False))
            self.labels.update(value_counts(pc.list_element(labels, 0)))
        return self

    def _add_models(self, table: Any, ok_mask: Any) -> None:
        """A model set's rows: the ok rows, and each model's column as that model's rows (an answer: ok)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        columns = [f.name for f in table.schema
                   if pa.types.is_struct(f.type) and f.type.get_field_index("scores") >= 0]
        if not columns:
            return
        self.ok += int(pc.sum(ok_mask).as_py() or 0)
        for name in columns:
            answer = table.column(name)
            sub = pa.table({"status": pc.if_else(pc.is_valid(answer), STATUS_OK, None),
                            "labels": pc.struct_field(answer, "labels"), "scores": pc.struct_field(answer, "scores"),
                            **({"carried": table.column("carried")} if "carried" in table.column_names else {})})
            self.models.setdefault(name, QualityStats()).add_table(sub)

    def merge(self, other: "QualityStats") -> "QualityStats":
        for name in ("rows", "ok", "carried", "confidence_sum", "margin_sum", "margin_rows", "below_floor"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.confidence += other.confidence
        self.carried_confidence += other.carried_confidence
        self.margin += other.margin
        self.labels.update(other.labels)
        self.error_kinds.update(other.error_kinds)
        for name, stats in other.models.items():
            self.models.setdefault(name, QualityStats()).merge(stats)
        return self

    def to_state(self) -> dict[str, Any]:
        """The raw counters, JSON-safe and lossless (what a shard's footer keeps, so outputs merge footers)."""
        return {"version": QUALITY_VERSION, **{name: getattr(self, name) for name in (
            "rows", "ok", "carried", "confidence_sum", "margin_sum", "margin_rows", "below_floor")},
            **{name: getattr(self, name).tolist() for name in ("confidence", "carried_confidence", "margin")},
            "labels": dict(self.labels), "error_kinds": dict(self.error_kinds),
            **({"models": {n: m.to_state() for n, m in self.models.items()}} if self.models else {})}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "QualityStats":
        stats = cls(**{k: v for k, v in state.items() if k not in (
            "version", "confidence", "carried_confidence", "margin", "labels", "error_kinds", "models")})
        stats.models = {n: cls.from_state(m) for n, m in (state.get("models") or {}).items()}
        for name in ("confidence", "carried_confidence", "margin"):
            setattr(stats, name, np.asarray(state[name], np.int64))
        stats.labels, stats.error_kinds = Counter(state["labels"]), Counter(state["error_kinds"])
        return stats

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written under ``quality`` in ``_REPORT.json``."""
        errors = sum(self.error_kinds.values())
        return {
            "version": QUALITY_VERSION,
            "rows": self.rows,
            "ok": self.ok,
            "errors": errors,
            "carried": self.carried,
            "confidence": {
                "edges": list(CONFIDENCE_EDGES),
                "counts": self.confidence.tolist(),
                "carried_counts": self.carried_confidence.tolist(),
                "mean": round(self.confidence_sum / self.ok, 6) if self.ok else None,
            },
            "margin": {
                "edges": list(CONFIDENCE_EDGES),
                "counts": self.margin.tolist(),
                "mean": round(self.margin_sum / self.margin_rows, 6) if self.margin_rows else None,
            },
            "below_floor": {
                "floor": CONFIDENCE_FLOOR,
                "rows": self.below_floor,
                "share": round(self.below_floor / self.ok, 6) if self.ok else None,
            },
            "labels": dict(sorted(self.labels.items(), key=lambda kv: (-kv[1], kv[0]))),
            "error_kinds": dict(sorted(self.error_kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
            "error_rates": {k: round(v / self.rows, 6) for k, v in sorted(self.error_kinds.items())},
            **({"models": {n: m.to_dict() for n, m in self.models.items()}} if self.models else {}),
        }


def quality_footer(rows: Any) -> dict[bytes, bytes]:
    """The footer entry the writer adds to a shard: its quality counters (``QualityStats.to_state``)."""
    import json


    return {QUALITY_KEY: json.dumps(QualityStats().add_table(rows).to_state(), separators=(",", ":")).encode()}


def quality_of_parts(fs: Any, parts: Iterable[str],
                     on_footer: Callable[[str, Mapping[bytes, bytes]], None] | None = None) -> dict[str, Any]:
    """Quality statistics of committed shards, one shard at a time: from the counters the writer kept in each
    shard's footer, or, for a shard written without them, from its five columns.

    Carried rows are included (they are part of the night's answer) and counted apart in
    ``carried`` and ``confidence.carried_counts``. ``on_footer(path, footer)`` sees each footer read, so a caller
    can take more from it (the job's final counts) without a second pass.
    """
    import json

    import pyarrow.parquet as pq


    stats = QualityStats()
    for path, footer in iter_footers(fs, list(parts)):
        if on_footer is not None:
            on_footer(path, footer)
        raw = footer.get(QUALITY_KEY)
        state = json.loads(raw) if raw is not None else None
        if state is not None and state.get("version") == QUALITY_VERSION:
            stats.merge(QualityStats.from_state(state))
            continue
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            present = [c for c in QUALITY_COLUMNS if c in pf.schema_arrow.names]
            stats.add_table(pf.read(columns=present))
    return stats.to_dict()


def committed_quality(fs: Any, root: str,
                      on_footer: Callable[[str, Mapping[bytes, bytes]], None] | None = None) -> dict[str, Any]:
    """:func:`quality_of_parts` of every shard committed in ROOT now.

    Listing caches are dropped first: other processes wrote the shards, and s3fs would list from its cache.
    """

    fs.invalidate_cache()
    return quality_of_parts(fs, committed_parts(fs, root), on_footer)


def output_quality(dest: str, storage_options: Mapping[str, Any] | None = None, *,
                   use_recorded: bool = True, catalog_options: Mapping[str, Any] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(quality, run report)`` of an output folder, or of the snapshot an ``iceberg://`` URL names.

    The quality recorded in a complete output's ``_REPORT.json`` is used when it covers every row
    (``_SUCCESS`` rows); otherwise (older report, incomplete output, an Iceberg snapshot) it is computed from the
    shards.

    Raises:
        OutputError: DEST cannot be read or holds no committed shard.
    """

    try:
        if is_iceberg(dest):
            fs, root, parts = table_parts(dest, catalog_options, storage_options)
            use_recorded = False  # the last run's report need not describe this snapshot
        else:
            fs, root = _open(dest, storage_options)
            fs.invalidate_cache()  # fsspec reuses file system objects, and their listings, within a process
            parts = committed_parts(fs, root)
    except OSError as err:
        raise OutputError(f"cannot read {dest!r}: {err}; check the URL, credentials and AWS_ENDPOINT_URL") from None
    if not parts:
        raise OutputError(f"{dest!r} holds no part-*.parquet shard; give a run's --output folder")
    run = read_json(fs, root, "_REPORT.json")
    success = read_json(fs, root, "_SUCCESS")
    recorded = (run or {}).get("quality")
    if (use_recorded and recorded and success and recorded.get("version") == QUALITY_VERSION
            and recorded.get("rows") == success.get("rows")):
        return recorded, run
    return quality_of_parts(fs, parts), run


def compare_quality(current: Mapping[str, Any], previous: Mapping[str, Any],
                    thresholds: DriftThresholds = DriftThresholds()) -> dict[str, Any]:
    """Compare two ``quality`` records (current night against the previous one).

    Returns:
        ``psi``, ``js_divergence``, ``label_shifts`` (largest moves of share first, with counts),
        ``error_rates`` {kind: {previous, current, change}}, ``confidence_mean`` and ``below_floor_share``
        (previous/current/change), ``breaches`` (what crossed which threshold), ``passed`` and ``thresholds``.
    """
    for name, q in (("current", current), ("previous", previous)):
        if q.get("version") != QUALITY_VERSION:
            raise OutputError(f"the {name} output's quality record has version {q.get('version')!r}, "
                              f"not {QUALITY_VERSION}; rerun `bulk-classify report` on it without a recorded report")
    psi = population_stability_index(previous["confidence"]["counts"], current["confidence"]["counts"])
    p_labels, c_labels = previous.get("labels") or {}, current.get("labels") or {}
    js = js_divergence(p_labels, c_labels)
    p_ok, c_ok = previous.get("ok") or 0, current.get("ok") or 0
    shifts = []
    for label in set(p_labels) | set(c_labels):
        ps = p_labels.get(label, 0) / p_ok if p_ok else 0.0
        cs = c_labels.get(label, 0) / c_ok if c_ok else 0.0
        shifts.append({"label": label, "previous": p_labels.get(label, 0), "current": c_labels.get(label, 0),
                       "previous_share": round(ps, 6), "current_share": round(cs, 6), "change": round(cs - ps, 6)})
    shifts.sort(key=lambda s: (-abs(s["change"]), s["label"]))
    p_rates, c_rates = previous.get("error_rates") or {}, current.get("error_rates") or {}
    p_kinds, c_kinds = previous.get("error_kinds") or {}, current.get("error_kinds") or {}
    rates = {k: {"previous": p_rates.get(k, 0.0), "current": c_rates.get(k, 0.0),
                 "previous_rows": p_kinds.get(k, 0), "current_rows": c_kinds.get(k, 0),
                 "change": round(c_rates.get(k, 0.0) - p_rates.get(k, 0.0), 6)}
             for k in sorted(set(p_rates) | set(c_rates))}

    breaches = []
    if psi > thresholds.psi_max:
        breaches.append({"metric": "psi", "value": psi, "threshold": thresholds.psi_max,
                         "message": f"top-1 confidence histogram moved: PSI {psi:.3f} > {thresholds.psi_max}"})
    if js > thresholds.js_max:
        top = shifts[0] if shifts else None
        detail = f" (most: {top['label']!r} {top['previous_share']:.1%} -> {top['current_share']:.1%})" if top else ""
        breaches.append({"metric": "js_divergence", "value": js, "threshold": thresholds.js_max,
                         "message": f"top-1 label distribution moved: JS {js:.3f} > {thresholds.js_max}{detail}"})
    for kind, r in rates.items():
        if r["change"] > thresholds.error_rate_max_increase:
            breaches.append({"metric": f"error_rate.{kind}", "value": r["change"],
                             "threshold": thresholds.error_rate_max_increase,
                             "message": f"{kind} errors rose from {r['previous']:.1%} to {r['current']:.1%} of rows"})
    models = {}
    for name in sorted(set(current.get("models") or {}) & set(previous.get("models") or {})):
        models[name] = compare_quality(current["models"][name], previous["models"][name], thresholds)
        breaches += [{**b, "metric": f"{name}.{b['metric']}", "message": f"model {name}: {b['message']}"}
                     for b in models[name]["breaches"]]
    too_few = min(current.get("rows") or 0, previous.get("rows") or 0) < thresholds.min_rows
    return {
        **({"models": models} if models else {}),
        "psi": psi,
        "js_divergence": js,
        "label_shifts": shifts[:LABEL_SHIFTS],
        "error_rates": rates,
        "confidence_mean": _change(previous["confidence"].get("mean"), current["confidence"].get("mean")),
        "margin_mean": _change(previous["margin"].get("mean"), current["margin"].get("mean")),
        "below_floor_share": _change(previous["below_floor"].get("share"), current["below_floor"].get("share")),
        "rows": {"previous": previous.get("rows"), "current": current.get("rows")},
        "breaches": breaches,
        "too_few_rows": too_few,
        "passed": not breaches or too_few,
        "thresholds": thresholds.as_dict(),
    }


def compare_outputs(dest: str, against: str, thresholds: DriftThresholds = DriftThresholds(),
                    storage_options: Mapping[str, Any] | None = None,
                    catalog_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Compare output DEST with the earlier output AGAINST (``"previous"``: the one DEST's night recorded); either
    may be an Iceberg snapshot (``iceberg://NS.TABLE``, ``…@parent``, ``…@SNAPSHOT_ID``).

    Returns the :func:`compare_quality` result plus ``current``/``previous`` ({dest, quality, run}) for the
    page; ``against`` is None (and ``passed`` True) when DEST's night had no earlier night to compare with.

    Raises:
        OutputError: an output cannot be read, holds no shard, or ``previous`` is asked and none is recorded.
    """
    quality, run = output_quality(dest, storage_options, catalog_options=catalog_options)
    if against == AGAINST_RECORDED:
        recorded = (run or {}).get("drift")
        if run is None or "drift" not in run:
            raise OutputError(f"{dest!r} has no comparison recorded in its _REPORT.json (not a nightly output?); "
                              f"give --against the earlier output's URL")
        if recorded is None or not recorded.get("against"):
            return {"against": None, "dest": dest, "passed": True, "breaches": [],
                    "message": "no earlier night to compare with", "thresholds": thresholds.as_dict()}
        against = recorded["against"]
    prev_quality, prev_run = output_quality(against, storage_options, catalog_options=catalog_options)
    result = compare_quality(quality, prev_quality, thresholds)
    result.update(dest=dest, against=against,
                  current={"dest": dest, "quality": quality, "run": _run_info(run)},
                  previous={"dest": against, "quality": prev_quality, "run": _run_info(prev_run)})
    return result


def record_drift(dest: str, against: str | None, storage_options: Mapping[str, Any] | None = None,
                 thresholds: DriftThresholds = DriftThresholds()) -> dict[str, Any] | None:
    """Compare finished output DEST with the earlier one AGAINST and record it as ``drift`` in DEST's ``_REPORT.json``.

    The nightly job calls this with the previous date's folder, so the night's report says what it was
    compared with (``report DEST --against previous`` reads that back). ``against=None`` (the first night)
    records ``drift: null``. Returns the record.
    """

    record = None
    if against is not None:
        result = compare_outputs(dest, against, thresholds, storage_options)
        record = {k: v for k, v in result.items() if k not in ("current", "previous", "dest")}
    fs, root = _open(dest, storage_options)
    report = read_json(fs, root, "_REPORT.json") or {}
    report["drift"] = record
    write_json(fs, root, "_REPORT.json", report)
    return record


def population_stability_index(expected: Iterable[float], actual: Iterable[float]) -> float:
    """PSI = Σ (a − e) · ln(a / e) over bins, on shares (each share floored at ``PSI_EPSILON``)."""
    e = _shares(expected)
    a = _shares(actual)
    if e is None or a is None:
        return 0.0
    return round(float(np.sum((a - e) * np.log(a / e))), 6)


def js_divergence(p: Mapping[str, float], q: Mapping[str, float]) -> float:
    """Jensen–Shannon divergence in bits (0: same distribution, 1: disjoint) of two count mappings."""
    keys = sorted(set(p) | set(q))
    pv = np.array([p.get(k, 0) for k in keys], np.float64)
    qv = np.array([q.get(k, 0) for k in keys], np.float64)
    if pv.sum() <= 0 or qv.sum() <= 0:
        return 0.0
    pv, qv = pv / pv.sum(), qv / qv.sum()
    m = (pv + qv) / 2

    def kl(x: np.ndarray) -> float:
        nz = x > 0
        return float(np.sum(x[nz] * np.log2(x[nz] / m[nz])))

    return round(max(0.0, (kl(pv) + kl(qv)) / 2), 6)


def format_comparison(result: Mapping[str, Any]) -> str:
    """The table ``bulk-classify report DEST --against PREV`` prints."""
    if result.get("against") is None:
        return f"{result.get('dest')}: {result.get('message', 'nothing to compare with')}; gate passes"
    t = result["thresholds"]
    rows = result["rows"]
    lines = [
        f"{result['dest']}  against  {result['against']}",
        f"{'rows':<26}{rows['previous']:>10,} -> {rows['current']:,}",
        f"{'confidence PSI':<26}{result['psi']:>10.4f}  (max {t['psi_max']})",
        f"{'label JS divergence':<26}{result['js_divergence']:>10.4f}  (max {t['js_max']})",
    ]
    for name, key in (("mean top-1 confidence", "confidence_mean"), ("mean top1-top2 margin", "margin_mean"),
                      (f"share below {CONFIDENCE_FLOOR}", "below_floor_share")):
        c = result.get(key) or {}
        if c.get("previous") is not None and c.get("current") is not None:
            lines.append(f"{name:<26}{c['previous']:>10.3f} -> {c['current']:.3f}")
    if result.get("label_shifts"):
        lines.append(f"{'label':<30}{'prev':>7}{'now':>7}{'share':>17}")
        for s in result["label_shifts"]:
            lines.append(f"  {s['label'][:28]:<28}{s['previous']:>7,}{s['current']:>7,}"
                         f"{s['previous_share']:>8.1%} -> {s['current_share']:.1%}")
    for kind, r in (result.get("error_rates") or {}).items():
        lines.append(f"  error {kind:<20}{r['previous']:>8.2%} -> {r['current']:.2%}  "
                     f"({r['previous_rows']:,} -> {r['current_rows']:,} rows)")
    if result.get("too_few_rows"):
        lines.append(f"fewer than {t['min_rows']} rows on one side: reported, not gated")
    if result["breaches"]:
        lines += [f"DRIFT: {b['message']}" for b in result["breaches"]]
    lines.append("gate: " + ("passed" if result["passed"] else f"FAILED (exit status {DRIFT_EXIT_CODE})"))
    return "\n".join(lines)


def _run_info(run: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if run is None:
        return None
    return {k: run.get(k) for k in ("engine", "model", "started_at", "finished_at", "elapsed_s", "images",
                                    "classified", "carried", "images_per_s", "rows_per_s", "stage_seconds")}


def _change(previous: float | None, current: float | None) -> dict[str, Any]:
    change = None if previous is None or current is None else round(current - previous, 6)
    return {"previous": previous, "current": current, "change": change}


def _shares(counts: Iterable[float]) -> np.ndarray | None:
    v = np.asarray(list(counts), np.float64)
    if v.sum() <= 0:
        return None
    return np.maximum(v / v.sum(), PSI_EPSILON)


def _bin(values: np.ndarray) -> np.ndarray:
    # np.histogram's last bin is closed, so a score of exactly 1.0 lands in it.
    return np.histogram(np.clip(values, 0.0, 1.0), bins=CONFIDENCE_EDGES)[0].astype(np.int64)


def _open(url: str, storage_options: Mapping[str, Any] | None):
    return open_fs(url, storage_options)
