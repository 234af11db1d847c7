"""The command line: parses options, builds the config, calls one library function, owns the terminal."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from typing import Any, Callable

import click

from pipeline import __version__
from pipeline.config import (
    CPUS_PER_CPU_ACTOR, ENV_PREFIX, FETCH_AHEAD_PER_ACTOR, FETCH_AHEAD_PER_CPU_ACTOR, RunConfig, parse_option,
)
from pipeline.engines.auto import CPU_CHOICE, GPU_CHOICE
from pipeline.engines.base import DEFAULT_BATCH_SIZE
from pipeline.engines.registry import AUTO_ENGINE, ENGINE_CHOICES, REGISTRY
from pipeline.errors import BulkClassifyError, EmptySourceError
from pipeline.int8.gate import GateThresholds
from pipeline.int8.quantize import (
    CALIBRATION_METHODS, DEFAULT_SAMPLES, DEFAULT_SEED, EXCLUDE_KEYWORDS, QUANT_FORMATS, QUANT_TYPES, SIDE_SUFFIX,
    GateFailed, QuantizeOptions,
)
from pipeline.io.iceberg_output import DEFAULT_WAREHOUSE, ICEBERG_SCHEME
from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE
from pipeline.model.imaging import MAX_DECODE_THREADS
from pipeline.model_check import DEFAULT_MAX_SCORE_DIFF, DEFAULT_MIN_AGREEMENT, DEFAULT_SAMPLE
from pipeline.model_import.core import (
    DEFAULT_MAX_LOGIT_DIFF, DEFAULT_MIN_AGREEMENT as IMPORT_MIN_AGREEMENT, DEFAULT_SAMPLE as IMPORT_SAMPLE, SOURCES,
    ImportOptions, ParityFailed,
)
from pipeline.nightly import PREVIOUS_AUTO, PREVIOUS_NONE
from pipeline.quality.statistics import DRIFT_EXIT_CODE, DriftThresholds
from pipeline.schema import DEFAULT_TOP_K, MIB, STATUS_ERROR, STATUS_OK
from pipeline.sizing import DEFAULT_SPARE, DEFAULT_UTILIZATION
from pipeline.storage import INVENTORY_FORM, URIS_FORM
from pipeline.terminal import quiet_ray
from pipeline.triton.configs import DEFAULT_MAX_BATCH_SIZE
from pipeline.triton.prepare import DEFAULT_REPOSITORY
from pipeline.triton.profiles import PORTABLE
from pipeline.triton.repository import REPOSITORY_PROFILES

NIGHTLY_PROGRESS_EVERY_S = 30.0
EMPTY_SOURCE_EXIT = 4  # `run` on a source with nothing to classify: a warning and this status, DEST untouched
NIGHTLY_ERROR_EXIT = 2  # `nightly`: a bad option, storage, model or an empty source (1 is a crash)
GATE_EXIT = 3  # `model quantize` and `model import`: the gate or the parity check refused the model
ERROR_EXIT = 1
# The one table of how a library error leaves the command line: (command, exception class, exit status); the first
# row whose command ("*": any) and class match wins. The message goes to stderr in one line, "Error: " first
# ("warning: " for the empty source), its control characters escaped; an exception no row matches is a crash
# (a traceback, exit status 1). Click's own usage errors exit 2, and `report --against` exits DRIFT_EXIT_CODE on
# drift and `model check` 1 on a failed engine: results, not errors (docs/operations.md lists every status).
EXIT_STATUSES: tuple[tuple[str, type[BaseException], int], ...] = (
    ("run", EmptySourceError, EMPTY_SOURCE_EXIT),
    ("nightly", BulkClassifyError, NIGHTLY_ERROR_EXIT),
    ("model quantize", GateFailed, GATE_EXIT),
    ("model import", ParityFailed, GATE_EXIT),
    ("repo prepare", Exception, ERROR_EXIT),  # anything, named by its type, in one line for the pod log
    ("*", BulkClassifyError, ERROR_EXIT),
)
# What reaches the terminal from names, labels and errors: C0 controls but tab and newline, DEL, C1 controls and the
# bidirectional overrides, shown escaped so that a hostile label cannot retitle, recolour or reorder the terminal.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """``text`` with control characters written as Python escapes (``\\x1b``, ``\\u202e``)."""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], text)


def _echo(text: str = "", **kwargs: Any) -> None:
    click.echo(escape_controls(text), **kwargs)


class Failure(click.ClickException):
    """A library error in one line on stderr, with its control characters escaped, and its exit status."""

    def __init__(self, message: str, exit_code: int = ERROR_EXIT, prefix: str = "Error: "):
        super().__init__(message)
        self.exit_code, self.prefix = exit_code, prefix

    def format_message(self) -> str:
        return escape_controls(self.message)

    def show(self, file: Any = None) -> None:
        _echo(f"{self.prefix}{self.format_message()}", err=True)


def failure(command: str, err: BaseException) -> Failure | None:
    """``err`` raised under ``command`` ("model quantize") as EXIT_STATUSES maps it; None: a crash, left to raise."""
    for name, kind, status in EXIT_STATUSES:
        if name in ("*", command) and isinstance(err, kind):
            message = str(err) if issubclass(kind, BulkClassifyError) else f"{type(err).__name__}: {err}"
            return Failure(message, status, prefix="warning: " if status == EMPTY_SOURCE_EXIT else "Error: ")
    return None


class LibraryCommand(click.Command):
    """A command whose library errors leave through EXIT_STATUSES."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as err:  # noqa: BLE001 - mapped by the table, or raised again as it was
            names = []
            while ctx.parent is not None:
                names.append(ctx.info_name)
                ctx = ctx.parent
            mapped = failure(" ".join(reversed(names)), err)
            if mapped is None:
                raise
            raise mapped from None


