"""pipeline/nightly.py's text: what `bulk-classify nightly` prints of a scan, without running one."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.nightly import NightlyResult, format_scan


def test_a_scan_prints_what_it_resumed_carried_and_compared_then_its_closing_line():
    summary = SimpleNamespace(carried=3, total=10, counts={"ok": 9, "error": 1},
                              report={"model": "m", "engine": "onnx", "elapsed_s": 1.0, "images": 10})
    drift = {"against": "out/date=2026-11-27", "psi": 0.5, "js_divergence": 0.25, "passed": False,
             "breaches": [{"message": "PSI 0.500 > 0.2"}]}
    result = NightlyResult(status="completed", date="2026-11-28", dest="out/date=2026-11-28",
                           previous="out/date=2026-11-27", resumed_shards=2, summary=summary, drift=drift)
    quiet = format_scan(result, report=False).splitlines()
    assert quiet == [
        "resumed an interrupted scan: 2 shard(s) were already committed",
        "previous: out/date=2026-11-27 (3 unchanged row(s) carried over)",
        "quality against out/date=2026-11-27: PSI 0.500, label JS 0.250: DRIFT: PSI 0.500 > 0.2",
        "nightly scan date=2026-11-28 complete: 10 rows (error 1  ok 9) -> out/date=2026-11-28",
    ]
    full = format_scan(result).splitlines()
    assert full[:2] == quiet[:2] and full[-2:] == quiet[-2:] and full[2].startswith("model m  engine onnx")


def test_an_already_complete_date_is_one_line():
    result = NightlyResult(status="already_complete", date="2026-11-28", dest="out/date=2026-11-28",
                           success={"rows": 10, "finished_at": "2026-11-28T03:00:00Z"})
    assert format_scan(result) == ("nightly scan date=2026-11-28 already complete at out/date=2026-11-28 (10 rows, "
                                   "finished 2026-11-28T03:00:00Z); nothing to do")
