"""The Ray Data job end to end: local folders and a real S3 endpoint, one row per input, resume, carry-over."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from conftest import PHOTOS, make_jpeg
from pipeline.config import RunConfig
from pipeline.errors import ConfigError, OutputError, SourceError
from pipeline.job import run_job


def read_rows(dest, filesystem=None) -> dict:
    table = pads.dataset(dest, format="parquet", filesystem=filesystem).to_table()
    rows = table.to_pylist()
    uris = [r["uri"] for r in rows]
    assert len(uris) == len(set(uris)), "duplicate rows"
    return {r["uri"].rsplit("/", 1)[-1]: r for r in rows}


def test_local_folder_photos_and_odd_inputs(tmp_path, ray_local):
    from support.oddities import oddities

    src = tmp_path / "src"
    shutil.copytree(PHOTOS, src / "photos")
    odd = oddities()
    ext_of = {"webp": "webp", "tiff": "tif", "bmp": "bmp"}
    names = {}
    for name, (data, _status, _kind) in odd.items():
        ext = next((e for k, e in ext_of.items() if k in name), "png" if "png" in name else "jpg")
        fname = f"{name}.{ext}"
        names[fname] = name
        (src / "odd").mkdir(exist_ok=True)
        (src / "odd" / fname).write_bytes(data)
    (src / "notes.txt").write_text("not an image: not listed")
    (src / "UPPER.JPG").write_bytes((PHOTOS / "coffee.jpg").read_bytes())

    summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "out"), batch_size=8, shard_size=10))

    rows = read_rows(str(tmp_path / "out"))
    expected = len(list(PHOTOS.glob("*.jpg"))) + len(odd) + 1
    assert len(rows) == expected == summary.total
    assert "notes.txt" not in rows and rows["UPPER.JPG"]["status"] == "ok"
    for fname, name in names.items():
        _data, status, kind = odd[name]
        row = rows[fname]
        assert row["status"] == status, (name, row["error"])
        if kind:
            assert row["error"].startswith(kind + ":"), (name, row["error"])
        else:
            assert row["error"] is None and len(row["class_ids"]) == 5
    cat = rows["chelsea.jpg"]
    assert cat["status"] == "ok" and any("cat" in label for label in cat["labels"])
    assert cat["scores"] == sorted(cat["scores"], reverse=True) and 0 < sum(cat["scores"]) <= 1.0001
    assert cat["width"] > 0 and cat["model"] and cat["uri"].startswith("file://")
    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert success["rows"] == expected and success["counts"]["ok"] + success["counts"]["error"] == expected
    report = json.loads((tmp_path / "out" / "_REPORT.json").read_text())
    assert report["writer_actors"] == 0  # a 2-CPU Ray: the driver committed the shards
    assert sorted(len(part) for part in _parts(tmp_path / "out")) == sorted(
        [10] * (expected // 10) + [expected % 10] * bool(expected % 10))  # shards of --shard-size, one smaller


def _parts(dest) -> list[list[str]]:
    return [pads.dataset(str(p), format="parquet").to_table(columns=["uri"]).column("uri").to_pylist()
            for p in sorted(dest.glob("*/part-*.parquet"))]


def test_a_cluster_of_eight_cpus_commits_through_writer_actors(tmp_path):
    """One writer actor per 8 CPUs (``pipeline.job.stages.WRITER_CPUS``): a Ray of 8 logical CPUs runs the write
    stage in an actor; every input still gets one row, in shards of --shard-size."""
    import subprocess
    import sys

    from support.ray_cluster import LocalRayCluster

    src = tmp_path / "src"
    src.mkdir()
    for i in range(45):
        (src / f"img{i:03d}.jpg").write_bytes(make_jpeg(i))
    cluster = LocalRayCluster(num_cpus=8, job_api=False)
    cluster.start()
    try:
        env = {**cluster.env, "RAY_ADDRESS": cluster.gcs_address}
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(src), "--output",
                               str(tmp_path / "out"), "-q", "--batch-size", "8", "--shard-size", "10",
                               "--num-actors", "1"], env=env, capture_output=True, text=True, timeout=600)
    finally:
        cluster.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "_REPORT.json").read_text())["writer_actors"] == 1
    rows = read_rows(str(tmp_path / "out"))
    assert sorted(rows) == [f"img{i:03d}.jpg" for i in range(45)] and {r["status"] for r in rows.values()} == {"ok"}
    assert sorted(len(part) for part in _parts(tmp_path / "out")) == [5, 10, 10, 10, 10]


def test_the_openvino_engine_writes_the_rows_the_onnx_engine_does(tmp_path, ray_local):
    src = tmp_path / "src"
    shutil.copytree(PHOTOS, src)
    (src / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    run_job(RunConfig(source=str(src), output=str(tmp_path / "onnx"), engine="onnx"))
    summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "ov"), engine="openvino"))
    onnx, ov = read_rows(str(tmp_path / "onnx")), read_rows(str(tmp_path / "ov"))
    assert summary.total == len(ov) == len(onnx) == len(list(PHOTOS.glob("*.jpg"))) + 1
    assert ov["broken.jpg"]["status"] == "error" and ov["broken.jpg"]["error"] == onnx["broken.jpg"]["error"]
    for name, row in onnx.items():
        assert (ov[name]["status"], ov[name]["class_ids"]) == (row["status"], row["class_ids"]), name
        assert ov[name]["scores"] == pytest.approx(row["scores"], abs=1e-4), name


def test_an_openvino_actor_exits_without_a_crash(tmp_path):
    """Left to the interpreter's shutdown, OpenVINO's infer requests (made by the actor's call threads, still alive)
    crashed every actor's process at its exit (SIGSEGV), after a run that had written every row; close() releases
    them first. A fresh CLI process with its own Ray temp folder, whose workers' logs are read after it ends."""
    import subprocess
    import sys
    import tempfile

    ray_tmp = Path(tempfile.mkdtemp(prefix="bcov", dir="/tmp"))  # short: Ray's socket paths must fit 107 chars
    try:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmp)}
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(PHOTOS), "--output",
                               str(tmp_path / "ov"), "-q", "--engine", "openvino"], env=env, capture_output=True,
                              text=True, timeout=600)
        logs = "".join(p.read_text(errors="replace") for p in ray_tmp.rglob("worker-*") if p.is_file())
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(read_rows(str(tmp_path / "ov"))) == len(list(PHOTOS.glob("*.jpg")))
    assert logs, "no worker logs found to check"
    for text in (done.stdout, done.stderr, logs):
        assert "SIGSEGV" not in text and "Fatal Python error" not in text, text[-3000:]


