"""What both ends of a TCP pull connection share: the hello, socket set-up, writing views."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

from kvpool import errors

# A connection opens with three frames: the client's hello (a nonce); the server's answer (its
# proof for that nonce, then a nonce of its own); the client's proof for the server's nonce
# (PROOF_NBYTES, zeros from a client without the cluster key), sent with its first requests.
HELLO = struct.Struct("<4sH16s")
HELLO_ANSWER = struct.Struct("<4sH16s16s")
HELLO_MAGIC = b"KVTH"
HELLO_VERSION = 2
PROOF_NBYTES = 16


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


def accept_forever(listener: socket.socket, closing: Callable[[], bool],
                   connected: Callable[[socket.socket], None]) -> None:
    """Hand every connection ``listener`` accepts to ``connected``, until ``closing()`` after the
    listener was closed. A failed accept (out of descriptors, an aborted handshake) is retried."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            if closing():
                return
            time.sleep(0.01)
            continue
        connected(conn)


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
