"""The numbers of committed rows: one dataclass from the writer's shard record to the run's totals and metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

import pyarrow as pa

from pipeline.schema import STAGE_DECODE, STAGE_INFER, STATUS_ERROR, STATUS_OK

# The run's stages, in pipeline order: the keys of ``stage_seconds`` in the report, the table and the drift page.
STAGES = ("list", "fetch", STAGE_DECODE, STAGE_INFER, "write")


@dataclass
class ShardStats:
    """What one committed shard (or, summed with ``+=``, a whole run) holds and cost.

    Attributes:
        rows: rows committed; ``ok`` + ``errors`` == ``rows``; ``carried``: rows copied from ``--previous``.
        error_kinds: error rows by kind (the text before ':' in ``error``).
        fetch_s, infer_s, write_s: seconds summed over rows (tasks); ``decode_s`` is None when the engine
            cannot separate decoding from inference.
        engine_calls: engine calls behind the classified rows (fractions per row, summed).
        engine_events: what the engines counted, by event (the triton engine's server starts, restarts and
            failovers, requests, answers checked and mismatched: ``pipeline.triton.client.EVENTS``).
    """

    rows: int = 0
    ok: int = 0
    errors: int = 0
    carried: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    fetch_s: float = 0.0
    decode_s: float | None = None
    infer_s: float = 0.0
    write_s: float = 0.0
    engine_calls: float = 0.0
    engine_events: dict[str, int] = field(default_factory=dict)

    @property
    def classified(self) -> int:
        return self.rows - self.carried

    def __iadd__(self, other: "ShardStats") -> "ShardStats":
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("error_kinds", "engine_events"):
                for kind, n in theirs.items():
                    mine[kind] = mine.get(kind, 0) + n
            elif f.name == "decode_s":
                if theirs is not None:
                    self.decode_s = (mine or 0.0) + theirs
            else:
                setattr(self, f.name, mine + theirs)
        return self

    def to_table(self) -> pa.Table:
        """The one-row Arrow record a write task returns to the driver."""
        row = {f.name: [getattr(self, f.name)] for f in fields(self)}
        row["error_kinds"] = [json.dumps(self.error_kinds, sort_keys=True)]
        row["engine_events"] = [json.dumps(self.engine_events, sort_keys=True)]
        return pa.Table.from_pydict(row, schema=STATS_SCHEMA)

    @classmethod
    def from_table(cls, table: pa.Table) -> Iterator["ShardStats"]:
        """The records of a batch of write-task results."""
        for rec in table.to_pylist():
            rec["error_kinds"] = json.loads(rec["error_kinds"] or "{}")
            rec["engine_events"] = json.loads(rec.get("engine_events") or "{}")
            yield cls(**rec)

    def report_fields(self) -> dict[str, Any]:
        """This run's part of the report input (``pipeline.quality.report.build_run_report``)."""
        return {
            "counts": {STATUS_OK: self.ok, STATUS_ERROR: self.errors},
            "error_kinds": dict(self.error_kinds),
            "images": self.rows,
            "classified": self.classified,
            "carried": self.carried,
            "engine_calls": self.engine_calls,
            "engine_events": dict(self.engine_events),
        }

    def stage_seconds(self, list_s: float) -> dict[str, float | None]:
        return dict(zip(STAGES, (list_s, self.fetch_s, self.decode_s, self.infer_s, self.write_s)))


STATS_SCHEMA = pa.schema([
    ("rows", pa.int64()), ("ok", pa.int64()), ("errors", pa.int64()), ("carried", pa.int64()),
    ("error_kinds", pa.string()),  # JSON {kind: count}
    ("fetch_s", pa.float64()), ("decode_s", pa.float64()), ("infer_s", pa.float64()), ("write_s", pa.float64()),
    ("engine_calls", pa.float64()),
    ("engine_events", pa.string()),  # JSON {event: count}
])


def value_counts(array: Any) -> dict[str, int]:
    """Counts of each non-null value of a pyarrow array, as ``{str(value): count}``."""
    import pyarrow.compute as pc

    out: dict[str, int] = {}
    for item in pc.value_counts(array).to_pylist():
        if item["values"] is not None:
            out[str(item["values"])] = int(item["counts"])
    return out
