"""The engine registry: each engine module's ``SPEC`` by name, read by the config, the CLI, the actor and the job.

An engine is its module plus one line in ``ENGINE_MODULES``; nothing else names an engine. The engine modules import
only cheap things at the top (their runtimes load when an engine is built), so the driver reads the specs before Ray
starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Mapping

from pipeline.engines.auto import AUTO_ENGINE  # the GPU path where the cluster has GPUs, onnx elsewhere
from pipeline.engines.base import Engine, EngineSpec
from pipeline.errors import ConfigError
from pipeline.model.imaging import DecodeLimits
from pipeline.schema import DEFAULT_TOP_K

if TYPE_CHECKING:
    from pipeline.model.folder import ModelBundle

# The engine modules, each exporting ``SPEC``, in the order --help and `bulk-classify engines` list them.
ENGINE_MODULES = (
    "pipeline.engines.onnx",
    "pipeline.engines.openvino",
    "pipeline.engines.triton",
    "pipeline.engines.gpu",
)
REGISTRY: dict[str, EngineSpec] = {
    spec.name: spec for spec in (importlib.import_module(module).SPEC for module in ENGINE_MODULES)
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
    return spec.with_decode_threads(spec.parse_options(raw), decode_threads)


def make_engine(name: str, bundle: ModelBundle, *, top_k: int = DEFAULT_TOP_K, limits: Any = None, **options: Any) -> Engine:
    """Builds the engine called ``name`` with typed ``options``; raises ConfigError for unknown or bad ones."""
    spec = engine_spec(name)
    return spec.build(bundle, top_k=top_k, limits=limits if limits is not None else DecodeLimits(),
                      options=spec.parse_options(options))
