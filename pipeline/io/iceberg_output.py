"""An Iceberg table as the output: the catalog, the table's shard folder, and committing shards exactly once.

``--output iceberg://NAMESPACE.TABLE`` writes the run's shards as any output does, into the table's data folder
(``<table location>/data``, which also holds the run's lease and bookkeeping files), then commits every shard there
that the table's current snapshot does not hold yet with ``add_files``, in one snapshot that carries the run's
identity in its properties. A run killed before that commit leaves shards the rerun resumes from and commits with
its own: no shard is lost or added twice, and a rerun of a completed run adds no snapshot. ``iceberg://NS.TABLE@ID``
reads snapshot ``ID`` (``@parent``: the one before the current snapshot), for ``report`` and the drift gate.

The table has the run's schema (``RunPlan.schema``: one model's columns, or a struct column per model of a set).
An ``embedding`` column is a ``list<float>`` in the shards (``pipeline.columns.EMBEDDING_TYPE``) and in the table.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import pyarrow as pa

from pipeline.columns import output_schema_like
from pipeline.errors import ConfigError, OutputError
from pipeline.storage import open_fs

LOG = logging.getLogger(__name__)
ICEBERG_SCHEME = "iceberg://"
CATALOG_NAME = "bulk_classify"  # pyiceberg's configuration (.pyiceberg.yaml, PYICEBERG_CATALOG__BULK_CLASSIFY__*)
DEFAULT_WAREHOUSE = "iceberg-warehouse"  # the embedded catalog's folder, under the working directory
CATALOG_DB = "catalog.db"
DATA_FOLDER = "data"
PARENT = "parent"
RUN_PROPERTY = "bulk-classify.run"  # snapshot properties: the run that committed it
SHARDS_PROPERTY = "bulk-classify.shards"
_NAME_RE = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9_.]*)\.([A-Za-z0-9_]+)(?:@(\d+|" + PARENT + r"))?$")


def is_iceberg(url: str | None) -> bool:
    return bool(url) and url.startswith(ICEBERG_SCHEME)


@dataclass(frozen=True)
class TableRef:
    """``iceberg://NAMESPACE.TABLE[@SNAPSHOT]`` parsed: the namespace, the table and the snapshot (None: current)."""

    namespace: str
    name: str
    snapshot: str | None = None

    @classmethod
    def parse(cls, url: str) -> "TableRef":
        match = _NAME_RE.match(url[len(ICEBERG_SCHEME):])
        if match is None:
            raise ConfigError(f"{url!r} is not an Iceberg table; write iceberg://NAMESPACE.TABLE (letters, digits, "
                              f"'_'), optionally @SNAPSHOT_ID or @{PARENT} to read an earlier snapshot")
        return cls(*match.groups())

    @property
    def identifier(self) -> str:
        return f"{self.namespace}.{self.name}"


