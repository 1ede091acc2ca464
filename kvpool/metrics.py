"""Prometheus metrics and a health endpoint, served over HTTP on 127.0.0.1.

Owns translating the pool's own counters (tier usage, hits and misses by
reason, bytes moved, evictions, demotions, promotions, master state) into
Prometheus metrics at scrape time, plus put/get latency histograms observed on
the API path. Collecting at scrape time keeps the hot paths free of metric
bookkeeping beyond one histogram observation per call.

``GET /metrics`` is the Prometheus text format; ``GET /health`` is JSON
``{"role": ..., "ready": bool, ...}`` with status 200 when ready, else 503.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("kvpool.metrics")

_LATENCY_BUCKETS_S = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                      5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
MISS_REASONS = ("absent", "evicted", "stale", "checksum", "holder_gone", "timeout")


class LatencyHistogram:
    """Latency buckets cheap enough to observe on every call (one bisect, two adds).

    prometheus_client's Histogram takes a lock and walks its buckets in Python,
    a cost of the order of a small dram get itself; this does the minimum and builds the
    cumulative family at scrape time. Updates are unlocked: under the GIL a
    thread switch inside ``+=`` can, rarely, lose one count — acceptable for a
    latency distribution, never for the pool's own accounting.
    """

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(_LATENCY_BUCKETS_S)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self) -> HistogramMetricFamily:
        buckets, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += count
            buckets.append((bound, running))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], buckets, self.sum_s)
        return family


class ApiLatency(Collector):
    """put/get latency histograms of one pool."""

    def __init__(self) -> None:
        self.put = LatencyHistogram("kvpool_put_seconds", "Latency of Pool.put")
        self.get = LatencyHistogram("kvpool_get_seconds", "Latency of Pool.get (hits and misses)")

    def collect(self) -> Iterator[Any]:
        yield self.put.family()
        yield self.get.family()


class StatsCollector(Collector):
    """Metrics from a ``stats()``-shaped dict (a Pool's, or a node's plus the master's)."""

    def __init__(self, pool_stats: Callable[[], dict[str, Any]] | None = None,
                 master_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self._pool_stats = pool_stats
        self._master_stats = master_stats

    def collect(self) -> Iterator[Any]:
        if self._pool_stats is not None:
            yield from self._pool_metrics(self._pool_stats())
        if self._master_stats is not None:
            try:
                stats = self._master_stats()
            except Exception as exc:  # an unreachable master is itself worth a metric
                log.debug("master stats unavailable: %s", exc)
                up = GaugeMetricFamily("kvpool_master_up", "Whether the master answered the scrape")
                up.add_metric([], 0)
                yield up
                return
            yield from self._master_metrics(stats)

    @staticmethod
    def _pool_metrics(stats: dict[str, Any]) -> Iterator[Any]:
        tiers = stats["tiers"].values() if isinstance(stats["tiers"], dict) else stats["tiers"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "capacity": GaugeMetricFamily("kvpool_tier_capacity_bytes", "Tier capacity", labels=["tier"]),
            "used": GaugeMetricFamily("kvpool_tier_used_bytes", "Bytes allocated in the tier", labels=["tier"]),
            "objects": GaugeMetricFamily("kvpool_tier_objects", "Objects held by the tier", labels=["tier"]),
            "hits": CounterMetricFamily("kvpool_hits", "Reads served by the tier", labels=["tier"]),
        }
        for tier in tiers:
            name = tier["tier"]
            families["capacity"].add_metric([name], tier["capacity_bytes"])
            families["used"].add_metric([name], tier["used_bytes"])
            families["objects"].add_metric([name], tier["objects"])
            families["hits"].add_metric([name], tier["hits"])
        yield from families.values()
        counters = stats.get("counters", {})
        remote = stats.get("remote", {})
        misses = CounterMetricFamily("kvpool_misses", "Gets that found nothing usable, by reason", labels=["reason"])
        for reason in MISS_REASONS:
            misses.add_metric([reason], stats.get("misses", {}).get(reason, counters.get(f"miss_{reason}", 0)))
        yield misses
        remote_hits = CounterMetricFamily("kvpool_remote_hits", "Gets served from another node's replica")
        remote_hits.add_metric([], remote.get("hits_remote", 0))
        yield remote_hits
        guesses = CounterMetricFamily("kvpool_speculative_pulls", "Keys a get (or get_many's batch) pulled from the "
                                      "last holder before the master said where they are, by outcome: used as the "
                                      "holder answered, used once the master confirmed it, or wasted",
                                      labels=["outcome"])
        unconfirmed = remote.get("speculative_unconfirmed", 0)
        guesses.add_metric(["used"], unconfirmed)
        guesses.add_metric(["confirmed"], remote.get("speculative_hits", 0) - unconfirmed)
        guesses.add_metric(["wasted"], remote.get("speculative_wasted", 0))
        yield guesses
        for name, help_text, value in (
            ("kvpool_bytes_put", "Payload bytes stored by puts", counters.get("bytes_put", 0)),
            ("kvpool_bytes_got", "Payload bytes read from local tiers", counters.get("bytes_got", 0)),
            ("kvpool_bytes_pulled", "Payload bytes pulled from other nodes", remote.get("bytes_pulled", 0)),
            ("kvpool_bytes_served", "Payload bytes served to other nodes",
             stats.get("transfer", {}).get("bytes_sent", 0)),
            ("kvpool_evictions", "Objects dropped from the bottom tier", counters.get("evictions", 0)),
            ("kvpool_demotions", "Objects moved one tier down", counters.get("demotions", 0)),
            ("kvpool_promotions", "Objects moved up after repeated hits", counters.get("promotions", 0)),
            ("kvpool_durable_dropped", "Acknowledged durable copies this node lost (corrupt, file gone, "
             "or beyond a smaller capacity at start)", counters.get("durable_dropped", 0)),
            ("kvpool_published_again", "Objects published again after a master takeover",
             counters.get("published_again", 0)),
        ):
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], value)
            yield family

    @staticmethod
    def _master_metrics(stats: dict[str, Any]) -> Iterator[Any]:
        up = GaugeMetricFamily("kvpool_master_up", "Whether the master answered the scrape")
        up.add_metric([], 1)
        yield up
        alive = GaugeMetricFamily("kvpool_master_nodes_alive", "Nodes whose heartbeats arrive")
        alive.add_metric([], sum(1 for n in stats["nodes"].values() if n["alive"]))
        yield alive
        for name, key in (("kvpool_master_keys", "keys"), ("kvpool_master_replicas", "replicas"),
                          ("kvpool_master_leases", "leases"), ("kvpool_master_reservations", "reservations")):
            gauge = GaugeMetricFamily(name, f"Master's current {key}")
            gauge.add_metric([], stats[key])
            yield gauge


