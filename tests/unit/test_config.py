"""pipeline/config.py: the one frozen RunConfig, its merge order and its checks; the plan's engine preflight and the
one parse of the engine options (pipeline/job/plan.py)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import DEFAULT_EXTENSIONS, RunConfig, parse_option
from pipeline.errors import ConfigError
from pipeline.job.plan import preflight as plan_preflight
from pipeline.node import ray_address


def config(**kw) -> RunConfig:
    return RunConfig(**{"source": "in/", "output": "out/", **kw})


def preflight(c: RunConfig):
    """The plan's preflight as a run asks it: on this machine unless RAY_ADDRESS names a cluster."""
    return plan_preflight(c, ray_address())


def test_defaults_and_frozen():
    c = config()
    assert c.engine == "auto" and c.batch_size is None and c.top_k == 5 and c.extensions == DEFAULT_EXTENSIONS
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3


def test_defaults_then_environment_then_explicit_options():
    env = {"BULK_CLASSIFY_TOP_K": "3", "BULK_CLASSIFY_BATCH_SIZE": "16", "BULK_CLASSIFY_ENGINE": "triton"}
    c = RunConfig.build({"source": "in/", "output": "out/", "batch_size": 8, "top_k": None}, env=env)
    assert (c.top_k, c.batch_size, c.engine) == (3, 8, "triton")  # None means "not given": the environment's
    with pytest.raises(ConfigError, match=r"BULK_CLASSIFY_TOP_K='x' is not an integer; unset it or fix it"):
        RunConfig.build({"source": "in/", "output": "out/"}, env={"BULK_CLASSIFY_TOP_K": "x"})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['colour'\]"):
        RunConfig.build({"source": "in/", "output": "out/", "colour": "red"}, env={})


@pytest.mark.parametrize("kw, message", [
    ({"source": ""}, "SOURCE is empty"),
    ({"output": "in/"}, "--output must differ from SOURCE"),
    ({"top_k": 0}, "--top-k must be a positive integer, got 0"),
    ({"top_k": 1001}, "--top-k 1001 is larger than any ImageNet head"),
    ({"batch_size": "8"}, "--batch-size must be a positive integer, got '8'"),
    ({"retries": -1}, "--retries must be 0 or more"),
    ({"num_actors": 0}, "--num-actors must be at least 1"),
    ({"num_gpus_per_actor": -0.5}, "--num-gpus-per-actor must be 0 or more"),
    ({"decode_threads": 0}, "--decode-threads must be at least 1"),
    ({"metrics_port": 70000}, "--metrics-port 70000 is not a TCP port"),
    ({"extensions": ("jpg", "a/b")}, "is not a list like jpg,png,webp"),
])
def test_bad_values_name_the_option_and_the_fix(kw, message):
    with pytest.raises(ConfigError, match=message):
        config(**kw)


