"""Mooncake Store in the peers benchmark (``mooncake-transfer-engine-non-cuda``).

Two deployments, both with ``mooncake_master`` in its own process:

* ``mooncake-tcp`` (embedded clients over the TCP transfer engine): a storage
  actor calls ``MooncakeDistributedStore.setup(..., global_segment_size, ...,
  "tcp", ...)`` and keeps its segment mounted; the benchmark client mounts no
  segment, registers the value pool and its get buffers (``register_buffer``)
  and uses zero-copy ``put_from`` / ``get_into`` (``batch_put_from`` /
  ``batch_get_into`` for batches), so every put and get crosses processes.
* ``mooncake-standalone``: the ``mooncake_client`` service process holds the
  segment; the benchmark is a ``setup_dummy`` client whose value pool and get
  buffers are allocated in the shared memory it maps with the service
  (``alloc_from_mem_pool``), Mooncake's fastest same-host path.

Metadata is exchanged with ``P2PHANDSHAKE`` (no etcd / HTTP metadata
server). A failed put raises; a negative get result is a miss.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
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
    port_open,
)

MiB = 1 << 20
LOCAL_BUFFER_BYTES = 16 * MiB


def _tool_missing(path: str | None, name: str) -> str | None:
    if not path or not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return f"not installed (no {name} at {path!r}; bash bench/install_peers.sh mooncake)"
    return None


class MooncakePeer(Peer):
    install_hint = "bash bench/install_peers.sh mooncake"

    @classmethod
    def missing(cls, options: dict[str, Any]) -> str | None:
        if importlib.util.find_spec("mooncake") is None:
            return f"not installed (Python package mooncake-transfer-engine-non-cuda; {cls.install_hint})"
        return _tool_missing(options.get("mooncake_master"), "mooncake_master")

    def start(self) -> None:
        self.master_port = free_port()
        work: Path = self.plan.work_dir
        master = ServerProcess("mooncake_master", [
            self.options["mooncake_master"], "--rpc_address=127.0.0.1", f"--rpc_port={self.master_port}",
            f"--metrics_port={free_port()}", "--enable_metric_reporting=false",
        ], work / "mooncake-master.log", self.cpus.server)
        self.servers.append(master)
        master.wait_ready(lambda: port_open(self.master_port), 30)

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"


class MooncakeTcp(MooncakePeer):
    system = "mooncake-tcp"
    label = "Mooncake embedded, TCP transfer engine, zero-copy"
    put_note = ("Mooncake puts cross processes: the client (no segment) writes into the storage process's "
                "segment over its TCP transfer engine")

    def actors(self) -> dict[str, tuple[ActorSpec, bool]]:
        common = {"master": self.master_address}
        # The storage process starts first so the client's first put has a segment to land in.
        return {"store": (ActorSpec(self.system, "store", {**common, "segment": self.plan.capacity}), True),
                "client": (ActorSpec(self.system, "client", common), False)}


class MooncakeStandalone(MooncakePeer):
    system = "mooncake-standalone"
    label = "Mooncake standalone client service, shared memory"

    @classmethod
    def missing(cls, options: dict[str, Any]) -> str | None:
        return super().missing(options) or _tool_missing(options.get("mooncake_client"), "mooncake_client")

    def start(self) -> None:
        super().start()
        self.client_port = free_port()
        service = ServerProcess("mooncake_client", [
            self.options["mooncake_client"], "--host=127.0.0.1", f"--port={self.client_port}",
            f"--master_server_address={self.master_address}", "--metadata_server=P2PHANDSHAKE",
            f"--global_segment_size={-(-self.plan.capacity // MiB)} MB", "--protocol=tcp",
        ], self.plan.work_dir / "mooncake-client-service.log", self.cpus.server)
        self.servers.append(service)
        service.wait_ready(lambda: port_open(self.client_port), 60)

    def actors(self) -> dict[str, tuple[ActorSpec, bool]]:
        source = ValueSource(self.plan.size, self.plan.count, self.plan.seed)
        pool_bytes = source.pool_nbytes + self.plan.batch * self.plan.size + 64 * MiB
        return {"client": (ActorSpec(self.system, "dummy", {
            "service": f"127.0.0.1:{self.client_port}", "mem_pool": pool_bytes}), False)}


class MooncakeClient(PeerClient):
    """``MooncakeDistributedStore`` as storage node (``store``), client (``client``) or dummy (``dummy``)."""

    def __init__(self, role: str, settings: dict[str, Any]) -> None:
        super().__init__(role, settings)
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        if role == "dummy":
            rc = self.store.setup_dummy(settings["mem_pool"], LOCAL_BUFFER_BYTES, settings["service"])
        else:
            segment = settings.get("segment", 0) if role == "store" else 0
            rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment, LOCAL_BUFFER_BYTES, "tcp", "",
                                  settings["master"])
        if rc != 0:
            raise PeerError(f"mooncake {role} setup returned {rc}")
        self._base = 0
        self._outs_base = 0

    def _memory(self, nbytes: int) -> np.ndarray:
        """Memory the library can transfer from/to: its shared pool (dummy) or registered numpy memory."""
        if self.role == "dummy":
            address = self.store.alloc_from_mem_pool(nbytes)
            if not address:
                raise PeerError(f"alloc_from_mem_pool({nbytes}) failed")
            memory = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
        else:
            memory = np.empty(nbytes, np.uint8)
        rc = self.store.register_buffer(memory.ctypes.data, nbytes)
        if rc != 0:
            raise PeerError(f"register_buffer({nbytes}) returned {rc}")
        return memory

    def prepare(self, source: ValueSource, out_slots: int) -> list[np.ndarray]:
        if self.role == "store":
            return []
        source.use_pool(self._memory(source.pool_nbytes))
        outs = self._memory(out_slots * source.size)
        return [outs[i * source.size: (i + 1) * source.size] for i in range(out_slots)]

    def put(self, keys: Sequence[str], indices: Sequence[int], source: ValueSource) -> None:
        size = source.size
        if len(keys) == 1:
            rc = self.store.put_from(keys[0], source.value(indices[0]).ctypes.data, size)
            if rc != 0:
                raise PeerError(f"put_from({keys[0]}) returned {rc}")
            return
        rcs = self.store.batch_put_from(list(keys), [source.value(i).ctypes.data for i in indices],
                                        [size] * len(keys))
        if any(rc != 0 for rc in rcs):
            raise PeerError(f"batch_put_from returned {sorted(set(rcs))}")

    def get(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> list[Any]:
        if len(keys) == 1:
            n = self.store.get_into(keys[0], outs[0].ctypes.data, len(outs[0]))
            return [outs[0] if n == len(outs[0]) else None]
        got = self.store.batch_get_into(list(keys), [o.ctypes.data for o in outs], [len(o) for o in outs])
        return [o if n == len(o) else None for o, n in zip(outs, got)]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if len(keys) == 1:
            return [self.store.is_exist(keys[0]) == 1]
        return [n == 1 for n in self.store.batch_is_exist(list(keys))]

    def close(self) -> None:
        self.store.close()
