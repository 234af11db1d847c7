"""Airflow DAG of the nightly scan: submit ``jobs/nightly_scan.py`` to a Ray cluster, wait, then gate on drift.

Two tasks: ``nightly_scan`` (fails when the job fails) and then ``quality_gate``, a short Ray job running
``bulk-classify report DEST --against previous``: it compares the night with the previous completed date (top-1
confidence PSI, label JS divergence, error rates; thresholds in the README's "Quality gate") and the task fails,
without retries, when a threshold is crossed (exit status 3), so downstream consumers never read a drifted night.

Setup (Airflow 3; the task only needs the Ray job client, installed by ``infra/airflow/setup_venv.sh``):

* Cluster address, first match wins: Variable ``bulk_classify_ray_address`` (``http://HEAD:8265``), or
  connection ``ray_default`` (type http, host HEAD, port 8265, password = the cluster's auth token if it
  has one), e.g. ``AIRFLOW_CONN_RAY_DEFAULT=http://:TOKEN@ray-head.svc:8265``.
* Variable ``bulk_classify_nightly`` (JSON), overridable per run by the DAG params / ``dag_run.conf``::

      {"source": "s3://photos/incoming", "output_root": "s3://labels/nightly",
       "args": ["--shard-size", "2000"],                      # more nightly_scan.py options
       "working_dir": null,                                   # a checkout to upload; null: the image's copy
       "script": null,                                        # default: jobs/nightly_scan.py in working_dir,
                                                              #   else /opt/bulk-classify/jobs/... (image)
       "env_vars": {"AWS_REGION": "eu-west-1"},               # the job's environment (runtime_env)
       "gate_args": ["--psi-max", "0.25"],                    # more `bulk-classify report` options
       "model_check": "/models/prod",                         # check this model folder first (null: no check)
       "model_check_args": ["--images", "s3://photos/sample"],  # more `bulk-classify model check` options
       "poll_s": 30}

The job runs the default engine (``auto``): the triton engine's gpu profile where the Ray cluster has GPUs,
onnx elsewhere, so ``args`` needs no engine option for the GPU path.

With ``model_check`` set, the scan task first runs ``bulk-classify model check`` on that folder as a Ray job (on the
cluster's nodes, so the GPU engines are compared too); a broken contract or an engine off the reference fails the task
without retries and before the night's job starts.

Why no operator from a provider: Airflow ships no maintained Ray provider (Astronomer's astro-provider-ray
is deprecated), so the task calls Ray's own ``JobSubmissionClient``, the API ``ray job submit`` uses.

Idempotence: the submission id is ``bulk-classify-nightly-<logical date>``. A retry of the task looks
that id up first and waits on the job it finds (running, pending or succeeded) instead of starting a
second one; only when the earlier job FAILED or was STOPPED does it submit ``...-attempt-N``, which
resumes the date (the script skips what is committed). Killing the task leaves the Ray job running, so
the retry re-attaches to it.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

from airflow.sdk import Connection, Param, Variable, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowException, AirflowFailException

LOG = logging.getLogger(__name__)

DAG_ID = "bulk_classify_nightly"
TASK_ID = "nightly_scan"
GATE_TASK_ID = "quality_gate"
GATE_PREFIX = "bulk-classify-gate"
DRIFT_EXIT_CODE = 3  # `bulk-classify report --against`: a threshold was crossed (pipeline/quality/statistics.py)
CONN_ID = "ray_default"
ADDRESS_VARIABLE = "bulk_classify_ray_address"
TOKEN_VARIABLE = "bulk_classify_ray_token"
CONFIG_VARIABLE = "bulk_classify_nightly"
SUBMISSION_PREFIX = "bulk-classify-nightly"
DEFAULT_SCRIPT = "jobs/nightly_scan.py"  # relative to an uploaded working_dir
IMAGE_SCRIPT = "/opt/bulk-classify/jobs/nightly_scan.py"  # where the worker image (infra/docker) keeps it
DEFAULT_PORT = 8265
MAX_ATTEMPTS = 20
LIVE = ("PENDING", "RUNNING")
DEFAULTS: dict[str, Any] = {
    "source": None,
    "output_root": None,
    "args": [],
    "script": None,  # DEFAULT_SCRIPT with a working_dir, else IMAGE_SCRIPT
    "working_dir": None,
    "env_vars": {},
    "gate_args": [],
    "model_check": None,  # a model folder to check before the scan
    "model_check_args": [],
    "poll_s": 30,
}
CHECK_PREFIX = "bulk-classify-model-check"


def ray_address() -> tuple[str, dict[str, str]]:
    """The Ray job API address and auth headers: the Variable, else the ``ray_default`` connection.

    A cluster with token auth (``RAY_AUTH_MODE=token``) needs its token: the connection's password, else
    Variable ``bulk_classify_ray_token``, else ``RAY_AUTH_TOKEN`` in the worker's environment.
    """
    address = Variable.get(ADDRESS_VARIABLE, default=None)
    password = None
    if address:
        address = str(address).rstrip("/")
    else:
        try:
            conn = Connection.get(CONN_ID)
        except Exception as err:  # noqa: BLE001  (the SDK raises its own not-found error type)
            raise AirflowException(
                f"no Ray cluster address: set Variable {ADDRESS_VARIABLE}=http://HEAD:8265 or connection "
                f"{CONN_ID} (AIRFLOW_CONN_{CONN_ID.upper()}=http://HEAD:8265) ({type(err).__name__}: {err})"
            ) from None
        if not conn.host:
            raise AirflowException(f"connection {CONN_ID} has no host; set it to the Ray head, e.g. http://HEAD:8265")
        host = str(conn.host)
        if "://" in host:
            address = host.rstrip("/") if conn.port is None else f"{host.rstrip('/')}:{conn.port}"
        else:
            scheme = "https" if (conn.schema == "https" or conn.conn_type == "https") else "http"
            address = f"{scheme}://{host}:{conn.port or DEFAULT_PORT}"
        password = conn.password
    token = password or Variable.get(TOKEN_VARIABLE, default=None) or os.environ.get("RAY_AUTH_TOKEN")
    return address, ({"Authorization": f"Bearer {token}"} if token else {})


def scan_config(variable: Mapping[str, Any] | None, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Defaults < Variable ``bulk_classify_nightly`` < the run's params (unset params ignored)."""
    cfg = {**DEFAULTS, **dict(variable or {})}
    cfg.update({k: v for k, v in dict(params or {}).items() if v not in (None, "", [], {})})
    missing = [k for k in ("source", "output_root") if not cfg.get(k)]
    if missing:
        raise AirflowException(f"nightly scan needs {', '.join(missing)}: set them in Variable {CONFIG_VARIABLE} "
                               f'(JSON, e.g. {{"source": "s3://bucket/in", "output_root": "s3://bucket/out"}})')
    if not cfg.get("script"):
        cfg["script"] = DEFAULT_SCRIPT if cfg.get("working_dir") else IMAGE_SCRIPT
    for key in ("args", "gate_args", "model_check_args"):
        if not isinstance(cfg[key], list):
            raise AirflowException(f"{CONFIG_VARIABLE}.{key} must be a list of strings, got {cfg[key]!r}")
    return cfg


