"""pipeline/engines/base.py and registry.py: the engine registry, typed options, and top-k arrays to results."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from pipeline.engines.base import Option, _load, results_from_topk
from pipeline.engines.registry import DEFAULT_ENGINE, ENGINE_NAMES, REGISTRY, engine_kwargs, engine_spec
from pipeline.errors import ConfigError
from pipeline.job.plan import resolve
from pipeline.schema import STATUS_ERROR, STATUS_OK


def test_registry_names_every_engine_once():
    assert ENGINE_NAMES == ("onnx", "openvino", "triton", "gpu") and DEFAULT_ENGINE == "auto" and DEFAULT_ENGINE not in REGISTRY
    assert [s.name for s in REGISTRY.values()] == list(REGISTRY)
    assert {name for name, spec in REGISTRY.items() if spec.needs_gpu} == {"triton", "gpu"}
    with pytest.raises(ConfigError, match="--engine 'cuda' is unknown; choose one of auto, onnx, openvino, triton, gpu"):
        engine_spec("cuda")


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_every_registered_option_is_a_constructor_argument(name):
    """An option the registry accepts must reach the engine: no option that fails only inside the actor."""
    spec = REGISTRY[name]
    factory = _load(spec.factory)  # imports the module only: torch and tritonclient load when built
    if name == "gpu":  # GpuEngine passes its options on to the classifier it makes
        import dataclasses

        from pipeline.gpu.classifier import ClassifierOptions

        params = {f.name for f in dataclasses.fields(ClassifierOptions)} | {"network"}
    else:
        params = set(inspect.signature(factory).parameters)
    assert {o.name for o in spec.options} <= params
    if spec.decode_threads_option:
        assert spec.decode_threads_option in {o.name for o in spec.options}
    if spec.preflight:
        assert callable(_load(spec.preflight))


def test_decode_threads_goes_to_the_option_each_engine_registered():
    assert engine_kwargs("onnx", {}, decode_threads=4) == {"decode_threads": 4}
    assert engine_kwargs("gpu", {}, decode_threads=4) == {"cpu_decode_threads": 4}  # GpuClassifier's name
    assert engine_kwargs("triton", {}, decode_threads=4) == {}  # the server decodes
    assert engine_kwargs("onnx", {"decode_threads": 2}, decode_threads=4) == {"decode_threads": 2}  # explicit wins


@pytest.mark.parametrize("option, raw, parsed", [
    (Option("n", int, ""), "3", 3),
    (Option("n", int, ""), 3.0, 3),
    (Option("x", float, ""), "0.5", 0.5),
    (Option("b", bool, ""), "yes", True),
    (Option("b", bool, ""), 0, False),
    (Option("s", str, ""), 12, "12"),
    (Option("l", list, ""), "--a=1 '--b 2'", ["--a=1", "--b 2"]),
    (Option("l", list, ""), ["--a"], ["--a"]),
])
def test_option_types(option, raw, parsed):
    assert option.parse("e", raw) == parsed


@pytest.mark.parametrize("option, raw, message", [
    (Option("n", int, "e.g. 4"), "four", r"--engine-option n='four' \(engine 'e'\) is not an integer; e.g. 4"),
    (Option("n", int, ""), 2.5, "is not an integer"),
    (Option("n", int, ""), True, "is not an integer"),
    (Option("n", int, "", minimum=1), 0, "must be at least 1"),
    (Option("x", float, "", minimum=0), 0, "must be more than 0"),
    (Option("b", bool, ""), "perhaps", "is not true or false"),
    (Option("c", str, "", choices=("a", "b")), "z", "is not one of a, b"),
])
def test_option_errors_name_the_value_and_the_fix(option, raw, message):
    with pytest.raises(ConfigError, match=message):
        option.parse("e", raw)


def test_a_folder_option_is_made_absolute_in_the_driver_for_actors_in_other_working_directories(tmp_path,
                                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    [repository] = [o for o in engine_spec("triton").options if o.name == "repository"]
    assert repository.parse("triton", "repos/gpu") == str(tmp_path / "repos" / "gpu")
    assert repository.parse("triton", "~/gpu") == str(tmp_path / "home" / "gpu")
    assert repository.parse("triton", "/srv/repo") == "/srv/repo"
    assert Option("name", str, "text").parse("e", "a/b") == "a/b"  # only folders are paths


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(ConfigError, match="engine 'triton' has no option bogus, max_batch; its options are "
                                          "profile, repository, url, instances"):
        REGISTRY["triton"].parse_options({"max_batch": 8, "bogus": 1})


def test_results_from_topk():
    ids = np.array([[2, 0], [1, 2], [0, 1]])
    scores = np.array([[0.7, 0.2], [0.6, 0.3], [0.5, 0.4]], dtype=np.float32)
    rows = results_from_topk(ids, scores, ["cat", "dog", "eel"], [(4, 3), (None, None), (9, 9)],
                             errors=[None, "decode_error: truncated", ""])
    assert [r.status for r in rows] == [STATUS_OK, STATUS_ERROR, STATUS_OK]
    assert rows[0].labels == ["eel", "cat"] and rows[0].class_ids == [2, 0] and rows[0].width == 4
    assert rows[0].scores == pytest.approx([0.7, 0.2]) and all(isinstance(s, float) for s in rows[0].scores)
    assert rows[1].error == "decode_error: truncated" and rows[1].class_ids == [] and rows[1].width is None
    # an id the labels do not cover is written as its number rather than crashing the batch
    assert results_from_topk([[5]], [[1.0]], ["a"], [(1, 1)])[0].labels == ["5"]


def test_writer_actors_one_per_eight_cpus_and_none_below_where_the_driver_writes():
    from pipeline.job.stages import writer_actors

    assert [writer_actors(cpus) for cpus in (1, 2, 7, 8, 15, 16, 64)] == [0, 0, 0, 1, 1, 2, 8]


def test_actor_plan_puts_three_gpu_actors_on_each_gpu():
    from pipeline.config import RunConfig
    from pipeline.job.stages import actor_plan

    def plan(engine, cpus=16, gpus=2, **kw):
        return actor_plan(RunConfig(source="/in", output="/out", engine=engine, **kw), cpus, gpus)

    actors, actor_cpus, gpus_each = plan("gpu")
    assert (actors, actor_cpus) == (6, 1.0) and abs(gpus_each - 1 / 3) < 1e-9
    assert plan("triton")[:1] == (6,)  # three actors per GPU share its one server (the gpu profile)
    assert plan("gpu", num_gpus_per_actor=0.5)[:1] == (4,)
    assert plan("gpu", num_actors=2)[0] == 2
    assert plan("gpu", gpus=0) == (4, 1.0, 0.0)  # no GPUs: the CPU plan (a core in four)


def actor_engine_options(config, *args, **kw):
    """The classify actors' engine options the job gives ``config``'s engine (its options parsed as the plan does)."""
    from pipeline.job.stages import actor_engine_options as options

    config, spec = resolve(config, 0)
    return options(spec, config.engine_options, *args, **kw)


def test_each_onnx_call_gets_the_actors_share_of_the_cores_unless_told():
    """2 cores keep one ORT thread a call (the 2-core optimum); 16 cores (4 actors x 2 calls) give each call 2."""
    from pipeline.config import RunConfig
    from pipeline.job.stages import call_threads

    assert [call_threads(c, a, k) for c, a, k in ((2, 1, 2), (16, 4, 2), (16, 4, 3), (64, 16, 2), (1, 1, 2))] == \
        [1, 2, 1, 2, 1]
    onnx = RunConfig(source="/in", output="/out", engine="onnx")
    assert actor_engine_options(onnx, 16, 4, 2, on_gpu=False) == {"intra_op_threads": 2}
    assert actor_engine_options(onnx, 2, 1, 2, on_gpu=False) == {"intra_op_threads": 1}
    told = RunConfig(source="/in", output="/out", engine="onnx", engine_options={"intra_op_threads": "3"})
    assert actor_engine_options(told, 16, 4, 2, on_gpu=False) == {"intra_op_threads": 3}
    assert actor_engine_options(RunConfig(source="/in", output="/out", engine="gpu"), 16, 4, 2, on_gpu=False) == {}
    assert REGISTRY["onnx"].call_threads_option in {o.name for o in REGISTRY["onnx"].options}


def test_openvino_gets_a_stream_for_each_of_the_actors_calls():
    """OpenVINO fixes its streams when it compiles the network, so the job tells it the actor's calls at once."""
    from pipeline.config import RunConfig
    ov = RunConfig(source="/in", output="/out", engine="openvino")
    assert actor_engine_options(ov, 2, 1, 2, on_gpu=False) == {"streams": 2, "threads": 1}
    assert actor_engine_options(ov, 16, 4, 3, on_gpu=False) == {"streams": 3, "threads": 1}
    told = RunConfig(source="/in", output="/out", engine="openvino", engine_options={"streams": "1"})
    assert actor_engine_options(told, 16, 4, 2, on_gpu=False) == {"streams": 1, "threads": 2}
    assert all(spec.calls_option in (None, *(o.name for o in spec.options)) for spec in REGISTRY.values())