def test_s3_in_and_out_over_a_thousand_images(s3, ray_local, s3_server):
    s3.create_bucket(Bucket="photos-in")
    s3.create_bucket(Bucket="results-out")
    n = 1050
    for i in range(n):
        s3.put_object(Bucket="photos-in", Key=f"catalog/{i % 7}/img{i:05d}.jpg", Body=make_jpeg(i, (24, 20)))
    s3.put_object(Bucket="photos-in", Key="catalog/broken.jpg", Body=b"\xff\xd8\xff\xe0 truncated")

    summary = run_job(RunConfig(source="s3://photos-in/catalog", output="s3://results-out/run1",
                                batch_size=64, shard_size=300))

    import s3fs

    fs = s3fs.S3FileSystem()
    table = pads.dataset("results-out/run1", format="parquet", filesystem=fs).to_table()
    uris = table.column("uri").to_pylist()
    assert len(uris) == len(set(uris)) == n + 1 == summary.total
    assert all(u.startswith("s3://photos-in/catalog/") for u in uris)
    statuses = dict(zip(uris, table.column("status").to_pylist()))
    assert statuses["s3://photos-in/catalog/broken.jpg"] == "error"
    assert sum(s == "ok" for s in statuses.values()) == n
    assert all(e for e in table.column("etag").to_pylist())
    assert fs.exists("results-out/run1/_SUCCESS")


