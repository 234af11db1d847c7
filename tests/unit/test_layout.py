"""The package's shape: every module on a floor, imports only downward, no cycle between rooms, short chains of
rooms, modules that say what they own."""

from __future__ import annotations

import ast
import shutil

from support import import_graph

# Modules allowed over import_graph.MAX_LINES, and why.
LONG_MODULES = {
    # GpuClassifier's pipelined hot path: triage, DALI preparation in threads, the CUDA-graph network, the stream loop.
    "pipeline.gpu.classifier",
    # The quality counters, their merge over shards and the drift comparison: one concern (#13), one module.
    "pipeline.quality",
    # The Triton client's request path: isolating bad inputs, restarts, shared-server failover and the answer checks
    # retry the same request, so they share its loop (the server's supervision and the checks are modules of their own).
    "pipeline.triton.client",
    # Planning and listing local folders, S3 key ranges and other fsspec stores, with the rows of what cannot be read.
    "pipeline.io.source",
    # One class owns the Triton process (STYLE.md 6): locating the binary, spawning, readiness, health, restart, stop.
    "pipeline.triton.server",
}

def test_every_module_has_a_floor_and_imports_run_down():
    assert import_graph.problems(import_graph.graph()) == []


def test_the_floors_hold_the_job_over_the_engines_over_triton_over_the_data():
    floor = import_graph.floor
    assert floor("pipeline.cli") > floor("pipeline.job.run") > floor("pipeline.engines.triton")
    assert floor("pipeline.engines.triton") > floor("pipeline.triton.server") > floor("pipeline.gpu.classifier")
    assert floor("pipeline.triton.serve.gpu_model") == floor("pipeline.triton.server")  # serve/ is in triton/'s room
    assert floor("pipeline.engines.base") > floor("pipeline.io.writer") > floor("pipeline.schema")
    assert floor("model_repository.gpu.classifier.1.model") == max(import_graph.FLOORS.values())


def test_a_sub_package_counts_in_its_parent_room():
    assert import_graph.room("pipeline.triton.serve.gpu_model") == "pipeline.triton"
    assert import_graph.room("pipeline.triton.serve") == "pipeline.triton"
    assert import_graph.room("pipeline.gpu.classifier") == "pipeline.gpu"
    assert import_graph.room("pipeline.cli") == "pipeline.cli"
    assert "pipeline.triton.serve" not in import_graph.rooms(import_graph.graph())


def test_the_room_graph_has_no_cycle_and_a_short_longest_chain():
    rooms = import_graph.rooms(import_graph.graph())
    assert import_graph.cycles(rooms) == []
    assert len(import_graph.longest_chain(rooms)) <= import_graph.MAX_CHAIN


def test_the_checker_sees_lazy_imports_string_refs_and_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(edges) == [["a", "b", "c"]]
    graph = import_graph.graph()
    assert "pipeline.model.folder" in graph["pipeline.actor"]  # imported inside __init__
    assert "pipeline.engines.onnx" in graph["pipeline.engines.registry"]  # by name, with importlib
    assert "pipeline.job" in graph["pipeline.cli.run"]  # from a package's __init__
    assert "pipeline.triton.serve.gpu_model" in graph["model_repository.gpu.classifier.1.model"]  # a shim


def test_the_check_fails_on_a_planted_upward_import():
    edges = import_graph.graph()
    edges["pipeline.io.writer"] = edges["pipeline.io.writer"] | {"pipeline.engines.base"}
    found = import_graph.problems(edges)
    assert found[0] == "upward import: pipeline.io.writer (floor 3) imports pipeline.engines.base (floor 6)"
    assert all(not p.startswith("upward import: ") for p in found[1:])  # and a chain of 10 rooms through io/
    edges["pipeline.engines.base"] = edges["pipeline.engines.base"] | {"pipeline.job.run"}
    cycles = [p for p in import_graph.problems(edges) if p.startswith("room cycle: ")]
    assert len(cycles) == 1 and {"pipeline.engines", "pipeline.job"} <= set(cycles[0][12:].split(" <-> "))


def test_the_check_fails_on_gpu_importing_triton_and_on_serve_importing_an_engine():
    edges = import_graph.graph()
    edges["pipeline.gpu.dali"] = edges["pipeline.gpu.dali"] | {"pipeline.triton.contract"}
    found = import_graph.problems(edges)
    assert "upward import: pipeline.gpu.dali (floor 4) imports pipeline.triton.contract (floor 5)" in found
    assert "room cycle: pipeline.gpu <-> pipeline.triton" in found  # triton/ (serve/ too) imports gpu/
    edges = import_graph.graph()
    edges["pipeline.triton.serve.gpu_model"] = edges["pipeline.triton.serve.gpu_model"] | {"pipeline.engines.gpu"}
    found = import_graph.problems(edges)
    assert "upward import: pipeline.triton.serve.gpu_model (floor 5) imports pipeline.engines.gpu (floor 6)" in found
    assert "room cycle: pipeline.engines <-> pipeline.triton" in found


def test_the_check_fails_on_an_upward_import_planted_in_a_copy_of_the_tree(tmp_path):
    package = tmp_path / "pipeline"
    shutil.copytree(import_graph.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    schema = package / "schema.py"
    schema.write_text(schema.read_text() + "\n\ndef _late():\n    from pipeline.job.run import run_job  # noqa\n")
    found = import_graph.problems(import_graph.graph(package))
    assert "upward import: pipeline.schema (floor 1) imports pipeline.job.run (floor 9)" in found


def test_a_module_in_a_room_without_a_floor_fails_the_check(tmp_path):
    package = tmp_path / "pipeline"
    shutil.copytree(import_graph.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "newroom.py").write_text('"""A module nobody placed."""\n\nfrom pipeline.schema import STATUS_OK\n')
    assert "no floor: pipeline.newroom (its room pipeline.newroom is not in FLOORS)" in \
        import_graph.problems(import_graph.graph(package))


def test_every_module_opens_with_a_docstring():
    missing = [p.name for p in import_graph.PACKAGE.rglob("*.py") if not ast.get_docstring(ast.parse(p.read_text()))
               and p.name != "__init__.py"]
    assert missing == []
