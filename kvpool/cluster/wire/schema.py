"""The typed schema of the control plane: every request and reply body of the master, and
every request of a node's control socket, as msgspec structs.

The wire stays msgpack maps with these field names (:mod:`kvpool.cluster.wire.protocol` has the
framing and the table of operations); a struct decodes straight from the frame, in C, and
anything that does not fit — a missing field, a wrong type, a negative size — is refused
with the path of the offending field before a handler runs. Limits that are settings
(``master.max_batch``, ``pool.max_key_bytes``, ``master.max_address_bytes``) are the
handlers' to check; the fixed ones are checked here. Unknown fields are ignored, so a newer
peer may add optional fields without a version bump.

A located replica in a ``locate`` reply stays a plain map: the node that asked checks each one
on its own where it reads the answer (:func:`kvpool.cluster.node.located.located_replicas`), so
one bad record from a wrong or hostile master costs that replica, not the whole answer.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvpool import errors

MAX_ID_BYTES = 256
MAX_CONTROL_BYTES = 1024
MAX_TIER_NAME_BYTES = 64
MAX_TIERS = 64
MAX_LOCATION_ENTRIES = 32
MAX_SPEC_FIELDS = 8

ROLE_STORAGE = "storage"  # kvpool-server --role node|all: may receive durable copies
ROLE_CLIENT = "client"    # an inference process (kvpool.connect): never receives durable copies


class Body(msgspec.Struct, omit_defaults=True):
    """A message body: a msgpack map of these fields (unknown ones ignored)."""


def _bounded(name: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise errors.RequestTooLargeError(f"{name} is {len(value)} characters; the most is {limit}")


def _non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


# -- shared parts ------------------------------------------------------------------------


class TierState(Body):
    capacity: int
    free: int

    def __post_init__(self) -> None:
        if self.capacity < 0 or not 0 <= self.free <= self.capacity:
            raise ValueError(f"need ints 0 <= free <= capacity, got free={self.free} capacity={self.capacity}")


def check_tiers(tiers: dict[str, TierState]) -> None:
    if len(tiers) > MAX_TIERS:
        raise errors.RequestTooLargeError(f"{len(tiers)} tiers; the most is {MAX_TIERS}")
    for name in tiers:
        if len(name) > MAX_TIER_NAME_BYTES:
            raise ValueError(f"tier names must be str of at most {MAX_TIER_NAME_BYTES} characters")


class Record(Body):
    """One replica as its node describes it (``key`` only in register/publish lists)."""

    tier: str
    spec: list[int | str]  # ObjectSpec.to_wire()
    nbytes: int            # whole object, header included
    key: bytes | None = None
    header_sum: int | None = None  # the replica's ObjectHeader.checksum(): readers check the holder's header
    location: dict[str, Any] = {}  # opaque to the master (e.g. cxl path + offset)
    durable: int | None = None     # a durable copy: replicas wanted for this key (storage nodes only)

    def __post_init__(self) -> None:
        _non_negative("nbytes", self.nbytes)
        if len(self.tier) > MAX_TIER_NAME_BYTES:
            raise ValueError(f"tier names must be str of at most {MAX_TIER_NAME_BYTES} characters")
        if len(self.spec) > MAX_SPEC_FIELDS:
            raise ValueError(f"spec has {len(self.spec)} fields; an object spec has at most {MAX_SPEC_FIELDS}")
        if self.header_sum is not None and not 0 <= self.header_sum < 1 << 64:
            raise ValueError(f"header_sum must be a u64 (the header's checksum), got {self.header_sum}")
        if self.durable is not None and self.durable < 1:
            raise ValueError(f"durable must be an int >= 1 (replicas wanted), got {self.durable}")
        location = self.location
        if location and (len(location) > MAX_LOCATION_ENTRIES or any(
                isinstance(v, (str, bytes, list, dict)) and len(v) > MAX_CONTROL_BYTES for v in location.values())):
            raise errors.RequestTooLargeError(
                f"record location: at most {MAX_LOCATION_ENTRIES} entries of at most {MAX_CONTROL_BYTES} each")


# -- master requests -----------------------------------------------------------------------


class Ping(Body):
    pass


class Register(Body):
    node_id: str
    address: str
    host_id: str
    tiers: dict[str, TierState]
    objects: list[Record] = []
    role: str = ROLE_CLIENT
    persistent_tiers: list[str] = []
    control: str | None = None  # the node's control socket; taken from a JSON ``address`` when absent
    # a client whose objects a storage node on its host should keep when it goes (node.hand_off_s):
    # at a clean exit it hands them off itself; declared dead, the master has them rescued
    hand_off: bool = False

    def __post_init__(self) -> None:
        _bounded("node_id", self.node_id, MAX_ID_BYTES)
        _bounded("host_id", self.host_id, MAX_ID_BYTES)
        if self.control is not None:
            _bounded("control", self.control, MAX_CONTROL_BYTES)
        if not self.node_id:
            raise ValueError("node_id must not be empty")
        if self.role not in (ROLE_STORAGE, ROLE_CLIENT):
            raise ValueError(f"role must be {ROLE_STORAGE!r} or {ROLE_CLIENT!r}, got {self.role!r:.40}")
        if len(self.persistent_tiers) > MAX_TIERS:
            raise errors.RequestTooLargeError(f"{len(self.persistent_tiers)} persistent tiers; the most is {MAX_TIERS}")
        check_tiers(self.tiers)


class Leave(Body):
    node_id: str


class Heartbeat(Body):
    node_id: str
    tiers: dict[str, TierState] | None = None
    delete_ack: int = 0
    term: int = 0  # the last master term whose takeover gap this node filled in (HeartbeatReply.resend_s)

    def __post_init__(self) -> None:
        if self.tiers is not None:
            check_tiers(self.tiers)


class Keys(Body):  # lookup, exists
    keys: list[bytes]
    # lookup only: also say whether the first and the last leading hit each have a replica near
    # the asker (LookupReply.near): held by one of ``near_nodes``, or in a cxl arena (read in
    # place) of a node on host ``near_host``. Booleans about keys, as every question's answer.
    near_nodes: Annotated[list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=64)] = []
    near_host: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class Locate(Body):
    keys: list[bytes]
    lease: bool = True


class Release(Body):
    leases: list[int]


class ReserveItem(Body):
    key: bytes
    nbytes: int
    node_id: str

    def __post_init__(self) -> None:
        _non_negative("nbytes", self.nbytes)


class Reserve(Body):
    items: list[ReserveItem]


class CommitItem(Body):
    reservation: int
    replica: Record


class Commit(Body):
    items: list[CommitItem]


class Revoke(Body):
    reservations: list[int]


class Publish(Body):
    node_id: str
    objects: list[Record]


class NodeKeys(Body):  # evict_request, removed
    node_id: str
    keys: list[bytes]


class Delete(Body):
    keys: list[bytes]
    node_id: str = ""  # the caller's node, which drops its own copies itself


class PlaceItem(Body):
    key: bytes
    nbytes: int

    def __post_init__(self) -> None:
        _non_negative("nbytes", self.nbytes)


class Place(Body):
    nbytes: int
    replicas: int = 1
    exclude: list[str] = []
    key: bytes | None = None  # with a key: reserved as durable copies of it
    # A batch: durable copies of every item on the same ``replicas`` nodes, one reservation
    # each (``nbytes``: the batch's total); replies with ``reservations`` per target.
    items: list[PlaceItem] = []

    def __post_init__(self) -> None:
        _non_negative("nbytes", self.nbytes)


class Stats(Body):
    pass


class Follow(Body):
    """A standby asking the leader for its changes after ``since`` in ``stream``, or for
    ``part`` of ``snapshot`` (kvpool.cluster.master.follow)."""

    stream: str = ""
    since: int = 0
    snapshot: int = 0
    part: int = 0
    follower: str = ""  # the standby's endpoint (shown in the leader's stats)

    def __post_init__(self) -> None:
        _bounded("stream", self.stream, MAX_ID_BYTES)
        _bounded("follower", self.follower, MAX_CONTROL_BYTES)
        _non_negative("since", self.since)
        _non_negative("part", self.part)


class ListKeys(Body):
    prefix: bytes = b""
    limit: int = 1000

    def __post_init__(self) -> None:
        _non_negative("limit", self.limit)


# -- master replies ------------------------------------------------------------------------


class PingReply(Body):
    version: int
    uptime_s: float
    query_port: int = 0  # the master's query port (kvpool.cluster.wire.query); 0: none


class RegisterReply(Body):
    heartbeat_ms: int
    dead_after_missed: int
    lease_s: float
    indexed: int
    skipped_deleted: int = 0
    term: int = 0  # with master.etcd: the master term this register is part of


class LeaveReply(Body):
    withdrawn: int
    known: bool


class HeartbeatReply(Body):
    reregister: bool      # the master does not know this node: register again with everything held
    delete: list[bytes]   # keys other clients deleted; drop them, the next beat acknowledges
    delete_seq: int       # acknowledge with this in the next heartbeat's delete_ack
    # With master.etcd: the cluster's term this master leads, and how many seconds back a node
    # must publish again what it changed (the tail of the last leader's changes that a warm
    # takeover may not have followed). 0 / 0.0 from a master without etcd, or an older one.
    term: int = 0
    resend_s: float = 0.0


class LookupReply(Body):
    prefix: int
    near: list[bool] | None = None  # asked for (Keys.near_nodes / near_host) and prefix > 0


class ExistsReply(Body):
    exists: list[bool]


class LocateReply(Body):
    replicas: list[list[dict[str, Any]] | None]  # per key; None on a miss; each replica checked by located_replicas
    lease: int | None = None                     # pins every replica returned until released/expired


class ReleaseReply(Body):
    released: int


class ReserveReply(Body):
    reservations: list[int]


class CommitReply(Body):
    committed: list[bool]


class RevokeReply(Body):
    revoked: int


class PublishReply(Body):
    indexed: int


class EvictReply(Body):
    allowed: list[bytes]  # drop now: already gone from the index, no reader holds them
    pinned: list[bytes]   # a reader holds a lease: keep them and ask again later
    reregister: bool


class RemovedReply(Body):
    removed: int


class DeleteReply(Body):
    deleted: list[bool]


class Target(Body):
    node_id: str
    address: str
    host_id: str
    reservation: int | None = None
    reservations: list[int] = []  # a batch's: one per item, in order


class PlaceReply(Body):
    targets: list[Target]


class ListReply(Body):
    keys: list[dict[str, Any]]  # {"key", "nbytes", "spec", "replicas": [{"node_id", "tier"}]}
    truncated: bool


# -- node control ----------------------------------------------------------------------------


class Replicate(Body):
    """Pull ``key`` from ``source`` (a node address) into a persistent tier, check it against
    ``spec`` and ``header_sum``, and commit ``reservation`` before answering."""

    key: bytes
    spec: list[int | str]
    header_sum: int
    source: str
    reservation: int | None = None
    replicas: int = 1
    persistent: bool = False  # into the persistent tier (every durable copy says so)
    token: bytes = b""  # pull token the holder accepts for this key

    def __post_init__(self) -> None:
        if not 0 <= self.header_sum < 1 << 64:
            raise ValueError(f"header_sum must be a u64, got {self.header_sum}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")


class ReplicateItem(Body):
    """One object of :class:`ReplicateMany`."""

    key: bytes
    spec: list[int | str]
    header_sum: int
    reservation: int
    token: bytes = b""

    def __post_init__(self) -> None:
        if not 0 <= self.header_sum < 1 << 64:
            raise ValueError(f"header_sum must be a u64, got {self.header_sum}")


class AdoptItem(Body):
    """One object of :class:`AdoptMany`."""

    key: bytes
    spec: list[int | str]
    header_sum: int
    token: bytes = b""

    def __post_init__(self) -> None:
        if not 0 <= self.header_sum < 1 << 64:
            raise ValueError(f"header_sum must be a u64, got {self.header_sum}")


class AdoptMany(Body):
    """A departing node's hand-off to a storage node on its host: pull every object from
    ``source`` that this node does not hold yet, verify it, keep it (evictable, a shared-memory
    tier first) and publish it as this node's own, in one master round trip."""

    items: list[AdoptItem]
    source: str
    # the master's rescue of a client declared dead: its arena is read though no process owns it
    # any more, and what is not there is not pulled (nobody serves it)
    rescue: bool = False


class ReplicateMany(Body):
    """:class:`Replicate` of a batch from one ``source``: every object pulled together, each
    verified and stored, their reservations committed in one master round trip."""

    items: list[ReplicateItem]
    source: str
    replicas: int = 1
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
