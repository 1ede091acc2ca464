"""The metadata master: node registry, key index, reservations, leases, placement.

Owns, in memory, which node holds which key in which tier (with the object's
spec, its header's checksum and an opaque location), the node registry and its liveness,
two-phase put reservations, read leases, delete/evict coordination and
placement of durable puts. It serves these over one ZeroMQ ROUTER socket with
the protocol of :mod:`kvpool.cluster.wire.protocol`, from one thread, and never sees KV
bytes. It does not own storage (nodes do) or persistence: after a restart the
state is rebuilt by nodes re-registering everything they hold (heartbeat
replies to an unknown node say ``reregister``); with ``master.etcd`` a standby
that followed the leader's changes takes over with the full index instead
(:mod:`kvpool.cluster.master.follow`). The key index itself is compact and bounded by
``master.max_keys`` (:mod:`kvpool.cluster.master.index`).

Semantics worth knowing:

* **Liveness.** A node that sends no heartbeat for ``heartbeat_ms *
  dead_after_missed`` is declared dead on the master's own timer: all its
  replicas leave the index at once and its reservations are dropped. A later
  heartbeat from it is answered ``reregister``; ``register`` brings it back.
* **register** is authoritative for a node: the list it carries replaces
  whatever the master believed that node held (thousands of records per
  message are fine; the whole list is one message).
* **Two-phase put.** ``reserve`` returns an id; the key stays invisible until
  ``commit`` with the replica's record. A reservation not committed within
  ``reservation_timeout_s`` is reclaimed. Re-putting a key *adds* a replica on
  a node that did not hold it and *replaces* the record on a node that did
  (new tier/location); other nodes' replicas are untouched. ``publish`` is the
  one-step form for a node announcing bytes it already holds (its own puts,
  tier moves).
* **Leases.** ``locate`` with ``lease=True`` pins every replica it returns
  until ``release`` or ``lease_s``. ``evict_request`` from a node only allows
  unpinned keys, and removes what it allows from the index before replying,
  so no reader can be pointed at bytes the node is about to drop.
* **Delete** removes keys from the index at once (lookup misses immediately);
  holders learn through heartbeat replies, but only once no lease pins their
  replica. A heartbeat acknowledges (``delete_ack``) the deletes of the
  previous reply; unacknowledged ones are sent again.
* **Leaving.** ``leave`` (a node's clean close) withdraws its replicas at once;
  it is listed as ``left``, not dead. Dead and departed nodes are forgotten
  ``forget_nodes_after_s`` later (they vanish from ``stats``).
* **Placement** (``place``, for durable copies): only *storage nodes* (that
  registered with role ``storage``: ``kvpool-server --role node|all``) with a
  persistent tier (nvme) are eligible; inference clients never are. Asking for
  more replicas than there are eligible nodes is NotEnoughReplicasError before
  anything is reserved. Among eligible nodes whose persistent tier is large
  enough, those whose *effective free bytes* (persistent free bytes the node
  last reported, minus bytes reserved but not committed, minus bytes committed
  since that report) can take the object are chosen by smooth weighted round
  robin, weighted by effective free bytes. A node that just joined empty
  therefore gets a share proportional to its room, not every put, and each
  reservation lowers its weight at once. When too few nodes have room, every
  candidate will have to evict, and weights are their capacities. Replicas go
  to distinct nodes, on distinct hosts where possible. Passing ``key`` reserves
  on every chosen node in the same round trip; committing such a reservation
  makes the key *durable* with ``replicas`` copies wanted.
* **Re-replication.** When a holder of a durable key dies, leaves or drops it,
  the key is queued; between requests the serving thread plans at most
  ``rereplicate_per_s`` copies a second (a surviving holder as source, a
  target chosen as for ``place`` excluding current holders, a reservation on
  it), and worker threads ask each target over its control socket to
  ``replicate`` (pull, store in nvme, commit). Failures are retried with
  backoff; a key with no live holder waits until a node registers it again.
  Records re-registered with ``durable`` restore this after a master restart.

Ids (reservations, leases) carry a random per-process prefix, so an id from
before a master restart never names something of the new master. Leases,
reservations and undelivered deletes live only in memory: after a restart a
lease from before no longer pins anything, a commit of an old reservation
fails (ReservationError), and a node may re-register a key deleted just
before the restart.
"""