def submission_id(day: str, attempt: int = 1) -> str:
    """Ray submission id of a date's ``attempt``-th job: stable, so a retried task finds its job."""
    base = f"{SUBMISSION_PREFIX}-{day}"
    return base if attempt == 1 else f"{base}-attempt-{attempt}"


def entrypoint(cfg: Mapping[str, Any], day: str) -> str:
    """The shell command Ray runs: the nightly script for ``day`` with the configured options."""
    argv = ["python", cfg["script"], "--source", cfg["source"], "--output-root", cfg["output_root"], "--date", day]
    return shlex.join(argv + [str(a) for a in cfg["args"]])


def gate_entrypoint(cfg: Mapping[str, Any], day: str) -> str:
    """The shell command of the quality gate: the night's output compared with the night it recorded."""
    argv = ["python", "-m", "pipeline.cli", "report", date_dest(cfg, day), "--against", "previous"]
    return shlex.join(argv + [str(a) for a in cfg["gate_args"]])


def check_entrypoint(cfg: Mapping[str, Any]) -> str:
    """The shell command of the model check run before the scan."""
    argv = ["python", "-m", "pipeline.cli", "model", "check", str(cfg["model_check"])]
    return shlex.join(argv + [str(a) for a in cfg["model_check_args"]])


def date_dest(cfg: Mapping[str, Any], day: str) -> str:
    return f"{str(cfg['output_root']).rstrip('/')}/date={day}"


