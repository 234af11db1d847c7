"""The nightly scan (`bulk-classify nightly`, pipeline/nightly.py): its date/previous/config logic, and real
`ray job submit` runs of jobs/nightly_scan.py against moto S3."""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import textwrap

import pyarrow.parquet as pq
import pytest

from click.testing import CliRunner

from pipeline.cli import main
from pipeline.cli import run as cli_run
from pipeline import nightly as ns
from pipeline.errors import ConfigError
from pipeline.job.plan import resolve
from support.paths import REPO

PHOTOS = REPO / "tests" / "data" / "photos"


def parse_args(argv: list[str]) -> dict:
    """What `bulk-classify nightly ARGV` hands to nightly_scan."""
    params = dict(cli_run.nightly.make_context("nightly", list(argv)).params)
    params.pop("quiet")
    return cli_run.nightly_options(params.pop("config_file"), params.pop("no_previous"), params)


# --- the nightly logic, no cluster -------------------------------------------------------------------


def test_scan_date_defaults_to_today_utc_and_rejects_bad_dates():
    from datetime import datetime, timedelta, timezone

    late_evening_in_la = datetime(2026, 11, 28, 23, 30, tzinfo=timezone(timedelta(hours=-8)))
    assert ns.scan_date(None, now=late_evening_in_la) == "2026-11-29"
    assert ns.scan_date("2026-02-28") == "2026-02-28"
    with pytest.raises(ConfigError, match="not YYYY-MM-DD; write e.g. --date"):
        ns.scan_date("29/11/2026")
    with pytest.raises(ConfigError, match="not a calendar date"):
        ns.scan_date("2026-02-30")


def test_find_previous_takes_the_latest_earlier_completed_date(tmp_path):
    for day, complete in [("2026-11-20", True), ("2026-11-25", True), ("2026-11-26", False),
                          ("2026-11-28", True), ("2026-11-30", True)]:
        folder = tmp_path / f"date={day}"
        folder.mkdir()
        if complete:
            (folder / "_SUCCESS").write_text("{}")
    (tmp_path / "date=garbage").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    root = str(tmp_path)
    assert ns.find_previous(root, "2026-11-28") == f"{root}/date=2026-11-25"  # 11-26 was interrupted
    assert ns.find_previous(root, "2026-11-29") == f"{root}/date=2026-11-28"
    assert ns.find_previous(root, "2026-11-20") is None
    assert ns.find_previous(str(tmp_path / "missing"), "2026-11-29") is None


def test_completed_date_is_not_run_again(tmp_path):
    dest = tmp_path / "date=2026-11-28"
    dest.mkdir()
    (dest / "_SUCCESS").write_text(json.dumps({"rows": 7, "finished_at": "2026-11-28T03:00:00+00:00"}))
    before = sorted(p.name for p in dest.iterdir())
    result = ns.nightly_scan({"source": str(PHOTOS), "output_root": str(tmp_path), "date": "2026-11-28"})
    assert result.status == "already_complete" and result.summary is None
    assert result.success["rows"] == 7
    assert sorted(p.name for p in dest.iterdir()) == before


def test_options_come_from_config_file_then_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "nightly.yaml"
    cfg.write_text("source: s3://in/photos\noutput_root: s3://out/nightly\nengine: triton\nbatch_size: 32\n"
                   "storage_options: {anon: false}\n")
    opts = parse_args(["--config", str(cfg), "--batch-size", "8", "--storage-option", "use_ssl=false",
                          "--no-previous", "--extensions", "jpg,png"])
    assert opts["source"] == "s3://in/photos" and opts["engine"] == "triton"
    assert opts["batch_size"] == 8  # the flag wins over the file
    assert opts["storage_options"] == {"anon": False, "use_ssl": False}
    assert opts["previous"] == "none" and opts["extensions"] == ("jpg", "png")
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: x\nbatchsize: 3\n")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['batchsize'\]"):
        parse_args(["--config", str(bad)])


def test_missing_required_options_say_how_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="--output-root is required"):
        ns.nightly_scan({"source": str(PHOTOS)})
    with pytest.raises(ConfigError, match="give --output-root, not output"):
        ns.nightly_scan({"source": str(PHOTOS), "output_root": str(tmp_path), "output": str(tmp_path)})
    result = CliRunner().invoke(main, ["nightly", "--source", str(PHOTOS)])
    assert result.exit_code == 2 and "--output-root is required" in result.output