class LibraryGroup(click.Group):
    """The command line's groups: their commands are LibraryCommands, their subgroups LibraryGroups."""

    command_class = LibraryCommand
    group_class = type


def _options(items: tuple[str, ...], flag: str = "--storage-option", example: str = "anon=true") -> dict[str, Any]:
    try:
        return dict(parse_option(i, flag, example) for i in items)
    except BulkClassifyError as err:
        raise click.BadParameter(str(err)) from None


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


@click.group(cls=LibraryGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="bulk-classify")
@click.option("-v", "--verbose", is_flag=True, help="Log the library's progress to stderr.")
def main(verbose: bool) -> None:
    """Classify every image under a folder or bucket prefix into a Parquet table."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        quiet_ray()



class ConfigDefault(click.Option):
    """An option that is None when not given, so that the library fills in its default (RunConfig merges it over the
    environment); the help shows that default as the module that owns it writes it: ``[default: 5]``, not ``(5)``."""

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = super().get_help_extra(ctx)
        if isinstance(self.show_default, str):
            extra["default"] = self.show_default
        return extra


def _default(name: str) -> Any:
    """RunConfig's default of field ``name``, for the help texts."""
    return RunConfig.__dataclass_fields__[name].default


_BUILT_IN_MODEL = "built-in EfficientNet-Lite0"  # what --model means when it is not given
_GPU_BATCH_SIZES = "/".join(sorted({str(s.gpu_batch_size) for s in REGISTRY.values() if s.gpu_batch_size}))
_ACTORS_PER_GPU = "/".join(sorted({str(s.actors_per_gpu) for s in REGISTRY.values() if s.needs_gpu}))

