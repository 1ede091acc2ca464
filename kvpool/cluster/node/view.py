"""A process's view of the cluster: everything a client does beyond its local tiers.

Owns the node this process is (serving its own objects to peers), the master
client, the replica reader, read leases and their release, and the watch on
the other nodes (same-host arenas mapped, dead holders forgotten). The cluster
client (:class:`kvpool.client.ClusterPool`) composes it with a local
:class:`kvpool.pool.Pool`; it knows nothing of the local pool beyond the tier
manager its node serves from.

Reads walk the locator chain (:mod:`kvpool.cluster.node.locators`): same-host
nodes' shared ``cxl`` indexes (no master), the replicas this key was read from
last time (no master), then the master's ``locate`` under a lease. Each yields
:class:`~kvpool.cluster.node.located.LocatedReplica` records, which the one
reader reads alike (in place on this host, else a pull), verified layer by
layer; a replica that fails is skipped for the next one, a key no replica of a
locator delivered goes to the next locator. With ``node.speculative_pulls`` a
read also guesses the node it last pulled from before asking the master: over
TCP from a holder that proves the cluster key its answer is used at once (a
batch's through the ``LastHolder`` locator); else (or with
``node.confirm_speculative``, single keys only) the guessed pull travels while
``locate`` does, and its bytes are used only when the master names that node
with the same header checksum.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.cluster.node.checks import Speculation
from kvpool.cluster.node.located import LocatedReplica, alive_nodes_of
from kvpool.cluster.node.locators import LastHolder, LocationCache, Locator, MasterLocator, SameHostIndex
from kvpool.cluster.node.reader import ReplicaReader
from kvpool.cluster.node.server import Node, NodeAddress, alive_peers_of
from kvpool.cluster.wire import schema as S
from kvpool.cluster.wire.control import control_call
from kvpool.cluster.wire.master_client import MasterClient
from kvpool.cluster.wire.protocol import CONTROL_ADOPT_MANY, Placement, ReplicaRecord
from kvpool.cluster.wire.schema import ROLE_STORAGE
from kvpool.config import Config
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec, out_view
from tiers.cxl.arena import shared_dirs_of
from tiers.manager import TierManager

log = logging.getLogger("kvpool.client")

#: the most bytes one hand-off exchange moves (:meth:`ClusterView.hand_off`): the storage node
#: holds a batch's receive buffers at once, and a batch cut short by the deadline is wasted
HAND_OFF_BATCH_BYTES = 64 << 20


def _failed(guess: Speculation) -> dict[str, str] | None:
    """The guessed holder, if it just failed as a holder: the located read skips it rather
    than wait on it a second time."""
    return None if guess.failure is None else {guess.replica.node_id: guess.failure}


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


class ReplicaLayers:
    """Located replicas of one key, leased, for a layer-wise read (:class:`kvpool.api.LayerSource`).

    Each layer comes from the first replica that delivers it intact; every layer
    after the first must match the header the first was verified against, so a
    read that moves to another replica never mixes two versions."""

    def __init__(self, reader: ReplicaReader, key: bytes, replicas: list[LocatedReplica],
                 release: Callable[[], None]) -> None:
        self.reader, self.key, self._release = reader, key, release
        self.spec: ObjectSpec = replicas[0].spec
        self.replicas = [r for r in replicas if r.spec == self.spec]
        self._header: ObjectHeader | None = None

    def read(self, layer_range: LayerRange, buf: memoryview) -> None:
        for replica in self.replicas:
            try:
                header = self.reader.read_into(self.key, replica, layer_range, buf, same_as=self._header)
            except (errors.TransferError, errors.FormatError, errors.TierError, errors.KVTimeoutError,
                    errors.AuthenticationError) as exc:  # this replica only: dead, evicted, corrupt, refused
                log.info("layers %s of %s: replica on %s failed (%s)", layer_range, self.key.hex(),
                         replica.node_id, exc)
                continue
            self._header = self._header or header
            return
        raise errors.TransferError(f"layers {layer_range} of {self.key.hex()}: every replica failed")

    def done(self, nbytes_read: int) -> None:
        self._release()


class ClusterView:
    """The node, master client, reader and lease releaser of one process (see the module
    docstring). ``manager``: the local tiers this process's node serves to peers."""

    def __init__(self, config: Config, manager: TierManager, master_address: str | None, *,
                 transport: str = "auto") -> None:
        self.config = config
        self.counters = Counter[str]()
        self._neighbours_thread: threading.Thread | None = None
        self._neighbours_stop = threading.Event()
        self._parts: list[Any] = []  # closed in reverse order
        try:
            self.node = Node(config, manager, master_address)
            self._parts.append(self.node)
            self.master = self.node.master
            self.master.ping()
            self.node.start()
            self.releaser = LeaseReleaser(self.master)
            self._parts.append(self.releaser)
            self.reader = ReplicaReader(self.node.host_id, node_id=self.node.node_id, transport=transport,
                                        max_message=config.node.max_message,
                                        pull_timeout_s=config.node.pull_timeout_s,
                                        location_cache_size=config.node.location_cache,
                                        allowed_dirs=shared_dirs_of(config), host=self.node.host,
                                        engine=self.node.ucx_engine, tcp_pull_max=config.node.tcp_pull_max,
                                        cluster_key=self.node.cluster_key,
                                        poll_s=config.node.reply_poll_us * 1e-6)
            self._parts.append(self.reader)
            self.locate = MasterLocator(self.master, self.reader.counters)
            #: where a read looks, nearest first; the master's answer is final
            self._nearby: tuple[Locator, ...] = (SameHostIndex(self.reader.arenas),
                                                 LocationCache(self.reader.remembered))
            guess = config.node.speculative_pulls and not config.node.confirm_speculative
            self.locators: tuple[Locator, ...] = (*self._nearby, *((LastHolder(self.reader.guessed_holder),)
                                                                   if guess else ()), self.locate)
            self._refresh_from_master()
            self._neighbours_thread = threading.Thread(target=self._watch_neighbours, daemon=True,
                                                       name="kvpool-neighbours")
            self._neighbours_thread.start()
        except BaseException:
            self.close()
            raise

    @property
    def node_id(self) -> str:
        return self.node.node_id

    # -- the other nodes --------------------------------------------------------------------

    def _refresh_from_master(self) -> None:
        """Map same-host arenas, forget remembered holders that are no longer alive, and close
        pooled pull connections to them or whose holder hung up (a reader's, and this node's
        replica pulls)."""
        stats = self.master.stats()
        if self.config.node.same_host_index:
            self.reader.arenas.refresh(stats)
        alive = alive_nodes_of(stats)  # None: the master's stats are unreadable, keep what we know
        if alive is not None:
            self.reader.forget_nodes_except(alive)
        peers = alive_peers_of(stats)
        self.reader.pulls.sweep(peers)
        self.node.sweep_peers(peers)

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

    # -- writes -----------------------------------------------------------------------------

    def publish(self, keys: Sequence[bytes]) -> None:
        """Make objects this node holds visible to the cluster: one master round trip (an object
        evicted again meanwhile by a concurrent flood has nothing to show and is skipped)."""
        records: list[ReplicaRecord] = [r for r in map(self.node.record, keys) if r is not None]
        if records:
            self.node.publish(records)

    def place_many(self, items: Sequence[tuple[bytes, int]], replicas: int) -> list[Placement]:
        """Storage nodes chosen (and reserved) for durable copies of a batch of ``(key,
        nbytes)``: one master round trip, the same nodes for every item."""
        return self.master.place_many(items, replicas, exclude=[self.node.node_id])

    def replicate_many(self, keys: Sequence[bytes], targets: Sequence[Placement]) -> None:
        """Have every target pull the objects from here into its nvme tier: one
        ``replicate_many`` exchange per target (the targets at once), each pulling every
        object together and committing them in one master round trip, so on return every
        copy is visible and durable. Raises the first target's error (copies already
        committed stay; the master completes the count)."""
        found = [self.node.record(key) for key in keys]
        records = [r for r in found if r is not None]
        if len(records) < len(found):
            raise errors.CapacityError("an object was evicted locally before it could be replicated")
        assert self.node.address is not None
        source = self.node.address.encode()

        def send(target: Placement) -> None:
            items = [S.ReplicateItem(key=key, spec=record["spec"], header_sum=record["header_sum"],
                                     reservation=rid, token=self.node.cluster_key.mint_token(key, self.node.node_id))
                     for key, record, rid in zip(keys, records, target.reservation_ids)]
            control_call(NodeAddress.decode(target.address).control, "replicate_many", S.ReplicateMany(
                items=items, source=source, replicas=len(targets), persistent=True,
            ), timeout_s=self.config.node.pull_timeout_s + 5.0, cluster_key=self.node.cluster_key)
            self.counters["replicate_requests"] += 1
            self.counters["replicated"] += len(items)

        if len(targets) == 1:
            send(targets[0])
            return
        with concurrent.futures.ThreadPoolExecutor(len(targets), thread_name_prefix="kvpool-replicate") as pool:
            futures = [pool.submit(send, target) for target in targets]
        for future in futures:
            future.result()

    def hand_off(self, within_s: float) -> dict[str, Any]:
        """Before this node leaves: have a storage node on this host keep the objects this node
        holds (``node.hand_off_s``), so the engine that comes after this one still finds them.

        The objects go newest first (by when each key was first stored here), in batches
        (``master.max_batch`` objects, at most :data:`HAND_OFF_BATCH_BYTES`), each an
        ``adopt_many`` exchange the storage node answers once it has read them (in place from
        this node's arena where it may map it, else pulled), verified, stored and published
        them; it skips keys it holds already. Stops at ``within_s``, or at the first failed
        exchange: what was not handed off leaves with this node, as without a hand-off (or is
        rescued, should this node die instead: the master's ``_plan_rescue``). The storage node
        chosen is the alive one on this host with the most shared-memory (cxl) capacity, then
        the most capacity; none on this host: nothing is handed off. Never raises; returns what
        it did."""
        started = time.monotonic()
        deadline = started + within_s
        done: dict[str, Any] = {"adopted": 0, "held": 0, "failed": 0, "left": 0, "target": None}
        objects = [(key, header) for key, _, _, header in reversed(self.node.manager.snapshot())]
        if not objects or within_s <= 0 or self.node.address is None:
            return done
        try:
            target = self._hand_off_target(self.master.stats(timeout_s=within_s / 2))  # a master away: half the time
        except errors.KVPoolError as exc:
            log.info("hand-off: the master did not answer (%s): %d objects leave with this node", exc, len(objects))
            done["left"] = len(objects)
            return done
        if target is None:
            log.info("hand-off: no storage node on this host: %d objects leave with this node", len(objects))
            done["left"] = len(objects)
            return done
        node_id, control = target
        done["target"] = node_id
        source = self.node.address.encode()
        key_of = self.node.cluster_key
        at = 0
        while at < len(objects):
            batch: list[S.AdoptItem] = []
            nbytes = 0
            while at < len(objects) and len(batch) < self.config.master.max_batch \
                    and (not batch or nbytes + objects[at][1].spec.total_nbytes <= HAND_OFF_BATCH_BYTES):
                key, header = objects[at]
                batch.append(S.AdoptItem(key=key, spec=header.spec.to_wire(), header_sum=header.checksum(),
                                         token=key_of.mint_token(key, self.node.node_id)))
                nbytes += header.spec.total_nbytes
                at += 1
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                at -= len(batch)
                break
            try:
                reply = control_call(control, CONTROL_ADOPT_MANY, S.AdoptMany(items=batch, source=source),
                                     timeout_s=left_s, cluster_key=key_of)
            except errors.KVPoolError as exc:
                log.info("hand-off to node %s stopped: %s: %s", node_id[:8], type(exc).__name__, exc)
                at -= len(batch)
                break
            for name in ("adopted", "held", "failed"):
                value = reply.get(name) if isinstance(reply, dict) else None
                done[name] += value if type(value) is int and value >= 0 else 0
        done["left"] = len(objects) - at
        self.counters["handed_off"] += done["adopted"]
        log.info("hand-off to node %s: %d objects kept there, %d held there already, %d failed, %d left with "
                 "this node, in %.2f s", node_id[:8], done["adopted"], done["held"], done["failed"], done["left"],
                 time.monotonic() - started)
        return done

    def _hand_off_target(self, stats: Any) -> tuple[str, str] | None:
        """(node id, control address) of the storage node on this host a hand-off goes to."""
        nodes = stats.get("nodes") if isinstance(stats, dict) else None
        best: tuple[tuple[int, int], str, str] | None = None
        for node_id, node in (nodes.items() if isinstance(nodes, dict) else ()):
            if (node_id == self.node.node_id or not isinstance(node, dict) or node.get("alive") is not True
                    or node.get("role") != ROLE_STORAGE or node.get("host_id") != self.node.host_id):
                continue
            raw_address, tiers = node.get("address"), node.get("tiers")
            address = NodeAddress.parse(raw_address) if isinstance(raw_address, str) else None
            capacity = {name: t.get("capacity", 0) if isinstance(t, dict) else 0
                        for name, t in (tiers.items() if isinstance(tiers, dict) else ())}
            rank = (int(capacity.get("cxl", 0) or 0), sum(int(c or 0) for c in capacity.values()))
            if address is None or not address.control or rank[1] <= 0:
                continue
            if best is None or rank > best[0]:
                best = (rank, node_id, address.control)
        return None if best is None else (best[1], best[2])

    def revoke(self, targets: Sequence[Placement]) -> None:
        """Give back reservations of copies that will not be made (else they expire after
        ``master.reservation_timeout_s``)."""
        try:
            self.master.revoke([rid for t in targets
                                for rid in ((t.reservation_id,) if t.reservation_id is not None else ())
                                + t.reservation_ids])
        except errors.KVPoolError as exc:
            log.debug("revoking durable reservations failed: %s", exc)

    # -- reads ------------------------------------------------------------------------------

    def read(self, key: bytes, layers: Any, out: Any) -> np.ndarray | None:
        """The layers from another node (the locator chain, see the module docstring),
        verified; None on a miss anywhere."""
        for locator in self._nearby:  # no master
            replicas = locator.find_many((key,)).replicas[0]
            if replicas:
                arr = self.reader.read(key, replicas, layers, out, out_view, source=locator.source)
                if arr is not None:
                    return arr
        # A guess: the holder last pulled from. Its verified answer is used at once when that
        # holder proves itself (TCP pulls); else (or with node.confirm_speculative) it is pulled
        # while the master locates the key and used only if the master names that holder and
        # version, so a right guess hides the round trip.
        node = self.config.node
        guess = self.reader.speculate(key, layers, out) if node.speculative_pulls else None
        skip = None
        if guess is not None and not node.confirm_speculative and self.reader.provable(guess):
            # over TCP, where this reader proved the cluster key to the holder: no token needed
            self.reader.run_proven(guess, out, out_view)
            used = self.reader.accept(guess)
            if used is not None:
                return used
            skip = _failed(guess)
            guess = None
        elif guess is not None and not guess.bind(out, out_view):
            guess = None
        if guess is None:
            found = self.locate.find(key)
        else:
            token = self.node.cluster_key.mint_token(key, guess.replica.node_id)
            found = self.locate.find(key, meanwhile=lambda: self.reader.run(guess, token))
        try:
            replicas = found.replicas[0]
            if guess is not None:
                confirmed = self.reader.confirm(guess, replicas)
                if confirmed is not None:
                    return confirmed
                skip = _failed(guess)
            return self.reader.read(key, replicas, layers, out, out_view, skip=skip)
        finally:
            self.releaser.release(found.lease_ids)

    def read_many(self, keys: Sequence[bytes], layers: Sequence[Any], outs: Sequence[Any],
                  landed: Callable[[int, np.ndarray | None], None] | None = None) -> list[np.ndarray | None]:
        """``read`` of many keys (``layers``: each key's): each locator of the chain asked
        once for the keys still missing (one master round trip for the last), the replicas it
        found read together (:meth:`ReplicaReader.read_many`: pulls in flight at once).
        ``landed(i, result)``: told each key's final result as soon as it is known."""
        results: list[np.ndarray | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        skip: dict[str, str] = {}  # holders that failed as holders on the way (a guessed one)
        for locator in self.locators:
            if not pending:
                break
            final = locator is self.locate
            found = locator.find_many([keys[i] for i in pending])
            try:
                ask = [(i, replicas) for i, replicas in zip(pending, found.replicas) if final or replicas]
                if not ask:
                    continue

                def tell(j: int, arr: np.ndarray | None, ask: list[Any] = ask, final: bool = final) -> None:
                    if landed is not None and (final or arr is not None):  # a miss here is not final
                        landed(ask[j][0], arr)

                pulled = self.reader.read_many([keys[i] for i, _ in ask], [r for _, r in ask],
                                               [layers[i] for i, _ in ask], out_view, [outs[i] for i, _ in ask],
                                               source=locator.source, landed=None if landed is None else tell,
                                               skip=skip)
                for (i, _), arr in zip(ask, pulled):
                    results[i] = arr
            finally:
                self.releaser.release(found.lease_ids)
            pending = [i for i in pending if results[i] is None]
        return results

    def layer_source(self, key: bytes) -> ReplicaLayers | None:
        """Replicas of ``key`` leased for a layer-wise read, or None on a miss."""
        found = self.locate.find(key)
        replicas = self.reader.ordered(found.replicas[0])
        if not replicas:
            self.releaser.release(found.lease_ids)
            return None
        return ReplicaLayers(self.reader, key, replicas, lambda: self.releaser.release(found.lease_ids))

    # -- metadata ---------------------------------------------------------------------------

    def exists(self, key: bytes) -> bool:
        return self.master.exists(key)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.master.exists_many(keys)

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.master.lookup(keys)

    def delete(self, key: bytes) -> bool:
        """Gone from lookups at once (holders drop it on their next heartbeat); whether the
        master knew the key."""
        self.reader.deleted(key)
        return self.master.delete([key], node_id=self.node.node_id)[0]

    def stats(self) -> dict[str, Any]:
        return {"node": self.node.stats(), "remote": {**self.reader.stats(), **self.counters}}

    def close(self) -> None:
        self._neighbours_stop.set()
        if self._neighbours_thread is not None:
            self._neighbours_thread.join(5.0)
        while self._parts:
            part = self._parts.pop()
            try:
                part.close()
            except Exception as exc:  # keep closing the rest
                log.warning("closing %s: %s", type(part).__name__, exc)
