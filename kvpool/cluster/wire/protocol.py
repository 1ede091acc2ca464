"""The master's and the node control socket's wire protocol: versioned msgpack messages
over ZeroMQ, with the bodies typed by :mod:`kvpool.cluster.wire.schema`.

Owns the framing, the list of operations, the shape of every request and reply
body, and the mapping of error replies to :mod:`kvpool.errors` classes. It does
not own sockets (:mod:`kvpool.cluster.master.server`, :mod:`kvpool.cluster.wire.master_client`) or any
state.

Framing. A client (DEALER) sends one frame; the master (ROUTER) sees the
routing identity first, optionally an empty delimiter (REQ sockets add one; it
is echoed back), then that frame::

    request = msgpack([version, request_id, op, body])
    reply   = msgpack([version, request_id, "ok",    body])
            | msgpack([version, request_id, "error", {"type": str, "message": str}])

``request_id`` is any int or str the client chooses; the reply echoes it, so a
client that gave up on a request can recognise and drop its late reply. An
error ``type`` is the name of a :mod:`kvpool.errors` class (``ProtocolError``
for anything unparseable, an unknown version or op, or a malformed body).
msgpack is packed with ``use_bin_type``: keys (prefix hashes) are ``bytes``,
names are ``str``.

Bodies (every batch is one message, whatever its size) are msgpack maps; their typed
schema — the authority on every field, type and fixed limit — is :mod:`kvpool.cluster.wire.schema`,
and :data:`SCHEMA` maps each op to its request and reply struct. A request decodes straight
into its struct (a body that does not fit is ProtocolError, naming the field); a client
decodes each reply into its op's reply struct the same way::

    ping            {}                                   -> {"version", "uptime_s"}
    register        {"node_id", "address", "host_id", "tiers", "objects": [record],
                     "role": "storage" | "client", "persistent_tiers": [tier name], "control": str}
                                                         -> {"heartbeat_ms", "dead_after_missed",
                                                             "lease_s", "indexed", "skipped_deleted"}
    leave           {"node_id"}                          -> {"withdrawn": int, "known": bool}
    heartbeat       {"node_id", "tiers", "delete_ack": int}
                                                         -> {"reregister": bool, "delete": [key],
                                                             "delete_seq": int}
    lookup          {"keys": [key]}                      -> {"prefix": int}
    exists          {"keys": [key]}                      -> {"exists": [bool]}
    locate          {"keys": [key], "lease": bool}       -> {"replicas": [[located] | None], "lease": id | None}
    release         {"leases": [id]}                     -> {"released": int}
    reserve         {"items": [{"key", "nbytes", "node_id"}]}      -> {"reservations": [id]}
    commit          {"items": [{"reservation": id, "replica": record}]} -> {"committed": [bool]}
    revoke          {"reservations": [id]}               -> {"revoked": int}
    publish         {"node_id", "objects": [record]}     -> {"indexed": int}
    evict_request   {"node_id", "keys": [key]}           -> {"allowed": [key], "pinned": [key], "reregister": bool}
    removed         {"node_id", "keys": [key]}           -> {"removed": int}
    delete          {"keys": [key], "node_id"?}          -> {"deleted": [bool]}
                    (node_id: the caller's node, which drops its own copies itself)
    place           {"nbytes", "replicas", "exclude": [node_id], "key": key | None,
                     "items"?: [{"key", "nbytes"}]}
                    (only storage nodes with a persistent tier are eligible; more replicas
                    than eligible nodes -> NotEnoughReplicasError, nothing reserved; with
                    ``items``, a batch: the same nodes hold every item, ``nbytes`` is the total)
                                                         -> {"targets": [{"node_id", "address", "host_id",
                                                                          "reservation": id | None,
                                                                          "reservations"?: [id]}]}
    stats           {}                                   -> {"nodes", "keys", "replicas", "counters", ...}
    list            {"prefix": bytes, "limit": int}      -> {"keys": [{"key", "nbytes", "spec", "replicas":
                                                             [{"node_id", "tier"}]}], "truncated": bool}

``tiers`` is ``{tier name: {"capacity": bytes, "free": bytes}}``. A *record*
describes one replica as its node holds it (see :func:`replica_record`); a
*located* replica is a record plus ``node_id``, ``address`` and ``host_id``.

Durability. ``register`` says what a node is: ``role`` ``"storage"`` (a
``kvpool-server --role node|all`` process) or ``"client"`` (an inference
process, the default when absent), ``persistent_tiers`` (tiers whose objects
survive a restart, e.g. ``["nvme"]``; none when absent) and ``control`` (the
node's control socket; taken from a JSON ``address`` when absent). Only storage
nodes with a persistent tier receive durable copies. A reservation made by
``place`` with a ``key`` is a durable copy: committing it makes the master
remember the key as durable with ``replicas`` copies wanted. A record may carry
``"durable": replicas`` (a storage node re-registering its durable copies, e.g.
after a master restart). When a holder of a durable key dies or leaves, the
master re-creates the missing copies in the background by sending the node
control op ``replicate`` ``{"key", "spec", "header_sum", "source", "reservation",
"replicas", "persistent": true}`` to a new storage node, which pulls the object
from ``source`` (a surviving holder's address) with its header, checks the header
against ``header_sum`` and the bytes against the header, stores it in its
persistent tier and commits the reservation before it replies. A durable batch
(``put_many``) sends each target one ``replicate_many`` ``{"items": [{"key", "spec",
"header_sum", "reservation", "token"}], "source", "replicas", "persistent"}``: the
target pulls every object at once, checks each as above, and commits them all in one
``commit`` before it replies ``{"node_id", "tiers": [tier], "committed": int}``.
A client that closes with ``node.hand_off_s`` sends the storage node on its host
``adopt_many`` ``{"items": [{"key", "spec", "header_sum", "token"}], "source"}``: the
node skips keys it holds, pulls and checks the rest as above, stores them as ordinary
(evictable) objects, a shared-memory tier first, publishes them as its own and replies
``{"node_id", "adopted", "held", "failed"}``. The master sends the same with ``"rescue":
true`` for a client that registered with ``"hand_off": true`` and was declared dead: the node
reads the dead client's arena without an owner and pulls nothing.

``leave`` is a clean departure: the node's replicas leave the index at once and
it is listed as ``left`` (not dead) until ``master.forget_nodes_after_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypedDict

import msgspec

from kvpool import errors
from kvpool.cluster.wire import schema as S
from kvpool.cluster.wire.schema import ROLE_CLIENT, ROLE_STORAGE
from kvpool.objformat import ObjectSpec, stored_header_checksum

PROTOCOL_VERSION = 2  # v2: records carry header_sum, not the header

# The default of master.max_request_bytes (the master, and a node's control socket,
# drop anything larger unread); the configured value is what applies.
MAX_MESSAGE_BYTES = 64 << 20

OK = "ok"
ERROR = "error"

PING = "ping"
REGISTER = "register"
LEAVE = "leave"
HEARTBEAT = "heartbeat"
LOOKUP = "lookup"
EXISTS = "exists"
LOCATE = "locate"
RELEASE = "release"
RESERVE = "reserve"
COMMIT = "commit"
REVOKE = "revoke"
PUBLISH = "publish"
EVICT_REQUEST = "evict_request"
REMOVED = "removed"
DELETE = "delete"
PLACE = "place"
STATS = "stats"
LIST = "list"
FOLLOW = "follow"  # a standby master following the leader's changes (kvpool.cluster.master.follow)

__all__ = ["ROLE_CLIENT", "ROLE_STORAGE"]

#: op -> (request body, reply body) in :mod:`kvpool.cluster.wire.schema`; a reply of None is free-form
SCHEMA: dict[str, tuple[type[S.Body], type[S.Body] | None]] = {
    PING: (S.Ping, S.PingReply), REGISTER: (S.Register, S.RegisterReply), LEAVE: (S.Leave, S.LeaveReply),
    HEARTBEAT: (S.Heartbeat, S.HeartbeatReply), LOOKUP: (S.Keys, S.LookupReply),
    EXISTS: (S.Keys, S.ExistsReply), LOCATE: (S.Locate, S.LocateReply), RELEASE: (S.Release, S.ReleaseReply),
    RESERVE: (S.Reserve, S.ReserveReply), COMMIT: (S.Commit, S.CommitReply), REVOKE: (S.Revoke, S.RevokeReply),
    PUBLISH: (S.Publish, S.PublishReply), EVICT_REQUEST: (S.NodeKeys, S.EvictReply),
    REMOVED: (S.NodeKeys, S.RemovedReply), DELETE: (S.Delete, S.DeleteReply), PLACE: (S.Place, S.PlaceReply),
    STATS: (S.Stats, None), LIST: (S.ListKeys, S.ListReply), FOLLOW: (S.Follow, None),
}
OPS = frozenset(SCHEMA)


# -- body shapes (documentation for readers and type checkers) --------------------


class TierState(TypedDict):
    capacity: int
    free: int


class ReplicaRecord(TypedDict, total=False):
    """One replica as its node describes it (``key`` only in register/publish lists)."""

    key: bytes
    tier: str
    spec: list[Any]          # ObjectSpec.to_wire()
    nbytes: int              # whole object, header included
    header_sum: int          # the replica's ObjectHeader.checksum(): readers check the holder's header
    location: dict[str, Any]  # opaque to the master (e.g. cxl path + offset)
    durable: int             # a durable copy: replicas wanted for this key (storage nodes only)


def replica_record(
    tier: str,
    spec: ObjectSpec,
    nbytes: int,
    *,
    key: bytes | None = None,
    header: bytes | None = None,
    header_sum: int | None = None,
    location: Mapping[str, Any] | None = None,
    durable: int | None = None,
) -> ReplicaRecord:
    """Build the record a node sends for one replica it holds. Of its header only the checksum
    travels (``header`` packed, or ``header_sum`` given): the holder sends the header itself
    with every pull, and the reader checks it against this checksum."""
    record: ReplicaRecord = {"tier": tier, "spec": spec.to_wire(), "nbytes": int(nbytes)}
    if key is not None:
        record["key"] = key
    if header is not None:
        header_sum = stored_header_checksum(header)
    if header_sum is not None:
        record["header_sum"] = int(header_sum)
    record["location"] = dict(location or {})
    if durable:
        record["durable"] = int(durable)
    return record


# -- client-side views of replies ------------------------------------------------------


HeartbeatReply = S.HeartbeatReply
EvictDecision = S.EvictReply


@dataclass(frozen=True, slots=True)
class Located:
    # per key (None on a miss): each replica a map as the master sent it, with ReplicaRecord's fields
    # and node_id, address, host_id, token; checked where the node reads them
    # (kvpool.cluster.node.located.located_replicas)
    replicas: list[list[dict[str, Any]] | None]
    lease_id: int | None                         # pins every replica returned until released/expired
    more_leases: tuple[int, ...] = ()            # further leases when the keys took several requests

    @property
    def lease_ids(self) -> tuple[int, ...]:
        """Every lease this locate took: release them all when done."""
        return ((self.lease_id,) if self.lease_id is not None else ()) + self.more_leases


@dataclass(frozen=True, slots=True)
class Placement:
    node_id: str
    address: str
    host_id: str
    reservation_id: int | None
    reservation_ids: tuple[int, ...] = ()  # a batch's (place with items): one per item


# -- encoding -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    request_id: Any
    op: str
    body: Any  # the op's schema struct


class MalformedRequest(errors.ProtocolError):
    """Raised inside the master for a request it cannot serve; carries the id to echo."""

    def __init__(self, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.request_id = request_id


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(tuple[Any, Any, Any, msgspec.Raw])
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def _decoder(kind: Any) -> msgspec.msgpack.Decoder[Any]:
    try:
        return _DECODERS[kind]
    except KeyError:
        decoder = _DECODERS[kind] = msgspec.msgpack.Decoder(kind)
        return decoder


def _envelope(frame: bytes | memoryview, what: str) -> tuple[Any, Any, Any, msgspec.Raw]:
    """``[version, request_id, op_or_status, body]`` with the body left encoded."""
    try:
        return _ENVELOPE.decode(frame)
    except msgspec.ValidationError:
        raise MalformedRequest(f"{what} must be a msgpack array [version, request_id, op, body]") from None
    except Exception as exc:  # DecodeError and friends: never leaks as such
        raise MalformedRequest(f"{what} is not msgpack: {type(exc).__name__}: {str(exc):.200}") from None


def decode_body(op: str, body: Any, request_id: Any = None, *, kinds: Mapping[str, Any] | None = None) -> Any:
    """``body`` (still encoded, or a mapping as tests build it) as ``op``'s request struct;
    MalformedRequest names the field that does not fit (RequestTooLargeError for a fixed limit)."""
    kind = (kinds or _REQUESTS)[op]
    if isinstance(body, S.Body):
        return body
    raw = body if isinstance(body, msgspec.Raw) else _ENCODER.encode(body)
    try:
        return _decoder(kind).decode(raw)
    except msgspec.ValidationError as exc:
        raise MalformedRequest(f"body of {op} does not fit its schema (a map of {kind.__name__} fields): {exc}",
                               request_id) from None
    except msgspec.DecodeError as exc:
        raise MalformedRequest(f"body of {op} is not msgpack: {exc}", request_id) from None


_REQUESTS = {op: request for op, (request, _) in SCHEMA.items()}


def pack_request(request_id: Any, op: str, body: Any) -> bytes:
    return _ENCODER.encode([PROTOCOL_VERSION, request_id, op, body])


def unpack_request(frame: bytes | memoryview) -> Request:
    """Parse one request frame into its op's struct; raises MalformedRequest (with the id when
    readable)."""
    version, request_id, op, body = _envelope(frame, "request")
    if not isinstance(request_id, (int, str)) or isinstance(request_id, bool) or (
            isinstance(request_id, str) and len(request_id) > 256):
        raise MalformedRequest(f"request_id must be an int or a str of at most 256 characters, "
                               f"got {type(request_id).__name__}")
    if version != PROTOCOL_VERSION:
        raise MalformedRequest(
            f"protocol version {version!r:.40} is not supported; this master speaks {PROTOCOL_VERSION}",
            request_id,
        )
    if not isinstance(op, str) or op not in OPS:
        raise MalformedRequest(f"unknown op {op!r:.80}; known: {', '.join(sorted(OPS))}", request_id)
    return Request(request_id, op, decode_body(op, body, request_id))


# A question (exists, lookup) as the master's query port receives it, checked in one decode;
# one that does not fit goes the general way (unpack_request), which names what is wrong.
_VERSION = Annotated[int, msgspec.Meta(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)]
_QUESTION = msgspec.msgpack.Decoder(tuple[_VERSION, int | Annotated[str, msgspec.Meta(max_length=256)], str, S.Keys])


def unpack_question(frame: bytes | memoryview) -> Request | None:
    """An ``exists`` or ``lookup`` request frame parsed as :func:`unpack_request` would, or
    None if it is anything else (another op, or malformed)."""
    try:
        _, request_id, op, body = _QUESTION.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return Request(request_id, op, body) if op == EXISTS or op == LOOKUP else None


def pack_reply(request_id: Any, body: Any) -> bytes:
    return _ENCODER.encode([PROTOCOL_VERSION, request_id, OK, body])


def pack_error(request_id: Any, error_type: str, message: str) -> bytes:
    return _ENCODER.encode([PROTOCOL_VERSION, request_id, ERROR, {"type": error_type, "message": message}])


# An OK reply to each op that has a reply struct, as one msgspec type (unpack_reply's usual case).
_ANSWERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    op: msgspec.msgpack.Decoder(tuple.__class_getitem__((_VERSION, Any, Literal["ok"], reply)))
    for op, (_, reply) in SCHEMA.items() if reply is not None}


def unpack_reply(frame: bytes | memoryview, op: str | None = None) -> tuple[Any, bool, Any]:
    """(request_id, ok, body) of one reply frame: an OK body as ``op``'s reply struct (free-form
    without an op, or for ``stats``), an error body as a map. ProtocolError if it does not fit."""
    answer = _ANSWERS.get(op) if op is not None else None
    if answer is not None:  # the usual case, checked in one decode
        try:
            _, request_id, _, body = answer.decode(frame)
            return request_id, True, body
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass  # an error reply, or one that does not fit: taken apart below, to say which
    try:
        version, request_id, status, raw = _envelope(frame, "master reply")
    except MalformedRequest as exc:
        raise errors.ProtocolError(str(exc)) from None
    if status not in (OK, ERROR):
        raise errors.ProtocolError("master reply is not [version, request_id, status, body]")
    if version != PROTOCOL_VERSION:
        raise errors.ProtocolError(
            f"master speaks protocol version {version!r:.40}; this client speaks {PROTOCOL_VERSION}"
        )
    kind = SCHEMA.get(op, (None, None))[1] if op is not None and status == OK else None
    try:
        body = _decoder(kind if kind is not None else Any).decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.ProtocolError(f"master sent a malformed {op or ''} reply: {exc}") from None
    return request_id, status == OK, body


def error_from_reply(body: Any) -> errors.KVPoolError:
    """The exception an error reply names (ProtocolError when the name is not ours)."""
    if not isinstance(body, dict):
        return errors.ProtocolError(f"malformed error reply: {body!r:.200}")
    name, message = body.get("type"), str(body.get("message", ""))
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, errors.KVPoolError):
        return cls(message)
    return errors.ProtocolError(f"{name!r:.80}: {message:.1000}")


# -- node control socket ------------------------------------------------------------------
#
# A node's control socket (a ZeroMQ ROUTER; the master and clients send ``replicate``,
# the CLI ``stats``) speaks msgpack ``[CONTROL_PROTOCOL_VERSION, request_id, op, body]``
# and answers ``[CONTROL_PROTOCOL_VERSION, request_id, "ok" | "error", body]``; an error
# body is ``{"type": <kvpool.errors class name>, "message"}``. Version 1 was the
# unversioned ``[op, body]`` -> ``[status, body]``; a node answers it (and anything else
# malformed) with a ProtocolError reply and keeps serving.

CONTROL_PROTOCOL_VERSION = 3  # v3: replicate names spec + header_sum
CONTROL_REPLICATE = "replicate"
CONTROL_REPLICATE_MANY = "replicate_many"
CONTROL_ADOPT_MANY = "adopt_many"  # a departing node's hand-off (node.hand_off_s); a node without it: ProtocolError
CONTROL_PING = "ping"
CONTROL_STATS = "stats"
CONTROL_OPS = frozenset({CONTROL_REPLICATE, CONTROL_REPLICATE_MANY, CONTROL_ADOPT_MANY, CONTROL_PING, CONTROL_STATS})


CONTROL_SCHEMA: dict[str, type[S.Body]] = {
    CONTROL_REPLICATE: S.Replicate, CONTROL_REPLICATE_MANY: S.ReplicateMany, CONTROL_ADOPT_MANY: S.AdoptMany,
    CONTROL_PING: S.Ping, CONTROL_STATS: S.Stats,
}


def pack_control_request(request_id: int, op: str, body: Any) -> bytes:
    return _ENCODER.encode([CONTROL_PROTOCOL_VERSION, request_id, op, body])


def unpack_control_request(frame: bytes | memoryview) -> Request:
    """Parse one control request into its op's struct; raises MalformedRequest (with the id
    when readable)."""
    try:
        version, request_id, op, body = _envelope(frame, "control request")
    except MalformedRequest as exc:
        raise MalformedRequest(
            f"{exc} (control requests are [version={CONTROL_PROTOCOL_VERSION}, request_id, op, body]; "
            "an unversioned [op, body] is protocol 1, no longer served)") from None
    if type(request_id) is not int:
        raise MalformedRequest(f"control request_id must be an int, got {type(request_id).__name__}")
    if version != CONTROL_PROTOCOL_VERSION:
        raise MalformedRequest(f"control protocol version {version!r:.40} is not supported; this node "
                               f"speaks {CONTROL_PROTOCOL_VERSION}", request_id)
    if not isinstance(op, str) or op not in CONTROL_OPS:
        raise MalformedRequest(f"unknown control op {op!r:.80}; known: {', '.join(sorted(CONTROL_OPS))}",
                               request_id)
    return Request(request_id, op, decode_body(op, body, request_id, kinds=CONTROL_SCHEMA))


def pack_control_reply(request_id: Any, body: Any) -> bytes:
    return _ENCODER.encode([CONTROL_PROTOCOL_VERSION, request_id, OK, body])


def pack_control_error(request_id: Any, error_type: str, message: str) -> bytes:
    return _ENCODER.encode([CONTROL_PROTOCOL_VERSION, request_id, ERROR,
                            {"type": error_type, "message": message[:2000]}])


def unpack_control_reply(frame: bytes | memoryview, request_id: int) -> Any:
    """The body of a control reply to ``request_id``; raises the error it names.

    An error type that is not a kvpool error becomes TransferError; a reply that
    cannot be parsed (or answers another request) is ProtocolError.
    """
    try:
        message = msgspec.msgpack.decode(frame)
    except Exception as exc:
        raise errors.ProtocolError(f"control reply is not msgpack: {type(exc).__name__}") from None
    if not isinstance(message, list) or len(message) != 4 or message[2] not in (OK, ERROR):
        raise errors.ProtocolError("control reply is not [version, request_id, status, body]")
    version, reply_id, status, body = message
    if version != CONTROL_PROTOCOL_VERSION:
        raise errors.ProtocolError(f"node speaks control protocol {version!r:.40}; this build speaks "
                                   f"{CONTROL_PROTOCOL_VERSION}")
    if reply_id != request_id:
        raise errors.ProtocolError(f"control reply answers request {reply_id!r:.40}, not {request_id}")
    if status == OK:
        return body
    if not isinstance(body, dict):
        raise errors.ProtocolError(f"malformed control error reply: {body!r:.200}")
    name, message_text = body.get("type"), str(body.get("message", ""))[:2000]
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, errors.KVPoolError)):
        raise errors.TransferError(f"{name!r:.80}: {message_text}")
    raise cls(message_text)
