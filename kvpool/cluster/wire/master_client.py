"""Client side of the master protocol: :class:`MasterClient` (a node's heartbeats are
:mod:`kvpool.cluster.node.heartbeat`, calls to another node's control socket
:mod:`kvpool.cluster.wire.control`).

Owns talking to the master: one DEALER socket per calling thread (ZeroMQ
sockets are not thread-safe, and a socket per thread needs no lock and no
demultiplexer), request ids, deadlines, and turning error replies into
:mod:`kvpool.errors` exceptions. It does not own node state or any policy: a
node decides what to register, delete or evict; this module carries the
messages.

Reconnecting is transparent: ZeroMQ reconnects a socket by itself when the
master restarts, and a call that times out throws its socket away (nothing it
queued is delivered later to a restarted master) and the next call on that
thread opens a fresh one.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import msgspec
import zmq

from kvpool import errors
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire.affinity import io_threads_anywhere
from kvpool.cluster.wire.etcd import LeaderFinder
from kvpool.cluster.wire.protocol import EvictDecision, HeartbeatReply, Located, Placement, ReplicaRecord
from kvpool.cluster.wire.query import QueryPorts
from kvpool.cluster.wire.schema import LocateReply
from kvpool.cluster.wire.security import ClusterKey, HandshakeWatch, recv_or_refused, refused_error
from kvpool.config import Config, MasterSection, check_master_address

log = logging.getLogger("kvpool.master_client")

KeyLike = bytes | bytearray | memoryview | str


def as_key(key: Any) -> bytes:
    """The wire form of a key: bytes as they are, str as UTF-8."""
    if type(key) is bytes:
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, str):
        return key.encode()
    raise errors.InvalidKeyError(f"a key must be bytes or str, got {type(key).__name__}")


def _keys(keys: Iterable[KeyLike]) -> list[bytes]:
    listed = keys if isinstance(keys, list) else list(keys)
    if set(map(type, listed)) <= {bytes}:  # the common case, checked in C
        return listed  # type: ignore[return-value]
    return [k if type(k) is bytes else as_key(k) for k in listed]


class _Connection:
    __slots__ = ("socket", "address", "ids", "watch", "answered", "__weakref__")

    def __init__(self, socket: zmq.Socket[Any], address: str, watch: HandshakeWatch) -> None:
        self.socket = socket
        self.address = address
        self.ids = itertools.count(1)
        self.watch = watch
        self.answered = False  # a reply arrived: the handshake is done, later calls take the fast path

    def close(self) -> None:
        _close(self.socket, self.watch)


def _close(socket: zmq.Socket[Any], watch: HandshakeWatch) -> None:
    watch.close()  # first: see HandshakeWatch.close
    socket.close(0)


# How long a reply may take before the client checks whether its connection dropped (and,
# following a leader in etcd, whether the leader has moved).
LEADER_CHECK_S = 0.2


class _LeaderMoved(Exception):
    """A call's master is no longer the leader in etcd: resend to the new one."""


