"""Benchmark: listing, resume and carry-over at catalog scale, without classifying the catalog.

Usage:
    python tests/benchmarks/bench_catalog_scale.py [--sizes 100000,1000000] [--layout nested|flat]
        [--s3-keys 200000] [--s3-tasks 8] [--skip-s3] [--skip-local] [--s3-port PORT] [--s3-fill-max-s S]
        [--workdir DIR] [--interval-s 0.5]

Local catalogs are N hard links of a few 64x48 JPEGs, in folders of 1,000 (``nested``) or all in one folder
(``flat``). For each N the script writes, with the real schema and the real writer (shard records included):

* a *committed* output holding a row for every object (so a rerun finds everything done), and
* a *previous* output holding rows for 99 % of the objects (every object whose index is not a multiple of 100),

then measures, each as its own ``bulk-classify run ... --quiet`` subprocess with a fresh local Ray:

* **listing**: the library's listing of the catalog in this process, one core (objects/s);
* **resume, all done**: ``run SRC --output COMMITTED``: time, peak PSS of the whole process tree (driver, raylet,
  workers; shared memory counted once), and the driver's peak RSS (VmHWM);
* **carry-over 99 %**: ``run SRC --output NEW --previous PREVIOUS``: the same, plus a check that every object
  has exactly one row, the 1 % are classified and the 99 % carried.

The 1 % new objects are classified by a tiny ONNX model (global average pool + one dense layer, 10 classes, a
32x32 input) built by this script: the benchmark measures the catalog machinery, not the network.

``--faults`` adds, at the largest size, the exactly-once check of issue 14 at scale: a *previous* output with a row
for every object, 1 % of them (index = 50 mod 100) recorded with another size, as if those objects had changed
since; a carry-over run into a fresh output killed with SIGKILL (the driver, raylet and workers) once a third of the
shards are committed; a rerun; a resume. It prints rows, duplicates, missing, reclassified and carried counts.

The S3 part fills a moto server bucket with ``--s3-keys`` keys in one flat prefix (parallel PUTs) and lists it
with 1 and ``--s3-tasks`` listing tasks (threads here, each listing its planned key ranges), in the same run. It
reports the CPU seconds of moto and of this process per LIST call, and the bound they set on this machine. Moto
takes about 5 ms of CPU per PUT, so 200,000 keys take about 17 minutes of one core: start ``moto_server -H
127.0.0.1 -p PORT`` yourself and fill it in parts (``--s3-port PORT --s3-fill-max-s 600``, repeated; the listing
runs once the bucket is full).

It prints one table with the 1M/100k ratios (largest/smallest size) and a projection to 100 M objects from the
per-object costs measured between the two sizes. Goals (issue 14): peak memory ratio <= 1.5 for resume and
carry-over; >= 20,000 objects/s for resume and carry-over at 1M; S3 listing with 8 tasks >= 3x one task.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streaming import TreeSampler  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SEEDS = 64  # ext4 allows 65,000 hard links to one file: 64 seeds give 4 M objects
PER_FOLDER = 1000
SHARD = 1000
TOP_K = 5
MIB = 1024 * 1024
PROJECT_TO = 100_000_000


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, "JPEG", quality=80)
    return buf.getvalue()


def tiny_model(folder: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE

    folder.mkdir(parents=True, exist_ok=True)
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(3, 10)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(10, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["flat"]),
         helper.make_node("Gemm", ["flat", "w", "b"], ["logits"])],
        "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, folder / MODEL_FILE)
    (folder / LABELS_FILE).write_text("".join(f"class{i}\n" for i in range(10)))
    (folder / SPEC_FILE).write_text(json.dumps({
        "resize_shorter": 32, "interpolation": "bilinear", "antialias": True, "crop": [32, 32],
        "channel_order": "RGB", "scale": 1.0, "mean": [127.0] * 3, "std": [128.0] * 3, "layout": "NCHW"}))
    return folder


def object_path(root: Path, i: int, layout: str) -> Path:
    name = f"img{i:07d}.jpg"
    return root / name if layout == "flat" else root / f"d{i // PER_FOLDER:04d}" / name


def make_catalog(root: Path, n: int, layout: str, seeds: list[Path]) -> None:
    if (root / ".done").exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i in range(n):
        path = object_path(root, i, layout)
        if layout != "flat" and i % PER_FOLDER == 0:
            path.parent.mkdir()
        os.link(seeds[i % SEEDS], path)
    (root / ".done").write_text("")


def fake_output(dest: Path, root: Path, n: int, layout: str, seeds: list[Path], model: str,
                keep=lambda i: True, changed=lambda i: False) -> None:
    """Rows with the real schema for the objects ``keep`` selects, committed by the real writer."""
    from pipeline.columns import conform
    from pipeline.schema import WORK_SCHEMA
    from pipeline.quality.statistics import quality_footer
    from pipeline.io.writer import write_shard

    if (dest / ".done").exists():
        return
    shutil.rmtree(dest, ignore_errors=True)
    stats = [os.stat(s) for s in seeds]
    when = datetime(2026, 11, 30, tzinfo=timezone.utc)
    idx = [i for i in range(n) if keep(i)]
    for start in range(0, len(idx), SHARD):
        chunk = idx[start:start + SHARD]
        k = len(chunk)
        cols = {
            "uri": ["file://" + str(object_path(root, i, layout)) for i in chunk],
            "status": ["ok"] * k,
            "class_ids": [[(i + j) % 10 for j in range(TOP_K)] for i in chunk],
            "labels": [[f"class{(i + j) % 10}" for j in range(TOP_K)] for i in chunk],
            "scores": [[0.5, 0.2, 0.1, 0.1, 0.1]] * k,
            "model": [model] * k,
            "engine": ["onnx"] * k,
            "size_bytes": [stats[i % SEEDS].st_size + (1 if changed(i) else 0) for i in chunk],
            "width": [64] * k,
            "height": [48] * k,
            "mtime": pa.array([int(stats[i % SEEDS].st_mtime * 1_000_000) for i in chunk], pa.int64()).cast(
                pa.timestamp("us", tz="UTC")),
            "classified_at": [when] * k,
            "carried": [False] * k,
        }
        table = pa.table({f.name: pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(k, f.type)
                          for f in WORK_SCHEMA})
        write_shard(conform(table, WORK_SCHEMA), output=str(dest), storage_options={}, footer=quality_footer)
    (dest / ".done").write_text("")


def vm_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_cli(args: list[str], env: dict, interval_s: float) -> dict:
    cmd = [sys.executable, "-m", "pipeline.cli", "run", *args, "--quiet"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hwm = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            hwm[0] = max(hwm[0], vm_hwm(proc.pid))
            stop.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with TreeSampler(proc.pid, interval_s=interval_s) as sampler:
        out, err = proc.communicate()
    stop.set()
    watcher.join()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bulk-classify failed ({proc.returncode}): {err[-3000:]}")
    return {"wall_s": wall, "pss": sampler.peak["pss"], "driver_rss": hwm[0]}


def check_rows(dest: Path, n: int) -> dict:
    table = pads.dataset(str(dest), format="parquet").to_table(columns=["uri", "carried"])
    uris = table.column("uri")
    unique = len(set(uris.to_pylist()))
    carried = table.column("carried").to_numpy(zero_copy_only=False)
    fresh = [u for u, c in zip(uris.to_pylist(), carried) if not c]
    fresh_ok = all(int(u.rsplit("img", 1)[1][:7]) % 100 == 0 for u in fresh)
    return {"rows": table.num_rows, "unique": unique, "carried": int(carried.sum()), "fresh": len(fresh),
            "ok": table.num_rows == unique == n and len(fresh) == -(-n // 100) and fresh_ok}


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a job started in its own session and everything it started (driver, raylet, workers)."""
    import psutil

    try:
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = [proc.pid]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(60)


