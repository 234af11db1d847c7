"""The nightly scan: classify SOURCE into ``<output-root>/date=YYYY-MM-DD/``, once per date, resumable.

``bulk-classify nightly`` runs it; ``jobs/nightly_scan.py`` is the same command as a ``ray job submit`` entrypoint.

* The date is today in UTC unless ``--date`` is given (Airflow passes its logical date).
* A date that already has ``_SUCCESS`` is left alone ("already complete"); an interrupted date (shards
  but no ``_SUCCESS``) resumes where it stopped; the job skips rows it already committed.
* The latest earlier completed ``date=`` folder is passed as ``previous``, so objects unchanged since
  then (same URI, ETag, size and mtime) are carried over instead of reclassified (``--no-previous`` off).
* The finished date is compared with the previous completed date (top-1 confidence PSI, label JS divergence,
  error rates; ``pipeline/quality/statistics.py``) and the comparison recorded as ``drift`` in its ``_REPORT.json``; the
  exit status does not depend on it: ``bulk-classify report DEST --against previous`` is the gate.
* ``--config FILE`` (YAML) may hold any of these options (``output_root``, ``date``, ...) and any run
  option (``batch_size``, ``num_actors``, ``storage_options``, ...); the command line wins over the file,
  the file over ``BULK_CLASSIFY_*`` environment variables (``pipeline.config.merge_options``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from datetime import date as Date
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from pipeline.config import RunConfig, merge_options, option_types
from pipeline.errors import ConfigError, OutputError
from pipeline.text import decode_text

LOG = logging.getLogger(__name__)
DATE_PREFIX = "date="
DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
PREVIOUS_AUTO, PREVIOUS_NONE = "auto", "none"
# Keys of the config file (and options) that belong to the nightly layer rather than to RunConfig.
NIGHTLY_KEYS = ("source", "output_root", "date", "previous")
RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in ("source", "output", "previous"))
# The options the environment may set for a scan (BULK_CLASSIFY_<NAME>), by type: the nightly's own and the run's.
SCAN_TYPES = {**{key: "str" for key in NIGHTLY_KEYS}, **{k: v for k, v in option_types().items() if k in RUN_FIELDS}}


@dataclasses.dataclass
class NightlyResult:
    """What one submission did: ``status`` is ``already_complete`` or ``completed``."""

    status: str
    date: str
    dest: str
    previous: str | None = None
    resumed_shards: int = 0
    summary: Any = None  # pipeline.job.RunSummary when a run happened
    success: dict[str, Any] | None = None  # the _SUCCESS record found or written
    drift: dict[str, Any] | None = None  # the comparison with the previous date recorded in _REPORT.json


def scan_date(value: str | None, now: datetime | None = None) -> str:
    """The date to scan: ``value`` checked as YYYY-MM-DD, or today in UTC."""
    if value is None or value == "":
        return (now or datetime.now(timezone.utc)).astimezone(timezone.utc).date().isoformat()
    value = str(value)
    if not DATE_RE.match(value):
        raise ConfigError(f"--date {value!r} is not YYYY-MM-DD; write e.g. --date 2026-11-29")
    try:
        Date.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"--date {value!r} is not a calendar date; write e.g. --date 2026-11-29") from None
    return value


def date_folder(output_root: str, day: str) -> str:
    """``<output-root>/date=YYYY-MM-DD`` (Hive-style, so query engines see ``date`` as a partition column)."""
    return f"{output_root.rstrip('/')}/{DATE_PREFIX}{day}"


def find_previous(output_root: str, day: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The latest ``date=`` folder before ``day`` under ``output_root`` that holds ``_SUCCESS``, as a URL."""
    from pipeline.schema import SUCCESS  # noqa: PLC0415 - pyarrow: not before the options are checked

    fs, root = _open(output_root, storage_options)
    try:
        entries = fs.ls(root, detail=False) if fs.exists(root) else []
    except FileNotFoundError:
        return None
    days = sorted(
        (name[len(DATE_PREFIX):] for name in (e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
         if name.startswith(DATE_PREFIX) and DATE_RE.match(name[len(DATE_PREFIX):])),
        reverse=True,
    )
    for earlier in (d for d in days if d < day):
        if fs.exists(f"{root.rstrip('/')}/{DATE_PREFIX}{earlier}/{SUCCESS}"):
            return date_folder(output_root, earlier)
        LOG.info("skipping %s%s as previous: no %s (interrupted run)", DATE_PREFIX, earlier, SUCCESS)
    return None


def load_options_file(path: str) -> dict[str, Any]:
    """Read the YAML config file; keys are option names with ``_`` (``output_root``, ``batch_size``)."""
    import yaml

    try:
        text = decode_text(Path(path).read_bytes())
    except OSError as err:
        raise ConfigError(f"--config {path!r}: {err.strerror or err}; give a readable YAML file") from None
    except ValueError as err:
        raise ConfigError(f"--config {path!r}: {err}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path!r} must be a mapping of option: value")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = set(data) - set(NIGHTLY_KEYS) - set(RUN_FIELDS)
    if unknown:
        raise ConfigError(f"--config {path!r} has unknown option(s) {sorted(unknown)}; "
                          f"known: {', '.join(NIGHTLY_KEYS + RUN_FIELDS)}")
    return data


def nightly_scan(options: Mapping[str, Any], *, env: Mapping[str, str] | None = None,
                 progress: Callable[[int, "int | None", int], None] | None = None) -> NightlyResult:
    """Run (or skip, or resume) the scan of one date.

    Args:
        options: ``source``, ``output_root``, optional ``date`` and ``previous`` (``"auto"`` (default): the
            latest earlier completed date; ``"none"``: classify everything; or a URL), plus any RunConfig
            field except ``output`` (it is the date folder).
        env: the environment for ``BULK_CLASSIFY_*`` defaults (``os.environ`` when None).
        progress: passed to ``run_job``.
    """
    options = merge_options(options, env=env, types=SCAN_TYPES)  # the environment below the file and flags
    for key in ("source", "output_root"):
        if not options.get(key):
            raise ConfigError(f"--{key.replace('_', '-')} is required (or set {key} in --config)")
    if "output" in options:
        raise ConfigError("give --output-root, not output: the scan writes to <output-root>/date=YYYY-MM-DD")
    day = scan_date(options.pop("date", None))
    output_root = str(options.pop("output_root"))
    dest = date_folder(output_root, day)
    previous_opt = options.pop("previous", None) or PREVIOUS_AUTO
    storage_options = dict(options.get("storage_options") or {})
    from pipeline.job.local_ray import ray_owned  # noqa: PLC0415 - once the options are good

    with ray_owned():  # a cluster joined to count its GPUs is left with the run
        return _scan(options, day, dest, output_root, previous_opt, storage_options, progress)


def _scan(options: dict[str, Any], day: str, dest: str, output_root: str, previous_opt: Any,
          storage_options: dict[str, Any], progress: Callable[[int, "int | None", int], None] | None
          ) -> NightlyResult:
    """``nightly_scan`` once its options are merged and checked: the engine chosen, the date skipped, resumed or run."""
    from pipeline.job import choose_engine, make_plan, open_store, run_job  # noqa: PLC0415 - once the options are good

    # Every option and the engine's requirements are checked before any storage is read or Ray starts.
    choice = choose_engine(RunConfig.build({**options, "output": dest}, env={}))

    from pipeline.schema import SUCCESS  # noqa: PLC0415 - pyarrow: only once the options are good
    from pipeline.io.reader import committed_parts, read_json  # noqa: PLC0415
    from pipeline.job.output import file_above  # noqa: PLC0415

    output = open_store(dest, storage_options)  # the run's output store too
    fs, root = output.fs, output.root
    blocker = file_above(fs, root)
    if blocker is not None:
        raise OutputError(f"--output-root {output_root!r}: {blocker!r} is a file, so no date folder can be made "
                          "there; choose another --output-root (or move that file)")
    try:
        done = read_json(fs, root, SUCCESS)
        shards = committed_parts(fs, root)
    except (OSError, ValueError) as err:
        raise OutputError(f"cannot read {dest!r}: {err}; check the URL, credentials and AWS_ENDPOINT_URL") from None
    if done is not None and not options.get("overwrite"):
        LOG.info("%s%s already complete at %s", DATE_PREFIX, day, dest)
        return NightlyResult("already_complete", day, dest, success=done)

    if previous_opt == PREVIOUS_AUTO:
        previous = find_previous(output_root, day, storage_options)
    elif previous_opt in (PREVIOUS_NONE, "off", False):
        previous = None
    else:
        previous = str(previous_opt)
    if shards and not options.get("overwrite"):
        LOG.info("resuming %s%s: %d shard(s) already committed", DATE_PREFIX, day, len(shards))

    plan = make_plan(dataclasses.replace(choice, config=dataclasses.replace(choice.config, previous=previous)),
                     output=output)
    summary = run_job(plan, progress=progress)
    from pipeline.quality.statistics import record_drift  # noqa: PLC0415

    # The quality gate's comparison: against the previous completed date, even when nothing was carried from it.
    drift = record_drift(dest, previous or find_previous(output_root, day, storage_options), storage_options)
    return NightlyResult("completed", day, dest, previous=previous, resumed_shards=len(shards), summary=summary,
                         success=read_json(fs, root, SUCCESS), drift=drift)


def _open(url: str, storage_options: Mapping[str, Any] | None):
    from pipeline.storage import open_fs

    return open_fs(url, storage_options)


def collect_options(config_file: str | None, flags: Mapping[str, Any]) -> dict[str, Any]:
    """The scan's options: the YAML file's, then the command line's (``None`` = not given) on top
    (``merge_options``: ``storage_options`` and ``engine_options`` merge key by key, the command line's keys winning).
    The environment goes below both in ``nightly_scan``."""
    return merge_options(load_options_file(config_file) if config_file else {}, flags, env={}, types={})


def format_scan(result: NightlyResult, *, report: bool = True) -> str:
    """What ``bulk-classify nightly`` prints of a scan: "already complete", or what it resumed and carried over, the
    run report (``report``), the comparison with the previous date and the closing line."""
    if result.status == "already_complete":
        rec = result.success or {}
        return (f"nightly scan {DATE_PREFIX}{result.date} already complete at {result.dest} "
                f"({rec.get('rows', '?')} rows, finished {rec.get('finished_at', '?')}); nothing to do")
    from pipeline.quality.report import format_run_report  # noqa: PLC0415 - only where a run happened

    summary = result.summary
    lines = []
    if result.resumed_shards:
        lines.append(f"resumed an interrupted scan: {result.resumed_shards} shard(s) were already committed")
    if result.previous:
        lines.append(f"previous: {result.previous} ({summary.carried} unchanged row(s) carried over)")
    if report:
        lines.append(format_run_report(summary.report))
    if result.drift:
        d = result.drift
        lines.append(f"quality against {d['against']}: PSI {d['psi']:.3f}, label JS {d['js_divergence']:.3f}: "
                     + ("no threshold crossed" if d["passed"]
                        else "DRIFT: " + "; ".join(b["message"] for b in d["breaches"])))
    counts = "  ".join(f"{k} {v}" for k, v in sorted(summary.counts.items()))
    lines.append(f"nightly scan {DATE_PREFIX}{result.date} complete: {summary.total} rows ({counts}) -> {result.dest}")
    return "\n".join(lines)