class MasterClient:
    """Thread-safe client of the metadata master; every call is one round trip.

    Every call raises MasterUnreachableError when no reply arrives within
    ``request_timeout_s``, ProtocolError when the reply cannot be understood,
    and the typed error a master error reply names (InvalidKeyError,
    UnknownNodeError, ReservationError, CapacityError, ...). A malformed
    address (``localhost:7700``: no ``tcp://``) is a ConfigError at once.

    Every socket is a CURVE client with ``cluster_key`` (default: the key of
    ``config``'s ``[security]``; no config: the default settings' key file; a
    MasterSection carries no ``[security]``, so it needs ``cluster_key``: TypeError
    without one). A master that refuses the key (another cluster's key, or auth on
    one side only) raises AuthenticationError instead of MasterUnreachableError.

    With ``master.etcd`` set and no ``address``, the client follows the leader
    of the masters in etcd: it reads the leader there, and a call whose master
    is slow to answer (over LEADER_CHECK_S) or answers NotLeaderError looks
    again and resends to a new leader within the same deadline.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        config: Config | MasterSection | None = None,
        request_timeout_s: float | None = None,
        cluster_key: ClusterKey | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        full = None if isinstance(config, MasterSection) else Config.load(config)
        section = config if isinstance(config, MasterSection) else full.master  # type: ignore[union-attr]
        # The key before anything is opened: an unreadable key file is a ConfigError at once.
        if cluster_key is None:
            if full is None:
                raise TypeError("MasterClient(config=MasterSection) needs cluster_key= (a section has no [security])")
            cluster_key = ClusterKey.from_config(full)
        self.cluster_key = cluster_key
        self._finder: LeaderFinder | None = None
        if address is None and section.etcd:
            self._fixed: str | None = None
            self._finder = LeaderFinder(section.etcd, section.etcd_prefix)
        else:
            self._fixed = check_master_address(address or section.listen)
        self.request_timeout_s = section.request_timeout_s if request_timeout_s is None else request_timeout_s
        # The master's limits (master.max_request_bytes, master.max_batch): larger batches are
        # split into several requests, and a request that still does not fit is never sent.
        self.max_request_bytes = section.max_request_bytes
        self.max_batch = section.max_batch
        # ``context``: a shared one (the process's: one ZeroMQ I/O thread for every client of a
        # node), whose sockets this client closes but which it never terminates.
        self._owns_context = context is None
        self._context = context if context is not None else zmq.Context(io_threads=1)
        if self._owns_context:
            self._context.setsockopt(zmq.LINGER, 0)  # no socket of this client can hold up term()
            io_threads_anywhere(self._context)
        self._local = threading.local()
        self._connections: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        # The master's query port (kvpool.cluster.wire.query): exists and lookup go there first.
        # Following a leader, a frozen one costs at most a second there before the ZeroMQ
        # call looks for a new one.
        self._queries = QueryPorts(
            self.cluster_key,
            self.request_timeout_s if self._finder is None else min(self.request_timeout_s, 5 * LEADER_CHECK_S),
            following=self._finder is not None, poll_s=full.node.reply_poll_us * 1e-6 if full is not None else 0.0)

    # -- plumbing -----------------------------------------------------------------

    @property
    def address(self) -> str:
        """The master this client talks to (with etcd: the leader last seen, or where to find it)."""
        if self._finder is None:
            return self._fixed  # type: ignore[return-value]
        return self._finder.current(LEADER_CHECK_S) or self._finder.describe()

    def _leader(self, deadline: float, refresh: bool = False) -> str:
        """The master to send to: the fixed address, or the leader in etcd (waits for one
        until ``deadline``)."""
        if self._finder is None:
            return self._fixed  # type: ignore[return-value]
        while True:
            # etcd is read within the call's deadline: an etcd that does not answer (frozen, cut
            # off) leaves the leader last read, never a call past its deadline.
            wait_s = max(0.0, deadline - time.monotonic())
            leader = self._finder.refresh(wait_s) if refresh else self._finder.current(wait_s)
            if leader is not None:
                return check_master_address(leader, "leader address in etcd")
            if time.monotonic() >= deadline:
                raise errors.MasterUnreachableError(f"no master leader in etcd at {self._finder.client.urls} "
                                                    f"(prefix {self._finder.key.decode()!r})")
            refresh = True
            time.sleep(min(LEADER_CHECK_S, max(0.0, deadline - time.monotonic())))

    def _connection(self, address: str) -> _Connection:
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            if conn.address == address:
                return conn
            self._discard(conn)  # the leader moved
        if self._closed:
            raise errors.PoolClosedError("master client is closed")
        with self._lock:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            # Retry quickly after a master restart, but do not hammer a dead address.
            socket.setsockopt(zmq.RECONNECT_IVL, 50)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            # Replies are bounded too (a locate of max_batch keys with their replicas can
            # be a few times its request): anything larger is dropped unread.
            socket.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_request_bytes)
            self.cluster_key.secure_client(socket)
            watch = HandshakeWatch(socket)  # before connect: it must see the first handshake
            try:
                socket.connect(address)
            except zmq.ZMQError as exc:  # an open socket would make close() hang in term()
                _close(socket, watch)
                raise errors.ConfigError(f"master address {address!r}: {exc}") from None
            conn = _Connection(socket, address, watch)
            self._connections.add(conn)
            # When the thread ends its connection is collected; close the socket then. Not at
            # exit: pools close their clients then (kvpool.api), and still need the sockets.
            weakref.finalize(conn, _close, socket, watch).atexit = False
        self._local.conn = conn
        return conn

    def _discard(self, conn: _Connection) -> None:
        self._local.conn = None
        conn.close()

    def call(self, op: str, body: Mapping[str, Any], *, timeout_s: float | None = None,
             meanwhile: Callable[[], None] | None = None) -> Any:
        """Send one request and return the reply body (raises the error a reply names).

        ``meanwhile`` runs on this thread once the request is out, before the reply is read:
        work that overlaps the round trip (it should not raise; a reply that arrives meanwhile
        waits in the socket). It runs once, even if the request is sent again to a new leader.
        """
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        if self._finder is None:
            return self._call_once(self._connection(self._fixed), op, body, deadline, timeout,  # type: ignore[arg-type]
                                   meanwhile)
        refresh = False
        while True:
            conn = self._connection(self._leader(deadline, refresh))
            try:
                work, meanwhile = meanwhile, None
                return self._call_once(conn, op, body, deadline, timeout, work)
            except _LeaderMoved:
                refresh = False  # the finder has just read the new leader
            except errors.NotLeaderError:  # a standby (the leader key moved since it was read)
                self._discard(conn)
                if deadline - time.monotonic() <= LEADER_CHECK_S / 4:  # no time left to ask again
                    raise
                time.sleep(LEADER_CHECK_S / 4)
                refresh = True

    def _call_once(self, conn: _Connection, op: str, body: Mapping[str, Any], deadline: float,
                   timeout: float, meanwhile: Callable[[], None] | None = None) -> Any:
        request_id = next(conn.ids)
        frame = P.pack_request(request_id, op, body)
        if len(frame) > self.max_request_bytes:  # the master would drop it unread: never a silent timeout
            raise errors.RequestTooLargeError(
                f"{op} request is {len(frame)} bytes; the master accepts at most master.max_request_bytes = "
                f"{self.max_request_bytes}")
        lost = conn.watch.lost()  # a connection that drops after the send takes the request with it
        try:
            conn.socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # the send queue is full: the master has been gone for a while
            self._discard(conn)
            raise errors.MasterUnreachableError(f"master at {conn.address} is not accepting requests") from None
        if meanwhile is not None:  # its time is not the master's: the deadline moves by it
            began = time.monotonic()
            meanwhile()
            deadline += time.monotonic() - began
        socket = conn.socket
        slice_ms = int(LEADER_CHECK_S * 1000)
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            # Set before anything can raise: a deadline already past (a resend after a
            # NotLeaderError, a leader found at the last moment) waits 0 ms and times out.
            wait_ms = max(0, min(remaining_ms, slice_ms))
            try:
                if remaining_ms <= 0:
                    raise zmq.Again
                if conn.answered:
                    # A blocking recv with a timeout costs one call; poll + recv would be two.
                    socket.setsockopt(zmq.RCVTIMEO, wait_ms)
                    frame = socket.recv()
                else:  # the first reply: also watch the handshake, so a refused key fails fast
                    try:
                        got = recv_or_refused(socket, conn.watch, wait_ms / 1000, "master", conn.address,
                                              self.cluster_key, lost=lost)
                    except errors.AuthenticationError:
                        self._discard(conn)
                        raise
                    if got is None:
                        raise zmq.Again
                    frame, conn.answered = got, True
            except zmq.Again:
                if wait_ms < remaining_ms:  # a slice ended, not the deadline
                    if conn.watch.lost() != lost:  # the master died holding the request, or restarted
                        self._discard(conn)
                        raise errors.MasterUnreachableError(
                            f"master at {conn.address} dropped the connection before answering {op} (it "
                            f"stopped or restarted); the request may or may not have taken effect") from None
                    if self._finder is not None and self._finder.refresh(
                            min(LEADER_CHECK_S, (deadline - time.monotonic()))) not in (None, conn.address):
                        self._discard(conn)
                        raise _LeaderMoved from None
                    continue
                refused = conn.watch.refused(settled=True)
                self._discard(conn)
                if refused:
                    raise refused_error("master", conn.address, self.cluster_key) from None
                raise errors.MasterUnreachableError(
                    f"master at {conn.address} did not answer {op} within {timeout:.3g} s"
                ) from None
            reply_id, ok, reply = P.unpack_reply(frame, op)  # an OK body as op's reply struct
            if reply_id != request_id:
                continue  # a late reply to a request this thread gave up on
            if ok:
                return reply
            raise P.error_from_reply(reply)

    def close(self) -> None:
        """Close every socket. Call when no thread is inside a call."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for conn in list(self._connections):
                conn.close()
            self._queries.close()
        self._local = threading.local()
        if self._owns_context:
            # destroy(): a socket still open in some thread is closed rather than waited for forever.
            self._context.destroy(linger=0)
        if self._finder is not None:
            self._finder.close()

    def _batched(self, items: Sequence[Any], call_one: Callable[[Sequence[Any]], Any],
                 until: Callable[[Sequence[Any], Any], bool] | None = None) -> list[Any]:
        """``call_one(batch)`` for consecutive batches of ``items`` (at least one call, even for
        none); returns the replies in order. A batch holds at most ``max_batch`` items, fewer when
        it does not fit ``max_request_bytes`` (RequestTooLargeError halves it, down to one item).
        ``until(batch, reply)`` true stops early.
        """
        replies: list[Any] = []
        size, done = self.max_batch, 0
        while True:
            batch = items[done:done + size]
            try:
                reply = call_one(batch)
            except errors.RequestTooLargeError:
                if len(batch) <= 1:
                    raise
                size = len(batch) // 2
                continue
            replies.append(reply)
            done += len(batch)
            if done >= len(items) or (until is not None and until(batch, reply)):
                return replies

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations ---------------------------------------------------------------------

    def ping(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return msgspec.structs.asdict(self.call(P.PING, {}, timeout_s=timeout_s))

    def register(
        self,
        node_id: str,
        address: str,
        host_id: str,
        tiers: Mapping[str, Mapping[str, int]],
        objects: Sequence[ReplicaRecord] = (),
        *,
        role: str = P.ROLE_CLIENT,
        persistent_tiers: Sequence[str] = (),
        control: str | None = None,
        hand_off: bool = False,
    ) -> dict[str, Any]:
        """Announce a node and everything it holds (replaces what the master believed).

        Each object is a :func:`kvpool.cluster.wire.protocol.replica_record` with ``key`` set.
        ``role`` ``"storage"`` plus a persistent tier makes the node eligible for
        durable copies; ``control`` is its control socket (for re-replication); ``hand_off``: a
        storage node on its host should keep its shared-memory objects once it is gone.
        The reply carries the master's ``heartbeat_ms``/``dead_after_missed``.
        """
        first: list[dict[str, Any]] = []

        def send(batch: Sequence[ReplicaRecord]) -> int:
            # The first batch registers (replacing what the master believed); the rest are published.
            if first:
                return cast(int, self.call(P.PUBLISH, {"node_id": node_id, "objects": list(batch)}).indexed)
            body: dict[str, Any] = {
                "node_id": node_id, "address": address, "host_id": host_id,
                "tiers": tiers, "objects": list(batch), "role": role, "persistent_tiers": list(persistent_tiers),
            }
            if control is not None:
                body["control"] = control
            if hand_off:
                body["hand_off"] = True
            first.append(msgspec.structs.asdict(self.call(P.REGISTER, body)))
            return cast(int, first[0]["indexed"])

        indexed = self._batched(objects if isinstance(objects, Sequence) else list(objects), send)
        reply = first[0]
        reply["indexed"] = sum(indexed)
        return reply

    def leave(self, node_id: str, *, timeout_s: float | None = None) -> int:
        """Deregister cleanly: the node's replicas leave the index; it is listed as ``left``.

        Returns how many replicas were withdrawn.
        """
        return cast(int, self.call(P.LEAVE, {"node_id": node_id}, timeout_s=timeout_s).withdrawn)

    def heartbeat(
        self, node_id: str, tiers: Mapping[str, Mapping[str, int]] | None = None, delete_ack: int = 0,
        term: int = 0,
    ) -> HeartbeatReply:
        """``term``: the last master term whose takeover gap this node filled in (see
        :class:`kvpool.cluster.node.recent.RecentChanges`)."""
        body: dict[str, Any] = {"node_id": node_id, "delete_ack": delete_ack, "term": term}
        if tiers is not None:
            body["tiers"] = tiers
        return cast(HeartbeatReply, self.call(P.HEARTBEAT, body))

    @property
    def query_calls(self) -> int:
        """Questions answered on a query port."""
        return self._queries.calls

    @property
    def query_polls(self) -> dict[str, int]:
        """How the answers on a query port were waited for (:class:`ReplyPoll` counters)."""
        return self._queries.poll.stats()

    def _query_port(self, deadline: float) -> int:
        """The query port of the master a call goes to (0: none), asked over ZeroMQ by ``deadline``."""
        return cast(int, self.call(P.PING, {}, timeout_s=max(0.0, deadline - time.monotonic())).query_port)

    def _question(self, op: str, body: Mapping[str, Any]) -> Any:
        """A question (exists, lookup): on the query port if it answers, else over ZeroMQ; both
        within one ``request_timeout_s`` (a query port that took part of it, a frozen master's,
        leaves the rest to the ZeroMQ call)."""
        deadline = time.monotonic() + self.request_timeout_s
        address = self._fixed if self._finder is None else self._finder.current(self._queries.timeout_s)
        reply = None if address is None or self._closed else self._queries.ask(
            address, op, body, lambda: self._query_port(deadline))
        return reply if reply is not None else self.call(op, body, timeout_s=max(0.0, deadline - time.monotonic()))

    def lookup(self, hashes: Iterable[KeyLike]) -> int:
        """How many leading ``hashes`` are cached somewhere (the longest cached prefix)."""
        return self.lookup_near(hashes)[0]

    def lookup_near(self, hashes: Iterable[KeyLike], nodes: Iterable[str] = (),
                    host: str = "") -> tuple[int, tuple[bool, bool] | None]:
        """:meth:`lookup`, and (when ``nodes`` or ``host`` is given) whether the first and the last
        leading hit each have a replica near the asker: held by one of ``nodes`` (at most 64), or
        in a cxl arena of a node on ``host``. None: no hit, or a master that does not say."""
        near = {"near_nodes": list(nodes)[:64], "near_host": host} if nodes or host else {}
        replies = self._batched(_keys(hashes), lambda b: self._question(P.LOOKUP, {"keys": list(b), **near}),
                                until=lambda batch, reply: reply.prefix < len(batch))
        prefix = sum(reply.prefix for reply in replies)
        hit = [reply.near for reply in replies if reply.prefix]
        if not near or not hit or any(ends is None or len(ends) != 2 for ends in (hit[0], hit[-1])):
            return prefix, None
        return prefix, (bool(hit[0][0]), bool(hit[-1][1]))

    def exists_many(self, keys: Iterable[KeyLike]) -> list[bool]:
        return [hit for reply in self._batched(
            _keys(keys), lambda b: self._question(P.EXISTS, {"keys": list(b)}).exists) for hit in reply]

    def exists(self, key: KeyLike) -> bool:
        return bool(self._question(P.EXISTS, {"keys": [as_key(key)]}).exists[0])

    def locate_many(self, keys: Iterable[KeyLike], lease: bool = True,
                    meanwhile: Callable[[], None] | None = None) -> Located:
        """Every replica of each key (None on a miss); with ``lease`` they are pinned
        until :meth:`release` or the master's ``lease_s``. ``meanwhile``: see :meth:`call`
        (with the first request)."""
        def locate(batch: Sequence[bytes]) -> LocateReply:
            nonlocal meanwhile
            work, meanwhile = meanwhile, None
            # The schema checks the reply's shape; each replica record is checked where it is used
            # (kvpool.cluster.node.located), so one bad record costs only that replica.
            return cast(LocateReply, self.call(P.LOCATE, {"keys": list(batch), "lease": lease}, meanwhile=work))

        replies = self._batched(_keys(keys), locate)
        leases = [r.lease for r in replies if r.lease is not None]
        if len(replies) == 1:
            return Located(replies[0].replicas, replies[0].lease)
        # More than max_batch keys: one lease per request; lease_id is the first, the others
        # are in more_leases (Located.lease_ids names them all).
        return Located([x for r in replies for x in r.replicas], leases[0] if leases else None,
                       tuple(leases[1:]))

    def locate(self, key: KeyLike, lease: bool = True, meanwhile: Callable[[], None] | None = None) -> Located:
        return self.locate_many([key], lease, meanwhile)

    def release(self, lease_ids: Iterable[int | None]) -> int:
        """End leases early; unknown or expired ids are ignored. Returns how many ended."""
        ids = [lid for lid in lease_ids if lid is not None]
        if not ids:
            return 0
        return sum(self._batched(ids, lambda b: self.call(P.RELEASE, {"leases": list(b)}).released))

    def reserve_many(self, items: Iterable[tuple[KeyLike, int, str]]) -> list[int]:
        """Reserve (key, nbytes, node_id) puts; the keys stay invisible until commit.

        All or nothing: UnknownNodeError if any node is not alive.
        """
        body = [{"key": as_key(k), "nbytes": int(n), "node_id": node} for k, n, node in items]
        done: list[int] = []

        def send(batch: Sequence[dict[str, Any]]) -> list[int]:
            ids: list[int] = self.call(P.RESERVE, {"items": list(batch)}).reservations
            done.extend(ids)
            return ids

        try:
            self._batched(body, send)
        except errors.KVPoolError:
            if done:  # all or nothing across the split too
                try:
                    self.revoke(done)
                except errors.KVPoolError:
                    pass  # they expire after master.reservation_timeout_s
            raise
        return done

    def reserve(self, key: KeyLike, nbytes: int, node_id: str) -> int:
        return self.reserve_many([(key, nbytes, node_id)])[0]

    def commit_many(self, items: Iterable[tuple[int, ReplicaRecord]]) -> list[bool]:
        """Make reserved puts visible; False for a reservation that expired, was
        revoked, or whose node died."""
        body = [{"reservation": rid, "replica": record} for rid, record in items]
        return [ok for reply in self._batched(body, lambda b: self.call(P.COMMIT, {"items": list(b)}).committed)
                for ok in reply]

    def commit(self, reservation_id: int, replica: ReplicaRecord) -> None:
        if not self.commit_many([(reservation_id, replica)])[0]:
            raise errors.ReservationError(
                f"reservation {reservation_id} is unknown, expired, revoked or its node died"
            )

    def revoke(self, reservation_ids: Iterable[int]) -> int:
        return sum(self._batched(list(reservation_ids),
                                 lambda b: self.call(P.REVOKE, {"reservations": list(b)}).revoked))

    def publish(self, node_id: str, objects: Sequence[ReplicaRecord], *, timeout_s: float | None = None) -> int:
        """Index replicas a node already holds, in one step (records with ``key``); ``timeout_s``:
        each request's deadline (default ``request_timeout_s``)."""
        return sum(self._batched(list(objects), lambda b: self.call(
            P.PUBLISH, {"node_id": node_id, "objects": list(b)}, timeout_s=timeout_s).indexed))

    def evict_request(self, node_id: str, keys: Iterable[KeyLike]) -> EvictDecision:
        """Ask to drop keys: allowed ones are already out of the index; pinned ones
        must stay until their readers' leases end."""
        replies = self._batched(_keys(keys), lambda b: self.call(
            P.EVICT_REQUEST, {"node_id": node_id, "keys": list(b)}))
        return EvictDecision([k for r in replies for k in r.allowed], [k for r in replies for k in r.pinned],
                             any(r.reregister for r in replies))

    def removed(self, node_id: str, keys: Iterable[KeyLike]) -> int:
        """Report keys the node no longer holds; returns how many were indexed."""
        return sum(self._batched(_keys(keys), lambda b: self.call(
            P.REMOVED, {"node_id": node_id, "keys": list(b)}).removed))

    def delete(self, keys: Iterable[KeyLike], node_id: str | None = None) -> list[bool]:
        """Remove keys from the pool (lookups miss at once); False for unknown keys.

        ``node_id``: the caller's own node, which drops its copies itself right away; it is
        not told to drop them again on a later heartbeat (which would delete a copy it put
        again meanwhile: delete then put from one process must leave the key there)."""
        extra = {} if node_id is None else {"node_id": node_id}
        replies = self._batched(_keys(keys), lambda b: self.call(P.DELETE, {"keys": list(b), **extra}).deleted)
        return [d for reply in replies for d in reply]

    def place(
        self,
        nbytes: int,
        replicas: int = 1,
        exclude: Iterable[str] = (),
        key: KeyLike | None = None,
    ) -> list[Placement]:
        """Storage nodes for a durable put: exactly ``replicas`` of them.

        Only storage nodes with a persistent tier are eligible. With ``key``,
        each target comes with a reservation for it (committing one makes the
        key durable). Raises InvalidArgumentError for ``replicas < 1``,
        NotEnoughReplicasError when fewer nodes are eligible (nothing reserved),
        ObjectTooLargeError when no persistent tier can hold the object.
        """
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise errors.InvalidArgumentError(f"replicas must be an int >= 1, got {replicas!r}")
        reply = self.call(P.PLACE, {
            "nbytes": int(nbytes), "replicas": int(replicas), "exclude": list(exclude),
            "key": None if key is None else as_key(key),
        })
        return [
            Placement(t.node_id, t.address, t.host_id, t.reservation, tuple(t.reservations)) for t in reply.targets
        ]

    def place_many(self, items: Sequence[tuple[KeyLike, int]], replicas: int = 1,
                   exclude: Iterable[str] = ()) -> list[Placement]:
        """Storage nodes for a durable batch, in one request: the same ``replicas`` nodes take
        every ``(key, nbytes)`` item, each target with one reservation per item
        (``reservation_ids``, in order). Raises what :meth:`place` raises (nothing reserved);
        a batch larger than ``master.max_batch`` is RequestTooLargeError (split it)."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise errors.InvalidArgumentError(f"replicas must be an int >= 1, got {replicas!r}")
        wire = [{"key": as_key(key), "nbytes": int(nbytes)} for key, nbytes in items]
        reply = self.call(P.PLACE, {"nbytes": sum(i["nbytes"] for i in wire), "replicas": int(replicas),
                                    "exclude": list(exclude), "items": wire})
        return [
            Placement(t.node_id, t.address, t.host_id, t.reservation, tuple(t.reservations)) for t in reply.targets
        ]

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return cast(dict[str, Any], self.call(P.STATS, {}, timeout_s=timeout_s))

    def list_keys(self, prefix: KeyLike = b"", limit: int = 1000) -> tuple[list[dict[str, Any]], bool]:
        """(keys with their replicas, truncated) for keys starting with ``prefix``."""
        reply = self.call(P.LIST, {"prefix": as_key(prefix) if prefix else b"", "limit": int(limit)})
        return reply.keys, reply.truncated
