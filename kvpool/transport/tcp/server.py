"""The holder's end of TCP pulls (see :mod:`kvpool.transport.tcp`)."""

from __future__ import annotations

import logging
import mmap
import socket
import threading
import time
from collections.abc import Callable

from kvpool import errors
from kvpool.transport.answer import decide, provide
from kvpool.transport.engine import describe
from kvpool.transport.frames import (
    MAX_ADDRESS_BYTES,
    MAX_KEY_BYTES,
    MAX_TOKEN_BYTES,
    REQUEST,
    STATUS_MISS,
    STATUS_UNAUTHORIZED,
    Request,
    parse_request,
)
from kvpool.transport.source import Provider, ServeSource
from kvpool.transport.staging import staged_pieces, staging_buffer
from kvpool.transport.tcp.admission import Admission, OpeningLoop, connection_cap
from kvpool.transport.tcp.stream import (
    PULL_HELLO,
    ReplyPoll,
    listen_on,
    send_views,
    set_timeouts,
    shutdown,
)

log = logging.getLogger("kvpool.transport.tcp")

_STAGING_NBYTES = 4 << 20  # nvme payloads are read and sent in pieces of at most this
# Requests are read into a buffer of this size, as many as have arrived at once (pipelined
# ones); it holds the largest request a client may send.
_REQUESTS_NBYTES = 16 << 10
# Pipelined requests already received are answered with one send while their payloads add up
# to less than _COALESCE_NBYTES (at most _ANSWERS_PER_SEND of them, pinned until it returns):
# one sendmsg, one push through the stack, one wake-up of the reader for several small objects.
# Measured (bench/hicache_bench.py, 256 KiB objects, 128-page gets over loopback TCP): 37 ms a
# call answering one at a time, 28.5 ms coalescing up to 1 MiB, 30-31 ms up to 512 KiB or 2 MiB;
# coalescing 1 MiB objects 16 at a time made their gets slower (87 -> 108 ms), so a request
# of 1 MiB or more is answered alone, as before.
_ANSWERS_PER_SEND = 16
_COALESCE_NBYTES = 1 << 20
assert _REQUESTS_NBYTES >= REQUEST.size + MAX_KEY_BYTES + MAX_TOKEN_BYTES + MAX_ADDRESS_BYTES


