"""The endpoints a pull server replies on (progress thread only).

A client reaches the server either through its UCX listener (the client sends a
hello naming its ``conn_id`` first) or, on the same host, by worker address: the
request then carries the client's own worker address and the server creates the
reply endpoint itself, one per client. A request that overtakes its connection's
hello is parked until the hello arrives, or forgotten after ``park_s`` (the
client's deadline reports that failure).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvpool.transport.engine import Array, Engine, RecentFailures, close_endpoint, describe, ucx_api
from kvpool.transport.frames import HELLO, HELLO_MAGIC, PROTOCOL_VERSION, Request

log = logging.getLogger("kvpool.transport")

#: after a client's reply endpoint could not be made, its requests that reach the server meanwhile
#: are dropped (counted as errors) for this long instead of each trying again: a client that died
#: with a batch of pulls in flight cost one attempt, one warning and UCX's ERROR lines per pull
REPLY_RETRY_S = 2.0


class ReplyEndpoints:
    """``conn_id`` → endpoint. ``dispatch(request, ep)`` serves a request once its endpoint
    is known; ``dropped(ep)`` is told of every endpoint closed for a dead or failed client
    (after it is closed, so sends reading a source's memory are cancelled first);
    ``error()`` counts each malformed hello, unreachable client and forgotten request."""

    def __init__(self, engine: Engine, name: str, *, park_s: float, dispatch: Callable[[Request, Any], None],
                 dropped: Callable[[Any], None], error: Callable[[], None]) -> None:
        self._engine, self._name, self._park_s = engine, name, park_s
        self._dispatch, self._dropped, self._error = dispatch, dropped, error
        self._pending_hello: set[Any] = set()
        self._conns: dict[int, Any] = {}  # conn_id -> endpoint replies go out on
        self._reply_conn: dict[int, int] = {}  # client_id -> conn_id of its worker-address reply endpoint
        self._parked: dict[int, list[Request]] = {}
        self._unreachable = RecentFailures(lambda: REPLY_RETRY_S)  # reply addresses

    # -- listener connections ------------------------------------------------------------

    def accept(self, listener: Any, conn_request: int) -> None:
        ep = listener.create_endpoint_from_conn_request(conn_request, True)
        # Called from inside UCX when the client goes away; sweep afterwards,
        # never close an endpoint from within its own error callback.
        ep.set_close_callback(self._engine.post, cb_args=(self.sweep,))
        hello = bytearray(HELLO.size)
        self._pending_hello.add(ep)
        array = Array(hello)
        self._engine.watch(ep.stream_recv(array), lambda err: self._on_hello(ep, hello, err), array)

    def _on_hello(self, ep: Any, hello: bytearray, error: BaseException | None) -> None:
        self._pending_hello.discard(ep)
        if error is not None:
            log.debug("%s: connection closed before its hello: %s", self._name, error)
            close_endpoint(ep)
            return
        magic, version, conn_id = HELLO.unpack(hello)
        if magic != HELLO_MAGIC or version != PROTOCOL_VERSION or conn_id in self._conns:
            self._error()
            log.warning("%s: bad hello %r, dropping connection", self._name, bytes(hello))
            close_endpoint(ep)
            return
        self._conns[conn_id] = ep
        for request in self._parked.pop(conn_id, []):
            self._dispatch(request, ep)

    def sweep(self) -> None:
        """Drop the endpoints whose client went away."""
        for ep in [ep for ep in self._conns.values() if not ep.alive]:
            self.drop(ep)
        for ep in [ep for ep in self._pending_hello if not ep.alive]:
            self._pending_hello.discard(ep)
            close_endpoint(ep)

    # -- requests --------------------------------------------------------------------------

    def route(self, request: Request) -> None:
        """Dispatch ``request`` on its client's endpoint, connecting or parking as needed."""
        ep = self._conns.get(request.conn_id)
        if ep is None and request.reply_address:
            ep = self._connect_reply_endpoint(request)
            if ep is None:
                return
        if ep is None:
            self._parked.setdefault(request.conn_id, []).append(request)
            self._engine.call_later(self._park_s, lambda: self._unpark(request))
            return
        self._dispatch(request, ep)

    def _connect_reply_endpoint(self, request: Request) -> Any:
        """Endpoint to a same-host client's worker address, one per client.

        A client that dropped its endpoint to us (deadline, error) reconnects
        under a new ``conn_id``. UCX pairs the two endpoints a pair of workers
        create toward each other, so our old reply endpoint points at the
        closed one and must be replaced, not reused.
        """
        if self._unreachable.why(request.reply_address) is not None:  # no new attempt, no new warning
            self._error()
            return None
        stale = self._conns.get(self._reply_conn.get(request.client_id, -1))
        if stale is not None:
            self.drop(stale)
        try:
            address = ucx_api.UCXAddress.create_from_buffer(request.reply_address)
            ep = self._engine.worker.create_endpoint_from_worker_address(address, request.reply_error_handling)
            if request.reply_error_handling:
                ep.set_close_callback(self._engine.post, cb_args=(self.sweep,))
        except Exception as exc:
            self._error()
            self._unreachable.failed(request.reply_address, describe(exc))
            log.warning("%s: cannot reach client by worker address: %s (its requests dropped for %g s)",
                        self._name, exc, REPLY_RETRY_S)
            return None
        self._conns[request.conn_id] = ep
        self._reply_conn[request.client_id] = request.conn_id
        return ep

    def _unpark(self, request: Request) -> None:
        parked = self._parked.get(request.conn_id)
        if parked and request in parked:
            parked.remove(request)
            self._error()
            if not parked:
                del self._parked[request.conn_id]

    # -- closing ----------------------------------------------------------------------------

    def drop(self, ep: Any) -> None:
        """Forget and close ``ep``, then tell the server (its jobs on ``ep`` fail)."""
        for conn_id, known in list(self._conns.items()):
            if known is ep:
                del self._conns[conn_id]
                for client_id, reply_conn in list(self._reply_conn.items()):
                    if reply_conn == conn_id:
                        del self._reply_conn[client_id]
        # Close first: closing cancels the sends still reading the sources'
        # memory, and only then may their release() let the node unpin it.
        close_endpoint(ep)
        self._dropped(ep)

    def close(self) -> None:
        """Close every endpoint (cancelling every send) and forget parked requests."""
        eps = list(self._pending_hello) + list(self._conns.values())
        self._pending_hello.clear()
        self._conns.clear()
        self._reply_conn.clear()
        self._parked.clear()
        self._unreachable.clear()
        for ep in eps:
            close_endpoint(ep)