def catalog_properties(options: Mapping[str, Any] | None) -> dict[str, str]:
    """The catalog's properties: ``options`` (``--catalog-option``) over pyiceberg's own configuration of the
    ``bulk_classify`` catalog; with neither a ``uri`` nor a ``type``, the embedded SQL catalog on SQLite in
    ``warehouse`` (default: ./iceberg-warehouse), which needs no server."""
    try:
        from pyiceberg.utils.config import Config
    except ImportError:
        raise ConfigError("an iceberg:// output needs pyiceberg: pip install 'bulk-classify[iceberg]'") from None

    merged = {**(Config().get_catalog_config(CATALOG_NAME) or {}), **{k: str(v) for k, v in (options or {}).items()}}
    if "uri" in merged or "type" in merged:
        return merged
    warehouse = merged.pop("warehouse", DEFAULT_WAREHOUSE)
    local = warehouse.removeprefix("file://")
    if "://" in local:
        raise ConfigError(f"--catalog-option warehouse={warehouse}: the embedded catalog keeps its SQLite file in a "
                          "local folder; give a folder, or a catalog uri (and type) for a remote warehouse")
    local = os.path.abspath(local)
    os.makedirs(local, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{local}/{CATALOG_DB}", "warehouse": f"file://{local}", **merged}


def load_catalog(options: Mapping[str, Any] | None) -> Any:
    from pyiceberg.catalog import load_catalog as load

    properties = catalog_properties(options)
    try:
        return load(CATALOG_NAME, **properties)
    except Exception as err:  # noqa: BLE001 - a catalog that cannot be reached is the user's to fix
        raise OutputError(f"cannot open the Iceberg catalog ({properties.get('uri')}): {type(err).__name__}: "
                          f"{err}; check --catalog-option uri=… and the catalog's credentials") from None


def schema_shape(schema: pa.Schema) -> tuple:
    """``schema``'s column names and types as an Iceberg table holds them, for comparing a table with a run: string
    and list sizes dropped (pyiceberg reads large ones), a fixed-size list as a list (Iceberg has none), no field
    ids or nullability."""
    return tuple((f.name, _type_shape(f.type)) for f in schema)


def _type_shape(t: pa.DataType) -> Any:
    if pa.types.is_struct(t):
        return ("struct", tuple((t.field(i).name, _type_shape(t.field(i).type)) for i in range(t.num_fields)))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return ("list", _type_shape(t.value_type))
    if pa.types.is_large_string(t):
        return str(pa.string())
    return str(t)


def describe(schema: pa.Schema) -> str:
    """A schema's columns in one short line: each model's struct column as ``name{…}``."""
    return ", ".join(f"{f.name}{{…}}" if pa.types.is_struct(f.type) else f.name for f in schema)


class IcebergOutput:
    """An Iceberg table an output URL names, created with the run's schema only at the first commit.

    ``schema``: the run's (``RunPlan.schema``), which an existing table must have; None for a reader, which takes a
    table of any of this tool's schemas (one model's, or a model set's)."""

    def __init__(self, url: str, catalog_options: Mapping[str, Any] | None = None, schema: pa.Schema | None = None):
        self.url, self.ref = url, TableRef.parse(url)
        self.schema = schema
        self.catalog = load_catalog(catalog_options)
        self.table = self._load()

    def _load(self) -> Any:
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

        try:
            table = self.catalog.load_table(self.ref.identifier)
        except (NoSuchTableError, NoSuchNamespaceError):
            return None

        self.check_schema(table)
        return table

    def expect(self, schema: pa.Schema) -> None:
        """Take ``schema`` as the run's (the table's at its first commit); OutputError for an existing table whose
        columns are another's."""
        self.schema = schema
        if self.table is not None:
            self.check_schema(self.table)

    def check_schema(self, table: Any) -> None:
        """OutputError, in one line, unless ``table`` has the run's schema or (without one) any of this tool's."""
        held = table.schema().as_arrow()
        wanted = self.schema if self.schema is not None else output_schema_like(held)
        if schema_shape(held) == schema_shape(wanted):
            return
        whose = "this run's" if self.schema is not None else "this tool's"
        raise OutputError(f"Iceberg table {self.ref.identifier} has the columns {describe(held)}, not {whose} "
                          f"({describe(wanted)}): it holds another model or model set's rows (a table's columns are "
                          "fixed by its first run); choose another table for --output")

    @property
    def location(self) -> str:
        """The table's location: where the catalog put it, or will put it at the first commit."""
        if self.table is not None:
            return self.table.location()
        # The namespace is made here, not the table: its location is the one the table will get.
        self.catalog.create_namespace_if_not_exists(self.ref.namespace)
        return self.catalog._resolve_table_location(None, self.ref.namespace, self.ref.name).rstrip("/")

    @property
    def data_folder(self) -> str:
        """The folder that receives the shards (and the run's lease and bookkeeping files)."""
        return f"{self.location.rstrip('/')}/{DATA_FOLDER}"

    def snapshot_id(self) -> int | None:
        """The snapshot ``@…`` names, else the current one; None for a table with none yet."""
        if self.table is None:
            return None
        current = self.table.current_snapshot()
        if self.ref.snapshot is None or current is None:
            return None if current is None else current.snapshot_id
        if self.ref.snapshot == PARENT:
            if current.parent_snapshot_id is None:
                raise OutputError(f"{self.url}: the current snapshot has no parent; give a snapshot id")
            return current.parent_snapshot_id
        wanted = int(self.ref.snapshot)
        if self.table.snapshot_by_id(wanted) is None:
            ids = [s.snapshot_id for s in self.table.metadata.snapshots][-5:]
            raise OutputError(f"{self.url}: no snapshot {wanted}; the table's latest ones are {ids}")
        return wanted

    def files(self, snapshot_id: int | None = None) -> list[str]:
        """The data files of a snapshot (default: the one the URL names), as the catalog records them (URIs)."""
        sid = self.snapshot_id() if snapshot_id is None else snapshot_id
        if sid is None:
            return []
        return sorted(task.file.file_path for task in self.table.scan(snapshot_id=sid).plan_files())

    def commit(self, fs: Any, parts: list[str], run: Mapping[str, str]) -> int:
        """Add every shard of ``parts`` (paths on ``fs``) that the current snapshot lacks, in one snapshot with
        ``run`` in its properties; the shards added (0: no snapshot)."""
        held = set(self.files()) if self.table is not None and self.ref.snapshot is None else set()
        new = [uri for uri in (fs.unstrip_protocol(p) for p in parts) if uri not in held]
        if not new:
            return 0
        if self.table is None:
            if self.schema is None:
                raise ValueError("IcebergOutput.commit creates the table with the run's schema: call "
                                 "expect(RunPlan.schema) first")
            self.table = self.catalog.create_table_if_not_exists(self.ref.identifier, schema=self.schema,
                                                                 location=self.location)
        properties = {**{f"bulk-classify.{k}": str(v) for k, v in run.items()}, SHARDS_PROPERTY: str(len(new))}
        try:
            self.table.add_files(file_paths=new, snapshot_properties=properties, check_duplicate_files=False)
        except Exception as err:  # noqa: BLE001 - a refused commit changes nothing: the rerun commits these shards
            text = f"{type(err).__name__}: {err}".replace("\n", " ")[:300]
            raise OutputError(f"cannot commit {len(new)} shards to Iceberg table {self.ref.identifier}: {text}; "
                              "fix the catalog, then rerun (it resumes and commits them)") from None
        LOG.info("committed %d shards to %s in snapshot %s", len(new), self.ref.identifier,
                 self.table.current_snapshot().snapshot_id)
        return len(new)


def table_parts(url: str, catalog_options: Mapping[str, Any] | None, storage_options: Mapping[str, Any] | None
                ) -> tuple[Any, str, list[str]]:
    """``(fs, data folder, shard paths)`` of the snapshot an ``iceberg://`` URL names, for readers of an output."""

    output = IcebergOutput(url, catalog_options)
    if output.table is None:
        raise OutputError(f"Iceberg table {output.ref.identifier} does not exist; check the name and "
                          "--catalog-option")
    fs, root = open_fs(output.data_folder, storage_options)
    return fs, root, [fs._strip_protocol(uri) for uri in output.files()]
