"""Who may hold a connection on a TCP port kvpool listens on, and how many descriptors a
process has for all of them.

Why
    Every open connection is a descriptor. A peer without the cluster key could once open a
    thousand idle connections to a node's pull port and wait 600 s in each: under the common
    soft limit of 1024 descriptors the process then could not open a socket to the master,
    missed its heartbeats and was declared dead. Now:

    * :func:`raise_descriptor_limit` lifts the soft ``RLIMIT_NOFILE`` to the hard limit at
      process start, and :func:`connection_cap` sizes a listener's cap from what the process
      got, keeping a reserve (:func:`reserved_descriptors`) that listeners never touch: the
      master's and the heartbeat's ZeroMQ sockets, tier files, outgoing pulls.
    * :class:`Admission` keeps a port's connections under that cap. A connection is
      *unproven* until its peer proves it holds the cluster key (its opening must be complete
      within a few seconds, ``node.hello_timeout_s``); unproven ones are few
      (:attr:`max_unproven` in all, :attr:`max_unproven_per_address` per peer address) and
      one is cut to admit a newer one (the oldest that sent nothing yet, else the oldest), so
      a flood of idle connections holds a handful of descriptors, for seconds, and a peer with
      the key gets in. Proven connections are never cut; when they fill the cap, a new
      connection is accepted and closed at once.
    * :class:`OpeningLoop` runs the openings on the accepting thread: a connection gets a
      thread only once its opening is complete, so a flood costs no threads either.
"""

from __future__ import annotations

import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from kvpool.transport.tcp.stream import PROOF_NBYTES, MutualHello, shutdown

log = logging.getLogger("kvpool.transport.tcp")

#: descriptors no listener may use, at least (the rest of the reserve scales with the limit)
MIN_RESERVED_DESCRIPTORS = 256
_NR_OPEN = "/proc/sys/fs/nr_open"


