"""The run decided once, before Ray starts or DEST is touched: the config checked and resolved, the engine's spec,
local Ray or a cluster, and the opened stores (the actors' shares of the cluster are decided once Ray is up:
``pipeline.job.stages.plan_shares``). The stages and the output module take these, never the raw options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipeline.node import local_ray_env, ray_address
from pipeline.config import RunConfig
from pipeline.engines.registry import AUTO_ENGINE, engine_spec
from pipeline.io.iceberg_output import IcebergOutput, is_iceberg, table_parts
from pipeline.job.output import Store, check_output, check_output_location, open_store

ASK = object()  # choose_engine's address when the caller has not read it: ask pipeline.node.ray_address()


@dataclass(frozen=True)
class RunPlan:
    """What a run is, decided before anything is written or Ray starts.

    Attributes:
        config: the options with ``auto`` resolved to an engine, the batch size filled in, and an ``iceberg://``
            output or previous replaced by its table's data folder.
        spec: the resolved engine's ``EngineSpec``.
        ray_address: the cluster the job joins (``RAY_ADDRESS``); None: a local Ray the job starts.
        gpus: (GPUs, where they were counted) of the cluster the job runs on, counted once for ``auto`` and the GPU
            engines (their batch size, model check and actors' environment); None: a CPU engine, not counted.
        output_url: the output as the user named it (an ``iceberg://`` table, or the folder).
        source, output, previous: the opened stores (previous None: nothing is carried over).
        table: the output's Iceberg table (None: a folder output); previous_parts: the previous table's current
            shards (None: a folder, listed as usual).
    """

    config: RunConfig
    spec: Any
    ray_address: str | None
    output_url: str
    source: Store
    output: Store
    previous: Store | None = None
    table: IcebergOutput | None = None
    previous_parts: list[str] | None = None
    gpus: tuple[int, str] | None = None

    @property
    def local(self) -> bool:
        """Whether the job starts its own Ray on this machine."""
        return self.ray_address is None


def choose_engine(config: RunConfig, *, address: str | None | object = ASK
                  ) -> tuple[RunConfig, Any, tuple[int, str] | None]:
    """The engine's preflight, then ``auto`` resolved to an engine and the batch size filled in, by the GPUs of the
    cluster the job runs on: ``config`` resolved, its engine's ``EngineSpec``, and the GPU count it was resolved by
    ((GPUs, where they were counted); None for a CPU engine, which does not count them). Reads no storage.

    ``address``: the cluster's, as ``pipeline.node.ray_address()`` gives it (asked here by default); None: a local
    Ray. The preflight runs in this driver only for a local Ray: a cluster's nodes must meet it.
    """
    if address is ASK:
        address = ray_address()
    local = address is None
    if local:
        local_ray_env()  # before anything imports ray: Ray reads its loopback switch then
    given = preflight(config, address=address)  # before the GPUs are counted: a bad engine fails in a second
    gpus = None
    if given is None or given.needs_gpu:  # counted once: the engine, its batch size, model check and actors use it
        from pipeline.engines.auto import cluster_gpus  # noqa: PLC0415 - ray, only with a cluster's address

        gpus = cluster_gpus(address)
    # auto -> an engine, and the batch size (a CPU engine's does not depend on the cluster)
    config, spec = config.resolve(*gpus, spec=given) if gpus else config.resolve(spec=given)
    if local and given is None:
        spec.check(config.engine_options)
    return config, spec, gpus


def preflight(config: RunConfig, *, address: str | None | object = ASK) -> Any:
    """``config``'s engine's ``EngineSpec`` (None for ``auto``, an engine only once the GPUs are counted), its
    preflight (torch, tritonserver, a repository) run on this machine where the job starts a local Ray: ``address``
    None (asked by default). On a cluster its nodes, not this driver, must meet the requirements."""
    if address is ASK:
        address = ray_address()
    spec = None if config.engine == AUTO_ENGINE else engine_spec(config.engine)
    if address is None and spec is not None:
        spec.check(config.engine_options)
    return spec


def make_plan(config: RunConfig, *, spec: Any = None, gpus: tuple[int, str] | None = None,
              output: Store | None = None, address: str | None | object = ASK) -> RunPlan:
    """Everything a run decides before Ray starts or DEST is touched: the engine (``choose_engine``; with ``spec``,
    ``config`` is already resolved, ``spec`` its engine's and ``gpus`` the count it was resolved by), then the
    stores opened (``output``: DEST already opened by the caller) and checked, read-only. ``address``: the cluster's,
    as ``choose_engine`` was given it (asked here by default).
    """
    from pipeline.io.source import check_source  # noqa: PLC0415

    if address is ASK:
        address = ray_address()
    if spec is None:
        config, spec, gpus = choose_engine(config, address=address)
    output_url = config.output
    table = None
    if is_iceberg(config.output):
        table = IcebergOutput(config.output, config.catalog_options)
        config = dataclasses.replace(config, output=table.data_folder)
    config, previous, previous_parts = _open_previous(config)
    source = open_store(config.source, config.storage_options)
    if output is None or output.url != config.output:
        output = open_store(config.output, config.storage_options)
    check_output_location(source, output)  # an output that is the source or holds it: refused before anything else
    check_source(source.fs, source.root, config.source, config.extensions, follow_symlinks=config.follow_symlinks,
                 source_prefix=config.source_prefix)
    check_output(output.fs, output.root, config.output)
    return RunPlan(config=config, spec=spec, ray_address=address, output_url=output_url, source=source,
                   output=output, previous=previous, table=table, previous_parts=previous_parts, gpus=gpus)


def _open_previous(config: RunConfig) -> tuple[RunConfig, Store | None, list[str] | None]:
    """``config`` with an ``iceberg://`` previous replaced by its table's data folder, the previous store and the
    table's current shards (None: a folder, listed as usual)."""
    if not config.previous:
        return config, None, None
    if not is_iceberg(config.previous):
        return config, open_store(config.previous, config.storage_options), None
    fs, root, parts = table_parts(config.previous, config.catalog_options, config.storage_options)
    config = dataclasses.replace(config, previous=fs.unstrip_protocol(root))
    return config, Store(config.previous, fs, root, dict(config.storage_options)), parts
