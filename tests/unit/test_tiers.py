"""The test tree by tier: every test file sits in a tier folder, and every tier's marker is registered."""

from __future__ import annotations

import tomllib

from conftest import TIERS
from support.paths import REPO, TESTS


def test_every_test_file_sits_in_a_tier_folder():
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                 if p.relative_to(TESTS).parts[0] not in TIERS]
    assert misplaced == [], "move these into tests/unit, integration, gpu or airflow"


def test_every_tier_and_slow_is_a_registered_marker():
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= {*TIERS, "slow"}


def test_the_folder_gives_the_marker(request):
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("integration") is None
