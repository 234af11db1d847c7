"""The drift gate on real classifications: 200 real JPEGs through the job (embedded ONNX engine), then second nights.

One baseline night is classified once for the module; each second night is one more real run. The gate is
checked through the command line's exit status, as a scheduler would see it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from support.alterations import ALTERATIONS
from conftest import PHOTOS, REPO
from pipeline.cli import main
from pipeline.config import RunConfig
from pipeline.job import run_job
from pipeline.quality.statistics import DRIFT_EXIT_CODE, quality_of_parts
from pipeline.io.reader import committed_parts

pytestmark = pytest.mark.slow

INPUTS = REPO / "tests" / "data" / "parity" / "inputs"
NEW_PHOTOS = ("chelsea", "coffee")  # 2 new ordinary photos on 200: 1 %
SCREENSHOT_ENV = "BULK_CLASSIFY_SCREENSHOT"  # a path: the page test saves its screenshot there


@pytest.fixture(scope="module")
def originals() -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(INPUTS.glob("*.jpg"))}
    assert len(files) == 200
    return files


@pytest.fixture(scope="module")
def night(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("nights")
    done: dict[str, Path] = {}

    def run(name: str, files: dict[str, bytes], previous: Path | None = None, source: str | None = None) -> Path:
        """Classify ``files`` in source folder ``source`` (default: the night's own) into output ``name``."""
        if name in done:  # one real run per night for the whole module
            return done[name]
        src = root / "src" / (source or name)
        src.mkdir(parents=True, exist_ok=True)
        for fname, data in files.items():
            (src / fname).write_bytes(data)
        out = root / "out" / name
        run_job(RunConfig(source=str(src), output=str(out), batch_size=32, shard_size=64,
                          previous=None if previous is None else str(previous)))
        done[name] = out
        return out

    return run


@pytest.fixture(scope="module")
def baseline(night, originals) -> Path:
    return night("base", originals)


def gate(dest: Path, against: Path, *extra: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["report", str(dest), "--against", str(against), "--json", *extra])
    assert result.exit_code in (0, DRIFT_EXIT_CODE), result.output
    return result.exit_code, json.loads(result.output)


def test_every_run_records_quality_of_its_committed_rows(baseline):
    import fsspec

    report = json.loads((baseline / "_REPORT.json").read_text())
    q = report["quality"]
    assert q["rows"] == 200 and q["ok"] == 200 and q["errors"] == 0 and q["carried"] == 0
    assert sum(q["confidence"]["counts"]) == 200 and sum(q["labels"].values()) == 200
    fs = fsspec.filesystem("file")
    parts = committed_parts(fs, str(baseline))
    assert len(parts) >= 3  # computed shard by shard, and equal to reading them again
    assert quality_of_parts(fs, parts) == q


def test_two_runs_over_the_same_photos_give_zero_drift(night, originals, baseline):
    again = night("again", originals)  # classified again from scratch, not carried
    code, r = gate(again, baseline)
    assert code == 0 and r["passed"] and r["breaches"] == []
    assert r["psi"] == 0 and r["js_divergence"] == 0
    assert all(s["change"] == 0 for s in r["label_shifts"])
    assert r["current"]["quality"]["carried"] == 0


@pytest.mark.parametrize("alteration, metrics", [
    ("rotate90", {"psi", "js_divergence"}),
    ("bgr", {"js_divergence"}),
    ("recompress", {"psi", "js_divergence"}),
])
def test_an_altered_night_crosses_the_thresholds(night, originals, baseline, alteration, metrics):
    altered = night(alteration, {n: ALTERATIONS[alteration](d) for n, d in originals.items()})
    code, r = gate(altered, baseline)
    print(f"{alteration}: PSI {r['psi']:.3f}  JS {r['js_divergence']:.3f}  "
          f"mean top-1 {r['confidence_mean']['previous']:.3f} -> {r['confidence_mean']['current']:.3f}")
    assert code == DRIFT_EXIT_CODE and not r["passed"]
    assert metrics <= {b["metric"] for b in r["breaches"]}
    assert r["label_shifts"][0]["change"] != 0


def test_one_percent_new_ordinary_photos_pass(night, originals, baseline):
    extra = {f"new_{name}.jpg": (PHOTOS / f"{name}.jpg").read_bytes() for name in NEW_PHOTOS}
    # the baseline's folder the next night: the same 200 objects, untouched, plus 2 new ones
    grown = night("grown", extra, previous=baseline, source="base")
    code, r = gate(grown, baseline)
    print(f"1% new: PSI {r['psi']:.4f}  JS {r['js_divergence']:.4f}")
    assert code == 0 and r["passed"], r["breaches"]
    q = r["current"]["quality"]
    assert q["rows"] == 202 and q["carried"] == 200  # the unchanged 200 were carried, and are counted
    assert 0 < r["js_divergence"] and 0 <= r["psi"]


def test_the_page_of_a_real_comparison_renders_in_chromium(night, originals, baseline, tmp_path, monkeypatch):
    from support.headless_chromium import ensure_browser, visit

    if ensure_browser() is None:
        pytest.skip("no Chromium, and no root apt-get to install it: apt-get install -y chromium")
    rotated = night("rotate90", {n: ALTERATIONS["rotate90"](d) for n, d in originals.items()})
    page = tmp_path / "drift.html"
    monkeypatch.chdir(rotated.parent)  # relative names on the page (and in the README's screenshot)
    result = CliRunner().invoke(main, ["report", rotated.name, "--against", baseline.name, "--html", str(page)])
    assert result.exit_code == DRIFT_EXIT_CODE, result.output
    seen = visit(page)
    assert seen.console_errors == []
    assert seen.requests == [page.resolve().as_uri()]  # self-contained: nothing else fetched
    charts = {c["name"]: c for c in seen.charts}
    assert set(charts) == {"confidence", "margin", "label-shifts", "errors", "run"}
    for name in ("confidence", "margin", "label-shifts", "run"):
        assert charts[name]["bars"] > 0 and charts[name]["width"] > 100 and charts[name]["height"] > 20, charts[name]
    assert seen.title == "Quality gate: DRIFT"
    assert seen.screenshot.startswith(b"\x89PNG") and len(seen.screenshot) > 10_000
    if os.environ.get(SCREENSHOT_ENV):  # how docs/quality-gate.png is made
        monkeypatch.undo()
        Path(os.environ[SCREENSHOT_ENV]).write_bytes(seen.screenshot)
