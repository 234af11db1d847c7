"""The package's shape: no import cycle in pipeline/, imports only downward, modules that say what they own."""

from __future__ import annotations

import ast

from support import import_graph

# Modules allowed over import_graph.MAX_LINES, and why.
LONG_MODULES = {
    # GpuClassifier's pipelined hot path: triage, DALI preparation in threads, the CUDA-graph network, the stream loop.
    "pipeline.engines.gpu.classifier",
    # The quality counters, their merge over shards and the drift comparison: one concern (#13), one module.
    "pipeline.quality",
    # The Triton client's request path: isolating bad inputs, restarts, shared-server failover and the answer checks
    # retry the same request, so they share its loop (the server's supervision and the checks are modules of their own).
    "pipeline.engines.triton",
    # Planning and listing local folders, S3 key ranges and other fsspec stores, with the rows of what cannot be read.
    "pipeline.source",
    # One class owns the Triton process (STYLE.md 6): locating the binary, spawning, readiness, health, restart, stop.
    "pipeline.triton.server",
    # The one command line (STYLE.md 2, 17): every command's options, its progress and its one-line errors.
    "pipeline.cli",
}


def test_no_import_cycle_inside_pipeline():
    assert import_graph.cycles(import_graph.graph()) == []


def test_imports_run_one_way_cli_job_engines_triton_model():
    assert import_graph.upward(import_graph.graph()) == []
    assert import_graph.floor("pipeline.engines.triton") > import_graph.floor("pipeline.triton.server")


def test_the_checker_sees_lazy_imports_and_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(edges) == [["a", "b", "c"]]
    assert "pipeline.model" in import_graph.graph()["pipeline.actor"]  # imported inside __init__
    assert "pipeline.engines.onnx" in import_graph.graph()["pipeline.engines.registry"]  # by name, with importlib


def test_every_module_opens_with_a_docstring():
    missing = [p.name for p in import_graph.PACKAGE.rglob("*.py") if not ast.get_docstring(ast.parse(p.read_text()))
               and p.name != "__init__.py"]
    assert missing == []


def test_modules_stay_short_unless_listed_with_a_reason():
    long = {name for name, lines in import_graph.sizes().items() if lines > import_graph.MAX_LINES * 1.1}
    assert long <= LONG_MODULES, long - LONG_MODULES
