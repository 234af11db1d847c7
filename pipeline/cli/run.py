"""``run`` and ``nightly``: the options every run shares (``run_options``), a run's config, its progress and summary."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable

import click

from pipeline.cli.command import (
    ConfigDefault, LibraryCommand, catalog_option, catalog_values, key_values, model_option, storage_option,
)
from pipeline.cli.output import echo

NIGHTLY_PROGRESS_EVERY_S = 30.0


def _default(name: str) -> Any:
    """RunConfig's default of field ``name``, for the help texts."""
    from pipeline.config import RunConfig

    return RunConfig.__dataclass_fields__[name].default


def run_options() -> tuple[Callable, ...]:
    """The options every run takes, shared by `run` and `nightly` (sqlite-utils style): one list, no drift."""
    from pipeline.config import CPUS_PER_CPU_ACTOR, FETCH_AHEAD_PER_ACTOR, FETCH_AHEAD_PER_CPU_ACTOR
    from pipeline.engines.auto import CPU_CHOICE, GPU_CHOICE
    from pipeline.engines.base import DEFAULT_BATCH_SIZE
    from pipeline.engines.registry import AUTO_ENGINE, ENGINE_CHOICES, REGISTRY
    from pipeline.io.iceberg_output import DEFAULT_WAREHOUSE, ICEBERG_SCHEME
    from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE
    from pipeline.model.imaging import MAX_DECODE_THREADS
    from pipeline.schema import MIB
    from pipeline.storage import INVENTORY_FORM, URIS_FORM

    gpu_batch_sizes = "/".join(sorted({str(s.gpu_batch_size) for s in REGISTRY.values() if s.gpu_batch_size}))
    actors_per_gpu = "/".join(sorted({str(s.actors_per_gpu) for s in REGISTRY.values() if s.needs_gpu}))
    return (
        model_option(f"Model folder ({MODEL_FILE}, {LABELS_FILE}, {SPEC_FILE}); or NAME=DIR, repeated, for several "
                     "models in one pass, each written to its column NAME (NAME=default: the built-in model).",
                     multiple=True, metavar="[NAME=]DIR"),
        click.option("--engine", type=click.Choice(ENGINE_CHOICES), cls=ConfigDefault, default=None, show_default=_default("engine"), help=f"{AUTO_ENGINE}: {GPU_CHOICE} where the Ray cluster has GPUs, else {CPU_CHOICE}; " + "; ".join(f"{s.name}: {s.summary}" for s in REGISTRY.values()) + "."),
        click.option("--engine-option", "engine_options", multiple=True, metavar="KEY=VALUE", help="Engine-specific option, e.g. max_batch=8 (onnx) or repository=DIR (triton); repeatable; 'bulk-classify engines' lists them."),
        click.option("--top-k", type=int, cls=ConfigDefault, default=None, show_default=str(_default("top_k")), help="Labels kept per image."),
        click.option("--batch-size", type=int, cls=ConfigDefault, default=None, show_default=f"{gpu_batch_sizes} where the actors take GPUs, else {DEFAULT_BATCH_SIZE}", help="Images per engine call."),
        click.option("--shard-size", type=int, cls=ConfigDefault, default=None, show_default=str(_default("shard_size")), help="Rows per committed Parquet shard."),
        storage_option("fsspec option for the source, the output and the previous output, e.g. endpoint_url=http://127.0.0.1:9000; repeatable."),
        click.option("--overwrite", is_flag=True, default=None, help="Delete this tool's earlier files in the output and start over."),
        click.option("--extensions", cls=ConfigDefault, default=None, show_default=",".join(_default("extensions")), help="Comma-separated extensions to list."),
        click.option("--num-actors", type=int, cls=ConfigDefault, default=None, show_default=f"one per GPU, or CPUs/{CPUS_PER_CPU_ACTOR}", help="Classify actors."),
        click.option("--num-gpus-per-actor", type=float, cls=ConfigDefault, default=None, show_default=f"on a cluster with GPUs 1/{actors_per_gpu}, {actors_per_gpu} actors per GPU; else 0", help="GPUs each classify actor takes."),
        click.option("--calls-per-actor", type=int, cls=ConfigDefault, default=None, show_default=", ".join(f"{s.calls_per_actor} for {s.name}" for s in REGISTRY.values()), help="Engine calls each classify actor runs at once."),
        click.option("--fetch-threads", type=int, cls=ConfigDefault, default=None, show_default=str(_default("fetch_threads")), help="Concurrent reads per fetch task."),
        click.option("--decode-threads", type=int, cls=ConfigDefault, default=None, show_default=f"the CPU count, at most {MAX_DECODE_THREADS}", help="Decode threads per actor, for engines that decode in the actor."),
        click.option("--max-bytes", type=int, cls=ConfigDefault, default=None, show_default=f"{_default('max_bytes') // MIB} MiB", help="Largest encoded image accepted, in bytes."),
        click.option("--max-pixels", type=int, cls=ConfigDefault, default=None, show_default=f"{_default('max_pixels') // 1_000_000}M", help="Largest width*height accepted, read from the header."),
        click.option("--retries", type=int, cls=ConfigDefault, default=None, show_default=str(_default("retries")), help="Retries of a transient storage error per object."),
        click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on 127.0.0.1:PORT while running (0 = any free port)."),
        click.option("--fetch-ahead-bytes", type=int, cls=ConfigDefault, default=None, show_default=f"{FETCH_AHEAD_PER_CPU_ACTOR // MIB} MiB per CPU classify actor, {FETCH_AHEAD_PER_ACTOR // MIB} MiB per GPU actor", help="Cap on bytes fetched but not yet classified (Ray object store)."),
        click.option("--list-tasks", type=int, cls=ConfigDefault, default=None, show_default=str(_default("list_tasks")), help="Listing tasks at once, the bound on outstanding LIST calls."),
        click.option("--follow-symlinks", is_flag=True, default=None, help="Follow local symbolic links that lead out of SOURCE (links inside it are listed by their targets' own paths either way)."),
        click.option("--source-prefix", default=None, metavar="URI", help=f"With a {URIS_FORM} or {INVENTORY_FORM} SOURCE: only the objects under this, by whole path segments (s3://bucket/photos keeps photos/…, not photos2/…)."),
        catalog_option(f"Iceberg catalog property for an {ICEBERG_SCHEME}NAMESPACE.TABLE output or previous, e.g. warehouse=DIR (the embedded SQLite catalog, default ./{DEFAULT_WAREHOUSE}) or uri=… type=rest; repeatable."),
        click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary."),
    )


