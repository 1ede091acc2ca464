"""kvpool in the peers benchmark: a master process, a writer that holds the data, a reader.

kvpool is pull-on-demand: a put stays on the putting node (its local tiers)
and is published to the master; another process's get asks the master where
the key is and pulls it. So the honest cross-process setup is a *writer*
actor (a ``kvpool.connect`` client: its timed puts are local tier copy +
one master publish, and it keeps serving the data) and a *reader* actor
(the benchmark client: every get is a master locate + a pull from the writer).
The master runs as ``kvpool-server --role master`` in its own process.

Modes (the reader's transport and the writer's tier):

Pulls of at most ``node.tcp_pull_max`` (16 MiB by default; 1 MiB from a same-host holder over
UCX shared memory) go over a plain TCP connection to the writer; larger ones over UCX as below.

* ``kvpool-tcp``: reader ``transport="tcp"`` (UCX listener endpoints over TCP),
  writer stores in ``dram`` — the cross-process path, as to another host;
* ``kvpool-shm``: reader ``transport="auto"`` (same host: UCX shared memory),
  writer stores in ``dram``;
* ``kvpool-cxl``: reader ``transport="auto"``, writer stores in ``cxl``
  (``tiers.dram.capacity = 0``), so the reader copies the object in place out
  of the writer's shared-memory arena;
* ``kvpool-tcp-block`` (only when named): ``kvpool-tcp`` with a reader and a writer that
  block at once for every wait (``node.reply_poll_us = node.serve_poll_us = 0``), to show
  what polling does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from bench.peer_backends.base import (
    ActorSpec,
    Peer,
    PeerClient,
    ServerProcess,
    ValueSource,
    free_port,
    kv_shape,
)


class KvpoolPeer(Peer):
    put_role = "writer"
    get_role = "reader"
    put_note = ("kvpool puts are the writer's: local tier copy + one master publish (pull-on-demand: "
                "no bytes cross processes on a put; the reader's gets pull them)")
    transport: ClassVar[str] = "tcp"
    holder_tier: ClassVar[str] = "dram"
    poll_us: ClassVar[int | None] = None  # the reader's reply_poll_us and the writer's serve_poll_us; None: defaults

    @classmethod
    def missing(cls, options: dict[str, Any]) -> str | None:
        try:
            import kvpool  # noqa: F401
        except ImportError as exc:  # the project itself: only outside its venv
            return f"kvpool not importable: {exc}"
        return None

    def start(self) -> None:
        from kvpool.cluster.wire.master_client import MasterClient

        self.address = f"tcp://127.0.0.1:{free_port()}"
        work = self.plan.work_dir
        master = ServerProcess(
            "kvpool master", [sys.executable, "-m", "kvpool.cli.server", "--role", "master", "--master.listen",
                              self.address, "--log-level", "WARNING"],
            work / "kvpool-master.log", self.cpus.server)
        self.servers.append(master)
        client = MasterClient(self.address, request_timeout_s=1.0)
        try:
            master.wait_ready(lambda: client.ping(timeout_s=0.5), 60)
        finally:
            client.close()

    def actors(self) -> dict[str, tuple[ActorSpec, bool]]:
        capacity, work, name = self.plan.capacity, self.plan.work_dir, f"peers-{self.plan.work_dir.name}"
        holder_tiers = {"dram": capacity if self.holder_tier == "dram" else 0,
                        "cxl": capacity if self.holder_tier == "cxl" else 0}
        writer = {"master": self.address, "transport": self.transport, "config": {
            "pool": {"name": f"{name}-w", "data_dir": str(work / "writer")},
            "tiers": {"dram": {"capacity": holder_tiers["dram"]},
                      "cxl": {"capacity": holder_tiers["cxl"], "path": f"/dev/shm/kvpool-{name}-w-cxl"},
                      "nvme": {"capacity": 0}},
            "master": {"listen": self.address},
            **({"node": {"serve_poll_us": self.poll_us}} if self.poll_us is not None else {}),
        }}
        # The reader holds nothing: a small dram tier (a pool needs one tier), no cxl, no nvme.
        reader = {"master": self.address, "transport": self.transport, "config": {
            "pool": {"name": f"{name}-r", "data_dir": str(work / "reader")},
            "tiers": {"dram": {"capacity": "64MiB", "mlock": False, "prefault": False},
                      "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
            "master": {"listen": self.address},
            **({"node": {"reply_poll_us": self.poll_us}} if self.poll_us is not None else {}),
        }}
        return {"writer": (ActorSpec(self.system, "writer", writer), True),
                "reader": (ActorSpec(self.system, "reader", reader), False)}


class KvpoolTcp(KvpoolPeer):
    system = "kvpool-tcp"
    label = "kvpool  TCP (UCX > 16 MiB), cross-process"


class KvpoolTcpBlocking(KvpoolTcp):
    system = "kvpool-tcp-block"
    label = "kvpool  TCP, no polling (*_poll_us 0)"
    poll_us = 0


class KvpoolShm(KvpoolPeer):
    system = "kvpool-shm"
    label = "kvpool  same host, UCX shm > 1 MiB"
    transport = "auto"


class KvpoolCxl(KvpoolPeer):
    system = "kvpool-cxl"
    label = "kvpool  same host, in place from cxl"
    transport = "auto"
    holder_tier = "cxl"


class KvpoolClient(PeerClient):
    """``kvpool.connect``: puts (writer) or gets/exists (reader) through the public API."""

    def __init__(self, role: str, settings: dict[str, Any]) -> None:
        super().__init__(role, settings)
        import kvpool

        self.pool = kvpool.connect(settings["master"], config=settings["config"], transport=settings["transport"])

    def prepare(self, source: ValueSource, out_slots: int) -> list[np.ndarray]:
        self.shape = kv_shape(source.size)
        return [np.empty(source.size, np.uint8) for _ in range(out_slots)]

    def put(self, keys: Sequence[str], indices: Sequence[int], source: ValueSource) -> None:
        if len(keys) == 1:
            self.pool.put(keys[0], source.kv(indices[0]))
        else:
            self.pool.put_many([(k, source.kv(i)) for k, i in zip(keys, indices)])

    def get(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> list[Any]:
        if len(keys) == 1:
            out = outs[0].view(np.float16).reshape(self.shape)
            return [self.pool.get(keys[0], out=out)]
        # preallocated buffers, as Mooncake's batch_get_into gets registered ones
        return self.pool.get_many(list(keys), outs=[o.view(np.float16).reshape(self.shape) for o in outs])

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if len(keys) == 1:
            return [self.pool.exists(keys[0])]
        return self.pool.exists_many(list(keys))

    def info(self) -> dict[str, Any]:
        stats = self.pool.stats()
        remote = stats.get("remote", {})
        names = ("pulls", "speculative_hits", "reads_in_place", "hits_same_host", "hits_remote", "bytes_pulled")
        tcp = remote.get("tcp_pull_client", {})
        return {**{k: remote.get(k, 0) for k in names}, "tcp_pulls": tcp.get("pulls", 0),
                **{k: tcp.get(k, 0) for k in ("polls_caught", "polls_ran_out", "polls_preempted")}}

    def close(self) -> None:
        self.pool.close()
