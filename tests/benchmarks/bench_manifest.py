"""Benchmark: planning a run from a manifest (a Parquet URI list, an S3 Inventory in CSV.gz) vs a LIST, on moto.

Usage:
    python tests/benchmarks/bench_manifest.py [--sizes 100000,1000000] [--list-sizes 100000] [--inventory-file-rows 250000]

One moto server (in a subprocess of this script, filled through moto's own backend, which is ~100x faster than
PUTs over HTTP) holds, for each size N of ``--list-sizes``, a bucket of N keys, and for each size of ``--sizes`` a
Parquet URI list (uri, size_bytes, etag, mtime) and an S3 Inventory report (manifest.json and CSV.gz data files of
``--inventory-file-rows`` rows, no header, URL-encoded keys) naming N keys of the same form. Each measurement runs
in a fresh subprocess: the job's listing code (``plan_listing`` and ``listing_blocks``, which the listing tasks run)
plans and lists the whole source on one core, blocks dropped as they come. It prints entries/s, the subprocess's
peak RSS (VmHWM) and the growth over the RSS after imports, and the ratios: manifest rate / LIST rate at the same
N, and peak RSS at the largest size / the smallest.

moto's ListObjectsV2 filters and sorts every key of the bucket on each call (a page costs O(keys in the bucket)),
so a LIST of 1,000,000 keys on moto takes hours: ``--list-sizes`` defaults to 100,000, and the table says which
sizes were listed. Goals (issue 43): manifest >= 5x the LIST; peak memory from 100k to 1M <= 1.2x.

``--baseline DIR`` (another checkout of this repository, e.g. ``git worktree add /tmp/base main``) measures each
source with that checkout's listing code too, in the same run against the same moto, ``--rounds`` times each,
alternating which goes first; a second table gives both sides' median and range (the spread) and the ratio of the
medians.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote_plus

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MANIFEST_BUCKET = "bench-manifests"
LIST_TASKS = 8  # the job's default --list-tasks: the plan a run would make


def key(i: int) -> str:
    return f"photos/{i // 1000:05d}/img {i:08d}.jpg"  # a space: URL-encoded in the inventory, decoded back


def serve(port: int, list_sizes: list[int]) -> None:
    """Run moto on ``port`` with a bucket of N keys for each N (filled through the backend), until killed."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    backend.create_bucket(MANIFEST_BUCKET, "us-east-1")
    for n in list_sizes:
        backend.create_bucket(f"bench-list-{n}", "us-east-1")
        for i in range(n):
            backend.put_object(f"bench-list-{n}", key(i), b"x")
    print("ready", flush=True)
    while True:
        time.sleep(3600)


def write_manifests(client, n: int, file_rows: int) -> dict[str, str]:
    """Upload a Parquet URI list and an S3 Inventory report (CSV.gz) of ``n`` keys; their SOURCE forms."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    etags = [f"{i:032x}" for i in range(n)]
    stamp = datetime(2026, 12, 1, 5, 10, 44, tzinfo=timezone.utc)
    uris = pa.table({"uri": [f"s3://bench-list/{key(i)}" for i in range(n)],
                     "size_bytes": pa.array([600] * n, pa.int64()), "etag": etags,
                     "mtime": pa.array([stamp] * n, pa.timestamp("us", tz="UTC"))})
    buf = io.BytesIO()
    pq.write_table(uris, buf, row_group_size=100_000)
    client.put_object(Bucket=MANIFEST_BUCKET, Key=f"{n}/uris.parquet", Body=buf.getvalue())
    files = []
    for start in range(0, n, file_rows):
        lines = [f'"bench-list","{quote_plus(key(i), safe="/")}","600","2026-12-01T05:10:44.000Z","{etags[i]}"'
                 for i in range(start, min(n, start + file_rows))]
        body = gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=6)
        name = f"{n}/inv/data/{start // file_rows:04d}.csv.gz"
        client.put_object(Bucket=MANIFEST_BUCKET, Key=name, Body=body)
        files.append({"key": name, "size": len(body), "MD5checksum": "-"})
    manifest = {"sourceBucket": "bench-list", "destinationBucket": f"arn:aws:s3:::{MANIFEST_BUCKET}",
                "fileFormat": "CSV", "fileSchema": "Bucket, Key, Size, LastModifiedDate, ETag", "files": files}
    client.put_object(Bucket=MANIFEST_BUCKET, Key=f"{n}/inv/manifest.json", Body=json.dumps(manifest).encode())
    return {"Parquet URI list": f"uris+s3://{MANIFEST_BUCKET}/{n}/uris.parquet",
            "S3 Inventory CSV.gz": f"inventory+s3://{MANIFEST_BUCKET}/{n}/inv/manifest.json"}


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(source: str) -> None:
    """Plan and list ``source`` with the job's listing code on one core; print one JSON line."""
    import numpy as np

    from pipeline.schema import DEFAULT_EXTENSIONS
    from pipeline.io.source import check_source, listing_blocks, plan_listing
    from pipeline.storage import open_fs
    from pipeline.storage import manifest_form

    fs, root = open_fs(source)
    fs.ls(root.split("/", 1)[0])  # the client is made and connected before the clock starts
    base = vm_hwm_mb()
    start = time.perf_counter()
    check_source(fs, root, source, DEFAULT_EXTENSIONS)
    groups = plan_listing(fs, root, DEFAULT_EXTENSIONS, LIST_TASKS, source=source)
    planned = time.perf_counter() - start
    empty = np.empty(0, np.int64)
    rows = errors = 0
    for group in groups:
        for block in listing_blocks(fs, group, DEFAULT_EXTENSIONS, done=empty, previous=empty,
                                    named=manifest_form(source) is not None):
            rows += block.num_rows
            errors += block.column("status").null_count != block.num_rows
    seconds = time.perf_counter() - start
    print(json.dumps({"entries": rows, "errors": errors, "seconds": seconds, "plan_s": planned,
                      "units": sum(map(len, groups)), "peak_mb": vm_hwm_mb(), "base_mb": base}), flush=True)