def output_rows(dest: Path) -> pa.Table:
    parts = sorted(str(p) for p in dest.rglob("part-*.parquet"))
    if not parts:
        return pa.table({"uri": pa.array([], pa.string()), "carried": pa.array([], pa.bool_()),
                         "status": pa.array([], pa.string())})
    return pads.dataset(parts, format="parquet").to_table(columns=["uri", "carried", "status"])


def bench_faults(n: int, layout: str, work: Path, seeds: list[Path], model_dir: Path, model: str, env: dict,
                 interval_s: float) -> dict:
    """Exactly once at N: kill -9 mid-carry-over with 1 % changed, rerun, resume (see the module docstring)."""
    import pyarrow.compute as pc

    root = work / f"src-{layout}-{n}"
    prev = work / f"previous-changed-{layout}-{n}"
    fake_output(prev, root, n, layout, seeds, model, changed=lambda i: i % 100 == 50)
    dest = work / f"faults-{layout}-{n}"
    shutil.rmtree(dest, ignore_errors=True)
    args = [str(root), "--output", str(dest), "--previous", str(prev), "--model", str(model_dir)]
    cmd = [sys.executable, "-m", "pipeline.cli", "run", *args, "--quiet"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = n // SHARD // 3
    start = time.perf_counter()
    while proc.poll() is None and sum(1 for _ in dest.glob("*/part-*.parquet")) < target:
        time.sleep(0.2)
    if proc.poll() is not None:
        raise SystemExit(f"the carry-over run ended ({proc.returncode}) before {target} shards: nothing was killed")
    kill_tree(proc)
    killed_s = time.perf_counter() - start
    table = output_rows(dest)
    at_kill = {"rows": table.num_rows, "unique": pc.count_distinct(table.column("uri")).as_py(),
               "carried": int(pc.sum(table.column("carried")).as_py() or 0)}
    print(f"  faults N={n:,}: killed after {killed_s:.0f} s with {at_kill['rows']:,} rows committed "
          f"({at_kill['unique']:,} distinct, {at_kill['carried']:,} carried)", flush=True)
    rerun = run_cli(args, env, interval_s)
    rerun_run = json.loads((dest / "_SUCCESS").read_text())["this_run"]
    table = output_rows(dest)
    uris = table.column("uri")
    fresh = uris.filter(pc.invert(table.column("carried"))).to_pylist()
    fresh_idx = sorted(int(u.rsplit("img", 1)[1][:7]) for u in fresh)
    changed = list(range(50, n, 100))
    unique = pc.count_distinct(uris).as_py()
    statuses = set(pc.unique(table.column("status")).to_pylist())
    resume = run_cli(args, env, interval_s)
    success = json.loads((dest / "_SUCCESS").read_text())
    after_resume = output_rows(dest).num_rows
    out = {"n": n, "killed_s": killed_s, "at_kill": at_kill, "rerun": rerun, "rerun_run": rerun_run,
           "rows": table.num_rows, "duplicates": table.num_rows - unique, "missing": n - unique,
           "reclassified": len(fresh), "reclassified_are_changed": fresh_idx == changed,
           "carried": int(pc.sum(table.column("carried")).as_py() or 0), "statuses": sorted(statuses),
           "resume": resume, "resume_run": success["this_run"], "rows_after_resume": after_resume}
    out["ok"] = (at_kill["rows"] == at_kill["unique"] and 0 < at_kill["rows"] < n and out["duplicates"] == 0
                 and out["missing"] == 0 and out["reclassified_are_changed"] and statuses == {"ok"}
                 and success["rows"] == n == after_resume
                 and success["this_run"] == {"images": 0, "classified": 0, "carried": 0, "already_done": n})
    print(f"  faults N={n:,}: rerun {rerun['wall_s']:.1f} s ({rerun_run}); rows {out['rows']:,}, duplicates "
          f"{out['duplicates']}, missing {out['missing']}, reclassified {out['reclassified']:,} (the changed 1 %: "
          f"{out['reclassified_are_changed']}), carried {out['carried']:,}; resume {resume['wall_s']:.1f} s "
          f"({success['this_run']}), rows after {after_resume:,}: {'OK' if out['ok'] else 'FAILED'}", flush=True)
    return out


def listing_rate(root: Path) -> float:
    from pipeline.schema import DEFAULT_EXTENSIONS
    from pipeline.io.source import list_unit, plan_listing
    from pipeline.storage import open_fs

    fs, path = open_fs(str(root))
    start = time.perf_counter()
    count = sum(1 for g in plan_listing(fs, path, DEFAULT_EXTENSIONS, 2) for u in g
                for _ in list_unit(fs, u, DEFAULT_EXTENSIONS))
    return count / (time.perf_counter() - start)


def bench_size(n: int, layout: str, work: Path, seeds: list[Path], model_dir: Path, model: str, env: dict,
               interval_s: float) -> dict:
    root = work / f"src-{layout}-{n}"
    t = time.perf_counter()
    make_catalog(root, n, layout, seeds)
    fake_output(work / f"committed-{layout}-{n}", root, n, layout, seeds, model)
    fake_output(work / f"previous-{layout}-{n}", root, n, layout, seeds, model, keep=lambda i: i % 100 != 0)
    print(f"  N={n:,}: catalog and fake outputs ready in {time.perf_counter() - t:.0f} s", flush=True)
    result = {"n": n, "list_rate": listing_rate(root)}
    print(f"  N={n:,}: listing {result['list_rate']:,.0f} objects/s", flush=True)
    resume = run_cli([str(root), "--output", str(work / f"committed-{layout}-{n}"), "--model", str(model_dir)],
                     env, interval_s)
    done = json.loads((work / f"committed-{layout}-{n}" / "_SUCCESS").read_text())["this_run"]
    assert done["already_done"] == n and done["images"] == 0, done
    result["resume"] = resume
    print(f"  N={n:,}: resume {resume['wall_s']:.1f} s, peak PSS {resume['pss'] / MIB:,.0f} MiB", flush=True)
    dest = work / f"carried-{layout}-{n}"
    shutil.rmtree(dest, ignore_errors=True)
    carry = run_cli([str(root), "--output", str(dest), "--previous", str(work / f"previous-{layout}-{n}"),
                     "--model", str(model_dir)], env, interval_s)
    carry["check"] = check_rows(dest, n)
    result["carry"] = carry
    print(f"  N={n:,}: carry-over {carry['wall_s']:.1f} s, peak PSS {carry['pss'] / MIB:,.0f} MiB, "
          f"rows {carry['check']}", flush=True)
    shutil.rmtree(dest, ignore_errors=True)
    return result


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fill_bucket(port: int, bucket: str, first: int, keys: int, threads: int) -> None:
    """PUT one-byte objects ``first``..``keys - 1`` through the S3 REST API, each thread on one keep-alive connection.

    Plain HTTP PUTs, not boto3: moto spends about 5 ms of its one core per PUT whatever the client, and boto3
    spent another 3.3 ms of client CPU per PUT on the same two cores (raw requests: 0.6 ms).
    """
    import http.client

    def part(offset: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for i in range(first + offset, keys, threads):
            conn.request("PUT", f"/{bucket}/flat/img{i:07d}.jpg", body=b"x", headers={"Content-Length": "1"})
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise SystemExit(f"PUT failed: HTTP {resp.status}")
        conn.close()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(threads)))


