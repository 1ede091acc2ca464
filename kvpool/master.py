"""The metadata master: node registry, key index, reservations, leases, placement.

Owns, in memory, which node holds which key in which tier (with the object's
spec, its header's checksum and an opaque location), the node registry and its liveness,
two-phase put reservations, read leases, delete/evict coordination and
placement of durable puts. It serves these over one ZeroMQ ROUTER socket with
the protocol of :mod:`kvpool.protocol`, from one thread, and never sees KV
bytes. It does not own storage (nodes do) or persistence: after a restart the
state is rebuilt by nodes re-registering everything they hold (heartbeat
replies to an unknown node say ``reregister``).

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

import argparse
import json
import logging
import os
import queue
import random
import re
import secrets
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any

import zmq

from kvpool import errors
from kvpool import protocol as P
from kvpool.config import Config, MasterSection, add_setting_flags, apply_setting_flags
from kvpool.etcd import Election, EtcdClient, check_address_for_etcd
from kvpool.master_client import control_call
from kvpool.objformat import ObjectSpec
from kvpool.security import ClusterKey, stop_authenticator

log = logging.getLogger("kvpool.master")

# Deletes sent to one node per heartbeat reply; the rest follow on later beats
# so a heartbeat stays a small message.
MAX_DELETES_PER_BEAT = 4096
# Re-replication: keys examined per planning round (bounds the work done between
# requests), copies in flight at once, worker threads, and retry backoff.
REREPLICATE_EXAMINE_PER_ROUND = 4096
REREPLICATE_MAX_IN_FLIGHT = 16
REREPLICATE_WORKERS = 2
REREPLICATE_BACKOFF_S = (0.5, 30.0)
# Bounds on request fields (besides master.max_batch / max_address_bytes / max_request_bytes
# and pool.max_key_bytes): node and host ids, control addresses, tier names and counts,
# the parts of a replica record. A longer one is RequestTooLargeError.
MAX_ID_BYTES = 256
MAX_CONTROL_BYTES = 1024
MAX_TIER_NAME_BYTES = 64
MAX_TIERS = 64
MAX_LOCATION_ENTRIES = 32
# A request that kept the serving thread longer than this pauses liveness for that long
# (see MasterState.note_busy): nodes are not declared dead because the master was busy.
STALL_CREDIT_MIN_S = 0.02

COUNTERS = (
    "requests", "protocol_errors", "errors",
    "lookups", "lookup_hashes", "lookup_hits",
    "key_hits", "key_misses",
    "leases_granted", "leases_released", "leases_expired",
    "reservations", "bytes_reserved", "commits", "bytes_committed", "commits_failed",
    "revokes", "reservations_expired", "published",
    "deletes", "evictions_allowed", "evictions_refused", "removed",
    "registers", "heartbeats", "nodes_dead", "nodes_left", "placements",
    "rereplications_started", "rereplications_done", "rereplications_failed",
)

_ENDPOINT_RE = re.compile(r"^[a-z]+://(.+:[0-9]+)")


def describe_address(address: str) -> tuple[str, str]:
    """(``host:port``, control socket) of a node's published address, for logs and re-replication.

    A node's address is opaque to the master except for these two: a JSON
    object with ``ucx: [host, port]`` and ``control`` (kvpool nodes) or a
    ``scheme://host:port`` string. Never log the address itself: it carries a
    base64 UCX worker blob.
    """
    try:
        data = json.loads(address)
        host, port = data["ucx"]
        control = data.get("control")
        return f"{host}:{int(port)}", control if isinstance(control, str) else ""
    except (ValueError, KeyError, TypeError):
        pass
    m = _ENDPOINT_RE.match(address)
    return (m.group(1) if m else "?"), ""


@dataclass(slots=True)
class NodeInfo:
    node_id: str
    address: str
    host_id: str
    tiers: dict[str, dict[str, int]]
    last_seen: float
    alive: bool = True
    died_at: float = 0.0
    objects: set[bytes] = field(default_factory=set)
    reserved_bytes: int = 0        # reserved, neither committed nor revoked yet
    committed_since_beat: int = 0  # not yet reflected in the free bytes the node reported
    # key -> seq of the heartbeat reply that last carried it (0: not sent yet)
    pending_deletes: dict[bytes, int] = field(default_factory=dict)
    delete_seq: int = 0
    role: str = P.ROLE_CLIENT
    persistent_tiers: tuple[str, ...] = ()
    control: str = ""       # the node's control socket (replicate, stats)
    endpoint: str = "?"     # host:port, for log lines
    state: str = "alive"    # alive | dead | left

    @property
    def label(self) -> str:
        """How log lines name a node: 8 characters of its id and host:port, never the address blob."""
        return f"{self.node_id[:8]} ({self.endpoint})"

    @property
    def stores_durably(self) -> bool:
        """May receive durable copies: a storage node with a persistent tier that has capacity."""
        return self.role == P.ROLE_STORAGE and self.persistent_capacity_bytes > 0

    @property
    def persistent_capacity_bytes(self) -> int:
        return sum(self.tiers[t]["capacity"] for t in self.persistent_tiers if t in self.tiers)

    @property
    def largest_persistent_tier_bytes(self) -> int:
        return max((self.tiers[t]["capacity"] for t in self.persistent_tiers if t in self.tiers), default=0)

    @property
    def durable_free_bytes(self) -> int:
        free = sum(self.tiers[t]["free"] for t in self.persistent_tiers if t in self.tiers)
        return free - self.reserved_bytes - self.committed_since_beat

    @property
    def free_bytes(self) -> int:
        return sum(t["free"] for t in self.tiers.values())

    @property
    def capacity_bytes(self) -> int:
        return sum(t["capacity"] for t in self.tiers.values())

    @property
    def largest_tier_bytes(self) -> int:
        return max((t["capacity"] for t in self.tiers.values()), default=0)

    @property
    def effective_free_bytes(self) -> int:
        return self.free_bytes - self.reserved_bytes - self.committed_since_beat


@dataclass(slots=True)
class Reservation:
    key: bytes
    nbytes: int
    node_id: str
    deadline: float
    durable: int = 0  # a durable copy: committing it makes the key durable with this many replicas


@dataclass(slots=True)
class RereplicationTask:
    """One copy the master asks ``target`` to make by pulling from ``source``."""

    key: bytes
    spec: Any          # ObjectSpec.to_wire() of the source replica
    header_sum: int    # its header's checksum: the copier checks the header the source sends
    nbytes: int
    replicas: int
    source_id: str
    source_address: str
    target_id: str
    target_label: str
    target_control: str
    reservation: int


@dataclass(slots=True)
class Lease:
    pins: list[tuple[bytes, str]]
    deadline: float


_MISSING: Any = object()


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    try:
        value = body[name]
    except KeyError:
        if default is _MISSING:
            raise P.MalformedRequest(f"missing field {name!r}") from None
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise P.MalformedRequest(f"field {name!r} has type {type(value).__name__}")
    return value


class Replica:
    """One replica record as the master keeps it. A million keys are a million of these, so a
    record is a slotted object with its spec, tier and node id shared, not a dict; it reads like
    the wire record (``record["nbytes"]``, ``"header_sum" in record``, ``{**record}``). Of the
    object's header only its 8-byte checksum is kept (the holder sends the header with each
    pull and the reader checks it against this): a 32-layer header is 384 bytes, which at a
    million keys was half the master's memory."""

    __slots__ = ("tier", "spec", "nbytes", "header_sum", "location", "durable", "node_id")
    _SPECS: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # equal specs share one tuple (bounded)
    _NBYTES: dict[int, int] = {}  # and equal sizes one int

    def __init__(self, tier: str, spec: Any, nbytes: int, header_sum: int | None,
                 location: dict[str, Any] | None, durable: int | None) -> None:
        spec = tuple(spec) if isinstance(spec, (list, tuple)) else spec
        if isinstance(spec, tuple):
            shared = Replica._SPECS.get(spec)
            if shared is None and len(Replica._SPECS) < 4096:
                shared = Replica._SPECS[spec] = spec
            spec = shared or spec
        self.tier = sys.intern(tier)
        self.spec = spec
        shared_nbytes = Replica._NBYTES.get(nbytes)  # a handful of object sizes: one int each
        if shared_nbytes is None and len(Replica._NBYTES) < 4096:
            shared_nbytes = Replica._NBYTES[nbytes] = nbytes
        self.nbytes = nbytes if shared_nbytes is None else shared_nbytes
        self.header_sum = header_sum
        self.location = location or None
        self.durable = durable
        self.node_id: str | None = None

    def keys(self) -> list[str]:
        return [name for name in self.__slots__ if name == "location" or getattr(self, name) is not None]

    def __getitem__(self, name: str) -> Any:
        if name == "location":
            return dict(self.location or {})
        value = getattr(self, name, None) if name in self.__slots__ else None
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return name in self.__slots__ and (name == "location" or getattr(self, str(name)) is not None)

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default


