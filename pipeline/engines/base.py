"""The engine contract: ``Result``, the ``Engine`` protocol, top-k arrays to results, and the engine registry.

Every engine is one module plus one ``EngineSpec`` in ``REGISTRY``: its name, the class that builds it (imported
only when an actor builds one), its typed options, whether it wants a GPU, and its module's preflight that checks
its requirements in the driver, before Ray starts or anything is written. The config, the CLI, the actor and the
job read the registry; nothing else names an engine.
"""

from __future__ import annotations

import importlib
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from pipeline.engines.auto import AUTO_ENGINE  # the GPU path where the cluster has GPUs, onnx elsewhere
from pipeline.errors import ConfigError
from pipeline.triton import contract as tn  # stdlib only: names
from pipeline.triton.contract import DEFAULT_TOP_K  # noqa: F401 - the engines' default, re-exported

DEFAULT_BATCH_SIZE = 64
# Threads decoding in an actor by default (--decode-threads): the CPU count, at most this; past it threads only wait.
MAX_DECODE_THREADS = 8
STATUS_OK = "ok"
STATUS_ERROR = "error"
STAGE_DECODE = "decode_preprocess"
STAGE_INFER = "infer"


@dataclass
class Result:
    """One input's outcome. Scores are softmax probabilities, descending."""

    status: str
    error: str | None = None
    class_ids: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    width: int | None = None
    height: int | None = None

    @classmethod
    def failed(cls, error: str, width: int | None = None, height: int | None = None) -> "Result":
        return cls(status=STATUS_ERROR, error=error, width=width, height=height)


@runtime_checkable
class Engine(Protocol):
    """What every engine offers: one Result per encoded image, in order, and its cumulative stage times.

    ``stage_seconds`` maps ``STAGE_DECODE`` and ``STAGE_INFER`` to seconds spent so far; an engine that cannot
    tell decoding from inference (the server does both) reports everything under ``STAGE_INFER``.
    """

    name: str
    stage_seconds: Mapping[str, float]

    def classify(self, images: Sequence[bytes]) -> list[Result]: ...

    def close(self) -> None: ...


def results_from_topk(
    class_ids: Sequence[Sequence[int]],
    scores: Sequence[Sequence[float]],
    labels: Sequence[str],
    sizes: Sequence[tuple[int | None, int | None]],
    errors: Sequence[str | None] | None = None,
) -> list[Result]:
    """The one place top-k arrays become ``Result`` rows.

    Args:
        class_ids, scores: (N, k) arrays, best first.
        labels: the model's labels; an id outside them is written as its number.
        sizes: (width, height) per image, ``None`` where unknown.
        errors: per image, ``None``/"" when classified, else the ``kind: detail`` text of its error row.
    """
    out = []
    for i, (ids, probs, (width, height)) in enumerate(zip(class_ids, scores, sizes)):
        if errors is not None and errors[i]:
            out.append(Result.failed(str(errors[i]), width, height))
            continue
        ids = [int(c) for c in ids]
        out.append(Result(
            status=STATUS_OK,
            class_ids=ids,
            labels=[labels[c] if 0 <= c < len(labels) else str(c) for c in ids],
            scores=[float(p) for p in probs],
            width=width,
            height=height,
        ))
    return out


# ---- the registry ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One typed engine option (``--engine-option NAME=VALUE``)."""

    name: str
    type: type  # int, float, bool, str, or list (of strings; a string is split like a shell would)
    help: str
    minimum: float | None = None  # inclusive for int, exclusive for float
    choices: tuple[str, ...] = ()

    def parse(self, engine: str, value: Any) -> Any:
        """``value`` (from the CLI, the environment or a YAML file) as this option's type; ConfigError names the fix."""
        where = f"--engine-option {self.name}={value!r} (engine {engine!r})"
        try:
            if self.type is bool:
                parsed: Any = _as_bool(value)
            elif self.type is list:
                parsed = shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
            elif self.type is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError(value)
                parsed = int(value)
            else:
                parsed = self.type(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} is not {_type_name(self.type)}; {self.help}") from None
        if self.minimum is not None and self.type is float and parsed <= self.minimum:
            raise ConfigError(f"{where} must be more than {self.minimum:g}; {self.help}")
        if self.minimum is not None and parsed < self.minimum:
            raise ConfigError(f"{where} must be at least {self.minimum:g}; {self.help}")
        if self.choices and parsed not in self.choices:
            raise ConfigError(f"{where} is not one of {', '.join(self.choices)}")
        return parsed


