"""Pulls over a plain TCP connection (:class:`TcpPullServer`, :class:`TcpPullClient`): the data
path for payloads up to ``node.tcp_pull_max``.

Why a second data path
    Where UCX itself runs over TCP or shared memory (no RDMA device), a small pull over it
    from Python costs several wake-ups of each side's progress thread: a bare ucxx
    request/reply measured 141 us at 4 KiB and 281 us at 64 KiB between two pinned processes
    here, against 58 / 71 us for the same exchange over a blocking TCP socket (see
    ``bench/transfer_bench.py``). From 16 MiB on, UCX over shared memory is faster than a
    socket, and RDMA is what UCX is for: large payloads stay on UCX.

Wire (the UCX protocol's frames over one byte stream, :mod:`.frames`)
    A client keeps connections to a holder open and writes requests (``_REQUEST`` + key +
    token, no reply address) on one; the server answers each request, in the order sent, with
    a status frame (``_STATUS`` + failure text, or for an OK the served object's header when
    asked for) followed, for an OK, by exactly ``nbytes`` payload bytes. A read that fails
    after its OK went out (nvme) closes the connection, so the client sees the stream end
    short and fails that pull: nothing is ever taken for payload that was not. A client that
    stops reading for ``send_timeout_s`` is dropped.

Threads
    The server has one thread accepting and one per open connection, each blocked in
    ``recv`` or ``send`` (no polling). The client has none: the calling thread writes
    its requests and reads the replies, waking every ``alive_check_s`` to ask whether the
    holder is still alive. Connections are kept per holder, one per concurrent caller.

Security
    The server binds ``host`` only (the node's address). A client opens every connection
    with a hello carrying a fresh nonce, sent together with its first requests; the server
    answers it with ``prove(nonce)`` before any reply, and the client reads no reply before
    ``check_proof`` accepted that (:meth:`ClusterKey.holder_proof`): a process that took over
    a dead holder's port cannot hand out bytes. Every request carries the pull token that
    ``authorize(key, token)`` checks before the provider runs, as over UCX; a refusal is
    ``STATUS_UNAUTHORIZED``, never data. The bytes are not encrypted.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool import errors
from kvpool.transport.engine import _describe
from kvpool.transport.frames import (
    _MAX_ADDRESS_BYTES,
    _MAX_KEY_BYTES,
    _MAX_TOKEN_BYTES,
    _REQUEST,
    _STATUS,
    MAX_HEADER_NBYTES,
    OK_STATUSES,
    STATUS_BAD_RANGE,
    STATUS_ERROR,
    STATUS_MISS,
    STATUS_OK,
    STATUS_OUT_TOO_SMALL,
    STATUS_UNAUTHORIZED,
    PeerAddress,
    _pack_request,
    _pack_status,
    _parse_request,
    _parse_status,
    _Request,
    status_error,
)
from kvpool.transport.pulls import PullRequest, checked_pull
from kvpool.transport.source import Provider, ServeSource

log = logging.getLogger("kvpool.transport.tcp")

_STAGING_NBYTES = 4 << 20  # nvme payloads are read and sent in pieces of at most this
_WINDOW_NBYTES = 32 << 10  # request bytes a client writes ahead of the replies it has read
# A connection's first frame each way: the client's nonce, then the server's proof for it.
_HELLO = struct.Struct("<4sH16s")
_HELLO_MAGIC = b"KVTH"
_HELLO_VERSION = 1


class TcpPathUnusable(errors.TransferError):
    """A holder's TCP port could not be used: connecting timed out, or a new connection was
    closed before its first reply (the holder is at its connection limit). The holder may
    still serve the pull over UCX. A refused connection (nothing listens: the holder is gone)
    is a plain :class:`errors.TransferError`."""


class TcpPullServer:
    """Serves ``(key, layer range)`` pulls over TCP on ``host`` (an ephemeral port).

    ``provider`` and ``authorize`` are the node's, as for :class:`PullServer`; here they run
    on the connection's own thread, so a provider may block. ``release`` of a source runs
    once its last byte is written (or the connection failed). ``prove``: the answer to a
    client's hello nonce (16 bytes; zeros when None).
    """

    def __init__(self, provider: Provider, host: str = "127.0.0.1", *,
                 authorize: Callable[[bytes, bytes], None] | None = None,
                 prove: Callable[[bytes], bytes] | None = None, max_connections: int = 1024,
                 send_timeout_s: float = 30.0, idle_timeout_s: float = 600.0,
                 staging_nbytes: int = _STAGING_NBYTES, name: str = "kvpool-tcp-pulls") -> None:
        self._provider = provider
        self._authorize = authorize
        self._prove = prove
        self._host = host
        self.max_connections = max_connections
        self.send_timeout_s = send_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.staging_nbytes = staging_nbytes  # an nvme payload is read and sent in pieces of this
        self._name = name
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()  # serving a connection
        self._closing = False
        self.port = 0
        self.bytes_sent = 0
        self.requests_served = 0
        self.misses = 0
        self.errors = 0
        self.refused = 0
        self.connections_refused = 0

    def start(self) -> TcpPullServer:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((self._host, 0))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name=f"{self._name}-accept", daemon=True)
        self._accepter.start()
        return self

    def close(self) -> None:
        """Stop accepting and cut every open connection (its pulls fail at the client)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            connections = list(self._connections)
        if self._listener is not None:
            _shutdown(self._listener)
            self._listener.close()
        for conn in connections:
            _shutdown(conn)
        if self._accepter is not None:
            self._accepter.join(timeout=5.0)
        # A connection's thread may be in the provider or a read: it releases what it pinned
        # before the node's tiers close (bounded: a provider stuck longer is left behind).
        deadline = time.monotonic() + 5.0
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> TcpPullServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            open_connections = len(self._connections)
        return {"bytes_sent": self.bytes_sent, "requests_served": self.requests_served, "misses": self.misses,
                "errors": self.errors, "refused": self.refused, "connections": open_connections,
                "connections_refused": self.connections_refused}

    # -- connections -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                time.sleep(0.01)  # out of descriptors, or an aborted handshake: go on
                continue
            with self._lock:
                full = len(self._connections) >= self.max_connections
                if not full and not self._closing:
                    self._connections.add(conn)
            if full or self._closing:
                self.connections_refused += full
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn", daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        staging: list[mmap.mmap] = []
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.settimeout(self.idle_timeout_s)
            hello = bytearray(_HELLO.size)
            if not _recv_exactly(conn, memoryview(hello), at_boundary=True):
                return
            magic, version, nonce = _HELLO.unpack(hello)
            if magic != _HELLO_MAGIC or version != _HELLO_VERSION:
                self.errors += 1
                raise errors.ProtocolError(f"not a kvpool TCP pull hello ({bytes(hello[:6])!r})")
            proof = self._prove(nonce) if self._prove is not None else bytes(16)
            conn.sendall(_HELLO.pack(_HELLO_MAGIC, _HELLO_VERSION, proof))
            fixed = bytearray(_REQUEST.size)
            while True:
                conn.settimeout(self.idle_timeout_s)
                if not _recv_exactly(conn, memoryview(fixed), at_boundary=True):
                    return  # the client closed between requests
                request = self._read_request(conn, fixed)
                conn.settimeout(self.send_timeout_s)
                self._answer(conn, request, staging)
        except (OSError, errors.KVPoolError) as exc:
            if not self._closing:
                log.debug("tcp pull connection dropped: %s", _describe(exc))
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()
            for buf in staging:
                buf.close()

    def _read_request(self, conn: socket.socket, fixed: bytearray) -> _Request:
        fields = _REQUEST.unpack_from(fixed)
        key_len, addr_len, token_len = fields[3], fields[4], fields[13]
        if key_len > _MAX_KEY_BYTES or token_len > _MAX_TOKEN_BYTES or addr_len > _MAX_ADDRESS_BYTES:
            self.errors += 1
            raise errors.ProtocolError("request key, token or address too long")
        frame = fixed + bytearray(key_len + token_len + addr_len)
        _recv_exactly(conn, memoryview(frame)[_REQUEST.size:])
        try:
            return _parse_request(frame)
        except errors.ProtocolError:
            self.errors += 1
            raise

    def _answer(self, conn: socket.socket, request: _Request, staging: list[mmap.mmap]) -> None:
        def refuse(status: int, text: str) -> None:
            conn.sendall(_pack_status(request.request_id, status, 0, 0, text))

        try:
            if self._authorize is not None:
                self._authorize(request.key, request.token)
            source = self._provider(request.key, request.layer_range)
        except errors.AuthenticationError as exc:
            self.refused += 1
            return refuse(STATUS_UNAUTHORIZED, str(exc))
        except Exception as exc:
            self.errors += 1
            return refuse(STATUS_BAD_RANGE if isinstance(exc, errors.LayerRangeError) else STATUS_ERROR,
                          _describe(exc))
        if source is None:
            self.misses += 1
            return refuse(STATUS_MISS, f"key {request.key.hex()} not held here")
        if not isinstance(source, ServeSource):
            self.errors += 1
            return refuse(STATUS_ERROR, f"provider returned {type(source).__name__}")
        try:
            if source.nbytes > request.capacity:
                return refuse(STATUS_OUT_TOO_SMALL,
                              f"payload is {source.nbytes} bytes, out buffer holds {request.capacity}")
            header = source.header if request.want_header else b""
            if request.want_header and not 0 < len(header) <= MAX_HEADER_NBYTES:
                self.errors += 1
                return refuse(STATUS_ERROR, f"no header to send ({len(header)} bytes)")
            status = _pack_status(request.request_id, STATUS_OK, source.nbytes, source.nbytes, "", body=header)
            if source.read_into is None:
                _send_all(conn, [memoryview(status), *source.buffers])
            else:
                conn.sendall(status)
                self._send_read(conn, source, staging)
            self.requests_served += 1
            self.bytes_sent += source.nbytes
        finally:
            if source.release is not None:
                try:
                    source.release()
                except Exception:
                    log.exception("releasing a served object failed")

    def _send_read(self, conn: socket.socket, source: ServeSource, staging: list[mmap.mmap]) -> None:
        """Send a payload read while it is sent; a failed or short read cuts the connection."""
        assert source.read_into is not None
        if not staging:
            staging.append(mmap.mmap(-1, self.staging_nbytes))  # page-aligned, as direct I/O wants
        view = memoryview(staging[0])
        step = self.staging_nbytes
        try:
            for offset in range(0, source.nbytes, step):
                piece = view[:min(step, source.nbytes - offset)]
                try:
                    got = source.read_into(offset, piece)
                except Exception as exc:
                    self.errors += 1
                    raise errors.TransferError(f"read at {offset} failed: {_describe(exc)}") from None
                if got is not None and got != len(piece):
                    self.errors += 1
                    raise errors.TransferError(f"short read at {offset}: {got} of {len(piece)} bytes")
                conn.sendall(piece)
        finally:
            view.release()


