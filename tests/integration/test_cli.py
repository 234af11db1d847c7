"""The CLI as a user runs it: a real subprocess, real photos and odd inputs, one-line errors, help everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.dataset as pads
import pytest
from click.testing import CliRunner

from conftest import PHOTOS
from pipeline.cli import main

CLI = [sys.executable, "-m", "pipeline.cli"]


def bulk(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("command", [[], ["run"], ["nightly"], ["engines"], ["repo"], ["repo", "build"], ["repo", "check"],
                                     ["repo", "prepare"], ["report"], ["size"], ["model"], ["model", "quantize"],
                                     ["model", "check"], ["model", "import"]])
def test_every_command_has_help(command):
    result = CliRunner().invoke(main, command + ["--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and len(result.output.splitlines()) > 3


def test_run_real_photos_and_odd_inputs_one_row_each(tmp_path):
    from support.oddities import oddities

    src = tmp_path / "in"
    src.mkdir()
    for p in PHOTOS.glob("*.jpg"):
        (src / p.name).write_bytes(p.read_bytes())
    odd = oddities()
    for name, (data, _status, _kind) in odd.items():
        (src / f"odd_{name}.img.png").write_bytes(data)  # the extension says png; the bytes decide
    out = tmp_path / "out"

    result = bulk("run", str(src), "--output", str(out), "--batch-size", "16")

    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(odd) + 10} rows in {out}" in result.stdout
    # only our lines on the terminal: Ray's actor notice and Ray Data's warnings are for -v
    assert "core_worker.cc" not in result.stderr and "UserWarning" not in result.stderr, result.stderr[-3000:]
    rows = {r["uri"].rsplit("/", 1)[-1]: r for r in pads.dataset(str(out), format="parquet").to_table().to_pylist()}
    assert len(rows) == len(odd) + 10
    for name, (_data, status, kind) in odd.items():
        row = rows[f"odd_{name}.img.png"]
        assert row["status"] == status, (name, row["error"])
        assert (row["error"] or "").startswith(kind or ""), (name, row["error"])
    top5 = {name: " ".join(rows[name]["labels"]).lower() for name in ("chelsea.jpg", "coffee.jpg", "rocket.jpg")}
    assert "cat" in top5["chelsea.jpg"]
    assert "espresso" in top5["coffee.jpg"] or "cup" in top5["coffee.jpg"]
    assert "space shuttle" in top5["rocket.jpg"] or "missile" in top5["rocket.jpg"]
    success = json.loads((out / "_SUCCESS").read_text())
    assert success["counts"]["error"] == sum(1 for _d, s, _k in odd.values() if s == "error")

    again = bulk("run", str(src), "--output", str(out), "--quiet")
    assert again.returncode == 0 and again.stdout == ""
    assert json.loads((out / "_SUCCESS").read_text())["this_run"]["already_done"] == len(odd) + 10


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "{missing}", "--output", "{out}"], "does not exist; check the path or bucket prefix"),
        (["run", "{photos}", "--output", "{out}", "--model", "{missing}"], "model folder"),
        (["run", "{photos}", "--output", "{out}", "--top-k", "0"], "--top-k must be a positive integer"),
        (["run", "{photos}", "--output", "{out}", "--storage-option", "novalue"], "is not KEY=VALUE"),
        (["run", "{photos}", "--output", "{out}", "--engine", "tpu"], "Invalid value for '--engine'"),
        (["run", "{photos}", "--output", "{photos}"], "--output must differ from SOURCE"),
        (["run", "nosuchscheme://x/y", "--output", "{out}"], "install the fsspec package for that scheme"),
    ],
)
def test_bad_arguments_fail_at_once_with_one_line(tmp_path, args, message):
    values = {"missing": str(tmp_path / "missing"), "out": str(tmp_path / "out"), "photos": str(PHOTOS)}
    result = CliRunner().invoke(main, [a.format(**values) for a in args])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def test_unreachable_storage_fails_before_work(tmp_path):
    result = bulk("run", "s3://bucket/prefix", "--output", str(tmp_path / "out"), "--storage-option",
                  'config_kwargs={"connect_timeout": 1, "retries": {"max_attempts": 1}}',
                  env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
                       "AWS_SECRET_ACCESS_KEY": "y"}, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("Error: cannot read 's3://bucket/prefix'")
    assert "AWS_ENDPOINT_URL" in result.stderr


def test_environment_sets_defaults_and_options_win(monkeypatch):
    from pipeline.config import RunConfig

    env = {"BULK_CLASSIFY_TOP_K": "3", "BULK_CLASSIFY_ENGINE": "onnx", "BULK_CLASSIFY_BATCH_SIZE": "8"}
    config = RunConfig.build({"source": "a", "output": "b", "batch_size": 16}, env=env)
    assert (config.top_k, config.batch_size) == (3, 16)
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="BULK_CLASSIFY_TOP_K='x' is not an integer"):
        RunConfig.build({"source": "a", "output": "b"}, env={"BULK_CLASSIFY_TOP_K": "x"})


def test_repo_build_and_check_through_the_cli(tmp_path):
    runner = CliRunner()
    built = runner.invoke(main, ["repo", "build", "--profile", "portable", "--output", str(tmp_path / "r"),
                                 "--top-k", "3", "--instances", "2"])
    assert built.exit_code == 0, built.output
    assert built.output.startswith("built portable repository in ") and "shape" not in built.output  # one shape
    config = (tmp_path / "r" / "classifier" / "config.pbtxt").read_text()
    assert "count: 2" in config and "3" in config
    checked = runner.invoke(main, ["repo", "check", str(tmp_path / "r")])
    assert checked.exit_code == 0 and "ok: 1 models checked (classifier)" in checked.output
    bad = runner.invoke(main, ["repo", "build", "--output", str(tmp_path / "x"), "--top-k", "0"])
    assert bad.exit_code == 1 and "must be positive" in bad.output


def test_repo_build_sets_the_gpu_profiles_backlog(tmp_path):
    runner = CliRunner()
    built = runner.invoke(main, ["repo", "build", "--profile", "gpu", "--output", str(tmp_path / "g"),
                                 "--instances", "6", "--max-backlog", "4"])
    assert built.exit_code == 0, built.output
    config = (tmp_path / "g" / "classifier" / "config.pbtxt").read_text()
    assert "count: 6" in config and 'key: "max_backlog"\n  value {\n    string_value: "4"' in config
    for args, message in ((["--profile", "portable"], "max_backlog is the gpu profile's; use --profile gpu"),
                          (["--profile", "gpu", "--max-backlog", "-1"], "max_backlog=-1.0 must be 0")):
        bad = runner.invoke(main, ["repo", "build", "--output", str(tmp_path / "x"), "--max-backlog", "2", *args])
        assert bad.exit_code == 1 and message in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1
