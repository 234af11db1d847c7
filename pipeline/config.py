"""The run's options as plain data, each value checked on its own, and the one option merge: defaults < environment <
the nightly's file < explicit options. What the options make of the run (the engine, its parsed options, the model)
is decided in ``pipeline.job.plan``."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipeline.engines.registry import AUTO_ENGINE, DEFAULT_ENGINE
from pipeline.errors import ConfigError
from pipeline.io.iceberg_output import TableRef, is_iceberg
from pipeline.model.imaging import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS
from pipeline.model.model_set import parse_model_args
from pipeline.schema import DEFAULT_EXTENSIONS, DEFAULT_TOP_K, MIB
from pipeline.storage import manifest_form

ENV_PREFIX = "BULK_CLASSIFY_"
# Fetch-ahead: bytes fetched but not yet classified wait in Ray's object store. The default budget is sized per
# classify actor to hold some seconds of its work (docs/output.md#large-catalogs).
FETCH_AHEAD_PER_ACTOR = 256 * MIB
FETCH_AHEAD_PER_CPU_ACTOR = 64 * MIB
# ...and never less than a few actor batches of typical images: with a budget below one actor batch Ray Data
# feeds the actor a trickle.
FETCH_AHEAD_BATCHES = 3
FETCH_AHEAD_IMAGE_BYTES = 256 * 1024
DEFAULT_LIST_TASKS = 8
# Classify actors where they take no GPU, by default (--num-actors): one per this many CPUs.
CPUS_PER_CPU_ACTOR = 4
MAX_TOP_K = 1000  # the classes of the largest ImageNet head
# Each bounded number option's (low, high or None), checked where the config is made (``check_range``).
RANGES = {"retries": (0, None), "num_gpus_per_actor": (0, None), "calls_per_actor": (1, 16), "num_actors": (1, None),
          "decode_threads": (1, None)}


def parse_option(item: str, flag: str = "--storage-option", example: str = "anon=true") -> tuple[str, Any]:
    """Parse one ``KEY=VALUE`` of ``flag``; JSON values (true, 3, {...}) are decoded, anything else stays text."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{flag} {item!r} is not KEY=VALUE; write e.g. {flag} {example}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one classification run is given; never mutated (``pipeline.job.plan`` makes the resolved copy).

    Attributes:
        source: folder or fsspec URL (``s3://bucket/prefix``, ``file://…``) listed recursively, or a manifest that
            names the objects: ``uris+URL`` (a URI list) or ``inventory+URL`` (an S3 Inventory manifest.json).
        output: folder or fsspec URL that receives Parquet shards and bookkeeping files (``_*``).
        model: ``None``/``"default"`` for the built-in EfficientNet-Lite0, or a model folder; or the ``--model``
            values as a list: one folder, or a model set of ``NAME=DIR`` items (``--model taxonomy=DIR --model
            safety=DIR2``; kept as that tuple), each model run on one decode of every image and written to its own
            column (``pipeline.model.model_set``).
        engine: a name in ``pipeline.engines.registry.REGISTRY``, or ``auto`` (the plan picks one by the cluster's
            GPUs); ``engine_options``: the engine's options, which the plan parses against its spec.
        batch_size: images per engine call (None: the engine's ``gpu_batch_size`` where its actors take GPUs,
            else DEFAULT_BATCH_SIZE; filled in by the plan); shard_size: rows per committed Parquet shard.
        previous: an earlier run's output; unchanged objects are carried over instead of reclassified.
        fetch_ahead_bytes: cap on the object-store bytes of the running pipeline (fetched, not yet classified);
            None: FETCH_AHEAD_PER_ACTOR per classify actor on a GPU, FETCH_AHEAD_PER_CPU_ACTOR per actor on CPUs,
            and at least FETCH_AHEAD_BATCHES actor batches of FETCH_AHEAD_IMAGE_BYTES per image per actor.
        list_tasks: listing tasks at once, i.e. the bound on outstanding LIST calls.
        follow_symlinks: follow local symbolic links that lead out of the source (links inside it are never
            followed: their targets are listed under their own paths).
        source_prefix: with a manifest SOURCE (``uris+…``, ``inventory+…``), only the entries under it, by whole
            path segments (``pipeline.io.source_manifest.prefix_uri``).
        catalog_options: properties of the Iceberg catalog of an ``iceberg://NAMESPACE.TABLE`` output or previous
            (``pipeline.io.iceberg_output.catalog_properties``).
        calls_per_actor: engine calls each classify actor runs at once (threads); None: the engine's
            ``calls_per_actor`` in ``pipeline.engines.registry.REGISTRY``.
    """

    source: str
    output: str
    model: str | tuple[str, ...] | None = None
    engine: str = DEFAULT_ENGINE
    top_k: int = DEFAULT_TOP_K
    batch_size: int | None = None
    shard_size: int = 1000
    extensions: tuple[str, ...] = DEFAULT_EXTENSIONS
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    overwrite: bool = False
    previous: str | None = None
    num_actors: int | None = None
    num_gpus_per_actor: float | None = None
    calls_per_actor: int | None = None
    fetch_threads: int = 16
    decode_threads: int | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    retries: int = 5
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    metrics_port: int | None = None
    fetch_ahead_bytes: int | None = None
    list_tasks: int = DEFAULT_LIST_TASKS
    follow_symlinks: bool = False
    source_prefix: str | None = None
    catalog_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for url, name in ((self.source, "SOURCE"), (self.output, "--output")):
            if not url:
                raise ConfigError(f"{name} is empty; give a folder, file:// or s3://bucket/prefix URL")
        if _strip(self.source) == _strip(self.output):
            raise ConfigError("--output must differ from SOURCE; write results next to the images, not over them")
        if self.source_prefix is not None and manifest_form(self.source) is None:
            raise ConfigError(f"--source-prefix filters a manifest; SOURCE {self.source!r} is a folder or prefix: "
                              "give the prefix in SOURCE itself, or use a uris+ or inventory+ SOURCE")
        for url in (self.output, self.previous):
            if is_iceberg(url):
                TableRef.parse(url)  # a malformed table name fails here, before anything is opened
        if is_iceberg(self.output) and ("@" in self.output or self.overwrite):
            raise ConfigError(f"--output {self.output!r}: an Iceberg output is a table's current snapshot, without "
                              "@SNAPSHOT, and is never overwritten; choose a new table to start over")
        if self.engine == AUTO_ENGINE and self.engine_options:
            raise ConfigError("--engine-option needs an engine: add --engine onnx or --engine triton (auto picks "
                              "one by the cluster's GPUs; 'bulk-classify engines' shows which)")
        if self.batch_size is not None:
            check_positive("batch_size", self.batch_size)
        check_top_k(self.top_k)
        if isinstance(self.model, (str, list, tuple)):  # read as the --model values are: NAME=DIR names a model
            ref, named = parse_model_args((self.model,) if isinstance(self.model, str) else tuple(self.model))
            object.__setattr__(self, "model", tuple(f"{n}={r}" for n, r in named) if named else ref)
        for name in ("shard_size", "fetch_threads", "max_bytes", "max_pixels", "list_tasks"):
            check_positive(name, getattr(self, name))
        for name, (low, high) in RANGES.items():
            check_range(name, getattr(self, name), low, high)
        if self.fetch_ahead_bytes is not None and self.fetch_ahead_bytes < 16 * MIB:
            raise ConfigError(f"--fetch-ahead-bytes {self.fetch_ahead_bytes} is below 16 MiB (16777216); "
                              "give a larger budget or leave it unset")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port {self.metrics_port} is not a TCP port; use 1024..65535 or 0")
        exts = tuple(e.lower().lstrip(".") for e in self.extensions)
        if not exts or any(not e or "/" in e for e in exts):
            raise ConfigError(f"--extensions {','.join(self.extensions)!r} is not a list like jpg,png,webp")
        object.__setattr__(self, "extensions", exts)
        for name in ("storage_options", "catalog_options", "engine_options"):
            object.__setattr__(self, name, dict(getattr(self, name)))

    @classmethod
    def build(cls, explicit: Mapping[str, Any], env: Mapping[str, str] | None = None) -> "RunConfig":
        """Merge defaults < ``BULK_CLASSIFY_*`` environment < explicit options (``None`` means unset)."""
        if unknown := set(explicit) - set(cls.__dataclass_fields__):
            raise ConfigError(f"unknown option(s) {sorted(unknown)}; see 'bulk-classify run --help'")
        return cls(**merge_options(explicit, env=env))

    def revised(self, **decided: Any) -> "RunConfig":
        """A copy with what the plan decided from these checked options (the engine ``auto`` resolves to, the batch
        size, ``top_k`` capped at the model's classes, an Iceberg table's data folder), not checked again: each
        option is validated once, where the config is made."""
        if unknown := set(decided) - set(self.__dataclass_fields__):
            raise TypeError(f"RunConfig has no field(s) {sorted(unknown)}")
        copy = object.__new__(RunConfig)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(decided)
        return copy

    def public_dict(self) -> dict[str, Any]:
        """The options as JSON-safe values, with storage secrets left out (for _SUCCESS and reports)."""
        out = dataclasses.asdict(self)
        out["storage_options"] = sorted(self.storage_options)  # keys only: values may be credentials
        out["catalog_options"] = sorted(self.catalog_options)
        out["engine_options"] = {k: v for k, v in self.engine_options.items() if "secret" not in k.lower()}
        out["extensions"] = list(self.extensions)
        if isinstance(self.model, tuple):
            out["model"] = list(self.model)
        return out


def check_positive(name: str, value: Any, flag: str | None = None) -> None:
    """ConfigError unless ``value`` of option ``name`` (``flag``: as the caller spells it) is a positive integer."""
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag or '--' + name.replace('_', '-')} must be a positive integer, got {value!r}")


def check_range(name: str, value: Any, low: float, high: float | None) -> None:
    """ConfigError unless ``value`` of option ``name`` is None or within ``low``..``high`` (None: no upper bound)."""
    if value is not None and not (low <= value and (high is None or value <= high)):
        bound = f"within {low}..{high}" if high is not None else "0 or more" if low == 0 else f"at least {low}"
        raise ConfigError(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def check_top_k(top_k: Any, flag: str = "--top-k") -> None:
    """The one check of a top-k: a positive integer within any ImageNet head's classes (1..MAX_TOP_K); the model's
    own class count caps it once the model is loaded (``pipeline.job.plan``)."""
    check_positive("top_k", top_k, flag)
    if top_k > MAX_TOP_K:
        raise ConfigError(f"{flag} {top_k} is larger than any ImageNet head; use 1..{MAX_TOP_K}")


def _strip(url: str) -> str:
    return url.rstrip("/").removeprefix("file://")


def option_types() -> dict[str, str]:
    """Every RunConfig field by the name of its type, as the environment's values are read."""
    return {f.name: str(f.type) for f in dataclasses.fields(RunConfig)}


def merge_options(*layers: Mapping[str, Any], env: Mapping[str, str] | None = None,
                  types: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The one merge of options: defaults (left out) < ``BULK_CLASSIFY_<NAME>`` environment < ``layers``, lowest
    first (the nightly's file, then the command line). In a layer ``None`` and an empty mapping mean "not given";
    mapping options (storage, engine and catalog options) merge key by key, the higher layer's keys winning.

    ``types`` names the options the environment may set and their types (default: every RunConfig field).
    """
    env = os.environ if env is None else env
    types = option_types() if types is None else types
    merged: dict[str, Any] = {}
    for name, type_name in types.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            merged[name] = _coerce(name, raw, type_name)
    for layer in layers:
        for name, value in layer.items():
            if isinstance(value, Mapping):
                if value:
                    merged[name] = {**dict(merged.get(name) or {}), **dict(value)}
            elif value is not None:
                merged[name] = value
    if isinstance(merged.get("extensions"), list):
        merged["extensions"] = tuple(merged["extensions"])
    return merged


def _coerce(name: str, raw: str, type_name: str) -> Any:
    """A ``BULK_CLASSIFY_<NAME>`` value as the option's type: integers, numbers, true/false, comma-separated lists,
    and ``KEY=VALUE,KEY=VALUE`` (or a JSON object) for the mapping options."""
    var = f"{ENV_PREFIX}{name.upper()}={raw!r}"
    if type_name.startswith(("int", "float")):
        number = int if type_name.startswith("int") else float
        try:
            return number(raw)
        except ValueError:
            what = "an integer" if number is int else "a number"
            raise ConfigError(f"{var} is not {what}; unset it or fix it") from None
    if type_name == "bool":
        word = raw.strip().lower()
        if word not in _BOOLEANS:
            raise ConfigError(f"{var} is not true or false; unset it or fix it")
        return _BOOLEANS[word]
    if type_name.startswith("tuple"):
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    if type_name.startswith("Mapping"):
        if raw.lstrip().startswith("{"):
            try:
                value = json.loads(raw)
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise ConfigError(f"{var} is not a JSON object; write KEY=VALUE,KEY=VALUE or {{\"KEY\": VALUE}}")
            return value
        return dict(parse_option(item.strip(), f"{ENV_PREFIX}{name.upper()}", "KEY=VALUE,KEY=VALUE")
                    for item in raw.split(",") if item.strip())
    return raw


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
