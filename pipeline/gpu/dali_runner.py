"""A DALI pipeline kept several batches ahead, in its own thread (the gpu profile's ``dali_depth``).

``Runner`` feeds one built pipeline (``feed_input`` + ``schedule_run``) as soon as fewer than ``depth`` runs are in
flight and hands each run's output to its caller in submission order (``share_outputs`` / ``release_outputs``), so
DALI overlaps the CPU, decoder and GPU stages of consecutive batches. A failed run breaks the pipeline and every run
in flight: the pipeline is rebuilt and those batches run again one at a time, so the failure goes to the batch that
caused it (``DaliRefused``) and the others succeed.
"""

from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from pipeline.gpu.dali_graph import ENCODED, first_line

# What a failed DALI run raises (one undecodable file fails the batch).
DALI_ERRORS = (RuntimeError, IndexError, ValueError)
_CLOSE = object()


class DaliRefused(Exception):
    """DALI failed a batch (one file it cannot decode fails them all); the message is DALI's reason."""


def consumed(outs):
    """A run's outputs as ``consume`` receives them: the one TensorList of a one-branch graph, else a tuple of them
    (a model set's branches, ``pipeline.gpu.dali_graph.preprocess_graphs``)."""
    return outs[0] if len(outs) == 1 else tuple(outs)


@dataclass
class _Job:
    arrays: list
    consume: Callable[[Any], None]
    future: Future


class Runner:
    """One DALI pipeline kept ``depth`` batches ahead, in its own thread.

    ``submit`` queues a batch; the thread feeds it and schedules a run as soon as fewer than ``depth`` runs are
    in flight, and hands each batch's output to its ``consume`` (in the runner's thread, while the output is
    valid) in the order the batches were submitted. A failed run breaks the pipeline and every run in flight: the
    pipeline is rebuilt and those batches are run again one at a time, so a failure is given to the batch that
    caused it (``DaliRefused``) and the others still succeed.
    """

    def __init__(self, build: Callable[[], Any], depth: int):
        self._build = build
        self.depth = depth
        self._pipe = self._new()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="dali-runner", daemon=True)
        self._thread.start()

    def submit(self, blobs: Sequence[bytes], consume: Callable[[Any], None]) -> Future:
        job = _Job([np.frombuffer(b, dtype=np.uint8) for b in blobs], consume, Future())
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        self._queue.put(_CLOSE)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        flight: collections.deque = collections.deque()
        closing = False
        while True:
            while not closing and len(flight) < self.depth:
                try:
                    job = self._queue.get(block=not flight)
                except queue.Empty:
                    break
                if job is _CLOSE:
                    closing = True
                    break
                try:
                    self._schedule(job)
                except DALI_ERRORS:
                    self._recover([*flight, job])
                    flight.clear()
                    continue
                flight.append(job)
            if not flight:
                if closing:
                    return
                continue
            job = flight.popleft()
            try:
                self._collect(job)
            except DALI_ERRORS:
                self._recover([job, *flight])
                flight.clear()

    def _schedule(self, job: _Job) -> None:
        self._pipe.feed_input(ENCODED, job.arrays)
        self._pipe.schedule_run()

    def _collect(self, job: _Job) -> None:
        outs = self._pipe.share_outputs()
        try:
            job.consume(consumed(outs))
        except BaseException as err:  # noqa: BLE001 - the caller's failure, reported to the caller
            job.future.set_exception(err)
        else:
            job.future.set_result(None)
        finally:
            self._pipe.release_outputs()

    def _recover(self, jobs: list) -> None:
        """A run failed: the pipeline and every run in flight are lost. Rebuild, then run each batch alone."""
        for job in jobs:
            self._pipe = self._new()
            try:
                self._schedule(job)
                self._collect(job)
            except DALI_ERRORS as err:
                job.future.set_exception(DaliRefused(first_line(err)))
        self._pipe = self._new()

    def _new(self):
        pipe = self._build()
        # DALI's first schedule_run() "prefetches": it runs the graph prefetch_queue_depth times, which with fed
        # inputs means runs with no data yet that every later batch waits behind; each schedule_run() here follows
        # its own feed_input, so start past that step.
        pipe._first_iter = False  # noqa: SLF001 - DALI 2.4's Pipeline; no public switch for it
        return pipe
