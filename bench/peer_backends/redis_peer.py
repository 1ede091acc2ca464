"""Redis in the peers benchmark: one ``redis-server`` (Debian's), the ``redis`` Python client
with the ``hiredis`` reply parser, as Redis users run it (``redis[hiredis]``; without hiredis
redis-py parses in Python and a 1 MB GET was measured several times slower, so the row is
reported as not installed rather than measured with the slow client).

The server binds 127.0.0.1 on a free port with persistence off
(``--save '' --appendonly no``). Single calls are SET/GET/EXISTS; batches
are one MSET / MGET, and EXISTS pipelined (``EXISTS k1 k2`` only counts).
Values go out as memoryviews of the source (no copy in Python); GET returns
new ``bytes`` (Redis cannot write into caller memory).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.peer_backends.base import Peer, PeerClient, ServerProcess, ValueSource, free_port


class RedisPeer(Peer):
    system = "redis"
    label = "Redis   SET/GET, MSET/MGET over TCP, hiredis"
    install_hint = "bash bench/install_peers.sh redis"

    @classmethod
    def missing(cls, options: dict[str, Any]) -> str | None:
        server = options.get("redis_server") or "redis-server"
        if not (os.path.isfile(server) and os.access(server, os.X_OK)):
            return f"not installed (no redis-server at {server!r}; {cls.install_hint})"
        if importlib.util.find_spec("redis") is None:
            return f"not installed (Python package redis; {cls.install_hint})"
        if importlib.util.find_spec("hiredis") is None:
            return f"not installed (Python package hiredis, redis-py's fast parser; {cls.install_hint})"
        return None

    def start(self) -> None:
        import redis

        self.port = free_port()
        work: Path = self.plan.work_dir
        server = ServerProcess("redis-server", [
            self.options.get("redis_server") or "redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
            "--save", "", "--appendonly", "no", "--dir", str(work), "--protected-mode", "yes",
            "--maxmemory", "0", "--daemonize", "no", "--logfile", "",
        ], work / "redis.log", self.cpus.server)
        self.servers.append(server)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        try:
            server.wait_ready(client.ping, 30)
        finally:
            client.close()

    def client_settings(self) -> dict[str, Any]:
        return {"port": self.port}


class RedisClient(PeerClient):
    def __init__(self, role: str, settings: dict[str, Any]) -> None:
        super().__init__(role, settings)
        import redis

        self.redis = redis.Redis(host="127.0.0.1", port=settings["port"])

    def put(self, keys: Sequence[str], indices: Sequence[int], source: ValueSource) -> None:
        if len(keys) == 1:
            self.redis.set(keys[0], memoryview(source.value(indices[0])))
        else:
            self.redis.mset({k: memoryview(source.value(i)) for k, i in zip(keys, indices)})

    def get(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> list[Any]:
        if len(keys) == 1:
            return [self.redis.get(keys[0])]
        return self.redis.mget(keys)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if len(keys) == 1:
            return [bool(self.redis.exists(keys[0]))]
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def close(self) -> None:
        self.redis.close()
