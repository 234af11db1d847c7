"""Carry-over with a real local Ray: the copy of unchanged rows runs beside the classification, not after it."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from conftest import make_jpeg
from pipeline.config import RunConfig
from pipeline.job import run_job
from test_faults import previous_rows


def test_unchanged_rows_are_committed_while_the_new_objects_are_still_classified(tmp_path, ray_local):
    from pipeline.model.folder import load_model
    from pipeline.quality.statistics import quality_footer
    from pipeline.io.writer import write_shard

    src, prev, out = tmp_path / "src", tmp_path / "prev", tmp_path / "out"
    seed = tmp_path / "seed.jpg"
    seed.write_bytes(make_jpeg(1, (24, 20)))
    old = [src / f"d{i // 500}" / f"old{i:05d}.jpg" for i in range(1500)]
    for path in old:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.link(seed, path)
    new = src / "new"
    new.mkdir()
    for i in range(600):  # several seconds of the default model on one actor
        (new / f"new{i:05d}.jpg").write_bytes(make_jpeg(100 + i, (24, 20)))
    model = load_model(None).name
    for start in range(0, len(old), 100):
        write_shard(previous_rows(old[start:start + 100], model), output=str(prev), storage_options={},
                    footer=quality_footer)

    summary = run_job(RunConfig(source=str(src), output=str(out), previous=str(prev), shard_size=100))

    assert (summary.classified, summary.carried, summary.total) == (600, 1500, 2100)
    committed: dict[bool, list[int]] = {True: [], False: []}
    for part in out.rglob("part-*.parquet"):
        carried = pq.read_table(part, columns=["carried"]).column("carried").to_pylist()
        assert len(set(carried)) == 1  # a shard is either carried rows or classified rows
        committed[carried[0]].append(part.stat().st_mtime_ns)
    # Before, the carry started only once the last classified shard was committed.
    assert min(committed[True]) < max(committed[False])
    uris = pads.dataset(str(out), format="parquet").to_table(columns=["uri"]).column("uri").to_pylist()
    assert len(uris) == len(set(uris)) == 2100


def test_every_planned_listing_task_starts_at_once_in_the_jobs_pipeline(tmp_path, ray_local):
    """The job's four operators on 2 CPUs with one classify actor taking a whole CPU: the two listing tasks must run
    together (each waits for the other). With a request of 0.25 CPU, Ray Data ran them one after another."""
    import ray
    from ray.data import ActorPoolStrategy, Datasource, TaskPoolStrategy
    from ray.data.block import BlockMetadata
    from ray.data.datasource import ReadTask

    from pipeline.job.stages import IO_TASK_CPUS, listing_task_cpus

    class Rendezvous(Datasource):
        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            return [ReadTask(lambda i=i: self._read(i), meta) for i in range(2)]

        def _read(self, i):
            (tmp_path / f"started{i}").touch()
            deadline = time.monotonic() + 30
            while not (tmp_path / f"started{1 - i}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            yield pa.table({"task": [i], "met": [(tmp_path / f"started{1 - i}").exists()]})

    class Classify:
        def __call__(self, batch):
            return batch

    cpus = int(ray.cluster_resources()["CPU"])
    assert cpus == 2
    ds = ray.data.read_datasource(Rendezvous(), override_num_blocks=2, num_cpus=listing_task_cpus(cpus, 2))
    ds = ds.map_batches(lambda b: b, batch_format="pyarrow", num_cpus=IO_TASK_CPUS, compute=TaskPoolStrategy(size=2))
    ds = ds.map_batches(Classify, batch_format="pyarrow", num_cpus=1.0, compute=ActorPoolStrategy(size=1))
    ds = ds.map_batches(lambda b: b, batch_format="pyarrow", num_cpus=IO_TASK_CPUS, compute=TaskPoolStrategy(size=1))
    rows = pa.concat_tables(list(ds.iter_batches(batch_size=None, batch_format="pyarrow"))).to_pylist()
    assert sorted((r["task"], r["met"]) for r in rows) == [(0, True), (1, True)]