def run_measure(source: str, env: dict, code: Path = REPO) -> dict:
    """``measure(source)`` in a fresh subprocess, with the listing code of the checkout ``code``."""
    script = code / "tests" / "benchmarks" / Path(__file__).name
    out = subprocess.run([sys.executable, str(script), "--measure", source], env={**env, "PYTHONPATH": str(code)},
                         capture_output=True, text=True, check=True, cwd=code)
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_comparison(pairs: list[tuple[str, int, list[dict], list[dict]]], baseline: Path) -> None:
    """Both sides' seconds (plan, and plan + listing) as median [min-max] over the rounds, and this / baseline."""
    import statistics

    def spread(rs: list[dict], key: str) -> str:
        values = [r[key] for r in rs]
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    print(f"\nthis checkout ({REPO.name}) against {baseline}, median [min-max] of {len(pairs[0][2])} rounds")
    print(f"{'source':<22}{'entries':>11}{'plan s, this':>22}{'plan s, baseline':>22}{'ratio':>7}"
          f"{'plan+list s, this':>22}{'plan+list s, base':>22}{'ratio':>7}")
    for kind, n, mine, base in pairs:
        ratios = [statistics.median(r[k] for r in mine) / statistics.median(r[k] for r in base)
                  for k in ("plan_s", "seconds")]
        print(f"{kind:<22}{n:>11,}{spread(mine, 'plan_s'):>22}{spread(base, 'plan_s'):>22}{ratios[0]:>6.2f}x"
              f"{spread(mine, 'seconds'):>22}{spread(base, 'seconds'):>22}{ratios[1]:>6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,1000000", help="Manifest sizes (entries).")
    parser.add_argument("--list-sizes", default="100000", help="Sizes of the buckets LISTed on moto.")
    parser.add_argument("--inventory-file-rows", type=int, default=250_000, help="Rows per inventory data file.")
    parser.add_argument("--baseline", type=Path, default=None, help="Another checkout to measure side by side.")
    parser.add_argument("--rounds", type=int, default=1, help="Measurements of each manifest (and side).")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    list_sizes = [int(s) for s in args.list_sizes.split(",") if s]
    if args.serve is not None:
        return serve(args.serve, list_sizes)
    if args.measure is not None:
        return measure(args.measure)

    import socket

    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1", "PYTHONPATH": str(REPO)}
    os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                           "AWS_DEFAULT_REGION")})
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--list-sizes", args.list_sizes],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout.readline().strip() == "ready", "moto did not start"
        print(f"moto filled with {sum(list_sizes):,} keys in {time.perf_counter() - t0:.0f} s", flush=True)
        client = boto3.client("s3")
        results: list[tuple[str, int, dict]] = []
        for n in list_sizes:
            r = run_measure(f"s3://bench-list-{n}/photos", env)
            results.append(("LIST (moto)", n, r))
            print(f"LIST {n:,}: {r}", flush=True)
        pairs: list[tuple[str, int, list[dict], list[dict]]] = []
        for n in [int(s) for s in args.sizes.split(",")]:
            for kind, src in write_manifests(client, n, args.inventory_file_rows).items():
                mine, base = [], []
                for i in range(max(1, args.rounds)):
                    sides = [(mine, REPO, "")] + ([(base, args.baseline, " (baseline)")] if args.baseline else [])
                    for side, code, label in sides if i % 2 == 0 else sides[::-1]:  # who goes first alternates
                        side.append(run_measure(src, env, code))
                        print(f"{kind} {n:,}{label}: {side[-1]}", flush=True)
                results.append((kind, n, mine[0]))
                pairs.append((kind, n, mine, base))
    finally:
        server.kill()
        server.wait()
    list_rate = {n: r["entries"] / r["seconds"] for kind, n, r in results if kind.startswith("LIST")}
    print(f"\n{'source':<22}{'entries':>11}{'units':>7}{'seconds':>9}{'entries/s':>12}{'vs LIST':>9}"
          f"{'peak MB':>9}{'+MB':>7}{'peak vs smallest':>18}")
    smallest: dict[str, float] = {}
    for kind, n, r in results:
        rate = r["entries"] / r["seconds"]
        same = list_rate.get(n) or (list_rate[max(list_rate)] if list_rate else None)
        versus = f"{rate / same:.1f}x" + ("" if n in list_rate else "*") if same and not kind.startswith("LIST") \
            else "-"
        smallest.setdefault(kind, r["peak_mb"])
        print(f"{kind:<22}{r['entries']:>11,}{r['units']:>7}{r['seconds']:>9.2f}{rate:>12,.0f}{versus:>9}"
              f"{r['peak_mb']:>9.0f}{r['peak_mb'] - r['base_mb']:>7.0f}{r['peak_mb'] / smallest[kind]:>17.2f}x")
    if any(n not in list_rate for _k, n, _r in results):
        print(f"* against the LIST of {max(list_rate):,} keys (the largest listed on moto)" if list_rate else "")
    if args.baseline is not None:
        print_comparison(pairs, args.baseline)


if __name__ == "__main__":
    main()
