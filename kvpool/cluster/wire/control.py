"""Calls to a node's control socket (``replicate``, ``stats``, ``ping``): :func:`control_call`.

The node side (the ROUTER socket and its handlers) is :class:`kvpool.cluster.node.server.Node`;
the messages are :mod:`kvpool.cluster.wire.protocol`'s control section.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from kvpool import errors
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire import schema as S
from kvpool.cluster.wire.security import ClusterKey, HandshakeWatch, recv_or_refused


def control_call(control: str, op: str, body: Mapping[str, Any] | S.Body, timeout_s: float, *,
                 cluster_key: ClusterKey, context: zmq.Context[Any] | None = None,
                 check: Callable[[], None] | None = None) -> Any:
    """One request to a node's control socket (``replicate``, ``stats``, ``ping``); returns the
    reply body or raises the node's typed error.

    Authenticates with ``cluster_key`` (the caller's, from its settings); a node that refuses it
    is AuthenticationError as soon as the handshake fails. ``check()`` runs every 100 ms of
    waiting and may raise to give up early (a stopping master, a target known to be gone).
    """
    key = cluster_key
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)  # a reply larger than this is dropped unread
    key.secure_client(sock)
    watch = HandshakeWatch(sock)
    request_id = secrets.randbits(62)
    try:
        sock.connect(control)
        sock.send(P.pack_control_request(request_id, op, body))
        frame = recv_or_refused(sock, watch, timeout_s, f"{op}: node control socket", control, key, check,
                                lost=0)
        if frame is None and watch.sessions_lost:  # the node died or restarted holding the request
            raise errors.TransferError(f"node {control} dropped the connection before answering {op!r}")
        if frame is None:
            raise errors.KVTimeoutError(f"node {control} did not answer {op!r} within {timeout_s:.3g} s")
    finally:
        watch.close()  # first: see HandshakeWatch.close
        sock.close(0)
    try:
        return P.unpack_control_reply(frame, request_id)  # the node's typed error; TransferError if not ours
    except errors.KVPoolError as exc:
        raise type(exc)(f"{op} on {control} failed: {exc}") from None
