"""``kvpool.connect``: the cluster client, a :class:`Pool` that also sees the other nodes.

Owns the read and write paths across nodes: a put is stored locally, then
published to the master (durable puts also get copies on storage nodes, through
the master's two-phase reserve/commit); a get tries the local tiers, then the
shared indexes of same-host nodes' ``cxl`` arenas (no master round trip), then
asks the master where the key lives and reads the requested layers from a
replica — in place from a same-host ``cxl`` arena, else pulled over UCX into
``out`` — verifying every layer's checksum. A replica that fails (checksum, holder gone,
timeout) is skipped for the next one; when none is left the get is a miss.

The process is also a :class:`kvpool.cluster.node.Node`: its own puts are served to
peers from its tiers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.cluster.master_client import MasterClient, control_call
from kvpool.cluster.node import Node, NodeAddress
from kvpool.cluster.protocol import LocatedReplica
from kvpool.cluster.reader import ReplicaReader, alive_nodes_of, replicas_at, shared_dirs_of
from kvpool.config import Config
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec, byte_view, spec_of
from kvpool.pool import Key, Pool, timed

log = logging.getLogger("kvpool.client")


class LeaseReleaser:
    """Ends read leases off the caller's path: a get returns as soon as its bytes are
    verified, and the master hears of finished reads in batches moments later — at most one
    release request per ``interval_s``, so a reader doing thousands of gets a second does not
    double the master's load (a lease held a few ms longer only delays an eviction)."""

    def __init__(self, master: MasterClient, interval_s: float = 0.02) -> None:
        self._master = master
        self._interval_s = interval_s
        self._pending: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvpool-lease-release", daemon=True)
        self._thread.start()

    def release(self, lease_ids: Iterable[int]) -> None:
        for lease_id in lease_ids:
            self._pending.put(lease_id)

    def _run(self) -> None:
        last = 0.0
        while True:
            batch = [self._pending.get()]
            if batch[0] is not None:  # let more gather, unless it is time to stop
                time.sleep(max(0.0, last + self._interval_s - time.monotonic()))
            last = time.monotonic()
            while True:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            leases = [lease for lease in batch if lease is not None]
            if leases:
                try:
                    self._master.release(leases)
                except errors.KVPoolError as exc:  # they expire on their own after master.lease_s
                    log.debug("releasing %d leases failed: %s", len(leases), exc)
            if None in batch:
                return

    def close(self) -> None:
        self._pending.put(None)  # flushes what is queued, then stops
        self._thread.join(5.0)


_CLIENT_POOLS = itertools.count()


def connect(master_address: str | None = None, *, config: str | Config | Mapping[str, Any] | None = None,
            transport: str = "auto") -> ClusterPool:
    """A pool backed by the cluster whose master listens on ``master_address`` (default:
    ``master.listen``; with ``master.etcd`` set and no address, the master leader found in
    etcd, followed when it changes).

    Settings given as a mapping (or none) that name no ``pool.name`` open this process's
    own local pool (``client-<pid>``, no nvme tier), so clients never collide with each
    other or with a ``kvpool-server`` on the same host.

    ``transport``: ``"auto"`` (same-host peers over shared memory, others over
    TCP) or ``"tcp"`` (always the UCX listener, with UCX's own peer-failure
    detection). Raises MasterUnreachableError if the master does not answer, and
    ConfigError at once for a malformed address (``tcp://host:port`` or ``ipc://path``).
    """
    from kvpool.config import check_master_address

    if master_address is not None:
        check_master_address(master_address)
    return ClusterPool(master_address, config=config, transport=transport)


