"""``repo build|check|prepare``: build, check and put in place Triton model repositories."""

from __future__ import annotations

import logging
from typing import Callable

import click

from pipeline.cli.command import ConfigDefault, LibraryGroup, model_option
from pipeline.cli.output import echo


@click.group(cls=LibraryGroup)
def repo() -> None:
    """Build and check Triton model repositories."""


def _build_options() -> tuple[Callable, ...]:
    from pipeline.schema import DEFAULT_TOP_K
    from pipeline.triton.profiles import PORTABLE
    from pipeline.triton.repository import REPOSITORY_PROFILES

    return (
        click.option("--profile", type=click.Choice(tuple(REPOSITORY_PROFILES)), default=PORTABLE, show_default=True, help="Which repository profile to fill."),
        model_option("Model folder."),
        click.option("--output", required=True, help="Folder to write the filled repository to."),
        click.option("--top-k", type=int, default=DEFAULT_TOP_K, show_default=True, help="Classes each response carries (the engine's --top-k must not exceed it)."),
        click.option("--instances", type=int, cls=ConfigDefault, default=None, show_default="the profile's", help="Model instances per server."),
        click.option("--max-batch-size", type=int, default=None, help="Largest batch the server forms (and the TensorRT profile's max)."),
        click.option("--max-backlog", type=float, cls=ConfigDefault, default=None, show_default="the profile's, docs/gpu.md", help="gpu profile: network batches one instance takes before its execute() waits (0: never)."),
    )


@repo.command("build", options=_build_options)
def repo_build(profile: str, model: str | None, output: str, top_k: int, instances: int | None,
               max_batch_size: int | None, max_backlog: float | None) -> None:
    """Fill a repository profile's artifacts (ONNX, DALI pipeline, TensorRT plan where TensorRT is installed)."""
    from pipeline.triton.repository import build_repository

    path = build_repository(profile, model, output, top_k=top_k, instances=instances,
                            max_batch_size=max_batch_size, max_backlog=max_backlog)
    echo(f"built {profile} repository in {path}")


@repo.command("check", options=lambda: (click.argument("path", required=False),))
def repo_check(path: str | None) -> None:
    """Check repositories: PATH (a repository or a folder of profiles), else every profile this package generates."""
    from pipeline.triton.checks import check_repository

    models = check_repository(path)
    echo(f"ok: {len(models)} models checked ({', '.join(models)})")


def _prepare_options() -> tuple[Callable, ...]:
    from pipeline.config import ENV_PREFIX
    from pipeline.schema import DEFAULT_TOP_K
    from pipeline.triton.configs import DEFAULT_MAX_BATCH_SIZE
    from pipeline.triton.prepare import DEFAULT_REPOSITORY

    return (
        click.option("--repository", envvar=f"{ENV_PREFIX}REPOSITORY", show_envvar=True, default=DEFAULT_REPOSITORY, show_default=True, help="Where the repository goes."),
        model_option("Model folder.", envvar=f"{ENV_PREFIX}MODEL", show_envvar=True),
        click.option("--plan-cache", envvar=f"{ENV_PREFIX}PLAN_CACHE", show_envvar=True, default=None, help="fsspec URL of built repositories per GPU kind, e.g. s3://bucket/trt-plans."),
        click.option("--top-k", envvar=f"{ENV_PREFIX}TOP_K", show_envvar=True, type=int, default=DEFAULT_TOP_K, show_default=True, help="Classes each response carries."),
        click.option("--max-batch-size", envvar=f"{ENV_PREFIX}MAX_BATCH_SIZE", show_envvar=True, type=int, default=DEFAULT_MAX_BATCH_SIZE, show_default=True, help="The TensorRT profile's largest batch."),
    )


@repo.command("prepare", options=_prepare_options)
def repo_prepare(repository: str, model: str | None, plan_cache: str | None, top_k: int, max_batch_size: int) -> None:
    """Put a production repository for this node's GPU and TensorRT in place: keep, fetch from the cache, or build."""
    from pipeline.triton.prepare import prepare

    logging.getLogger().setLevel(logging.INFO)  # the pod log shows what it did and how long it took
    done = prepare(repository, model or None, plan_cache=plan_cache or None, top_k=top_k,
                   max_batch_size=max_batch_size)
    echo(f"repo prepare: {done['action']} {done['cache_name']}")
