"""Requests in, one pipeline out: the gpu profile's Triton model feeds every request's images into one long-running
``GpuClassifier.run_stream``, so decode of the next requests overlaps the network on this one across ``execute()``
calls, and network batches are full whatever the requests' sizes.

``RequestStream.submit`` (called from ``execute``) triages a request's images on the CPU (caps, JPEG header) and
queues them; the stream's thread cuts the queue into network batches (``batch_size`` images, or fewer when the GPU
would otherwise wait longer than ``max_delay_s``), runs them through the classifier's pipeline, and calls
``respond(sender, RawResults, n)`` for a request as soon as its last image is done. A batch that fails as a whole
(a CUDA error, say) fails its images with an ``engine_error`` and the stream goes on. Each image's TAG travels on
its item through the pipeline and lands in ``RawResults.echo`` beside its answer, so the client checks the stream's
bookkeeping of every image.

With ``max_backlog`` set, ``submit`` waits while that many batches' worth of images are already in the stream, so a
Triton model instance with enough work stays busy in ``execute()`` and the server gives the next requests to another
instance (its scheduler hands requests to free instances; an ``execute()`` that returns at once is always free).

Torch-free: the classifier brings torch; tests run this module with the hop's ``NullClassifier``
(tests/benchmarks/hop_model.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pipeline.gpu.classifier import (
    STOP, Chunk, ModelScores, RawResults, empty_embedding, empty_scores, triage, write_scores,
)
from pipeline.errors import ImageError
from pipeline.model.imaging import DecodeLimits
from pipeline.gpu.defaults import GPU_DEFAULT_MAX_DELAY_MS

LOG = logging.getLogger(__name__)

_CLOSE = object()


@dataclass
class _Request:
    """One request's images on their way through the stream, and its results so far."""

    sender: Any
    n: int
    ids: np.ndarray
    scores: np.ndarray
    width: np.ndarray
    height: np.ndarray
    errors: list[str]
    tags: np.ndarray  # int64 [n], the request's TAG input
    echo: np.ndarray  # int64 [n], the TAG of the image each answer was made for
    more: list[ModelScores]  # a model set's other models' top-k
    embedding: np.ndarray | None = None  # float32 [n, dim]: the first model's embedding, where it has one
    remaining: int = 0  # images still in the stream
    counted: int = 0  # images this request adds to the stream's backlog
    done: bool = False

    @classmethod
    def new(cls, sender, n: int, top_k: int, tags: np.ndarray | None = None, more_top_k=(), embedding_dim: int = 0,
            more_embedding_dims=()) -> "_Request":
        tags = np.zeros(n, np.int64) if tags is None else np.asarray(tags, np.int64).reshape(n)
        return cls(sender, n, np.zeros((n, top_k), np.int32), np.zeros((n, top_k), np.float32),
                   np.zeros(n, np.int32), np.zeros(n, np.int32), [""] * n, tags, np.zeros(n, np.int64),
                   empty_scores(n, more_top_k, more_embedding_dims), empty_embedding(n, embedding_dim))

    def results(self) -> RawResults:
        return RawResults(self.ids, self.scores, self.width, self.height, self.errors, self.echo, more=self.more,
                          embedding=self.embedding)


@dataclass
class _Pending:
    """Queued images not yet cut into a batch: (serial, item) pairs, oldest first."""

    items: list = field(default_factory=list)
    since: float = 0.0  # when the oldest queued image arrived