def test_triton_actors_keep_their_children_when_ray_ends_their_worker(monkeypatch):
    """The shared server must outlive its owner's worker; a local Ray started with the variable passes it on by
    inheritance, a cluster's workers get it in the actors' runtime_env."""
    from pipeline.job.stages import classify_actor_options

    env = {"RAY_kill_child_processes_on_worker_exit": "0"}
    assert dict(REGISTRY["triton"].actor_env) == env and not REGISTRY["onnx"].actor_env
    monkeypatch.delenv("RAY_kill_child_processes_on_worker_exit", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    triton, onnx = REGISTRY["triton"], REGISTRY["onnx"]
    assert classify_actor_options(triton, on_gpu=True, local=True) == {"runtime_env": {"env_vars": env}}
    assert classify_actor_options(triton, on_gpu=False, local=True) == {}  # an actor's own server: Ray's default stops it
    assert classify_actor_options(onnx, on_gpu=True, local=True) == {}
    monkeypatch.setenv("RAY_kill_child_processes_on_worker_exit", "0")
    assert classify_actor_options(triton, on_gpu=True, local=True) == {}
    # a cluster's workers (RAY_ADDRESS) do not inherit the driver's environment
    assert classify_actor_options(triton, on_gpu=True, local=False) == {"runtime_env": {"env_vars": env}}


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_the_default_gpu_plan_scales_with_the_gpus_of_a_node(gpus):
    """No flags: auto's engine on a node of N GPUs and 16 CPUs each gives 3N actors of one CPU and a third of a GPU,
    keeps CPUs beside them for the fetch, write and server work, and a fetch-ahead budget N times one GPU's."""
    from pipeline.config import RunConfig
    from pipeline.job.stages import actor_plan, fetch_budget

    config = RunConfig(source="/in", output="/out")
    actors, actor_cpus, gpus_each = actor_plan(config, 16 * gpus, gpus)
    assert actors == 3 * gpus and actor_cpus == 1.0 and abs(gpus_each - 1 / 3) < 1e-9
    assert 16 * gpus - actors * actor_cpus == 13 * gpus
    batch = resolve(config, gpus, "the Ray cluster")[0].batch_size
    one = fetch_budget(actor_plan(config, 16, 1)[0], batch, on_gpu=True)
    assert fetch_budget(actors, batch, on_gpu=True) == gpus * one