class TcpPullServer:
    """Serves ``(key, layer range)`` pulls over TCP on ``host`` (an ephemeral port).

    ``provider`` and ``authorize`` are the node's, as for :class:`PullServer`; here they run
    on the connection's own thread, so a provider may block. ``release`` of a source runs
    once the send that carried its last byte returned (or the connection failed): pipelined
    requests for small objects that arrived together are answered with one send.
    ``prove``: the answer to a client's hello nonce (16 bytes; zeros when None).
    ``trust(nonce, proof)``: whether a client's answer to this server's nonce proves it holds
    the cluster key (:meth:`ClusterKey.check_reader_proof`); such a client may mint tokens
    anyway, so its requests are served without ``authorize``. Any other client's requests are authorized
    one by one. ``poll_s``: after answering, a connection's thread polls for the next request
    this long before it blocks (:class:`ReplyPoll`, without the GIL where kvpool._poll is
    built; one connection at a time; 0: never).
    """

    def __init__(self, provider: Provider, host: str = "127.0.0.1", *,
                 authorize: Callable[[bytes, bytes], None] | None = None,
                 prove: Callable[[bytes], bytes] | None = None,
                 trust: Callable[[bytes, bytes], bool] | None = None, max_connections: int | None = None,
                 send_timeout_s: float = 30.0, idle_timeout_s: float = 600.0, hello_timeout_s: float = 3.0,
                 max_unproven_per_address: int = 16, limit_unproven: bool | None = None,
                 staging_nbytes: int = _STAGING_NBYTES, name: str = "kvpool-tcp-pulls",
                 poll_s: float = 0.0) -> None:
        self._provider = provider
        self.poll = ReplyPoll(poll_s)  # shared by the connections' threads
        self._authorize = authorize
        self._prove = prove
        self._trust = trust
        self._host = host
        # Connections (each a descriptor and a thread) are admitted under a cap sized from the
        # process's descriptor limit; unproven ones (no cluster key shown yet) are few and cut
        # first (:class:`Admission`), so they never take what the master link needs.
        self.admission = Admission(connection_cap(0.5, 1024) if max_connections is None else max_connections,
                                   max_unproven_per_address=max_unproven_per_address)
        #: whether a connection whose peer did not prove the key stays cuttable after its hello
        #: (default: when ``trust`` is given, i.e. the node holds a key)
        self.limit_unproven = trust is not None if limit_unproven is None else limit_unproven
        self.send_timeout_s = send_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.hello_timeout_s = hello_timeout_s  # an opening must be complete this soon after connecting
        self.staging_nbytes = staging_nbytes  # an nvme payload is read and sent in pieces of this
        self._name = name
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._openings: OpeningLoop | None = None
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
        self.connections_trusted = 0  # whose client proved the cluster key

    @property
    def max_connections(self) -> int:
        return self.admission.max_connections

    @max_connections.setter
    def max_connections(self, value: int) -> None:
        self.admission.max_connections = value

    def start(self) -> TcpPullServer:
        # A deep backlog: a burst of connections (a flood without the key) queues rather than
        # dropping a keyed peer's SYN, while the opening loop accepts and cuts them.
        self._listener = listener = listen_on(self._host, backlog=1024)
        self.port = listener.getsockname()[1]
        self._openings = OpeningLoop(listener, PULL_HELLO, self._prove, self.admission, self.hello_timeout_s,
                                     self._opened, lambda: self._closing)
        self._accepter = threading.Thread(target=self._openings.run, name=f"{self._name}-accept", daemon=True)
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
            shutdown(self._listener)
            self._listener.close()
        for conn in connections:
            shutdown(conn)
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
        openings = self._openings
        malformed, timed_out = (openings.malformed, openings.timed_out) if openings is not None else (0, 0)
        return {"bytes_sent": self.bytes_sent, "requests_served": self.requests_served, "misses": self.misses,
                "errors": self.errors + malformed, "refused": self.refused, "connections": open_connections,
                "openings_timed_out": timed_out,
                "connections_trusted": self.connections_trusted, **self.admission.stats(), **self.poll.stats()}

    # -- connections -------------------------------------------------------------------------

    def _opened(self, conn: socket.socket, nonce: bytes, proof: bytes) -> None:
        """A connection whose opening is complete (on the opening loop's thread): its own thread."""
        with self._lock:
            closing = self._closing
            if not closing:
                self._connections.add(conn)
        if closing:
            conn.close()
            self.admission.release(conn)
            return
        thread = threading.Thread(target=self._serve, args=(conn, nonce, proof), name=f"{self._name}-conn",
                                  daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _serve(self, conn: socket.socket, nonce: bytes, proof: bytes) -> None:
        staging: list[mmap.mmap] = []
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            trusted = self._trust is not None and self._trust(nonce, proof)
            self.connections_trusted += trusted
            if trusted or not self.limit_unproven:
                self.admission.proven(conn)
            set_timeouts(conn, self.idle_timeout_s, self.send_timeout_s)
            authorize = None if trusted else self._authorize
            requests = _Requests(conn, self.poll)
            while True:
                request = requests.next()
                if request is None:
                    return  # the client closed between requests
                batch = [request]  # small pipelined requests already here: answered together
                nbytes = request.capacity
                while len(batch) < _ANSWERS_PER_SEND and nbytes < _COALESCE_NBYTES and requests.ready():
                    more = requests.next()
                    assert more is not None  # (ready: a whole request is here)
                    batch.append(more)
                    nbytes += more.capacity
                self._answer(conn, batch, staging, authorize)
        except (OSError, errors.KVPoolError) as exc:  # BlockingIOError: idle or stuck past a timeout
            if not self._closing:
                log.debug("tcp pull connection dropped: %s", describe(exc))
            self.errors += isinstance(exc, errors.ProtocolError)
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()
            self.admission.release(conn)
            for buf in staging:
                buf.close()

    def _answer(self, conn: socket.socket, batch: list[Request], staging: list[mmap.mmap],
                authorize: Callable[[bytes, bytes], None] | None) -> None:
        """Answer one request, or several that arrived together, in order: the answers whose
        payload is in memory go out in as few ``sendmsg`` calls as the socket takes (one system
        call and one push through the stack for many answers, not one each); an nvme payload
        (read while it is sent) flushes what is pending first. Every source is released once
        the send that carried it returned or failed."""
        views: list[memoryview] = []
        held: list[object] = []  # outcomes to release after the send
        served = sent = 0
        try:
            for request in batch:
                outcome = provide(request, self._provider, authorize)
                held.append(outcome)
                answer = decide(request, outcome)
                if not answer.ok:
                    self.misses += answer.status == STATUS_MISS
                    self.refused += answer.status == STATUS_UNAUTHORIZED
                    self.errors += answer.is_error
                    views.append(memoryview(answer.frame(request.request_id)))
                    continue
                source = answer.source
                assert source is not None
                if source.read_into is not None:
                    send_views(conn, views)  # (empties it)
                    conn.sendall(answer.frame(request.request_id))
                    self._send_read(conn, source, staging)
                else:
                    views.append(memoryview(answer.frame(request.request_id)))
                    views.extend(source.buffers)
                served += 1
                sent += source.nbytes
            send_views(conn, views)
            self.requests_served += served
            self.bytes_sent += sent
        finally:
            for outcome in held:
                if isinstance(outcome, ServeSource) and outcome.release is not None:
                    try:
                        outcome.release()
                    except Exception:
                        log.exception("releasing a served object failed")

    def _send_read(self, conn: socket.socket, source: ServeSource, staging: list[mmap.mmap]) -> None:
        """Send a payload read while it is sent; a failed or short read cuts the connection."""
        if not staging:
            staging.append(staging_buffer(self.staging_nbytes))
        pieces = staged_pieces(source, staging[0], self.staging_nbytes)
        try:
            for piece in pieces:
                conn.sendall(piece)
        except errors.TransferError:  # the read's (a failed send is an OSError)
            self.errors += 1
            raise
        finally:
            pieces.close()


class _Requests:
    """The requests arriving on one connection, read into one buffer: one ``recv`` brings
    every request a client pipelined at once, and each is parsed from there. The wait for
    the next request is polled first (``poll``)."""

    def __init__(self, conn: socket.socket, poll: ReplyPoll | None = None) -> None:
        self.conn = conn
        self.poll = poll
        self.buf = bytearray(_REQUESTS_NBYTES)
        self.view = memoryview(self.buf)
        self.start = 0  # the next request begins here
        self.end = 0  # bytes received up to here

    def next(self) -> Request | None:
        """The next request; None if the client closed the connection between requests."""
        if not self._have(REQUEST.size, at_boundary=True):
            return None
        fields = REQUEST.unpack_from(self.buf, self.start)
        key_len, addr_len, token_len = fields[3], fields[4], fields[13]
        if key_len > MAX_KEY_BYTES or token_len > MAX_TOKEN_BYTES or addr_len > MAX_ADDRESS_BYTES:
            raise errors.ProtocolError("request key, token or address too long")
        size = REQUEST.size + key_len + token_len + addr_len
        self._have(size)
        request = parse_request(self.buf, self.start)
        self.start += size
        if self.start == self.end:  # all read: the next recv fills the buffer from its start
            self.start = self.end = 0
        return request

    def ready(self) -> bool:
        """Whether a whole request is buffered already (:meth:`next` would not wait for it)."""
        have = self.end - self.start
        if have < REQUEST.size:
            return False
        fields = REQUEST.unpack_from(self.buf, self.start)
        size: int = REQUEST.size + fields[3] + fields[4] + fields[13]  # key, address, token
        return have >= size

    def _have(self, nbytes: int, at_boundary: bool = False) -> bool:
        """At least ``nbytes`` unread bytes in the buffer (moved to its front when the rest of
        a request would not fit behind them)."""
        while self.end - self.start < nbytes:
            if self.start and self.start + nbytes > len(self.buf):
                pending = self.end - self.start
                self.buf[:pending] = self.buf[self.start:self.end]
                self.start, self.end = 0, pending
            got = None
            if self.poll is not None and self.poll.poll_s and at_boundary and self.end == self.start:
                got = self.poll.receive(self.conn, [self.view[self.end:]], self.poll.mark())
            if got is None:
                got = self.conn.recv_into(self.view[self.end:])
            if got == 0:
                if at_boundary and self.end == self.start:
                    return False
                raise errors.ProtocolError("connection closed mid-request")
            self.end += got
        return True
