"""LMCache in the peers benchmark: ``lmcache_server HOST PORT cpu`` and LMCache's own client.

LMCache lives in its own venv (bench/install_peers.sh explains why), so
both the server and the benchmark's client actor run that venv's Python;
``--lmcache-python`` says where it is. The client is LMCache's
``LMCServerConnector`` (the ``lm://`` remote connector its engine uses) over
a CPU ``LocalCPUBackend`` that allocates the memory objects, as LMCache's
own ``lmcache check`` tool builds it:

* put: allocate a memory object, copy the value into it (in LMCache's
  engine the GPU->CPU copy fills it), send it;
* get: the connector allocates a memory object and ``recv_into``s it; the
  object is released at the next get (LMCache cannot write into caller memory);
* exists: one round trip.

The ``lm://`` protocol has no batched put/get/exists: those cells stay empty.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.peer_backends.base import (
    ActorSpec,
    Peer,
    PeerClient,
    PeerError,
    ServerProcess,
    ValueSource,
    free_port,
    kv_shape,
    port_open,
)


class LMCachePeer(Peer):
    system = "lmcache"
    label = "LMCache lmcache_server (cpu), lm:// connector"
    install_hint = "bash bench/install_peers.sh lmcache"
    has_batch = False

    @classmethod
    def _python(cls, options: dict[str, Any]) -> str:
        return options.get("lmcache_python") or ""

    @classmethod
    def missing(cls, options: dict[str, Any]) -> str | None:
        python = cls._python(options)
        server = Path(python).parent / "lmcache_server"
        if not (python and os.access(python, os.X_OK) and server.exists()):
            return f"not installed (no LMCache venv at {python!r}; {cls.install_hint})"
        return None

    def start(self) -> None:
        self.port = free_port()
        server = ServerProcess("lmcache_server", [
            str(Path(self._python(self.options)).parent / "lmcache_server"), "127.0.0.1", str(self.port), "cpu",
        ], self.plan.work_dir / "lmcache-server.log", self.cpus.server)
        self.servers.append(server)
        server.wait_ready(lambda: port_open(self.port), 120)

    def actors(self) -> dict[str, tuple[ActorSpec, bool]]:
        settings = {"port": self.port, "size": self.plan.size, "batch": self.plan.batch}
        return {"client": (ActorSpec(self.system, "client", settings, python=self._python(self.options)), False)}


class LMCacheClient(PeerClient):
    def __init__(self, role: str, settings: dict[str, Any]) -> None:
        super().__init__(role, settings)
        size = settings["size"]
        # The CPU allocator must hold a few objects in flight (gets are released one call later).
        os.environ.setdefault("LMCACHE_LOCAL_CPU", "False")
        os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", str(max(0.25, 8 * size / 1e9)))
        import torch
        from lmcache.integration.vllm.utils import lmcache_get_or_create_config
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        shape = kv_shape(size)
        self._torch, self._key_class = torch, CacheEngineKey
        metadata = LMCacheMetadata(model_name="kvpool-peers", world_size=1, local_world_size=1, worker_id=0,
                                   local_worker_id=0, kv_dtype=torch.float16, kv_shape=shape, chunk_size=shape[2])
        self.backend = LocalCPUBackend(config=lmcache_get_or_create_config(), metadata=metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop", daemon=True)
        self._thread.start()
        self.connector = LMCServerConnector("127.0.0.1", settings["port"], self.loop, self.backend)
        self._held: list[Any] = []

    def _key(self, name: str) -> Any:
        chunk_hash = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
        return self._key_class("kvpool-peers", 1, 0, chunk_hash, self._torch.float16)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def put(self, keys: Sequence[str], indices: Sequence[int], source: ValueSource) -> None:
        for key, i in zip(keys, indices):
            c = self.connector
            obj = self.backend.allocate(c.meta_shapes, c.meta_dtypes, c.meta_fmt)
            if obj is None:
                raise PeerError("LMCache could not allocate a memory object for a put")
            try:
                np.frombuffer(obj.byte_array, np.uint8)[:] = source.value(i)
                self._run(c.put(self._key(key), obj))
            finally:
                obj.ref_count_down()

    def get(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> list[Any]:
        self._release()
        results: list[Any] = []
        for key in keys:
            obj = self._run(self.connector.get(self._key(key)))
            if obj is None:
                results.append(None)
                continue
            self._held.append(obj)
            results.append(np.frombuffer(obj.byte_array, np.uint8))
        return results

    def _release(self) -> None:
        for obj in self._held:
            obj.ref_count_down()
        self._held.clear()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [bool(self._run(self.connector.exists(self._key(k)))) for k in keys]

    def close(self) -> None:
        self._release()
        try:
            self._run(self.connector.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