def moto_pid(port: int) -> int:
    """The pid of the moto_server listening on ``port`` (for its CPU seconds)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if any("moto_server" in c for c in cmd[:2]) and str(port) in cmd:
            return proc.pid
    raise SystemExit(f"no moto_server process with port {port} in its command line")


def fill_to(client, port: int, keys: int, max_s: float | None) -> tuple[int, int, float]:
    """Fill the flat prefix up to ``keys`` keys in chunks, recording progress in ``_fill/next`` so a later
    invocation against the same server resumes; stops after ``max_s`` seconds. (keys before, keys now, seconds)."""
    try:
        done = int(client.get_object(Bucket="catalog", Key="_fill/next")["Body"].read())
    except client.exceptions.NoSuchKey:
        done = 0
    before, start = done, time.perf_counter()
    while done < keys and (max_s is None or time.perf_counter() - start < max_s):
        end = min(keys, done + 8000)
        fill_bucket(port, "catalog", done, end, threads=8)
        done = end
        client.put_object(Bucket="catalog", Key="_fill/next", Body=str(done).encode())
        print(f"    {done:,} keys", flush=True)
    return before, done, time.perf_counter() - start


def bench_s3(keys: int, tasks: int, work: Path, port: int | None = None, fill_max_s: float | None = None,
             ranges_per_task: tuple[int, ...] = (4,)) -> dict | None:
    """Fill a flat prefix on a moto server and list it with 1 and ``tasks`` tasks, with both sides' CPU per LIST.

    ``port``: a moto_server already running on 127.0.0.1 (kept, and filled across invocations); None starts one.
    """
    sys.path.insert(0, str(REPO / "tests"))
    import boto3
    from conftest import MotoServer, free_port

    import pipeline.io.source as source
    from pipeline.schema import DEFAULT_EXTENSIONS
    from pipeline.io.source import list_unit, plan_listing
    from pipeline.storage import open_fs

    server = None
    if port is None:
        server = MotoServer(free_port())
        server.start()
        port = server.port
    pid = moto_pid(port)
    url = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    calls = [0]
    list_page, ranges_default = source._list_page, source.S3_RANGES_PER_TASK

    def counted(*args, **kwargs):
        calls[0] += 1
        return list_page(*args, **kwargs)

    source._list_page = counted
    try:
        client = boto3.client("s3", endpoint_url=url)
        if "catalog" not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
            client.create_bucket(Bucket="catalog")
        server_cpu = cpu_seconds(pid)
        before, filled, fill_s = fill_to(client, port, keys, fill_max_s)
        put_ms = (cpu_seconds(pid) - server_cpu) / max(1, filled - before) * 1000
        if filled < keys:
            print(f"  S3: {filled:,} of {keys:,} keys after {fill_s:.0f} s; run again with --s3-port {port}")
            return None
        print(f"  S3: {keys:,} keys in one flat prefix; this run put {filled - before:,} in {fill_s:.0f} s, "
              f"moto CPU {put_ms:.1f} ms per PUT", flush=True)
        out = {"keys": keys, "fill_s": fill_s, "put_ms": put_ms}
        plans = [("one", 1, source.S3_RANGES_PER_TASK)] + [
            ("many" if i == 0 else f"many{per}", tasks, per) for i, per in enumerate(ranges_per_task)]
        for label, n_tasks, per in plans:
            source.S3_RANGES_PER_TASK = per
            fs, root = open_fs("s3://catalog/flat")
            fs.invalidate_cache()
            calls[0] = 0
            server_cpu, client_cpu = cpu_seconds(pid), time.process_time()
            start = time.perf_counter()
            groups = plan_listing(fs, root, DEFAULT_EXTENSIONS, n_tasks)
            plan_s, probes = time.perf_counter() - start, calls[0]

            def list_group(group: list) -> int:
                return sum(1 for u in group for _ in list_unit(fs, u, DEFAULT_EXTENSIONS))

            with ThreadPoolExecutor(len(groups)) as pool:
                count = sum(pool.map(list_group, groups))
            wall = time.perf_counter() - start
            assert count == keys, (count, keys)
            r = {"tasks": len(groups), "ranges": sum(len(g) for g in groups), "wall_s": wall, "plan_s": plan_s, "rate": count / wall, "calls": calls[0],
                 "probes": probes, "server_s": cpu_seconds(pid) - server_cpu,
                 "client_s": time.process_time() - client_cpu}
            out[label] = r
            print(f"  S3 {n_tasks} task(s), {r['ranges']} ranges: {r['rate']:,.0f} keys/s ({wall:.1f} s, planning {plan_s:.1f} s with "
                  f"{probes} LIST calls; {r['calls']} LIST calls in all; moto CPU {r['server_s']:.1f} s = "
                  f"{r['server_s'] / wall:.0%} of one core, client CPU {r['client_s']:.1f} s)", flush=True)
        return out
    finally:
        source._list_page, source.S3_RANGES_PER_TASK = list_page, ranges_default
        if server is not None:
            server.stop()


def marginal(results: list[dict], r: dict, key: str) -> float:
    """Objects/s between the smallest size and this one: the rate once Ray and the actors are up."""
    first = results[0]
    if r is first:
        return float("nan")
    dt = r[key]["wall_s"] - first[key]["wall_s"]
    return (r["n"] - first["n"]) / dt if dt > 0 else float("nan")


def projection(small: dict, large: dict, key: str) -> tuple[float, float]:
    """(seconds, bytes) projected to PROJECT_TO objects from the per-object slope between the two sizes."""
    dn = large["n"] - small["n"]
    t_slope = max(0.0, (large[key]["wall_s"] - small[key]["wall_s"]) / dn)
    m_slope = max(0.0, (large[key]["pss"] - small[key]["pss"]) / dn)
    rest = PROJECT_TO - large["n"]
    return large[key]["wall_s"] + t_slope * rest, large[key]["pss"] + m_slope * rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--layout", choices=("nested", "flat"), default="nested")
    parser.add_argument("--s3-keys", type=int, default=200_000)
    parser.add_argument("--s3-tasks", type=int, default=8)
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--s3-ranges-per-task", default="4",
                        help="Comma-separated: list with --s3-tasks tasks once per value of the planner's ranges per task.")
    parser.add_argument("--s3-port", type=int, default=None,
                        help="Use the moto_server already on this 127.0.0.1 port (kept; filling resumes there).")
    parser.add_argument("--s3-fill-max-s", type=float, default=None,
                        help="Stop filling after this long (run again with --s3-port to go on), to keep runs short.")
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument("--workdir", default=None, help="Keep catalogs and fake outputs here between runs.")
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--faults", action="store_true",
                        help="Also check exactly-once at the largest size: kill -9 mid-carry-over, rerun, resume.")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-catalog-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    env = dict(os.environ, RAY_TMPDIR=str(work / "ray"), PYTHONUNBUFFERED="1")
    (work / "ray").mkdir(exist_ok=True)
    results = []
    if not args.skip_local:
        seeds = []
        for s in range(SEEDS):
            p = work / "seeds" / f"seed{s}.jpg"
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.exists():
                p.write_bytes(jpeg(s))
            seeds.append(p)
        model_dir = tiny_model(work / "tiny-model")
        sys.path.insert(0, str(REPO))
        from pipeline.model.folder import load_model

        model = load_model(str(model_dir)).name
        for n in sizes:
            results.append(bench_size(n, args.layout, work, seeds, model_dir, model, env, args.interval_s))
        faults = (bench_faults(sizes[-1], args.layout, work, seeds, model_dir, model, env, args.interval_s)
                  if args.faults else None)
    s3 = None if args.skip_s3 else bench_s3(args.s3_keys, args.s3_tasks, work, args.s3_port, args.s3_fill_max_s,
                                            tuple(int(v) for v in args.s3_ranges_per_task.split(",")))

    print()
    if results:
        small, large = results[0], results[-1]
        ratio = f"{large['n'] // 1000:,}k/{small['n'] // 1000:,}k"
        print(f"{'local (' + args.layout + ')':<30}" + "".join(f"{r['n']:>16,}" for r in results) + f"{ratio:>14}")
        rows = [
            ("listing, objects/s", lambda r: r["list_rate"], "{:,.0f}"),
            ("resume all done, s", lambda r: r["resume"]["wall_s"], "{:,.1f}"),
            ("resume, objects/s", lambda r: r["n"] / r["resume"]["wall_s"], "{:,.0f}"),
            ("resume peak PSS, MiB", lambda r: r["resume"]["pss"] / MIB, "{:,.0f}"),
            ("resume driver RSS, MiB", lambda r: r["resume"]["driver_rss"] / MIB, "{:,.0f}"),
            ("carry-over 99 %, s", lambda r: r["carry"]["wall_s"], "{:,.1f}"),
            ("carry-over, objects/s", lambda r: r["n"] / r["carry"]["wall_s"], "{:,.0f}"),
            ("carry peak PSS, MiB", lambda r: r["carry"]["pss"] / MIB, "{:,.0f}"),
            ("carry driver RSS, MiB", lambda r: r["carry"]["driver_rss"] / MIB, "{:,.0f}"),
            ("resume, objects/s past start", lambda r: marginal(results, r, "resume"), "{:,.0f}"),
            ("carry, objects/s past start", lambda r: marginal(results, r, "carry"), "{:,.0f}"),
            ("carry rows / carried", lambda r: f"{r['carry']['check']['rows']:,}/{r['carry']['check']['carried']:,}",
             "{}"),
        ]
        for name, get, fmt in rows:
            values = [get(r) for r in results]
            cells = "".join(f"{'-' if v != v else fmt.format(v):>16}" for v in values)  # v != v: NaN
            ratio_cell = (f"{values[-1] / values[0]:>13.2f}x" if isinstance(values[0], float) and values[0] == values[0]
                          else f"{'':>14}")
            print(f"{name:<30}{cells}{ratio_cell}")
        print(f"every object exactly once after carry-over, 1 % reclassified: "
              f"{all(r['carry']['check']['ok'] for r in results)}")
        if len(results) > 1:
            for key, label in (("resume", "resume all done"), ("carry", "carry-over 99 %")):
                secs, mem = projection(small, large, key)
                print(f"projection to {PROJECT_TO // 1_000_000} M, {label}: {secs / 60:,.0f} min, "
                      f"peak PSS {mem / MIB / 1024:,.1f} GiB (per-object slope between the two sizes)")
    if not args.skip_local and faults:
        f = faults
        print(f"exactly once at {f['n']:,} (kill -9 mid-carry-over after {f['at_kill']['rows']:,} rows, rerun "
              f"{f['rerun']['wall_s']:.1f} s, resume {f['resume']['wall_s']:.1f} s): rows {f['rows']:,}, duplicates "
              f"{f['duplicates']}, missing {f['missing']}, reclassified {f['reclassified']:,} (all of the changed 1 %: "
              f"{f['reclassified_are_changed']}), carried {f['carried']:,}: {'OK' if f['ok'] else 'FAILED'}")
    if s3:
        one, many = s3["one"], s3["many"]
        print(f"S3 flat prefix, {s3['keys']:,} keys on moto: 1 task {one['rate']:,.0f} keys/s, "
              f"{many['tasks']} tasks {many['rate']:,.0f} keys/s: {many['rate'] / one['rate']:.2f}x")
        print(f"{'S3 listing':<18}{'ranges':>6}{'tasks':>6}{'keys/s':>9}{'wall s':>8}{'LISTs':>7}{'probes':>7}"
              f"{'moto CPU ms/LIST':>18}{'client CPU ms/LIST':>20}{'moto busy':>10}")
        plans = [v for k, v in s3.items() if k == "one" or k.startswith("many")]
        for r in plans:
            print(f"{'':<18}{r['ranges']:>6}{r['tasks']:>6}{r['rate']:>9,.0f}{r['wall_s']:>8.1f}{r['calls']:>7}{r['probes']:>7}"
                  f"{r['server_s'] / r['calls'] * 1000:>18.0f}{r['client_s'] / r['calls'] * 1000:>20.0f}"
                  f"{r['server_s'] / r['wall_s']:>10.0%}")
        # The limit on this machine, from the CPU the listing costs: moto serves requests on one core (one
        # process; a lock around its dispatch), and moto plus the client share the machine's cores. However many
        # tasks list at once, the wall time is at least max(moto CPU, (moto + client CPU) / cores).
        cores = os.cpu_count() or 1
        for r in plans:
            floor_s = max(r["server_s"], (r["server_s"] + r["client_s"]) / cores)
            print(f"CPU bound of the {r['tasks']}-task plan ({r['ranges']} ranges): its LISTs cost moto {r['server_s']:.1f} s + client "
                  f"{r['client_s']:.1f} s of CPU; on {cores} cores at best {s3['keys'] / floor_s:,.0f} keys/s = "
                  f"{s3['keys'] / floor_s / one['rate']:.2f}x the one-task rate")


if __name__ == "__main__":
    main()