def test_example_config_is_valid():
    from pipeline.config import RunConfig

    opts = ns.load_options_file(str(REPO / "jobs" / "nightly.example.yaml"))
    assert opts["source"].startswith("s3://") and opts["output_root"].startswith("s3://")
    run_opts = {k: v for k, v in opts.items() if k not in ns.NIGHTLY_KEYS}
    config = RunConfig.build({**run_opts, "source": opts["source"], "output": "s3://x/date=2026-11-29"}, env={})
    # the default engine: triton (its gpu shape) on a cluster with GPUs, onnx without
    assert config.engine == "auto" and config.batch_size is None and config.num_gpus_per_actor is None
    assert resolve(config, 4, "the Ray cluster")[0].engine == "triton"
    assert resolve(config, 0)[0].engine == "onnx"


# --- real `ray job submit` against a real local Ray cluster and moto S3 ---------------------------------


def s3_listing(s3, bucket: str, prefix: str) -> dict[str, tuple[str, str]]:
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = (o["ETag"], o["LastModified"].isoformat())
    return out


def read_output(s3, bucket: str, prefix: str):
    import pyarrow as pa

    tables = []
    for key in s3_listing(s3, bucket, prefix):
        if key.rsplit("/", 1)[-1].startswith("part-"):
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            tables.append(pq.read_table(io.BytesIO(body)))
    return pa.concat_tables(tables)


def read_json(s3, bucket: str, key: str) -> dict:
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def documented_submit() -> str:
    """The `ray job submit` lines of infra/README.md, exactly as written there."""
    text = (REPO / "infra" / "README.md").read_text()
    block = re.search(r"\n((?:    .*\n)*    ray job submit .*\n(?:    .*\n)*)", text).group(1)
    return textwrap.dedent(block)


