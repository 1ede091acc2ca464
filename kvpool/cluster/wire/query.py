"""The master's query port: ``exists``, ``lookup`` and ``ping`` over a plain TCP connection.

Why
    Every ZeroMQ message passes through an I/O thread on each side, so a round trip costs
    two thread hand-offs per side on top of the network, and that was most of what a one-key
    ``exists`` cost. A blocking socket answered by a thread of the master's own is one wake-up
    each way. (Measurements: docs/limits.md, docs/benchmarks.md.)

This module is what both ends speak (:data:`QUERY_OPS`, :data:`QUERY_HELLO`, the framing)
and the client end (:class:`QueryClient`, :class:`QueryPorts`); the master's end is
:class:`kvpool.cluster.master.query_server.QueryServer`.

What it serves
    Only questions (:data:`QUERY_OPS`): they change nothing on the master, and their answers
    are booleans and counts about keys, never bytes or pull tokens. Everything else is
    refused with a ProtocolError reply: writes stay on the CURVE-encrypted ZeroMQ socket.
    Requests and replies are the master protocol's own frames (:mod:`.protocol`), each
    behind a u32 length, answered by the master's ``MasterServer._answer_query`` under the lock the
    ZeroMQ loop holds for each of its requests (one request at a time, as ever).

Security
    Both ends prove they hold the cluster key before any request: the client sends a nonce,
    the server answers with an HMAC of it and a nonce of its own, and the client's HMAC of
    that opens the connection (:meth:`ClusterKey.query_proof`). Past that, frames are neither
    encrypted nor signed: an on-path observer learns which key hashes are asked about, and
    one who rewrites packets can change an answer (a wrong ``exists``, never wrong bytes: a
    get verifies what it reads).
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from kvpool import errors
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire.security import ClusterKey
from kvpool.transport.tcp.stream import (
    MutualHello,
    ReplyPoll,
    recv_exactly,
    set_timeouts,
)

log = logging.getLogger("kvpool.master.query")

QUERY_OPS = frozenset({P.EXISTS, P.LOOKUP, P.PING})
QUERY_HELLO = MutualHello(b"KVMQ", 2, "kvpool master query port")  # 1: the answer's nonce before its proof
_LENGTH = struct.Struct("<I")
MAX_QUERY_BYTES = 4 << 20  # a query or its answer larger than this ends the connection
_RETRY_S = 30.0  # a master without a query port, or whose port failed, is asked for it again after this
_FIRST_READ = 4096  # a frame's first recv asks for this much (a one-key question is ~100 bytes)


class QueryClient:
    """One thread's connection to a master's query port (see the module); raises OSError or
    a kvpool error when the port cannot be used, for the caller to ask over ZeroMQ instead.
    ``poll``: how the answers are polled for before the caller blocks (shared by a client's
    connections; none: never)."""

    def __init__(self, host: str, port: int, cluster_key: ClusterKey, timeout_s: float,
                 poll: ReplyPoll | None = None) -> None:
        self.where = (host, port)
        self.poll = poll if poll is not None else ReplyPoll(0.0)
        self.address = ""  # the master's ZeroMQ address this port belongs to (the caller's to set)
        self._key = cluster_key
        self.timeout_s = timeout_s
        self._sock = socket.create_connection(self.where, timeout=timeout_s)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(self._sock, timeout_s, timeout_s)  # BlockingIOError past it
            nonce, hello = QUERY_HELLO.opening()
            self._sock.sendall(hello)
            answer = _recv_exactly(self._sock, QUERY_HELLO.ANSWER.size)
            if answer is None:
                raise errors.TransferError("the query port closed the connection")
            challenge = QUERY_HELLO.check_answer(
                answer, nonce, lambda nonce, proof: cluster_key.check_query_proof(b"server", nonce, proof))
            self._sock.sendall(cluster_key.query_proof(b"client", challenge))
        except BaseException:
            self._sock.close()
            raise

    def call(self, frame: bytes) -> bytes:
        """Send one request frame and return the reply frame."""
        mark = self.poll.mark()
        write_frame(self._sock, frame)
        reply = read_frame(self._sock, self.poll, mark)
        if reply is None:
            raise errors.TransferError("the query port closed the connection")
        return reply

    def close(self) -> None:
        self._sock.close()


class QueryPorts:
    """A master client's questions on masters' query ports: one :class:`QueryClient` per calling
    thread, for the master it last asked. A master's port is learned with the ``port_of()`` a
    question brings (a ping over ZeroMQ to the master being asked; 0: it has none; passed with
    each question, so this object holds no reference back to its client), and asked for again
    :data:`_RETRY_S` after it was missing or unusable, or at once after a connection broke (a
    master that restarted has a new port). ``following``: the client follows a leader in
    etcd, so a port that does not answer in ``timeout_s`` is left for the ZeroMQ call (which
    looks for a new leader) instead of raising MasterUnreachableError."""

    def __init__(self, cluster_key: ClusterKey, timeout_s: float, *, following: bool = False,
                 poll_s: float = 0.0) -> None:
        self.cluster_key = cluster_key
        self.timeout_s = timeout_s
        self.following = following
        self.poll = ReplyPoll(poll_s)  # answers polled for before blocking (see ReplyPoll)
        self.calls = 0  # questions answered here
        self._local = threading.local()
        self._ports: dict[str, tuple[int, float]] = {}  # master -> (its port, 0: none; when to ask again)
        self._clients: weakref.WeakSet[QueryClient] = weakref.WeakSet()
        self._ids = itertools.count(1)

    def ask(self, address: str, op: str, body: Mapping[str, Any], port_of: Callable[[], int]) -> Any:
        """``op`` answered on the query port of the master at ``address``, or None: ask over
        ZeroMQ (no port, or it failed: a master that restarted, a standby, an error the ZeroMQ
        call will name)."""
        conn: QueryClient | None = getattr(self._local, "conn", None)
        if conn is not None and conn.address != address:
            conn.close()
            conn = self._local.conn = None
        if conn is None:
            conn = self._open(address, op, port_of)
            if conn is None:
                return None
        request_id = next(self._ids)
        frame = P.pack_request(request_id, op, body)
        if len(frame) > MAX_QUERY_BYTES:  # a batch this large is asked over ZeroMQ
            return None
        try:
            reply_id, ok, reply = P.unpack_reply(conn.call(frame), op)
            if reply_id != request_id:
                raise errors.ProtocolError(f"query reply {reply_id!r:.40} to request {request_id}")
        except (OSError, errors.KVPoolError) as exc:
            conn.close()
            self._local.conn = None
            self._ports[address] = (0, time.monotonic())  # asked for afresh at the next question
            self._unanswered(op, address, exc)
            log.debug("master query port %s:%d: %s; asking over ZeroMQ", *conn.where, exc)
            return None
        if not ok:
            return None
        self.calls += 1
        return reply

    def close(self) -> None:
        for conn in list(self._clients):
            conn.close()
        self._local = threading.local()

    def _open(self, address: str, op: str, port_of: Callable[[], int]) -> QueryClient | None:
        """A connection to ``address``'s query port for this thread, or None."""
        port, retry_at = self._ports.get(address, (0, 0.0))
        if not port:
            if time.monotonic() < retry_at:
                return None
            # Its errors (unreachable, refused key) are the ones the ZeroMQ call would raise.
            try:
                port = port_of()
            except errors.MasterUnreachableError as exc:
                raise errors.MasterUnreachableError(str(exc).replace(f" answer {P.PING} ", f" answer {op} ")) from None
            self._ports[address] = (port, time.monotonic() + _RETRY_S)
            if not port:
                return None
        try:
            conn = QueryClient(query_host(address), port, self.cluster_key, self.timeout_s, self.poll)
        except (OSError, errors.KVPoolError) as exc:
            self._ports[address] = (0, time.monotonic() + _RETRY_S)
            self._unanswered(op, address, exc)
            log.debug("master query port %s:%d unusable: %s", query_host(address), port, exc)
            return None
        conn.address = address
        self._local.conn = conn
        self._clients.add(conn)
        return conn

    def _unanswered(self, op: str, address: str, exc: BaseException) -> None:
        """A query port that took the whole deadline: MasterUnreachableError, as the ZeroMQ call
        would raise after as long again (following a leader, the ZeroMQ call looks for a new one
        instead)."""
        if isinstance(exc, (BlockingIOError, TimeoutError)) and not self.following:
            raise errors.MasterUnreachableError(
                f"master at {address} did not answer {op} within {self.timeout_s:.3g} s") from None