def raise_descriptor_limit() -> int:
    """Lift this process's soft RLIMIT_NOFILE to its hard limit (once is enough; cheap to
    repeat) and return the soft limit it has now. Never lowers it; a refusal keeps it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(_NR_OPEN) as fh:
                target = int(fh.read().strip())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.info("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
        else:
            log.debug("descriptor limit raised from %d to %d", soft, target)
    return descriptor_limit()


def descriptor_limit() -> int:
    """This process's soft RLIMIT_NOFILE (a large number for unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def reserved_descriptors(limit: int | None = None) -> int:
    """Descriptors kept from every listener: a quarter of the limit, at least
    :data:`MIN_RESERVED_DESCRIPTORS` (ZeroMQ's sockets and threads, tier files, outgoing pulls)."""
    limit = descriptor_limit() if limit is None else limit
    return max(MIN_RESERVED_DESCRIPTORS, limit // 4)


def connection_cap(share: float, ceiling: int, limit: int | None = None) -> int:
    """A listener's connection cap: ``share`` of the descriptors left above the reserve, at
    most ``ceiling`` (each connection is a thread too), at least 8."""
    limit = descriptor_limit() if limit is None else limit
    return max(8, min(ceiling, int((limit - reserved_descriptors(limit)) * share)))


class Admission:
    """The connections of one listening port, proven (their peer holds the cluster key) or not.

    :meth:`admit` a new connection (False: close it now); call :meth:`proven` once its peer
    proved the key and :meth:`release` when it closed. An unproven connection cut to make
    room is shut down here (its thread sees the stream end, closes it and releases it); until
    then it holds a descriptor, and while :attr:`max_unproven` of them are still closing new
    connections are turned away, so the descriptors in use stay under ``max_connections +
    max_unproven``."""

    def __init__(self, max_connections: int, max_unproven: int | None = None,
                 max_unproven_per_address: int = 16) -> None:
        self.max_connections = max_connections  # 0: every connection is closed at once
        self.max_unproven = max_unproven or max(8, max_connections // 4)
        self.max_unproven_per_address = max(1, max_unproven_per_address)
        self._lock = threading.Lock()
        self._unproven: OrderedDict[socket.socket, str] = OrderedDict()  # oldest first
        self._per_address: Counter[str] = Counter()
        self._proven: set[socket.socket] = set()
        self._spoke: set[socket.socket] = set()  # unproven ones that sent a valid first frame
        self._cut: set[socket.socket] = set()  # shut down, not yet released by their threads
        self.refused = 0  # accepted and closed at once: every slot held by a proven connection
        self.cut = 0  # unproven connections cut to admit newer ones

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._unproven) + len(self._proven) + len(self._cut)

    def admit(self, conn: socket.socket) -> bool:
        """Whether ``conn`` (just accepted) may be served; older unproven ones may be cut for it
        (shut down here; see :meth:`admit_cutting` to close them yourself)."""
        admitted, cut = self.admit_cutting(conn)
        for old in cut:
            shutdown(old)
        return admitted

    def admit_cutting(self, conn: socket.socket) -> tuple[bool, list[socket.socket]]:
        """As :meth:`admit`, returning the connections cut for ``conn`` for the caller to end
        (close one it owns and :meth:`release` it; shut down one a thread serves)."""
        address = _peer_address(conn)
        cut: list[socket.socket] = []
        with self._lock:
            if self.max_connections <= 0 or len(self._cut) >= self.max_unproven:
                self.refused += 1  # no slot at all, or a flood whose cut connections are still closing
                return False, cut
            if self._per_address[address] >= self.max_unproven_per_address:
                cut.append(self._cut_oldest(address))
            while (len(self._unproven) >= min(self.max_unproven, self.max_connections)
                   or len(self._unproven) + len(self._proven) >= self.max_connections):
                if not self._unproven:
                    self.refused += 1
                    return False, cut
                cut.append(self._cut_oldest(None))
            self._unproven[conn] = address
            self._per_address[address] += 1
        return True, cut

    def spoke(self, conn: socket.socket) -> None:
        """``conn``'s peer sent a valid first frame: cut only after every silent one."""
        with self._lock:
            if conn in self._unproven:
                self._spoke.add(conn)

    def proven(self, conn: socket.socket) -> None:
        """``conn``'s peer proved the cluster key: never cut from now on."""
        with self._lock:
            address = self._unproven.pop(conn, None)
            if address is not None:
                self._forget_address(address)
                self._spoke.discard(conn)
                self._proven.add(conn)

    def release(self, conn: socket.socket) -> None:
        """``conn`` is closed (or about to be, by the caller)."""
        with self._lock:
            address = self._unproven.pop(conn, None)
            if address is not None:
                self._forget_address(address)
            self._spoke.discard(conn)
            self._proven.discard(conn)
            self._cut.discard(conn)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"connections_unproven": len(self._unproven), "connections_proven": len(self._proven),
                    "connections_cut": self.cut, "connections_refused": self.refused,
                    "max_connections": self.max_connections}

    def _cut_oldest(self, address: str | None) -> socket.socket:
        """Under the lock: stop counting the oldest unproven connection (of ``address``, or of
        any) as unproven; it counts as cut until released."""
        # The oldest silent one (sent nothing yet: an idle flood's), else the oldest.
        candidates = [c for c, a in self._unproven.items() if address is None or a == address]
        conn = next((c for c in candidates if c not in self._spoke), candidates[0])
        address = self._unproven.pop(conn)
        self._spoke.discard(conn)
        self._forget_address(address)
        self._cut.add(conn)
        self.cut += 1
        return conn

    def _forget_address(self, address: str) -> None:
        self._per_address[address] -= 1
        if self._per_address[address] <= 0:
            del self._per_address[address]


def _peer_address(conn: socket.socket) -> str:
    try:
        return str(conn.getpeername()[0])
    except (OSError, IndexError):
        return ""


