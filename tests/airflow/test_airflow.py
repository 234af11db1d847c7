"""The nightly DAG under real Airflow (the separate .venv-airflow): it loads, and its task drives a real Ray job."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from support.paths import REPO

AIRFLOW_VENV = REPO / ".venv-airflow"
DAGS = REPO / "infra" / "airflow" / "dags"
DAG_ID = "bulk_classify_nightly"
TASK_ID = "nightly_scan"
GATE_TASK_ID = "quality_gate"



@pytest.fixture(scope="session", autouse=True)
def airflow_venv():
    """Airflow's own virtualenv (its pins clash with ours), made once by infra/airflow/setup_venv.sh where it is
    missing; the script leaves a ready one as it is."""
    proc = subprocess.run(["bash", str(REPO / "infra" / "airflow" / "setup_venv.sh")], capture_output=True, text=True,
                          timeout=1800, env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    assert proc.returncode == 0 and (AIRFLOW_VENV / "bin" / "airflow").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory):
    """AIRFLOW_HOME of its own with a migrated sqlite database, the repo's DAG folder, no examples."""
    home = tmp_path_factory.mktemp("airflow_home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "RAY_"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__DAGS_FOLDER=str(DAGS), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               PATH=f"{AIRFLOW_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    proc = subprocess.run([str(AIRFLOW_VENV / "bin" / "airflow"), "db", "migrate"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return env


def airflow_python(env: dict, code: str) -> dict:
    proc = subprocess.run([str(AIRFLOW_VENV / "bin" / "python"), "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_dag_loads_without_import_errors_with_the_expected_task(airflow_env):
    got = airflow_python(airflow_env, f"""
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag({str(DAGS)!r})
dag = bag.dags.get({DAG_ID!r})
sys.path.insert(0, {str(DAGS)!r})
import bulk_classify_nightly as m
cfg = m.scan_config({{"source": "s3://in/x", "output_root": "s3://out/y/"}}, {{"args": ["--no-previous"]}})
local = m.scan_config({{"source": "s3://in/x", "output_root": "s3://o", "working_dir": "."}}, {{"source": "s3://in/z"}})
print(json.dumps({{
    "errors": {{k: str(v) for k, v in bag.import_errors.items()}},
    "dags": sorted(bag.dags),
    "tasks": [t.task_id for t in dag.tasks],
    "retries": dag.get_task({TASK_ID!r}).retries,
    "timetable": dag.timetable.expression,
    "max_active_runs": dag.max_active_runs,
    "catchup": dag.catchup,
    "ids": [m.submission_id("2026-11-29"), m.submission_id("2026-11-29", 3)],
    "entrypoint": m.entrypoint(cfg, "2026-11-29"),
    "local": m.entrypoint(local, "2026-11-29"),
    "downstream": sorted(dag.get_task({TASK_ID!r}).downstream_task_ids),
    "gate": m.gate_entrypoint({{**cfg, "gate_args": ["--js-max", "0.1"]}}, "2026-11-29"),
    "check": m.check_entrypoint({{**cfg, "model_check": "/models/prod", "model_check_args": ["--sample", "8"]}}),
}}))
""")
    assert got["errors"] == {}
    assert got["dags"] == [DAG_ID]
    assert got["tasks"] == [TASK_ID, GATE_TASK_ID]
    assert got["downstream"] == [GATE_TASK_ID]
    assert got["gate"] == ("python -m pipeline.cli report s3://out/y/date=2026-11-29 --against previous "
                           "--js-max 0.1")
    assert got["check"] == "python -m pipeline.cli model check /models/prod --sample 8"
    assert got["retries"] >= 1 and got["max_active_runs"] == 1 and got["catchup"] is False
    assert got["timetable"] == "0 2 * * *"
    assert got["ids"] == ["bulk-classify-nightly-2026-11-29", "bulk-classify-nightly-2026-11-29-attempt-3"]
    # no working_dir: the copy in the worker image; params override the Variable
    assert got["entrypoint"] == ("python /opt/bulk-classify/jobs/nightly_scan.py --source s3://in/x "
                                 "--output-root s3://out/y/ --date 2026-11-29 --no-previous")
    assert got["local"] == "python jobs/nightly_scan.py --source s3://in/z --output-root s3://o --date 2026-11-29"


def dag_run_env(env: dict, cluster, s3_server, source: str, output_root: str) -> dict:
    """The DAG's Ray connection (this cluster, its token) and its scan variable (moto S3, one actor)."""
    scan = {
        "source": source,
        "output_root": output_root,
        "working_dir": str(REPO),
        "args": ["--num-actors", "1"],
        "env_vars": {"AWS_ENDPOINT_URL": s3_server.url, "AWS_ACCESS_KEY_ID": "testing",
                     "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"},
        "poll_s": 1,
    }
    host = cluster.address.removeprefix("http://")
    return {**env, "AIRFLOW_CONN_RAY_DEFAULT": f"http://:{cluster.token}@{host}",
            "AIRFLOW_VAR_BULK_CLASSIFY_NIGHTLY": json.dumps(scan)}


def run_task(env: dict, day: str, cluster, s3_server, source: str) -> subprocess.CompletedProcess:
    task_env = dag_run_env(env, cluster, s3_server, source, "s3://airflow-out/nightly")
    return subprocess.run([str(AIRFLOW_VENV / "bin" / "airflow"), "tasks", "test", DAG_ID, TASK_ID, day],
                          env=task_env, capture_output=True, text=True, timeout=400)


def final_state(out: str) -> str:
    """The task instance's last state in `airflow tasks test` output (its exit status is 0 either way)."""
    states = re.findall(r"new_state=(\w+)", out)
    assert states, out[-4000:]
    return states[-1]


def nightly_jobs(cluster, day: str) -> dict[str, str]:
    prefix = f"bulk-classify-nightly-{day}"
    return {j.submission_id: str(j.status.value) for j in cluster.client().list_jobs()
            if (j.submission_id or "").startswith(prefix)}


def test_task_submits_waits_and_a_retry_attaches_instead_of_resubmitting(airflow_env, ray_cluster, s3,  # noqa: F811
                                                                      s3_server):
    s3.create_bucket(Bucket="airflow-src")
    s3.create_bucket(Bucket="airflow-out")
    photos = sorted((REPO / "tests" / "data" / "photos").glob("*.jpg"))[:4]
    for p in photos:
        s3.put_object(Bucket="airflow-src", Key=f"in/{p.name}", Body=p.read_bytes())

    proc = run_task(airflow_env, "2026-11-26", ray_cluster, s3_server, "s3://airflow-src/in")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and final_state(out) == "success", out[-4000:]
    assert nightly_jobs(ray_cluster, "2026-11-26") == {"bulk-classify-nightly-2026-11-26": "SUCCEEDED"}
    success = json.loads(s3.get_object(Bucket="airflow-out", Key="nightly/date=2026-11-26/_SUCCESS")["Body"].read())
    assert success["counts"] == {"ok": len(photos), "error": 0}

    # A retry of the task for the same logical date finds the job and does not start another.
    proc = run_task(airflow_env, "2026-11-26", ray_cluster, s3_server, "s3://airflow-src/in")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and final_state(out) == "success", out[-4000:]
    assert "already SUCCEEDED; attaching instead of submitting again" in out
    assert nightly_jobs(ray_cluster, "2026-11-26") == {"bulk-classify-nightly-2026-11-26": "SUCCEEDED"}


def test_task_fails_when_the_job_fails_and_the_retry_submits_a_new_attempt(airflow_env, ray_cluster,  # noqa: F811
                                                                         s3_server):
    proc = run_task(airflow_env, "2026-11-25", ray_cluster, s3_server, "s3://no-such-bucket-here/in")
    out = proc.stdout + proc.stderr
    assert final_state(out) == "up_for_retry", out[-4000:]  # failed; Airflow will retry it
    assert "Ray job bulk-classify-nightly-2026-11-25 ended FAILED" in out
    # the job's own error reaches the task's failure message
    assert re.search(r"Error: .*no-such-bucket-here", out), out[-5000:]  # `bulk-classify nightly`'s one line
    proc = run_task(airflow_env, "2026-11-25", ray_cluster, s3_server, "s3://no-such-bucket-here/in")
    assert final_state(proc.stdout + proc.stderr) == "up_for_retry"
    assert nightly_jobs(ray_cluster, "2026-11-25") == {"bulk-classify-nightly-2026-11-25": "FAILED",
                                                       "bulk-classify-nightly-2026-11-25-attempt-2": "FAILED"}


def run_dag(env: dict, day: str, cluster, s3_server, source: str, output_root: str) -> subprocess.CompletedProcess:
    """`airflow dags test`: the whole DAG for one logical date, scan then quality gate, in this process tree."""
    dag_env = dag_run_env(env, cluster, s3_server, source, output_root)
    return subprocess.run([str(AIRFLOW_VENV / "bin" / "airflow"), "dags", "test", DAG_ID, day],
                          env=dag_env, capture_output=True, text=True, timeout=500)


def task_states(env: dict, day: str) -> dict[str, str]:
    """Each task's state in the DAG run of logical date ``day``, from Airflow's own database."""
    return airflow_python(env, f"""
import json
from airflow.models.dagrun import DagRun
from airflow.utils.session import create_session
with create_session() as session:
    runs = [r for r in session.query(DagRun).filter(DagRun.dag_id == {DAG_ID!r})
            if r.logical_date is not None and r.logical_date.date().isoformat() == {day!r}]
    assert len(runs) == 1, runs
    print(json.dumps({{ti.task_id: str(ti.state) for ti in runs[0].get_task_instances(session=session)}}))
""")


@pytest.mark.slow
def test_quality_gate_passes_on_an_unchanged_night_and_fails_on_an_altered_one(airflow_env, ray_cluster,  # noqa: F811
                                                                              s3, s3_server):
    from support.alterations import recompress

    s3.create_bucket(Bucket="gate-src")
    s3.create_bucket(Bucket="gate-out")
    images = sorted((REPO / "tests" / "data" / "parity" / "inputs").glob("*.jpg"))[:40]
    for p in images:
        s3.put_object(Bucket="gate-src", Key=f"in/{p.name}", Body=p.read_bytes())
    args = (ray_cluster, s3_server, "s3://gate-src/in", "s3://gate-out/nightly")

    # The first night has nothing to compare with; the second, unchanged (every row carried), shows no drift.
    for day in ("2026-11-20", "2026-11-21"):
        proc = run_dag(airflow_env, day, *args)
        out = proc.stdout + proc.stderr
        assert task_states(airflow_env, day) == {TASK_ID: "success", GATE_TASK_ID: "success"}, out[-5000:]
    report = json.loads(s3.get_object(Bucket="gate-out", Key="nightly/date=2026-11-21/_REPORT.json")["Body"].read())
    assert report["carried"] == len(images)
    assert report["drift"]["against"] == "s3://gate-out/nightly/date=2026-11-20" and report["drift"]["psi"] == 0
    assert "gate: passed" in out

    # The third night's uploads were recompressed hard: every object changed, so all are classified again.
    for p in images:
        s3.put_object(Bucket="gate-src", Key=f"in/{p.name}", Body=recompress(p.read_bytes()))
    proc = run_dag(airflow_env, "2026-11-22", *args)
    out = proc.stdout + proc.stderr
    assert task_states(airflow_env, "2026-11-22") == {TASK_ID: "success", GATE_TASK_ID: "failed"}, out[-5000:]
    assert "quality gate: drift in s3://gate-out/nightly/date=2026-11-22 against the previous night" in out
    report = json.loads(s3.get_object(Bucket="gate-out", Key="nightly/date=2026-11-22/_REPORT.json")["Body"].read())
    assert report["classified"] == len(images) and report["drift"]["passed"] is False
    print(f"altered night: PSI {report['drift']['psi']:.3f}  JS {report['drift']['js_divergence']:.3f}")
