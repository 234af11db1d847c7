"""The engine contract: ``Result``, the ``Engine`` protocol, top-k arrays to results, and ``EngineSpec``.

Every engine module exports its ``SPEC``: its name, the class that builds it (whose heavy imports wait until an
actor builds one), its typed options, whether it wants a GPU, and its preflight that checks its requirements in the
driver, before Ray starts or anything is written. ``pipeline.engines.registry`` lists the engine modules.
"""

from __future__ import annotations

import importlib
import math
import os
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from pipeline.errors import ConfigError
from pipeline.gpu.defaults import NO_INT8  # stdlib only: names
from pipeline.schema import STATUS_ERROR, STATUS_OK

if TYPE_CHECKING:
    from pipeline.model.folder import ModelBundle

DEFAULT_BATCH_SIZE = 64
# Where an engine without INT8 sends an INT8 model: ONNX Runtime's integer kernels run it.
INT8_FIX = "use --engine onnx, or --engine triton with the portable profile, or the FP32 model"
# The error row of an image whose network output holds NaN or infinity: every engine's scores turn NaN for it
# (pipeline.model.scores, the served top-k head, TopKNetwork), and results_from_topk writes this instead of them.
NONFINITE_ERROR = ("engine_error: the network's output for this image is NaN or infinite, so it has no scores; check "
                   "the model's weights and export (FP16 overflow?) with bulk-classify model check")


@dataclass
class Result:
    """One input's outcome. Scores descending: softmax probabilities, the model's own probabilities, or a sigmoid
    per class, per its spec's ``output``."""

    status: str
    error: str | None = None
    class_ids: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    width: int | None = None
    height: int | None = None
    # The model's embedding, a float32 numpy vector (L2-normalised where its spec says), where its folder declares
    # one: it stays an array to the output column, far cheaper than Python floats (docs/performance.md).
    embedding: Any = None
    # A model set's other models' answers, in the set's order after this one's; each has its own status, error,
    # top-k and embedding (width and height are this Result's). Empty for one model, and for an image that failed to
    # decode: its error is every model's.
    more: list["Result"] = field(default_factory=list)

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
    """The one place top-k arrays become ``Result`` rows; a row whose scores are not finite is ``NONFINITE_ERROR``.

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
        if not all(math.isfinite(p) for p in probs):
            out.append(Result.failed(NONFINITE_ERROR, width, height))
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


# ---- what an engine registers ------------------------------------------------------------------------------------

# How an option's type reads: its kind in `bulk-classify engines`, and what a bad value "is not" in an error.
TYPE_WORDS = {int: ("int", "an integer"), float: ("number", "a number"), bool: ("true|false", "true or false"),
              list: ("list", "a list"), str: ("text", "text")}


@dataclass(frozen=True)
class Option:
    """One typed engine option (``--engine-option NAME=VALUE``)."""

    name: str
    type: type  # int, float, bool, str, or list (of strings; a string is split like a shell would)
    help: str
    minimum: float | None = None  # inclusive for int, exclusive for float
    choices: tuple[str, ...] = ()
    # A local folder: made absolute (``~`` expanded) where it is parsed, in the driver, since the actors that open it
    # run in their Ray workers' working directories.
    folder: bool = False

    @property
    def kind(self) -> str:
        """The type's word in ``bulk-classify engines`` (``int``, ``number``, ``true|false``, ``list``, ``text``)."""
        return TYPE_WORDS[self.type][0]

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
            raise ConfigError(f"{where} is not {TYPE_WORDS[self.type][1]}; {self.help}") from None
        if self.minimum is not None and self.type is float and parsed <= self.minimum:
            raise ConfigError(f"{where} must be more than {self.minimum:g}; {self.help}")
        if self.minimum is not None and parsed < self.minimum:
            raise ConfigError(f"{where} must be at least {self.minimum:g}; {self.help}")
        if self.choices and parsed not in self.choices:
            raise ConfigError(f"{where} is not one of {', '.join(self.choices)}")
        if self.folder:
            parsed = os.path.abspath(os.path.expanduser(parsed))
        return parsed