def runtime_env(cfg: Mapping[str, Any]) -> dict[str, Any]:
    env: dict[str, Any] = {"env_vars": {str(k): str(v) for k, v in dict(cfg["env_vars"]).items()}}
    if cfg.get("working_dir"):
        env["working_dir"] = cfg["working_dir"]
    return env


def submit_or_attach(client: Any, cfg: Mapping[str, Any], day: str) -> str:
    """Return the id of the date's live or successful job, submitting a new attempt only when none is."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        sid = submission_id(day, attempt)
        status = _status_or_none(client, sid)
        if status is None:
            try:
                client.submit_job(entrypoint=entrypoint(cfg, day), submission_id=sid, runtime_env=runtime_env(cfg),
                                  metadata={"dag_id": DAG_ID, "date": day, "attempt": str(attempt)})
            except RuntimeError:
                if _status_or_none(client, sid) is None:  # not a lost race with another submitter
                    raise
                LOG.info("job %s appeared while submitting; attaching to it", sid)
                return sid
            LOG.info("submitted Ray job %s: %s", sid, entrypoint(cfg, day))
            return sid
        if status in LIVE or status == "SUCCEEDED":
            LOG.info("Ray job %s is already %s; attaching instead of submitting again", sid, status)
            return sid
        LOG.info("Ray job %s ended %s; the next attempt resumes the date", sid, status)
    raise AirflowException(f"{MAX_ATTEMPTS} jobs for {day} failed; fix the cause (see `ray job logs "
                           f"{submission_id(day, MAX_ATTEMPTS)}`) and clear this task")


def wait_for(client: Any, sid: str, poll_s: float) -> str:
    """Poll until the job ends; return its final status name."""
    last = None
    while True:
        status = _status_name(client.get_job_status(sid))
        if status != last:
            LOG.info("Ray job %s: %s", sid, status)
            last = status
        if status not in LIVE:
            return status
        time.sleep(poll_s)


def run_nightly_scan(address: str, cfg: Mapping[str, Any], day: str,
                     headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Submit (or re-attach to) the date's job, wait for it, raise when it did not succeed."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address, headers=dict(headers or {}))
    if cfg.get("model_check"):
        check_model(client, cfg, day)
    sid = submit_or_attach(client, cfg, day)
    status = wait_for(client, sid, float(cfg.get("poll_s") or 30))
    logs = client.get_job_logs(sid)
    tail = "\n".join(logs.splitlines()[-40:])
    LOG.info("last lines of Ray job %s:\n%s", sid, tail)
    if status != "SUCCEEDED":
        info = client.get_job_info(sid)
        raise AirflowException(f"Ray job {sid} ended {status}: {info.message or ''}; "
                               f"see `ray job logs {sid}` (last lines above)")
    return {"submission_id": sid, "status": status, "date": day, "dest": date_dest(cfg, day)}


def check_model(client: Any, cfg: Mapping[str, Any], day: str) -> None:
    """Runs ``bulk-classify model check`` as a Ray job; AirflowFailException (no retry) when the model fails it."""
    sid = f"{CHECK_PREFIX}-{day}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%f}"
    client.submit_job(entrypoint=check_entrypoint(cfg), submission_id=sid, runtime_env=runtime_env(cfg),
                      metadata={"dag_id": DAG_ID, "date": day, "task": "model_check"})
    status = wait_for(client, sid, float(cfg.get("poll_s") or 30))
    logs = client.get_job_logs(sid)
    LOG.info("model check of %s:\n%s", cfg["model_check"], "\n".join(logs.splitlines()[-40:]))
    if status != "SUCCEEDED":
        error = next((line for line in reversed(logs.splitlines()) if line.startswith("Error: ")), status)
        raise AirflowFailException(f"model check of {cfg['model_check']} failed ({error}); fix the model folder "
                                   f"or unset {CONFIG_VARIABLE}.model_check, then clear this task")


def run_quality_gate(address: str, cfg: Mapping[str, Any], day: str,
                     headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run the night's drift check as a Ray job; AirflowFailException (no retry) on drift.

    Each run is a new job (the check only reads, and reading again is the point of a rerun). A job that fails
    for another reason (storage unreachable, no recorded comparison) raises AirflowException, so it retries.
    """
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address, headers=dict(headers or {}))
    sid = f"{GATE_PREFIX}-{day}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%f}"
    client.submit_job(entrypoint=gate_entrypoint(cfg, day), submission_id=sid, runtime_env=runtime_env(cfg),
                      metadata={"dag_id": DAG_ID, "date": day, "task": GATE_TASK_ID})
    LOG.info("submitted quality gate %s: %s", sid, gate_entrypoint(cfg, day))
    status = wait_for(client, sid, float(cfg.get("poll_s") or 30))
    logs = client.get_job_logs(sid)
    LOG.info("comparison of %s with the previous night:\n%s", date_dest(cfg, day), "\n".join(logs.splitlines()[-40:]))
    if status == "SUCCEEDED":
        return {"submission_id": sid, "date": day, "dest": date_dest(cfg, day), "passed": True}
    message = client.get_job_info(sid).message or ""
    if f"exit code {DRIFT_EXIT_CODE}" in message:
        drift = [line.split("DRIFT: ", 1)[1] for line in logs.splitlines() if "DRIFT: " in line]
        raise AirflowFailException(
            f"quality gate: drift in {date_dest(cfg, day)} against the previous night: {'; '.join(drift)}. "
            f"Look at the night (`bulk-classify report {date_dest(cfg, day)} --against previous --html drift.html`); "
            f"if the change is expected, loosen {CONFIG_VARIABLE}.gate_args (e.g. --js-max) and clear this task")
    raise AirflowException(f"quality gate job {sid} ended {status}: {message[:2000]}; see `ray job logs {sid}`")