class OpeningLoop:
    """Accepts a port's connections and runs their openings (the server's side of a
    :class:`MutualHello`) on one thread, without a thread per connection: a connection gets a
    thread of its own (``opened(conn, nonce, proof)``, on this thread: start one there) only once
    its opening is complete. Until then it costs a descriptor and a few bytes, is admitted by
    ``admission`` (which may cut it for a newer one) and is closed if its opening is not complete
    within ``hello_timeout_s`` or is not this protocol's. Runs until ``closing()`` (checked at
    least every 0.25 s) and then closes every connection still opening."""

    def __init__(self, listener: socket.socket, hello: MutualHello, prove: Callable[[bytes], bytes] | None,
                 admission: Admission, hello_timeout_s: float,
                 opened: Callable[[socket.socket, bytes, bytes], None], closing: Callable[[], bool]) -> None:
        self._listener = listener
        self._hello = hello
        self._prove = prove
        self._admission = admission
        self.hello_timeout_s = hello_timeout_s
        self._opened = opened
        self._closing = closing
        self._selector = selectors.DefaultSelector()
        self._pending: dict[socket.socket, _Opening] = {}
        self.timed_out = 0  # openings not complete in time
        self.malformed = 0  # openings of another protocol

    def run(self) -> None:
        try:
            self._listener.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        except (OSError, ValueError):  # the port closed before this thread ran: nothing to serve
            self._selector.close()
            return
        try:
            while not self._closing():
                now = time.monotonic()
                wait = 0.25
                if self._pending:
                    wait = max(0.0, min(wait, min(o.deadline for o in self._pending.values()) - now))
                try:
                    events = self._selector.select(wait)
                except OSError:
                    continue  # the listener closed under us: closing() says so next
                for key, _ in events:
                    if key.data is None:
                        self._accept()
                    else:
                        self._step(key.fileobj, key.data)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, o in self._pending.items() if o.deadline <= now]:
                    self.timed_out += 1
                    self._drop(conn)
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, then the openings in progress get their turn
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:  # out of descriptors, an aborted handshake, the listener closed
                time.sleep(0.01)
                return
            admitted, cut = self._admission.admit_cutting(conn)
            for old in cut:
                if old in self._pending:
                    self._drop(old)  # still opening: ours to close now, its descriptor free at once
                else:
                    shutdown(old)  # a thread serves it: that thread closes it
            if not admitted:
                conn.close()  # every slot held by a connection that proved the key
                continue
            conn.setblocking(False)
            opening = _Opening(time.monotonic() + self.hello_timeout_s, self._hello.HELLO.size)
            self._pending[conn] = opening
            self._selector.register(conn, selectors.EVENT_READ, opening)
            # A keyed client's HELLO is usually here already: read now, so it counts as having
            # spoken before the rest of this burst (an idle flood's) is admitted and cut.
            self._step(conn, opening)

    def _step(self, conn: socket.socket, opening: _Opening) -> None:
        try:
            data = conn.recv(opening.want - len(opening.buf))  # never a byte of the first request
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        if not data:  # the peer closed, or the admission cut it
            self._drop(conn)
            return
        opening.buf += data
        if len(opening.buf) < opening.want:
            return
        if opening.challenge is None:
            magic, version, nonce = self._hello.HELLO.unpack(opening.buf)
            if magic != self._hello.magic or version != self._hello.version:
                self.malformed += 1
                self._drop(conn)
                return
            self._admission.spoke(conn)
            opening.challenge = os.urandom(16)
            proof = self._prove(nonce) if self._prove is not None else bytes(PROOF_NBYTES)
            answer = self._hello.ANSWER.pack(self._hello.magic, self._hello.version, proof, opening.challenge)
            try:
                sent = conn.send(answer)  # a fresh socket's send buffer takes 52 bytes at once
            except OSError:
                sent = -1
            if sent != len(answer):
                self._drop(conn)
                return
            opening.buf, opening.want = b"", PROOF_NBYTES
            return
        self._selector.unregister(conn)
        del self._pending[conn]
        conn.setblocking(True)
        self._opened(conn, opening.challenge, bytes(opening.buf))

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        self._admission.release(conn)


class _Opening:
    __slots__ = ("deadline", "want", "buf", "challenge")

    def __init__(self, deadline: float, want: int) -> None:
        self.deadline = deadline
        self.want = want  # bytes of the frame being read
        self.buf = b""
        self.challenge: bytes | None = None  # sent with the answer: the proof read next answers it
