"""The reader's end of TCP pulls (see :mod:`kvpool.transport.tcp`)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool import errors
from kvpool.objformat import LayerRange
from kvpool.transport.engine import describe
from kvpool.transport.frames import (
    OK_STATUSES,
    STATUS,
    PeerAddress,
    pack_request,
    parse_status_head,
    status_error,
)
from kvpool.transport.pulls import PullRequest, checked_out, checked_pull, checked_request, header_room
from kvpool.transport.tcp.stream import (
    PROOF_NBYTES,
    PULL_HELLO,
    ReplyPoll,
    TcpPathUnusable,
    set_timeouts,
)

log = logging.getLogger("kvpool.transport.tcp")

_WINDOW_NBYTES = 32 << 10  # request bytes a client writes ahead of the replies it has read
_REQUEST_ID = 1
# Once a reply's status and header are in, its payload is received in pieces of at most this
# many bytes, each with one blocking receive that returns when the piece is whole (MSG_WAITALL),
# and checked (``progress``) before the next. Receiving whatever had arrived instead took about
# three receives, polls and checks per 256 KiB object (bench/hicache_bench.py's 16-token TCP get).
_FILL_NBYTES = 1 << 20


class TcpPullClient:
    """Pulls from :class:`TcpPullServer` peers into caller buffers, on the calling thread.

    Thread-safe: each call takes its own connection to a holder (kept open for the next call
    afterwards, at most ``idle_per_peer`` per holder). An idle connection the holder closed
    meanwhile is never reused (one non-blocking peek at checkout), and :meth:`sweep`, run
    periodically by its owner, closes those and the ones to holders that left: a pooled
    connection outlives neither its holder's socket nor its node. Errors as :meth:`PullClient.pull_into`.
    A holder whose port cannot be connected to, or which closes a new connection unasked
    (over its connection limit), is :meth:`reachable` no more for a while: callers pull from
    it over UCX meanwhile. The while is ``first_retry_s`` after a first failure and doubles with
    each failure in a row up to ``retry_after_s``; a connection that opens ends the row (one
    dropped SYN under a flood costs seconds of TCP, not half a minute).
    ``check_proof(nonce, proof)``: whether a holder's answer to a new connection's hello
    proves it is one (:meth:`ClusterKey.check_holder_proof`); a holder that fails it gets no
    pull (AuthenticationError). None: holders are not checked.
    ``prove(nonce)``: this client's answer to the holder's nonce (:meth:`ClusterKey.reader_proof`);
    a holder that accepts it serves this connection's pulls without checking their tokens.
    None: every pull's token is checked. ``poll_s``: how long each wait for a reply's status and header
    is polled for before the caller blocks (:class:`ReplyPoll`; 0: never).
    """

    def __init__(self, *, connect_timeout_s: float = 1.0, idle_per_peer: int = 8,
                 retry_after_s: float = 30.0, first_retry_s: float = 2.0,
                 check_proof: Callable[[bytes, bytes], bool] | None = None,
                 prove: Callable[[bytes], bytes] | None = None, poll_s: float = 0.0) -> None:
        self.poll = ReplyPoll(poll_s)
        self.check_proof = check_proof
        self.prove = prove
        self.connect_timeout_s = connect_timeout_s
        self.idle_per_peer = idle_per_peer
        self.retry_after_s = retry_after_s
        self.first_retry_s = min(first_retry_s, retry_after_s)
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        # holder -> (connects failed in a row since one opened, when to try it again)
        self._failed_in_a_row: dict[tuple[str, int], tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.pulls = 0
        self.failures = 0
        self.timeouts = 0
        self.bytes_received = 0
        self.connects = 0
        self.swept = 0  # idle connections closed because their holder hung up or left

    def pull_into(self, address: PeerAddress, key: bytes, layer_range: Any, out: Any, *,
                  timeout_s: float = 10.0, alive: Callable[[], bool] | None = None,
                  alive_check_s: float = 0.05, token: bytes = b"", header_out: bytearray | None = None) -> int:
        """As :meth:`PullClient.pull_into`, over the holder's TCP port (``address.tcp_port``)."""
        (outcome,) = self.pull_many([PullRequest(address, key, layer_range, out, token, header_out, alive)],
                                    timeout_s=timeout_s, alive_check_s=alive_check_s)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def pull(self, address: PeerAddress | tuple[str, int], key: bytes,
             layer_range: LayerRange | tuple[int, int] | range, out: Any, *, timeout_s: float = 10.0,
             token: bytes = b"", header_out: bytearray | None = None,
             progress: Callable[[int], None] | None = None, alive: Callable[[], bool] | None = None) -> int:
        """One pull (:meth:`Puller.pull`): the request goes out on an idle connection and its reply
        is read straight into ``out``, without :meth:`pull_many`'s batch machinery."""
        view = out if type(out) is memoryview else checked_out(out)
        sent = self.start(address, key, layer_range, view.nbytes, token=token, timeout_s=timeout_s)
        return self.finish(sent, view, header_out, progress=progress, alive=alive)

    @property
    def proves_holder(self) -> bool:
        """Whether every holder this client pulls from first proves it holds the cluster key."""
        return self.check_proof is not None

    def pull_many(self, requests: Sequence[PullRequest], *, timeout_s: float = 10.0,
                  alive_check_s: float = 0.05) -> list[int | BaseException]:
        """As :meth:`PullClient.pull_many`: one result per request, in order. The requests to one
        holder go out on one connection, pipelined; holders are read one after another."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        results: list[int | BaseException | None] = [None] * len(requests)
        groups: dict[tuple[str, int], list[tuple[int, TcpPull]]] = {}
        for i, request in enumerate(requests):
            pull = self._new_pull(request, timeout_s)
            if isinstance(pull, BaseException):
                results[i] = pull
                continue
            groups.setdefault(pull.where, []).append((i, pull))
        for where, group in groups.items():
            for (i, _), outcome in zip(group, self._pull_group(where, [pull for _, pull in group], alive_check_s)):
                results[i] = outcome
        return results  # type: ignore[return-value]

    def _new_pull(self, request: PullRequest, timeout_s: float) -> TcpPull | BaseException:
        """``request`` checked and framed, or why it cannot be sent."""
        try:
            if self._closed:
                raise errors.PoolClosedError("the TCP pull client is closed")
            args = checked_pull(request.address, request.key, request.layer_range, request.out, request.token,
                                request.header_out)
            pull = TcpPull(args.address, args.key, args.layer_range, args.out.nbytes, args.token,
                            request.header_out is not None, timeout_s)
            pull.bind(args.out, request.header_out, args.header_room, request.progress, request.alive)
            return pull
        except (errors.KVPoolError, ValueError, TypeError) as exc:
            return exc

    # -- one pull in two steps -----------------------------------------------------------------

    def start(self, address: PeerAddress | tuple[str, int], key: bytes,
              layer_range: LayerRange | tuple[int, int] | range, nbytes: int, *, token: bytes = b"",
              want_header: bool = True, timeout_s: float = 10.0, alive_check_s: float = 0.05) -> TcpPull:
        """Send one pull's request now, over an idle connection (a new one sends it in
        :meth:`finish`, after the holder's answer to its hello), and return the pull: the caller
        prepares the buffer its reply lands in while the holder answers, then calls
        :meth:`finish` (or :meth:`cancel`, exactly one of them). ``nbytes``: the payload bytes
        that buffer takes. Raises the argument errors of :meth:`pull_into`; every other failure
        is :meth:`finish`'s."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if self._closed:
            raise errors.PoolClosedError("the TCP pull client is closed")
        if not 0 < nbytes < 2**63:
            raise errors.OutBufferError(f"a pull needs room for at least one byte, got {nbytes}")
        peer, key, layer_range, token = checked_request(address, key, layer_range, token)
        pull = TcpPull(peer, key, layer_range, nbytes, token, want_header, timeout_s)
        pull.client = self
        conn = pull.conn = self._checkout(pull.where, pull, alive_check_s)
        if isinstance(conn, _Conn) and conn.nonce is None:
            try:
                pull.poll_mark = self.poll.mark()
                conn.send(pull, pull.frame)
                pull.sent_on = conn
            except _ConnectionLost:  # closed while idle: finish connects again
                conn.close()
                pull.conn = None
        return pull

    def finish(self, pull: TcpPull, out: Any, header_out: bytearray | None = None, *,
               progress: Callable[[int], None] | None = None, alive: Callable[[], bool] | None = None,
               alive_check_s: float = 0.05) -> int:
        """Read the reply of a pull :meth:`start` sent: its payload into ``out`` (at least the
        ``nbytes`` asked for), the header it carries into ``header_out``, as :meth:`pull_into`
        does and with its errors. A reply that cannot land in ``out`` is never read: the
        connection is closed instead."""
        try:
            view = checked_out(out)
            if view.nbytes < pull.nbytes:
                raise errors.OutBufferError(f"out holds {view.nbytes} bytes, the pull asked for {pull.nbytes}")
            pull.bind(view if view.nbytes == pull.nbytes else view[:pull.nbytes], header_out,
                      header_room(header_out), progress, alive)
        except BaseException:
            self.cancel(pull)
            raise
        conn, pull.conn = pull.conn, None
        if isinstance(conn, _Conn) and pull.sent_on is conn:  # the usual: sent on an idle connection
            try:
                outcome = self._reply(conn, pull, replied=False)
            except _ConnectionLost as lost:
                conn.close()
                if lost.replied:
                    outcome = self._failed(pull, lost.error)
                else:  # closed by the holder while idle: once more, on a new connection
                    pull.sent_on = None
                    fresh = self._checkout(pull.where, pull, alive_check_s, fresh=True)
                    (outcome,) = self._pull_group(pull.where, [pull], alive_check_s, fresh)
            else:
                self._checkin(pull.where, conn)
        else:
            (outcome,) = self._pull_group(pull.where, [pull], alive_check_s, conn)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def cancel(self, pull: TcpPull) -> None:
        """Drop a pull :meth:`start` sent, unread (its connection is closed)."""
        conn, pull.conn = pull.conn, None
        if isinstance(conn, _Conn):
            conn.close()

    def reachable(self, address: PeerAddress) -> bool:
        """Whether ``address`` serves TCP pulls that this client can reach (see the class)."""
        if not address.tcp_port:
            return False
        return self.retry_in_s(address) == 0.0

    def retry_in_s(self, address: PeerAddress) -> float:
        """Seconds until this client tries ``address``'s TCP port again (0: it is reachable)."""
        _, until = self._failed_in_a_row.get((address.host, address.tcp_port), (0, 0.0))
        return max(0.0, until - time.monotonic())

    def sweep(self, keep: Callable[[tuple[str, int]], bool] | None = None) -> int:
        """Close the idle connections whose holder hung up (closed or reset them: each would sit
        in CLOSE-WAIT, holding a descriptor, until reused, and a departed holder's never is)
        and, with ``keep``, those to holders ``keep((host, tcp_port))`` rejects (nodes that
        left or died); forget the failed connects of holders not tried for ``retry_after_s``
        after their mark ran out (holders that left). Never blocks: one non-blocking peek per
        idle connection. Returns how many connections it closed."""
        now = time.monotonic()
        closing: list[_Conn] = []
        with self._lock:
            for where, idle in list(self._idle.items()):
                left = keep is not None and not keep(where)
                usable = [] if left else [conn for conn in idle if not conn.hung_up()]
                closing += [conn for conn in idle if conn not in usable]
                if usable:
                    self._idle[where] = usable
                else:
                    del self._idle[where]
            for where, (_, until) in list(self._failed_in_a_row.items()):
                if until + self.retry_after_s <= now:  # not tried again since: a holder that left
                    del self._failed_in_a_row[where]
        for conn in closing:
            conn.close()
        self.swept += len(closing)
        return len(closing)

    def idle_connections(self, older_than_s: float = 0.0) -> int:
        """How many connections wait in the pool, idle for more than ``older_than_s``."""
        since = time.monotonic() - older_than_s
        with self._lock:
            return sum(conn.idle_since <= since for idle in self._idle.values() for conn in idle)

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
        with self._lock:
            idle = sum(len(conns) for conns in self._idle.values())
        return {"pulls": self.pulls, "failures": self.failures, "timeouts": self.timeouts,
                "bytes_received": self.bytes_received, "connects": self.connects, "idle_connections": idle,
                "swept": self.swept, **self.poll.stats()}

    # -- one holder ------------------------------------------------------------------------------

    def _pull_group(self, where: tuple[str, int], pulls: list[TcpPull], alive_check_s: float,
                    conn: _Conn | OSError | None = None) -> list[int | BaseException]:
        """Every pull to one holder over one connection (``conn``, else one checked out). A
        reused connection that fails before its first reply byte (the holder closed it while
        idle) is replaced once: requests go out again on the new one, reads repeat."""
        if conn is None:
            conn = self._checkout(where, pulls[0], alive_check_s)
        reused = isinstance(conn, _Conn) and conn.nonce is None  # an idle one (a new one has its hello's nonce)
        outcomes: list[int | BaseException] = []
        while True:
            if not isinstance(conn, _Conn):
                self._mark_unreachable(where)
                error = (errors.TransferError if isinstance(conn, ConnectionRefusedError) else TcpPathUnusable)
                return [self._failed(pull, error(f"{pull.label}: TCP port unusable: {describe(conn)}"))
                        for pull in pulls]
            try:
                self._exchange(conn, pulls, outcomes)
            except _ConnectionLost as lost:
                conn.close()
                if not lost.replied and not outcomes:
                    if reused:  # an idle one, closed by the holder meanwhile: once more on a new one
                        conn = self._checkout(where, pulls[0], alive_check_s, fresh=True)
                        reused = False
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

    def _exchange(self, conn: _Conn, pulls: list[TcpPull], outcomes: list[int | BaseException]) -> None:
        """Write the requests (at most ``_WINDOW_NBYTES`` ahead of the replies read, so neither
        side can block the other) and read each reply into its pull's buffer. On a new
        connection the holder's answer to its hello is read and checked (and its nonce
        answered) before any request is sent."""
        if conn.nonce is not None:
            self._check_hello(conn, pulls[0], conn.nonce)
            conn.nonce = None
            if self._failed_in_a_row:  # it opened: reachable, and the next failure starts a new row
                with self._lock:
                    self._failed_in_a_row.pop(pulls[0].where, None)
        sent = 0
        window = 0
        for index, pull in enumerate(pulls):
            while sent < len(pulls) and (sent == index or window + len(pulls[sent].frame) <= _WINDOW_NBYTES):
                if pulls[sent].sent_on is not conn:  # (start sent it already)
                    conn.send(pulls[sent], pulls[sent].frame)
                window += len(pulls[sent].frame)
                sent += 1
            outcomes.append(self._reply(conn, pull, replied=bool(outcomes)))
            window -= len(pull.frame)

    def _check_hello(self, conn: _Conn, pull: TcpPull, nonce: bytes) -> None:
        """Read the holder's answer to a new connection's hello (a wrong one ends the
        connection), then answer the holder's nonce."""
        answer = bytearray(PULL_HELLO.ANSWER.size)
        conn.receive(pull, memoryview(answer), False)
        try:
            challenge = PULL_HELLO.check_answer(answer, nonce, self.check_proof)
        except (errors.ProtocolError, errors.AuthenticationError) as exc:
            raise _ConnectionLost(type(exc)(f"{pull.label}: {exc}"), replied=True) from None
        conn.send(pull, self.prove(challenge) if self.prove is not None else bytes(PROOF_NBYTES))

    def _reply(self, conn: _Conn, pull: TcpPull, replied: bool) -> int | BaseException:
        """Read one reply: its status frame, the body that follows (a failure's text, or the
        header an OK carries, into ``pull.header_out``), then an OK's payload into ``pull.out``.

        Every reply is read here. The first receive lands bytes where the usual reply (OK, a
        header of the size asked for) wants them: status and header in small buffers, the
        payload straight in ``out``, often all of it with one ``recvmsg_into``. Whatever landed
        elsewhere than this reply wants it (the start of the next reply; or, after another
        status, everything past the status frame) is put back in front of the stream and read
        again into its place. A payload is reported to ``pull.progress`` as it lands, after
        the header is in ``header_out``.
        """
        status_buf = bytearray(STATUS.size)
        status_view = memoryview(status_buf)
        header_out = pull.header_out
        if header_out is None:
            header = _EMPTY
        elif len(header_out) == pull.header_room:  # the usual case: received in place
            header = memoryview(header_out)
        else:
            header = memoryview(bytearray(pull.header_room))
        views = [status_view, header, pull.out] if header.nbytes else [status_view, pull.out]
        got = conn.receive_some(pull, views, replied)
        while got < STATUS.size:
            got += conn.receive_some(pull, _skip(views, got), True)
        frame = parse_status_head(status_buf, pull.request_id)
        if frame is None:
            raise _ConnectionLost(errors.ProtocolError(f"{pull.label}: malformed status frame"), replied=True)
        status, body_len, nbytes, _ = frame
        ok = status in OK_STATUSES
        if ok and nbytes > pull.out.nbytes:
            raise _ConnectionLost(errors.ProtocolError(f"{pull.label}: {nbytes} bytes for a "
                                                       f"{pull.out.nbytes}-byte buffer"), replied=True)
        head = STATUS.size + body_len
        end = head + nbytes if ok else head
        if ok and body_len == header.nbytes:  # the usual: landed in place
            body = header
            if got > end:  # the start of the next reply, received into the out buffer's tail
                conn.unread(pull.out[nbytes:got - head])
        else:
            received = got - STATUS.size
            conn.unread(bytes(header[:received]) + bytes(pull.out[:max(0, received - header.nbytes)]))
            if header is not _EMPTY:
                header.release()  # header_out is free to take the header's own length below
            body = memoryview(bytearray(body_len))
            got = STATUS.size
        views = [status_view, body, (pull.out if nbytes == pull.out.nbytes else pull.out[:nbytes]) if ok else _EMPTY]
        while got < head:
            got += conn.receive_some(pull, _skip(views, got), True)
        if not ok:
            return self._failed(pull, status_error(status)(f"{pull.label}: {bytes(body).decode('utf-8', 'replace')}"))
        usable = header_out is None or 0 < body_len <= pull.header_room
        if usable and header_out is not None and body.obj is not header_out:
            header_out[:] = body
        while True:
            if pull.progress is not None and usable:
                pull.progress(min(got, end) - head)
            if got >= end:
                break
            # the rest of the payload, in place, a piece of at most _FILL_NBYTES at a time
            got += conn.receive_rest(pull, pull.out[got - head:min(nbytes, got - head + _FILL_NBYTES)])
        if not usable:
            return self._failed(pull, errors.ProtocolError(f"{pull.label}: OK without a usable header"))
        self.pulls += 1
        self.bytes_received += nbytes
        return int(nbytes)

    def _mark_unreachable(self, where: tuple[str, int]) -> None:
        with self._lock:
            row = self._failed_in_a_row.get(where, (0, 0.0))[0] + 1
            until = time.monotonic() + min(self.retry_after_s, self.first_retry_s * 2 ** min(row - 1, 16))
            self._failed_in_a_row[where] = row, until

    def _failed(self, pull: TcpPull, exc: BaseException) -> BaseException:
        self.failures += 1
        self.timeouts += isinstance(exc, errors.KVTimeoutError)
        return exc

    def _checkout(self, where: tuple[str, int], pull: TcpPull, wait_s: float,
                  fresh: bool = False) -> _Conn | OSError:
        """A connection to ``where`` (an idle one unless ``fresh``; a new one has sent its
        hello), waking every ``wait_s`` while it waits; or why none could be made."""
        while not fresh:
            with self._lock:
                idle = self._idle.get(where)
                conn = idle.pop() if idle else None
                if idle == []:
                    del self._idle[where]
            if conn is None:
                break
            if conn.hung_up():  # closed by the holder while idle: never sent on
                conn.close()
                self.swept += 1
                continue
            conn.wake_every(wait_s)
            return conn
        nonce, hello = PULL_HELLO.opening()
        try:
            sock = socket.create_connection(where, timeout=min(self.connect_timeout_s, pull.timeout_s))
        except OSError as exc:
            log.debug("tcp pull connect to %s:%d failed: %s", *where, describe(exc))
            return exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(hello)  # answered before any request
            conn = _Conn(sock, nonce, self.poll)
            conn.wake_every(wait_s)
        except OSError as exc:
            sock.close()
            return exc
        self.connects += 1
        return conn

    def _checkin(self, where: tuple[str, int], conn: _Conn) -> None:
        with self._lock:
            idle = self._idle.setdefault(where, [])
            if not self._closed and len(idle) < self.idle_per_peer and not conn.pending:
                conn.idle_since = time.monotonic()
                idle.append(conn)
                return
        conn.close()


