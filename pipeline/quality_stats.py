"""Quality counters of classified rows (confidence and margin histograms, labels, errors) that merge shard by shard.

The writer stores one ``QualityStats`` state per shard in its Parquet footer; ``pipeline.quality`` sums them over
an output and compares two outputs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

QUALITY_VERSION = 1
# Fixed bins, so two nights' histograms always line up: 20 bins of 0.05 over [0, 1].
CONFIDENCE_EDGES = tuple(round(i * 0.05, 2) for i in range(21))
CONFIDENCE_FLOOR = 0.3  # top-1 below this counts as "unsure"
QUALITY_COLUMNS = ("status", "error", "labels", "scores", "carried")


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
        ok_mask = pc.fill_null(pc.equal(status, "ok"), False)
        carried = (pc.fill_null(table.column("carried"), False) if "carried" in names
                   else pa.array(np.zeros(n, bool)))
        self.carried += int(pc.sum(carried).as_py() or 0)
        if "error" in names:
            errors = pc.drop_null(table.column("error"))
            if len(errors):
                kind = pc.utf8_trim_whitespace(pc.list_element(pc.split_pattern(errors, ":", max_splits=1), 0))
                self.error_kinds.update(_value_counts(kind))
        if "scores" not in names:
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
            self.labels.update(_value_counts(pc.list_element(labels, 0)))
        return self

    def merge(self, other: "QualityStats") -> "QualityStats":
        for name in ("rows", "ok", "carried", "confidence_sum", "margin_sum", "margin_rows", "below_floor"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.confidence += other.confidence
        self.carried_confidence += other.carried_confidence
        self.margin += other.margin
        self.labels.update(other.labels)
        self.error_kinds.update(other.error_kinds)
        return self

    def to_state(self) -> dict[str, Any]:
        """The raw counters, JSON-safe and lossless (what a shard's footer keeps, so outputs merge footers)."""
        return {"version": QUALITY_VERSION, **{name: getattr(self, name) for name in (
            "rows", "ok", "carried", "confidence_sum", "margin_sum", "margin_rows", "below_floor")},
            **{name: getattr(self, name).tolist() for name in ("confidence", "carried_confidence", "margin")},
            "labels": dict(self.labels), "error_kinds": dict(self.error_kinds)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "QualityStats":
        stats = cls(**{k: v for k, v in state.items() if k not in (
            "version", "confidence", "carried_confidence", "margin", "labels", "error_kinds")})
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
        }


def _bin(values: np.ndarray) -> np.ndarray:
    # np.histogram's last bin is closed, so a score of exactly 1.0 lands in it.
    return np.histogram(np.clip(values, 0.0, 1.0), bins=CONFIDENCE_EDGES)[0].astype(np.int64)


def _value_counts(array: Any) -> dict[str, int]:
    import pyarrow.compute as pc

    out: dict[str, int] = {}
    for item in pc.value_counts(array).to_pylist():
        if item["values"] is not None:
            out[str(item["values"])] = int(item["counts"])
    return out