# The options every run takes, shared by `run` and `nightly` (sqlite-utils style): one list, no drift.
RUN_OPTIONS = (
    click.option("--model", cls=ConfigDefault, default=None, show_default=_BUILT_IN_MODEL, help=f"Model folder ({MODEL_FILE}, {LABELS_FILE}, {SPEC_FILE})."),
    click.option("--engine", type=click.Choice(ENGINE_CHOICES), cls=ConfigDefault, default=None, show_default=_default("engine"), help=f"{AUTO_ENGINE}: {GPU_CHOICE} where the Ray cluster has GPUs, else {CPU_CHOICE}; " + "; ".join(f"{s.name}: {s.summary}" for s in REGISTRY.values()) + "."),
    click.option("--engine-option", "engine_options", multiple=True, metavar="KEY=VALUE", help="Engine-specific option, e.g. max_batch=8 (onnx) or repository=DIR (triton); repeatable; 'bulk-classify engines' lists them."),
    click.option("--top-k", type=int, cls=ConfigDefault, default=None, show_default=str(_default("top_k")), help="Labels kept per image."),
    click.option("--batch-size", type=int, cls=ConfigDefault, default=None, show_default=f"{_GPU_BATCH_SIZES} where the actors take GPUs, else {DEFAULT_BATCH_SIZE}", help="Images per engine call."),
    click.option("--shard-size", type=int, cls=ConfigDefault, default=None, show_default=str(_default("shard_size")), help="Rows per committed Parquet shard."),
    click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", help="fsspec option for the source, the output and the previous output, e.g. endpoint_url=http://127.0.0.1:9000; repeatable."),
    click.option("--overwrite", is_flag=True, default=None, help="Delete this tool's earlier files in the output and start over."),
    click.option("--extensions", cls=ConfigDefault, default=None, show_default=",".join(_default("extensions")), help="Comma-separated extensions to list."),
    click.option("--num-actors", type=int, cls=ConfigDefault, default=None, show_default=f"one per GPU, or CPUs/{CPUS_PER_CPU_ACTOR}", help="Classify actors."),
    click.option("--num-gpus-per-actor", type=float, cls=ConfigDefault, default=None, show_default=f"on a cluster with GPUs 1/{_ACTORS_PER_GPU}, {_ACTORS_PER_GPU} actors per GPU; else 0", help="GPUs each classify actor takes."),
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
    click.option("--catalog-option", "catalog_options", multiple=True, metavar="KEY=VALUE", help=f"Iceberg catalog property for an {ICEBERG_SCHEME}NAMESPACE.TABLE output or previous, e.g. warehouse=DIR (the embedded SQLite catalog, default ./{DEFAULT_WAREHOUSE}) or uri=… type=rest; repeatable."),
    click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary."),
)


def run_options(command: Callable) -> Callable:
    """Adds ``RUN_OPTIONS`` to a command."""
    for option in reversed(RUN_OPTIONS):
        command = option(command)
    return command


def _run_fields(options: dict[str, Any]) -> dict[str, Any]:
    """RUN_OPTIONS' values as RunConfig fields (None: not given); ``quiet`` is the CLI's and is removed."""
    options.pop("quiet", None)
    fields = dict(options)
    fields["storage_options"] = _options(options.get("storage_options") or ())
    fields["engine_options"] = _options(options.get("engine_options") or (), "--engine-option", "max_batch=8")
    fields["catalog_options"] = _options(options.get("catalog_options") or (), "--catalog-option", "warehouse=DIR")
    extensions = options.get("extensions")
    if extensions is not None:
        fields["extensions"] = tuple(e.strip() for e in extensions.split(",") if e.strip())
    return fields


@main.command()
@click.argument("source")
@click.option("-o", "--output", required=True, help=f"Folder or URL (s3://bucket/prefix) for the Parquet output, or an Iceberg table: {ICEBERG_SCHEME}NAMESPACE.TABLE.")
@click.option("--previous", default=None, help="An earlier run's output (a folder or an Iceberg table): unchanged objects are carried over, not reclassified.")
@run_options
def run(source: str, quiet: bool, **options: Any) -> None:
    """Classify every image under SOURCE into Parquet under --output (resumes where it stopped).

    SOURCE is a folder or prefix (listed), uris+FILE (a text, CSV or Parquet list of URIs) or
    inventory+s3://…/manifest.json (an S3 Inventory report).

    \b
    Exit status: 0 done, 1 an error (the message says the fix), 4 SOURCE holds nothing to classify.
    """
    config = RunConfig.build(dict(_run_fields(options), source=source))
    from pipeline.job import run_job
    from pipeline.quality.report import format_run_report

    progress = _Progress(enabled=not quiet and sys.stderr.isatty())
    try:
        with _ray_output_to_stderr():
            summary = run_job(config, progress=progress)
    finally:
        progress.close()
    if not quiet:
        _echo(format_run_report(summary.report))
        _echo(
            f"{summary.total} rows in {summary.output}: {summary.counts.get(STATUS_OK, 0)} ok, "
            f"{summary.counts.get(STATUS_ERROR, 0)} error; this run classified {summary.classified}, "
            f"carried {summary.carried}, found {summary.already_done} already done, in {summary.elapsed_s:.1f}s"
        )