class TcpPull:
    """One pull: its checked request, frame and deadline, where the request went (:meth:`start`),
    and the buffers its reply lands in (:meth:`bind`)."""

    __slots__ = ("address", "alive", "client", "conn", "deadline", "frame", "header_out", "header_room", "key",
                 "layer_range", "nbytes", "out", "poll_mark", "progress", "sent_on", "timeout_s", "token", "where")

    def __init__(self, address: PeerAddress, key: bytes, layer_range: LayerRange, nbytes: int, token: bytes,
                 want_header: bool, timeout_s: float) -> None:
        if not address.tcp_port:
            raise errors.TransferError(f"{address.host} serves no TCP pulls")
        self.address, self.key, self.layer_range, self.nbytes, self.token = address, key, layer_range, nbytes, token
        self.where = (address.host, address.tcp_port)
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.frame = pack_request(key, token, layer_range, nbytes, want_header=want_header,
                                   max_chunk=max(1, nbytes), request_id=_REQUEST_ID)
        self.sent_on: _Conn | None = None  # the connection its request went out on
        # (start) ReplyPoll.mark() before the request went out, for the reply's first receive
        self.poll_mark: int | None = None
        self.conn: _Conn | OSError | None = None  # (start) the connection to read the reply from
        self.out = _EMPTY
        self.header_out: bytearray | None = None
        self.header_room = 0
        self.alive: Callable[[], bool] | None = None
        self.progress: Callable[[int], None] | None = None
        self.client: TcpPullClient | None = None  # (start) the client that reads its reply

    #: every request on a connection has this id: replies come back in order, one per request,
    #: and the id only confirms the stream is in step
    request_id = _REQUEST_ID

    def bind(self, out: memoryview, header_out: bytearray | None, room: int,
             progress: Callable[[int], None] | None, alive: Callable[[], bool] | None) -> None:
        """Where the reply lands (checked by the caller)."""
        self.out, self.header_out, self.header_room, self.progress, self.alive = out, header_out, room, progress, alive

    def finish(self, out: Any, header_out: bytearray | None = None, *,
               progress: Callable[[int], None] | None = None, alive: Callable[[], bool] | None = None) -> int:
        """:meth:`TcpPullClient.finish` of this started pull (:class:`StartedPull`)."""
        assert self.client is not None, "only a pull TcpPullClient.start sent is finished"
        return self.client.finish(self, out, header_out, progress=progress, alive=alive)

    def cancel(self) -> None:
        """:meth:`TcpPullClient.cancel` of this started pull."""
        assert self.client is not None, "only a pull TcpPullClient.start sent is cancelled"
        self.client.cancel(self)

    @property
    def label(self) -> str:
        """For messages (built only when one is)."""
        return (f"{self.address.host}:{self.address.tcp_port}: pull of {self.key.hex()} layers "
                f"[{self.layer_range.start}, {self.layer_range.stop})")