class Holders:
    """The replicas of one key by node id: a dict's interface, a fraction of its memory. Almost
    every key has one or two replicas, so they are kept as one Replica or a tuple of them (each
    knows its node id) instead of a dict per key (184 bytes each here)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: Replica | tuple[Replica, ...] = ()

    def _all(self) -> tuple[Replica, ...]:
        held = self._held
        return (held,) if isinstance(held, Replica) else held

    def get(self, node_id: str, default: Any = None) -> Any:
        for replica in self._all():
            if replica.node_id == node_id:
                return replica
        return default

    def __getitem__(self, node_id: str) -> Replica:
        replica = self.get(node_id)
        if replica is None:
            raise KeyError(node_id)
        return replica

    def __contains__(self, node_id: object) -> bool:
        return any(replica.node_id == node_id for replica in self._all())

    def __setitem__(self, node_id: str, replica: Replica) -> None:
        replica.node_id = node_id
        rest = tuple(r for r in self._all() if r.node_id != node_id)
        self._held = replica if not rest else (*rest, replica)

    def pop(self, node_id: str, default: Any = None) -> Any:
        held = self._all()
        found = next((r for r in held if r.node_id == node_id), None)
        if found is None:
            return default
        rest = tuple(r for r in held if r is not found)
        self._held = rest[0] if len(rest) == 1 else rest
        return found

    def __len__(self) -> int:
        return len(self._all())

    def __bool__(self) -> bool:
        return bool(self._held)

    def __iter__(self) -> Iterator[str]:
        return (replica.node_id for replica in self._all())  # type: ignore[misc]

    def values(self) -> tuple[Replica, ...]:
        return self._all()

    def items(self) -> list[tuple[str, Replica]]:
        return [(replica.node_id, replica) for replica in self._all()]  # type: ignore[misc]


class MasterState:
    """All master state and every operation on it; no sockets, no threads.

    Each ``op_*`` validates its whole body before changing anything, so a bad
    request never leaves half an update behind.
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
        self.index: dict[bytes, Holders] = {}  # key -> node_id -> record
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
        self.durable: dict[bytes, int] = {}
        self.to_check: OrderedDict[bytes, float] = OrderedDict()
        self.rereplicating: dict[bytes, set[str]] = {}
        self._attempts: dict[bytes, int] = {}
        self._last_turn: float | None = None  # see note_turn
        #: mints the pull token every located replica carries (MasterServer sets it; None: no tokens)
        self.cluster_key: ClusterKey | None = None
        #: with master.etcd: {"etcd", "prefix", "term", "endpoint"} of this leader's term (shown in stats)
        self.ha: dict[str, Any] | None = None
        self.handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            P.PING: self.op_ping, P.REGISTER: self.op_register, P.LEAVE: self.op_leave,
            P.HEARTBEAT: self.op_heartbeat,
            P.LOOKUP: self.op_lookup, P.EXISTS: self.op_exists, P.LOCATE: self.op_locate,
            P.RELEASE: self.op_release, P.RESERVE: self.op_reserve, P.COMMIT: self.op_commit,
            P.REVOKE: self.op_revoke, P.PUBLISH: self.op_publish,
            P.EVICT_REQUEST: self.op_evict_request, P.REMOVED: self.op_removed,
            P.DELETE: self.op_delete, P.PLACE: self.op_place, P.STATS: self.op_stats,
            P.LIST: self.op_list,
        }

    # -- helpers ----------------------------------------------------------------

    def _new_id(self) -> int:
        self._id_count += 1
        return self._id_prefix | self._id_count

    def _keys(self, body: Mapping[str, Any], name: str = "keys", *, strict: bool = True) -> list[bytes]:
        """The list of keys in ``body[name]``; InvalidKeyError names the first bad one.

        Reads pass ``strict=False``: only the type is checked, since a key of an
        impossible length can only miss. map() over builtins keeps the checks
        in C, so a 1000-hash lookup does not spend its time validating.
        """
        keys = self._batch(body, name)
        if keys and (set(map(type, keys)) != {bytes} or strict and (
                not 0 < min(map(len, keys)) or max(map(len, keys)) > self.max_key_bytes)):
            for key in keys:
                self._key(key)
        return keys

    def _batch(self, body: Mapping[str, Any], name: str, default: Any = _MISSING) -> list[Any]:
        """The list ``body[name]``, at most ``master.max_batch`` long (RequestTooLargeError)."""
        items = _field(body, name, list, default)
        if len(items) > self.config.max_batch:
            raise errors.RequestTooLargeError(
                f"{name}: {len(items)} items in one request; the most is master.max_batch = "
                f"{self.config.max_batch} (MasterClient splits larger batches)")
        return items

    @staticmethod
    def _bounded_str(body: Mapping[str, Any], name: str, limit: int, default: Any = _MISSING) -> str:
        value = _field(body, name, str, default)
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
    def _tiers(raw: Any) -> dict[str, dict[str, int]]:
        if not isinstance(raw, dict):
            raise P.MalformedRequest("tiers must be a map {name: {capacity, free}}")
        if len(raw) > MAX_TIERS:
            raise errors.RequestTooLargeError(f"{len(raw)} tiers; the most is {MAX_TIERS}")
        tiers: dict[str, dict[str, int]] = {}
        for name, state in raw.items():
            if not isinstance(name, str) or len(name) > MAX_TIER_NAME_BYTES:
                raise P.MalformedRequest(f"tier names must be str of at most {MAX_TIER_NAME_BYTES} characters")
            if not isinstance(state, dict):
                raise P.MalformedRequest(f"tier {name!r} must be a map {{capacity, free}}")
            capacity, free = state.get("capacity"), state.get("free")
            if type(capacity) is not int or type(free) is not int or capacity < 0 or not 0 <= free <= capacity:
                raise P.MalformedRequest(f"tier {name!r}: need ints 0 <= free <= capacity, got {state!r:.100}")
            tiers[str(name)] = {"capacity": capacity, "free": free}
        return tiers

    def _record(self, raw: Any, *, with_key: bool) -> tuple[bytes, Replica]:
        """Validate one replica record; returns (key or b"", the record as stored)."""
        if not isinstance(raw, dict):
            raise P.MalformedRequest(f"replica record must be a map, got {type(raw).__name__}")
        key = self._key(raw.get("key")) if with_key else b""
        tier, nbytes = raw.get("tier"), raw.get("nbytes")
        spec: Any = raw.get("spec")
        if type(tier) is not str or type(nbytes) is not int or nbytes < 0 or len(tier) > MAX_TIER_NAME_BYTES:
            raise P.MalformedRequest(f"replica record needs tier (str) and nbytes (int >= 0): {raw!r:.200}")
        try:  # each spec is validated once (re-registering a million keys is a handful of specs)
            seen = tuple(spec) if type(spec) is list and len(spec) <= 8 else None
            if seen is None or seen not in self._specs_checked:  # TypeError: unhashable parts
                ObjectSpec.from_wire(spec)
                if seen is not None and len(self._specs_checked) < 4096:
                    self._specs_checked.add(seen)
        except (TypeError, ValueError, errors.KVPoolError) as exc:
            raise P.MalformedRequest(f"replica record has a bad spec {spec!r:.100}: {exc}") from None
        # A node that lies about its header checksum only fails its own readers' checks.
        header_sum = raw.get("header_sum")
        if header_sum is not None and (type(header_sum) is not int or not 0 <= header_sum < 1 << 64):
            raise P.MalformedRequest(f"header_sum must be a u64 (the header's checksum), got {header_sum!r:.40}")
        location = raw.get("location") or {}
        if not isinstance(location, dict):
            raise P.MalformedRequest("location must be a map")
        if location and (len(location) > MAX_LOCATION_ENTRIES or any(
                isinstance(v, (str, bytes, list, dict)) and len(v) > MAX_CONTROL_BYTES for v in location.values())):
            raise errors.RequestTooLargeError(
                f"record location: at most {MAX_LOCATION_ENTRIES} entries of at most {MAX_CONTROL_BYTES} each")
        durable = raw.get("durable")
        if durable is not None and (type(durable) is not int or durable < 1):
            raise P.MalformedRequest(f"durable must be an int >= 1 (replicas wanted), got {durable!r:.40}")
        return key, Replica(tier, spec, nbytes, header_sum, location, durable)

    def _alive_node(self, node_id: Any) -> NodeInfo:
        node = self.nodes.get(node_id) if isinstance(node_id, str) else None
        if node is None or not node.alive:
            raise errors.UnknownNodeError(f"node {node_id!r} is not registered or was declared dead")
        return node

    def _add_replica(self, node: NodeInfo, key: bytes, record: Replica) -> bool:
        """Index ``record`` for ``key`` on ``node``; True if the node did not hold it before."""
        record.node_id = node.node_id  # the node's own string: one per node, not one per record
        replicas = self.index.get(key)
        if replicas is None:
            replicas = self.index[key] = Holders()
        new = node.node_id not in replicas
        replicas[node.node_id] = record
        node.objects.add(key)
        # A new copy supersedes a delete the node has not carried out yet.
        node.pending_deletes.pop(key, None)
        return new

    def _remove_replica(self, node: NodeInfo, key: bytes) -> bool:
        node.objects.discard(key)
        replicas = self.index.get(key)
        if replicas is None or replicas.pop(node.node_id, None) is None:
            return False
        if not replicas:
            del self.index[key]
        return True

    def _drop_replicas_of(self, node: NodeInfo) -> int:
        index, node_id = self.index, node.node_id
        for key in node.objects:
            replicas = index.get(key)
            if replicas is not None:
                replicas.pop(node_id, None)
                if not replicas:
                    del index[key]
        dropped = len(node.objects)
        node.objects = set()
        return dropped

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

    def _retire(self, node: NodeInfo, now: float, state: str) -> tuple[int, int]:
        """Take a dead or departed node out of service; returns (replicas, reservations) dropped."""
        node.alive = False
        node.state = state
        node.died_at = now
        held = list(node.objects)
        dropped = self._drop_replicas_of(node)
        stale = [rid for rid, res in self.reservations.items() if res.node_id == node.node_id]
        for rid in stale:
            del self.reservations[rid]
        node.reserved_bytes = node.committed_since_beat = 0
        self._swrr.pop(node.node_id, None)
        self._check_durable(held)
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
        dropped, stale = self._retire(node, now, "dead")
        self.counters["nodes_dead"] += 1
        log.warning(
            "node %s missed %d heartbeats: declared dead; %d replicas and %d reservations dropped",
            node.label, self.config.dead_after_missed, dropped, stale,
        )

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

    # -- operations -----------------------------------------------------------------

    def handle(self, op: str, body: dict[str, Any]) -> Any:
        self.counters["requests"] += 1
        return self.handlers[op](body)

    def op_ping(self, body: dict[str, Any]) -> Any:
        return {"version": P.PROTOCOL_VERSION, "uptime_s": self.clock() - self.started}

    def op_register(self, body: dict[str, Any]) -> Any:
        node_id = self._bounded_str(body, "node_id", MAX_ID_BYTES)
        address = self._bounded_str(body, "address", self.config.max_address_bytes)
        host_id = self._bounded_str(body, "host_id", MAX_ID_BYTES)
        tiers = self._tiers(_field(body, "tiers", dict))
        raw_objects = self._batch(body, "objects", [])
        role = _field(body, "role", str, P.ROLE_CLIENT)
        persistent = _field(body, "persistent_tiers", list, [])
        if len(persistent) > MAX_TIERS:
            raise errors.RequestTooLargeError(f"{len(persistent)} persistent tiers; the most is {MAX_TIERS}")
        if not node_id:
            raise P.MalformedRequest("node_id must not be empty")
        if role not in (P.ROLE_STORAGE, P.ROLE_CLIENT):
            raise P.MalformedRequest(f"role must be {P.ROLE_STORAGE!r} or {P.ROLE_CLIENT!r}, got {role!r:.40}")
        if not all(isinstance(t, str) for t in persistent):
            raise P.MalformedRequest("persistent_tiers must be a list of tier names")
        endpoint, control = describe_address(address)
        control = self._bounded_str(body, "control", MAX_CONTROL_BYTES, control)
        records = [self._record(raw, with_key=True) for raw in raw_objects]
        now = self.clock()
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeInfo(node_id, address, host_id, tiers, now)
            previously: list[bytes] = []
        else:
            # The list is authoritative: forget what we believed the node held.
            previously = list(node.objects)
            self._drop_replicas_of(node)
            node.address, node.host_id, node.tiers = address, host_id, tiers
            node.last_seen, node.alive, node.committed_since_beat = now, True, 0
        node.role, node.persistent_tiers, node.control = role, tuple(persistent), control
        node.endpoint, node.state = endpoint, "alive"
        skipped = 0
        for key, record in records:
            if key in node.pending_deletes:  # deleted by a client while the node was away
                skipped += 1
                continue
            self._note_durable(key, record)
            self._add_replica(node, key, record)
        # Keys this node lost, and keys it brings back (maybe the only copy left of a
        # durable key whose other holders died), may need copies.
        self._check_durable(previously)
        self._check_durable(node.objects)
        if node.stores_durably and node.control:
            # A new target: keys waiting for one are looked at in the next round.
            check = self.to_check
            for key, not_before in check.items():
                if not_before > now:
                    check[key] = now
        self.counters["registers"] += 1
        if role == P.ROLE_CLIENT:
            kind = "inference client"
        elif node.stores_durably:
            kind = f"storage node, durable copies in {'+'.join(node.persistent_tiers)}"
        else:
            kind = "storage node without a persistent tier (takes no durable copies)"
        log.info(
            "node %s registered: %s, host=%.64s, %d objects (%d skipped: deleted meanwhile)",
            node.label, kind, host_id, len(records) - skipped, skipped,
        )
        return {
            "heartbeat_ms": self.config.heartbeat_ms,
            "dead_after_missed": self.config.dead_after_missed,
            "lease_s": self.config.lease_s,
            "indexed": len(records) - skipped,
            "skipped_deleted": skipped,
        }

    def op_leave(self, body: dict[str, Any]) -> Any:
        """A clean departure: the node's replicas leave the index now; it is listed as ``left``."""
        node = self.nodes.get(_field(body, "node_id", str))
        if node is None or not node.alive:
            return {"withdrawn": 0, "known": node is not None}
        dropped, stale = self._retire(node, self.clock(), "left")
        self.counters["nodes_left"] += 1
        log.info("node %s left: %d replicas withdrawn, %d reservations dropped", node.label, dropped, stale)
        return {"withdrawn": dropped, "known": True}

    def op_heartbeat(self, body: dict[str, Any]) -> Any:
        node_id = _field(body, "node_id", str)
        raw_tiers = _field(body, "tiers", dict, None)
        ack = _field(body, "delete_ack", int, 0)
        tiers = None if raw_tiers is None else self._tiers(raw_tiers)
        self.counters["heartbeats"] += 1
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            return {"reregister": True, "delete": [], "delete_seq": 0}
        node.last_seen = self.clock()
        if tiers is not None:
            node.tiers = tiers
            node.committed_since_beat = 0
        pending = node.pending_deletes
        if not pending:
            return {"reregister": False, "delete": [], "delete_seq": node.delete_seq}
        if ack:
            for key in [k for k, seq in pending.items() if 0 < seq <= ack]:
                del pending[key]
        # Pinned replicas stay until their lease ends; unacknowledged ones are
        # sent again (the reply carrying them may have been lost).
        sendable = [k for k in pending if (k, node_id) not in self.pins][:MAX_DELETES_PER_BEAT]
        if sendable:
            node.delete_seq += 1
            for key in sendable:
                pending[key] = node.delete_seq
        return {"reregister": False, "delete": sendable, "delete_seq": node.delete_seq}

    def op_lookup(self, body: dict[str, Any]) -> Any:
        keys = self._keys(body, strict=False)
        present = list(map(self.index.__contains__, keys))
        prefix = present.index(False) if False in present else len(present)
        c = self.counters
        c["lookups"] += 1
        c["lookup_hashes"] += len(keys)
        c["lookup_hits"] += prefix
        return {"prefix": prefix}

    def op_exists(self, body: dict[str, Any]) -> Any:
        keys = self._keys(body, strict=False)
        found = list(map(self.index.__contains__, keys))
        hits = sum(found)
        self.counters["key_hits"] += hits
        self.counters["key_misses"] += len(found) - hits
        return {"exists": found}

    def op_locate(self, body: dict[str, Any]) -> Any:
        keys = self._keys(body, strict=False)
        want_lease = _field(body, "lease", bool, True)
        index, nodes = self.index, self.nodes
        mint = self.cluster_key.mint_token if self.cluster_key is not None and self.cluster_key.enabled else None
        out: list[list[dict[str, Any]] | None] = []
        pins: list[tuple[bytes, str]] = []
        for key in keys:
            replicas = index.get(key)
            if not replicas:
                out.append(None)
                continue
            located = []
            for node_id, record in replicas.items():
                node = nodes[node_id]
                token = mint(key, node_id) if mint is not None else b""
                located.append({**record, "address": node.address, "host_id": node.host_id, "token": token})
                pins.append((key, node_id))
            out.append(located)
        hits = len(keys) - out.count(None)
        self.counters["key_hits"] += hits
        self.counters["key_misses"] += len(keys) - hits
        lease_id = None
        if want_lease and pins:
            lease_id = self._new_id()
            self.leases[lease_id] = Lease(pins, self.clock() + self.config.lease_s)
            table = self.pins
            for pin in pins:
                table[pin] = table.get(pin, 0) + 1
            self.counters["leases_granted"] += 1
        return {"replicas": out, "lease": lease_id}

    def op_release(self, body: dict[str, Any]) -> Any:
        lease_ids = self._batch(body, "leases")
        released = 0
        for lid in lease_ids:
            lease = self.leases.pop(lid, None) if type(lid) is int else None
            if lease is not None:
                self._unpin(lease)
                released += 1
        self.counters["leases_released"] += released
        return {"released": released}

    def op_reserve(self, body: dict[str, Any]) -> Any:
        items = self._batch(body, "items")
        checked = []
        for item in items:
            if not isinstance(item, dict):
                raise P.MalformedRequest("reserve items must be maps {key, nbytes, node_id}")
            key = self._key(item.get("key"))
            nbytes = _field(item, "nbytes", int)
            if nbytes < 0:
                raise P.MalformedRequest("nbytes must be >= 0")
            checked.append((key, nbytes, self._alive_node(item.get("node_id"))))
        now = self.clock()
        return {"reservations": [self._reserve(key, nbytes, node, now) for key, nbytes, node in checked]}

    def op_commit(self, body: dict[str, Any]) -> Any:
        items = self._batch(body, "items")
        checked = []
        for item in items:
            if not isinstance(item, dict):
                raise P.MalformedRequest("commit items must be maps {reservation, replica}")
            rid = _field(item, "reservation", int)
            _, record = self._record(_field(item, "replica", dict), with_key=False)
            checked.append((rid, record))
        committed = []
        for rid, record in checked:
            res = self.reservations.pop(rid, None)
            node = None if res is None else self._release_reservation(res)
            if res is None or node is None or not node.alive:
                committed.append(False)
                self.counters["commits_failed"] += 1
                continue
            node.committed_since_beat += record["nbytes"]
            self._note_durable(res.key, record)
            if res.durable:
                self.durable[res.key] = res.durable
            self._add_replica(node, res.key, record)
            committed.append(True)
            self.counters["commits"] += 1
            self.counters["bytes_committed"] += record["nbytes"]
        return {"committed": committed}

    def op_revoke(self, body: dict[str, Any]) -> Any:
        revoked = 0
        for rid in self._batch(body, "reservations"):
            res = self.reservations.pop(rid, None) if type(rid) is int else None
            if res is not None:
                self._release_reservation(res)
                revoked += 1
        self.counters["revokes"] += revoked
        return {"revoked": revoked}

    def op_publish(self, body: dict[str, Any]) -> Any:
        node = self._alive_node(_field(body, "node_id", str))
        records = [self._record(raw, with_key=True) for raw in self._batch(body, "objects")]
        # A node sending what it holds is alive: one that re-registers a large index in many
        # batches is never declared dead between them for want of a heartbeat.
        node.last_seen = max(node.last_seen, self.clock())
        for key, record in records:
            self._note_durable(key, record)
            if self._add_replica(node, key, record):
                node.committed_since_beat += record["nbytes"]
        self.counters["published"] += len(records)
        return {"indexed": len(records)}

    def op_evict_request(self, body: dict[str, Any]) -> Any:
        node_id = _field(body, "node_id", str)
        keys = self._keys(body)
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            # Nothing of this node is indexed, so nothing can be pointed at.
            return {"allowed": keys, "pinned": [], "reregister": True}
        allowed, pinned = [], []
        pins = self.pins
        for key in keys:
            if (key, node_id) in pins:
                pinned.append(key)
            else:
                self._remove_replica(node, key)
                node.pending_deletes.pop(key, None)
                allowed.append(key)
        self._check_durable(allowed)
        self.counters["evictions_allowed"] += len(allowed)
        self.counters["evictions_refused"] += len(pinned)
        return {"allowed": allowed, "pinned": pinned, "reregister": False}

    def op_removed(self, body: dict[str, Any]) -> Any:
        node_id = _field(body, "node_id", str)
        keys = self._keys(body)
        node = self.nodes.get(node_id)
        if node is None:
            return {"removed": 0}
        removed = 0
        for key in keys:
            removed += self._remove_replica(node, key)
            node.pending_deletes.pop(key, None)
        self._check_durable(keys)
        self.counters["removed"] += removed
        return {"removed": removed}

    def op_delete(self, body: dict[str, Any]) -> Any:
        keys = self._keys(body)
        caller = _field(body, "node_id", str, "")  # drops its own copies itself, at once
        nodes = self.nodes
        deleted = []
        for key in keys:
            replicas = self.index.pop(key, None)
            deleted.append(replicas is not None)
            self.durable.pop(key, None)
            self.to_check.pop(key, None)
            self._attempts.pop(key, None)
            for node_id in replicas or ():
                node = nodes[node_id]
                node.objects.discard(key)
                if node_id != caller:
                    node.pending_deletes[key] = 0
        self.counters["deletes"] += sum(deleted)
        return {"deleted": deleted}

    def op_place(self, body: dict[str, Any]) -> Any:
        nbytes = _field(body, "nbytes", int)
        replicas = _field(body, "replicas", int, 1)
        exclude = set(self._batch(body, "exclude", []))
        raw_key = _field(body, "key", (bytes, type(None)), None)
        key = None if raw_key is None else self._key(raw_key)
        if nbytes < 0:
            raise P.MalformedRequest("place needs nbytes >= 0")
        if replicas < 1:
            raise errors.InvalidArgumentError(f"replicas must be >= 1, got {replicas}")
        eligible = self._eligible(exclude)
        if replicas > len(eligible):
            others = sum(1 for n in self.nodes.values() if n.alive and n.node_id not in exclude) - len(eligible)
            raise errors.NotEnoughReplicasError(
                f"{replicas} durable replicas asked for, but only {len(eligible)} storage nodes with a "
                f"persistent tier are alive and eligible ({len(exclude)} excluded; {others} other alive "
                f"nodes are inference clients or have no nvme tier and never take durable copies)"
            )
        candidates = [n for n in eligible if n.largest_persistent_tier_bytes >= nbytes]
        if not candidates:
            raise errors.ObjectTooLargeError(
                f"{nbytes} bytes is larger than the persistent tier of every one of the "
                f"{len(eligible)} eligible storage nodes"
            )
        if replicas > len(candidates):
            raise errors.NotEnoughReplicasError(
                f"{replicas} durable replicas asked for, but the object ({nbytes} bytes) fits the persistent "
                f"tier of only {len(candidates)} of the {len(eligible)} eligible storage nodes"
            )
        chosen = self._choose(nbytes, replicas, candidates)
        now = self.clock()
        self.counters["placements"] += 1
        return {"targets": [
            {
                "node_id": n.node_id, "address": n.address, "host_id": n.host_id,
                "reservation": None if key is None else self._reserve(key, nbytes, n, now, durable=replicas),
            }
            for n in chosen
        ]}

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

    def op_list(self, body: dict[str, Any]) -> Any:
        """Keys starting with ``prefix`` (operators' ``kvpool ls``), at most ``limit``."""
        prefix = _field(body, "prefix", bytes, b"")
        limit = _field(body, "limit", int, 1000)
        if limit < 0:
            raise P.MalformedRequest("field 'limit' must be >= 0")
        limit = min(limit, self.config.max_batch)  # a reply stays as bounded as a request
        out: list[dict[str, Any]] = []
        for key, replicas in self.index.items():
            if not key.startswith(prefix):
                continue
            if len(out) == limit:
                return {"keys": out, "truncated": True}
            first = next(iter(replicas.values()))
            out.append({"key": key, "nbytes": first.get("nbytes", 0), "spec": first.get("spec"),
                        "replicas": [{"node_id": nid, "tier": r.get("tier")} for nid, r in replicas.items()]})
        return {"keys": out, "truncated": False}

    def op_stats(self, body: dict[str, Any]) -> Any:
        now = self.clock()
        return {
            "protocol_version": P.PROTOCOL_VERSION,
            "uptime_s": now - self.started,
            "nodes": {
                n.node_id: {
                    "alive": n.alive, "state": n.state, "role": n.role, "endpoint": n.endpoint,
                    "persistent_tiers": list(n.persistent_tiers), "stores_durably": n.stores_durably,
                    "address": n.address, "host_id": n.host_id,
                    "tiers": n.tiers, "objects": len(n.objects),
                    "reserved_bytes": n.reserved_bytes,
                    "effective_free_bytes": n.effective_free_bytes,
                    "pending_deletes": len(n.pending_deletes),
                    "last_seen_s": now - n.last_seen,
                }
                for n in self.nodes.values()
            },
            "keys": len(self.index),
            "replicas": sum(len(r) for r in self.index.values()),
            "reservations": len(self.reservations),
            "leases": len(self.leases),
            "pinned_replicas": len(self.pins),
            "durable_keys": len(self.durable),
            "under_replicated": len(self.to_check) + len(self.rereplicating),
            "rereplications_in_flight": sum(len(t) for t in self.rereplicating.values()),
            "counters": dict(self.counters),
            "ha": self.ha,
        }