from __future__ import annotations

import logging
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

from kvpool import errors
from kvpool.cluster.master.bulk import RecordColumns
from kvpool.cluster.master.index import KEY_BYTES, WHOLE, KeyIndex
from kvpool.cluster.master.records import (
    COUNTERS,
    REREPLICATE_BACKOFF_S,
    REREPLICATE_EXAMINE_PER_ROUND,
    STALL_CREDIT_MIN_S,
    Lease,
    NodeInfo,
    Replica,
    RereplicationTask,
    RescueTask,
    Reservation,
)
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire import schema as S
from kvpool.cluster.wire.security import ClusterKey
from kvpool.config import MasterSection
from kvpool.objformat import ObjectSpec

log = logging.getLogger("kvpool.master")


class Durable(dict[bytes, int]):
    """key -> replicas wanted, telling ``journal`` (when set) of every change (a standby keeps
    the same map)."""

    journal: Callable[[list[Any]], None] | None = None

    def __setitem__(self, key: bytes, replicas: int) -> None:
        super().__setitem__(key, replicas)
        if self.journal is not None:
            self.journal(["durable", key, replicas])

    def update(self, pairs: Any = (), /, **_: Any) -> None:
        for key, replicas in (pairs.items() if isinstance(pairs, dict) else pairs):
            self[key] = replicas

    def pop(self, key: bytes, *default: Any) -> Any:
        found = key in self
        value = super().pop(key, *default)
        if found and self.journal is not None:
            self.journal(["undurable", key])
        return value


