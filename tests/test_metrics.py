from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

import kvpool
from kvpool.metrics import LatencyHistogram
from tests.pool_configs import small_config


def scrape(address: tuple[str, int], path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=5) as reply:
        return reply.status, reply.read().decode()


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_pool_metrics_and_health(tmp_path) -> None:
    pool = kvpool.Pool(small_config(tmp_path, ("dram", "nvme")))
    try:
        kv = np.ones((2, 2, 8, 2, 16), np.float16)
        pool.put(b"a", kv)
        pool.get(b"a")
        pool.get(b"missing")
        server = pool.serve_metrics()
        status, body = scrape(server.address, "/health")
        assert status == 200 and json.loads(body) == {"role": "embedded", "ready": True}
        status, text = scrape(server.address, "/metrics")
        assert status == 200
        assert sample(text, "kvpool_put_seconds_count") == 1
        assert sample(text, "kvpool_get_seconds_count") == 2
        assert sample(text, 'kvpool_misses_total{reason="absent"}') == 1
        assert sample(text, 'kvpool_hits_total{tier="dram"}') == 1
        assert sample(text, 'kvpool_tier_objects{tier="dram"}') == 1
        assert sample(text, 'kvpool_tier_capacity_bytes{tier="nvme"}') == 16 << 20
        assert sample(text, "kvpool_bytes_put_total") == kv.nbytes
    finally:
        pool.close()
    with pytest.raises(OSError):
        scrape(server.address, "/health")  # closed with the pool


def test_latency_histogram_buckets_are_cumulative() -> None:
    histogram = LatencyHistogram("x_seconds", "test")
    for seconds in (3e-6, 3e-6, 2e-4, 10.0):
        histogram.observe(seconds)
    family = histogram.family()
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name == "x_seconds_bucket"}
    assert buckets["5e-06"] == 2 and buckets["0.00025"] == 3 and buckets["+Inf"] == 4
    assert histogram.count == 4
    assert [s.value for s in family.samples if s.name == "x_seconds_sum"] == [pytest.approx(10.000206)]