def submit(cluster, s3_server, sid: str, *args: str, auth: bool = True) -> str:
    """infra/README.md's `ray job submit` lines as written: HEAD, the source and the output root filled in, the
    test's flags appended, its job id and S3 endpoint added; returns the job's logs."""
    env = {"AWS_ENDPOINT_URL": s3_server.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    options = dict(zip(args[::2], args[1::2]))
    command = documented_submit()
    assert "export RAY_AUTH_MODE=token\n" in command and "http://HEAD:8265" in command
    if not auth:
        command = command.replace("export RAY_AUTH_MODE=token\n", "")
    command = command.replace("http://HEAD:8265", cluster.address)
    command = command.replace("--source s3://photos/incoming", f"--source {options.pop('--source')}")
    command = command.replace("--output-root s3://labels/nightly", f"--output-root {options.pop('--output-root')}")
    command = command.replace("ray job submit", "ray job submit --submission-id " + sid + " --runtime-env-json "
                              + shlex.quote(json.dumps({"env_vars": env})), 1)
    command = command.rstrip("\n") + " " + " ".join(f"{k} {shlex.quote(v)}" for k, v in options.items())
    # The client gets the cluster's token as the README says (RAY_AUTH_TOKEN), and auth mode only from the lines.
    shell_env = {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_MODE"}
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=shell_env, capture_output=True, text=True,
                          timeout=300)
    if not auth:
        return proc.stdout + proc.stderr
    status = cluster.job_status(sid)
    logs = cluster.ray("job", "logs", "--address", cluster.address, sid).stdout
    assert status == "SUCCEEDED", f"job {sid} did not succeed:\n{status}\n{logs[-3000:]}\n{proc.stderr[-2000:]}"
    return logs


@pytest.fixture(scope="module")
def photo_bucket(s3):
    s3.create_bucket(Bucket="nightly-src")
    s3.create_bucket(Bucket="nightly-out")
    for path in sorted(PHOTOS.glob("*.jpg")):
        s3.put_object(Bucket="nightly-src", Key=f"photos/{path.name}", Body=path.read_bytes())
    s3.put_object(Bucket="nightly-src", Key="photos/broken.jpg", Body=b"\xff\xd8\xff\xe0 not really a jpeg")
    return "nightly-src"


def test_ray_job_submit_nightly_scan_is_idempotent_resumes_and_carries_over(ray_cluster, s3_server, s3,  # noqa: F811
                                                                         photo_bucket):
    n_photos = len(list(PHOTOS.glob("*.jpg")))
    common = ["--source", "s3://nightly-src/photos", "--output-root", "s3://nightly-out/scans",
              "--num-actors", "1", "--shard-size", "4"]
    day1 = "scans/date=2026-11-27/"

    # 0. The documented command without its `export RAY_AUTH_MODE=token` line: Ray 2.60 refuses it.
    refused = submit(ray_cluster, s3_server, "nightly-no-auth", *common, "--date", "2026-11-27", auth=False)
    assert "Missing authentication token" in refused, refused[-2000:]

    # 1. First submission for the date: classifies everything.
    logs = submit(ray_cluster, s3_server, "nightly-2026-11-27", *common, "--date", "2026-11-27")
    assert "nightly scan date=2026-11-27 complete" in logs
    table = read_output(s3, "nightly-out", day1)
    assert table.num_rows == n_photos + 1
    statuses = table.column("status").to_pylist()
    assert statuses.count("ok") == n_photos and statuses.count("error") == 1
    assert sorted(table.column("uri").to_pylist()) == sorted(
        [f"s3://nightly-src/photos/{p.name}" for p in PHOTOS.glob("*.jpg")] + ["s3://nightly-src/photos/broken.jpg"])
    report = read_json(s3, "nightly-out", day1 + "_REPORT.json")
    # The report agrees with the Parquet output.
    assert report["counts"] == {"ok": n_photos, "error": 1}
    assert report["images"] == table.num_rows and report["classified"] == table.num_rows
    assert sum(report["error_kinds"].values()) == 1
    assert report["avg_batch_size"] and report["avg_batch_size"] > 0 and report["images_per_s"] > 0
    assert set(report["stage_seconds"]) == {"list", "fetch", "decode_preprocess", "infer", "write"}
    assert read_json(s3, "nightly-out", day1 + "_SUCCESS")["counts"] == {"ok": n_photos, "error": 1}
    assert report["drift"] is None  # the first night has nothing to be compared with
    assert report["quality"]["rows"] == n_photos + 1 and report["quality"]["error_kinds"] == report["error_kinds"]

    # 2. Second submission for the completed date: says so and changes nothing.
    before = s3_listing(s3, "nightly-out", day1)
    logs = submit(ray_cluster, s3_server, "nightly-2026-11-27-again", *common, "--date", "2026-11-27")
    assert "already complete" in logs and "nothing to do" in logs
    assert s3_listing(s3, "nightly-out", day1) == before

    # 3. The next date carries the unchanged objects over from the previous date (errors are retried).
    day2 = "scans/date=2026-11-28/"
    logs = submit(ray_cluster, s3_server, "nightly-2026-11-28", *common, "--date", "2026-11-28")
    assert "previous: s3://nightly-out/scans/date=2026-11-27" in logs
    report2 = read_json(s3, "nightly-out", day2 + "_REPORT.json")
    assert report2["carried"] == n_photos and report2["classified"] == 1
    # ... and compares itself with it: nothing changed, no drift (the quality gate's record)
    assert report2["drift"]["against"] == "s3://nightly-out/scans/date=2026-11-27"
    assert report2["drift"]["psi"] == 0 and report2["drift"]["js_divergence"] == 0 and report2["drift"]["passed"]
    assert report2["quality"]["carried"] == n_photos
    assert "quality against s3://nightly-out/scans/date=2026-11-27: PSI 0.000, label JS 0.000: no threshold" in logs
    table2 = read_output(s3, "nightly-out", day2)
    assert table2.num_rows == n_photos + 1 and sum(table2.column("carried").to_pylist()) == n_photos

    # 4. An interrupted date (no _SUCCESS, one shard lost) resumes: only the missing rows are classified.
    parts = sorted(k for k in s3_listing(s3, "nightly-out", day1) if "/part-" in k)
    assert len(parts) >= 2
    lost = pq.read_table(io.BytesIO(s3.get_object(Bucket="nightly-out", Key=parts[0])["Body"].read())).num_rows
    s3.delete_object(Bucket="nightly-out", Key=parts[0])
    s3.delete_object(Bucket="nightly-out", Key=day1 + "_SUCCESS")
    logs = submit(ray_cluster, s3_server, "nightly-2026-11-27-resume", *common, "--date", "2026-11-27")
    assert f"resumed an interrupted scan: {len(parts) - 1} shard(s)" in logs
    report3 = read_json(s3, "nightly-out", day1 + "_REPORT.json")
    assert report3["classified"] == lost and report3["already_done"] == n_photos + 1 - lost
    assert read_output(s3, "nightly-out", day1).num_rows == n_photos + 1