@dataclass(frozen=True)
class EngineSpec:
    """One registered engine.

    Attributes:
        name: the ``--engine`` value.
        factory: ``"module:Class"``, called as ``Class(bundle, top_k=, limits=, **options)`` inside the actor.
        summary: one line for ``--help``.
        options: the options it accepts; anything else is refused in the driver.
        needs_gpu: actors take one GPU each when the cluster has GPUs.
        decode_threads_option: the option that ``--decode-threads`` fills, if the engine decodes in the actor.
        preflight: ``"module:function"`` called with the parsed options in the driver; raises ConfigError.
        calls_per_actor: engine calls each actor runs at once by default (``--calls-per-actor``): more than one
            for an engine whose calls mostly wait on a server, so the next batch is sent while this one finishes.
        actors_per_gpu: classify actors sharing one GPU by default (``--num-gpus-per-actor`` is 1 / this).
        gpu_batch_size: images per actor call by default where the actors take GPUs (``--batch-size``); None:
            the CPU default, DEFAULT_BATCH_SIZE.
        runs_int8: runs INT8 (QDQ) model folders, as written by ``bulk-classify model quantize``.
        int8: one line for ``bulk-classify engines``: where INT8 models run with this engine.
        actor_env: environment variables of the classify actors' worker processes where they take GPUs.
    """

    name: str
    factory: str
    summary: str
    options: tuple[Option, ...] = ()
    needs_gpu: bool = False
    decode_threads_option: str | None = None
    preflight: str | None = None
    calls_per_actor: int = 1
    actors_per_gpu: int = 1
    gpu_batch_size: int | None = None
    runs_int8: bool = True
    int8: str = "INT8 models: yes (ONNX Runtime's integer kernels)"
    actor_env: Mapping[str, str] = field(default_factory=dict)

    def parse_options(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Typed, checked options; ConfigError for an unknown option or a bad value."""
        known = {o.name: o for o in self.options}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            listed = ", ".join(known) or "none"
            raise ConfigError(f"engine {self.name!r} has no option {', '.join(unknown)}; its options are {listed} "
                              f"(see 'bulk-classify engines')")
        return {name: known[name].parse(self.name, value) for name, value in raw.items()}

    def check(self, options: Mapping[str, Any]) -> None:
        """Runs the engine's preflight (requirements on this machine) on parsed options."""
        if self.preflight:
            _load(self.preflight)(options)

    def check_model(self, bundle: Any) -> None:
        """Refuses, in the driver, a model this engine cannot run: an INT8 model on an engine without INT8."""
        from pipeline.model import PRECISION_INT8  # noqa: PLC0415 - Pillow: only where a model was loaded

        if getattr(bundle, "precision", None) == PRECISION_INT8 and not self.runs_int8:
            raise ConfigError(f"model {bundle.name!r} is INT8 and --engine {self.name} has {tn.NO_INT8}; "
                              f"{tn.INT8_FIX}")

    def build(self, bundle: Any, *, top_k: int, limits: Any, options: Mapping[str, Any]) -> Engine:
        """The engine itself (heavy: loads the runtime, may start a server)."""
        return _load(self.factory)(bundle, top_k=top_k, limits=limits, **options)


def _positive_int(name: str, help: str) -> Option:
    return Option(name, int, help, minimum=1)


def _positive_float(name: str, help: str) -> Option:
    return Option(name, float, help, minimum=0)


REGISTRY: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            name="onnx",
            factory="pipeline.engines.onnx:OnnxEngine",
            summary="ONNX Runtime on the actor's CPU cores (auto's choice without GPUs)",
            options=(
                _positive_int("decode_threads", "threads decoding images per actor, e.g. 4"),
                _positive_int("intra_op_threads", "ONNX Runtime threads per run, e.g. 2"),
                _positive_int("max_batch", "images per ONNX Runtime run, e.g. 8"),
            ),
            decode_threads_option="decode_threads",
            # Two calls, each running ONNX Runtime on one thread: one call's batch decodes on the pool while the
            # other's runs the network, so the stages overlap instead of taking turns (docs/int8.md, shape table).
            calls_per_actor=2,
        ),
        EngineSpec(
            name="triton",
            factory="pipeline.engines.triton:TritonEngine",
            summary="one local tritonserver per GPU (gpu profile: DALI + the network) or per actor (portable: "
                    "ONNX Runtime on the CPU), images over gRPC",
            options=(
                Option("profile", str, "the repository the engine builds and serves: auto (gpu where the actor "
                       "has a GPU, else portable), gpu or portable", choices=("auto", "gpu", "portable")),
                Option("repository", str, "a folder built by 'bulk-classify repo build'"),
                Option("url", str, "a running server's gRPC host:port"),
                _positive_int("instances", "model instances when the engine builds the repository, e.g. 6"),
                Option("mps", bool, "a private CUDA MPS daemon for the server the engine starts on a GPU: true "
                       "or false (default: the profile's)"),
                _positive_float("startup_timeout_s", "seconds to wait for the server, e.g. 120"),
                _positive_int("request_batch", "images per request, e.g. 32"),
                _positive_int("concurrency", "requests in flight, e.g. 2"),
                Option("server_args", list, "extra tritonserver arguments, e.g. '--log-verbose=1'"),
                Option("model_name", str, "the model to call, e.g. classifier"),
                _positive_float("request_timeout_s", "seconds one request may take, e.g. 300"),
                Option("share_server", bool, "one local server for the actors of a GPU (with --num-gpus-per-actor "
                       "below 1): true or false"),
            ),
            needs_gpu=True,
            preflight="pipeline.engines.triton:check_requirements",
            # Two calls per actor: the next batch is sent while this one's last requests finish. Three actors per
            # GPU share its one server (the gpu profile's share_server), so the client work spreads over three
            # processes; 2,048 images a call keep 16 requests of 128 in flight (docs/performance.md).
            calls_per_actor=2,
            actors_per_gpu=3,
            gpu_batch_size=2048,
            # Ray kills a worker's child processes when the worker exits, before its atexit handlers run: a GPU's
            # shared server's owner must keep serving the other actors of its GPU until they leave (sharing.py).
            # The server still dies with its owner's launcher thread (PR_SET_PDEATHSIG, server.py). An actor's own
            # server (the portable profile) keeps Ray's default, which stops it before the job's end.
            actor_env={"RAY_kill_child_processes_on_worker_exit": "0"},
            int8=f"INT8 models: with the portable profile (ONNX Runtime); the gpu profile has {tn.NO_INT8}",
        ),
        EngineSpec(
            name="gpu",
            factory="pipeline.engines.gpu.engine:GpuEngine",
            summary="DALI decode + resize and a PyTorch network on the actor's GPU",
            options=(
                Option("network", str, "'auto' (the model's) or 'resnet50' (random weights, benchmarks)"),
                _positive_int("dali_threads", "DALI's CPU threads per pipeline, e.g. 4"),
                _positive_int("dali_depth", "batches in flight on one DALI pipeline (1: a pipeline per prep worker), e.g. 2"),
                _positive_int("batch_size", "images per network call, e.g. 256"),
                Option("device", str, "a torch device, e.g. cuda:0"),
                Option("cuda_graph", bool, "capture the network in a CUDA graph: true or false"),
                Option("half", bool, "FP16 network: true or false"),
                _positive_int("cpu_decode_threads", "Pillow threads decoding what DALI does not take, e.g. 4"),
                Option("pipeline", bool, "prepare the next batches while the network runs: true or false"),
                _positive_int("prep_workers", "threads preparing batches (at dali_depth 1: one DALI pipeline each), e.g. 2"),
                Option("hw_decoder_load", float, "share of each batch for DALI's hardware JPEG decoder, 0..1"),
                Option("cuda_sync", str, "how threads wait for the GPU: auto (CUDA's: spin), spin, yield or block",
                       choices=tn.CUDA_SYNC_MODES),
            ),
            needs_gpu=True,
            decode_threads_option="cpu_decode_threads",
            preflight="pipeline.engines.gpu.engine:check_requirements",
            # Calls share one pipeline (RequestStream), so the next call decodes while the network runs this one;
            # three actors keep one GPU busiest (docs/performance.md).
            calls_per_actor=3,
            actors_per_gpu=3,
            gpu_batch_size=2048,
            runs_int8=False,
            int8=f"INT8 models: none ({tn.NO_INT8}); {tn.INT8_FIX}",
        ),
    )
}
ENGINE_NAMES = tuple(REGISTRY)
ENGINE_CHOICES = (AUTO_ENGINE, *ENGINE_NAMES)
DEFAULT_ENGINE = AUTO_ENGINE


