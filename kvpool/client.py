"""``kvpool.connect``: the cluster client, a pool that also sees the other nodes.

A :class:`ClusterPool` composes a local :class:`kvpool.pool.Pool` (this
process's own tiers) with a :class:`kvpool.cluster.node.view.ClusterView` (its node,
the master, the replica reader). A put is stored locally, then published to the
master (durable puts also get copies on storage nodes, through the master's
two-phase reserve/commit); a get tries the local tiers, then the cluster: the
shared indexes of same-host nodes' ``cxl`` arenas, the replicas the key was read
from last time, then the master's ``locate`` — read in place from a same-host
``cxl`` arena, else pulled over UCX into ``out`` — verifying every layer's
checksum. A replica that fails (checksum, holder gone, timeout) is skipped for
the next one; when none is left the get is a miss.

The process is also a :class:`kvpool.cluster.node.server.Node`: its own puts are served to
peers from its tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.api import Key, LayerSource, PoolAPI, timed
from kvpool.cluster.node.same_host import ArenaBlock, copy_layer
from kvpool.cluster.node.view import ClusterView, LeaseReleaser
from kvpool.cluster.wire.protocol import Placement
from kvpool.config import Config, NodeSection, settings_for
from kvpool.pool import Pool

log = logging.getLogger("kvpool.client")

__all__ = ["ClusterPool", "LeaseReleaser", "connect", "durable_copies"]

def connect(master_address: str | None = None, *, config: str | Config | Mapping[str, Any] | None = None,
            transport: str = "auto") -> ClusterPool:
    """A pool backed by the cluster whose master listens on ``master_address`` (default:
    ``master.listen``; with ``master.etcd`` set and no address, the master leader found in
    etcd, followed when it changes).

    Settings that name no ``pool.name`` (none, a TOML file, a mapping or a Config alike)
    open this process's own local pool (``client-<pid>``, no nvme tier unless
    ``tiers.nvme.capacity`` is given), so clients never collide with each other or with a
    ``kvpool-server`` on the same host (:func:`kvpool.config.settings_for`).

    ``transport``: ``"auto"`` (same-host peers over shared memory, others over
    TCP) or ``"tcp"`` (always the UCX listener, with UCX's own peer-failure
    detection). Raises MasterUnreachableError if the master does not answer, and
    ConfigError at once for a malformed address (``tcp://host:port`` or ``ipc://path``).
    """
    from kvpool.config import check_master_address

    if master_address is not None:
        check_master_address(master_address)
    return ClusterPool(master_address, config=config, transport=transport)


def durable_copies(node: NodeSection, durable: bool | None, replicas: int | None) -> int:
    """The one durability rule of :meth:`ClusterPool.put`, :meth:`ClusterPool.put_many` and
    the vLLM connector: how many durable copies on storage nodes a write asks for (0: none).

    ``durable`` and ``replicas`` given by the caller override the config's ``node.durable``
    and ``node.replicas``; None (the default) takes the config's. Raises
    InvalidArgumentError for ``durable`` not a bool or None and ``replicas`` not an int >= 1
    or None (checked even when the write is not durable).
    """
    if durable is not None and not isinstance(durable, bool):
        raise errors.InvalidArgumentError(f"durable must be True, False or None, got {durable!r}")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise errors.InvalidArgumentError(f"replicas must be an int >= 1, got {replicas!r}")
    if not (node.durable if durable is None else durable):
        return 0
    return node.replicas if replicas is None else replicas


class ClusterPool(PoolAPI):
    """The pool API over the whole cluster (see the module docstring): ``local`` is this
    process's own pool, ``cluster`` its view of the other nodes."""

    def __init__(self, master_address: str | None = None, *,
                 config: str | Config | Mapping[str, Any] | None = None, transport: str = "auto") -> None:
        from kvpool.config import check_master_address
        from kvpool.config import master_address as config_master_address

        if master_address is not None:
            check_master_address(master_address)  # before any tier is opened
        # No pool named, in whatever form the settings come: this process's own pool, never the
        # one of a kvpool-server or of another client on this host (same name = same arena and
        # nvme dir = PoolLockedError), and no nvme tier unless asked for (settings_for).
        #: what the hand-off at :meth:`close` did (``node.hand_off_s``; see
        #: :meth:`kvpool.cluster.node.view.ClusterView.hand_off`), once it ran
        self.handed_off: dict[str, Any] | None = None
        self.local = Pool(settings_for(config, process="client"))
        super().__init__(self.local.config)
        self._adopt(self.local)
        self.master_address = config_master_address(self.config, master_address)  # None: the leader in etcd
        try:
            self.cluster = ClusterView(self.config, self.local.manager, self.master_address, transport=transport)
        except BaseException:
            self._closed = True
            self.local.close()
            raise

    @property
    def node_id(self) -> str:
        return self.cluster.node_id

    def start_ucx(self) -> bool:
        """Start this node's UCX now, serving pulls and registered with the master; False (logged)
        where UCX cannot start (pulls then go over TCP). A client otherwise starts it when it
        is first wanted (an object above ``node.tcp_pull_max`` or 1 MiB, or a UCX pull), and
        starting it holds the GIL while UCX sets up its context and worker: every thread of the
        process stops meanwhile. A latency-sensitive process (an inference engine) starts it
        before it serves."""
        self._check_open()
        try:
            self.cluster.node.ucx_engine()
            return True
        except errors.KVPoolError as exc:
            log.warning("UCX did not start (%s): pulls to and from this node go over TCP", exc)
            return False

    # -- writes -------------------------------------------------------------------------

    @timed("put")
    def put(self, prefix_hash: Key, kv: Any, *, dtype: str | None = None, durable: bool | None = None,
            replicas: int | None = None) -> None:
        """Store locally and publish (one master round trip); durable (see
        :func:`durable_copies`: ``durable=True``, or ``node.durable`` in the config when
        ``durable`` is None) also keeps ``replicas`` copies in the nvme tier of storage nodes
        (``kvpool-server --role node|all``, never inference clients) chosen by the master, so
        the object outlives this process. A durable put returns once every copy is committed
        at the master, which then keeps the count: copies lost with a storage node are
        re-created elsewhere.

        Raises what :meth:`Pool.put` raises, MasterUnreachableError within
        ``master.request_timeout_s`` (twice that when the bottom tier must first ask the
        master before it evicts, which it does not again while the master is known away; the
        object then stays in the local tiers, readable here, and becomes visible to the
        cluster when this node re-registers with the master), and (durable)
        InvalidArgumentError for ``replicas < 1`` and NotEnoughReplicasError when
        fewer storage nodes are eligible (both before anything is stored or
        copied), CapacityError / TransferError / KVTimeoutError when a copy failed
        (copies already committed stay, and the master completes the count).
        """
        self._check_open()
        self._write(self.local.prepare_many([(prefix_hash, kv)], dtype), durable, replicas)

    def put_many(self, items: Mapping[Key, Any] | Iterable[tuple[Key, Any]], *, dtype: str | None = None,
                 durable: bool | None = None, replicas: int | None = None) -> None:
        """:meth:`put` of every (prefix_hash, kv) pair: all validated before any is stored,
        then stored, then published in one master round trip. Durable by the same rule as
        :meth:`put` (:func:`durable_copies`); a durable batch takes one placement (the same
        storage nodes reserve every object) and one ``replicate_many`` exchange per storage
        node, which pulls every object at once — not a round trip per key. Raises what
        :meth:`put` raises."""
        prepared = self.local.prepare_many(items, dtype)
        self._check_open()
        self._write(prepared, durable, replicas)

    def _write(self, prepared: Sequence[tuple[bytes, Any, memoryview]], durable: bool | None,
               replicas: int | None) -> None:
        """Store and publish validated objects; durable ones (:func:`durable_copies`) are placed
        (and reserved) first, so too few storage nodes fails before anything is stored, then
        copied in batches of at most ``master.max_batch``."""
        copies = durable_copies(self.config.node, durable, replicas)
        if copies and len({key for key, _, _ in prepared}) < len(prepared):
            # a key given twice is copied once: the later object, the one the local store keeps
            last = {key: i for i, (key, _, _) in enumerate(prepared)}
            prepared = [prepared[i] for i in sorted(last.values())]
        batches: list[tuple[list[bytes], list[Placement]]] = []
        try:
            if copies and prepared:
                step = self.config.master.max_batch
                for at in range(0, len(prepared), step):
                    chunk = prepared[at:at + step]
                    targets = self.cluster.place_many([(key, spec.total_nbytes) for key, spec, _ in chunk], copies)
                    batches.append(([key for key, _, _ in chunk], targets))
            self._store(prepared)
            for keys, targets in batches:
                self.cluster.replicate_many(keys, targets)
        except BaseException:
            if batches:
                self.cluster.revoke([t for _, targets in batches for t in targets])
            raise

    def _store(self, prepared: Sequence[tuple[bytes, Any, memoryview]]) -> None:
        """Store every object locally, then publish them all in one master round trip.

        The bytes are complete before the master hears of them, so no reader can
        see half an object; a reservation (the master's two-phase put) is only
        needed where bytes go to another node, i.e. for durable copies.
        """
        stored: list[bytes] = []
        try:
            for key, spec, payload in prepared:
                self.local.put_object(key, spec, payload)
                stored.append(key)
        finally:
            self.cluster.publish(stored)

    # -- reads ----------------------------------------------------------------------------

    @timed("get")
    def get(self, prefix_hash: Key, *, layers: Any = None, out: Any = None) -> np.ndarray | None:
        """Local tiers first, then a replica elsewhere; None on a miss anywhere.

        What lands in ``out`` counts only when the get returns it: on a miss ``out`` may hold
        bytes a failed replica or a wasted speculative pull wrote (never reported as data)."""
        self._check_open()
        key = self._key(prefix_hash)
        local = self.local.get_object(key, layers, out)
        return local if local is not None else self.cluster.read(key, layers, out)

    def get_many(self, prefix_hashes: Sequence[Key], *, layers: Any = None, outs: Sequence[Any] | None = None,
                 landed: Callable[[int, np.ndarray | None], None] | None = None) -> list[np.ndarray | None]:
        """Local hits, then the cluster: same-host arenas, remembered replicas, and the rest
        located in one master round trip; pulls to one holder go out together on one connection
        and are read in order (see :meth:`PoolAPI.get_many` for ``layers``, ``outs``, ``landed``)."""
        self._check_open()
        keys = [self._key(h) for h in prefix_hashes]
        outs = self._outs(keys, outs)
        each = self._layers_each(keys, layers)
        results = [self.local.get_object(k, layer, out) for k, layer, out in zip(keys, each, outs)]
        if landed is not None:
            for i, arr in enumerate(results):
                if arr is not None:
                    landed(i, arr)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            found = self.cluster.read_many([keys[i] for i in missing], [each[i] for i in missing],
                                           [outs[i] for i in missing],
                                           None if landed is None else lambda j, arr: landed(missing[j], arr))
            for i, arr in zip(missing, found):
                results[i] = arr
        return results

    def _layer_source(self, key: bytes) -> LayerSource | None:
        return self.local.pin_layers(key) or self.cluster.layer_source(key)

    # -- in place, on this host -------------------------------------------------------------

    def find_in_place(self, prefix_hashes: Sequence[Key]) -> list[ArenaBlock | None]:
        """Where each object lies in the shared-memory (cxl) arena of another kvpool node on
        this host, found through that arena's shared index: no master round trip, no pull;
        None where no same-host arena has it (or none is mapped yet). Copy its layers with
        :meth:`copy_layer_in_place`. A hint, not a hold: the holder may evict the object and
        reuse its extent at any time, which the copy's checksums catch."""
        self._check_open()
        return self.cluster.reader.arenas.find_many([self._key(h) for h in prefix_hashes])

    def copy_layer_in_place(self, layer: int, blocks: Sequence[ArenaBlock], outs: Sequence[Any]) -> list[bool]:
        """Copy layer ``layer`` of each of ``blocks`` (:meth:`find_in_place`) straight into
        ``outs[i]`` (one layer's bytes each, e.g. a paged KV cache's block), one verified copy
        per arena for all its blocks. ``ok[i]`` False: that copy failed its checksum (the
        extent was reused, or rot) or the arena went away, and ``outs[i]`` holds bytes that
        must not be used. Raises LayerRangeError for a layer a block lacks, OutBufferError
        for an ``out`` of another size or read-only (before anything is copied)."""
        self._check_open()
        return copy_layer(layer, blocks, outs)

    # -- metadata -------------------------------------------------------------------------

    def exists(self, prefix_hash: Key) -> bool:
        self._check_open()
        key = self._key(prefix_hash)
        return key in self.local.manager or self.cluster.exists(key)

    def exists_many(self, prefix_hashes: Sequence[Key]) -> list[bool]:
        """One master round trip for the whole batch."""
        self._check_open()
        return self.cluster.exists_many([self._key(h) for h in prefix_hashes])

    def lookup(self, prefix_hashes: Sequence[Key]) -> int:
        """Longest cached prefix anywhere in the cluster, in one master round trip."""
        self._check_open()
        return self.cluster.lookup([self._key(h) for h in prefix_hashes])

    def delete(self, prefix_hash: Key) -> None:
        """Delete everywhere: gone from lookups at once; holders drop it on their next heartbeat."""
        self._check_open()
        key = self._key(prefix_hash)
        deleted = self.cluster.delete(key)
        try:
            self.local.manager.delete(key)
        except errors.KeyNotFoundError:
            if not deleted:
                raise

    def stats(self) -> dict[str, Any]:
        self._check_open()
        stats = self.local.stats()
        stats["role"] = "client"
        cluster = self.cluster.stats()
        stats["node"], remote = cluster["node"], cluster["remote"]
        stats["remote"] = remote
        for reason in ("evicted", "stale", "checksum", "timeout", "holder_gone", "unauthorized", "malformed"):
            stats["misses"][reason] = remote.get(f"miss_{reason}", 0)
        # every remote read starts with a local miss: count where the key really was absent
        stats["misses"]["absent"] = remote.get("miss_absent", 0)
        return stats

    def _close(self) -> None:
        if self.config.node.hand_off_s > 0:
            try:
                self.handed_off = self.cluster.hand_off(self.config.node.hand_off_s)
            except Exception as exc:  # closing anyway: what was not handed off leaves with this node
                log.warning("hand-off failed: %s: %.200s", type(exc).__name__, exc)
        self.cluster.close()
        self.local.close()