@contextlib.contextmanager
def _ray_output_to_stderr():
    """Ray prints its own messages to stdout (raylet errors such as "A worker died or was killed", forwarded
    worker output); stdout is this command's report, so they go to stderr, Ray's shutdown (by the library, which
    stops the Ray it starts) included."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


@main.command()
@click.option("--config", "config_file", default=None, metavar="FILE", help="YAML file with any of these options, with _ for - (flags win).")
@click.option("--source", default=None, help="Folder or URL to classify, e.g. s3://bucket/prefix.")
@click.option("--output-root", default=None, help="Folder or URL that receives date=YYYY-MM-DD/ folders.")
@click.option("--date", cls=ConfigDefault, default=None, show_default="today in UTC", help="YYYY-MM-DD to scan.")
@click.option("--previous", cls=ConfigDefault, default=None, show_default=PREVIOUS_AUTO, help=f"'{PREVIOUS_AUTO}' (the latest earlier completed date), '{PREVIOUS_NONE}', or a URL.")
@click.option("--no-previous", is_flag=True, help=f"Classify everything: carry nothing over from an earlier date (= --previous {PREVIOUS_NONE}).")
@run_options
def nightly(config_file: str | None, quiet: bool, no_previous: bool, **options: Any) -> None:
    """Scan SOURCE into <output-root>/date=YYYY-MM-DD/: once per date, resumable, carrying unchanged objects over.

    \b
    Exit status: 0 done or already complete, 2 bad options or storage (the message says the fix), 1 a crash.
    """
    from pipeline.nightly import DATE_PREFIX, nightly_scan

    scan = nightly_options(config_file, no_previous, options)
    with _ray_output_to_stderr():
        result = nightly_scan(scan, progress=None if quiet else _nightly_progress())
    if result.status == "already_complete":
        rec = result.success or {}
        _echo(f"nightly scan {DATE_PREFIX}{result.date} already complete at {result.dest} "
              f"({rec.get('rows', '?')} rows, finished {rec.get('finished_at', '?')}); nothing to do")
        return
    from pipeline.quality.report import format_run_report

    summary = result.summary
    if result.resumed_shards:
        _echo(f"resumed an interrupted scan: {result.resumed_shards} shard(s) were already committed")
    if result.previous:
        _echo(f"previous: {result.previous} ({summary.carried} unchanged row(s) carried over)")
    if not quiet:
        _echo(format_run_report(summary.report))
    if result.drift:
        d = result.drift
        _echo(f"quality against {d['against']}: PSI {d['psi']:.3f}, label JS {d['js_divergence']:.3f}: "
              + ("no threshold crossed" if d["passed"] else "DRIFT: " + "; ".join(b["message"] for b in d["breaches"])))
    counts = "  ".join(f"{k} {v}" for k, v in sorted(summary.counts.items()))
    _echo(f"nightly scan {DATE_PREFIX}{result.date} complete: {summary.total} rows ({counts}) -> {result.dest}")


def nightly_options(config_file: str | None, no_previous: bool, options: dict[str, Any]) -> dict[str, Any]:
    """The scan's options from the command line's values (``None``: not given) over the YAML file's."""
    from pipeline.nightly import collect_options

    fields = _run_fields(dict(options))
    if no_previous:
        fields["previous"] = PREVIOUS_NONE
    return collect_options(config_file, fields)


@main.command("engines")
def engines_command() -> None:
    """The registered engines, what each needs, their --engine-option names, and what auto picks here."""
    from pipeline.engines.auto import choose  # noqa: PLC0415

    try:
        choice = choose()
        click.echo(f"{AUTO_ENGINE} (the default) -> {choice.engine} here: {choice.reason}")
    except Exception as err:  # noqa: BLE001 - a cluster that cannot be reached: say so, list the engines anyway
        click.echo(f"{AUTO_ENGINE} (the default): could not count the cluster's GPUs ({err})")
    for spec in REGISTRY.values():
        click.echo(f"{spec.name}: {spec.summary}{' (takes a GPU per actor where the cluster has GPUs)' if spec.needs_gpu else ''}")
        click.echo(f"  {spec.int8}")
        for option in spec.options:
            click.echo(f"  {option.name}={option.kind}  {option.help}")