def scan_day(context: Mapping[str, Any]) -> str:
    """The date to scan: the run's logical date (UTC), or when it has none (manual run) the run's start."""
    when = context.get("logical_date") or getattr(context.get("dag_run"), "run_after", None)
    when = when or datetime.now(timezone.utc)
    return when.astimezone(timezone.utc).date().isoformat()


def _status_or_none(client: Any, sid: str) -> str | None:
    try:
        return _status_name(client.get_job_status(sid))
    except RuntimeError as err:  # the job API answers 404 for an unknown submission id
        if "does not exist" in str(err) or "404" in str(err):
            return None
        raise


def _status_name(status: Any) -> str:
    return str(getattr(status, "value", status))


@dag(
    dag_id=DAG_ID,
    schedule="0 2 * * *",  # 02:00 UTC; the logical date is the scan date
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    tags=["bulk-classify", "ray"],
    params={
        "source": Param(None, type=["null", "string"], description="overrides the Variable's source"),
        "output_root": Param(None, type=["null", "string"], description="overrides the Variable's output_root"),
        "args": Param([], type="array", description="extra nightly_scan.py options, e.g. ['--no-previous']"),
    },
    doc_md=__doc__,
)
def bulk_classify_nightly():
    @task(task_id=TASK_ID, retries=2, retry_delay=timedelta(minutes=5), execution_timeout=timedelta(hours=12))
    def nightly_scan() -> dict[str, Any]:
        context = get_current_context()
        cfg = scan_config(Variable.get(CONFIG_VARIABLE, default=None, deserialize_json=True), context.get("params"))
        address, headers = ray_address()
        return run_nightly_scan(address, cfg, scan_day(context), headers)

    @task(task_id=GATE_TASK_ID, retries=1, retry_delay=timedelta(minutes=2), execution_timeout=timedelta(hours=1))
    def quality_gate() -> dict[str, Any]:
        context = get_current_context()
        cfg = scan_config(Variable.get(CONFIG_VARIABLE, default=None, deserialize_json=True), context.get("params"))
        address, headers = ray_address()
        return run_quality_gate(address, cfg, scan_day(context), headers)

    nightly_scan() >> quality_gate()


bulk_classify_nightly()