def _run_fields(options: dict[str, Any]) -> dict[str, Any]:
    """run_options' values as RunConfig fields (None: not given); ``quiet`` is the CLI's and is removed."""
    options.pop("quiet", None)
    fields = dict(options)
    fields["storage_options"] = key_values(options.get("storage_options") or ())
    fields["engine_options"] = key_values(options.get("engine_options") or (), "--engine-option", "max_batch=8")
    fields["catalog_options"] = catalog_values(options.get("catalog_options") or ())
    fields["model"] = tuple(options.get("model") or ()) or None  # one folder, or NAME=DIR items: RunConfig reads both
    extensions = options.get("extensions")
    if extensions is not None:
        fields["extensions"] = tuple(e.strip() for e in extensions.split(",") if e.strip())
    return fields


class _Progress:
    """A tqdm bar on a terminal (images done of total, img/s, errors); silent otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def __call__(self, done: int, total: int | None, errors: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:  # opened at the first result, below Ray's start-up lines
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="img", dynamic_ncols=True, file=sys.stderr, desc="classified")
        if total is not None and total != self.bar.total:
            self.bar.total = max(total, done)
        self.bar.update(done - self.bar.n)
        self.bar.set_postfix(errors=errors, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def _ray_output_to_stderr():
    """Ray prints its own messages to stdout (raylet errors such as "A worker died or was killed", forwarded
    worker output); stdout is this command's report, so they go to stderr, Ray's shutdown (by the library, which
    stops the Ray it starts) included."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _run_command_options() -> tuple[Callable, ...]:
    from pipeline.io.iceberg_output import ICEBERG_SCHEME

    return (
        click.argument("source"),
        click.option("-o", "--output", required=True, help=f"Folder or URL (s3://bucket/prefix) for the Parquet output, or an Iceberg table: {ICEBERG_SCHEME}NAMESPACE.TABLE."),
        click.option("--previous", default=None, help="An earlier run's output (a folder or an Iceberg table): unchanged objects are carried over, not reclassified."),
        *run_options(),
    )