def test_rerun_processes_only_new_objects_and_overwrite_keeps_foreign_files(tmp_path, ray_local):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for i in range(30):
        (src / f"a{i}.jpg").write_bytes(make_jpeg(i))
    first = run_job(RunConfig(source=str(src), output=str(out), shard_size=7))
    assert (first.classified, first.already_done) == (30, 0)

    for i in range(5):
        (src / f"b{i}.jpg").write_bytes(make_jpeg(100 + i))
    second = run_job(RunConfig(source=str(src), output=str(out), shard_size=7))
    assert (second.classified, second.already_done, second.total) == (5, 30, 35)
    assert len(read_rows(str(out))) == 35

    (src / "broken.jpg").write_bytes(b"not a jpeg")
    states = []
    run_job(RunConfig(source=str(src), output=str(out), shard_size=7),
            progress=lambda done, total, errors: states.append((out / "_SUCCESS").exists()))
    assert states and not any(states), "a run in progress must not look complete"
    assert (out / "_SUCCESS").exists()
    (src / "broken.jpg").unlink()

    (out / "keep-me.txt").write_text("not ours")
    third = run_job(RunConfig(source=str(src), output=str(out), overwrite=True))
    assert (third.classified, third.already_done, third.total) == (35, 0, 35)
    assert (out / "keep-me.txt").read_text() == "not ours"


def test_previous_output_is_carried_over_not_reclassified(tmp_path, ray_local):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"p{i}.jpg").write_bytes(make_jpeg(i))
    run_job(RunConfig(source=str(src), output=str(tmp_path / "day1")))
    (src / "p0.jpg").write_bytes(make_jpeg(999, (60, 50)))  # changed: other size
    (src / "new.jpg").write_bytes(make_jpeg(1000))

    day2 = run_job(RunConfig(source=str(src), output=str(tmp_path / "day2"), previous=str(tmp_path / "day1")))

    assert (day2.classified, day2.carried, day2.total) == (2, 19, 21)
    rows = read_rows(str(tmp_path / "day2"))
    assert rows["p0.jpg"]["carried"] is False and rows["p0.jpg"]["width"] == 60
    assert rows["new.jpg"]["carried"] is False and rows["p5.jpg"]["carried"] is True
    day1 = read_rows(str(tmp_path / "day1"))
    assert rows["p5.jpg"]["class_ids"] == day1["p5.jpg"]["class_ids"]


def test_bad_arguments_fail_before_work(tmp_path):
    with pytest.raises(ConfigError, match="--engine 'tpu' is unknown; choose one of auto, onnx, openvino, triton, gpu"):
        run_job(RunConfig(source=str(tmp_path / "missing"), output=str(tmp_path / "o"), engine="tpu"))  # the plan's
    with pytest.raises(ConfigError, match="--output must differ from SOURCE"):
        RunConfig(source=str(tmp_path), output=str(tmp_path) + "/")
    with pytest.raises(SourceError, match="does not exist; check the path"):
        run_job(RunConfig(source=str(tmp_path / "missing"), output=str(tmp_path / "o")))
    (tmp_path / "file.jpg").write_bytes(b"x")
    with pytest.raises(SourceError, match="is a file, not a folder"):
        run_job(RunConfig(source=str(tmp_path / "file.jpg"), output=str(tmp_path / "o")))


def test_output_of_another_model_is_not_mixed(tmp_path, ray_local):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.jpg").write_bytes(make_jpeg(1))
    run_job(RunConfig(source=str(src), output=str(tmp_path / "o"), top_k=3))
    with pytest.raises(OutputError, match="pass --overwrite to start over or choose another --output"):
        run_job(RunConfig(source=str(src), output=str(tmp_path / "o"), top_k=5))


def test_fetch_ahead_budget_bounds_the_blocks_of_fetched_images(tmp_path, ray_local):
    """The job gives Ray Data the budget and blocks a sixteenth of it: with Ray Data's 128 MiB blocks, a 20,000-image
    run held 758 MiB of fetched images in the store whatever the budget."""
    from ray.data import DataContext

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.jpg").write_bytes(make_jpeg(i))
    summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "out"), fetch_ahead_bytes=32 * 1024 * 1024))
    assert summary.counts["ok"] == 3
    ctx = DataContext.get_current()
    assert ctx.execution_options.resource_limits.object_store_memory == 32 * 1024 * 1024
    assert ctx.target_max_block_size == 2 * 1024 * 1024


