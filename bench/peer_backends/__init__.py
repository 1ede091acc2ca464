"""Systems of the peers benchmark, one module each, registered by name with lazy imports.

Importing this package imports no peer library: a system's module is loaded
only when it runs, so a missing peer costs nothing but a "skipped" row.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.peer_backends.base import Peer, PeerClient

# --systems name -> (module, Peer class, PeerClient class)
SYSTEMS: dict[str, tuple[str, str, str]] = {
    "kvpool-tcp": ("bench.peer_backends.kvpool_peer", "KvpoolTcp", "KvpoolClient"),
    "kvpool-shm": ("bench.peer_backends.kvpool_peer", "KvpoolShm", "KvpoolClient"),
    "kvpool-cxl": ("bench.peer_backends.kvpool_peer", "KvpoolCxl", "KvpoolClient"),
    "kvpool-tcp-block": ("bench.peer_backends.kvpool_peer", "KvpoolTcpBlocking", "KvpoolClient"),
    "mooncake-tcp": ("bench.peer_backends.mooncake_peer", "MooncakeTcp", "MooncakeClient"),
    "mooncake-standalone": ("bench.peer_backends.mooncake_peer", "MooncakeStandalone", "MooncakeClient"),
    "redis": ("bench.peer_backends.redis_peer", "RedisPeer", "RedisClient"),
    "lmcache": ("bench.peer_backends.lmcache_peer", "LMCachePeer", "LMCacheClient"),
}

#: run only when named (not in --systems all)
OPT_IN = frozenset({"kvpool-tcp-block"})


def peer_class(system: str) -> type[Peer]:
    module, peer, _ = SYSTEMS[system]
    return getattr(importlib.import_module(module), peer)


def client_class(system: str) -> type[PeerClient]:
    module, _, client = SYSTEMS[system]
    return getattr(importlib.import_module(module), client)