def engine_spec(name: str) -> EngineSpec:
    """The registered engine called ``name``; ConfigError lists the choices."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"--engine {name!r} is unknown; choose one of {', '.join(ENGINE_CHOICES)}") from None


def engine_kwargs(name: str, raw: Mapping[str, Any], *, decode_threads: int | None = None) -> dict[str, Any]:
    """``raw`` options parsed for engine ``name``, with ``--decode-threads`` filled in where the engine takes it."""
    spec = engine_spec(name)
    options = spec.parse_options(raw)
    if decode_threads is not None and spec.decode_threads_option:
        options.setdefault(spec.decode_threads_option, decode_threads)
    return options


def make_engine(name: str, bundle: Any, *, top_k: int = DEFAULT_TOP_K, limits: Any = None, **options: Any) -> Engine:
    """Builds the engine called ``name`` with typed ``options``; raises ConfigError for unknown or bad ones."""
    from pipeline.imaging import DecodeLimits  # noqa: PLC0415 - Pillow: only where an engine is built

    spec = engine_spec(name)
    return spec.build(bundle, top_k=top_k, limits=limits if limits is not None else DecodeLimits(),
                      options=spec.parse_options(options))


def _load(ref: str) -> Callable[..., Any]:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


def _type_name(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", list: "a list", str: "text"}[kind]