_ADDRESS_BLOB_RE = re.compile(r"'?\{\"ucx\".*?\}'?\}?'?")


def loggable(message: str, limit: int = 300) -> str:
    """``message`` without node address blobs (JSON with a base64 worker address), at most ``limit`` chars."""
    message = _ADDRESS_BLOB_RE.sub("<node address>", message)
    return message if len(message) <= limit else message[:limit - 3] + "..."


class Rereplicator:
    """Restores durable keys' copy counts without ever blocking the master's request loop.

    :meth:`round` runs on the serving thread (it alone touches :class:`MasterState`):
    it applies finished copies, then plans new ones within the rate limit (a token
    bucket of ``rereplicate_per_s``) and hands them to worker threads, which only
    talk to the targets' control sockets (each a socket of its own) and report back
    through a queue. The target commits its copy to the master itself before it
    answers, over the master's normal request path.
    """

    def __init__(self, state: MasterState, context: zmq.Context, config: MasterSection,
                 cluster_key: ClusterKey | None = None) -> None:
        self.state = state
        self.cluster_key = cluster_key or ClusterKey.default()
        self.rate = config.rereplicate_per_s
        self.timeout_s = config.rereplicate_timeout_s
        self._context = context
        self._tokens = max(1.0, self.rate)
        self._burst = max(1.0, self.rate)
        self._refilled = state.clock()
        self._todo: queue.SimpleQueue[RereplicationTask | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[RereplicationTask, str | None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.in_flight = 0
        # Targets no longer alive, so a worker waiting on one gives up (replaced, never mutated).
        self._gone: frozenset[str] = frozenset()

    def round(self, now: float) -> None:
        state = self.state
        done = failed = 0
        last_error = ""
        while True:
            try:
                task, error = self._done.get_nowait()
            except queue.Empty:
                break
            self.in_flight -= 1
            state.finish_rereplication(task, error, now)
            if error is None:
                done += 1
            else:
                failed += 1
                last_error = f"{task.key.hex()[:16]} -> {task.target_label}: {loggable(error)}"
        if self.in_flight:
            self._gone = frozenset(nid for nid, n in state.nodes.items() if not n.alive)
        started: list[RereplicationTask] = []
        lost = waiting = 0
        # Just after a (re)start, nodes are still re-registering what they hold: copies
        # counted short now may only be unregistered yet.
        settled = now - state.started >= state.dead_after_s
        if self.rate > 0 and state.to_check and settled:
            self._tokens = min(self._burst, self._tokens + (now - self._refilled) * self.rate)
            self._refilled = now
            limit = min(int(self._tokens), REREPLICATE_MAX_IN_FLIGHT - self.in_flight)
            if limit > 0:
                started, lost, waiting = state.plan_rereplication(now, limit)
        else:
            self._refilled = now
        for task in started:
            self._start_workers()
            self._tokens -= 1
            self.in_flight += 1
            self._todo.put(task)
        if started or done or failed or lost:
            log.info(
                "re-replication: %d copies started, %d done, %d failed%s; %d keys without a live holder, "
                "%d waiting for a storage node; %d under-replicated, %d copies in flight",
                len(started), done, failed, f" (last: {last_error})" if last_error else "", lost, waiting,
                len(state.to_check) + len(state.rereplicating), self.in_flight,
            )

    def _start_workers(self) -> None:
        while len(self._threads) < REREPLICATE_WORKERS:
            thread = threading.Thread(target=self._work, name=f"kvpool-rereplicate-{len(self._threads)}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                task = self._todo.get(timeout=0.2)
            except queue.Empty:
                continue
            if task is None:
                return
            error: str | None = None
            try:
                control_call(task.target_control, "replicate", {
                    "key": task.key, "spec": list(task.spec), "header_sum": task.header_sum,
                    "source": task.source_address,
                    "reservation": task.reservation, "replicas": task.replicas, "persistent": True,
                    "token": self.cluster_key.mint_token(task.key, task.source_id),
                }, self.timeout_s, self._context, self.cluster_key, check=partial(self._check_task, task))
            except Exception as exc:  # reported on the serving thread; retried with backoff
                error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, errors.KVPoolError) else str(exc)
            self._done.put((task, error))

    def _check_task(self, task: Any) -> None:
        """While a copy waits: give up when the master stops or the target is gone."""
        if self._stop.is_set():
            raise errors.KVTimeoutError("replicate: the master is stopping")
        if task.target_id in self._gone:
            raise errors.UnknownNodeError("replicate: the target left or was declared dead")

    def close(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._todo.put(None)
        for thread in self._threads:
            thread.join(2.0)


class MasterServer:
    """The ROUTER socket and the single thread that serves :class:`MasterState`."""

    election: Election | None = None  # with master.etcd: this master serves only while it leads

    def __init__(self, config: MasterSection, *, max_key_bytes: int = 256,
                 cluster_key: ClusterKey | None = None) -> None:
        # Only holders of the cluster key (default: the default key file) get an answer.
        self.cluster_key = cluster_key or ClusterKey.default()
        self.config = config
        self.max_key_bytes = max_key_bytes
        self._context = zmq.Context(io_threads=1)
        self._context.setsockopt(zmq.LINGER, 0)
        self.state, self.rereplicator = self._fresh_state()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.cluster_key.secure_server(self._socket)
        # A larger message is dropped by ZeroMQ before it is read (the peer is disconnected).
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_request_bytes)
        try:
            self._socket.bind(config.listen)
        except zmq.ZMQError as exc:
            self.close()
            raise errors.ConfigError(f"master.listen = {config.listen!r}: cannot bind: {exc}") from None
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # With master.etcd this master serves only while it leads (see kvpool.etcd); a
        # standby answers every request with NotLeaderError naming the leader.
        self._term = 0
        if config.etcd:
            try:
                check_address_for_etcd(self.endpoint)
            except errors.ConfigError:
                self.close()
                raise
            self.election = Election(EtcdClient(config.etcd), config.etcd_prefix, self.endpoint,
                                     config.leader_ttl_s).start()
        # Timers (dead nodes, reservation and lease expiry) run at least this
        # often; between requests the socket poll blocks for at most this long.
        heartbeat_s = config.heartbeat_ms / 1000
        self.tick_s = max(0.01, min(0.25, heartbeat_s / 2))

    def _fresh_state(self) -> tuple[MasterState, Rereplicator]:
        state = MasterState(self.config, max_key_bytes=self.max_key_bytes)
        state.cluster_key = self.cluster_key
        return state, Rereplicator(state, self._context, self.config, self.cluster_key)

    def leading(self) -> bool:
        """Serve requests now? Always without etcd; with it, only while this master's term lasts
        (a new term starts from an empty index, rebuilt by the nodes' re-registration)."""
        election = self.election
        if election is None:
            return True
        if election.term != self._term:
            self._term = election.term
            self.rereplicator.close()
            self.state, self.rereplicator = self._fresh_state()
            self.state.ha = {"etcd": election.client.urls, "prefix": election.prefix, "term": self._term,
                             "endpoint": self.endpoint}
            log.info("serving as master leader, term %d: nodes re-register what they hold", self._term)
        return election.leading()

    def serve(self, stop_event: threading.Event) -> None:
        sock, tick_s = self._socket, self.tick_s
        # A blocking recv with a timeout is one call per request when busy (a
        # poll and a failing non-blocking recv would be three) and wakes up at
        # least every tick when idle, so timers and stop_event are noticed.
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(tick_s * 1000)))
        next_sweep = time.monotonic() + tick_s
        while not stop_event.is_set():
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                pass
            else:
                try:
                    sock.send_multipart(self.serve_frames(frames), zmq.NOBLOCK)
                except zmq.Again:  # that peer's queue is full: it will time out and retry
                    pass
            now = time.monotonic()
            state = self.state
            # A turn longer than the receive timeout (a large request, a slow sweep, a GC
            # pause) is time the nodes' heartbeats spent queued: not held against them.
            state.note_turn(now, tick_s)
            if now >= next_sweep and self.leading():
                state.sweep(now)
                self.rereplicator.round(now)
                next_sweep = now + tick_s

    def serve_frames(self, frames: list[bytes]) -> list[bytes]:
        """One routed request in, one routed reply out (errors become typed replies)."""
        # REQ peers put an empty delimiter after their identity; DEALER peers need not.
        split = 2 if len(frames) >= 3 and frames[1] == b"" else 1
        envelope, payload = frames[:split], frames[split:]
        request_id: Any = None
        op = "?"
        try:
            if len(payload) != 1:
                raise P.MalformedRequest(f"expected one message frame after the envelope, got {len(payload)}")
            request = P.unpack_request(payload[0])
            request_id, op = request.request_id, request.op
            if not self.leading():
                leader = self.election.leader if self.election is not None else None
                raise errors.NotLeaderError(
                    f"master {self.endpoint} is a standby; the leader is {leader or '(being elected)'}")
            reply = P.pack_reply(request_id, self.state.handle(op, request.body))
        except P.MalformedRequest as exc:
            self.state.counters["protocol_errors"] += 1
            rid = exc.request_id if exc.request_id is not None else request_id
            reply = P.pack_error(rid, "ProtocolError", str(exc))
        except errors.KVPoolError as exc:
            self.state.counters["errors"] += 1
            reply = P.pack_error(request_id, type(exc).__name__, str(exc.args[0]) if exc.args else "")
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            # A body shaped wrong in a way the validators did not name.
            self.state.counters["protocol_errors"] += 1
            reply = P.pack_error(request_id, "ProtocolError",
                                 f"malformed {op} body: {type(exc).__name__}: {loggable(str(exc))}")
        except Exception as exc:  # keep serving: one bad request must not take the master down
            log.exception("internal error serving %s", op)
            self.state.counters["errors"] += 1
            reply = P.pack_error(request_id, "KVPoolError", f"internal master error in {op}: {loggable(repr(exc))}")
        return [*envelope, reply]

    def close(self) -> None:
        if self.election is not None:
            self.election.stop()  # the lease is revoked: a standby takes over at once
        self.rereplicator.close()
        self._socket.close(linger=0)
        stop_authenticator(self._context)  # its ZAP thread holds a socket of this context
        # destroy(): closes whatever socket is still open (a worker that did not stop in
        # time) instead of waiting for it forever, as term() would.
        self._context.destroy(linger=0)


