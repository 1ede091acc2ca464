"""The master's end of its query port (:mod:`kvpool.cluster.wire.query` says what it serves
and why): a thread accepting connections and running their openings, and one thread per
connection that proved the cluster key, each blocked in ``recv``."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from kvpool import errors
from kvpool.cluster.wire.query import QUERY_HELLO, read_frame, write_frame
from kvpool.cluster.wire.security import ClusterKey
from kvpool.transport.tcp.admission import Admission, OpeningLoop, connection_cap
from kvpool.transport.tcp.stream import listen_on, set_timeouts, shutdown

log = logging.getLogger("kvpool.master.query")


class QueryServer:
    """Serves :data:`QUERY_OPS` on ``host`` (an ephemeral port): a thread accepting and running
    openings, and one per connection that proved the key, each blocked in ``recv``.
    ``serve(frame)`` answers one request frame."""

    def __init__(self, serve: Callable[[bytes], bytes], host: str, cluster_key: ClusterKey, *,
                 max_connections: int | None = None, idle_timeout_s: float = 600.0,
                 hello_timeout_s: float = 3.0, max_unproven_per_address: int = 16) -> None:
        self._serve = serve
        self._key = cluster_key
        # Under a cap sized from the descriptor limit; a connection is unproven (few, cut
        # first) until its peer proved the key: a flood without it never takes the
        # descriptors the master's ZeroMQ socket needs (see :class:`Admission`).
        self.admission = Admission(connection_cap(0.25, 256) if max_connections is None else max_connections,
                                   max_unproven_per_address=max_unproven_per_address)
        self.idle_timeout_s = idle_timeout_s
        self.hello_timeout_s = hello_timeout_s
        self._listener = listen_on(host, 1024)  # a burst queues, a keyed client's SYN is not dropped
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closing = False
        # Openings run on the accepting thread; a connection gets a thread once it proved the key.
        self._openings = OpeningLoop(self._listener, QUERY_HELLO, lambda nonce: self._key.query_proof(b"server", nonce),
                                     self.admission, hello_timeout_s, self._opened, lambda: self._closing)
        self._accepter = threading.Thread(target=self._openings.run, name="kvpool-master-queries", daemon=True)
        self._accepter.start()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            connections = list(self._connections)
        for sock in [self._listener, *connections]:
            shutdown(sock)
        self._listener.close()
        self._accepter.join(timeout=5.0)

    def _opened(self, conn: socket.socket, nonce: bytes, proof: bytes) -> None:
        with self._lock:
            refused = self._closing or not self._key.check_query_proof(b"client", nonce, proof)
            if not refused:
                self._connections.add(conn)
        if refused:
            conn.close()
            self.admission.release(conn)
            return
        self.admission.proven(conn)
        threading.Thread(target=self._connection, args=(conn,), name="kvpool-master-query", daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(conn, self.idle_timeout_s, 30.0)  # BlockingIOError past either: dropped
            while True:
                frame = read_frame(conn)
                if frame is None:
                    return
                write_frame(conn, self._serve(frame))
        except (OSError, errors.KVPoolError) as exc:
            if not self._closing:
                log.debug("query connection dropped: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()
            self.admission.release(conn)