@dataclass(frozen=True)
class EngineSpec:
    """One registered engine.

    Attributes:
        name: the ``--engine`` value.
        factory: ``"module:Class"``, called as ``Class(bundle, top_k=, limits=, **options)`` inside the actor; for a
            model set, ``more=(bundle, ...)`` too: the set's other models, whose answers go in ``Result.more``.
        summary: one line for ``--help``.
        options: the options it accepts; anything else is refused in the driver.
        needs_gpu: actors take one GPU each when the cluster has GPUs.
        gpu_only: it runs nowhere else (``bulk-classify model check`` skips it on a machine without a GPU).
        decode_threads_option: the option that ``--decode-threads`` fills, if the engine decodes in the actor.
        call_threads_option: the option the job fills, unless given, with each call's compute threads on a CPU
            node: the actor's share of the cluster's cores over its calls (``pipeline.job.stages.call_threads``).
        calls_option: the option the job fills, unless given, with the calls each actor runs at once
            (``--calls-per-actor``), for a runtime that must know how many runs will share it.
        preflight: ``"module:function"`` called with the parsed options in the driver; raises ConfigError.
        model_check: ``"module:function"`` called as ``function(bundle, options, gpus)`` in the driver, before Ray
            starts or anything is written (``gpus``: (GPUs, where they were counted), the run's count): refuses, with
            a ModelError in one line, a model this engine cannot run.
        calls_per_actor: engine calls each actor runs at once by default (``--calls-per-actor``): more than one
            for an engine whose calls mostly wait on a server, so the next batch is sent while this one finishes.
        actors_per_gpu: classify actors sharing one GPU by default (``--num-gpus-per-actor`` is 1 / this).
        gpu_batch_size: images per actor call by default where the actors take GPUs (``--batch-size``); None:
            the CPU default, DEFAULT_BATCH_SIZE.
        runs_int8: runs INT8 (QDQ) model folders, as written by ``bulk-classify model quantize``.
        int8: one line for ``bulk-classify engines``: where INT8 models run with this engine.
        actor_env: environment variables of the classify actors' worker processes where they take GPUs.
        several_models: it runs a model set (``--model NAME=DIR`` given more than once) in one pass: decoding each image
            once, each model's own preprocessing and network on that decode (the factory's ``more``).
        models_check: ``"module:function"`` called as ``function(bundles, options, gpus)`` in the driver with every
            model of the run (a set's, in order; one model alone), after each passed ``model_check``: refuses, with a
            ConfigError in one line, models this engine cannot serve together (a repository without a set's outputs).
        node_start: ``"module:function"`` the driver of a local Ray calls before Ray starts, as
            ``function(bundle, top_k=, limits=, options=)`` (and ``more=`` for a model set): it starts in the
            background what the node's actors will share, so that it starts while Ray does, and returns an object with
            ``close()`` (called once the job is done) and ``events``, or None.
    """

    name: str
    factory: str
    summary: str
    options: tuple[Option, ...] = ()
    needs_gpu: bool = False
    gpu_only: bool = False
    decode_threads_option: str | None = None
    call_threads_option: str | None = None
    calls_option: str | None = None
    preflight: str | None = None
    model_check: str | None = None
    calls_per_actor: int = 1
    actors_per_gpu: int = 1
    gpu_batch_size: int | None = None
    runs_int8: bool = True
    int8: str = "INT8 models: yes (ONNX Runtime's integer kernels)"
    actor_env: Mapping[str, str] = field(default_factory=dict)
    node_start: str | None = None
    several_models: bool = False
    models_check: str | None = None

    def parse_options(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Typed, checked options; ConfigError for an unknown option or a bad value."""
        known = {o.name: o for o in self.options}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            listed = ", ".join(known) or "none"
            raise ConfigError(f"engine {self.name!r} has no option {', '.join(unknown)}; its options are {listed} "
                              f"(see 'bulk-classify engines')")
        return {name: known[name].parse(self.name, value) for name, value in raw.items()}

    def with_decode_threads(self, options: Mapping[str, Any], decode_threads: int | None) -> dict[str, Any]:
        """Parsed ``options`` with ``--decode-threads`` in the option this engine registered for it, unless given
        (none for a server that decodes)."""
        options = dict(options)
        if decode_threads is not None and self.decode_threads_option:
            options.setdefault(self.decode_threads_option, decode_threads)
        return options

    def default_batch_size(self, gpus: int) -> int:
        """Images per actor call unless ``--batch-size`` says: ``gpu_batch_size`` where the actors take GPUs (a GPU
        engine on a cluster of ``gpus`` > 0), else DEFAULT_BATCH_SIZE."""
        return self.gpu_batch_size if self.needs_gpu and gpus > 0 and self.gpu_batch_size else DEFAULT_BATCH_SIZE

    def check(self, options: Mapping[str, Any]) -> None:
        """Runs the engine's preflight (requirements on this machine) on parsed options."""
        if self.preflight:
            _load(self.preflight)(options)

    def check_model(self, bundle: ModelBundle, options: Mapping[str, Any] | None = None,
                    gpus: tuple[int, str] | None = None) -> None:
        """Refuses, in the driver, a model this engine cannot run: an INT8 model on an engine without INT8, and
        whatever the engine's ``model_check`` refuses, by ``gpus``: (GPUs, where they were counted) of the cluster
        the engine runs on (a run passes its plan's; None: counted here)."""
        from pipeline.model.folder import PRECISION_INT8  # noqa: PLC0415 - Pillow: only where a model was loaded

        if getattr(bundle, "precision", None) == PRECISION_INT8 and not self.runs_int8:
            raise ConfigError(f"model {bundle.name!r} is INT8 and --engine {self.name} has {NO_INT8}; "
                              f"{INT8_FIX}")
        if self.model_check:
            if gpus is None:
                from pipeline.engines.auto import cluster_gpus  # noqa: PLC0415 - ray, only with RAY_ADDRESS
                from pipeline.node import ray_address  # noqa: PLC0415

                gpus = cluster_gpus(ray_address())
            _load(self.model_check)(bundle, dict(options or {}), gpus)

    def check_models(self, bundles: Sequence[ModelBundle], options: Mapping[str, Any] | None = None,
                     gpus: tuple[int, str] | None = None) -> None:
        """Refuses, in the driver, the run's models (a set's, or one) that this engine cannot serve together
        (``models_check``); each has passed ``check_model``."""
        if self.models_check:
            _load(self.models_check)(list(bundles), dict(options or {}), gpus)

    def start_node(self, bundle: ModelBundle, *, top_k: int, limits: Any, options: Mapping[str, Any],
                   more: Sequence[ModelBundle] = ()) -> Any:
        """What the driver of a local Ray starts for its node's actors (``node_start``), or None; ``more``: a model
        set's other models, as ``build`` takes them."""
        if not self.node_start:
            return None
        return _load(self.node_start)(bundle, top_k=top_k, limits=limits, options=options,
                                      **({"more": tuple(more)} if more else {}))

    def build(self, bundle: ModelBundle, *, top_k: int, limits: Any, options: Mapping[str, Any],
              more: Sequence[ModelBundle] = ()) -> Engine:
        """The engine itself (heavy: loads the runtime, may start a server); ``more``: a model set's other models."""
        if more:
            return _load(self.factory)(bundle, top_k=top_k, limits=limits, more=tuple(more), **options)
        return _load(self.factory)(bundle, top_k=top_k, limits=limits, **options)


def positive_int(name: str, help: str) -> Option:
    """An integer option of at least 1."""
    return Option(name, int, help, minimum=1)


def positive_float(name: str, help: str) -> Option:
    """A number option above 0."""
    return Option(name, float, help, minimum=0)


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