class ClusterPool(Pool):
    """The :class:`Pool` API over the whole cluster (see the module docstring)."""

    def __init__(self, master_address: str | None = None, *,
                 config: str | Config | Mapping[str, Any] | None = None, transport: str = "auto") -> None:
        from kvpool.config import check_master_address
        from kvpool.config import master_address as config_master_address

        if master_address is not None:
            check_master_address(master_address)  # before any tier is opened
        if config is None or isinstance(config, Mapping):
            # No pool named: this process's own pool, never the one of a kvpool-server or of
            # another client on this host (same name = same arena and nvme dir = PoolLockedError),
            # and no nvme tier unless asked for: durable copies live on storage nodes.
            given = config or {}
            config = Config.load(dict(given))
            if "name" not in given.get("pool", {}):
                n = next(_CLIENT_POOLS)  # a second pool in this process needs its own name too
                config.set("pool.name", f"client-{os.getpid()}" + (f"-{n}" if n else ""),
                           origin="kvpool.connect defaults")
            if "capacity" not in given.get("tiers", {}).get("nvme", {}):
                config.set("tiers.nvme.capacity", 0, origin="kvpool.connect defaults")
        super().__init__(config)
        self.master_address = config_master_address(self.config, master_address)  # None: the leader in etcd
        self._remote = Counter[str]()
        try:
            self._node = Node(self.config, self._manager, self.master_address)
            self._master = self._node.master
            self._master.ping()
            self._node.start()
            self._releaser = LeaseReleaser(self._master)
            self._reader = ReplicaReader(self._node.host_id, node_id=self._node.node_id, transport=transport,
                                         max_message=self.config.node.max_message,
                                         pull_timeout_s=self.config.node.pull_timeout_s,
                                         location_cache_size=self.config.node.location_cache,
                                         allowed_dirs=shared_dirs_of(self.config), host=self._node.host,
                                         engine=self._node.engine)
            self._neighbours_stop = threading.Event()
            self._refresh_from_master()
            self._neighbours_thread: threading.Thread | None = threading.Thread(
                target=self._watch_neighbours, daemon=True, name="kvpool-neighbours")
            self._neighbours_thread.start()
        except BaseException:
            self._close_cluster_parts()
            self._manager.close()
            self._closed = True
            raise

    def _refresh_from_master(self) -> None:
        """Map same-host arenas and forget remembered holders that are no longer alive."""
        stats = self._master.stats()
        if self.config.node.same_host_index:
            self._reader.refresh_neighbours(stats)
        alive = alive_nodes_of(stats)  # None: the master's stats are unreadable, keep what we know
        if alive is not None:
            self._reader.forget_nodes_except(alive)

    def _watch_neighbours(self) -> None:
        """Keep the view of the other nodes current (they join, leave, die) once per heartbeat."""
        period_s = max(0.2, self.config.master.heartbeat_ms / 1000.0)
        while not self._neighbours_stop.wait(period_s):
            try:
                self._refresh_from_master()
            except errors.KVPoolError as exc:
                log.debug("refreshing the view of other nodes failed: %s", exc)
            except Exception as exc:  # garbage from the master must not stop this thread
                log.warning("refreshing the view of other nodes failed: %s: %.200s", type(exc).__name__, exc)

    @property
    def node_id(self) -> str:
        return self._node.node_id

    # -- writes -------------------------------------------------------------------------

    @timed("put")
    def put(self, prefix_hash: Key, kv: Any, *, dtype: str | None = None, durable: bool | None = None,
            replicas: int | None = None) -> None:
        """Store locally and publish (one master round trip); ``durable=True`` also keeps ``replicas``
        copies in the nvme tier of storage nodes (``kvpool-server --role node|all``, never
        inference clients) chosen by the master, so the object outlives this process.
        A durable put returns once every copy is committed at the master, which then
        keeps the count: copies lost with a storage node are re-created elsewhere.

        Raises what :meth:`Pool.put` raises, MasterUnreachableError (the object
        then stays in the local tiers, readable here, and becomes visible to the
        cluster when this node re-registers with the master), and (durable)
        InvalidArgumentError for ``replicas < 1`` and NotEnoughReplicasError when
        fewer storage nodes are eligible (both before anything is stored or
        copied), CapacityError / TransferError / KVTimeoutError when a copy failed
        (copies already committed stay, and the master completes the count).
        """
        self._check_open()
        key = self._key(prefix_hash)
        spec, arr = spec_of(kv, dtype)
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise errors.InvalidArgumentError(f"replicas must be an int >= 1, got {replicas!r}")
        targets = []
        if durable if durable is not None else self.config.node.durable:
            # Placed (and reserved) first: too few storage nodes fails before anything is stored.
            targets = self._master.place(spec.total_nbytes, replicas or self.config.node.replicas,
                                         exclude=[self._node.node_id], key=key)
        try:
            self._put_many([(key, spec, byte_view(arr))])
            if targets:
                self._replicate(key, targets)
        except BaseException:
            if targets:
                try:
                    self._master.revoke([t.reservation_id for t in targets if t.reservation_id is not None])
                except errors.KVPoolError as exc:  # they expire after master.reservation_timeout_s
                    log.debug("revoking durable reservations failed: %s", exc)
            raise

    def put_many(self, items: Mapping[Key, Any] | Iterable[tuple[Key, Any]], *, dtype: str | None = None) -> None:
        """Validate everything, store everything, publish everything: one master round trip."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        prepared = []
        for prefix_hash, kv in pairs:
            spec, arr = spec_of(kv, dtype)
            prepared.append((self._key(prefix_hash), spec, byte_view(arr)))
        self._check_open()
        self._put_many(prepared)

    def _put_many(self, prepared: Sequence[tuple[bytes, ObjectSpec, memoryview]]) -> None:
        """Store every object locally, then publish them all in one master round trip.

        The bytes are complete before the master hears of them, so no reader can
        see half an object; a reservation (the master's two-phase put) is only
        needed where bytes go to another node, i.e. for durable copies.
        """
        records = []
        try:
            for key, spec, payload in prepared:
                self._put_local(key, spec, payload)
                record = self._node.record(key)
                if record is not None:  # already evicted again by a concurrent flood: nothing to show
                    records.append(record)
        finally:
            if records:
                self._node.publish(records)

    def _replicate(self, key: bytes, targets: Sequence[Any]) -> None:
        """Have every target pull the object from here into its nvme tier; each commits its
        reservation before it answers, so on return every copy is visible and durable."""
        record = self._node.record(key)
        if record is None:
            raise errors.CapacityError("object was evicted locally before it could be replicated")
        assert self._node.address is not None
        source = self._node.address.encode()
        for target in targets:
            control_call(NodeAddress.decode(target.address).control, "replicate", {
                "key": key, "spec": record["spec"], "header_sum": record["header_sum"], "source": source,
                "reservation": target.reservation_id,
                "replicas": len(targets), "persistent": True,
                "token": self._node.cluster_key.mint_token(key, self._node.node_id),
            }, timeout_s=self.config.node.pull_timeout_s + 5.0, cluster_key=self._node.cluster_key)
            self._remote["replicated"] += 1

    # -- reads ----------------------------------------------------------------------------

    @timed("get")
    def get(self, prefix_hash: Key, *, layers: Any = None, out: Any = None) -> np.ndarray | None:
        """Local tiers first, then a replica elsewhere; None on a miss anywhere."""
        self._check_open()
        key = self._key(prefix_hash)
        local = self._get_local(key, layers, out)
        if local is not None:
            return local
        nearby = self._reader.read_same_host(key, layers, out, self._out_view)
        if nearby is not None:
            return nearby
        remembered = self._reader.read_cached(key, layers, out, self._out_view)
        if remembered is not None:
            return remembered
        located = self._master.locate(key, lease=True)
        try:
            return self._get_remote(key, replicas_at(located, 0), layers, out)
        finally:
            self._releaser.release(located.lease_ids)

    def get_many(self, prefix_hashes: Sequence[Key], *, layers: Any = None,
                 outs: Sequence[Any] | None = None) -> list[np.ndarray | None]:
        """Local hits, then same-host arenas; the rest are located in one master round trip and
        pulled concurrently. ``outs`` gives one ``out=`` buffer per key."""
        self._check_open()
        keys = [self._key(h) for h in prefix_hashes]
        outs = self._outs(keys, outs)
        results = [self._get_local(k, layers, out) for k, out in zip(keys, outs)]
        for i, key in enumerate(keys):
            if results[i] is None:
                results[i] = self._reader.read_same_host(key, layers, outs[i], self._out_view)
        # Where keys were found last time, without the master: pulled concurrently; a replica no
        # longer there (or a token about to expire) is located again below.
        remembered = [(i, self._reader.remembered(keys[i])) for i, r in enumerate(results) if r is None]
        remembered = [(i, replicas) for i, replicas in remembered if replicas]
        if remembered:
            pulled = self._reader.read_many([keys[i] for i, _ in remembered], [r for _, r in remembered], layers,
                                            self._out_view, [outs[i] for i, _ in remembered], count_misses=False)
            for (i, _), arr in zip(remembered, pulled):
                results[i] = arr
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            located = self._master.locate_many([keys[i] for i in missing], lease=True)
            try:
                pulled = self._reader.read_many([keys[i] for i in missing],
                                                [replicas_at(located, j) for j in range(len(missing))], layers,
                                                self._out_view, [outs[i] for i in missing])
                for i, arr in zip(missing, pulled):
                    results[i] = arr
            finally:
                self._releaser.release(located.lease_ids)
        return results

    def _get_remote(self, key: bytes, replicas: list[LocatedReplica] | None, layers: Any,
                    out: Any) -> np.ndarray | None:
        return self._reader.read(key, replicas, layers, out, self._out_view)

    async def iter_layers(self, prefix_hash: Key, *, layers: Any = None,
                          out: Any = None) -> AsyncIterator[tuple[int, np.ndarray]]:
        """Layer-wise: layer i is yielded while layer i+1 is read or pulled."""
        self._check_open()
        key = self._key(prefix_hash)
        if key in self._manager:
            async for item in super().iter_layers(key, layers=layers, out=out):
                yield item
            return
        located = await asyncio.to_thread(self._master.locate, key, True)
        try:
            replicas = self._reader.ordered(replicas_at(located, 0))
            if not replicas:
                return
            spec: ObjectSpec = replicas[0]["_spec"]  # type: ignore[typeddict-item]
            replicas = [r for r in replicas if r["_spec"] == spec]  # type: ignore[typeddict-item]
            layer_range = LayerRange.resolve(layers, spec.layers)
            arr, _ = self._out_view(spec, layer_range, out)

            first: list[ObjectHeader] = []  # the header layer 0 was verified against

            def fetch(i: int) -> None:
                one = LayerRange(layer_range.start + i, layer_range.start + i + 1)
                buf = byte_view(arr[i])
                for replica in replicas:
                    try:
                        header = self._reader.read_into(key, replica, one, buf, same_as=first[0] if first else None)
                        first[:] = first or [header]
                        return
                    except (errors.TransferError, errors.ChecksumError, errors.KVTimeoutError) as exc:
                        log.info("layer %d of %s: replica failed (%s)", one.start, key.hex(), exc)
                raise errors.TransferError(f"layer {one.start} of {key.hex()}: every replica failed")

            pending = asyncio.ensure_future(asyncio.to_thread(fetch, 0))
            for i in range(layer_range.count):
                await pending
                if i + 1 < layer_range.count:
                    pending = asyncio.ensure_future(asyncio.to_thread(fetch, i + 1))
                yield layer_range.start + i, arr[i]
        finally:
            self._releaser.release(located.lease_ids)

    # -- metadata -------------------------------------------------------------------------

    def exists(self, prefix_hash: Key) -> bool:
        self._check_open()
        key = self._key(prefix_hash)
        return key in self._manager or self._master.exists(key)

    def exists_many(self, prefix_hashes: Sequence[Key]) -> list[bool]:
        """One master round trip for the whole batch."""
        self._check_open()
        return self._master.exists_many([self._key(h) for h in prefix_hashes])

    def lookup(self, prefix_hashes: Sequence[Key]) -> int:
        """Longest cached prefix anywhere in the cluster, in one master round trip."""
        self._check_open()
        return self._master.lookup([self._key(h) for h in prefix_hashes])

    def delete(self, prefix_hash: Key) -> None:
        """Delete everywhere: gone from lookups at once; holders drop it on their next heartbeat."""
        self._check_open()
        key = self._key(prefix_hash)
        self._reader.forget(key)
        deleted = self._master.delete([key], node_id=self._node.node_id)[0]
        try:
            self._manager.delete(key)
        except errors.KeyNotFoundError:
            if not deleted:
                raise

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats["role"] = "client"
        stats["node"] = self._node.stats()
        remote = self._reader.stats()
        stats["remote"] = {**remote, **self._remote}
        for reason in ("evicted", "stale", "checksum", "timeout", "holder_gone", "unauthorized", "malformed"):
            stats["misses"][reason] = remote.get(f"miss_{reason}", 0)
        # every remote read starts with a local miss: count where the key really was absent
        stats["misses"]["absent"] = remote.get("miss_absent", 0)
        return stats

    # -- lifecycle -----------------------------------------------------------------------------

    def _close_cluster_parts(self) -> None:
        stop = getattr(self, "_neighbours_stop", None)
        if stop is not None:
            stop.set()
            if self._neighbours_thread is not None:
                self._neighbours_thread.join(5.0)
        for name in ("_releaser", "_reader", "_node"):
            part = getattr(self, name, None)
            if part is not None:
                try:
                    part.close()
                except Exception as exc:  # keep closing the rest
                    log.warning("closing %s: %s", name, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._close_cluster_parts()
        super().close()