class MetricsServer:
    """``/metrics`` and ``/health`` on ``host:port`` (port 0 picks a free one), on a daemon thread."""

    def __init__(self, port: int, *, role: str, ready: Callable[[], bool],
                 registries: list[CollectorRegistry | Collector], host: str = "127.0.0.1",
                 health_detail: Callable[[], dict[str, Any]] | None = None) -> None:
        self.role = role
        self._ready = ready
        self._health_detail = health_detail
        self._registry = CollectorRegistry(auto_describe=False)
        for source in registries:
            self._registry.register(_Merged(source) if isinstance(source, CollectorRegistry) else source)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] == "/metrics":
                    body, status, kind = generate_latest(server._registry), 200, "text/plain; version=0.0.4"
                elif self.path.split("?")[0] == "/health":
                    payload = server.health()
                    body = json.dumps(payload).encode()
                    status, kind = (200 if payload["ready"] else 503), "application/json"
                else:
                    body, status, kind = b"see /metrics and /health\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
                log.debug(format, *args)

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.address = self._http.server_address[:2]
        self._thread = threading.Thread(target=self._http.serve_forever, name="kvpool-metrics", daemon=True)

    def health(self) -> dict[str, Any]:
        try:
            ready = bool(self._ready())
        except Exception:  # a failing readiness probe means not ready
            ready = False
        detail = self._health_detail() if self._health_detail is not None else {}
        return {"role": self.role, "ready": ready, **detail}

    def start(self) -> MetricsServer:
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics, health on /health", *self.address)
        return self

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


class _Merged(Collector):
    """Lets one registry's metrics be served through another."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._source = registry

    def collect(self) -> Iterable[Any]:
        return self._source.collect()