class TcpPullClient:
    """Pulls from :class:`TcpPullServer` peers into caller buffers, on the calling thread.

    Thread-safe: each call takes its own connection to a holder (kept open for the next call
    afterwards, at most ``idle_per_peer`` per holder). Errors as :meth:`PullClient.pull_into`.
    A holder whose port cannot be connected to, or which closes a new connection unasked
    (over its connection limit), is :meth:`reachable` no more for ``retry_after_s``: callers
    pull from it over UCX meanwhile. ``check_proof(nonce, proof)``: whether a holder's answer
    to a new connection's hello proves it is one (:meth:`ClusterKey.check_holder_proof`); a
    holder that fails it gets no pull (AuthenticationError). None: holders are not checked.
    """

    def __init__(self, *, connect_timeout_s: float = 1.0, idle_per_peer: int = 8,
                 retry_after_s: float = 30.0, check_proof: Callable[[bytes, bytes], bool] | None = None) -> None:
        self.check_proof = check_proof
        self.connect_timeout_s = connect_timeout_s
        self.idle_per_peer = idle_per_peer
        self.retry_after_s = retry_after_s
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._unreachable: dict[tuple[str, int], float] = {}  # holder -> when to try it again
        self._lock = threading.Lock()
        self._closed = False
        self.pulls = 0
        self.failures = 0
        self.timeouts = 0
        self.bytes_received = 0
        self.connects = 0

    def pull_into(self, address: PeerAddress, key: bytes, layer_range: Any, out: Any, *,
                  timeout_s: float = 10.0, alive: Callable[[], bool] | None = None,
                  alive_check_s: float = 0.05, token: bytes = b"", header_out: bytearray | None = None) -> int:
        """As :meth:`PullClient.pull_into`, over the holder's TCP port (``address.tcp_port``)."""
        (outcome,) = self.pull_many([PullRequest(address, key, layer_range, out, token, header_out, alive)],
                                    timeout_s=timeout_s, alive_check_s=alive_check_s)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def pull_many(self, requests: Sequence[PullRequest], *, timeout_s: float = 10.0,
                  alive_check_s: float = 0.05) -> list[int | BaseException]:
        """As :meth:`PullClient.pull_many`: one result per request, in order. The requests to one
        holder go out on one connection, pipelined; holders are read one after another."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        results: list[int | BaseException | None] = [None] * len(requests)
        groups: dict[tuple[str, int], list[tuple[int, _TcpPull]]] = {}
        for i, request in enumerate(requests):
            try:
                if self._closed:
                    raise errors.PoolClosedError("the TCP pull client is closed")
                pull = _TcpPull(request, timeout_s)
            except (errors.KVPoolError, ValueError, TypeError) as exc:
                results[i] = exc
                continue
            groups.setdefault(pull.where, []).append((i, pull))
        for where, group in groups.items():
            for (i, _), outcome in zip(group, self._pull_group(where, [pull for _, pull in group], alive_check_s)):
                results[i] = outcome
        return results  # type: ignore[return-value]

    def reachable(self, address: PeerAddress) -> bool:
        """Whether ``address`` serves TCP pulls that this client can reach (see the class)."""
        if not address.tcp_port:
            return False
        until = self._unreachable.get((address.host, address.tcp_port))
        return until is None or time.monotonic() >= until

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def __enter__(self) -> TcpPullClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        return {"pulls": self.pulls, "failures": self.failures, "timeouts": self.timeouts,
                "bytes_received": self.bytes_received, "connects": self.connects}

    # -- one holder ------------------------------------------------------------------------------

    def _pull_group(self, where: tuple[str, int], pulls: list[_TcpPull],
                    alive_check_s: float) -> list[int | BaseException]:
        """Every pull to one holder over one connection. A reused connection that fails before
        its first reply byte (the holder closed it while idle) is replaced once: reads repeat."""
        conn, nonce = self._checkout(where, pulls[0])
        outcomes: list[int | BaseException] = []
        while True:
            if not isinstance(conn, socket.socket):
                self._unreachable[where] = time.monotonic() + self.retry_after_s
                error = (errors.TransferError if isinstance(conn, ConnectionRefusedError) else TcpPathUnusable)
                return [self._failed(pull, error(f"{pull.label}: TCP port unusable: {_describe(conn)}"))
                        for pull in pulls]
            try:
                self._exchange(conn, pulls, outcomes, alive_check_s, nonce)
            except _ConnectionLost as lost:
                conn.close()
                if not lost.replied and not outcomes:
                    if nonce is None:  # an idle one, closed by the holder meanwhile: once more on a new one
                        conn, nonce = self._checkout(where, pulls[0], fresh=True)
                        continue
                    if type(lost.error) is errors.TransferError:  # a new one closed unasked: full
                        conn = ConnectionAbortedError("closed before its first reply")
                        continue
                failed = pulls[len(outcomes):]
                outcomes += [self._failed(pull, lost.error if pull is failed[0] else errors.TransferError(
                    f"{pull.label}: connection lost during an earlier pull on it")) for pull in failed]
                return outcomes
            self._checkin(where, conn)
            return outcomes

    def _exchange(self, conn: socket.socket, pulls: list[_TcpPull], outcomes: list[int | BaseException],
                  alive_check_s: float, nonce: bytes | None) -> None:
        """Write the requests (at most ``_WINDOW_NBYTES`` ahead of the replies read, so neither
        side can block the other) and read each reply into its pull's buffer. ``nonce``: that
        of a new connection's hello, whose answer is read and checked before any reply."""
        sent = 0
        window = 0
        for index, pull in enumerate(pulls):
            while sent < len(pulls) and (sent == index or window + len(pulls[sent].frame) <= _WINDOW_NBYTES):
                try:
                    conn.settimeout(max(1e-3, pulls[sent].deadline - time.monotonic()))
                    conn.sendall(pulls[sent].frame)
                except OSError as exc:
                    raise _ConnectionLost(_transport_error(pull, exc), replied=False) from None
                window += len(pulls[sent].frame)
                sent += 1
            if nonce is not None:
                self._check_hello(conn, pull, nonce, alive_check_s)
                nonce = None
            outcomes.append(self._reply(conn, pull, alive_check_s, replied=bool(outcomes)))
            window -= len(pull.frame)

    def _check_hello(self, conn: socket.socket, pull: _TcpPull, nonce: bytes, alive_check_s: float) -> None:
        """Read the holder's answer to a new connection's hello; a wrong one ends the connection."""
        hello = bytearray(_HELLO.size)
        _receive(conn, pull, memoryview(hello), alive_check_s, False)
        magic, version, proof = _HELLO.unpack(hello)
        if magic != _HELLO_MAGIC or version != _HELLO_VERSION:
            raise _ConnectionLost(errors.ProtocolError(f"{pull.label}: not a kvpool TCP pull server"), replied=True)
        if self.check_proof is not None and not self.check_proof(nonce, proof):
            raise _ConnectionLost(errors.AuthenticationError(
                f"{pull.label}: the server there could not prove it holds the cluster key"), replied=True)

    def _reply(self, conn: socket.socket, pull: _TcpPull, alive_check_s: float, replied: bool) -> int | BaseException:
        status_buf = bytearray(_STATUS.size)
        _receive(conn, pull, memoryview(status_buf), alive_check_s, replied)
        frame = status_buf + bytearray(_STATUS.unpack_from(status_buf)[3])  # + its text or header (< 64 KiB)
        _receive(conn, pull, memoryview(frame)[_STATUS.size:], alive_check_s, True)
        parsed = _parse_status(frame, pull.request_id)
        if parsed is None:
            raise _ConnectionLost(errors.ProtocolError(f"{pull.label}: malformed status frame"), replied=True)
        status, nbytes, _, body = parsed
        if status not in OK_STATUSES:
            return self._failed(pull, status_error(status)(f"{pull.label}: {body.decode('utf-8', 'replace')}"))
        if nbytes > pull.out.nbytes:
            raise _ConnectionLost(errors.ProtocolError(f"{pull.label}: {nbytes} bytes for a "
                                                       f"{pull.out.nbytes}-byte buffer"), replied=True)
        _receive(conn, pull, pull.out[:nbytes], alive_check_s, True)
        if pull.header_out is not None:
            if not body or len(body) > pull.header_room:
                return self._failed(pull, errors.ProtocolError(f"{pull.label}: OK without a usable header"))
            pull.header_out[:] = body
        self.pulls += 1
        self.bytes_received += nbytes
        return nbytes

    def _failed(self, pull: _TcpPull, exc: BaseException) -> BaseException:
        self.failures += 1
        self.timeouts += isinstance(exc, errors.KVTimeoutError)
        return exc


    def _checkout(self, where: tuple[str, int], pull: _TcpPull,
                  fresh: bool = False) -> tuple[socket.socket | OSError, bytes | None]:
        """A connection to ``where`` (an idle one unless ``fresh``) and, for a new one, the
        nonce of the hello sent on it; or why none could be made."""
        if not fresh:
            with self._lock:
                idle = self._idle.get(where)
                if idle:
                    return idle.pop(), None
        nonce = os.urandom(16)
        try:
            conn = socket.create_connection(where, timeout=min(self.connect_timeout_s, pull.timeout_s))
        except OSError as exc:
            log.debug("tcp pull connect to %s:%d failed: %s", *where, _describe(exc))
            return exc, None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(_HELLO.pack(_HELLO_MAGIC, _HELLO_VERSION, nonce))  # answered before the first reply
        except OSError as exc:
            conn.close()
            return exc, None
        self.connects += 1
        return conn, nonce

    def _checkin(self, where: tuple[str, int], conn: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(where, [])
            if not self._closed and len(idle) < self.idle_per_peer:
                idle.append(conn)
                return
        conn.close()


class _TcpPull:
    """One request's checked arguments, its frame and its deadline."""

    def __init__(self, request: PullRequest, timeout_s: float) -> None:
        args = checked_pull(request.address, request.key, request.layer_range, request.out, request.token,
                            request.header_out)
        self.address, self.key, self.layer_range, self.out = args.address, args.key, args.layer_range, args.out
        if not self.address.tcp_port:
            raise errors.TransferError(f"{self.address.host} serves no TCP pulls")
        self.where = (self.address.host, self.address.tcp_port)
        self.token = args.token
        self.header_out = request.header_out
        self.header_room = args.header_room
        self.alive = request.alive
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.request_id = 1
        self.label = (f"{self.address.host}:{self.address.tcp_port}: pull of {self.key.hex()} layers "
                      f"[{self.layer_range.start}, {self.layer_range.stop})")
        self.frame = bytes(_pack_request(0, 0, self, max(1, self.out.nbytes), b""))


class _ConnectionLost(Exception):
    """The connection cannot carry more replies: ``error`` for the pull being read."""

    def __init__(self, error: BaseException, replied: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.replied = replied  # some reply byte arrived on this connection before


def _transport_error(pull: _TcpPull, exc: BaseException) -> errors.KVPoolError:
    if isinstance(exc, TimeoutError):
        return errors.KVTimeoutError(f"{pull.label}: no reply within {pull.timeout_s}s")
    return errors.TransferError(f"{pull.label}: {_describe(exc)}")


def _receive(conn: socket.socket, pull: _TcpPull, view: memoryview, alive_check_s: float, replied: bool) -> None:
    """Fill ``view`` with the next bytes of ``pull``'s reply by its deadline, asking its
    ``alive`` every ``alive_check_s`` while it waits. ``replied``: some reply byte came on this
    connection before (else a closed connection may be a stale idle one, see _pull_group)."""
    while view.nbytes:
        remaining = pull.deadline - time.monotonic()
        if remaining <= 0:  # not a stale connection: never repeated
            raise _ConnectionLost(_transport_error(pull, TimeoutError()), replied=True)
        try:
            conn.settimeout(min(remaining, alive_check_s) if pull.alive else remaining)
            n = conn.recv_into(view)
        except TimeoutError:
            if pull.alive is not None and not pull.alive():
                raise _ConnectionLost(errors.TransferError(f"{pull.label}: the holder is gone"),
                                      replied=True) from None
            continue
        except OSError as exc:
            raise _ConnectionLost(_transport_error(pull, exc), replied=replied) from None
        if n == 0:
            raise _ConnectionLost(errors.TransferError(f"{pull.label}: the holder closed the connection"),
                                  replied=replied)
        replied = True
        view = view[n:]


def _recv_exactly(conn: socket.socket, view: memoryview, at_boundary: bool = False) -> bool:
    """Fill ``view`` from ``conn``; False if the stream ended before its first byte and
    ``at_boundary`` allows that, else an error."""
    first = True
    while view.nbytes:
        n = conn.recv_into(view)
        if n == 0:
            if first and at_boundary:
                return False
            raise errors.ProtocolError("connection closed mid-frame")
        first = False
        view = view[n:]
    return True


def _send_all(conn: socket.socket, views: list[memoryview]) -> None:
    """Write every view in order with as few ``sendmsg`` calls as the socket allows (no copy)."""
    while views:
        sent = conn.sendmsg(views[:64])
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

