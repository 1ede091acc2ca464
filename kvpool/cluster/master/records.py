"""The master's records: nodes, replicas (and the compact per-key holder map), reservations,
leases, re-replication tasks, request-field checks and the limits they enforce.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpool.cluster.wire import protocol as P

# Deletes sent to one node per heartbeat reply; the rest follow on later beats
# so a heartbeat stays a small message.
MAX_DELETES_PER_BEAT = 4096
# Re-replication: keys examined per planning round (bounds the work done between
# requests), copies in flight at once, worker threads, and retry backoff.
REREPLICATE_EXAMINE_PER_ROUND = 4096
REREPLICATE_MAX_IN_FLIGHT = 16
REREPLICATE_WORKERS = 2
REREPLICATE_BACKOFF_S = (0.5, 30.0)
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
    "rescues_planned", "rescues_done", "rescues_failed", "rescued_objects",
)

_ENDPOINT_RE = re.compile(r"^[a-z]+://(.+:[0-9]+)")


def describe_address(address: str) -> tuple[str, str]:
    """(``host:port``, ``host tcp:PORT`` or ``host``; control socket) of a node's published address,
    for logs and re-replication.

    A node's address is opaque to the master except for these two: a JSON
    object with ``ucx: [host, port]`` and ``control`` (kvpool nodes) or a
    ``scheme://host:port`` string. Never log the address itself: it carries a
    base64 UCX worker blob.
    """
    try:
        data = json.loads(address)
        host, port = data["ucx"]
        control = data.get("control")
        tcp = data.get("tcp")
        # UCX port 0: no listener (peers use the worker address); the TCP pull port, if any, is real.
        where = (f"{host}:{int(port)}" if int(port) else
                 f"{host} tcp:{int(tcp)}" if isinstance(tcp, int) and not isinstance(tcp, bool) and tcp > 0 else
                 str(host))
        return where, control if isinstance(control, str) else ""
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
    term_seen: int = 0      # the last master term whose takeover gap this node filled in (or registered in)
    hand_off: bool = False  # a client whose shared-memory objects a storage node on its host keeps once it died

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


def node_wire(node: NodeInfo) -> dict[str, Any]:
    """What a standby needs of a node (kvpool.cluster.master.follow): msgpack-able."""
    return {"node_id": node.node_id, "address": node.address, "host_id": node.host_id, "tiers": node.tiers,
            "alive": node.alive, "state": node.state, "role": node.role,
            "persistent_tiers": list(node.persistent_tiers), "control": node.control, "endpoint": node.endpoint,
            "hand_off": node.hand_off}


def node_from_wire(wire: dict[str, Any], now: float) -> NodeInfo:
    node = NodeInfo(wire["node_id"], wire["address"], wire["host_id"], wire["tiers"], now)
    node.alive, node.state, node.role = wire["alive"], wire["state"], wire["role"]
    node.hand_off = bool(wire.get("hand_off", False))
    node.persistent_tiers, node.control, node.endpoint = tuple(wire["persistent_tiers"]), wire["control"], \
        wire["endpoint"]
    if not node.alive:
        node.died_at = now
    return node


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
class RescueTask:
    """The shared-memory objects of a client that died (one that asked for a hand-off), for a
    storage node on its host to read out of the dead client's arena and keep."""

    source_id: str
    source_address: str
    target_id: str
    target_label: str
    target_control: str
    items: list[tuple[bytes, Any, int]]  # (key, ObjectSpec.to_wire(), header checksum)


@dataclass(slots=True)
class Lease:
    pins: list[tuple[bytes, str]]
    deadline: float


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
    knows its node id) instead of a dict per key (a one-entry dict takes 184 bytes of its own on
    CPython 3.11, more than the slotted Replica it would hold)."""

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
        replica: Replica | None = self.get(node_id)
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




_ADDRESS_BLOB_RE = re.compile(r"'?\{\"ucx\".*?\}'?\}?'?")


def loggable(message: str, limit: int = 300) -> str:
    """``message`` without node address blobs (JSON with a base64 worker address), at most ``limit`` chars."""
    message = _ADDRESS_BLOB_RE.sub("<node address>", message)
    return message if len(message) <= limit else message[:limit - 3] + "..."