class IndexState:
    """The master's state and its transitions (index, registry, timers, durability planning);
    no sockets, no threads. The requests that drive it are :class:`kvpool.cluster.master.ops.MasterState`'s.
    """

    def __init__(
        self,
        config: MasterSection,
        *,
        max_key_bytes: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.max_key_bytes = max_key_bytes
        self.clock = clock
        self.dead_after_s = config.heartbeat_ms / 1000 * config.dead_after_missed
        self.started = clock()
        self.nodes: dict[str, NodeInfo] = {}
        self.index = KeyIndex(config.max_keys)  # key -> node_id -> record (compact: see index.py)
        # Every reservation (lease) gets the same timeout, so insertion order is
        # deadline order and expiry pops from the front.
        self.reservations: OrderedDict[int, Reservation] = OrderedDict()
        self.leases: OrderedDict[int, Lease] = OrderedDict()
        self.pins: dict[tuple[bytes, str], int] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._id_prefix = secrets.randbits(30) << 32
        self._id_count = 0
        self._swrr: dict[str, int] = {}
        self._specs_checked: set[tuple[Any, ...]] = set()  # wire specs validated before
        # Durability: key -> replicas wanted (from committed durable copies and
        # re-registered records); keys whose copies may be short, each with the
        # time before which it is not looked at again (retry backoff); the
        # targets of copies in flight per key; failed attempts per key.
        self.durable: Durable = Durable()
        self.to_check: OrderedDict[bytes, float] = OrderedDict()
        self.rereplicating: dict[bytes, set[str]] = {}
        #: the arenas of dead clients a storage node on their host is to rescue (Rereplicator.round)
        self.rescues: list[RescueTask] = []
        self._attempts: dict[bytes, int] = {}
        self._last_turn: float | None = None  # see note_turn
        #: mints the pull token every located replica carries (MasterServer sets it; None: no tokens)
        self.cluster_key: ClusterKey | None = None
        #: with master.etcd: {"etcd", "prefix", "term", "endpoint"} of this leader's term (shown in stats)
        self.ha: dict[str, Any] | None = None
        #: the master's query port (kvpool.cluster.wire.query), told to clients by ping; 0: none
        self.query_port = 0
        #: with master.etcd, on the leader: every change, for standbys to follow (a
        #: kvpool.cluster.master.follow.ChangeLog), and its append
        self.change_log: Any = None
        #: with master.etcd: how this leader's term began (warm from a followed copy, or cold)
        self.takeover: dict[str, Any] | None = None
        #: with master.etcd: the cluster term this master leads (told to nodes with each beat)
        self.term = 0
        #: on a leader that took over warm: the time (this clock) after which the last leader's
        #: changes may be missing from the copy it followed; nodes publish again what they
        #: changed since then (HeartbeatReply.resend_s). None: nothing to resend (cold or no etcd)
        self.resend_from: float | None = None
        self.changes: Callable[[list[Any]], None] | None = None

    def record_changes(self, change_log: Any) -> None:
        """Send every change of the index, the node registry and durability to ``change_log``."""
        self.change_log = change_log
        self.changes = self.index.journal = self.durable.journal = change_log.append

    def _journal(self, change: list[Any]) -> None:
        if self.changes is not None:
            self.changes(change)

    # -- helpers ----------------------------------------------------------------

    def _new_id(self) -> int:
        self._id_count += 1
        return self._id_prefix | self._id_count

    def _keys(self, keys: list[bytes], name: str = "keys", *, strict: bool = True) -> list[bytes]:
        """``keys`` (bytes, as the schema decoded them), at most ``master.max_batch``;
        InvalidKeyError names the first of an impossible length.

        Reads pass ``strict=False``: a key of an impossible length can only miss.
        map() over builtins keeps the checks in C, so a 1000-hash lookup does not
        spend its time validating.
        """
        self._batch(keys, name)
        if strict and keys and (not 0 < min(map(len, keys)) or max(map(len, keys)) > self.max_key_bytes):
            for key in keys:
                self._key(key)
        return keys

    def _batch(self, items: list[Any], name: str) -> list[Any]:
        """``items``, at most ``master.max_batch`` long (RequestTooLargeError)."""
        if len(items) > self.config.max_batch:
            raise errors.RequestTooLargeError(
                f"{name}: {len(items)} items in one request; the most is master.max_batch = "
                f"{self.config.max_batch} (MasterClient splits larger batches)")
        return items

    @staticmethod
    def _bounded_str(name: str, value: str, limit: int) -> str:
        if len(value) > limit:
            raise errors.RequestTooLargeError(f"{name} is {len(value)} characters; the most is {limit}")
        return value

    def _key(self, key: Any) -> bytes:
        if type(key) is not bytes or not 0 < len(key) <= self.max_key_bytes:
            raise errors.InvalidKeyError(
                f"keys must be 1..{self.max_key_bytes} bytes, got {type(key).__name__} {key!r:.60}"
            )
        return key

    @staticmethod
    def _tiers(tiers: dict[str, S.TierState]) -> dict[str, dict[str, int]]:
        """The schema checked the states; the master keeps plain maps (shown in stats)."""
        return {name: {"capacity": state.capacity, "free": state.free} for name, state in tiers.items()}

    def _record(self, raw: S.Record, *, with_key: bool) -> tuple[bytes, Replica]:
        """One replica record as stored: (key or b"", the record). The schema checked its
        shape; the key's length and the spec's meaning are checked here."""
        key = self._key(raw.key) if with_key else b""
        self._check_spec(raw.spec)
        # A node that lies about its header checksum only fails its own readers' checks.
        return key, Replica(raw.tier, raw.spec, raw.nbytes, raw.header_sum, raw.location, raw.durable)

    def _check_spec(self, spec: list[Any]) -> None:
        try:  # each spec is validated once (re-registering a million keys is a handful of specs)
            seen = tuple(spec)
            if seen not in self._specs_checked:
                ObjectSpec.from_wire(spec)
                if len(self._specs_checked) < 4096:
                    self._specs_checked.add(seen)
        except (TypeError, ValueError, errors.KVPoolError) as exc:
            raise P.MalformedRequest(f"replica record has a bad spec {spec!r:.100}: {exc}") from None

    def _encode_records(self, raws: list[S.Record]) -> tuple[list[bytes], list[int], list[int], list[int],
                                                                 list[Replica | None], list[tuple[bytes, int]]]:
        """Records with keys as the index stores them: (keys, shape ids, header checksums, offsets,
        whole records where a shape id is WHOLE (else None; [] when there are none), (key,
        replicas wanted) of the durable ones). Checks every record before the caller changes
        anything."""
        keys: list[bytes] = [raw.key for raw in raws]  # type: ignore[misc]
        n = len(keys)
        if n and (None in keys or not 0 < min(map(len, keys)) or max(map(len, keys)) > self.max_key_bytes):
            for key in keys:
                self._key(key)
        if not n:
            return [], [], [], [], [], []
        durable = [(key, raw.durable) for key, raw in zip(keys, raws) if raw.durable]
        # The common batch: one kind of object, every record with a checksum, no locations
        # (dram, nvme): one shape, checked with a few C loops instead of a Python loop.
        first = raws[0]
        specs, tiers, sizes = [r.spec for r in raws], [r.tier for r in raws], [r.nbytes for r in raws]
        sums: list[int] = [raw.header_sum for raw in raws]  # type: ignore[misc]
        if (specs.count(first.spec) == n and tiers.count(first.tier) == n and sizes.count(first.nbytes) == n
                and None not in sums and [r.location for r in raws].count({}) == n):
            self._check_spec(first.spec)
            sid = self.index.encode(first.tier, first.spec, first.nbytes, first.header_sum, None)[0]
            if sid != WHOLE:
                return keys, [sid] * n, sums, [0] * n, [], durable
        checked, encode = self._specs_checked, self.index.encode
        sids: list[int] = []
        sums = []
        offsets: list[int] = []
        whole: list[Replica | None] = []
        for raw in raws:
            spec = raw.spec
            if tuple(spec) not in checked:
                self._check_spec(spec)
            sid, header_sum, offset = encode(raw.tier, spec, raw.nbytes, raw.header_sum, raw.location)
            sids.append(sid)
            sums.append(header_sum)
            offsets.append(offset)
            whole.append(None if sid != WHOLE else
                         Replica(raw.tier, spec, raw.nbytes, raw.header_sum, raw.location, None))
        return keys, sids, sums, offsets, whole if any(w is not None for w in whole) else [], durable

    def _encode_columns(self, columns: RecordColumns) -> int | None:
        """The shape id of a batch decoded as columns (checked as :meth:`_encode_records` checks
        each record), or None: it does not fit the index's columns (decode it record by record)."""
        if not len(columns):
            return None
        self._key(columns.keys[:KEY_BYTES])  # every key is 16 bytes: allowed if the first is
        first = columns.first
        self._check_spec(first.spec)
        sid, _, offset = self.index.encode(first.tier, first.spec, first.nbytes, 0, None)
        return None if sid == WHOLE or offset else sid

    def _alive_node(self, node_id: Any) -> NodeInfo:
        node = self.nodes.get(node_id) if isinstance(node_id, str) else None
        if node is None or not node.alive:
            raise errors.UnknownNodeError(f"node {node_id!r} is not registered or was declared dead")
        return node

    def _add_replica(self, node: NodeInfo, key: bytes, record: Replica) -> bool:
        """Index ``record`` for ``key`` on ``node``; True if the node did not hold it before."""
        new = self.index.add(key, node.node_id, record)
        # A new copy supersedes a delete the node has not carried out yet.
        node.pending_deletes.pop(key, None)
        return new

    def _remove_replica(self, node: NodeInfo, key: bytes) -> bool:
        return self.index.remove(key, node.node_id)

    def _drop_replicas_of(self, node: NodeInfo) -> int:
        return self.index.drop_node(node.node_id)

    def _durable_held_by(self, node: NodeInfo) -> list[bytes]:
        """The durable keys ``node`` holds (durable keys are few next to the index)."""
        holds, node_id = self.index.holds, node.node_id
        return [key for key in self.durable if holds(key, node_id)]

    def _unpin(self, lease: Lease) -> None:
        pins = self.pins
        for pin in lease.pins:
            left = pins[pin] - 1
            if left:
                pins[pin] = left
            else:
                del pins[pin]

    def _reserve(self, key: bytes, nbytes: int, node: NodeInfo, now: float, durable: int = 0) -> int:
        rid = self._new_id()
        self.reservations[rid] = Reservation(key, nbytes, node.node_id, now + self.config.reservation_timeout_s,
                                             durable)
        node.reserved_bytes += nbytes
        self.counters["reservations"] += 1
        self.counters["bytes_reserved"] += nbytes
        return rid

    def _release_reservation(self, res: Reservation) -> NodeInfo | None:
        node = self.nodes.get(res.node_id)
        if node is not None:
            node.reserved_bytes -= res.nbytes
        return node

    # -- timers ------------------------------------------------------------------

    def sweep(self, now: float | None = None) -> None:
        """Declare silent nodes dead, reclaim stale reservations, end expired leases."""
        now = self.clock() if now is None else now
        for node in list(self.nodes.values()):
            if node.alive and now - node.last_seen > self.dead_after_s:
                self._declare_dead(node, now)
            elif not node.alive and now - node.died_at > self.config.forget_nodes_after_s:
                del self.nodes[node.node_id]
                self._swrr.pop(node.node_id, None)
                self.index.forget_node(node.node_id)
                self._journal(["forget", node.node_id])
        reservations = self.reservations
        while reservations:
            rid, res = next(iter(reservations.items()))
            if res.deadline > now:
                break
            del reservations[rid]
            self._release_reservation(res)
            self.counters["reservations_expired"] += 1
        leases = self.leases
        while leases:
            lid, lease = next(iter(leases.items()))
            if lease.deadline > now:
                break
            del leases[lid]
            self._unpin(lease)
            self.counters["leases_expired"] += 1

    def _takeover_filled_in(self) -> None:
        """Once every live node has published again what a warm takeover may have missed, the
        term's index is whole: nodes joining later need not, and a standby's takeover from
        this copy asks only for its own gap."""
        waiting = [n for n in self.nodes.values() if n.alive and n.term_seen != self.term]
        if not waiting:
            log.info("term %d: every node published again what the takeover may have missed", self.term)
            self.resend_from = None

    def _retire(self, node: NodeInfo, now: float, state: str) -> tuple[int, int]:
        """Take a dead or departed node out of service; returns (replicas, reservations) dropped."""
        node.alive = False
        if self.resend_from is not None:
            self._takeover_filled_in()
        node.state = state
        node.died_at = now
        held = self._durable_held_by(node)
        dropped = self._drop_replicas_of(node)
        stale = [rid for rid, res in self.reservations.items() if res.node_id == node.node_id]
        for rid in stale:
            del self.reservations[rid]
        node.reserved_bytes = node.committed_since_beat = 0
        self._swrr.pop(node.node_id, None)
        self._check_durable(held)
        self._journal(["retire", node.node_id, state])
        return dropped, len(stale)

    def note_turn(self, now: float, expected_s: float) -> None:
        """One turn of the serving loop ended at ``now``; a turn normally lasts at most
        ``expected_s`` (the idle receive timeout). Anything longer (a large request, a slow
        sweep retiring a big node, a garbage collection) is a stall: see :meth:`note_busy`.
        """
        last, self._last_turn = self._last_turn, now
        if last is not None:
            self.note_busy(last + expected_s, now)

    def note_busy(self, started: float, ended: float) -> None:
        """The serving thread was busy from ``started`` to ``ended`` (clock() times).

        Heartbeats that arrived meanwhile are still queued unread, so a long stall
        must not count against the nodes: every alive node's silence is shortened
        by the stall (its deadline moves out by that much). Stalls shorter than
        STALL_CREDIT_MIN_S are ignored (they are far below a heartbeat period).
        A node that really died during the stall is declared dead that much later.
        """
        stall = ended - started
        if stall < STALL_CREDIT_MIN_S:
            return
        for node in self.nodes.values():
            if node.alive:
                node.last_seen = min(ended, node.last_seen + stall)

    def _declare_dead(self, node: NodeInfo, now: float) -> None:
        self._plan_rescue(node)  # (before its replicas leave the index)
        dropped, stale = self._retire(node, now, "dead")
        self.counters["nodes_dead"] += 1
        log.warning(
            "node %s missed %d heartbeats: declared dead; %d replicas and %d reservations dropped",
            node.label, self.config.dead_after_missed, dropped, stale,
        )

    def _plan_rescue(self, node: NodeInfo) -> None:
        """A client that asked for a hand-off (``node.hand_off_s``) and died without one: its
        objects in its shared-memory arena outlive it until another process on the host clears
        the dead arena away, so a storage node on that host is asked to read them out of it and
        keep them (``adopt_many``; checked against these header checksums, every layer against
        its header). The storage node with the most cxl capacity is chosen; none: nothing."""
        if not node.hand_off or node.role != P.ROLE_CLIENT:
            return
        targets = [n for n in self.nodes.values()
                   if n.alive and n.role == P.ROLE_STORAGE and n.host_id == node.host_id and n.control]
        if not targets:
            return
        def rank(n: NodeInfo) -> tuple[int, int]:
            return (int(n.tiers.get("cxl", {}).get("capacity", 0)), sum(int(t.get("capacity", 0))
                                                                           for t in n.tiers.values()))
        target = max(targets, key=rank)
        items = [(key, list(record.spec), record.header_sum)
                 for key, record in self.index.records_of(node.node_id, "cxl") if record.header_sum is not None]
        if items:
            self.rescues.append(RescueTask(node.node_id, node.address, target.node_id, target.label, target.control,
                                           items))
            self.counters["rescues_planned"] += 1

    # -- durability ---------------------------------------------------------------------

    def _check_durable(self, keys: Iterable[bytes]) -> None:
        """Queue the durable ones among ``keys``: their copies may now be short."""
        durable, check = self.durable, self.to_check
        for key in keys:
            if key in durable and key not in check:
                check[key] = 0.0

    def _note_durable(self, key: bytes, record: Replica) -> None:
        replicas, record.durable = record.durable, None
        if replicas:
            self.durable[key] = replicas

    def _eligible(self, exclude: set[str] | frozenset[str]) -> list[NodeInfo]:
        """Nodes that may receive a durable copy: alive storage nodes with a persistent tier."""
        return [n for n in self.nodes.values() if n.alive and n.stores_durably and n.node_id not in exclude]

    def _choose(self, nbytes: int, replicas: int, candidates: list[NodeInfo]) -> list[NodeInfo]:
        """Up to ``replicas`` distinct nodes among ``candidates`` (all large enough), by free room."""
        roomy = [n for n in candidates if n.durable_free_bytes >= nbytes]
        if roomy and len(roomy) >= min(replicas, len(candidates)):
            pool, weight = roomy, (lambda n: n.durable_free_bytes)
        else:  # too few have room: the chosen will evict; weigh by capacity
            pool, weight = candidates, (lambda n: n.persistent_capacity_bytes)
        chosen: list[NodeInfo] = []
        hosts: set[str] = set()
        for _ in range(min(replicas, len(pool))):
            remaining = [n for n in pool if n not in chosen]
            group = [n for n in remaining if n.host_id not in hosts] or remaining
            pick = self._swrr_pick(group, weight)
            chosen.append(pick)
            hosts.add(pick.host_id)
        return chosen

    def _swrr_pick(self, group: list[NodeInfo], weight: Callable[[NodeInfo], int]) -> NodeInfo:
        """Smooth weighted round robin (nginx): deterministic, proportional, interleaved."""
        current = self._swrr
        total = 0
        best: NodeInfo | None = None
        for node in group:
            w = max(weight(node), 1)
            total += w
            current[node.node_id] = current.get(node.node_id, 0) + w
            if best is None or current[node.node_id] > current[best.node_id]:
                best = node
        assert best is not None
        current[best.node_id] -= total
        return best

    def plan_rereplication(self, now: float, limit: int) -> tuple[list[RereplicationTask], int, int]:
        """Up to ``limit`` copies that restore durable keys' replica counts, reserved on their
        targets; returns (tasks, keys lost: no live holder, keys waiting for a target).

        Examines at most REREPLICATE_EXAMINE_PER_ROUND queued keys, so it never holds the
        serving thread for long whatever the backlog.
        """
        tasks: list[RereplicationTask] = []
        lost = waiting = 0
        check, nodes = self.to_check, self.nodes
        for key in list(islice(check, REREPLICATE_EXAMINE_PER_ROUND)):
            if len(tasks) >= limit:
                break
            not_before = check[key]
            wanted = self.durable.get(key)
            if not wanted:
                del check[key]
                continue
            if not_before > now:
                check.move_to_end(key)
                continue
            replicas = self.index.get(key)
            if not replicas:
                # No live holder to copy from: it comes back when a node registers it again.
                del check[key]
                self._attempts.pop(key, None)
                lost += 1
                continue
            in_flight = self.rereplicating.setdefault(key, set())
            holders = [nid for nid in replicas if nodes[nid].stores_durably]
            need = wanted - len(holders) - len(in_flight)
            if need <= 0:
                del check[key]  # a copy in flight queues the key again when it ends
                if not in_flight:
                    del self.rereplicating[key]
                continue
            sources = [nid for nid in holders if "header_sum" in replicas[nid]] or \
                [nid for nid in replicas if "header_sum" in replicas[nid]]
            if not sources:  # records without a header checksum cannot be verified by a copier
                del check[key]
                if not in_flight:
                    del self.rereplicating[key]
                lost += 1
                continue
            source_id = random.choice(sources)
            record = replicas[source_id]
            nbytes = record["nbytes"]
            exclude = set(replicas) | in_flight
            candidates = [n for n in self._eligible(exclude)
                          if n.control and n.largest_persistent_tier_bytes >= nbytes]
            targets = self._choose(nbytes, min(need, limit - len(tasks)), candidates)
            if not targets:
                waiting += 1
                check[key] = now + REREPLICATE_BACKOFF_S[1] / 10
                check.move_to_end(key)
                if not in_flight:
                    del self.rereplicating[key]
                continue
            source_address = nodes[source_id].address
            for target in targets:
                rid = self._reserve(key, nbytes, target, now, durable=wanted)
                in_flight.add(target.node_id)
                tasks.append(RereplicationTask(
                    key, record.spec, record["header_sum"], nbytes, wanted, source_id, source_address,
                    target.node_id, target.label, target.control, rid,
                ))
            if len(targets) < need:  # the rest next round (rate limit) or once a target turns up
                if len(targets) < len(candidates):
                    check[key] = now
                else:
                    waiting += 1
                    check[key] = now + REREPLICATE_BACKOFF_S[1] / 10
                check.move_to_end(key)
            else:
                del check[key]
        self.counters["rereplications_started"] += len(tasks)
        return tasks, lost, waiting

    def finish_rereplication(self, task: RereplicationTask, error: str | None, now: float) -> None:
        """A copy ended: ``error`` None means the target committed it."""
        in_flight = self.rereplicating.get(task.key)
        if in_flight is not None:
            in_flight.discard(task.target_id)
            if not in_flight:
                del self.rereplicating[task.key]
        delay = 0.0
        if error is None:
            self.counters["rereplications_done"] += 1
            self._attempts.pop(task.key, None)
        else:
            self.counters["rereplications_failed"] += 1
            res = self.reservations.pop(task.reservation, None)
            if res is not None:
                self._release_reservation(res)
            if task.key in self.durable:
                attempts = self._attempts[task.key] = self._attempts.get(task.key, 0) + 1
                low, high = REREPLICATE_BACKOFF_S
                delay = min(high, low * 2 ** (attempts - 1))
        if task.key in self.durable:  # look again: more copies may be short, or this one failed
            self.to_check[task.key] = max(self.to_check.get(task.key, 0.0), now + delay)
