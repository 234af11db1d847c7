"""The job's listing as a Ray Data datasource: one read task per planned group of folders or key ranges, dropping
what the output holds and what ``--previous`` holds unchanged, and telling the listing counter what it saw."""

from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from ray.data import Datasource

from pipeline.columns import conform
from pipeline.io.source import listing_blocks, resolve_keys
from pipeline.schema import WORK_SCHEMA
from pipeline.storage import manifest_form, open_fs

COUNTS_EVERY_S = 0.25  # a listing task sends its counts to the counter actor at most this often (progress)


class ListingDatasource(Datasource):
    """Ray Data datasource over the source's listing: one read task per planned group of key ranges or folders.

    ``done`` and ``previous`` are Ray object refs of sorted int64 key arrays: read tasks map them from the object
    store without copying, so their memory counts once per node, not once per task. Carried identities and the
    counts go to the ``counter`` actor; each task tells it when it has finished (``ListingCounter.finish``).
    Objects under ``excluded`` (an output inside the source) are never listed as input.
    """

    def __init__(self, url: str, storage_options: Any, extensions: tuple[str, ...], groups: list[list], *,
                 done: Any = None, previous: Any = None, counter: Any = None, excluded: str | None = None,
                 schema: pa.Schema = WORK_SCHEMA):
        self.schema = schema  # the run's working columns (its models' columns: pipeline.columns.work_schema)
        self.url, self.storage_options, self.extensions = url, dict(storage_options), extensions
        self.groups, self.done, self.previous, self.counter = groups, done, previous, counter
        self.excluded = None if excluded is None else "file://" + excluded.rstrip("/") + "/"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_name(self) -> str:
        return "Listing"

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None):
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        # The groups were planned in the driver (listing_groups), so the counter knows how many finishes to wait for.
        meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
        return [ReadTask(lambda i=i, g=group: self._read(i, g), meta) for i, group in enumerate(self.groups)]

    def _read(self, index: int, group: list) -> Iterator[pa.Table]:
        fs, _root = open_fs(self.url, self.storage_options)
        calls = _CounterCalls(self.counter)
        for block in listing_blocks(fs, group, self.extensions, done=resolve_keys(self.done),
                                    previous=resolve_keys(self.previous), report=calls.report,
                                    claim=calls.claim if self.counter is not None else None,
                                    named=manifest_form(self.url) is not None):
            if self.excluded is not None:
                block = block.filter(pc.invert(pc.starts_with(block.column("uri"), self.excluded)))
            yield conform(block, self.schema)
        calls.finish(index)


class _CounterCalls:
    """A listing task's calls to the counter: counts sent at most every COUNTS_EVERY_S, carried identities as they
    come, and at the end ``finish`` once every earlier call has run (an asyncio actor does not keep their order)."""

    def __init__(self, counter: Any):
        self.counter, self.pending, self.sums, self.sent_at = counter, [], [0, 0, 0.0], 0.0

    def report(self, listed: int, skipped: int, seconds: float, carried: np.ndarray | None) -> None:
        if self.counter is None:
            return
        self.sums = [self.sums[0] + listed, self.sums[1] + skipped, self.sums[2] + seconds]
        if carried is not None:
            self.pending.append(self.counter.add_carried.remote(carried))
        if time.monotonic() - self.sent_at >= COUNTS_EVERY_S:
            self._send_counts()

    def _send_counts(self) -> None:
        import ray

        if self.sums[0] or self.sums[1]:
            self.pending.append(self.counter.add.remote(*self.sums))
            self.sums = [0, 0, 0.0]
        self.sent_at = time.monotonic()
        if len(self.pending) > 64:  # keep only the refs of calls not yet run
            _ran, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)

    def claim(self, folder: tuple[int, int]) -> bool:
        """Whether this task walks a folder out of the source reached through a followed link (the counter knows
        which task asked first)."""
        import ray

        return ray.get(self.counter.claim.remote(tuple(folder)))

    def finish(self, index: int) -> None:
        import ray

        if self.counter is None:
            return
        self._send_counts()
        ray.get(self.pending)
        ray.get(self.counter.finish.remote(index))
