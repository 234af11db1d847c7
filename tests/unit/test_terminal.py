"""The CLI's stderr filter: Ray's notice lines go, everything else passes unchanged and in order."""

from __future__ import annotations

import subprocess
import sys

from pipeline.terminal import _StderrFilter
from support.paths import REPO

NOTICE = (b"[2026-12-02 06:33:41,502 E 963 963] core_worker.cc:2465: Actor with class name: 'MapWorker(MapBatches("
          b"ClassifyActor))' and ID: '11dbf4' has constructor arguments in the object store and max_restarts > 0. If "
          b"the arguments in the object store go out of scope or are lost, the actor restart will fail.\n")
OTHER_RAY_ERROR = b"[2026-12-02 06:33:41,502 E 963 963] raylet_client.cc:12: the raylet died\n"


def _filter():
    got: list[bytes] = []
    f = _StderrFilter.__new__(_StderrFilter)
    f._write = got.append
    return f, got


def test_the_notice_goes_and_everything_else_passes_in_order():
    f, got = _filter()
    rest = f._forward(b"Error: --top-k must be a positive integer, got 0\n" + NOTICE + OTHER_RAY_ERROR + b"50%|#####")
    assert rest == b""
    assert b"".join(got) == b"Error: --top-k must be a positive integer, got 0\n" + OTHER_RAY_ERROR + b"50%|#####"


def test_a_line_that_may_be_a_notice_waits_for_its_end():
    f, got = _filter()
    half = len(NOTICE) // 2
    rest = f._forward(NOTICE[:half])
    assert got == [] and rest == NOTICE[:half]
    assert f._forward(rest + NOTICE[half:] + b"[done]") == b"[done]"  # short: could still be a Ray line
    assert got == []
    assert f._forward(b"[" + b"x" * 80) == b"" and got == [b"[" + b"x" * 80]  # long enough to tell: it passes


def test_the_cli_prints_no_ray_notice_without_v_and_its_errors_still(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(tmp_path / "missing"), "--output",
                          str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [f"Error: source '{tmp_path / 'missing'}' does not exist; check the "
                                               "path or bucket prefix"]