def _nightly_progress(every_s: float = NIGHTLY_PROGRESS_EVERY_S) -> Callable[[int, "int | None", int], None]:
    """A progress line every ``every_s`` seconds: the job logs of `ray job submit` are not a terminal."""
    last = [0.0]

    def show(done: int, total: int | None, errors: int) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            click.echo(f"progress: {done}/{total if total is not None else '?'} rows, {errors} errors")

    return show


@main.group()
def repo() -> None:
    """Build and check Triton model repositories."""


@repo.command("build")
@click.option("--profile", type=click.Choice(tuple(REPOSITORY_PROFILES)), default=PORTABLE, show_default=True, help="Which repository profile to fill.")
@click.option("--model", cls=ConfigDefault, default=None, show_default=_BUILT_IN_MODEL, help="Model folder.")
@click.option("--output", required=True, help="Folder to write the filled repository to.")
@click.option("--top-k", type=int, default=DEFAULT_TOP_K, show_default=True, help="Classes each response carries (the engine's --top-k must not exceed it).")
@click.option("--instances", type=int, cls=ConfigDefault, default=None, show_default="the profile's", help="Model instances per server.")
@click.option("--max-batch-size", type=int, default=None, help="Largest batch the server forms (and the TensorRT profile's max).")
@click.option("--max-backlog", type=float, cls=ConfigDefault, default=None, show_default="the profile's, docs/gpu.md", help="gpu profile: network batches one instance takes before its execute() waits (0: never).")
def repo_build(profile: str, model: str | None, output: str, top_k: int, instances: int | None,
               max_batch_size: int | None, max_backlog: float | None) -> None:
    """Fill a repository profile's artifacts (ONNX, DALI pipeline, TensorRT plan where TensorRT is installed)."""
    from pipeline.triton.repository import build_repository

    path = build_repository(profile, model, output, top_k=top_k, instances=instances,
                            max_batch_size=max_batch_size, max_backlog=max_backlog)
    click.echo(f"built {profile} repository in {path}")


@repo.command("check")
@click.argument("path", required=False)
def repo_check(path: str | None) -> None:
    """Check repositories: PATH (a repository or a folder of profiles), else every profile this package generates."""
    from pipeline.triton.checks import check_repository

    models = check_repository(path)
    click.echo(f"ok: {len(models)} models checked ({', '.join(models)})")


@repo.command("prepare")
@click.option("--repository", envvar=f"{ENV_PREFIX}REPOSITORY", show_envvar=True, default=DEFAULT_REPOSITORY, show_default=True, help="Where the repository goes.")
@click.option("--model", envvar=f"{ENV_PREFIX}MODEL", show_envvar=True, cls=ConfigDefault, default=None, show_default=_BUILT_IN_MODEL, help="Model folder.")
@click.option("--plan-cache", envvar=f"{ENV_PREFIX}PLAN_CACHE", show_envvar=True, default=None, help="fsspec URL of built repositories per GPU kind, e.g. s3://bucket/trt-plans.")
@click.option("--top-k", envvar=f"{ENV_PREFIX}TOP_K", show_envvar=True, type=int, default=DEFAULT_TOP_K, show_default=True, help="Classes each response carries.")
@click.option("--max-batch-size", envvar=f"{ENV_PREFIX}MAX_BATCH_SIZE", show_envvar=True, type=int, default=DEFAULT_MAX_BATCH_SIZE, show_default=True, help="The TensorRT profile's largest batch.")
def repo_prepare(repository: str, model: str | None, plan_cache: str | None, top_k: int, max_batch_size: int) -> None:
    """Put a production repository for this node's GPU and TensorRT in place: keep, fetch from the cache, or build."""
    from pipeline.triton.prepare import prepare

    logging.getLogger().setLevel(logging.INFO)  # the pod log shows what it did and how long it took
    done = prepare(repository, model or None, plan_cache=plan_cache or None, top_k=top_k,
                   max_batch_size=max_batch_size)
    click.echo(f"repo prepare: {done['action']} {done['cache_name']}")