class _Conn:
    """A client connection: a blocking socket whose waits end every ``wait_s`` (so a pull
    can check its deadline and its holder), and the bytes read ahead of the reply being read."""

    def __init__(self, sock: socket.socket, nonce: bytes | None, poll: ReplyPoll | None = None) -> None:
        self.sock = sock
        self.poll = poll  # each wait for bytes is polled first (see ReplyPoll)
        self.nonce = nonce  # of the hello sent, until the holder's answer to it was checked
        self.pending = bytearray()  # received, not yet consumed: the stream goes on with these
        self.wait_s = 0.0
        self.idle_since = 0.0  # when it last went back to the pool

    def hung_up(self) -> bool:
        """Whether this idle connection can no longer carry a pull: the holder closed or reset
        it, or sent bytes nobody asked for. One non-blocking peek (the socket is blocking with
        kernel timeouts, see :func:`set_timeouts`, so MSG_DONTWAIT never waits)."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:  # nothing to read: still open
            return False
        except OSError:  # reset, or already closed here
            return True
        return True  # b"": closed by the holder; a byte: out of step

    def wake_every(self, wait_s: float) -> None:
        if wait_s != self.wait_s:
            set_timeouts(self.sock, wait_s, wait_s)
            self.wait_s = wait_s

    def close(self) -> None:
        self.sock.close()

    def unread(self, data: bytes | memoryview) -> None:
        """Put ``data`` back in front of the bytes still to be read."""
        if len(data):
            self.pending[:0] = data

    def send(self, pull: TcpPull, frame: bytes | bytearray) -> None:
        view = memoryview(frame)
        while view.nbytes:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:  # the holder is not reading yet
                self._waited(pull)
            except OSError as exc:
                raise _ConnectionLost(_transport_error(pull, exc), replied=False) from None

    def receive(self, pull: TcpPull, view: memoryview, replied: bool) -> None:
        """Fill ``view`` with the next bytes of ``pull``'s reply (see :meth:`receive_some`)."""
        while view.nbytes:
            view = view[self.receive_some(pull, [view], replied):]
            replied = True

    def receive_some(self, pull: TcpPull, views: list[memoryview], replied: bool) -> int:
        """Receive the next bytes of the stream into ``views``, in order (at least one byte, at
        most what they hold) by ``pull``'s deadline, asking its ``alive`` between waits.
        ``replied``: some reply byte came on this connection before (else a closed connection
        may be a stale idle one, see _pull_group)."""
        if self.pending:
            return self._from_pending(views)
        try:
            n = self.polled(pull, views)
        except OSError as exc:
            raise _ConnectionLost(_transport_error(pull, exc), replied=replied) from None
        while n is None:
            try:
                n = self.sock.recvmsg_into(views)[0] if len(views) > 1 else self.sock.recv_into(views[0])
            except BlockingIOError:
                self._waited(pull)
            except OSError as exc:
                raise _ConnectionLost(_transport_error(pull, exc), replied=replied) from None
        if n == 0:
            raise _ConnectionLost(errors.TransferError(f"{pull.label}: the holder closed the connection"),
                                  replied=replied)
        return n

    def receive_rest(self, pull: TcpPull, view: memoryview) -> int:
        """Fill ``view`` with the next bytes of the stream (a piece of a payload whose reply
        began): one blocking ``recv`` that returns once all of it is in (MSG_WAITALL), woken
        every ``wait_s`` (the socket's timeout, which returns what came so far) to check
        ``pull``'s deadline and holder. Returns ``view.nbytes``."""
        got = self._from_pending([view]) if self.pending else 0
        while got < view.nbytes:
            try:
                n = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
            except BlockingIOError:  # nothing came for wait_s
                n = 0
            except OSError as exc:
                raise _ConnectionLost(_transport_error(pull, exc), replied=True) from None
            else:
                if n == 0:
                    raise _ConnectionLost(errors.TransferError(f"{pull.label}: the holder closed the connection"),
                                          replied=True)
            got += n
            if got < view.nbytes:  # a wait ran out before the piece was whole
                self._waited(pull)
        return got

    def polled(self, pull: TcpPull, views: list[Any]) -> int | None:
        """What one receive into ``views`` brought while it was polled for (see ReplyPoll); None:
        not polled, or nothing came meanwhile. The first receive of a reply counts from the
        request's send (``pull.poll_mark``), a later one from now."""
        poll = self.poll
        if poll is None or not poll.poll_s:
            return None
        mark, pull.poll_mark = pull.poll_mark, None
        return poll.receive(self.sock, views, poll.mark() if mark is None else mark)

    def _from_pending(self, views: list[memoryview]) -> int:
        taken = 0
        for view in views:
            n = min(view.nbytes, len(self.pending) - taken)
            view[:n] = self.pending[taken:taken + n]
            taken += n
            if taken == len(self.pending):
                break
        del self.pending[:taken]
        return taken

    @staticmethod
    def _waited(pull: TcpPull) -> None:
        """A wait ended without bytes: past the deadline, or the holder known gone, ends the
        pull (and the connection: never repeated)."""
        if time.monotonic() >= pull.deadline:
            raise _ConnectionLost(_transport_error(pull, TimeoutError()), replied=True)
        if pull.alive is not None and not pull.alive():
            raise _ConnectionLost(errors.TransferError(f"{pull.label}: the holder is gone"), replied=True)


def _skip(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """``views`` without their first ``nbytes`` bytes (and without empty ones)."""
    rest = []
    for view in views:
        if nbytes >= view.nbytes:
            nbytes -= view.nbytes
            continue
        rest.append(view[nbytes:] if nbytes else view)
        nbytes = 0
    return rest


_EMPTY = memoryview(b"")


class _ConnectionLost(Exception):
    """The connection cannot carry more replies: ``error`` for the pull being read."""

    def __init__(self, error: BaseException, replied: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.replied = replied  # some reply byte arrived on this connection before


def _transport_error(pull: TcpPull, exc: BaseException) -> errors.KVPoolError:
    if isinstance(exc, TimeoutError):
        return errors.KVTimeoutError(f"{pull.label}: no reply within {pull.timeout_s}s")
    return errors.TransferError(f"{pull.label}: {describe(exc)}")