@click.command(cls=LibraryCommand, options=_run_command_options)
def run(source: str, quiet: bool, **options: Any) -> None:
    """Classify every image under SOURCE into Parquet under --output (resumes where it stopped).

    SOURCE is a folder or prefix (listed), uris+FILE (a text, CSV or Parquet list of URIs) or
    inventory+s3://…/manifest.json (an S3 Inventory report).

    \b
    Exit status: 0 done, 1 an error (the message says the fix), 4 SOURCE holds nothing to classify.
    """
    from pipeline.config import RunConfig

    config = RunConfig.build(dict(_run_fields(options), source=source))
    from pipeline.job import run_job
    from pipeline.quality.report import format_run_report
    from pipeline.schema import STATUS_ERROR, STATUS_OK

    progress = _Progress(enabled=not quiet and sys.stderr.isatty())
    try:
        with _ray_output_to_stderr():
            summary = run_job(config, progress=progress)
    finally:
        progress.close()
    if not quiet:
        echo(format_run_report(summary.report))
        echo(
            f"{summary.total} rows in {summary.output}: {summary.counts.get(STATUS_OK, 0)} ok, "
            f"{summary.counts.get(STATUS_ERROR, 0)} error; this run classified {summary.classified}, "
            f"carried {summary.carried}, found {summary.already_done} already done, in {summary.elapsed_s:.1f}s"
        )


def _nightly_command_options() -> tuple[Callable, ...]:
    from pipeline.nightly import PREVIOUS_AUTO, PREVIOUS_NONE

    return (
        click.option("--config", "config_file", default=None, metavar="FILE", help="YAML file with any of these options, with _ for - (flags win)."),
        click.option("--source", default=None, help="Folder or URL to classify, e.g. s3://bucket/prefix."),
        click.option("--output-root", default=None, help="Folder or URL that receives date=YYYY-MM-DD/ folders."),
        click.option("--date", cls=ConfigDefault, default=None, show_default="today in UTC", help="YYYY-MM-DD to scan."),
        click.option("--previous", cls=ConfigDefault, default=None, show_default=PREVIOUS_AUTO, help=f"'{PREVIOUS_AUTO}' (the latest earlier completed date), '{PREVIOUS_NONE}', or a URL."),
        click.option("--no-previous", is_flag=True, help=f"Classify everything: carry nothing over from an earlier date (= --previous {PREVIOUS_NONE})."),
        *run_options(),
    )


@click.command(cls=LibraryCommand, options=_nightly_command_options)
def nightly(config_file: str | None, quiet: bool, no_previous: bool, **options: Any) -> None:
    """Scan SOURCE into <output-root>/date=YYYY-MM-DD/: once per date, resumable, carrying unchanged objects over.

    \b
    Exit status: 0 done or already complete, 2 bad options or storage (the message says the fix), 1 a crash.
    """
    from pipeline.nightly import format_scan, nightly_scan

    scan = nightly_options(config_file, no_previous, options)
    with _ray_output_to_stderr():
        result = nightly_scan(scan, progress=None if quiet else _nightly_progress())
    echo(format_scan(result, report=not quiet))


def nightly_options(config_file: str | None, no_previous: bool, options: dict[str, Any]) -> dict[str, Any]:
    """The scan's options from the command line's values (``None``: not given) over the YAML file's."""
    from pipeline.nightly import PREVIOUS_NONE, collect_options

    fields = _run_fields(dict(options))
    if no_previous:
        fields["previous"] = PREVIOUS_NONE
    return collect_options(config_file, fields)


def _nightly_progress(every_s: float = NIGHTLY_PROGRESS_EVERY_S) -> Callable[[int, "int | None", int], None]:
    """A progress line every ``every_s`` seconds: the job logs of `ray job submit` are not a terminal."""
    last = [0.0]

    def show(done: int, total: int | None, errors: int) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            echo(f"progress: {done}/{total if total is not None else '?'} rows, {errors} errors")

    return show