def _sections(config: Config | MasterSection | str | os.PathLike[str] | None) -> tuple[MasterSection, int]:
    if isinstance(config, MasterSection):
        return config, Config().pool.max_key_bytes
    full = Config.load(config)
    return full.master, full.pool.max_key_bytes


def run_master(
    config: Config | MasterSection | str | os.PathLike[str] | None = None,
    stop_event: threading.Event | None = None,
    *,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until ``stop_event`` is set (or SIGTERM/SIGINT when none is given).

    Signal handlers are only installed when no ``stop_event`` is passed and this
    runs on the main thread; a daemon that owns signals passes its own event.
    ``on_ready`` gets the bound endpoint once requests are being accepted.
    Raises ConfigError when the listen address cannot be bound.
    """
    section, max_key_bytes = _sections(config)
    stop = stop_event if stop_event is not None else threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if stop_event is None and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: stop.set())
    cluster_key = ClusterKey.default() if isinstance(config, MasterSection) else ClusterKey.from_config(
        Config.load(config))
    server = MasterServer(section, max_key_bytes=max_key_bytes, cluster_key=cluster_key)
    try:
        (log.info if cluster_key.enabled else log.warning)(
            "kvpool master authenticates with %s", cluster_key.describe())
        log.info(
            "kvpool master listening on %s (protocol v%d, heartbeat %d ms x %d, lease %.1f s)%s",
            server.endpoint, P.PROTOCOL_VERSION, section.heartbeat_ms,
            section.dead_after_missed, section.lease_s,
            f"; campaigning for leadership in etcd at {section.etcd} ({section.etcd_prefix})"
            if section.etcd else "",
        )
        if on_ready is not None:
            on_ready(server.endpoint)
        server.serve(stop)
    finally:
        server.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        log.info("kvpool master on %s stopped", server.endpoint)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.master", description="kvpool metadata master")
    parser.add_argument("--listen", help="ZeroMQ address to bind (overrides master.listen)")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--log-level", default="INFO")
    add_setting_flags(parser)
    args = parser.parse_args(None if argv is None else list(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = Config.load(args.config)
        apply_setting_flags(config, args)
        if args.listen:
            config.set("master.listen", args.listen)
        run_master(config)
    except errors.ConfigError as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
