"""The serving side of a pull: :class:`PullServer` answers requests from a provider's
:class:`ServeSource` (memory views sent in place, or nvme reads through staging buffers).
"""

from __future__ import annotations

import concurrent.futures
import logging
import mmap
from collections.abc import Callable, Mapping
from typing import Any, cast

from kvpool import errors
from kvpool.transport.answer import decide, provide
from kvpool.transport.connections import ReplyEndpoints
from kvpool.transport.engine import (
    Array,
    Engine,
    MiB,
    describe,
    local_host_id,
    reply_tag,
    ucx_api,
    ucx_interface_options,
)
from kvpool.transport.frames import (
    ABORT_INDEX,
    RECEIVES_POSTED,
    REQUEST_BUFFER_NBYTES,
    REQUEST_TAG,
    STATUS_ERROR,
    STATUS_MISS,
    STATUS_UNAUTHORIZED,
    PeerAddress,
    Request,
    pack_status,
    parse_request,
)
from kvpool.transport.source import (
    INLINE,
    Provider,
    ProviderWouldBlock,
    ServeJob,
    ServeSource,
)
from kvpool.transport.staging import StagedReads

log = logging.getLogger("kvpool.transport")


class PullServer:
    """Serves ``(key, layer range)`` pulls from this process over UCX.

    ``provider(key, layer_range)`` is called on a worker thread for each pull
    and returns a :class:`ServeSource`, or ``None`` for a miss. It may raise:
    the client then gets a typed error (``LayerRangeError`` for a bad range,
    ``TransferError`` with the exception's text otherwise) instead of a hang.
    Providers should not block indefinitely: a stalled provider ties up one of
    ``provider_threads`` and its client times out. ``inline_provider=True``
    calls it on the progress thread instead, saving a thread hop per pull
    (a wake-up of a worker thread and one back, much of a small pull's time); only for providers
    that never block (memory lookups), since a stall there stalls every pull.
    ``read_into`` always runs on the worker threads.

    Counters (read from any thread): ``bytes_sent`` (payload bytes whose send
    completed), ``messages_sent`` (payload messages), ``requests_served`` (pulls fully sent), ``misses``,
    ``errors`` (provider errors, failed or timed-out sends, malformed
    requests); ``stats()["in_flight"]`` counts pulls not yet fully released.
    """

    def __init__(
        self,
        provider: Provider,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message: int = 16 * MiB,
        *,
        send_timeout_s: float = 30.0,
        provider_threads: int = 4,
        inline_provider: bool = False,
        staging_buffers: int = 4,
        ucx_options: Mapping[str, str] | None = None,
        name: str = "kvpool-pull-server",
        engine: Engine | None = None,
        authorize: Callable[[bytes, bytes], None] | None = None,
        listener: bool = True,
    ) -> None:
        if max_message < 4096:
            raise ValueError(f"max_message must be at least 4096 bytes, got {max_message}")
        self._provider = provider
        #: ``authorize(key, token)`` raises AuthenticationError to refuse a pull; called before
        #: the provider, on the same thread, so a refused pull never pins or sends anything
        self._authorize = authorize
        self._host = host
        self._requested_port = port
        self._use_listener = listener
        self.max_message = max_message
        self.send_timeout_s = send_timeout_s
        self.inline_provider = inline_provider
        self._provider_threads = provider_threads
        self._ucx_options = {**ucx_interface_options(host), **(ucx_options or {})}
        self._name = name
        self._engine: Engine | None = None
        self._shared_engine = engine  # a shared one (the node's) is used, never stopped, here
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._listener: Any = None
        self._closing = False  # progress thread: close began, requests are no longer served
        self._port = 0
        self._worker_address = b""
        self._host_id = local_host_id()
        # Progress-thread state.
        self._recv_slots: list[tuple[Any, bytearray]] = []
        self._endpoints: ReplyEndpoints | None = None  # made on start, on the progress thread
        self._jobs: set[ServeJob] = set()
        self._reads = StagedReads(max(2, staging_buffers), max_message, submit=self._submit_io,
                                  post=self._post_from_worker, send=self._send_chunk, abort=self._maybe_abort,
                                  release=self._release)
        self._releasing = 0  # sources whose release() is queued or running
        self._awaiting_provider: set[ServeJob] = set()  # provider call not returned yet
        self._deferred_release: set[ServeJob] = set()  # finished, a read still running
        self.bytes_sent = 0
        self.messages_sent = 0
        self.requests_served = 0
        self.misses = 0
        self.errors = 0
        self.refused = 0  # pulls whose token authorize() refused

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> PullServer:
        """Create the UCX worker and listener; returns ``self``. Idempotent.

        Raises :class:`errors.TransferError` if UCX cannot start or the port is taken.
        """
        if self._engine is not None:
            return self
        engine = self._shared_engine or Engine(self._name, self._ucx_options)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self._provider_threads, thread_name_prefix=f"{self._name}-io"
        )
        self._engine = engine
        try:
            engine.call(self._start_on_thread)
        except Exception as exc:
            self.close()
            raise errors.TransferError(
                f"{self._name}: cannot listen on port {self._requested_port}: {describe(exc)}") from exc
        if self._use_listener:
            log.info("%s: serving pulls on %s:%d (UCX listener)", self._name, self._host, self._port)
        else:  # no sockaddr listener: peers reach the worker by its address, over transports on host
            log.info("%s: serving pulls over UCX on %s by worker address (no listener port)", self._name, self._host)
        return self

    def _start_on_thread(self) -> None:
        engine = self._engine
        assert engine is not None
        # The request overtook the connection's hello: parked until it arrives, or forgotten
        # after send_timeout_s (the client's deadline reports the failure).
        endpoints = self._endpoints = ReplyEndpoints(
            engine, self._name, park_s=self.send_timeout_s, dispatch=self._dispatch, dropped=self._on_dropped,
            error=self._count_error)
        if self._use_listener:
            # ucxx 0.52 binds its sockaddr listener to every interface (no address parameter).
            self._listener = ucx_api.UCXListener.create(
                engine.worker, self._requested_port, lambda conn_request: endpoints.accept(self._listener, conn_request)
            )
            self._port = self._listener.port
        self._worker_address = engine.worker.address.tobytes()
        for _ in range(RECEIVES_POSTED):
            self._post_request_receive()

    def close(self) -> None:
        """Stop serving: close endpoints and listener, release sources, join threads."""
        engine, self._engine = self._engine, None
        if engine is not None and engine is self._shared_engine:
            if not engine.closed:
                engine.call(self._close_on_thread)
        elif engine is not None:
            engine.stop(self._close_on_thread)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        # Reads that were still running when the thread stopped: release now
        # (single-threaded from here on).
        for job in list(self._deferred_release):
            job.reads_in_flight = 0
            self._release(job)
        self._reads.close()

    def _close_on_thread(self) -> None:
        self._closing = True
        self._listener = None  # ucp_listener_destroy: no new connections
        if self._endpoints is not None:
            self._endpoints.close()  # cancels every send before any source is released
        for job in list(self._jobs):
            self._finish(job, ok=False, reason="server closing")
        self._recv_slots.clear()

    def __enter__(self) -> PullServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- addresses and counters ---------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the UCX listener (``host`` is what was advertised)."""
        self._require_started()
        return (self._host, self._port)

    @property
    def worker_address(self) -> bytes:
        """This server's UCX worker address (same-host fast path)."""
        self._require_started()
        return self._worker_address

    @property
    def peer_address(self) -> PeerAddress:
        self._require_started()
        return PeerAddress(self._host, self._port, self._worker_address, self._host_id)

    def stats(self) -> dict[str, int]:
        """Counters; ``in_flight`` counts pulls whose source is not yet released."""
        engine = self._engine
        if engine is not None and not engine.on_thread():
            try:
                # The job sets belong to the progress thread: read them there.
                return cast(dict[str, int], engine.call(self.stats, timeout_s=5.0))
            except (errors.PoolClosedError, errors.KVTimeoutError):
                pass
        return {
            "bytes_sent": self.bytes_sent,
            "messages_sent": self.messages_sent,
            "requests_served": self.requests_served,
            "misses": self.misses,
            "errors": self.errors,
            "refused": self.refused,
            "in_flight": len(self._jobs | self._awaiting_provider | self._deferred_release) + self._releasing,
        }

    def _require_started(self) -> None:
        if self._engine is None:
            raise errors.PoolClosedError(f"{self._name} is not started")

    def _count_error(self) -> None:
        self.errors += 1

    def _submit_io(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._executor is not None
        self._executor.submit(fn, *args)

    def _post_from_worker(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the progress thread; PoolClosedError once the server is closing."""
        engine = self._engine
        if engine is None:
            raise errors.PoolClosedError("closing")
        engine.submit(fn)

    @property
    def _live_engine(self) -> Engine:
        """The progress engine, for code that runs on it (so it exists)."""
        engine = self._engine
        assert engine is not None, "PullServer used before start() or after close()"
        return engine

    # -- requests (progress thread) ----------------------------------------------------------

    def _post_request_receive(self) -> None:
        buf = bytearray(REQUEST_BUFFER_NBYTES)
        array = Array(buf)
        req = self._live_engine.worker.tag_recv(array, ucx_api.UCXXTag(REQUEST_TAG))
        slot = (req, buf)
        self._recv_slots.append(slot)
        self._live_engine.watch(req, lambda err: self._on_request_frame(slot, err), array)

    def _on_request_frame(self, slot: tuple[Any, bytearray], error: BaseException | None) -> None:
        self._recv_slots.remove(slot)
        if self._engine is None or self._closing:
            return
        self._post_request_receive()
        if error is not None:
            self.errors += 1
            log.warning("%s: request receive failed: %s", self._name, describe(error))
            return
        try:
            request = parse_request(slot[1])
        except errors.ProtocolError as exc:
            self.errors += 1
            log.warning("%s: dropping malformed request: %s", self._name, exc)
            return
        assert self._endpoints is not None
        self._endpoints.route(request)

    def _dispatch(self, request: Request, ep: Any) -> None:
        job = ServeJob(request, ep)
        self._jobs.add(job)
        job.timer = self._live_engine.call_later(self.send_timeout_s, lambda: self._on_send_timeout(job))
        self._awaiting_provider.add(job)
        assert self._executor is not None
        if self.inline_provider:
            self._call_provider(job, inline=True)
        else:
            self._executor.submit(self._call_provider, job)

    def _call_provider(self, job: ServeJob, inline: bool = False) -> None:
        # Runs on a worker thread (providers may take locks or touch disk), or inline on the
        # progress thread, where a provider that would have to wait says so and is retried
        # on a worker.
        outcome: object
        try:
            INLINE.active = inline
            try:
                outcome = provide(job.request, self._provider, self._authorize)
            finally:
                INLINE.active = False
        except BaseException as exc:  # not an Exception (provide returns those): still answered
            outcome = exc
        if isinstance(outcome, ProviderWouldBlock):
            assert self._executor is not None
            self._executor.submit(self._call_provider, job)
            return
        if inline:  # already on the progress thread: reply now, no hand-off
            self._on_source(job, outcome)
            return
        try:
            self._post_from_worker(lambda: self._on_source(job, outcome))
        except errors.PoolClosedError:
            if isinstance(outcome, ServeSource) and outcome.release is not None:
                outcome.release()

    def _on_source(self, job: ServeJob, outcome: object) -> None:
        self._awaiting_provider.discard(job)
        if isinstance(outcome, ServeSource):
            job.source = outcome  # released when the job finishes, whatever the answer
        if job.finished:  # timed out or closed while the provider ran
            self._release(job)
            return
        answer = decide(job.request, outcome, self.max_message)
        if not answer.ok:
            self.misses += answer.status == STATUS_MISS
            self.refused += answer.status == STATUS_UNAUTHORIZED
            self._send_status(job, answer.status, text=answer.text)
            self._finish(job, ok=answer.status == STATUS_MISS, reason=answer.text, counted=answer.is_error)
            return
        job.chunk, job.chunks_total = answer.chunk, answer.chunks
        if not self._send_status(job, answer.status, nbytes=answer.nbytes, chunk=answer.chunk, body=answer.header):
            return
        if job.chunks_total == 0:
            self._finish(job, ok=True)
        elif answer.source is not None and answer.source.read_into is None:
            self._send_buffers(job)
        else:
            self._reads.pump(job)

    def _send_status(
        self, job: ServeJob, status: int, *, text: str = "", nbytes: int = 0, chunk: int = 0,
        index: int = 0, body: bytes = b"",
    ) -> bool:
        array = Array(pack_status(job.request.request_id, status, nbytes, chunk, text, body))
        try:
            req = job.ep.tag_send(array, reply_tag(job.request.request_id, index))
        except Exception as exc:
            self._on_send_failed(job, exc)
            return False
        def sent(err: BaseException | None) -> None:
            if err is not None:
                self._on_send_failed(job, err)

        self._live_engine.watch(req, sent, array)
        return True

    def _send_buffers(self, job: ServeJob) -> None:
        source = job.source
        assert source is not None
        views = list(source.buffers)
        index, offset = 0, 0  # position in views
        for i in range(job.chunks_total):
            want = min(job.chunk, source.nbytes - i * job.chunk)
            pieces: list[memoryview] = []
            while want:
                view = views[index]
                take = min(want, view.nbytes - offset)
                pieces.append(view[offset:offset + take])
                offset += take
                want -= take
                if offset == view.nbytes:
                    index, offset = index + 1, 0
            # A chunk straddling two buffers is gathered: the rare path (memory
            # tiers hand one contiguous extent), and still one message.
            payload = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
            if not self._send_chunk(job, i + 1, payload):
                return

    def _send_chunk(
        self, job: ServeJob, index: int, payload: memoryview, staging: mmap.mmap | None = None
    ) -> bool:
        job.chunks_started += 1
        nbytes = payload.nbytes
        array = Array(payload)
        try:
            req = job.ep.tag_send(array, reply_tag(job.request.request_id, index))
        except Exception as exc:
            if staging is not None:
                self._reads.give(job, staging)
            self._on_send_failed(job, exc)
            return False
        self._live_engine.watch(req, lambda err: self._on_chunk_sent(job, nbytes, staging, err), array)
        return True

    def _on_chunk_sent(
        self, job: ServeJob, nbytes: int, staging: mmap.mmap | None, error: BaseException | None
    ) -> None:
        if staging is not None:
            self._reads.give(job, staging)
        if error is not None:
            self._on_send_failed(job, error)
            return
        self.bytes_sent += nbytes
        self.messages_sent += 1
        job.chunks_done += 1
        if job.abort_text:
            self._maybe_abort(job)
        elif job.chunks_done == job.chunks_total and not job.finished:
            self._finish(job, ok=True)
        elif job.source is not None and job.source.read_into is not None:
            self._reads.pump(job)

    def _on_send_failed(self, job: ServeJob, error: BaseException) -> None:
        if not job.finished:
            self._finish(job, ok=False, reason=f"send failed: {describe(error)}", close_ep=True)

    def _on_send_timeout(self, job: ServeJob) -> None:
        if job.finished:
            return
        if job in self._awaiting_provider:
            # Nothing sent yet: the client's own deadline reports it; keep the
            # connection, release whatever the provider returns when it does.
            self._finish(job, ok=False, reason=f"provider did not answer within {self.send_timeout_s}s")
            return
        self._finish(
            job, ok=False, reason=f"client did not receive within {self.send_timeout_s}s",
            close_ep=True,
        )

    # -- aborts -------------------------------------------------------------------------

    def _maybe_abort(self, job: ServeJob) -> None:
        """After a failed read, once nothing of this pull is in flight: tell the client.

        The OK status is already out, so the client waits for chunks; waiting
        for the chunks already posted first means every message the client
        still expects after the abort is one that will never be sent.
        """
        if job.finished or job.reads_in_flight or job.chunks_started != job.chunks_done:
            return
        self._send_status(job, STATUS_ERROR, text=job.abort_text, index=ABORT_INDEX)
        self._finish(job, ok=False, reason=job.abort_text)

    # -- finishing ------------------------------------------------------------------------

    def _finish(
        self, job: ServeJob, *, ok: bool, reason: str = "", close_ep: bool = False,
        counted: bool = True,
    ) -> None:
        if job.finished:
            return
        job.finished = True
        if job.timer is not None:
            job.timer.cancel()
        if ok and counted:
            self.requests_served += 1
        elif not ok:
            if counted:
                self.errors += 1
            log.info("%s: pull of %s failed: %s", self._name, job.request.key.hex(), reason)
        if close_ep:
            self._drop_client(job.ep)
        self._release(job)
        # Only now: until its release is queued the job still counts as in flight.
        self._jobs.discard(job)

    def _release(self, job: ServeJob) -> None:
        if job.reads_in_flight:
            # A worker thread is still inside read_into: the last read to
            # finish releases (releasing may close the file it reads).
            self._deferred_release.add(job)
            return
        self._deferred_release.discard(job)
        source, job.source = job.source, None
        if source is None or source.release is None:
            return
        executor, engine = self._executor, self._engine
        if executor is None or engine is None or source.release_nonblocking:
            _safe_release(source.release)
            return
        self._releasing += 1
        release = source.release

        def run_release() -> None:
            _safe_release(release)
            engine.post(self._released_one)

        executor.submit(run_release)

    def _released_one(self) -> None:
        self._releasing -= 1

    def _drop_client(self, ep: Any) -> None:
        assert self._endpoints is not None  # made on start, before any job exists
        self._endpoints.drop(ep)  # closes it, then calls _on_dropped

    def _on_dropped(self, ep: Any) -> None:
        for other in list(self._jobs):
            if other.ep is ep:
                self._finish(other, ok=False, reason="connection dropped")


def _safe_release(release: Callable[[], None]) -> None:
    try:
        release()
    except Exception:
        log.exception("ServeSource.release failed")