@pytest.mark.parametrize("kw, message", [
    ({"engine": "tpu"}, "--engine 'tpu' is unknown; choose one of auto, onnx, openvino, triton, gpu"),
    ({"engine": "onnx", "engine_options": {"bogus": 1}}, "engine 'onnx' has no option bogus; its options are decode_threads"),
    ({"engine": "onnx", "engine_options": {"max_batch": 0}}, r"--engine-option max_batch=0 \(engine 'onnx'\) must be at least 1"),
    ({"engine": "triton", "engine_options": {"request_batch": -5}}, "request_batch=-5 .* must be at least 1"),
    ({"engine": "triton", "engine_options": {"startup_timeout_s": 0}}, "startup_timeout_s=0 .* must be more than 0"),
    ({"engine": "gpu", "engine_options": {"decoder": "dali"}}, "^engine 'gpu' has no option decoder; its options are "),
    ({"engine": "gpu", "engine_options": {"cuda_sync": "jpegturbo"}}, "cuda_sync='jpegturbo' .* is not one of auto"),
    ({"engine": "gpu", "engine_options": {"half": "maybe"}}, "half='maybe' .* is not true or false"),
])
def test_the_plan_names_a_bad_engine_or_option_and_the_fix(kw, message, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # the parse only: a cluster's nodes run the preflight
    c = config(**kw)  # plain data: the engine and its options are the plan's to check
    with pytest.raises(ConfigError, match=message):
        preflight(c)


def test_engine_options_are_typed_once_in_the_driver(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    raw = {"request_batch": "16", "server_args": "--log-verbose=1 --a=b"}
    c = config(engine="triton", engine_options=raw)
    assert c.engine_options == raw  # as given: RunConfig is plain data
    assert preflight(c)[1] == {"request_batch": 16, "server_args": ["--log-verbose=1", "--a=b"]}
    assert preflight(config(engine="gpu", engine_options={"half": "false", "cuda_graph": True}))[1] == {
        "half": False, "cuda_graph": True}


def test_parse_option_names_the_flag_it_came_from():
    assert parse_option("anon=true") == ("anon", True)
    assert parse_option("endpoint_url=http://h:9000") == ("endpoint_url", "http://h:9000")
    assert parse_option("n=3", "--engine-option") == ("n", 3)
    with pytest.raises(ConfigError, match="--engine-option 'notakeyvalue' is not KEY=VALUE; write e.g. "
                                          "--engine-option max_batch=8"):
        parse_option("notakeyvalue", "--engine-option", "max_batch=8")
    with pytest.raises(ConfigError, match="--storage-option '=x' is not KEY=VALUE"):
        parse_option("=x")


def test_public_dict_leaves_secrets_out():
    c = config(storage_options={"secret": "s3cr3t", "anon": False})
    public = c.public_dict()
    assert public["storage_options"] == ["anon", "secret"] and "s3cr3t" not in str(public)


def test_check_requirements_runs_the_engines_preflight(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    preflight(config())  # onnx needs nothing beyond the install
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=f"--engine-option repository={missing} does not exist; build one with "
                                          "'bulk-classify repo build"):
        preflight(config(engine="triton", engine_options={"repository": missing}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no classifier/config.pbtxt"):
        preflight(config(engine="triton", engine_options={"repository": str(tmp_path / "empty")}))
    monkeypatch.setenv("BULK_CLASSIFY_TRITONSERVER", str(tmp_path / "no-binary"))
    with pytest.raises(ConfigError, match="--engine triton: tritonserver binary .* does not exist"):
        preflight(config(engine="triton"))
    preflight(config(engine="triton", engine_options={"url": "127.0.0.1:8001"}))  # a server elsewhere
    # On a cluster (RAY_ADDRESS), the nodes must meet the requirements, not this driver.
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    preflight(config(engine="triton"))


def test_gpu_preflight_wants_torch(monkeypatch):
    import importlib.util

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(ConfigError, match="--engine gpu needs PyTorch with CUDA .* or use --engine onnx"):
        preflight(config(engine="gpu"))


def test_gpu_preflight_wants_dali_and_names_the_extra(monkeypatch):
    import importlib.util

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    real = importlib.util.find_spec
    present = {"torch": real("json")}  # torch "installed" (CI has none); DALI missing with its namespace package

    def find_spec(name, *a):
        if name in present:
            return present[name]
        if name.startswith("nvidia"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=r"^--engine gpu decodes and resizes with DALI, which is not installed here: "
                                          r"pip install 'bulk-classify\[dali\]' \(the gpu extra includes it\), "
                                          r"or use --engine onnx$"):
        preflight(config(engine="gpu"))


def test_fetch_ahead_budget_holds_several_actor_batches():
    """Below one actor batch Ray Data feeds the actor a trickle (a GPU actor with 3,072 ~100 KB images per call ran
    at 122 img/s): the default budget holds a few batches of large calls, and CPU-sized calls keep the floor."""
    from pipeline.config import FETCH_AHEAD_PER_ACTOR, FETCH_AHEAD_PER_CPU_ACTOR
    from pipeline.job.stages import fetch_budget

    assert fetch_budget(1, 64, on_gpu=False) == FETCH_AHEAD_PER_CPU_ACTOR
    assert fetch_budget(1, 64, on_gpu=True) == FETCH_AHEAD_PER_ACTOR
    assert fetch_budget(1, 3072, on_gpu=True) >= 2 * 3072 * 100_000 * 2
    assert fetch_budget(2, 3072, on_gpu=True) == 2 * fetch_budget(1, 3072, on_gpu=True)
    assert fetch_budget(1, 1024, on_gpu=False) > FETCH_AHEAD_PER_CPU_ACTOR  # large CPU calls keep their batches


def test_fetched_blocks_are_a_fraction_of_the_budget():
    """Ray Data's 128 MiB blocks made the store hold several times the budget (a block stays whole until its last
    row is classified): a block of fetched images is a sixteenth of the budget, at least 1 MiB, at most Ray's own."""
    from pipeline.job.stages import fetch_block_bytes

    mib = 1024 * 1024
    assert fetch_block_bytes(64 * mib) == 4 * mib
    assert fetch_block_bytes(16 * mib) == mib
    assert fetch_block_bytes(8 * mib) == mib
    assert fetch_block_bytes(64 * 1024 * mib) == 128 * mib


# A value for every RunConfig field as the environment writes it, and what the config holds for it.
ENV_VALUES = {
    "source": ("uris+in/list.txt", "uris+in/list.txt"),
    "output": ("out2/", "out2/"),
    "model": ("my-model", "my-model"),
    "engine": ("onnx", "onnx"),
    "top_k": ("3", 3),
    "batch_size": ("8", 8),
    "shard_size": ("10", 10),
    "extensions": ("jpg, PNG", ("jpg", "png")),
    "storage_options": ("anon=true,endpoint_url=http://h:9000", {"anon": True, "endpoint_url": "http://h:9000"}),
    "overwrite": ("true", True),
    "previous": ("prev/", "prev/"),
    "num_actors": ("2", 2),
    "num_gpus_per_actor": ("0.5", 0.5),
    "calls_per_actor": ("2", 2),
    "fetch_threads": ("4", 4),
    "decode_threads": ("2", 2),
    "max_bytes": ("1000", 1000),
    "max_pixels": ("2000", 2000),
    "retries": ("1", 1),
    "engine_options": ('{"max_batch": 4}', {"max_batch": 4}),
    "metrics_port": ("9464", 9464),
    "fetch_ahead_bytes": ("33554432", 33554432),
    "list_tasks": ("3", 3),
    "follow_symlinks": ("1", True),
    "source_prefix": ("s3://b/photos/", "s3://b/photos/"),
    "catalog_options": ("warehouse=/w", {"warehouse": "/w"}),
}


def test_every_option_is_settable_from_the_environment():
    assert set(ENV_VALUES) == {f.name for f in dataclasses.fields(RunConfig)}
    c = RunConfig.build({}, env={f"BULK_CLASSIFY_{name.upper()}": raw for name, (raw, _) in ENV_VALUES.items()})
    assert {name: getattr(c, name) for name in ENV_VALUES} == {name: want for name, (_, want) in ENV_VALUES.items()}
    with pytest.raises(ConfigError, match=r"BULK_CLASSIFY_OVERWRITE='maybe' is not true or false"):
        RunConfig.build({"source": "in/", "output": "out/"}, env={"BULK_CLASSIFY_OVERWRITE": "maybe"})
    with pytest.raises(ConfigError, match=r"BULK_CLASSIFY_NUM_GPUS_PER_ACTOR='x' is not a number"):
        RunConfig.build({"source": "in/", "output": "out/"}, env={"BULK_CLASSIFY_NUM_GPUS_PER_ACTOR": "x"})


def test_defaults_then_environment_then_the_nightly_file_then_the_command_line(tmp_path):
    """One merge: a field the command line leaves unset (None) is the file's, then the environment's, then the
    default; mapping options merge key by key, the higher layer's keys winning."""
    from pipeline.config import merge_options
    from pipeline.nightly import SCAN_TYPES, collect_options

    options = tmp_path / "nightly.yaml"
    options.write_text("top_k: 4\nshard_size: 20\nstorage_options: {a: 1, anon: true}\nextensions: [jpg]\n")
    env = {"BULK_CLASSIFY_TOP_K": "3", "BULK_CLASSIFY_SHARD_SIZE": "30", "BULK_CLASSIFY_BATCH_SIZE": "16",
           "BULK_CLASSIFY_STORAGE_OPTIONS": "a=0,b=2", "BULK_CLASSIFY_OUTPUT_ROOT": "s3://x/nightly"}
    flags = {"shard_size": 50, "top_k": None, "storage_options": {"a": 5}, "engine_options": {}}
    merged = merge_options(collect_options(str(options), flags), env=env, types=SCAN_TYPES)  # as nightly_scan does
    assert (merged["batch_size"], merged["top_k"], merged["shard_size"]) == (16, 4, 50)
    assert merged["storage_options"] == {"a": 5, "anon": True, "b": 2} and merged["extensions"] == ("jpg",)
    assert merged["output_root"] == "s3://x/nightly" and "engine_options" not in merged
    c = RunConfig.build({"source": "in/", "output": "out/", "top_k": None}, env=env)
    assert (c.top_k, c.shard_size, c.batch_size, c.storage_options) == (3, 30, 16, {"a": 0, "b": 2})
    assert RunConfig.build({"source": "in/", "output": "out/"}, env={}).top_k == 5  # the default


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_the_nightly_file_reads_as_its_editor_saved_it_or_says_how_to_save_it(tmp_path, encoding):
    from pipeline.nightly import load_options_file

    options = tmp_path / "nightly.yaml"
    options.write_bytes("source: s3://photos/caf\u00e9\r\ntop_k: 4\r\n".encode(encoding))
    assert load_options_file(str(options)) == {"source": "s3://photos/caf\u00e9", "top_k": 4}
    options.write_bytes("source: s3://photos/caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^--config '{options}': it is not UTF-8 text \(bytes e9 0a: invalid "
                                          r"continuation byte\); save it as UTF-8"):
        load_options_file(str(options))


def test_ray_address_is_read_in_one_place():
    """Only pipeline.node reads RAY_ADDRESS; everything else asks ``ray_address()`` or the run's plan."""
    import re
    from pathlib import Path

    import pipeline

    read = re.compile(r"""(environ\.get|getenv|environ\[)\(?\s*["']RAY_ADDRESS|RAY_ADDRESS_ENV\b""")
    readers = {p.name for p in Path(pipeline.__file__).parent.rglob("*.py") if read.search(p.read_text())}
    assert readers == {"node.py"}


def test_every_command_line_option_is_a_field_the_environment_sets_and_every_entry_merges_it():
    """The README's promise: each ``run``/``nightly`` option reads ``BULK_CLASSIFY_<NAME>``, NAME the RunConfig field
    (the repeatable ``--storage-option``, ``--engine-option``, ``--catalog-option`` are ``..._OPTIONS``); the CLI, the
    nightly and the Python API all go through ``merge_options``."""
    from pipeline import api
    from pipeline.cli.run import nightly, run
    from pipeline.nightly import NIGHTLY_KEYS, SCAN_TYPES, nightly_scan

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    run_params = {p.name for p in run.params} - {"quiet"}
    assert run_params == fields
    nightly_params = {p.name for p in nightly.params} - {"quiet", "config_file", "no_previous"}
    assert nightly_params == set(SCAN_TYPES) == (fields - {"output"}) | set(NIGHTLY_KEYS)
    bad = {"BULK_CLASSIFY_TOP_K": "x"}
    with pytest.raises(ConfigError, match=r"BULK_CLASSIFY_TOP_K='x' is not an integer"):
        nightly_scan({"source": "in/", "output_root": "out/"}, env=bad)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BULK_CLASSIFY_TOP_K", "x")
        with pytest.raises(ConfigError, match=r"BULK_CLASSIFY_TOP_K='x' is not an integer"):
            api.run(source="in/", output="out/")
