"""The nightly scan: classify SOURCE into ``<output-root>/date=YYYY-MM-DD/``, once per date, resumable.

Submit it to a Ray cluster from the repository root::

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python jobs/nightly_scan.py --source s3://photos/incoming --output-root s3://photos-labels/nightly

* The date is today in UTC unless ``--date`` is given (Airflow passes its logical date).
* A date that already has ``_SUCCESS`` is left alone ("already complete"); an interrupted date (shards
  but no ``_SUCCESS``) resumes where it stopped; the job skips rows it already committed.
* The latest earlier completed ``date=`` folder is passed as ``previous``, so objects unchanged since
  then (same URI, ETag, size and mtime) are carried over instead of reclassified (``--no-previous`` off).
* The finished date is compared with the previous completed date (top-1 confidence PSI, label JS divergence,
  error rates; ``pipeline/quality.py``) and the comparison recorded as ``drift`` in its ``_REPORT.json``; the
  exit status does not depend on it: ``bulk-classify report DEST --against previous`` is the gate.
* ``--config FILE`` (YAML) may hold any of these options (``output_root``, ``date``, ...) and any run
  option (``batch_size``, ``num_actors``, ``storage_options``, ...); the command line wins over the file,
  the file over ``BULK_CLASSIFY_*`` environment variables.

Exit status: 0 done or already complete, 2 bad options or storage (the message says the fix), 1 a crash.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
import time
from datetime import date as Date
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

try:
    import pipeline  # noqa: F401
except ImportError:  # run as `python jobs/nightly_scan.py` from a checkout: the package is one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import RunConfig, parse_storage_option  # noqa: E402
from pipeline.errors import BulkClassifyError, ConfigError, OutputError  # noqa: E402
from pipeline.writer import committed_parts, read_json  # noqa: E402

LOG = logging.getLogger("bulk_classify.nightly")
DATE_PREFIX = "date="
from pipeline.schema import SUCCESS  # noqa: E402
DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
PROGRESS_EVERY_S = 30.0
# Keys of the config file (and options) that belong to the nightly layer rather than to RunConfig.
NIGHTLY_KEYS = ("source", "output_root", "date", "previous")
RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in ("source", "output", "previous"))


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
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as err:
        raise ConfigError(f"--config {path!r}: {err.strerror or err}; give a readable YAML file") from None
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
    options = dict(options)
    for key in ("source", "output_root"):
        if not options.get(key):
            raise ConfigError(f"--{key.replace('_', '-')} is required (or set {key} in --config)")
    if "output" in options:
        raise ConfigError("give --output-root, not output: the scan writes to <output-root>/date=YYYY-MM-DD")
    day = scan_date(options.pop("date", None))
    output_root = str(options.pop("output_root"))
    dest = date_folder(output_root, day)
    previous_opt = options.pop("previous", None) or "auto"
    storage_options = dict(options.get("storage_options") or {})

    fs, root = _open(dest, storage_options)
    try:
        done = read_json(fs, root, SUCCESS)
        shards = committed_parts(fs, root)
    except (OSError, ValueError) as err:
        raise OutputError(f"cannot read {dest!r}: {err}; check the URL, credentials and AWS_ENDPOINT_URL") from None
    if done is not None and not options.get("overwrite"):
        LOG.info("%s%s already complete at %s", DATE_PREFIX, day, dest)
        return NightlyResult("already_complete", day, dest, success=done)

    if previous_opt == "auto":
        previous = find_previous(output_root, day, storage_options)
    elif previous_opt in ("none", "off", False):
        previous = None
    else:
        previous = str(previous_opt)
    if shards and not options.get("overwrite"):
        LOG.info("resuming %s%s: %d shard(s) already committed", DATE_PREFIX, day, len(shards))

    config = RunConfig.build({**options, "output": dest, "previous": previous}, env=env)
    from pipeline.job import run_job

    summary = run_job(config, progress=progress)
    from pipeline.quality import record_drift

    # The quality gate's comparison: against the previous completed date, even when nothing was carried from it.
    drift = record_drift(dest, previous or find_previous(output_root, day, storage_options), storage_options)
    return NightlyResult("completed", day, dest, previous=previous, resumed_shards=len(shards), summary=summary,
                         success=read_json(fs, root, SUCCESS), drift=drift)


def parse_args(argv: list[str] | None) -> dict[str, Any]:
    """Command line -> options dict (config file first, then the flags given)."""
    p = argparse.ArgumentParser(prog="nightly_scan.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with any of these options (flags win)")
    p.add_argument("--source", help="folder or URL to classify, e.g. s3://bucket/prefix")
    p.add_argument("--output-root", help="folder or URL that receives date=YYYY-MM-DD/ folders")
    p.add_argument("--date", help="YYYY-MM-DD to scan (default: today in UTC)")
    p.add_argument("--previous", help="'auto' (latest earlier completed date, default), 'none', or a URL")
    p.add_argument("--no-previous", dest="previous", action="store_const", const="none",
                   help="classify everything: carry nothing over from an earlier date")
    p.add_argument("--model", help="'default' or a model folder (model.onnx, labels.txt, preprocess.json)")
    p.add_argument("--engine", help="onnx | triton | gpu")
    for name, kind in (("top_k", int), ("batch_size", int), ("shard_size", int), ("num_actors", int),
                       ("num_gpus_per_actor", float), ("fetch_threads", int), ("decode_threads", int),
                       ("retries", int), ("metrics_port", int)):
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, dest=name)
    p.add_argument("--extensions", help="comma-separated, e.g. jpg,png,webp")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for source and output (repeatable), e.g. anon=false")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option (repeatable), e.g. repository=/models")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="redo the date even if complete (deletes its shards first)")
    p.add_argument("--log-level", default="INFO")
    args = vars(p.parse_args(argv))
    logging.basicConfig(level=args.pop("log_level").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = load_options_file(args.pop("config")) if args.get("config") else {}
    args.pop("config", None)
    storage = dict(parse_storage_option(s) for s in args.pop("storage_option"))
    engine_opts = dict(parse_storage_option(s) for s in args.pop("engine_option"))
    if storage:
        options["storage_options"] = {**dict(options.get("storage_options") or {}), **storage}
    if engine_opts:
        options["engine_options"] = {**dict(options.get("engine_options") or {}), **engine_opts}
    if args.get("extensions"):
        args["extensions"] = tuple(e.strip() for e in args["extensions"].split(",") if e.strip())
    options.update({k: v for k, v in args.items() if v is not None})
    if isinstance(options.get("extensions"), list):
        options["extensions"] = tuple(options["extensions"])
    return options


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python jobs/nightly_scan.py``; prints what happened and returns the exit status."""
    try:
        options = parse_args(argv)
        result = nightly_scan(options, progress=_progress_printer())
    except BulkClassifyError as err:
        print(f"nightly scan: error: {err}", file=sys.stderr, flush=True)
        return 2
    if result.status == "already_complete":
        rec = result.success or {}
        print(f"nightly scan {DATE_PREFIX}{result.date} already complete at {result.dest} "
              f"({rec.get('rows', '?')} rows, finished {rec.get('finished_at', '?')}); nothing to do", flush=True)
        return 0
    from pipeline.report import format_run_report

    summary = result.summary
    if result.resumed_shards:
        print(f"resumed an interrupted scan: {result.resumed_shards} shard(s) were already committed")
    if result.previous:
        print(f"previous: {result.previous} ({summary.carried} unchanged row(s) carried over)")
    print(format_run_report(summary.report))
    if result.drift:
        d = result.drift
        print(f"quality against {d['against']}: PSI {d['psi']:.3f}, label JS {d['js_divergence']:.3f}: "
              + ("no threshold crossed" if d["passed"] else "DRIFT: " + "; ".join(b["message"] for b in d["breaches"])))
    counts = "  ".join(f"{k} {v}" for k, v in sorted(summary.counts.items()))
    print(f"nightly scan {DATE_PREFIX}{result.date} complete: {summary.total} rows ({counts}) -> {result.dest}",
          flush=True)
    return 0


def _progress_printer() -> Callable[[int, "int | None", int], None]:
    last = [0.0]

    def show(done: int, total: int | None, errors: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            print(f"progress: {done}/{total if total is not None else '?'} rows, {errors} errors", flush=True)

    return show


def _open(url: str, storage_options: Mapping[str, Any] | None):
    from pipeline.source import open_fs

    return open_fs(url, storage_options)


if __name__ == "__main__":
    sys.exit(main())
