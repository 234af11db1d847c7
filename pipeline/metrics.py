"""Prometheus metrics of a running job: the driver's counters served on a loopback HTTP port.

What is exposed (all prefixed ``bulk_classify_``), scraped from ``http://127.0.0.1:PORT/metrics``:

    images_listed              gauge    objects listed in the source so far (the progress total)
    rows_total{status}         counter  rows committed to Parquet, by status (ok / error); carried rows included
    carried_total              counter  rows carried over unchanged from --previous (not reclassified)
    errors_total               counter  error rows committed
    engine_calls_total         counter  engine calls (batches) behind the committed rows
    images_per_second          gauge    classified rows per second over the last RATE_WINDOW_S seconds
    avg_batch_size             gauge    classified rows / engine calls since the start
    batch_size                 histogram  average batch size formed, one observation per committed shard
    progress_ratio             gauge    committed rows / listed objects (0..1)
    start_time_seconds         gauge    Unix time the job started

Each actor's local tritonserver has its own metrics endpoint (``nv_inference_*`` counters, GPU
utilisation and memory) on a loopback port that ``pipeline.triton.server`` picks; it is not
re-exported here. Prometheus on another host scrapes neither directly: run a node-local agent or a
sidecar that scrapes loopback and forwards (remote-write), which keeps both ports off the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError
from pipeline.node import LOOPBACK
from pipeline.schema import STATUS_ERROR, STATUS_OK

if TYPE_CHECKING:
    from pipeline.io.stats import ShardStats

LOG = logging.getLogger(__name__)

PREFIX = "bulk_classify"
RATE_WINDOW_S = 60.0
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class JobMetrics:
    """The job's Prometheus endpoint; a no-op when ``port`` is None.

    Args:
        port: TCP port to serve on; 0 picks a free one (read it back from ``.port``); None disables.
        host: address to bind; loopback unless you know the port must be reachable from elsewhere.
    """

    def __init__(self, port: int | None, *, host: str = LOOPBACK):
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()
        self._classified = 0
        self._calls = 0
        self._listed = 0
        self._rows = 0
        if port is None:
            return
        if not 0 <= port < 65536:
            raise ConfigError(f"--metrics-port {port} is not a TCP port; use 1024..65535, or 0 for any free port")
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        # A registry of our own: two runs in one process (tests, notebooks) must not clash on names.
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._listed_g = Gauge(f"{PREFIX}_images_listed", "Objects listed in the source so far", registry=reg)
        self._rows_c = Counter(f"{PREFIX}_rows", "Rows committed to Parquet, by status", ["status"], registry=reg)
        for status in (STATUS_OK, STATUS_ERROR):  # present from the first scrape, so rate() starts at zero
            self._rows_c.labels(status=status)
        self._carried_c = Counter(f"{PREFIX}_carried", "Rows carried over from the previous run", registry=reg)
        self._errors_c = Counter(f"{PREFIX}_errors", "Error rows committed", registry=reg)
        self._calls_c = Counter(f"{PREFIX}_engine_calls", "Engine calls behind the committed rows", registry=reg)
        self._batch_h = Histogram(f"{PREFIX}_batch_size", "Average batch size formed, per committed shard",
                                  buckets=BATCH_BUCKETS, registry=reg)
        rate = Gauge(f"{PREFIX}_images_per_second",
                     f"Classified rows per second over the last {RATE_WINDOW_S:.0f} s", registry=reg)
        rate.set_function(self.images_per_second)
        avg = Gauge(f"{PREFIX}_avg_batch_size", "Classified rows / engine calls since the start", registry=reg)
        avg.set_function(lambda: self._classified / self._calls if self._calls else 0.0)
        ratio = Gauge(f"{PREFIX}_progress_ratio", "Committed rows / listed objects", registry=reg)
        ratio.set_function(lambda: min(1.0, self._rows / self._listed) if self._listed else 0.0)
        Gauge(f"{PREFIX}_start_time_seconds", "Unix time the job started", registry=reg).set(time.time())
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=reg)
        except OSError as err:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {err}; choose another --metrics-port "
                              "or 0 for any free port") from None
        self.port = self._server.server_address[1]
        self._samples.append((time.monotonic(), 0))
        LOG.info("job metrics on http://%s:%d/metrics", host, self.port)

    @property
    def enabled(self) -> bool:
        return self._server is not None

    def set_listed(self, n: int) -> None:
        """Record how many objects the listing has produced so far."""
        self._listed = int(n)
        if self.enabled:
            self._listed_g.set(n)

    def add_rows(self, ok: int, error: int, engine_calls: int, carried: int = 0) -> None:
        """Record one committed shard: its ok and error rows (carried ones included) and engine calls."""
        ok, error, engine_calls, carried = int(ok), int(error), int(engine_calls), int(carried)
        classified = max(0, ok + error - carried)
        with self._lock:
            self._rows += ok + error
            self._classified += classified
            self._calls += engine_calls
            now = time.monotonic()
            self._samples.append((now, self._classified))
            while len(self._samples) > 2 and now - self._samples[1][0] > RATE_WINDOW_S:
                self._samples.popleft()
        if not self.enabled:
            return
        self._rows_c.labels(status=STATUS_OK).inc(ok)
        self._rows_c.labels(status=STATUS_ERROR).inc(error)
        self._errors_c.inc(error)
        self._carried_c.inc(carried)
        self._calls_c.inc(engine_calls)
        if engine_calls and classified:
            self._batch_h.observe(classified / engine_calls)

    def add_shard(self, shard: "ShardStats") -> None:
        """Record one committed shard's stats."""
        self.add_rows(ok=shard.ok, error=shard.errors, engine_calls=int(round(shard.engine_calls)),
                      carried=shard.carried)

    def images_per_second(self) -> float:
        """Classified rows per second over the last ``RATE_WINDOW_S`` seconds (0 before the first shard)."""
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            t0, n0 = self._samples[0]
            now = time.monotonic()
            return (self._classified - n0) / max(now - t0, 1e-9)

    def close(self) -> None:
        """Stop serving; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "JobMetrics":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
