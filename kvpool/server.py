"""Wiring of the daemon's roles: which components run in this process.

``master`` runs the metadata master; ``node`` opens the local tiers and serves
them to the cluster (pulls over UCX, registration, heartbeats); ``all`` runs
both, the master first. Owns start-up and shutdown order, nothing else:
shutdown stops the node (its tiers close, the nvme index is flushed, so
everything on disk is found again at the next start) before the master.
"""

from __future__ import annotations

import logging
import threading

from kvpool.config import Config

log = logging.getLogger("kvpool.server")


def serve(config: Config, role: str, stop: threading.Event) -> int:
    master_thread: threading.Thread | None = None
    master_stop = threading.Event()
    if role in ("master", "all"):
        from kvpool.master import run_master

        if role == "master":
            run_master(config, stop)
            return 0
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                run_master(config, master_stop, on_ready=lambda _endpoint: ready.set())
            except BaseException as exc:  # reported by the main thread below
                failure.append(exc)
                ready.set()

        master_thread = threading.Thread(target=run, name="kvpool-master", daemon=True)
        master_thread.start()
        ready.wait()
        if failure:
            log.error("master failed to start: %s", failure[0])
            return 1
    try:
        return _serve_node(config, stop)
    finally:
        if master_thread is not None:
            master_stop.set()
            master_thread.join(10.0)


def _serve_node(config: Config, stop: threading.Event) -> int:
    from kvpool.daemon import describe_tiers
    from kvpool.node import Node
    from kvpool.pool import build_tier_manager

    manager = build_tier_manager(config)
    node: Node | None = None
    try:
        node = Node(config, manager, config.master.listen).start()
        log.info("pool %r data_dir=%s", config.pool.name, config.pool.resolved_data_dir())
        log.info("tiers: %s", describe_tiers({"tiers": {t["tier"]: t for t in manager.tier_stats()}}))
        log.info("ready")
        stop.wait()
    finally:
        if node is not None:
            node.close()
        on_disk = sum(1 for _key, tier, _extent, _header in manager.snapshot() if tier.persistent)
        manager.close()
        log.info("node stopped: tiers closed, nvme index flushed; %d objects on disk are found again "
                 "at the next start (memory tiers are not kept)", on_disk)
    return 0