@main.group("model")
def model_group() -> None:
    """Build and check model folders that --model loads."""


_Q, _G = QuantizeOptions(), GateThresholds()  # the defaults the help shows
_DRIFT = DriftThresholds()


@model_group.command("quantize")
@click.option("--calibration", "source", required=True, metavar="SOURCE", help="Folder or URL (s3://bucket/prefix) of images like the job's; sampled up to --samples.")
@click.option("--output", required=True, metavar="DIR", help="The INT8 model folder to write (new or empty).")
@click.option("--model", cls=ConfigDefault, default=None, show_default=_BUILT_IN_MODEL, help="The FP32 model folder.")
@click.option("--samples", type=int, default=DEFAULT_SAMPLES, show_default=True, help="Images sampled from SOURCE (calibration + held-out).")
@click.option("--calibration-images", type=int, default=_Q.calibration_images, show_default=True, help="Images of the sample that calibrate; the rest are held out for the gate.")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True, help="Seed of the sampling (the report records it).")
@click.option("--method", type=click.Choice(CALIBRATION_METHODS), default=_Q.method, show_default=True, help="Calibration method.")
@click.option("--percentile", type=float, default=_Q.percentile, show_default=True, help="The percentile method's cut.")
@click.option("--per-channel/--per-tensor", default=_Q.per_channel, show_default=True, help="Weight scales per output channel or per tensor.")
@click.option("--exclude", default=",".join(_Q.exclude), show_default=True, help=f"Comma-separated nodes left in float: node names, or {', '.join(EXCLUDE_KEYWORDS)}; '' for none.")
@click.option("--format", "quant_format", type=click.Choice(QUANT_FORMATS), default=_Q.quant_format, show_default=True, help="QDQ (QuantizeLinear/DequantizeLinear pairs) or QOperator (QLinearConv...).")
@click.option("--types", type=click.Choice(tuple(QUANT_TYPES)), default=_Q.types, show_default=True, help="Activation and weight integer types.")
@click.option("--min-decisive-agreement", type=float, default=_G.min_decisive_agreement, show_default=True, help="Top-1 agreement with FP32 on held-out images whose FP32 margin is at least 0.1.")
@click.option("--min-class-agreement", type=float, default=_G.min_class_agreement, show_default=True, help="Top-1 agreement every FP32 top-1 class with --min-class-images images must reach.")
@click.option("--min-class-images", type=int, default=_G.min_class_images, show_default=True, help="Held-out images a class needs to be gated on its own.")
@click.option("--min-top1-agreement", type=float, default=_G.min_top1_agreement, show_default=True, help="Top-1 agreement with FP32 over all held-out images.")
@click.option("--min-top5-overlap", type=float, default=_G.min_top5_overlap, show_default=True, help="Mean share of FP32's top-5 that INT8's top-5 holds.")
@click.option("--force", is_flag=True, help="Write the model even when the gate fails, marked failed in its report.")
@click.option("--report", "report_path", cls=ConfigDefault, default=None, show_default=f"DIR{SIDE_SUFFIX} beside DIR", metavar="FILE", help="Where a refused model's report goes.")
@click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", help="fsspec option for SOURCE; repeatable.")
def model_quantize(source: str, output: str, model: str | None, samples: int, calibration_images: int, seed: int,
                   method: str, percentile: float, per_channel: bool, exclude: str, quant_format: str, types: str,
                   force: bool, report_path: str | None, storage_options: tuple[str, ...], **gate: Any) -> None:
    """INT8 (QDQ) model calibrated on SOURCE, written only if it passes the gate against FP32 on held-out images.

    \b
    Exit status: 0 written, 3 the gate failed (no model written; the report goes to a side file), 1 an error.
    """
    from pipeline.int8.quantize import format_gate, quantize_model

    options = QuantizeOptions(method=method, percentile=percentile, per_channel=per_channel,
                              exclude=tuple(exclude.split(",")), quant_format=quant_format, types=types,
                              calibration_images=calibration_images)
    thresholds = GateThresholds(**gate)
    result = quantize_model(source, output, model=model, samples=samples, seed=seed, options=options,
                            thresholds=thresholds, force=force, storage_options=_options(storage_options),
                            report_path=report_path)
    click.echo(format_gate(result.report))
    state = "passed" if result.passed else "FAILED (written with --force, marked failed)"
    click.echo(f"INT8 model {state}: {result.model_dir} (report {result.report_path.name})")


