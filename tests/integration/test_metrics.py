"""The job's Prometheus endpoint, scraped over real HTTP on loopback."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import ConfigError
from pipeline.metrics import JobMetrics


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_counters_are_served_on_loopback_and_follow_committed_shards():
    with JobMetrics(0) as m:
        assert m.port and m._server.server_address[0] == "127.0.0.1"
        m.set_listed(100)
        m.add_rows(ok=30, error=2, engine_calls=4)
        m.add_rows(ok=10, error=0, engine_calls=0, carried=10)
        got = scrape(m.port)
        assert got["bulk_classify_images_listed"] == 100
        assert got["bulk_classify_rows_total{status=ok}"] == 40
        assert got["bulk_classify_rows_total{status=error}"] == 2
        assert got["bulk_classify_errors_total"] == 2
        assert got["bulk_classify_carried_total"] == 10
        assert got["bulk_classify_engine_calls_total"] == 4
        assert got["bulk_classify_avg_batch_size"] == 8.0  # 32 classified / 4 calls; carried rows excluded
        assert got["bulk_classify_batch_size_count"] == 1  # the all-carried shard formed no batch
        assert got["bulk_classify_batch_size_sum"] == 8.0
        assert got["bulk_classify_progress_ratio"] == pytest.approx(0.42)
        assert got["bulk_classify_images_per_second"] > 0
        port = m.port
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_disabled_when_port_is_none():
    m = JobMetrics(None)
    assert m.port is None and not m.enabled
    m.set_listed(3)
    m.add_rows(ok=1, error=0, engine_calls=1)
    m.close()


def test_port_in_use_says_how_to_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="choose another --metrics-port or 0"):
            JobMetrics(busy.getsockname()[1])
    with pytest.raises(ConfigError, match="not a TCP port"):
        JobMetrics(70000)


def test_two_instances_in_one_process_do_not_clash():
    with JobMetrics(0) as a, JobMetrics(0) as b:
        a.add_rows(ok=1, error=0, engine_calls=1)
        assert a.port != b.port
        assert scrape(a.port)["bulk_classify_rows_total{status=ok}"] == 1
        assert scrape(b.port)["bulk_classify_rows_total{status=ok}"] == 0
