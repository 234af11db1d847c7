"""Where the tests find the repository, its test data and the benchmark scripts, whatever tier folder they sit in."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
DATA = TESTS / "data"
PHOTOS = DATA / "photos"
PARITY = DATA / "parity"
BENCHMARKS = TESTS / "benchmarks"