@pytest.mark.parametrize("engine, options", [
    ("onnx", {"batch_size": 4}),
    # the GPU engines' path on this CPU machine: the batch size resolved and the model checked by the plan's GPU count
    ("triton", {"engine_options": {"profile": "portable"}, "num_actors": 1}),
])
def test_a_run_is_decided_once(tmp_path, ray_local, monkeypatch, engine, options):
    """Following run_job in the driver: the engine spec looked up, its options parsed, the model loaded and checked,
    the cluster's GPUs and resources counted and each store opened once, all in the plan; top_k checked at one place
    (RunConfig's own validation) and capped by the model once; RAY_ADDRESS is read only by
    ``pipeline.node.ray_address``, once."""
    import sys
    import threading
    from collections import Counter

    from pipeline import node
    from pipeline.config import RunConfig as Config
    from pipeline import config as config_module
    from pipeline.engines import auto, base, registry
    from pipeline.job import plan as plan_module
    from pipeline.model import contract
    from pipeline.storage import open_fs

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for name in ("coffee.jpg", "chelsea.jpg"):
        shutil.copy(PHOTOS / name, src / name)
    watched = {registry.engine_spec.__code__: "engine_spec", open_fs.__code__: "open_fs",
               plan_module.choose_engine.__code__: "choose_engine", auto.cluster_gpus.__code__: "cluster_gpus",
               node.node_gpus.__code__: "node_gpus", node.ray_address.__code__: "ray_address",
               base.EngineSpec.parse_options.__code__: "parse_options", config_module.check_top_k.__code__: "top_k",
               contract.check_contract.__code__: "check_contract", Config.__post_init__.__code__: "RunConfig"}
    calls: Counter = Counter()
    callers: dict[str, set] = {}
    driver = threading.main_thread().ident

    def profile(frame, event, _arg):
        name = watched.get(frame.f_code) if event == "call" else None
        if name is not None and threading.get_ident() != driver:
            name = None  # the driver's decisions, not a thread of an engine's server supervision
        if name == "open_fs":
            calls["open_fs " + frame.f_locals["url"]] += 1
        elif name is not None:
            calls[name] += 1
            callers.setdefault(name, set()).add(f"{frame.f_back.f_globals['__name__']}:{frame.f_back.f_code.co_name}")

    cluster_resources = ray_local.cluster_resources

    def counted_cluster_resources(*args, **kwargs):
        calls["cluster_resources"] += 1
        return cluster_resources(*args, **kwargs)

    monkeypatch.setattr(ray_local, "cluster_resources", counted_cluster_resources)
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        summary = run_job(RunConfig(source=str(src), output=str(out), engine=engine, **options))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert summary.counts.get("ok") == 2
    assert calls["engine_spec"] == 1 and calls["choose_engine"] == 1 and calls["cluster_resources"] == 1, calls
    assert calls["parse_options"] == 1 and callers["parse_options"] == {"pipeline.job.plan:preflight"}, callers
    assert calls["check_contract"] == 1 and callers["check_contract"] == {"pipeline.job.plan:_check_model"}, callers
    # top_k: checked once, where RunConfig validates the config given (the plan's revised copy is not checked again)
    assert callers["top_k"] == {"pipeline.config:__post_init__"} and calls["top_k"] == calls["RunConfig"] == 1, calls
    gpu_counts = 1 if registry.engine_spec(engine).needs_gpu else 0  # a CPU engine's run never counts GPUs
    assert calls["cluster_gpus"] == gpu_counts and calls["node_gpus"] == gpu_counts, calls
    assert calls[f"open_fs {src}"] == 1 and calls[f"open_fs {out}"] == 1
    assert not [k for k in calls if k.startswith("open_fs") and k not in (f"open_fs {src}", f"open_fs {out}")]
    assert calls["ray_address"] == 1
