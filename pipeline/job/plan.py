"""The run decided once, before Ray starts or DEST is touched: the engine (``auto`` resolved) and its spec, its options
parsed, the batch size, local Ray or a cluster and its GPUs, the model loaded and checked, and the opened stores, in
one frozen ``RunPlan`` (the actors' shares of the cluster are decided once Ray is up:
``pipeline.job.stages.plan_shares``). The stages, the actors and the output module take the plan, never the raw
options."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import pyarrow as pa

from pipeline.columns import output_schema
from pipeline.config import RunConfig
from pipeline.engines.registry import AUTO_ENGINE, engine_spec
from pipeline.errors import ConfigError
from pipeline.io.iceberg_output import IcebergOutput, is_iceberg, table_parts
from pipeline.job.output import Store, check_compatible, check_output, check_output_location, open_store
from pipeline.node import local_ray_env, node_gpus, ray_address
from pipeline.schema import OUTPUT_SCHEMA

if TYPE_CHECKING:
    from pipeline.engines.base import EngineSpec
    from pipeline.model.folder import ModelBundle
    from pipeline.model.model_set import ModelSet

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineChoice:
    """The engine a run takes, decided before any storage is read.

    Attributes:
        config: the options with ``auto`` resolved to an engine, the batch size filled in and the engine options
            parsed (typed, checked).
        spec: the resolved engine's ``EngineSpec``.
        gpus: (GPUs, where they were counted) of the cluster the job runs on, counted once for ``auto`` and the GPU
            engines (their batch size, model check and actors' environment); None: a CPU engine, not counted.
        ray_address: the cluster the job joins (``RAY_ADDRESS``); None: a local Ray the job starts.
    """

    config: RunConfig
    spec: EngineSpec
    gpus: tuple[int, str] | None
    ray_address: str | None


@dataclass(frozen=True)
class RunPlan:
    """What a run is, decided before anything is written or Ray starts.

    Attributes:
        config: the options as ``EngineChoice.config``, with ``top_k`` capped at the model's classes and an
            ``iceberg://`` output or previous replaced by its table's data folder.
        spec: the resolved engine's ``EngineSpec``.
        bundle: the model, loaded and checked (its contract and the engine's own refusals); of a model set, its first.
        models: the model set (``--model NAME=DIR`` items), each loaded and checked like ``bundle``; None: one
            unnamed model.
        engine_options: the options the engine is built with: ``config.engine_options`` (parsed) and
            ``--decode-threads`` in the option the engine registered for it.
        ray_address: the cluster the job joins (``RAY_ADDRESS``); None: a local Ray the job starts.
        gpus: as ``EngineChoice.gpus``.
        output_url: the output as the user named it (an ``iceberg://`` table, or the folder).
        source, output, previous: the opened stores (previous None: nothing is carried over).
        table: the output's Iceberg table (None: a folder output); previous_parts: the previous table's current
            shards (None: a folder, listed as usual).
    """

    config: RunConfig
    spec: EngineSpec
    bundle: ModelBundle
    engine_options: Mapping[str, Any]
    ray_address: str | None
    output_url: str
    source: Store
    output: Store
    previous: Store | None = None
    table: IcebergOutput | None = None
    previous_parts: list[str] | None = None
    gpus: tuple[int, str] | None = None
    models: ModelSet | None = None

    @property
    def identity(self) -> ModelBundle | ModelSet:
        """Whose rows these are (``name``, ``digest``): the model's, or the model set's."""
        return self.models if self.models is not None else self.bundle

    @property
    def more(self) -> tuple[ModelBundle, ...]:
        """A model set's models after the first, which the engine runs beside ``bundle``."""
        return self.models.bundles[1:] if self.models is not None else ()

    @property
    def schema(self) -> pa.Schema:
        """The output's schema: one unnamed model's columns, or one struct column per model of the set."""
        if self.models is not None:
            return output_schema(self.models.columns())
        embedding = self.bundle.spec.embedding
        return output_schema(((None, embedding.dim),)) if embedding else OUTPUT_SCHEMA

    @property
    def local(self) -> bool:
        """Whether the job starts its own Ray on this machine."""
        return self.ray_address is None


def engine_of(engine: str, gpus: tuple[int, str] | None = None) -> EngineSpec:
    """The ``EngineSpec`` of ``engine``: the one it names, or the one ``auto`` runs on ``gpus`` ((GPUs, where they
    were counted); ``pipeline.engines.auto.choose``). ConfigError lists the engines for an unknown name."""
    if engine == AUTO_ENGINE:
        from pipeline.engines.auto import choose  # noqa: PLC0415

        engine = choose(*gpus).engine
    return engine_spec(engine)


def resolved(config: RunConfig, spec: EngineSpec, options: Mapping[str, Any], gpus: tuple[int, str] | None
             ) -> RunConfig:
    """``config`` run by ``spec`` with the parsed ``options`` and its batch size filled in by the ``gpus`` counted."""
    batch = config.batch_size or spec.default_batch_size(gpus[0] if gpus else 0)
    return config.revised(engine=spec.name, batch_size=batch, engine_options=dict(options))


def resolve(config: RunConfig, gpus: int, where: str = "this machine") -> tuple[RunConfig, EngineSpec]:
    """``config`` resolved as a run would resolve it on a cluster of ``gpus`` GPUs, counted ``where``, and its engine's
    spec, without a preflight or a count (what ``bulk-classify size``, the tests and the benchmarks ask)."""
    spec = engine_of(config.engine, (gpus, where))
    return resolved(config, spec, spec.parse_options(config.engine_options), (gpus, where)), spec


def choose_engine(config: RunConfig) -> EngineChoice:
    """The engine's options parsed and its preflight, then ``auto`` resolved to an engine and the batch size filled
    in, by the GPUs of the cluster the job runs on. Reads no storage.

    The cluster is ``pipeline.node.ray_address()``'s (asked here, once); None: a local Ray. The preflight runs in this
    driver only for a local Ray: a cluster's nodes must meet it.
    """
    address = ray_address()
    local = address is None
    if local:
        local_ray_env()  # before anything imports ray: Ray reads its loopback switch then
    named, options = preflight(config, address)  # before the GPUs are counted: a bad engine fails in a second
    gpus = None
    if named is None or named.needs_gpu:  # counted once: the engine, its batch size, model check and actors use it
        from pipeline.engines.auto import cluster_gpus  # noqa: PLC0415 - ray, only with a cluster's address

        gpus = cluster_gpus(address)
    spec = named if named is not None else engine_of(config.engine, gpus)
    if local and named is None:
        spec.check(options)
    return EngineChoice(config=resolved(config, spec, options, gpus), spec=spec, gpus=gpus, ray_address=address)


def preflight(config: RunConfig, address: str | None) -> tuple[EngineSpec | None, dict[str, Any]]:
    """``config``'s engine's ``EngineSpec`` (None for ``auto``, an engine only once the GPUs are counted) and its
    options parsed, the one parse of them; its preflight (torch, tritonserver, a repository) run on this machine where
    the job starts a local Ray (``address`` None). On a cluster its nodes, not this driver, must meet it."""
    if config.engine == AUTO_ENGINE:
        return None, {}  # auto takes no options (RunConfig refuses them)
    spec = engine_of(config.engine)
    options = spec.parse_options(config.engine_options)
    if address is None:
        spec.check(options)
    return spec, options


def make_plan(config: RunConfig | EngineChoice, *, output: Store | None = None) -> RunPlan:
    """Everything a run decides before Ray starts or DEST is touched: the engine (``choose_engine``, unless
    ``config`` is its choice already), then the stores opened (``output``: DEST already opened by the caller) and
    checked, and the model loaded and checked against the engine and DEST, read-only.
    """
    from pipeline.io.source import check_source  # noqa: PLC0415

    choice = config if isinstance(config, EngineChoice) else choose_engine(config)
    config, spec = choice.config, choice.spec
    output_url = config.output
    table = None
    if is_iceberg(config.output):
        table = IcebergOutput(config.output, config.catalog_options)
        config = config.revised(output=table.data_folder)
    config, previous, previous_parts = _open_previous(config)
    source = open_store(config.source, config.storage_options)
    if output is None or output.url != config.output:
        output = open_store(config.output, config.storage_options)
    check_output_location(source, output)  # an output that is the source or holds it: refused before anything else
    check_source(source.fs, source.root, config.source, config.extensions, follow_symlinks=config.follow_symlinks,
                 source_prefix=config.source_prefix)
    check_output(output.fs, output.root, config.output)
    config, bundle, models = _check_models(config, spec, choice.gpus)
    plan = RunPlan(config=config, spec=spec, bundle=bundle, models=models,
                   engine_options=spec.with_decode_threads(config.engine_options, config.decode_threads),
                   ray_address=choice.ray_address, output_url=output_url, source=source, output=output,
                   previous=previous, table=table, previous_parts=previous_parts, gpus=choice.gpus)
    if table is not None:  # a table of another model or set's columns: refused by its schema, before DEST is touched
        table.expect(plan.schema)
    check_compatible(output.fs, output.root, config.output, models or bundle, top_k=config.top_k,
                     overwrite=config.overwrite)
    return plan


def classifier_engine(engine: str, raw: Mapping[str, Any] | None, decode_threads: int | None
                      ) -> tuple[EngineSpec, dict[str, Any]]:
    """The engine ``pipeline.api.Classifier`` runs in its process and the options it is built with: ``auto`` resolved
    by the GPUs this process sees, the options parsed, the preflight run here."""
    spec = engine_of(engine, (node_gpus(), "this machine") if engine == AUTO_ENGINE else None)
    options = spec.with_decode_threads(spec.parse_options(raw or {}), decode_threads)
    spec.check(options)  # the engine's requirements on this node (torch, tritonserver, ...), in one line
    return spec, options


def _check_models(config: RunConfig, spec: EngineSpec, gpus: tuple[int, str] | None
                  ) -> tuple[RunConfig, ModelBundle, ModelSet | None]:
    """Each model's contract, as ``model check`` runs it (and the cache built once), and within it, before the
    network runs, the engine's own refusals (INT8, the gpu paths' network and layout); ``config`` with ``top_k``
    capped at the model's classes (a set's: its largest model's), which every engine, record and carry-over then
    uses; the first model, and the model set (None: one unnamed model)."""
    from pipeline.model.folder import top_k_note  # noqa: PLC0415 - Pillow: once the options are good
    from pipeline.model.model_set import ModelSet, NamedModel, named_models  # noqa: PLC0415

    named = named_models(config.model)
    if len(named) > 1 and not spec.several_models:
        raise ConfigError(f"--engine {spec.name} runs one model a pass; run a model set with --engine onnx, "
                          "openvino, gpu or triton (or the default), or one run per model")
    bundles = [_check_model(ref, config, spec, gpus) for _name, ref in named] or [
        _check_model(config.model, config, spec, gpus)]
    spec.check_models(bundles, config.engine_options, gpus)  # what the engine cannot serve together
    models = ModelSet(tuple(NamedModel(name, b) for (name, _), b in zip(named, bundles))) if named else None
    identity = models or bundles[0]
    if config.top_k > identity.num_classes:
        LOG.warning("%s", top_k_note(config.top_k, identity))
        config = config.revised(top_k=identity.num_classes)
    return config, bundles[0], models


def _check_model(ref: str | None, config: RunConfig, spec: EngineSpec, gpus: tuple[int, str] | None) -> ModelBundle:
    """One model's contract and the engine's refusals (``_check_models``)."""
    from pipeline.model.contract import check_contract  # noqa: PLC0415 - onnxruntime: once the options are good
    from pipeline.model.folder import fixed_batch_note  # noqa: PLC0415

    bundle = check_contract(ref, engine_check=lambda loaded: spec.check_model(loaded, config.engine_options, gpus))
    if bundle.fixed_batch:
        LOG.warning("%s", fixed_batch_note(bundle))
    return bundle


def _open_previous(config: RunConfig) -> tuple[RunConfig, Store | None, list[str] | None]:
    """``config`` with an ``iceberg://`` previous replaced by its table's data folder, the previous store and the
    table's current shards (None: a folder, listed as usual)."""
    if not config.previous:
        return config, None, None
    if not is_iceberg(config.previous):
        return config, open_store(config.previous, config.storage_options), None
    fs, root, parts = table_parts(config.previous, config.catalog_options, config.storage_options)
    config = config.revised(previous=fs.unstrip_protocol(root))
    return config, Store(config.previous, fs, root, dict(config.storage_options)), parts
