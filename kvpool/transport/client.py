"""The pulling side: :class:`PullClient` names ``(key, layer range)`` and the bytes land in
the caller's ``out`` buffer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvpool import errors
from kvpool.objformat import LayerRange
from kvpool.transport.engine import (
    TRANSPORTS,
    Array,
    Engine,
    MiB,
    RecentFailures,
    close_endpoint,
    describe,
    local_host_id,
    reply_tag,
    ucx_api,
    ucx_interface_options,
)
from kvpool.transport.frames import (
    ABORT_INDEX,
    HELLO,
    HELLO_MAGIC,
    MAX_CHUNKS,
    MAX_REQUEST_ID,
    MAX_STATUS_TEXT,
    MIN_CHUNK,
    MIN_CHUNK_FLOOR,
    OK_STATUSES,
    PROTOCOL_VERSION,
    REQUEST_TAG,
    STATUS,
    STATUS_OK_MAY_ABORT,
    PeerAddress,
    pack_request,
    parse_status,
    plausible_worker_address,
    status_error,
)
from kvpool.transport.pulls import Peer, PullRequest, PullState, checked_out, checked_pull

log = logging.getLogger("kvpool.transport")

#: after an endpoint to a peer could not be made, pulls to that peer fail at once for this long
#: instead of each trying again: a batch of pulls from a process that just died (a hand-off from
#: an engine killed meanwhile) made one endpoint each, and UCX logged four ERROR lines for each
CONNECT_RETRY_S = 2.0


class PullClient:
    """Pulls ``(key, layer range)`` from :class:`PullServer` peers into caller buffers.

    Thread-safe: any number of threads may call :meth:`pull_into`, and
    :meth:`apull_into` works from any asyncio loop; all UCX work happens on the
    client's own progress thread. Endpoints are cached per peer and dropped on
    any error or deadline. ``transport`` is ``"tcp"`` or ``"auto"`` (see the
    module docstring for the trade-off).
    """

    def __init__(
        self,
        *,
        transport: str = "tcp",
        max_message: int = 16 * MiB,
        ucx_options: Mapping[str, str] | None = None,
        name: str = "kvpool-pull-client",
        host: str | None = "127.0.0.1",
        engine: Engine | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if max_message < 4096:
            raise ValueError(f"max_message must be at least 4096 bytes, got {max_message}")
        self.transport = transport
        self.max_message = max_message
        self._max_chunk = max(MIN_CHUNK, max_message)  # the largest chunk a server may send us
        self._name = name
        self._client_id = secrets.randbits(64)
        self._host_id = local_host_id()
        self._peers: dict[tuple[Any, ...], Peer] = {}
        self._unreachable = RecentFailures(lambda: CONNECT_RETRY_S)  # peer keys
        # ``host``: this process's address (node.host); UCX's transports stay on its interface.
        # ``engine``: a shared one (the node's), which this client uses but does not stop.
        self._owns_engine = engine is None
        self._engine = engine if engine is not None else Engine(
            name, {**ucx_interface_options(host), **(ucx_options or {})})
        self._worker_address: bytes = self._engine.call(lambda: self._engine.worker.address.tobytes())
        self._closing = False
        self.pulls = 0
        self.failures = 0
        self.timeouts = 0
        self.bytes_received = 0
        self.connects_failed = 0
        self.connects_skipped = 0

    # -- public API ------------------------------------------------------------------------

    def pull_into(
        self,
        address: PeerAddress | tuple[str, int],
        key: bytes,
        layer_range: LayerRange | tuple[int, int] | range,
        out: Any,
        *,
        timeout_s: float = 10.0,
        alive: Callable[[], bool] | None = None,
        alive_check_s: float = 0.05,
        token: bytes = b"",
        header_out: bytearray | None = None,
    ) -> int:
        """Pull the bytes of ``layer_range`` of ``key`` from ``address`` into ``out``.

        ``out`` is any writable C-contiguous buffer (numpy array, bytearray,
        memoryview, mmap) at least as large as the payload; bytes land in it
        directly. Returns the number of bytes received (the payload size).

        ``alive`` (optional) is asked every ``alive_check_s`` while the pull
        waits: when it says the holder is gone the pull is abandoned at once
        with TransferError instead of waiting out the deadline (the shared-memory
        transport cannot see a dead peer by itself).

        ``token`` (at most 64 bytes) travels with the request: the pull token the
        master issued for this key on this holder. A server that refuses it
        answers :class:`errors.AuthenticationError` and sends nothing else.

        ``header_out`` (optional): the holder also sends the packed header of
        the object it serves, in the same reply; on return ``header_out`` holds
        exactly those bytes. Its length on entry is the most accepted (0: up to
        :data:`MAX_HEADER_NBYTES`); a longer header fails the pull. Nothing in
        it is verified here: the caller checks it (and the bytes against it).

        Raises :class:`errors.RemoteMissError` if the peer does not hold the
        key, :class:`errors.LayerRangeError` if the range is outside the
        object, :class:`errors.OutBufferError` if ``out`` is unusable or too
        small, :class:`errors.TransferError` on any other remote or transport
        failure, and :class:`errors.KVTimeoutError` if the pull is not complete
        within ``timeout_s``. After an exception the content of ``out`` is
        undefined (possibly partly written), never reported as valid.
        """
        pull = self._new_pull(address, key, layer_range, out, timeout_s, token, header_out)
        self._run_many([(pull, alive)], timeout_s, alive_check_s)
        return pull.future.result(0)

    def pull(self, address: PeerAddress | tuple[str, int], key: bytes,
             layer_range: LayerRange | tuple[int, int] | range, out: Any, *, timeout_s: float = 10.0,
             token: bytes = b"", header_out: bytearray | None = None,
             progress: Callable[[int], None] | None = None, alive: Callable[[], bool] | None = None) -> int:
        """One pull (:meth:`Puller.pull`), as :meth:`pull_into` (UCX never calls ``progress``)."""
        (outcome,) = self.pull_many([PullRequest(address, key, layer_range, out, token, header_out, alive)],
                                    timeout_s=timeout_s)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @property
    def proves_holder(self) -> bool:
        """False: a UCX endpoint proves nothing (whatever took over a dead holder's address
        would be believed)."""
        return False

    def start(self, address: PeerAddress | tuple[str, int], key: bytes,
              layer_range: LayerRange | tuple[int, int] | range, nbytes: int, *, token: bytes = b"",
              timeout_s: float = 10.0) -> DeferredPull:
        """A pull to send once its buffer is known (:class:`StartedPull`): over UCX the request
        carries where the reply lands, so nothing goes out before :meth:`DeferredPull.finish`."""
        if not 0 < nbytes < 2**63:
            raise errors.OutBufferError(f"a pull needs room for at least one byte, got {nbytes}")
        return DeferredPull(self, address, key, layer_range, nbytes, token, timeout_s)

    def pull_many(self, requests: Sequence[PullRequest], *, timeout_s: float = 10.0,
                  alive_check_s: float = 0.05) -> list[int | BaseException]:
        """Pulls in flight together, sent and completed by this thread (no thread per pull, no
        hand-off when no other thread drives the worker): one result per request, in order —
        the bytes received, or the exception :meth:`pull_into` would have raised (a request
        whose arguments are bad gets its own error and the others go on). Each request has the
        whole ``timeout_s``; ``alive`` is asked as in :meth:`pull_into`. Pulls to one holder
        share its endpoint: a transport failure of one fails the others on it too.
        """
        results: list[int | BaseException | None] = [None] * len(requests)
        pending: list[tuple[int, PullState, Callable[[], bool] | None]] = []
        for i, request in enumerate(requests):
            try:
                pull = self._new_pull(request.address, request.key, request.layer_range, request.out, timeout_s,
                                      request.token, request.header_out)
            except (errors.KVPoolError, ValueError, TypeError) as exc:
                results[i] = exc
                continue
            pending.append((i, pull, request.alive))
        if pending:
            self._run_many([(pull, alive) for _, pull, alive in pending], timeout_s, alive_check_s)
        for i, pull, _ in pending:
            error = pull.future.exception(0)
            results[i] = error if error is not None else pull.future.result(0)
        return results  # type: ignore[return-value]

    def _run_many(self, pending: list[tuple[PullState, Callable[[], bool] | None]], timeout_s: float,
                  alive_check_s: float) -> None:
        """Start every pull and wait until each is done or abandoned (holder gone, deadline).

        Usually no other thread drives the worker: this one sends the requests and handles the
        replies itself (no hand-off either way); otherwise it submits them and waits.
        """
        futures = [pull.future for pull, _ in pending]
        # The pulls' own timers enforce the deadline; the slack only guards against a wedged
        # progress thread.
        deadline = time.monotonic() + timeout_s + 5.0
        checked = [(pull, alive) for pull, alive in pending if alive is not None]

        def start() -> None:
            for pull, _ in pending:
                self._start(pull)

        def done() -> bool:
            return all(f.done() for f in futures)

        def gone(pull: PullState) -> errors.TransferError:
            return errors.TransferError(f"pull of {pull.key.hex()}: the holder is gone")

        def check_alive() -> None:  # on the driving thread
            for pull, alive in checked:
                if not pull.future.done() and not alive():
                    self._fail(pull, gone(pull), drop_peer=True)

        if not self._engine.drive(start, done, deadline, check_alive if checked else None, alive_check_s):
            self._engine.submit(start)
            while not done() and time.monotonic() < deadline:
                remaining = max(0.0, deadline - time.monotonic())
                concurrent.futures.wait(futures, min(alive_check_s, remaining) if checked else remaining)
                for pull, alive in checked:
                    if not pull.future.done() and not alive():
                        self._abort(pull.future)
                        _fail_future(pull.future, gone(pull))
        for pull, _ in pending:
            if not pull.future.done():
                self._abort(pull.future)
                _fail_future(pull.future, errors.KVTimeoutError(
                    f"pull of {pull.key.hex()}: no result {timeout_s}s + 5s after it started (UCX stalled)"))

    async def apull_into(
        self,
        address: PeerAddress | tuple[str, int],
        key: bytes,
        layer_range: LayerRange | tuple[int, int] | range,
        out: Any,
        *,
        timeout_s: float = 10.0,
        token: bytes = b"",
        header_out: bytearray | None = None,
    ) -> int:
        """Asyncio twin of :meth:`pull_into` (same arguments, result and errors).

        Several may be in flight at once (e.g. layer ``i+1`` while the caller
        uses layer ``i``). Cancelling the awaiting task does not disturb other
        pulls sharing the endpoint: the pull runs on in the background (its
        result discarded) until it completes or reaches its deadline, so
        ``out`` may still be written until then. It stays referenced, never
        freed under UCX.
        """
        pull = self._new_pull(address, key, layer_range, out, timeout_s, token, header_out)
        self._engine.submit(lambda: self._start(pull))
        return await asyncio.wrap_future(pull.future)

    def close(self) -> None:
        """Fail pulls still in flight, close endpoints and stop the progress thread."""
        if self._engine.closed or self._closing:
            return
        self._closing = True
        if self._owns_engine:
            self._engine.stop(self._close_on_thread)
        else:
            self._engine.call(self._close_on_thread)

    def forget_peers_except(self, alive: Iterable[PeerAddress]) -> None:
        """Close the cached endpoints to peers other than ``alive`` (nodes that left or died)
        that carry no pull now. An endpoint with UCX's failure detection goes when its peer
        does anyway; one reached by a same-host worker address has none and stayed otherwise."""
        keep: set[tuple[Any, ...]] = set()
        for address in alive:
            keep.update({("wa", address.worker_address), ("wa-eh", address.worker_address),
                         ("tcp", address.host, address.port)})

        def forget() -> None:
            for peer in list(self._peers.values()):
                if peer.key not in keep and not peer.pulls:
                    self._drop_peer(peer, "its node left")

        if not self._closing:
            self._engine.post(forget)

    def __enter__(self) -> PullClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_address(self) -> bytes:
        return self._worker_address

    def stats(self) -> dict[str, int]:
        """Counters: pulls completed and failed, timeouts among them, bytes received; endpoints
        that could not be made (``connects_failed``), and pulls failed at once meanwhile
        (``connects_skipped``, see :data:`CONNECT_RETRY_S`)."""
        return {
            "peers": len(self._peers),
            "connects_failed": self.connects_failed,
            "connects_skipped": self.connects_skipped,
            "pulls": self.pulls,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "bytes_received": self.bytes_received,
        }

    # -- submission (caller's thread) -----------------------------------------------------------

    def _new_pull(
        self,
        address: PeerAddress | tuple[str, int],
        key: bytes,
        layer_range: LayerRange | tuple[int, int] | range,
        out: Any,
        timeout_s: float,
        token: bytes = b"",
        header_out: bytearray | None = None,
    ) -> PullState:
        if self._closing:
            raise errors.PoolClosedError(f"{self._name} is closed")
        if self._engine.on_thread():
            raise RuntimeError("pull_into cannot be called from the client's own progress thread")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        args = checked_pull(address, key, layer_range, out, token, header_out)
        pull = PullState(address=args.address, key=args.key, layer_range=args.layer_range, out=args.out,
                     timeout_s=float(timeout_s), future=concurrent.futures.Future(), token=args.token)
        if header_out is not None:
            pull.header_out = header_out
            pull.status_buf = bytearray(STATUS.size + max(args.header_room, MAX_STATUS_TEXT))
        pull.future.kvpool_pull = pull  # type: ignore[attr-defined]  # for _abort
        return pull

    def _abort(self, future: concurrent.futures.Future[int]) -> None:
        pull = getattr(future, "kvpool_pull", None)
        if pull is None:
            return
        try:
            self._engine.submit(
                lambda: self._fail(pull, errors.TransferError("pull cancelled"), drop_peer=True)
            )
        except errors.PoolClosedError:
            pass

    # -- progress thread ------------------------------------------------------------------------

    def _start(self, pull: PullState) -> None:
        pull.timer = self._engine.call_later(pull.timeout_s, lambda: self._on_deadline(pull))
        if pull.future.cancelled():
            self._fail(pull, errors.TransferError("pull cancelled"))
            return
        try:
            peer = self._peer_for(pull.address)
        except Exception as exc:
            where = f"{pull.address.host}:{pull.address.port}"
            self._fail(pull, errors.TransferError(f"cannot connect to {where}: {describe(exc)}"))
            return
        pull.peer = peer
        peer.pulls.add(pull)
        pull.request_id = next(self._engine.request_ids) & MAX_REQUEST_ID
        reply_address = self._worker_address if peer.by_worker_address else b""
        frame = pack_request(pull.key, pull.token, pull.layer_range, pull.out.nbytes,
                              want_header=pull.header_out is not None, max_chunk=self.max_message,
                              request_id=pull.request_id, client_id=self._client_id, conn_id=peer.conn_id,
                              reply_address=reply_address, reply_error_handling=peer.error_handling)
        status_array, frame_array = Array(pull.status_buf), Array(frame)
        # The first chunk's receive is posted before the request goes out, straight into
        # `out` (the server's chunk is at most our max_message; a shorter message fits): the
        # bytes of a pull of one chunk land while the status is still being handled, and one
        # request + one reply is the whole pull. A pull that fails cancels it.
        # (A server's chunk is at most max(MIN_CHUNK, our max_message).)
        first_array = Array(pull.out[:min(pull.out.nbytes, self._max_chunk)])
        try:
            status_req = peer.ep.tag_recv(status_array, reply_tag(pull.request_id, 0))
            first_req = peer.ep.tag_recv(first_array, reply_tag(pull.request_id, 1))
            pull.receives.append(first_req)
            send_req = peer.ep.tag_send(frame_array, ucx_api.UCXXTag(REQUEST_TAG))
        except Exception as exc:
            self._fail(pull, errors.TransferError(f"{peer.label}: {describe(exc)}"), drop_peer=True)
            return
        self._engine.watch(status_req, lambda err: self._on_status(pull, err), status_array)
        self._engine.watch(first_req, functools.partial(self._on_chunk, pull, first_req), first_array)
        def sent(err: BaseException | None) -> None:
            if err is not None:
                self._fail(pull, errors.TransferError(f"{peer.label}: request send failed: {describe(err)}"),
                           drop_peer=True)

        self._engine.watch(send_req, sent, frame_array)

    def _peer_for(self, address: PeerAddress) -> Peer:
        use_worker_address = (
            self.transport == "auto" and bool(address.worker_address) and address.host_id == self._host_id
        )
        if use_worker_address and not plausible_worker_address(address.worker_address):
            log.warning("%s: %s:%d advertises a malformed worker address; using its listener",
                        self._name, address.host, address.port)
            use_worker_address = False
        # A server without a sockaddr listener (port 0) is reached through its worker address
        # with UCX's peer-failure detection on: TCP over the interfaces its UCX context uses.
        checked_worker_address = (not use_worker_address and not address.port
                                  and plausible_worker_address(address.worker_address))
        key: tuple[Any, ...] = (
            ("wa", address.worker_address) if use_worker_address
            else ("wa-eh", address.worker_address) if checked_worker_address
            else ("tcp", address.host, address.port))
        peer = self._peers.get(key)
        if peer is not None and peer.error_handling and not peer.ep.alive:
            self._drop_peer(peer, "endpoint failed while idle")
            peer = None
        if peer is not None:
            return peer
        why = self._unreachable.why(key)
        if why is not None:
            self.connects_skipped += 1
            raise errors.TransferError(f"{why} (failed moments ago; not tried again for {CONNECT_RETRY_S:g} s)")
        try:
            peer = self._new_peer(key, address, use_worker_address, checked_worker_address)
        except Exception as exc:
            self.connects_failed += 1
            self._unreachable.failed(key, describe(exc))
            raise
        self._peers[key] = peer
        return peer

    def _new_peer(self, key: tuple[Any, ...], address: PeerAddress, use_worker_address: bool,
                  checked_worker_address: bool) -> Peer:
        """An endpoint to ``address`` as :meth:`_peer_for` chose to reach it (its hello sent)."""
        worker = self._engine.worker
        if use_worker_address:
            ucx_address = ucx_api.UCXAddress.create_from_buffer(address.worker_address)
            ep = worker.create_endpoint_from_worker_address(ucx_address, False)
            peer = Peer(key, ep, False, f"{address.host}:{address.port} (worker address)",
                         by_worker_address=True)
        elif checked_worker_address:
            ucx_address = ucx_api.UCXAddress.create_from_buffer(address.worker_address)
            ep = worker.create_endpoint_from_worker_address(ucx_address, True)
            ep.set_close_callback(self._engine.post, cb_args=(self._sweep_dead_peers,))
            peer = Peer(key, ep, True, f"{address.host} (worker address, tcp)", by_worker_address=True)
        elif not address.port:
            raise errors.TransferError(f"{address.host}: neither a listener port nor a usable worker address")
        else:
            ep = ucx_api.UCXEndpoint.create(worker, address.host, address.port, True)
            ep.set_close_callback(self._engine.post, cb_args=(self._sweep_dead_peers,))
            peer = Peer(key, ep, True, f"{address.host}:{address.port}")
            hello = bytearray(HELLO.size)
            HELLO.pack_into(hello, 0, HELLO_MAGIC, PROTOCOL_VERSION, peer.conn_id)
            hello_array = Array(hello)
            def hello_sent(err: BaseException | None, peer: Peer = peer) -> None:
                if err is not None:
                    self._drop_peer(peer, f"hello failed: {describe(err)}")

            self._engine.watch(ep.stream_send(hello_array), hello_sent, hello_array)
        return peer

    def _sweep_dead_peers(self) -> None:
        for peer in list(self._peers.values()):
            if peer.error_handling and not peer.ep.alive:
                self._drop_peer(peer, "connection lost")

    def _on_status(self, pull: PullState, error: BaseException | None) -> None:
        if pull.done:
            return
        peer = pull.peer
        assert peer is not None
        if error is not None:
            self._fail(pull, errors.TransferError(f"{peer.label}: {describe(error)}"), drop_peer=True)
            return
        frame = parse_status(pull.status_buf, pull.request_id)
        if frame is None:
            self._fail(pull, errors.ProtocolError(f"{peer.label}: malformed status frame"), drop_peer=True)
            return
        status, nbytes, chunk, body = frame
        layers = pull.layer_range
        what = f"{peer.label}: pull of {pull.key.hex()} layers [{layers.start}, {layers.stop})"
        if status not in OK_STATUSES:
            self._fail(pull, status_error(status)(f"{what}: {body.decode('utf-8', 'replace')}"))
            return
        if pull.header_out is not None:
            if not body:
                self._fail(pull, errors.ProtocolError(f"{what}: OK without the header asked for"), drop_peer=True)
                return
            pull.header_out[:] = body  # before the status buffer takes the abort frame
        if nbytes > pull.out.nbytes or (nbytes and chunk < min(MIN_CHUNK_FLOOR, nbytes)) \
                or -(-nbytes // max(chunk, 1)) > MAX_CHUNKS:
            self._fail(pull, errors.ProtocolError(f"{what}: bad sizes {nbytes}/{chunk}"), drop_peer=True)
            return
        if nbytes and chunk > self._max_chunk:
            self._fail(pull, errors.ProtocolError(f"{what}: chunk {chunk} above {self._max_chunk}"),
                       drop_peer=True)
            return
        pull.nbytes, pull.chunk = nbytes, chunk
        total = -(-nbytes // chunk) if nbytes else 0
        # The first chunk's receive went out with the request and may have completed already.
        pull.chunks_left = total - pull.chunks_done
        if pull.chunks_left <= 0:
            self._succeed(pull)  # an empty payload: this cancels the first chunk's receive
            return
        try:
            for i in range(1, total):
                lo = i * chunk
                array = Array(pull.out[lo:min(lo + chunk, nbytes)])
                req = peer.ep.tag_recv(array, reply_tag(pull.request_id, i + 1))
                pull.receives.append(req)
                self._engine.watch(req, functools.partial(self._on_chunk, pull, req), array)
            if status != STATUS_OK_MAY_ABORT:  # from memory: every chunk comes, no abort frame
                return
            # The status buffer is free again: it takes the abort frame, if any.
            array = Array(pull.status_buf)
            pull.abort_receive = peer.ep.tag_recv(array, reply_tag(pull.request_id, ABORT_INDEX))
            self._engine.watch(pull.abort_receive, lambda err: self._on_abort(pull, what, err), array)
        except Exception as exc:
            self._fail(pull, errors.TransferError(f"{what}: {describe(exc)}"), drop_peer=True)

    def _on_chunk(self, pull: PullState, request: Any, error: BaseException | None) -> None:
        if pull.done:
            return
        if error is not None:
            assert pull.peer is not None
            self._fail(pull, errors.TransferError(f"{pull.peer.label}: {describe(error)}"), drop_peer=True)
            return
        pull.receives.remove(request)
        pull.chunks_done += 1
        if not pull.chunk:  # the status has not been handled yet: it counts this chunk
            return
        pull.chunks_left -= 1
        if pull.chunks_left == 0:
            self._succeed(pull)

    def _on_abort(self, pull: PullState, what: str, error: BaseException | None) -> None:
        pull.abort_receive = None
        if pull.done:
            return
        if error is not None:
            self._fail(pull, errors.TransferError(f"{what}: {describe(error)}"), drop_peer=True)
            return
        frame = parse_status(pull.status_buf, pull.request_id)
        text = frame[3].decode("utf-8", "replace") if frame is not None else "malformed abort frame"
        # Every chunk the server sent was delivered before this frame; the
        # receives still posted are for chunks that will never come.
        self._fail(pull, errors.TransferError(f"{what}: holder failed mid-pull: {text}"))

    def _cancel_receives(self, pull: PullState) -> None:
        """Cancel a finished pull's receives that can no longer match.

        ucxx has no per-request cancel call: a request whose Python object is
        collected is cancelled, so dropping our references is the cancel.
        """
        for request in pull.receives:
            self._engine.unwatch(request)
        pull.receives.clear()
        if pull.abort_receive is not None:
            self._engine.unwatch(pull.abort_receive)
            pull.abort_receive = None

    def _on_deadline(self, pull: PullState) -> None:
        if not pull.done:
            where = pull.peer.label if pull.peer is not None else f"{pull.address.host}:{pull.address.port}"
            if not pull.nbytes and not pull.chunks_left:
                stage = "no reply yet"
            else:
                stage = f"{pull.chunks_left} of {-(-pull.nbytes // max(pull.chunk, 1))} messages missing"
            self._fail(pull, errors.KVTimeoutError(
                f"{where}: pull of {pull.key.hex()} not complete after {pull.timeout_s}s ({stage})"),
                drop_peer=True)

    def _succeed(self, pull: PullState) -> None:
        pull.done = True
        self._cancel_receives(pull)  # the abort receive
        self.pulls += 1
        self.bytes_received += pull.nbytes
        self._detach(pull)
        if not pull.future.done():
            pull.future.set_result(pull.nbytes)

    def _fail(self, pull: PullState, exc: BaseException, *, drop_peer: bool = False) -> None:
        if pull.done:
            return
        peer = pull.peer
        if drop_peer and peer is not None:
            self._drop_peer(peer, f"{type(exc).__name__} on {pull.key.hex()}", first=(pull, exc))
            return
        self._finish_failed([(pull, exc)])

    def _finish_failed(self, failed: list[tuple[PullState, BaseException]]) -> None:
        for pull, exc in failed:
            pull.done = True
            self._cancel_receives(pull)
            self._detach(pull)
            self.failures += 1
            self.timeouts += isinstance(exc, errors.KVTimeoutError)
            if not pull.future.done():
                pull.future.set_exception(exc)

    def _detach(self, pull: PullState) -> None:
        if pull.timer is not None:
            pull.timer.cancel()
        if pull.peer is not None:
            pull.peer.pulls.discard(pull)
            pull.peer = None

    def _drop_peer(
        self, peer: Peer, reason: str, first: tuple[PullState, BaseException] | None = None
    ) -> None:
        """Forget ``peer``, close its endpoint, then fail every pull that used it."""
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]
        failed = [first] if first is not None else []
        failed += [
            (other, errors.TransferError(f"{peer.label}: connection dropped ({reason})"))
            for other in peer.pulls if first is None or other is not first[0]
        ]
        for pull, _ in failed:
            pull.done = True  # their receives' cancellations below are not failures of their own
        # Closing cancels the pulls' receives before their callers hear of the
        # failure, so no late bytes land in an `out` buffer afterwards.
        close_endpoint(peer.ep)
        self._finish_failed(failed)

    def _close_on_thread(self) -> None:
        for peer in list(self._peers.values()):
            for pull in list(peer.pulls):
                self._fail(pull, errors.PoolClosedError(f"{self._name} closed"))
            self._drop_peer(peer, "client closing")


class DeferredPull:
    """A pull :meth:`PullClient.start` prepared: sent and received by :meth:`finish`."""

    __slots__ = ("address", "client", "key", "layer_range", "nbytes", "timeout_s", "token")

    def __init__(self, client: PullClient, address: PeerAddress | tuple[str, int], key: bytes,
                 layer_range: LayerRange | tuple[int, int] | range, nbytes: int, token: bytes,
                 timeout_s: float) -> None:
        self.client, self.address, self.key, self.layer_range = client, address, key, layer_range
        self.nbytes, self.token, self.timeout_s = nbytes, token, timeout_s

    def finish(self, out: Any, header_out: bytearray | None = None, *,
               progress: Callable[[int], None] | None = None, alive: Callable[[], bool] | None = None) -> int:
        """Pull into ``out`` (its first ``nbytes``), as :meth:`PullClient.pull_into`."""
        view = checked_out(out)
        if view.nbytes < self.nbytes:
            raise errors.OutBufferError(f"out holds {view.nbytes} bytes, the pull asked for {self.nbytes}")
        return self.client.pull(self.address, self.key, self.layer_range, view[:self.nbytes],
                                timeout_s=self.timeout_s, token=self.token, header_out=header_out, alive=alive)

    def cancel(self) -> None:
        """Nothing was sent: nothing to drop."""


def _fail_future(future: concurrent.futures.Future[int], exc: BaseException) -> None:
    """Fail ``future`` unless the progress thread finished it meanwhile."""
    try:
        future.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass
