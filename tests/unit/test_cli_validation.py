"""pipeline/cli/: every bad option is refused in the driver, at once, in one line, before anything is written.

The four cases issue #15 names run as real `bulk-classify` processes (import time counts): each must exit
non-zero in under 3 s with one ``Error:`` line naming the fix, and leave DEST as it was, whether DEST did not
exist or held files. The other bad inputs run in-process through click's runner, with the same checks but time.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.node import importable
from support.paths import PHOTOS

CLI = [sys.executable, "-m", "pipeline.cli"]
# A refusal comes before Ray, the model or the source are touched: a few CPU-seconds of interpreter start and
# imports. CPU time, not wall time, is the bound (a loaded machine stretches the wall); the wall has a looser one.
LIMIT_CPU_S = 3.0
LIMIT_WALL_S = 10.0

def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


MUST_SHOW = [
    (["--engine", "onnx", "--engine-option", "bogus=1"], "engine 'onnx' has no option bogus; its options are decode_threads"),
    (["--engine-option", "max_batch=8"], "--engine-option needs an engine: add --engine onnx or --engine triton"),
    (["--engine", "gpu"], "--engine gpu needs PyTorch with CUDA"),
    (["--engine", "triton", "--engine-option", "repository=/nonexistent"],
     "--engine-option repository=/nonexistent does not exist; build one with 'bulk-classify repo build"),
    (["--engine", "onnx", "--engine-option", "max_batch=0"],
     "--engine-option max_batch=0 (engine 'onnx') must be at least 1"),
]
OTHERS = [
    (["--engine-option", "notakeyvalue"], "--engine-option 'notakeyvalue' is not KEY=VALUE; write e.g. "
                                          "--engine-option max_batch=8"),
    (["--engine", "triton", "--engine-option", "request_batch=-5"], "request_batch=-5 (engine 'triton') must be at"),
    (["--engine", "gpu", "--engine-option", "decoder=dali"], "engine 'gpu' has no option decoder; its options are network"),
    (["--engine", "gpu", "--engine-option", "cuda_sync=turbo"], "cuda_sync='turbo' (engine 'gpu') is not one of auto"),
    (["--engine", "triton", "--engine-option", "concurrency=two"], "concurrency='two' (engine 'triton') is not an "
                                                                   "integer"),
    (["--engine", "triton", "--engine-option", "half=true"], "--engine-option half is the gpu profile's, and this "
                                                             "run serves the portable profile"),
    (["--top-k", "0"], "--top-k must be a positive integer, got 0"),
    (["--num-gpus-per-actor", "-1"], "--num-gpus-per-actor must be 0 or more"),
    (["--decode-threads", "0"], "--decode-threads must be at least 1"),
    (["--metrics-port", "99999"], "--metrics-port 99999 is not a TCP port"),
    (["--extensions", ","], "is not a list like jpg,png,webp"),
    (["--engine", "tpu"], "Invalid value for '--engine'"),
]


def _snapshot(folder: Path) -> dict[str, bytes] | None:
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in folder.rglob("*")}


def _dest(tmp_path: Path, exists: bool) -> Path:
    dest = tmp_path / "dest"
    if exists:
        dest.mkdir()
        (dest / "_SUCCESS").write_text("{}")
        (dest / "keep.txt").write_text("not ours")
    return dest


def _one_error_line(stderr: str, message: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and message in errors[0], stderr
    # Only click's usage lines may surround it: no traceback, no Ray output.
    others = [line for line in stderr.splitlines() if line and not line.startswith("Error")]
    assert all(line.startswith(("Usage:", "Try ")) for line in others), stderr


# Where torch is installed the gpu engine's torch requirement is met and this machine's lack of a GPU is what it
# refuses; the torch refusal is checked in process, with torch hidden
# (test_the_gpu_engine_without_torch_is_refused_in_one_line).
REAL_PROCESS = [c for c in MUST_SHOW if not (c[0][:2] == ["--engine", "gpu"] and _has_torch())]
if _has_torch() and importable("nvidia.dali"):
    REAL_PROCESS.append((["--engine", "gpu"], "--engine gpu runs on a GPU and this machine has none that it can "
                                              "use; use --engine onnx, or --engine-option device=cpu"))


@pytest.mark.parametrize("dest_exists", [False, True], ids=["no-dest", "dest-with-files"])
@pytest.mark.parametrize("args, message", REAL_PROCESS, ids=[" ".join(a) for a, _ in REAL_PROCESS])
def test_bad_option_fails_fast_in_one_line_and_writes_nothing(tmp_path, args, message, dest_exists):
    dest = _dest(tmp_path, dest_exists)
    before = _snapshot(dest)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("BULK_CLASSIFY_")}
    start, cpu = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run([*CLI, "run", str(PHOTOS), "--output", str(dest), *args], capture_output=True, text=True,
                          env=env, timeout=60)
    elapsed, cpu = time.perf_counter() - start, _children_cpu_s() - cpu
    assert proc.returncode != 0
    _one_error_line(proc.stderr, message)
    assert _snapshot(dest) == before
    assert cpu < LIMIT_CPU_S and elapsed < LIMIT_WALL_S, f"{cpu:.1f} CPU-s, {elapsed:.1f} s"


def _children_cpu_s() -> float:
    """CPU seconds of every finished child process (and their waited-for children) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_the_gpu_engine_without_torch_is_refused_in_one_line(tmp_path, monkeypatch):
    import importlib.util

    from pipeline.engines import gpu as gpu_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(gpu_engine.importlib.util, "find_spec", lambda name, *a: None if name == "torch" else
                        real(name, *a))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    dest = _dest(tmp_path, True)
    before = _snapshot(dest)
    result = CliRunner().invoke(main, ["run", str(PHOTOS), "--output", str(dest), "--engine", "gpu"])
    assert result.exit_code != 0
    _one_error_line(result.stderr, "--engine gpu needs PyTorch with CUDA")
    assert _snapshot(dest) == before


@pytest.mark.parametrize("args, message", OTHERS, ids=[" ".join(a) for a, _ in OTHERS])
def test_other_bad_inputs_fail_in_one_line_and_write_nothing(tmp_path, monkeypatch, args, message):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    dest = _dest(tmp_path, True)
    before = _snapshot(dest)
    result = CliRunner().invoke(main, ["run", str(PHOTOS), "--output", str(dest), *args])
    assert result.exit_code != 0
    _one_error_line(result.stderr, message)
    assert _snapshot(dest) == before


@pytest.mark.parametrize("args, message", [
    (["--engine", "onnx", "--engine-option", "bogus=1"], "engine 'onnx' has no option bogus"),
    (["--date", "2026-02-30"], "--date '2026-02-30' is not a calendar date"),
    (["--engine", "triton", "--engine-option", "repository=/nonexistent"], "repository=/nonexistent does not exist"),
])
def test_nightly_checks_options_before_reading_storage(tmp_path, monkeypatch, args, message):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    root = tmp_path / "root"
    result = CliRunner().invoke(main, ["nightly", "--source", str(PHOTOS), "--output-root", str(root),
                                                       *args])
    assert result.exit_code == 2
    _one_error_line(result.stderr, message)
    assert not root.exists()


def test_help_shows_the_defaults_of_the_modules_that_own_them():
    from pipeline.cli.report import report
    from pipeline.cli.run import nightly, run
    from pipeline.config import RunConfig
    from pipeline.quality.statistics import DriftThresholds

    options = {p.name: p for p in run.params}
    for name in ("top_k", "shard_size", "fetch_threads", "retries", "list_tasks"):
        assert options[name].show_default == str(RunConfig.__dataclass_fields__[name].default), name
    drift = DriftThresholds()
    for p in report.params:
        if p.name in ("psi_max", "js_max", "error_rate_max_increase", "min_rows"):
            assert p.show_default == str(getattr(drift, p.name)), p.name
    for command in (run, nightly, report):
        for p in command.params:
            assert "(default" not in (getattr(p, "help", None) or ""), (command.name, p.name)
    shown = CliRunner().invoke(main, ["run", "--help"], terminal_width=400).output
    assert "Labels kept per image.  [default: 5]" in shown


def test_one_table_maps_the_librarys_exceptions_to_exit_statuses():
    """EXIT_STATUSES: the first row whose command and class match; no row, a crash (the exception itself)."""
    from pipeline.cli.output import EXIT_STATUSES, failure
    from pipeline.errors import ConfigError, EmptySourceError, OutputError
    from pipeline.model_import.core import ParityFailed

    empty = failure("run", EmptySourceError("nothing to classify"))
    assert (empty.exit_code, empty.prefix, empty.message) == (4, "warning: ", "nothing to classify")
    assert failure("nightly", EmptySourceError("x")).exit_code == 2 and failure("nightly", OutputError("x")).exit_code == 2
    assert failure("model import", ParityFailed("x")).exit_code == 3
    assert failure("model check", ParityFailed("x")).exit_code == 1  # a ModelError like any other elsewhere
    assert (failure("run", ConfigError("bad")).exit_code, failure("run", ConfigError("bad")).prefix) == (1, "Error: ")
    assert failure("repo prepare", ValueError("no plan")).message == "ValueError: no plan"
    assert failure("repo prepare", ConfigError("x")).message == "ConfigError: x"
    assert failure("run", ValueError("a bug")) is None  # not the library's: a traceback
    assert failure("x", ConfigError("\x1b[31mred")).format_message() == "\\x1b[31mred"
    assert all(status in (1, 2, 3, 4) for _cmd, _kind, status in EXIT_STATUSES)


def test_the_command_line_catches_no_library_error_itself():
    """Every library error leaves through the table: no command catches BulkClassifyError, calls sys.exit or
    runs the engine's preflight itself."""
    import pipeline.cli as cli

    source = "\n".join(p.read_text() for p in Path(cli.__file__).parent.glob("*.py"))
    assert "except BulkClassifyError" not in source.replace("except BulkClassifyError as err:\n        raise click.", "")
    assert "sys.exit(" not in source and "check_requirements" not in source and ".resolved(" not in source


def test_listing_the_commands_imports_none_of_the_library():
    """`bulk-classify --help` imports the command modules, not the rooms they call (pyarrow, numpy, the engines):
    each command declares its options, and imports its library, only when it parses or shows its own help."""
    code = ("import sys\nfrom pipeline.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pipeline', 'pyarrow', 'numpy', 'ray')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    import ast

    loaded = {m for m in ast.literal_eval(done.stdout.splitlines()[-1]) if not m.startswith("pipeline.cli")}
    assert loaded == {"pipeline", "pipeline.errors", "pipeline.terminal"}
