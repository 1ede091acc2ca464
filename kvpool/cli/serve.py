"""Wiring of the daemon's roles: which components run in this process.

``master`` runs the metadata master; ``node`` opens the local tiers and serves
them to the cluster (pulls over UCX, registration, heartbeats); ``all`` runs
both, the master first. With ``metrics.port`` set, ``/metrics`` and
``/health`` are served on 127.0.0.1. Owns start-up and shutdown order, nothing
else: shutdown stops the node (its tiers close, the nvme index is flushed, so
everything on disk is found again at the next start) before the master.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from kvpool.config import Config, format_size, master_address

log = logging.getLogger("kvpool.server")


def serve(config: Config, role: str, stop: threading.Event) -> int:
    """Run ``role`` until ``stop`` is set; returns the exit status."""
    from kvpool import errors
    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.cluster.wire.security import ClusterKey
    from kvpool.transport.tcp.admission import raise_descriptor_limit, reserved_descriptors

    limit = raise_descriptor_limit()  # at start, before any socket or file: the caps are sized from it
    log.info("descriptor limit %d (%d kept from the TCP ports for the master link, ZeroMQ and files)",
             limit, reserved_descriptors(limit))
    try:
        cluster_key = ClusterKey.from_config(config)  # created on first use; an unreadable one stops here
    except errors.ConfigError as exc:
        log.error("%s", exc)
        return 2
    if cluster_key.enabled:
        log.info("authenticating with %s", cluster_key.describe())
    else:
        log.warning("security.auth = false: anyone who can reach this pool's ports can read, write and delete "
                    "every key (see README, Security)")
    with ExitStack() as stack:
        master_client = stack.enter_context(MasterClient(config.master.listen, config=config))
        if role in ("master", "all"):
            if not _start_master(config, stack):
                return 1
        try:
            node = _start_node(config, stack) if role in ("node", "all") else None
        except errors.ConfigError as exc:  # a setting this host cannot honour: one line naming it
            log.error("%s", exc)
            return 2
        except errors.KVPoolError as exc:
            log.error("node failed to start: %s: %s", type(exc).__name__, exc)
            return 1
        if config.metrics.port:
            _start_metrics(config, role, node, master_client, stack)
        log.info("ready")
        stop.wait()
        log.info("stopping")
    return 0


def _start_master(config: Config, stack: ExitStack) -> bool:
    from kvpool.cluster.master.server import run_master

    ready, master_stop = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            run_master(config, master_stop, on_ready=lambda _endpoint: ready.set())
        except BaseException as exc:  # reported by the caller
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="kvpool-master", daemon=True)
    thread.start()
    ready.wait()
    if failure:
        log.error("master failed to start: %s", failure[0])
        return False

    def stop_master() -> None:
        master_stop.set()
        thread.join(10.0)

    stack.callback(stop_master)  # runs after the node has stopped (LIFO)
    return True


def _start_node(config: Config, stack: ExitStack) -> Any:
    from kvpool.cluster.node.server import Node
    from kvpool.pool import build_tier_manager

    class StorageNode(Node):
        """A ``kvpool-server`` node: registers as a storage node, so with an nvme tier it
        receives durable copies (inference clients made by ``kvpool.connect`` never do)."""

        role = "storage"

    manager = build_tier_manager(config)

    def close_manager() -> None:
        # an object counts once per persistent copy: resident there, or backing a memory tier's copy
        on_disk = sum(stats["objects"] for tier, stats in zip(manager.tiers, manager.tier_stats()) if tier.persistent)
        manager.close()
        log.info("tiers closed, nvme index flushed: %d objects on disk will be found again at the next "
                 "start (memory tiers are not kept)", on_disk)

    stack.callback(close_manager)
    node = StorageNode(config, manager, master_address(config))
    stack.callback(node.close)
    node.start()
    log.info("pool %r data_dir=%s", config.pool.name, config.pool.resolved_data_dir())
    log.info("tiers: %s", describe_tiers({"tiers": {t["tier"]: t for t in manager.tier_stats()}}))
    return node


def _start_metrics(config: Config, role: str, node: Any, master_client: Any, stack: ExitStack) -> None:
    from kvpool import errors
    from kvpool.metrics import MetricsServer, StatsCollector

    ready: Callable[[], bool]
    detail: dict[str, Any] = {}
    if node is not None:
        ready = lambda: bool(node.heartbeater and node.heartbeater.reachable)  # noqa: E731
        detail["node_id"] = node.node_id
    else:
        def ready() -> bool:
            try:
                master_client.ping(timeout_s=1.0)
                detail["master"] = "leader" if config.master.etcd else "single"
            except errors.NotLeaderError:  # a standby answers too, and is ready to take over
                detail["master"] = "standby"
            return True
    collector = StatsCollector(
        pool_stats=node.stats if node is not None else None,
        master_stats=master_client.stats if role in ("master", "all") else None,
    )
    server = MetricsServer(config.metrics.port, role=role, ready=ready, registries=[collector],
                           health_detail=lambda: dict(detail))
    stack.callback(server.close)
    server.start()


def describe_tiers(stats: dict[str, Any]) -> str:
    parts = []
    for name, tier in stats["tiers"].items():
        extra = []
        if tier.get("emulated"):
            extra.append("emulated")
        if "direct_io" in tier:
            extra.append("O_DIRECT" if tier["direct_io"] else "buffered")
        if "locked_bytes" in tier:
            extra.append(f"{format_size(tier['locked_bytes'])} locked")
        if tier.get("objects"):
            extra.append(f"{tier['objects']} objects")
        suffix = f" ({', '.join(extra)})" if extra else ""
        parts.append(f"{name} {format_size(tier['capacity_bytes'])}{suffix}")
    return "; ".join(parts)