def write_frame(sock: socket.socket, frame: bytes) -> None:
    if len(frame) > MAX_QUERY_BYTES:
        raise errors.RequestTooLargeError(f"{len(frame)}-byte query frame (at most {MAX_QUERY_BYTES})")
    sock.sendall(_LENGTH.pack(len(frame)) + frame)


def read_frame(sock: socket.socket, poll: ReplyPoll | None = None, mark: int = 0) -> bytes | None:
    """The next length-prefixed frame; None if the stream ended cleanly before it. One ``recv``
    brings a small frame whole (neither end sends a second frame before the answer); it is
    polled for first with ``poll`` (``mark``: its mark before the request was sent)."""
    buf = bytearray(_FIRST_READ)
    got = poll.receive(sock, [buf], mark) if poll is not None else None
    if got is None:
        got = sock.recv_into(buf)
    if got == 0:
        return None
    while got < _LENGTH.size:
        n = sock.recv_into(memoryview(buf)[got:])
        if n == 0:
            raise errors.ProtocolError("connection closed mid-frame")
        got += n
    (length,) = _LENGTH.unpack_from(buf)
    if length > MAX_QUERY_BYTES:
        raise errors.ProtocolError(f"{length}-byte query frame (at most {MAX_QUERY_BYTES})")
    end = _LENGTH.size + length
    if got > end:
        raise errors.ProtocolError("a second frame before the answer to the first")
    if got == end:
        return bytes(buf[_LENGTH.size:end])
    rest = _recv_exactly(sock, end - got)
    if rest is None:
        raise errors.ProtocolError("connection closed mid-frame")
    return bytes(buf[_LENGTH.size:got]) + rest


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes | None:
    """``nbytes`` from ``sock``; None if it ended before the first byte."""
    buf = bytearray(nbytes)
    return bytes(buf) if recv_exactly(sock, memoryview(buf), at_boundary=True) else None


def query_host(endpoint: str) -> str:
    """The host a master bound at ``endpoint`` (``tcp://HOST:PORT``) binds its query port on."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return "0.0.0.0" if host in ("*", "") else host

