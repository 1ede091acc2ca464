"""What both ends of a TCP connection share: the opening both ends prove a key in (the pull
port's and the master query port's), socket set-up, writing views."""

from __future__ import annotations

import os
import resource
import socket
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpool import errors
from kvpool.native import extension

if TYPE_CHECKING:
    from kvpool import _poll as _native
else:
    _native = extension("_poll")  # None where not built (no C compiler at install): polled in Python

PROOF_NBYTES = 16


class MutualHello:
    """How a connection opens when each end proves to the other that it holds a key (the TCP
    pull port and the master's query port, each with a ``magic`` of its own), in three frames:

    1. the client's HELLO: magic, version, a nonce;
    2. the server's ANSWER: magic, version, its proof of that nonce, a nonce of its own;
    3. the client's proof of the server's nonce (PROOF_NBYTES; zeros from a client without
       the key), sent before its first request.

    Proofs are the callers' (:class:`~kvpool.cluster.wire.security.ClusterKey`, labelled per side,
    so neither end's answer can be replayed as the other's). Fresh nonces on both ends: a
    recorded opening cannot be replayed. ``what`` names the server in errors. The server's
    side runs in :class:`kvpool.transport.tcp.admission.OpeningLoop`."""

    HELLO = struct.Struct("<4sH16s")
    ANSWER = struct.Struct("<4sH16s16s")

    def __init__(self, magic: bytes, version: int, what: str) -> None:
        self.magic, self.version, self.what = magic, version, what

    def opening(self) -> tuple[bytes, bytes]:
        """(the nonce, the HELLO frame) of a new client connection."""
        nonce = os.urandom(16)
        return nonce, self.HELLO.pack(self.magic, self.version, nonce)

    def check_answer(self, answer: bytes | bytearray, nonce: bytes,
                     check_proof: Callable[[bytes, bytes], bool] | None) -> bytes:
        """The server's nonce, from its ANSWER to ``nonce``; ProtocolError from another
        protocol, AuthenticationError when ``check_proof(nonce, proof)`` fails."""
        magic, version, proof, challenge = self.ANSWER.unpack(answer)
        if magic != self.magic or version != self.version:
            raise errors.ProtocolError(f"not a {self.what}")
        if check_proof is not None and not check_proof(nonce, proof):
            raise errors.AuthenticationError(f"the {self.what} could not prove it holds the cluster key")
        return bytes(challenge)


PULL_HELLO = MutualHello(b"KVTH", 2, "kvpool TCP pull server")


class TcpPathUnusable(errors.TransferError):
    """A holder's TCP port could not be used: connecting timed out, or a new connection was
    closed before its first reply (the holder is at its connection limit). The holder may
    still serve the pull over UCX. A refused connection (nothing listens: the holder is gone)
    is a plain :class:`errors.TransferError`."""


def set_timeouts(sock: socket.socket, recv_s: float, send_s: float) -> None:
    """Make ``sock`` blocking, with kernel timeouts (SO_RCVTIMEO / SO_SNDTIMEO): a call that
    waits longer raises BlockingIOError. One system call per ``recv``/``send``: a Python
    socket with a timeout of its own polls before each of them."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_s))


class ReplyPoll:
    """Polls a socket for bytes that are due soon (a reply, the rest of one), for at most
    ``poll_s``, before the caller blocks for them.

    Why: a thread blocked in ``recv`` sleeps, its CPU goes idle, and on a virtual machine an
    idle vCPU halts; waking it when the bytes land costs tens of microseconds, each time, which
    is much of a small reply's time and still some of a large one's. (Measurements:
    ``bench/poll_bench.py``, docs/benchmarks.md.)

    Only where the CPU is this thread's alone: a poll during which the thread was preempted,
    counted from ``mark`` (for a reply's first bytes, taken before the request's send: the
    peer it waits for, woken on the same CPU by the request, or a neighbour wanted the CPU),
    counts against polling, as one that ran out does. Bounded: at most ``poll_s`` per reply,
    then the caller blocks as before; one thread polls at a time (the others block at once);
    and when polls keep running out or being preempted, polling stops, and is tried again
    every ``POLL_RETRY_EVERY`` replies. ``poll_s = 0``: never poll.
    """

    def __init__(self, poll_s: float) -> None:
        self.poll_s = max(0.0, poll_s)
        self.caught = 0  # replies that came while polled for
        self.ran_out = 0  # polls that ended without a reply (the caller blocked)
        self.preempted = 0  # polls during which another task took the CPU (reply caught or not)
        self._score = _POLL_MAX_SCORE // 2  # a caught reply adds one; a poll run out or preempted takes two
        self._skipped = 0
        self._polling = False  # advisory (no lock): at worst two threads poll at once

    def mark(self) -> int:
        """Taken when a wait begins, for :meth:`receive` (for a reply: before its request is sent)."""
        return _involuntary_switches() if self.poll_s else 0

    def receive(self, sock: socket.socket, views: list[Any], mark: int) -> int | None:
        """What one receive into ``views`` brought (``recvmsg_into``; 0: the stream ended), if
        something came while polled for; None: nothing came by then, or no poll now (the caller
        blocks). ``mark``: :meth:`mark` when the wait began. OSError for a failed
        connection, as a blocking receive raises it."""
        if not self.poll_s or self._polling or not self._poll_now():
            return None
        self._polling = True
        try:
            got = _poll(sock, views, self.poll_s)
        finally:
            self._polling = False
        preempted = _involuntary_switches() != mark
        if preempted or got is None:
            self._score -= 2
        else:
            self._score = min(self._score + 1, _POLL_MAX_SCORE)
        self.preempted += preempted
        self.caught += got is not None
        self.ran_out += got is None
        return got

    def _poll_now(self) -> bool:
        if self._score > 0:
            return True
        self._skipped += 1
        if self._skipped < POLL_RETRY_EVERY:
            return False
        self._skipped, self._score = 0, 1
        return True

    def stats(self) -> dict[str, int]:
        return {"polls_caught": self.caught, "polls_ran_out": self.ran_out, "polls_preempted": self.preempted}


_POLL_MAX_SCORE = 8
POLL_RETRY_EVERY = 32


def _poll(sock: socket.socket, views: list[Any], poll_s: float) -> int | None:
    """One non-blocking receive after another until one brings something, or ``poll_s`` passed:
    in C with the GIL released (kvpool/_poll.c), else in Python (every try takes the GIL)."""
    if _native is not None:
        got = _native.recv_poll(sock.fileno(), views, int(poll_s * 1e9))
        return None if got < 0 else got
    deadline = time.perf_counter() + poll_s
    while True:
        try:
            return sock.recvmsg_into(views, 0, socket.MSG_DONTWAIT)[0]
        except BlockingIOError:
            if time.perf_counter() >= deadline:
                return None


def _involuntary_switches() -> int:
    """How often this thread was preempted so far (Linux; elsewhere never, as far as it knows)."""
    return resource.getrusage(_RUSAGE_THREAD).ru_nivcsw if _RUSAGE_THREAD is not None else 0


_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def _timeval(seconds: float) -> bytes:
    micros = max(1, int(seconds * 1e6))  # never 0: a zero timeval waits forever
    return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)


def recv_exactly(conn: socket.socket, view: memoryview, at_boundary: bool = False) -> bool:
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


def send_views(conn: socket.socket, views: list[memoryview]) -> None:
    """Write every view in order with as few ``sendmsg`` calls as the socket allows (no copy)."""
    while views:
        sent = conn.sendmsg(views[:64])
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def listen_on(host: str, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host`` at an ephemeral port (IPv6 for an address with a ``:``)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener
