"""A model set: several named models run in one pass (``--model taxonomy=DIR --model safety=DIR2``), each writing
its own struct column of the output, named by its name (docs/output.md, "Several models").

The set has an identity like one model's: its ``name`` (the names, in the order given) and its ``digest`` (of every
name and model digest, whatever their order), which the rows, the records, resume and carry-over use as they use one
model's.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from pipeline.errors import ConfigError
from pipeline.schema import OUTPUT_SCHEMA

if TYPE_CHECKING:
    from pipeline.model.folder import ModelBundle

# A name is a column name every reader takes unquoted: Parquet, DuckDB, Iceberg, SQL.
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,62}")
NAME_RULE = "a lowercase letter, then lowercase letters, digits or _ (at most 63), e.g. taxonomy or safety_v2"
# The output's own columns, which a model's column may not shadow.
RESERVED = frozenset(OUTPUT_SCHEMA.names) | {"embedding"}
SET_DIGEST_VERSION = 1


def split_model_arg(value: str) -> tuple[str | None, str]:
    """``NAME=DIR`` as (NAME, DIR); a value without ``=`` before any path separator is (None, DIR): one unnamed
    model, as ``--model DIR`` has always meant."""
    name, sep, ref = value.partition("=")
    if not sep or "/" in name or "\\" in name or not name:
        return None, value
    return name, ref


def named_models(model: str | tuple[str, ...] | None) -> tuple[tuple[str, str], ...]:
    """A run's ``model`` (``RunConfig.model``: a tuple of ``NAME=DIR`` for a set) as (name, folder) pairs, in the order
    given; empty for one unnamed model."""
    return parse_model_args(model)[1] if isinstance(model, tuple) else ()


def parse_model_args(values: Sequence[str]) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """The ``--model`` values as (one unnamed model's ref, or None; the named ones as (name, ref) pairs).

    Raises:
        ConfigError: a bad or repeated name, an unnamed model beside others, an empty ref; one line with the fix.
    """
    parsed = [split_model_arg(str(v)) for v in values]
    if len(parsed) == 1 and parsed[0][0] is None:
        return parsed[0][1], ()
    named: list[tuple[str, str]] = []
    for name, ref in parsed:
        if name is None:
            raise ConfigError(f"--model {ref!r} has no name beside other models; name each model of a set, e.g. "
                              f"--model taxonomy={ref} --model safety=DIR2")
        check_name(name)
        if not ref:
            raise ConfigError(f"--model {name}= names no model; write --model {name}=DIR (or {name}=default)")
        if name in (n for n, _ in named):
            raise ConfigError(f"--model {name}= is given twice; each model of a set needs a name of its own")
        named.append((name, ref))
    return None, tuple(named)


def check_name(name: str) -> None:
    """ConfigError unless ``name`` may name a model's column."""
    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"--model {name}=…: {name!r} is not a column name; use {NAME_RULE}")
    if name in RESERVED:
        raise ConfigError(f"--model {name}=…: {name!r} is one of the output's own columns; choose another name")


@dataclass(frozen=True)
class NamedModel:
    """One model of a set: its name (its output column) and its loaded folder."""

    name: str
    bundle: ModelBundle


@dataclass(frozen=True)
class ModelSet:
    """The models of one pass, in the order given (their columns' order)."""

    models: tuple[NamedModel, ...]

    @property
    def name(self) -> str:
        """The names, comma-separated: the rows' ``model``."""
        return ",".join(m.name for m in self.models)

    @property
    def digest(self) -> str:
        """sha256 (hex) of each name and its model's digest, sorted by name: the rows' ``model_digest``."""
        h = hashlib.sha256(f"bulk-classify model set v{SET_DIGEST_VERSION}\n".encode())
        for m in sorted(self.models, key=lambda m: m.name):
            h.update(f"{m.name}={m.bundle.digest}\n".encode())
        return h.hexdigest()

    @property
    def short_digest(self) -> str:
        return self.digest[:12]

    @property
    def bundles(self) -> tuple[ModelBundle, ...]:
        return tuple(m.bundle for m in self.models)

    @property
    def num_classes(self) -> int:
        """The most classes of any model: the set's top-k cap (each model caps its own at its classes)."""
        return max(m.bundle.num_classes for m in self.models)

    def columns(self) -> tuple[tuple[str, int | None], ...]:
        """(name, embedding width or None) per model: what ``pipeline.columns.output_schema`` lays out."""
        return tuple((m.name, m.bundle.spec.embedding.dim if m.bundle.spec.embedding else None) for m in self.models)