@model_group.command("check")
@click.argument("folder", metavar="DIR")
@click.option("--images", default=None, metavar="SOURCE", help="Folder or URL of sample images (default: the repository's tests/data/photos).")
@click.option("--engine", "engines", multiple=True, metavar="NAME", help="An engine to compare (repeatable; default: every engine available here).")
@click.option("--sample", type=int, default=DEFAULT_SAMPLE, show_default=True, help="Images of SOURCE to run.")
@click.option("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT, show_default=True, help="Top-1 agreement with the reference each engine needs.")
@click.option("--max-score-diff", type=float, default=DEFAULT_MAX_SCORE_DIFF, show_default=True, help="Largest score difference from the reference allowed.")
@click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", help="fsspec option for SOURCE; repeatable.")
def model_check(folder: str, images: str | None, engines: tuple[str, ...], sample: int, min_agreement: float,
                max_score_diff: float, storage_options: tuple[str, ...]) -> None:
    """Check a model folder: its contract, then sample images through the reference and every engine here.

    \b
    Exit status: 0 every engine agrees with the reference, 1 a broken contract, an error, or an engine below the
    thresholds.
    """
    from pipeline.model_check import check_model_folder, format_report

    report = check_model_folder(folder, images=images, engines=engines, sample=sample,
                                min_agreement=min_agreement, max_score_diff=max_score_diff,
                                storage_options=_options(storage_options))
    click.echo(format_report(report))
    if not report.passed:
        failed = [e.engine for e in report.engines if not e.passed]
        raise Failure(f"model check failed for {', '.join(failed)}; see the lines above")


@model_group.command("import")
@click.argument("source", type=click.Choice(tuple(SOURCES)))
@click.argument("name")
@click.option("--output", required=True, metavar="DIR", help="The model folder to write (new or empty).")
@click.option("--checkpoint", metavar="FILE", help="timm: a state dict, train.py checkpoint or safetensors file; torchvision: a state dict.")
@click.option("--labels", metavar="FILE", help="Class names, one a line in output order (default: the checkpoint's, ImageNet-1k's for an ImageNet timm architecture, torchvision's categories, id2label).")
@click.option("--preset", metavar="ENTRY", help="torchvision: the weights entry whose transforms and categories apply, e.g. IMAGENET1K_V2 (default: DEFAULT).")
@click.option("--use-ema", is_flag=True, help="timm: take a train.py checkpoint's EMA weights (state_dict_ema) instead of its state_dict.")
@click.option("--images", metavar="SOURCE", cls=ConfigDefault, default=None, show_default="the repository's tests/data/photos", help="Folder or URL of sample photos for the parity check.")
@click.option("--sample", type=int, default=IMPORT_SAMPLE, show_default=True, help="Sample photos compared.")
@click.option("--min-agreement", type=float, default=IMPORT_MIN_AGREEMENT, show_default=True, help="Top-1 agreement with the framework needed on the clearly decided photos.")
@click.option("--max-logit-diff", type=float, default=DEFAULT_MAX_LOGIT_DIFF, show_default=True, help="Largest median over the photos of the logit difference from the framework, as a share of the photo's logit range.")
def model_import(source: str, name: str, output: str, checkpoint: str | None, labels: str | None, preset: str | None,
                 use_ema: bool, images: str | None, sample: int, min_agreement: float, max_logit_diff: float) -> None:
    """Write a model folder from a trained network, kept only if it classifies like its framework.

    \b
    SOURCE NAME: timm ARCHITECTURE --checkpoint FILE; torchvision MODEL --checkpoint FILE; huggingface FOLDER.
    Nothing is downloaded. The written folder runs through pipeline.model.imaging and ONNX Runtime on the sample photos,
    against the framework's own transform and forward.
    Exit status: 0 written, 3 parity failed (nothing written), 1 an error.
    """
    from pipeline.model_import.core import format_result, import_model

    options = ImportOptions(images=images, sample=sample, min_agreement=min_agreement, max_logit_diff=max_logit_diff)
    result = import_model(source, name, output, checkpoint=checkpoint, labels=labels, preset=preset, use_ema=use_ema,
                          options=options)
    _echo(format_result(result))


@main.command()
@click.argument("dest")
@click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", help="fsspec option for DEST and --against; repeatable.")
@click.option("--catalog-option", "catalog_options", multiple=True, metavar="KEY=VALUE", help=f"Iceberg catalog property for an {ICEBERG_SCHEME}NAMESPACE.TABLE[@SNAPSHOT_ID|@parent] DEST or PREV; repeatable.")
@click.option("--against", default=None, metavar="PREV", help="Compare DEST with an earlier output PREV ('previous': the night DEST's nightly run compared itself with); exits 3 on drift.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--html", "html_file", default=None, metavar="FILE", help="With --against: write a self-contained page (charts, no network) to FILE.")
@click.option("--psi-max", type=float, cls=ConfigDefault, default=None, show_default=str(_DRIFT.psi_max), help="Largest PSI of the top-1 confidence histogram that passes.")
@click.option("--js-max", type=float, cls=ConfigDefault, default=None, show_default=str(_DRIFT.js_max), help="Largest Jensen-Shannon divergence (bits) of top-1 labels that passes.")
@click.option("--error-rate-max-increase", type=float, cls=ConfigDefault, default=None, show_default=str(_DRIFT.error_rate_max_increase), help="Largest rise of an error kind's share of rows that passes.")
@click.option("--min-rows", type=int, cls=ConfigDefault, default=None, show_default=str(_DRIFT.min_rows), help="Fewer rows on either side: report, never fail.")
def report(dest: str, storage_options: tuple[str, ...], catalog_options: tuple[str, ...], against: str | None,
           as_json: bool, html_file: str | None, **thresholds: Any) -> None:
    """Summarise a finished output, or with --against gate it on drift from an earlier one.

    \b
    Exit status with --against: 0 no threshold crossed, 3 drift (a threshold crossed),
    1 an output cannot be read, 2 a bad option.
    """
    import json

    from pipeline.quality.report import format_summary, summarize_output

    options = _options(storage_options)
    catalog = _options(catalog_options, "--catalog-option", "warehouse=DIR")
    if against is None:
        if html_file:
            raise click.UsageError("--html needs --against PREV: the page compares two outputs")
        summary = summarize_output(dest, options, catalog)
        _echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))
        return

    from pipeline.quality.statistics import compare_outputs, format_comparison

    try:
        limits = DriftThresholds(**{k: v for k, v in thresholds.items() if v is not None})
    except BulkClassifyError as err:
        raise click.UsageError(str(err)) from None
    result = compare_outputs(dest, against, limits, options, catalog)
    if html_file:
        from pipeline.quality.html import write_html

        write_html(result, html_file)
    _echo(json.dumps(result, indent=2) if as_json else format_comparison(result))
    if html_file and not as_json:
        _echo(f"page: {html_file}")
    if not result["passed"]:
        click.get_current_context().exit(DRIFT_EXIT_CODE)


@main.command()
@click.argument("curve")
@click.option("--target-rate", type=float, required=True, help="Images per second the fleet must sustain.")
@click.option("--utilization", type=float, default=DEFAULT_UTILIZATION, show_default=True, help="Fraction of the plateau to plan for.")
@click.option("--spare", type=int, default=DEFAULT_SPARE, show_default=True, help="Spare GPUs on top.")
def size(curve: str, target_rate: float, utilization: float, spare: int) -> None:
    """GPUs needed for a target rate, from a measured throughput/p99 curve (CSV or JSON)."""
    from pipeline.sizing import format_sizing, size_fleet

    result = size_fleet(curve, target_rate, utilization=utilization, spare=spare)
    click.echo(format_sizing(result))


if __name__ == "__main__":  # pragma: no cover
    main()