class RequestStream:
    """Feeds requests' images into one ``classifier.run_stream`` running in its own thread.

    Args:
        classifier: a ``GpuClassifier`` (or anything with ``batch_size`` and ``run_stream``).
        respond: ``respond(sender, results, n)``, called from the stream's thread once per request.
        top_k: classes per image in the results.
        max_delay_s: how long queued images wait for a fuller batch while the GPU has nothing else to do.
        max_backlog: batches' worth of images in the stream (queued, being prepared or on the GPU) above which
            ``submit`` waits for some to finish; 0 never waits. One request is always let in, whatever its size.
    """

    def __init__(self, classifier, respond: Callable[[Any, RawResults, int], None], *, top_k: int,
                 max_delay_s: float = GPU_DEFAULT_MAX_DELAY_MS / 1000, max_backlog: float = 0):
        self.classifier = classifier
        self.respond = respond
        self.top_k = top_k
        self.max_delay_s = max_delay_s
        self.batch_size = int(classifier.batch_size)
        self.more_top_k = tuple(getattr(classifier, "more_top_k", ()))  # a model set's other models
        # each model's embedding width (0: none)
        self.embedding_dim = getattr(classifier, "embedding_dim", 0)
        self.more_embedding_dims = tuple(getattr(classifier, "more_embedding_dims", ()))
        self._queue: queue.Queue = queue.Queue()
        self._pending = _Pending()
        self._owners: dict[int, tuple[_Request, int]] = {}  # serial -> (request, position); stream thread only
        self._serial = 0
        self._submit_lock = threading.Lock()  # submit is called from several threads (the gpu engine's calls)
        self._closing = False
        self.max_backlog_images = int(max_backlog * self.batch_size)
        self._backlog = 0  # images submitted and not yet answered
        self._backlog_changed = threading.Condition()
        self.batches = 0  # network batches cut, and their images (for the average batch)
        self.images = 0
        self.requests = 0
        self.waits = 0  # submits that waited for the backlog, and how long in all
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="gpu-stream", daemon=True)
        self._thread.start()

    # ---- the caller's side (Triton's execute thread) ----------------------------------------------------------

    def submit(self, sender, blobs: list[bytes], limits: DecodeLimits, tags: np.ndarray | None = None) -> None:
        """Queues one request's images (``tags``: their TAGs, zeros when None); its response comes through
        ``respond`` (at once if nothing is left)."""
        request = _Request.new(sender, len(blobs), self.top_k, tags, self.more_top_k, self.embedding_dim,
                               self.more_embedding_dims)
        items = []
        with self._submit_lock:
            serial = self._serial
            self._serial += len(blobs)
            self.requests += 1
        for pos, data in enumerate(blobs):
            try:
                item = triage(serial + pos, data, limits)
            except ImageError as err:
                request.errors[pos] = str(err)
                request.echo[pos] = request.tags[pos]
                continue
            item.tag = int(request.tags[pos])
            items.append((item, pos))
        request.remaining = len(items)
        if not items:
            self._finish(request)
            return
        self._admit(request)
        self._queue.put((request, items))

    def _admit(self, request: _Request) -> None:
        """Waits while the backlog is full (``max_backlog``), then counts the request's images in it."""
        with self._backlog_changed:
            if self.max_backlog_images and self._backlog >= self.max_backlog_images and not self._closing:
                t0 = time.monotonic()
                self.waits += 1
                while self._backlog >= self.max_backlog_images and not self._closing:
                    self._backlog_changed.wait(1.0)
                self.wait_s += time.monotonic() - t0
            request.counted = request.remaining
            self._backlog += request.counted

    def stats(self) -> str:
        """One line: requests, images and batches so far, and how often ``submit`` waited for the backlog."""
        return (f"{self.requests} requests, {self.images} images in {self.batches} batches "
                f"(mean {self.images / max(self.batches, 1):.0f}), waited {self.waits} times for "
                f"{self.wait_s:.2f} s (max_backlog {self.max_backlog_images} images)")

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops taking work, finishes what is queued, and stops the thread."""
        self._closing = True
        with self._backlog_changed:
            self._backlog_changed.notify_all()
        self._queue.put(_CLOSE)
        self._thread.join(timeout_s)

    # ---- the stream's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self.classifier.run_stream(self._source, self._sink)
                return
            except Exception:  # noqa: BLE001 - a bug in the pipeline must not leave requests waiting forever
                LOG.exception("the gpu stream failed; failing its requests in flight and starting again")
                for request, _ in list(self._owners.values()):
                    if not request.done:
                        request.errors = [e or "engine_error: the gpu pipeline failed" for e in request.errors]
                        request.echo[:] = request.tags  # answered as a whole: every row an error
                        self._finish(request)
                self._owners.clear()
                if self._closing:
                    return

    def _take(self, timeout: float | None) -> bool:
        """Moves one request's items from the queue to the pending list; False when nothing came or closing."""
        try:
            got = self._queue.get(timeout=timeout) if timeout is None or timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return False
        if got is _CLOSE:
            self._closing = True
            return False
        request, items = got
        if not self._pending.items:
            self._pending.since = time.monotonic()
        for item, pos in items:
            self._owners[item.index] = (request, pos)
            self._pending.items.append(item)
        return True

    def _source(self, block: bool):
        pending = self._pending
        while len(pending.items) < self.batch_size and self._take(0):
            pass
        if not pending.items:
            if not block:
                return None
            while not self._closing and not self._take(None):
                pass
            if not pending.items:
                return STOP
        if len(pending.items) < self.batch_size:
            wait = pending.since + self.max_delay_s - time.monotonic()
            if not block and wait > 0 and not self._closing:
                return None  # the GPU is busy: let the batch fill a little longer
            deadline = time.monotonic() + max(wait, 0.0)
            while len(pending.items) < self.batch_size and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0 or not self._take(left):
                    break
        batch, pending.items = pending.items[: self.batch_size], pending.items[self.batch_size :]
        pending.since = time.monotonic()
        self.batches += 1
        self.images += len(batch)
        return Chunk(batch)

    def _sink(self, chunk: Chunk, ids, scores, error: BaseException | None) -> None:
        if error is not None:
            msg = f"engine_error: the batch failed on the GPU ({type(error).__name__}: {str(error)[:300]})"
            for item in chunk.items:
                chunk.errors.setdefault(item.index, msg)
        for serial, msg in chunk.errors.items():
            request, pos = self._owners[serial]
            request.errors[pos] = msg
        if ids is not None and error is None:
            for row, p in enumerate(chunk.ok):
                item = chunk.items[p]
                request, pos = self._owners[item.index]
                request.ids[pos, : ids.shape[1]] = ids[row]
                request.scores[pos, : scores.shape[1]] = scores[row]
                request.width[pos] = item.width
                request.height[pos] = item.height
                if request.embedding is not None and chunk.embedding is not None:
                    request.embedding[pos] = chunk.embedding[row]
                write_scores(request.more, pos, chunk.more_scores, row)
        for item in chunk.items:
            request, pos = self._owners.pop(item.index)
            request.echo[pos] = item.tag
            request.remaining -= 1
            if request.remaining == 0:
                self._finish(request)

    def _finish(self, request: _Request) -> None:
        request.done = True
        if request.counted:
            with self._backlog_changed:
                self._backlog -= request.counted
                request.counted = 0
                self._backlog_changed.notify_all()
        try:
            self.respond(request.sender, request.results(), request.n)
        except Exception:  # noqa: BLE001 - the client may be gone; the stream goes on
            LOG.exception("sending a response failed")
