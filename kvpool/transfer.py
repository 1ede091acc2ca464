"""Pulling KV bytes between nodes over UCX (``ucxx``).

Owns the wire protocol and the UCX plumbing for one operation: a client names
``(key, layer range)`` and a :class:`PullServer` answers with exactly those
bytes, which land straight in the client's preallocated ``out`` buffer.
It does not own where bytes live or how keys are located: the node wires a
*provider* callback into the server (tiers -> :class:`ServeSource`), and the
pool asks the master which node to pull from.

Threads and progress
    Every :class:`PullServer` and :class:`PullClient` owns one UCX context and
    one worker, driven by one dedicated thread (``_ProgressThread``). Only that
    thread makes UCX calls; other threads submit closures to it and wait on
    :class:`concurrent.futures.Future` objects (``pull_into``) or their asyncio
    wrappers (``apull_into``). The thread progresses the worker in *blocking*
    mode: when nothing is left to do it arms the worker and sleeps in
    ``epoll_wait`` on the worker's event fd plus an eventfd used for wake-ups,
    never spinning. On a 2-core machine running more processes than cores, two
    busy-polling UCX processes take turns on one vCPU and a round trip costs
    milliseconds; blocking progress costs one wake-up per event instead.

Wire protocol (all tag messages; tags are 64-bit and matched worker-wide)
    request  client -> server, tag ``REQUEST_TAG``: fixed header ``_REQUEST``
             + key + (``auto`` transport only) the client's worker address.
    status   server -> client, tag ``request_id << 20``: ``_STATUS`` + text.
             OK carries the payload size and the chunk size the server uses,
             and, when the request asked for it (``header_out``), the served
             object's packed header in place of the text: the reader checks it
             against the header checksum the master indexed, then every layer
             against it, so the master never has to hold whole headers.
    data     server -> client, tag ``request_id << 20 | i`` for chunk
             ``i = 1..n``: chunk ``i`` is bytes ``[(i-1)*chunk, i*chunk)`` of
             the payload. The client posts its receives straight into slices
             of ``out`` once the status arrives; UCX holds a rendezvous message
             until its receive is posted, so large chunks are never staged.
    abort    server -> client, tag ``request_id << 20 | 0xFFFFF``: a status
             frame sent instead of the remaining chunks when reading the
             object fails after OK went out (nvme path), once every chunk
             already posted has been delivered; the client cancels its
             receives for the chunks that will never come.
    hello    client -> server over the UCX *stream* API, once per listener
             connection: 16 bytes naming the connection (``conn_id``, which
             every request repeats), because a worker-wide tag receive cannot
             tell which endpoint a request came from.

Transports
    ``"tcp"``: the client connects to the server's UCX listener
        (``host``, ``port``) with endpoint error handling on, so UCX detects a
        peer that dies (TCP reset, keepalive) and fails the pull at once.
    ``"auto"``: for a peer on the same host (same ``host_id``) the client
        connects to the server's *worker address* and the server replies to the
        client's worker address, both with error handling **off**, which lets
        UCX choose shared memory (posix/sysv/cma). UCX cannot detect a dead
        peer on such endpoints, so only the pull deadline (``timeout_s``)
        catches a holder that dies mid-pull; the server likewise drops a
        client that stops receiving after ``send_timeout_s``. Nor can closing
        such an endpoint stop a sender that is alive but stalled between
        UCX's rendezvous handshake and its copy into ``out`` (cross-memory
        writes come from the sender's side), so after a deadline on this path
        ``out`` is not guaranteed untouched. Peers on other hosts, or without
        a worker address, use the listener as with ``"tcp"``.

Failure rules
    A miss is answered with a MISS status (:class:`errors.RemoteMissError` at
    the client), a provider exception with an ERROR status carrying its text,
    a read that fails mid-pull with an abort frame; none of them hangs the
    client or costs the connection. Any transport error or deadline on an endpoint
    drops that endpoint from the client's cache and fails every pull still
    using it: UCX cancels their receives as the endpoint closes, so no late
    bytes land in an ``out`` buffer after its pull raised (on TCP; see the
    ``"auto"`` caveat above). A cancelled ``apull_into`` is not a failure of
    the endpoint: that pull finishes in the background instead. Callers still
    verify per-layer checksums.

UCX environment
    Importing ``ucxx`` sets ``UCX_MEMTYPE_CACHE=n``, ``UCX_RNDV_THRESH=8192``
    and ``UCX_RNDV_FRAG_MEM_TYPE=cuda`` unless already set. This module adds
    ``UCX_WARN_UNUSED_ENV_VARS=n`` (ucxx's own variable otherwise triggers a
    warning) and passes :data:`DEFAULT_UCX_OPTIONS` to its contexts unless the
    matching ``UCX_*`` variable is set, so the environment always wins. Every
    process of a pool must run with the same UCX options: with
    ``RNDV_SCHEME`` differing between client and server, listener connections
    were seen to fail ("no remote ep address for lane").
    Both ends pass ``NET_DEVICES`` = the interface holding their ``host``
    (:func:`ucx_interface_options`, e.g. ``lo`` for 127.0.0.1), so UCX's own
    TCP listener binds that address only. The ucxx 0.52 sockaddr listener
    cannot bind an address (it takes the wildcard): ``PullServer(listener=False)``
    has none, and clients reach it by worker address (``"tcp"``: with UCX
    peer-failure detection, the server replying with it too). Requests carry
    a pull token (at most 64 bytes) that ``authorize(key, token)`` checks
    before the provider runs; a refusal is STATUS_UNAUTHORIZED
    (:class:`errors.AuthenticationError`), never data. UCX trusts what peers send it (a malformed worker
    address aborts the process; both ends check addresses first, see
    :func:`plausible_worker_address`): keep UCX ports on a trusted network.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import heapq
import itertools
import logging
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvpool import errors
from kvpool.objformat import LayerRange

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx_api  # noqa: E402  (after the env var above)
from ucxx._lib.arr import Array  # noqa: E402

log = logging.getLogger("kvpool.transfer")

MiB = 1 << 20

#: UCX options passed to every context this module creates, unless the matching
#: ``UCX_<NAME>`` environment variable is set. put_zcopy lets the sender write
#: rendezvous data into the receiver's buffer; on TCP it was measured markedly
#: faster than the default get-based scheme (see bench/transfer_bench.py).
DEFAULT_UCX_OPTIONS: dict[str, str] = {"RNDV_SCHEME": "put_zcopy"}

TRANSPORTS = ("tcp", "auto")


class ProviderWouldBlock(Exception):
    """Raised by a provider called inline on the progress thread that would have to wait
    (e.g. for a lock): the server calls it again on a worker thread."""


_INLINE = threading.local()


def in_inline_provider() -> bool:
    """Whether the calling provider runs inline on a progress thread (must not block)."""
    return bool(getattr(_INLINE, "active", False))


# -- wire format ---------------------------------------------------------------

PROTOCOL_VERSION = 3  # v2: pull tokens, reply error handling; v3: OK may carry the object's header
# Top bit set: never equal to a reply tag (request ids stay below 2**43).
REQUEST_TAG = 0xC0DE_4B56_5055_4C4C
_INDEX_BITS = 20
_MAX_REQUEST_ID = (1 << (63 - _INDEX_BITS)) - 1
_ABORT_INDEX = (1 << _INDEX_BITS) - 1  # reply tag of a mid-stream abort
_MAX_CHUNKS = _ABORT_INDEX - 1
# A client asking for smaller chunks gets chunks of at least this (at most the server's
# max_message): a pull is never a million tiny messages. A client refuses a status frame
# whose chunk is below _MIN_CHUNK_FLOOR (the smallest max_message a server may have).
MIN_CHUNK = 64 << 10
_MIN_CHUNK_FLOOR = 4096

# magic, version, flags, key_len, addr_len, client_id, conn_id, request_id,
# layer start, layer stop, capacity (bytes), max chunk (bytes), xxh3-64 of the address,
# token_len; then key, token, reply address
_REQUEST = struct.Struct("<4sBBHHQQQIIQQQH")
_REQUEST_MAGIC = b"KVPR"
_FLAG_REPLY_TO_ADDRESS = 0x1
_FLAG_REPLY_ERROR_HANDLING = 0x2  # reply over an endpoint with UCX peer-failure detection (tcp)
_FLAG_WANT_HEADER = 0x4  # the OK status carries the served object's packed header
_MAX_KEY_BYTES = 1024
_MAX_ADDRESS_BYTES = 8192
_MAX_TOKEN_BYTES = 64
_REQUEST_BUFFER_NBYTES = _REQUEST.size + _MAX_KEY_BYTES + _MAX_TOKEN_BYTES + _MAX_ADDRESS_BYTES

# magic, version, status, message length, request id, payload bytes, chunk bytes
_STATUS = struct.Struct("<4sBBHQQQ")
_STATUS_MAGIC = b"KVPS"
_MAX_STATUS_TEXT = 1024
MAX_HEADER_NBYTES = 0xFFFF  # the most header bytes an OK status carries (its length is a u16)
_STATUS_BUFFER_NBYTES = _STATUS.size + _MAX_STATUS_TEXT

_HELLO = struct.Struct("<4sBxxxQ")
_HELLO_MAGIC = b"KVPH"

STATUS_OK = 0
STATUS_MISS = 1
STATUS_ERROR = 2
STATUS_BAD_RANGE = 3
STATUS_OUT_TOO_SMALL = 4
STATUS_BAD_REQUEST = 5
STATUS_UNAUTHORIZED = 6  # the request's token was refused: nothing else is sent

_RECEIVES_POSTED = 4  # request receives kept posted on a server's worker
_POLL_FALLBACK_S = 0.5  # wake at least this often even if UCX raised no event


def plausible_worker_address(address: bytes) -> bool:
    """Cheap sanity check of a packed UCX worker address.

    UCX trusts the addresses it is given and aborts the process on some
    malformed ones, so addresses from the network or the master are checked
    first: a sane length and a header version UCX knows (v1 = 0, v2 = 1 in the
    low 4 bits of the first byte). Not a defence against a hostile peer: a UCX
    port belongs on a trusted network.
    """
    return 16 <= len(address) <= _MAX_ADDRESS_BYTES and (address[0] & 0x0F) in (0, 1)


def interface_for_host(host: str) -> str | None:
    """The network interface that holds address ``host`` (``127.0.0.1`` -> ``lo``), or None
    for a wildcard address, or one no local interface holds."""
    import fcntl
    import ipaddress

    if host in ("", "*", "0.0.0.0", "::"):
        return None
    try:
        wanted = {ipaddress.ip_address(str(info[4][0]).split("%")[0])
                  for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, ValueError):
        return None
    found: dict[Any, str] = {}
    try:
        with open("/proc/net/if_inet6") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 6:
                    found[ipaddress.IPv6Address(int(fields[0], 16))] = fields[5]
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            found[ipaddress.IPv4Address(raw[20:24])] = name
    for address in wanted:
        if address in found:
            return found[address]
        if address.is_loopback:  # 127.0.0.2 and friends live on the loopback interface too
            loopback = next((n for a, n in found.items() if a.is_loopback and a.version == address.version), None)
            if loopback is not None:
                return loopback
    return None


def ucx_interface_options(host: str | None) -> dict[str, str]:
    """UCX options that keep a context's network transports on the interface of ``host``:
    ``NET_DEVICES`` names it, so UCX's own TCP listener binds that interface's address only
    (UCX otherwise listens on every interface). Empty for None or a wildcard ``host``."""
    if host is None:
        return {}
    name = interface_for_host(host)
    if name is None:
        if host not in ("", "*", "0.0.0.0", "::"):
            log.warning("no local interface holds %r: UCX transports are not restricted to one", host)
        return {}
    return {"NET_DEVICES": name}


def local_host_id() -> str:
    """Identifies this machine (hostname + kernel boot id) for the same-host fast path."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot_id = fh.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


# -- public value types -----------------------------------------------------------


@dataclass(frozen=True)
class PeerAddress:
    """Where a node serves pulls: listener ``host``/``port``, plus its worker address.

    ``worker_address`` and ``host_id`` enable the same-host shared-memory path
    of ``transport="auto"``; both may be empty. ``to_wire``/``from_wire`` give a
    msgpack-friendly form for publishing through the master.
    """

    host: str
    port: int
    worker_address: bytes = b""
    host_id: str = ""

    def to_wire(self) -> list[Any]:
        return [self.host, self.port, self.worker_address, self.host_id]

    @classmethod
    def from_wire(cls, fields: Sequence[Any]) -> PeerAddress:
        host, port, worker_address, host_id = fields
        return cls(str(host), int(port), bytes(worker_address), str(host_id))


@dataclass
class ServeSource:
    """What a provider hands the server for one pull.

    Exactly one of:

    * ``buffers``: memoryviews whose concatenation is the payload, sent in
      place (memory tiers). They must stay valid until ``release`` is called.
    * ``read_into(offset, out)``: fills ``out`` with payload bytes
      ``[offset, offset + len(out))`` (nvme); the server calls it from a
      worker thread with a reusable page-aligned staging buffer. It may
      return the number of bytes read; a short read fails the pull.

    ``release`` (optional) runs exactly once, after the last byte was sent or
    the pull failed: the node unpins the object there. It runs on a worker
    thread, or on the progress thread itself when ``release_nonblocking`` says
    it never waits (no lock it could block on, no I/O): one hand-off less.

    ``header``: the served object's packed header, sent with the OK status
    to clients that ask for it (at most :data:`MAX_HEADER_NBYTES`).
    """

    nbytes: int
    buffers: Sequence[memoryview] = ()
    read_into: Callable[[int, memoryview], int | None] | None = None
    release: Callable[[], None] | None = None
    header: bytes = b""
    release_nonblocking: bool = False

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {self.nbytes}")
        if self.read_into is None:
            views = []
            for buf in self.buffers:
                view = memoryview(buf)
                if not view.c_contiguous:
                    raise ValueError("ServeSource buffers must be C-contiguous")
                views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
            total = sum(v.nbytes for v in views)
            if total != self.nbytes:
                raise ValueError(f"buffers hold {total} bytes, nbytes says {self.nbytes}")
            self.buffers = views
        elif self.buffers:
            raise ValueError("give either buffers or read_into, not both")


Provider = Callable[[bytes, LayerRange], "ServeSource | None"]


# -- the progress thread -------------------------------------------------------------


class _Timer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _ProgressThread:
    """One UCX context and worker, created, used and destroyed by one thread.

    Other threads only call :meth:`submit` / :meth:`call`. Everything else
    (``watch``, ``call_later``, the ``worker`` attribute) is for code already
    running on the thread.
    """

    def __init__(self, name: str, ucx_options: Mapping[str, str] | None) -> None:
        self.name = name
        self.worker: Any = None
        self.context: Any = None
        # Whoever holds this lock drives the worker: the thread below, or a caller waiting for
        # its own pull (:meth:`drive`), so a pull's reply is handled on the thread that waits for
        # it instead of being handed over. ``_driver`` is the holder's thread id.
        self._lock = threading.Lock()
        self._driver: int | None = None
        self._drive_epoll: select.epoll | None = None
        self._options = _effective_ucx_options(ucx_options)
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._watched: list[tuple[Any, Callable[[BaseException | None], None], Any]] = []
        self._timers: list[tuple[float, int, _Timer]] = []
        self._timer_seq = itertools.count()
        self._stop_requested = False
        self._closed = False
        self._finalizer: Callable[[], None] | None = None
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            os.close(self._wake_fd)
            raise errors.TransferError(f"{name}: cannot start UCX: {self._start_error}") from (
                self._start_error
            )

    # -- any thread --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def on_thread(self) -> bool:
        """Whether the calling thread drives the worker now (the progress thread, or a caller
        inside :meth:`drive`): UCX calls and engine state are for it alone."""
        return self._driver == threading.get_ident()

    def submit(self, fn: Callable[[], None]) -> None:
        if self._closed or self._stop_requested:
            raise errors.PoolClosedError(f"{self.name} is closed")
        self._commands.append(fn)
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:  # closed between the check and the write: the loop is gone
            raise errors.PoolClosedError(f"{self.name} is closed") from None

    def post(self, fn: Callable[[], None]) -> None:
        """:meth:`submit`, silently dropped once the thread is stopping (for UCX callbacks)."""
        try:
            self.submit(fn)
        except errors.PoolClosedError:
            pass

    def call(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """Run ``fn`` on the thread and return its result (or raise its exception)."""
        if self.on_thread():
            return fn()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the waiting thread
                fut.set_exception(exc)

        self.submit(run)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise errors.KVTimeoutError(f"{self.name} did not answer within {timeout_s}s") from None

    def stop(self, finalizer: Callable[[], None], timeout_s: float = 30.0) -> None:
        """Run ``finalizer`` on the thread, tear UCX down, and join the thread."""
        if self._closed:
            return
        if self.on_thread():
            raise RuntimeError("cannot stop the progress thread from itself")
        self._finalizer = finalizer
        self._stop_requested = True
        os.eventfd_write(self._wake_fd, 1)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("%s: progress thread did not stop within %ss", self.name, timeout_s)
            return
        self._closed = True
        os.close(self._wake_fd)

    def drive(self, start: Callable[[], None], done: Callable[[], bool], deadline: float,
              tick: Callable[[], None] | None = None, tick_s: float = _POLL_FALLBACK_S) -> bool:
        """Run ``start`` and progress the worker on the calling thread until ``done()``.

        Returns False, having run nothing, when another thread drives the worker now (the caller
        then submits and waits as usual). While driving, the caller does everything the
        progress thread would (other threads' commands, every completion, timers) and sleeps in
        ``epoll_wait`` like it, never spinning; ``tick`` runs at least every ``tick_s``. Stops at
        ``deadline`` (monotonic) even if not done: the caller's own timers decide what that means.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._stop_requested or self.worker is None or self._drive_epoll is None:
                raise errors.PoolClosedError(f"{self.name} is closed")
            self._driver = threading.get_ident()
            worker, epoll = self.worker, self._drive_epoll
            start()
            next_tick = time.monotonic() + tick_s
            while True:
                busy = self._run_commands()
                worker.progress()
                busy = self._reap() or busy
                busy = self._run_due_timers() or busy
                if done():
                    return True
                now = time.monotonic()
                if tick is not None and now >= next_tick:
                    tick()
                    next_tick = now + tick_s
                    continue
                if now >= deadline:
                    return True
                if busy or self._commands or not worker.arm():
                    continue
                wait = min(self._poll_timeout(), deadline - now, max(0.0, next_tick - now))
                if epoll.poll(max(wait, 0.0)):
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
        finally:
            self._driver = None
            # Leave the worker armed for the progress thread, or wake it for what is pending.
            kick = bool(self._commands)
            try:
                kick = kick or (self.worker is not None and not self.worker.arm())
            except Exception:
                kick = True
            self._lock.release()
            if kick and not self._closed:
                try:
                    os.eventfd_write(self._wake_fd, 1)
                except OSError:
                    pass

    # -- thread only -------------------------------------------------------------

    def watch(self, request: Any, on_done: Callable[[BaseException | None], None], buffer: Any) -> None:
        """Call ``on_done(error_or_None)`` once ``request`` completes.

        Holds the request and its ``buffer`` (the ``Array``) until then: ucxx
        cancels a request whose Python object is collected, and a request does
        not keep its buffer alive.
        """
        self._watched.append((request, on_done, buffer))

    def unwatch(self, request: Any) -> None:
        """Forget ``request`` (its callback never runs); see PullClient._cancel_receives."""
        self._watched = [item for item in self._watched if item[0] is not request]

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(callback)
        heapq.heappush(self._timers, (time.monotonic() + delay_s, next(self._timer_seq), timer))
        return timer

    # -- the loop ------------------------------------------------------------------

    def _main(self) -> None:
        epoll = None
        try:
            self.context = ucx_api.UCXContext(
                dict(self._options),
                feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.STREAM, ucx_api.Feature.WAKEUP),
            )
            self.worker = ucx_api.UCXWorker(self.context)
            self.worker.init_blocking_progress_mode()
            epoll = select.epoll()
            epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
            epoll.register(self._wake_fd, select.EPOLLIN)
            self._drive_epoll = select.epoll()
            self._drive_epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
            self._drive_epoll.register(self._wake_fd, select.EPOLLIN)
        except Exception as exc:  # reported to the constructor
            self._start_error = exc
            self.worker = self.context = None
            if epoll is not None:
                epoll.close()
            if self._drive_epoll is not None:
                self._drive_epoll.close()
                self._drive_epoll = None
            self._started.set()
            return
        self._started.set()
        try:
            self._loop(epoll)
        finally:
            self._teardown(epoll)

    def _loop(self, epoll: select.epoll) -> None:
        worker = self.worker
        me = threading.get_ident()
        while not self._stop_requested:
            with self._lock:  # waits while a caller drives (it does this thread's work meanwhile)
                self._driver = me
                try:
                    busy = self._run_commands()
                    worker.progress()
                    busy = self._reap() or busy
                    busy = self._run_due_timers() or busy
                    # arm() fails while UCX still has events to process: progress again.
                    if busy or self._commands or not worker.arm():
                        continue
                    timeout = self._poll_timeout()
                finally:
                    self._driver = None
            epoll.poll(timeout)
            try:
                os.eventfd_read(self._wake_fd)
            except BlockingIOError:
                pass

    def _teardown(self, epoll: select.epoll) -> None:
        self._lock.acquire()  # no caller drives from here on (drive() sees the stop request)
        self._driver = threading.get_ident()
        try:
            self._run_commands()
            if self._finalizer is not None:
                try:
                    self._finalizer()
                except Exception:
                    log.exception("%s: error while closing", self.name)
            # Deliver the cancellations the finalizer caused.
            for _ in range(3):
                self.worker.progress()
                self._reap()
        finally:
            epoll.close()
            if self._drive_epoll is not None:
                self._drive_epoll.close()
                self._drive_epoll = None
            self._watched.clear()
            self._timers.clear()
            self._commands.clear()
            self.worker = None
            self.context = None
            self._driver = None
            self._lock.release()

    def _run_commands(self) -> bool:
        ran = False
        while self._commands:
            fn = self._commands.popleft()
            ran = True
            try:
                fn()
            except Exception:
                log.exception("%s: command failed", self.name)
        return ran

    def _reap(self) -> bool:
        if not self._watched:
            return False
        done = [item for item in self._watched if item[0].completed]
        if not done:
            return False
        finished = {id(item[0]) for item in done}
        self._watched = [item for item in self._watched if id(item[0]) not in finished]
        for request, on_done, _buffer in done:
            try:
                request.check_error()
                error: BaseException | None = None
            except Exception as exc:
                error = exc
            try:
                on_done(error)
            except Exception:
                log.exception("%s: completion callback failed", self.name)
        return True

    def _run_due_timers(self) -> bool:
        now = time.monotonic()
        ran = False
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            ran = True
            try:
                timer.callback()
            except Exception:
                log.exception("%s: timer callback failed", self.name)
        return ran

    def _poll_timeout(self) -> float:
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        if not self._timers:
            return _POLL_FALLBACK_S
        return max(0.0, min(_POLL_FALLBACK_S, self._timers[0][0] - time.monotonic()))


def _effective_ucx_options(extra: Mapping[str, str] | None) -> dict[str, str]:
    options = {**DEFAULT_UCX_OPTIONS, **(extra or {})}
    # The environment wins, so UCX_* variables keep their usual meaning.
    return {k: str(v) for k, v in options.items() if f"UCX_{k}" not in os.environ}


def _close_endpoint(ep: Any) -> None:
    # close_blocking cancels the endpoint's in-flight requests, then closes it
    # (forcibly when error handling is on). The non-blocking close() returns a
    # request that may be null, which ucxx cannot safely free.
    try:
        ep.close_blocking()
    except Exception as exc:
        log.debug("closing endpoint: %s", exc)


def _reply_tag(request_id: int, index: int) -> Any:
    return ucx_api.UCXXTag((request_id << _INDEX_BITS) | index)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# -- server ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    client_id: int
    conn_id: int
    request_id: int
    key: bytes
    layer_range: LayerRange
    capacity: int
    max_chunk: int
    reply_address: bytes
    token: bytes = b""
    reply_error_handling: bool = False
    want_header: bool = False


class _StagingPool:
    """Page-aligned buffers reused for nvme reads (O_DIRECT needs the alignment)."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._limit = count
        self._free: list[mmap.mmap] = []
        self._made = 0
        self.waiting: collections.deque[_ServeJob] = collections.deque()

    def take(self) -> mmap.mmap | None:
        if self._free:
            return self._free.pop()
        if self._made < self._limit:
            self._made += 1
            return mmap.mmap(-1, self.nbytes)
        return None

    def give(self, buf: mmap.mmap) -> None:
        self._free.append(buf)

    @property
    def free_count(self) -> int:
        return len(self._free) + self._limit - self._made

    def close(self) -> None:
        for buf in self._free:
            try:
                buf.close()
            except BufferError:  # still exported to an in-flight send; freed with it
                pass
        self._free.clear()


@dataclass(eq=False)
class _ServeJob:
    request: _Request
    ep: Any
    source: ServeSource | None = None
    chunk: int = 0
    chunks_total: int = 0
    chunks_started: int = 0
    chunks_done: int = 0
    reads_in_flight: int = 0
    finished: bool = False
    abort_text: str = ""  # a read failed: stop, then tell the client this
    timer: _Timer | None = None
    staging: list[mmap.mmap] = field(default_factory=list)


class PullServer:
    """Serves ``(key, layer range)`` pulls from this process over UCX.

    ``provider(key, layer_range)`` is called on a worker thread for each pull
    and returns a :class:`ServeSource`, or ``None`` for a miss. It may raise:
    the client then gets a typed error (``LayerRangeError`` for a bad range,
    ``TransferError`` with the exception's text otherwise) instead of a hang.
    Providers should not block indefinitely: a stalled provider ties up one of
    ``provider_threads`` and its client times out. ``inline_provider=True``
    calls it on the progress thread instead, saving a thread hop per pull
    (~50 us of a ~260 us small pull, measured on 2 vCPUs); only for providers
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
        self._staging_count = max(2, staging_buffers)
        self._ucx_options = {**ucx_interface_options(host), **(ucx_options or {})}
        self._name = name
        self._engine: _ProgressThread | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._listener: Any = None
        self._closing = False  # progress thread: close began, requests are no longer served
        self._port = 0
        self._worker_address = b""
        self._host_id = local_host_id()
        # Progress-thread state.
        self._recv_slots: list[tuple[Any, bytearray]] = []
        self._pending_hello: set[Any] = set()
        self._conns: dict[int, Any] = {}  # conn_id -> endpoint replies go out on
        self._reply_conn: dict[int, int] = {}  # client_id -> conn_id of its worker-address reply endpoint
        self._parked: dict[int, list[_Request]] = {}
        self._jobs: set[_ServeJob] = set()
        self._staging: _StagingPool | None = None
        self._releasing = 0  # sources whose release() is queued or running
        self._awaiting_provider: set[_ServeJob] = set()  # provider call not returned yet
        self._deferred_release: set[_ServeJob] = set()  # finished, a read still running
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
        engine = _ProgressThread(self._name, self._ucx_options)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self._provider_threads, thread_name_prefix=f"{self._name}-io"
        )
        self._engine = engine
        try:
            engine.call(self._start_on_thread)
        except Exception as exc:
            self.close()
            raise errors.TransferError(
                f"{self._name}: cannot listen on port {self._requested_port}: {_describe(exc)}") from exc
        log.info("%s: serving pulls on %s:%d", self._name, self._host, self._port)
        return self

    def _start_on_thread(self) -> None:
        engine = self._engine
        assert engine is not None
        if self._use_listener:
            # ucxx 0.52 binds its sockaddr listener to every interface (no address parameter).
            self._listener = ucx_api.UCXListener.create(
                engine.worker, self._requested_port, self._on_connection
            )
            self._port = self._listener.port
        self._worker_address = engine.worker.address.tobytes()
        for _ in range(_RECEIVES_POSTED):
            self._post_request_receive()

    def close(self) -> None:
        """Stop serving: close endpoints and listener, release sources, join threads."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop(self._close_on_thread)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        # Reads that were still running when the thread stopped: release now
        # (single-threaded from here on).
        for job in list(self._deferred_release):
            job.reads_in_flight = 0
            self._release(job)
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def _close_on_thread(self) -> None:
        self._closing = True
        self._listener = None  # ucp_listener_destroy: no new connections
        eps = list(self._pending_hello) + list(self._conns.values())
        self._pending_hello.clear()
        self._conns.clear()
        self._reply_conn.clear()
        self._parked.clear()
        for ep in eps:  # cancels every send before any source is released
            _close_endpoint(ep)
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
                return engine.call(self.stats, timeout_s=5.0)
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

    @property
    def _live_engine(self) -> _ProgressThread:
        """The progress engine, for code that runs on it (so it exists)."""
        engine = self._engine
        assert engine is not None, "PullServer used before start() or after close()"
        return engine

    # -- connections (progress thread) ---------------------------------------------------

    def _on_connection(self, conn_request: int) -> None:
        ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
        # Called from inside UCX when the client goes away; sweep afterwards,
        # never close an endpoint from within its own error callback.
        ep.set_close_callback(self._live_engine.post, cb_args=(self._sweep_dead_connections,))
        hello = bytearray(_HELLO.size)
        self._pending_hello.add(ep)
        array = Array(hello)
        self._live_engine.watch(ep.stream_recv(array), lambda err: self._on_hello(ep, hello, err), array)

    def _on_hello(self, ep: Any, hello: bytearray, error: BaseException | None) -> None:
        self._pending_hello.discard(ep)
        if error is not None:
            log.debug("%s: connection closed before its hello: %s", self._name, error)
            _close_endpoint(ep)
            return
        magic, version, conn_id = _HELLO.unpack(hello)
        if magic != _HELLO_MAGIC or version != PROTOCOL_VERSION or conn_id in self._conns:
            self.errors += 1
            log.warning("%s: bad hello %r, dropping connection", self._name, bytes(hello))
            _close_endpoint(ep)
            return
        self._conns[conn_id] = ep
        for request in self._parked.pop(conn_id, []):
            self._dispatch(request, ep)

    def _sweep_dead_connections(self) -> None:
        for ep in [ep for ep in self._conns.values() if not ep.alive]:
            self._drop_client(ep)
        for ep in [ep for ep in self._pending_hello if not ep.alive]:
            self._pending_hello.discard(ep)
            _close_endpoint(ep)

    # -- requests (progress thread) ----------------------------------------------------------

    def _post_request_receive(self) -> None:
        buf = bytearray(_REQUEST_BUFFER_NBYTES)
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
            log.warning("%s: request receive failed: %s", self._name, _describe(error))
            return
        try:
            request = _parse_request(slot[1])
        except errors.ProtocolError as exc:
            self.errors += 1
            log.warning("%s: dropping malformed request: %s", self._name, exc)
            return
        ep = self._conns.get(request.conn_id)
        if ep is None and request.reply_address:
            ep = self._connect_reply_endpoint(request)
            if ep is None:
                return
        if ep is None:
            # The request overtook the connection's hello; serve it once that
            # arrives, or forget it (the client's deadline reports the failure).
            self._parked.setdefault(request.conn_id, []).append(request)
            self._engine.call_later(self.send_timeout_s, lambda: self._unpark(request))
            return
        self._dispatch(request, ep)

    def _connect_reply_endpoint(self, request: _Request) -> Any:
        """Endpoint to a same-host client's worker address, one per client.

        A client that dropped its endpoint to us (deadline, error) reconnects
        under a new ``conn_id``. UCX pairs the two endpoints a pair of workers
        create toward each other, so our old reply endpoint points at the
        closed one and must be replaced, not reused.
        """
        stale = self._conns.get(self._reply_conn.get(request.client_id, -1))
        if stale is not None:
            self._drop_client(stale)
        try:
            address = ucx_api.UCXAddress.create_from_buffer(request.reply_address)
            ep = self._live_engine.worker.create_endpoint_from_worker_address(address, request.reply_error_handling)
            if request.reply_error_handling:
                ep.set_close_callback(self._live_engine.post, cb_args=(self._sweep_dead_connections,))
        except Exception as exc:
            self.errors += 1
            log.warning("%s: cannot reach client by worker address: %s", self._name, exc)
            return None
        self._conns[request.conn_id] = ep
        self._reply_conn[request.client_id] = request.conn_id
        return ep

    def _unpark(self, request: _Request) -> None:
        parked = self._parked.get(request.conn_id)
        if parked and request in parked:
            parked.remove(request)
            self.errors += 1
            if not parked:
                del self._parked[request.conn_id]

    def _dispatch(self, request: _Request, ep: Any) -> None:
        job = _ServeJob(request, ep)
        self._jobs.add(job)
        job.timer = self._live_engine.call_later(self.send_timeout_s, lambda: self._on_send_timeout(job))
        self._awaiting_provider.add(job)
        assert self._executor is not None
        if self.inline_provider:
            self._call_provider(job, inline=True)
        else:
            self._executor.submit(self._call_provider, job)

    def _call_provider(self, job: _ServeJob, inline: bool = False) -> None:
        # Runs on a worker thread (providers may take locks or touch disk), or inline on the
        # progress thread, where a provider that would have to wait says so and is retried
        # on a worker.
        try:
            _INLINE.active = inline
            try:
                if self._authorize is not None:
                    self._authorize(job.request.key, job.request.token)
                outcome: ServeSource | BaseException | None = self._provider(
                    job.request.key, job.request.layer_range
                )
            finally:
                _INLINE.active = False
        except ProviderWouldBlock:
            assert self._executor is not None
            self._executor.submit(self._call_provider, job)
            return
        except BaseException as exc:
            outcome = exc
        if inline:  # already on the progress thread: reply now, no hand-off
            self._on_source(job, outcome)
            return
        try:
            engine = self._engine
            if engine is None:
                raise errors.PoolClosedError("closing")
            engine.submit(lambda: self._on_source(job, outcome))
        except errors.PoolClosedError:
            if isinstance(outcome, ServeSource) and outcome.release is not None:
                outcome.release()

    def _on_source(self, job: _ServeJob, outcome: ServeSource | BaseException | None) -> None:
        request = job.request
        self._awaiting_provider.discard(job)
        if isinstance(outcome, ServeSource):
            job.source = outcome
        if job.finished:  # timed out or closed while the provider ran
            self._release(job)
            return
        if outcome is None:
            self.misses += 1
            self._send_status(job, STATUS_MISS, text=f"key {request.key.hex()} not held here")
            self._finish(job, ok=True, counted=False)
            return
        if isinstance(outcome, errors.AuthenticationError):
            self.refused += 1
            self._send_status(job, STATUS_UNAUTHORIZED, text=str(outcome))
            self._finish(job, ok=False, reason="token refused", counted=False)
            return
        if isinstance(outcome, BaseException):
            status = STATUS_BAD_RANGE if isinstance(outcome, errors.LayerRangeError) else STATUS_ERROR
            self._send_status(job, status, text=_describe(outcome))
            self._finish(job, ok=False, reason=f"provider failed: {_describe(outcome)}")
            return
        if not isinstance(outcome, ServeSource):
            self._send_status(job, STATUS_ERROR, text=f"provider returned {type(outcome).__name__}")
            self._finish(job, ok=False, reason="provider returned a non-ServeSource")
            return
        source = outcome
        if source.nbytes > request.capacity:
            self._send_status(
                job, STATUS_OUT_TOO_SMALL,
                text=f"payload is {source.nbytes} bytes, out buffer holds {request.capacity}",
            )
            self._finish(job, ok=False, reason="client buffer too small", counted=False)
            return
        job.chunk = max(min(MIN_CHUNK, self.max_message), min(request.max_chunk, self.max_message))
        job.chunks_total = -(-source.nbytes // job.chunk)
        if job.chunks_total > _MAX_CHUNKS:
            self._send_status(job, STATUS_ERROR, text="payload needs too many messages")
            self._finish(job, ok=False, reason="too many chunks")
            return
        header = b""
        if request.want_header:
            header = source.header
            if not 0 < len(header) <= MAX_HEADER_NBYTES:
                self._send_status(job, STATUS_ERROR, text=f"no header to send ({len(header)} bytes)")
                self._finish(job, ok=False, reason="provider gave no header")
                return
        if not self._send_status(job, STATUS_OK, nbytes=source.nbytes, chunk=job.chunk, body=header):
            return
        if job.chunks_total == 0:
            self._finish(job, ok=True)
        elif source.read_into is None:
            self._send_buffers(job)
        else:
            self._pump_reads(job)

    def _send_status(
        self, job: _ServeJob, status: int, *, text: str = "", nbytes: int = 0, chunk: int = 0,
        index: int = 0, body: bytes = b"",
    ) -> bool:
        array = Array(_pack_status(job.request.request_id, status, nbytes, chunk, text, body))
        try:
            req = job.ep.tag_send(array, _reply_tag(job.request.request_id, index))
        except Exception as exc:
            self._on_send_failed(job, exc)
            return False
        def sent(err: BaseException | None) -> None:
            if err is not None:
                self._on_send_failed(job, err)

        self._live_engine.watch(req, sent, array)
        return True

    def _send_buffers(self, job: _ServeJob) -> None:
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
        self, job: _ServeJob, index: int, payload: memoryview, staging: mmap.mmap | None = None
    ) -> bool:
        job.chunks_started += 1
        nbytes = payload.nbytes
        array = Array(payload)
        try:
            req = job.ep.tag_send(array, _reply_tag(job.request.request_id, index))
        except Exception as exc:
            if staging is not None:
                self._give_staging(job, staging)
            self._on_send_failed(job, exc)
            return False
        self._live_engine.watch(req, lambda err: self._on_chunk_sent(job, nbytes, staging, err), array)
        return True

    def _on_chunk_sent(
        self, job: _ServeJob, nbytes: int, staging: mmap.mmap | None, error: BaseException | None
    ) -> None:
        if staging is not None:
            self._give_staging(job, staging)
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
            self._pump_reads(job)

    def _on_send_failed(self, job: _ServeJob, error: BaseException) -> None:
        if not job.finished:
            self._finish(job, ok=False, reason=f"send failed: {_describe(error)}", close_ep=True)

    def _on_send_timeout(self, job: _ServeJob) -> None:
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

    # -- nvme read path (progress thread + worker threads) ---------------------------------------

    def _pump_reads(self, job: _ServeJob) -> None:
        if self._staging is None:
            self._staging = _StagingPool(self._staging_count, self.max_message)
        pool = self._staging
        # Two buffers per pull: read chunk i+1 while chunk i is on the wire.
        while (not job.finished and not job.abort_text
               and job.chunks_started + job.reads_in_flight < job.chunks_total
               and job.reads_in_flight + (job.chunks_started - job.chunks_done) < 2):
            buf = pool.take()
            if buf is None:
                if job not in pool.waiting:
                    pool.waiting.append(job)
                return
            job.staging.append(buf)
            index = job.chunks_started + job.reads_in_flight + 1
            job.reads_in_flight += 1
            assert self._executor is not None and job.source is not None
            self._executor.submit(self._read_chunk, job, job.source, index, buf)

    def _read_chunk(self, job: _ServeJob, source: ServeSource, index: int, buf: mmap.mmap) -> None:
        # Runs on a worker thread; job state is only read here, never written.
        assert source.read_into is not None
        offset = (index - 1) * job.chunk
        nbytes = min(job.chunk, source.nbytes - offset)
        view = memoryview(buf)[:nbytes]
        error: BaseException | None = None
        try:
            got = source.read_into(offset, view)
            if got is not None and got != nbytes:
                raise errors.TransferError(f"short read: {got} of {nbytes} bytes at {offset}")
        except BaseException as exc:
            error = exc
        finally:
            view.release()
        try:
            engine = self._engine
            if engine is None:
                raise errors.PoolClosedError("closing")
            engine.submit(lambda: self._on_chunk_read(job, index, buf, nbytes, error))
        except errors.PoolClosedError:
            pass

    def _on_chunk_read(
        self, job: _ServeJob, index: int, buf: mmap.mmap, nbytes: int, error: BaseException | None
    ) -> None:
        job.reads_in_flight -= 1
        if job.finished:
            self._give_staging(job, buf)
            if job.reads_in_flight == 0:
                self._release(job)  # deferred until no read used the source
            return
        if error is not None or job.abort_text:
            self._give_staging(job, buf)
            if not job.abort_text:
                assert error is not None  # one of the two holds
                job.abort_text = f"reading the object failed: {_describe(error)}"
            self._maybe_abort(job)
            return
        # Reads may finish out of order; tags carry the chunk index, so order is free.
        self._send_chunk(job, index, memoryview(buf)[:nbytes], staging=buf)

    def _maybe_abort(self, job: _ServeJob) -> None:
        """After a failed read, once nothing of this pull is in flight: tell the client.

        The OK status is already out, so the client waits for chunks; waiting
        for the chunks already posted first means every message the client
        still expects after the abort is one that will never be sent.
        """
        if job.finished or job.reads_in_flight or job.chunks_started != job.chunks_done:
            return
        self._send_status(job, STATUS_ERROR, text=job.abort_text, index=_ABORT_INDEX)
        self._finish(job, ok=False, reason=job.abort_text)

    def _give_staging(self, job: _ServeJob, buf: mmap.mmap) -> None:
        if buf in job.staging:
            job.staging.remove(buf)
        pool = self._staging
        if pool is None:
            return
        pool.give(buf)
        # Hand free buffers to waiting pulls until one is taken or none waits.
        free_before = pool.free_count
        while pool.waiting and pool.free_count >= free_before:
            waiter = pool.waiting.popleft()
            if not waiter.finished:
                self._pump_reads(waiter)

    # -- finishing ------------------------------------------------------------------------

    def _finish(
        self, job: _ServeJob, *, ok: bool, reason: str = "", close_ep: bool = False,
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

    def _release(self, job: _ServeJob) -> None:
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
        for conn_id, known in list(self._conns.items()):
            if known is ep:
                del self._conns[conn_id]
                for client_id, reply_conn in list(self._reply_conn.items()):
                    if reply_conn == conn_id:
                        del self._reply_conn[client_id]
        # Close first: closing cancels the sends still reading the sources'
        # memory, and only then may their release() let the node unpin it.
        _close_endpoint(ep)
        for other in list(self._jobs):
            if other.ep is ep:
                self._finish(other, ok=False, reason="connection dropped")


def _safe_release(release: Callable[[], None]) -> None:
    try:
        release()
    except Exception:
        log.exception("ServeSource.release failed")


def _parse_request(buf: bytearray) -> _Request:
    try:
        (magic, version, flags, key_len, addr_len, client_id, conn_id, request_id, start, stop,
         capacity, max_chunk, address_sum, token_len) = _REQUEST.unpack_from(buf, 0)
    except struct.error as exc:
        raise errors.ProtocolError(f"request too short: {exc}") from None
    if magic != _REQUEST_MAGIC:
        raise errors.ProtocolError(f"bad request magic {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise errors.ProtocolError(
            f"request protocol version {version}, this build speaks {PROTOCOL_VERSION}")
    if not 0 < key_len <= _MAX_KEY_BYTES or addr_len > _MAX_ADDRESS_BYTES or token_len > _MAX_TOKEN_BYTES:
        raise errors.ProtocolError("request key empty, or key, token or address too long")
    if not start < stop or request_id > _MAX_REQUEST_ID or max_chunk <= 0:
        raise errors.ProtocolError("request fields out of range")
    key_end = _REQUEST.size + key_len
    token_end = key_end + token_len
    address = bytes(buf[token_end:token_end + addr_len]) if flags & _FLAG_REPLY_TO_ADDRESS else b""
    # UCX aborts the process on a malformed worker address: check before use.
    if address and (xxhash.xxh3_64_intdigest(address) != address_sum
                    or not plausible_worker_address(address)):
        raise errors.ProtocolError("request carries a corrupt reply address")
    return _Request(client_id, conn_id, request_id, bytes(buf[_REQUEST.size:key_end]),
                    LayerRange(start, stop), capacity, max_chunk, address, bytes(buf[key_end:token_end]),
                    bool(flags & _FLAG_REPLY_ERROR_HANDLING), bool(flags & _FLAG_WANT_HEADER))


def _parse_status(buf: bytearray, request_id: int) -> tuple[int, int, int, bytes] | None:
    """(status, payload bytes, chunk bytes, body) of a status frame, or None if malformed. The
    body is the text of a failure, or the header an OK carries."""
    try:
        magic, version, status, text_len, frame_request_id, nbytes, chunk = _STATUS.unpack_from(buf)
    except struct.error:
        return None
    if magic != _STATUS_MAGIC or version != PROTOCOL_VERSION or frame_request_id != request_id \
            or _STATUS.size + text_len > len(buf) or status != STATUS_OK and text_len > _MAX_STATUS_TEXT:
        return None
    return status, nbytes, chunk, bytes(buf[_STATUS.size:_STATUS.size + text_len])


def _pack_status(request_id: int, status: int, nbytes: int, chunk: int, text: str,
                 body: bytes = b"") -> bytearray:
    encoded = body or text.encode("utf-8", "replace")[:_MAX_STATUS_TEXT]
    frame = bytearray(_STATUS.size + len(encoded))
    _STATUS.pack_into(frame, 0, _STATUS_MAGIC, PROTOCOL_VERSION, status, len(encoded),
                      request_id, nbytes, chunk)
    frame[_STATUS.size:] = encoded
    return frame


# -- client ------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Peer:
    """A cached endpoint to one server and the pulls using it."""

    key: tuple[Any, ...]
    ep: Any
    error_handling: bool
    label: str
    conn_id: int = field(default_factory=lambda: secrets.randbits(64))
    pulls: set[_Pull] = field(default_factory=set)
    #: reached through its worker address (no listener): the server replies to ours
    by_worker_address: bool = False


@dataclass(eq=False)
class _Pull:
    address: PeerAddress
    key: bytes
    layer_range: LayerRange
    out: memoryview
    timeout_s: float
    future: concurrent.futures.Future[int]
    request_id: int = 0
    peer: _Peer | None = None
    status_buf: bytearray = field(default_factory=lambda: bytearray(_STATUS_BUFFER_NBYTES))
    header_out: bytearray | None = None  # receives the header an OK carries (asked for)
    nbytes: int = 0
    chunk: int = 0
    chunks_left: int = 0
    chunks_done: int = 0  # chunks received (the first may arrive before the status is handled)
    receives: list[Any] = field(default_factory=list)  # chunk receives not yet completed
    abort_receive: Any = None
    done: bool = False
    timer: _Timer | None = None
    token: bytes = b""


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
        self._request_ids = itertools.count(1)
        self._peers: dict[tuple[Any, ...], _Peer] = {}
        # ``host``: this process's address (node.host); UCX's transports stay on its interface.
        self._engine = _ProgressThread(name, {**ucx_interface_options(host), **(ucx_options or {})})
        self._worker_address: bytes = self._engine.call(lambda: self._engine.worker.address.tobytes())
        self._closing = False
        self.pulls = 0
        self.failures = 0
        self.timeouts = 0
        self.bytes_received = 0

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
        future = pull.future
        # The pull's own timer enforces the deadline; the slack only guards against a
        # wedged progress thread.
        deadline = time.monotonic() + timeout_s + 5.0
        # Usually no other thread drives the worker: this one sends the request and handles
        # the reply itself (no hand-off either way).
        def check_alive() -> None:
            if alive is not None and not alive():
                self._fail(pull, errors.TransferError(f"pull of {bytes(key).hex()}: the holder is gone"),
                           drop_peer=True)

        if self._engine.drive(lambda: self._start(pull), future.done, deadline,
                              check_alive if alive is not None else None, alive_check_s):
            if not future.done():
                self._abort(future)
                raise errors.KVTimeoutError(
                    f"pull of {bytes(key).hex()}: no result {timeout_s}s + 5s after it started (UCX stalled)")
            return future.result(0)
        self._engine.submit(lambda: self._start(pull))
        try:
            if alive is not None:
                while True:
                    try:
                        return future.result(min(alive_check_s, max(deadline - time.monotonic(), 0.0)))
                    except concurrent.futures.TimeoutError:
                        if future.done() or time.monotonic() >= deadline:
                            raise
                        if not alive():
                            self._abort(future)
                            raise errors.TransferError(
                                f"pull of {bytes(key).hex()}: the holder is gone") from None
            return future.result(timeout_s + 5.0)
        except concurrent.futures.TimeoutError:
            if future.done():  # KVTimeoutError is a TimeoutError too: the deadline's own
                raise
            self._abort(future)
            raise errors.KVTimeoutError(
                f"pull of {bytes(key).hex()}: progress thread unresponsive after {timeout_s}s") from None

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
        self._engine.stop(self._close_on_thread)

    def __enter__(self) -> PullClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_address(self) -> bytes:
        return self._worker_address

    def stats(self) -> dict[str, int]:
        """Counters: pulls completed and failed, timeouts among them, bytes received."""
        return {
            "peers": len(self._peers),
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
    ) -> _Pull:
        if self._closing:
            raise errors.PoolClosedError(f"{self._name} is closed")
        if self._engine.on_thread():
            raise RuntimeError("pull_into cannot be called from the client's own progress thread")
        peer = _as_peer_address(address)
        if not isinstance(key, (bytes, bytearray, memoryview)) or not 0 < len(key) <= _MAX_KEY_BYTES:
            raise errors.InvalidKeyError(f"key must be 1..{_MAX_KEY_BYTES} bytes, got {key!r:.80}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not isinstance(token, (bytes, bytearray, memoryview)) or len(token) > _MAX_TOKEN_BYTES:
            raise errors.AuthenticationError(f"pull token must be at most {_MAX_TOKEN_BYTES} bytes")
        pull = _Pull(
            address=peer,
            key=bytes(key),
            layer_range=_as_layer_range(layer_range),
            out=_as_out_view(out),
            timeout_s=float(timeout_s),
            future=concurrent.futures.Future(),
            token=bytes(token),
        )
        if header_out is not None:
            if not isinstance(header_out, bytearray):
                raise TypeError(f"header_out must be a bytearray, got {type(header_out).__name__}")
            room = len(header_out) if 0 < len(header_out) <= MAX_HEADER_NBYTES else MAX_HEADER_NBYTES
            pull.header_out = header_out
            pull.status_buf = bytearray(_STATUS.size + max(room, _MAX_STATUS_TEXT))
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

    def _start(self, pull: _Pull) -> None:
        pull.timer = self._engine.call_later(pull.timeout_s, lambda: self._on_deadline(pull))
        if pull.future.cancelled():
            self._fail(pull, errors.TransferError("pull cancelled"))
            return
        try:
            peer = self._peer_for(pull.address)
        except Exception as exc:
            where = f"{pull.address.host}:{pull.address.port}"
            self._fail(pull, errors.TransferError(f"cannot connect to {where}: {_describe(exc)}"))
            return
        pull.peer = peer
        peer.pulls.add(pull)
        pull.request_id = next(self._request_ids) & _MAX_REQUEST_ID
        reply_address = self._worker_address if peer.by_worker_address else b""
        frame = _pack_request(self._client_id, peer.conn_id, pull, self.max_message, reply_address,
                              peer.error_handling)
        status_array, frame_array = Array(pull.status_buf), Array(frame)
        # The first chunk's receive is posted before the request goes out, straight into
        # `out` (the server's chunk is at most our max_message; a shorter message fits): the
        # bytes of a pull of one chunk land while the status is still being handled, and one
        # request + one reply is the whole pull. A pull that fails cancels it.
        # (A server's chunk is at most max(MIN_CHUNK, our max_message).)
        first_array = Array(pull.out[:min(pull.out.nbytes, self._max_chunk)])
        try:
            status_req = peer.ep.tag_recv(status_array, _reply_tag(pull.request_id, 0))
            first_req = peer.ep.tag_recv(first_array, _reply_tag(pull.request_id, 1))
            pull.receives.append(first_req)
            send_req = peer.ep.tag_send(frame_array, ucx_api.UCXXTag(REQUEST_TAG))
        except Exception as exc:
            self._fail(pull, errors.TransferError(f"{peer.label}: {_describe(exc)}"), drop_peer=True)
            return
        self._engine.watch(status_req, lambda err: self._on_status(pull, err), status_array)
        self._engine.watch(first_req, functools.partial(self._on_chunk, pull, first_req), first_array)
        def sent(err: BaseException | None) -> None:
            if err is not None:
                self._fail(pull, errors.TransferError(f"{peer.label}: request send failed: {_describe(err)}"),
                           drop_peer=True)

        self._engine.watch(send_req, sent, frame_array)

    def _peer_for(self, address: PeerAddress) -> _Peer:
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
        worker = self._engine.worker
        if use_worker_address:
            ucx_address = ucx_api.UCXAddress.create_from_buffer(address.worker_address)
            ep = worker.create_endpoint_from_worker_address(ucx_address, False)
            peer = _Peer(key, ep, False, f"{address.host}:{address.port} (worker address)",
                         by_worker_address=True)
        elif checked_worker_address:
            ucx_address = ucx_api.UCXAddress.create_from_buffer(address.worker_address)
            ep = worker.create_endpoint_from_worker_address(ucx_address, True)
            ep.set_close_callback(self._engine.post, cb_args=(self._sweep_dead_peers,))
            peer = _Peer(key, ep, True, f"{address.host} (worker address, tcp)", by_worker_address=True)
        elif not address.port:
            raise errors.TransferError(f"{address.host}: neither a listener port nor a usable worker address")
        else:
            ep = ucx_api.UCXEndpoint.create(worker, address.host, address.port, True)
            ep.set_close_callback(self._engine.post, cb_args=(self._sweep_dead_peers,))
            peer = _Peer(key, ep, True, f"{address.host}:{address.port}")
            hello = bytearray(_HELLO.size)
            _HELLO.pack_into(hello, 0, _HELLO_MAGIC, PROTOCOL_VERSION, peer.conn_id)
            hello_array = Array(hello)
            def hello_sent(err: BaseException | None, peer: _Peer = peer) -> None:
                if err is not None:
                    self._drop_peer(peer, f"hello failed: {_describe(err)}")

            self._engine.watch(ep.stream_send(hello_array), hello_sent, hello_array)
        self._peers[key] = peer
        return peer

    def _sweep_dead_peers(self) -> None:
        for peer in list(self._peers.values()):
            if peer.error_handling and not peer.ep.alive:
                self._drop_peer(peer, "connection lost")

    def _on_status(self, pull: _Pull, error: BaseException | None) -> None:
        if pull.done:
            return
        peer = pull.peer
        assert peer is not None
        if error is not None:
            self._fail(pull, errors.TransferError(f"{peer.label}: {_describe(error)}"), drop_peer=True)
            return
        frame = _parse_status(pull.status_buf, pull.request_id)
        if frame is None:
            self._fail(pull, errors.ProtocolError(f"{peer.label}: malformed status frame"), drop_peer=True)
            return
        status, nbytes, chunk, body = frame
        layers = pull.layer_range
        what = f"{peer.label}: pull of {pull.key.hex()} layers [{layers.start}, {layers.stop})"
        if status != STATUS_OK:
            exc_type = {
                STATUS_MISS: errors.RemoteMissError,
                STATUS_BAD_RANGE: errors.LayerRangeError,
                STATUS_OUT_TOO_SMALL: errors.OutBufferError,
                STATUS_UNAUTHORIZED: errors.AuthenticationError,
            }.get(status, errors.TransferError)
            self._fail(pull, exc_type(f"{what}: {body.decode('utf-8', 'replace')}"))
            return
        if pull.header_out is not None:
            if not body:
                self._fail(pull, errors.ProtocolError(f"{what}: OK without the header asked for"), drop_peer=True)
                return
            pull.header_out[:] = body  # before the status buffer takes the abort frame
        if nbytes > pull.out.nbytes or (nbytes and chunk < min(_MIN_CHUNK_FLOOR, nbytes)) \
                or -(-nbytes // max(chunk, 1)) > _MAX_CHUNKS:
            self._fail(pull, errors.ProtocolError(f"{what}: bad sizes {nbytes}/{chunk}"), drop_peer=True)
            return
        if nbytes and chunk > self._max_chunk:
            self._fail(pull, errors.ProtocolError(f"{what}: chunk {chunk} above {self._max_chunk}"),
                       drop_peer=True)
            return
        pull.nbytes, pull.chunk = nbytes, chunk
        total = -(-nbytes // chunk) if nbytes else 0
        # The first chunk's receive went out with the request and may have completed already.
        first_done = pull.chunks_done
        pull.chunks_left = total - first_done
        if total == 0:
            self._succeed(pull)  # cancels the first chunk's receive
            return
        if pull.chunks_left == 0:
            self._succeed(pull)
            return
        try:
            for i in range(1, total):
                lo = i * chunk
                array = Array(pull.out[lo:min(lo + chunk, nbytes)])
                req = peer.ep.tag_recv(array, _reply_tag(pull.request_id, i + 1))
                pull.receives.append(req)
                self._engine.watch(req, functools.partial(self._on_chunk, pull, req), array)
            # The status buffer is free again: it takes the abort frame, if any.
            array = Array(pull.status_buf)
            pull.abort_receive = peer.ep.tag_recv(array, _reply_tag(pull.request_id, _ABORT_INDEX))
            self._engine.watch(pull.abort_receive, lambda err: self._on_abort(pull, what, err), array)
        except Exception as exc:
            self._fail(pull, errors.TransferError(f"{what}: {_describe(exc)}"), drop_peer=True)

    def _on_chunk(self, pull: _Pull, request: Any, error: BaseException | None) -> None:
        if pull.done:
            return
        if error is not None:
            assert pull.peer is not None
            self._fail(pull, errors.TransferError(f"{pull.peer.label}: {_describe(error)}"), drop_peer=True)
            return
        pull.receives.remove(request)
        pull.chunks_done += 1
        if not pull.chunk:  # the status has not been handled yet: it counts this chunk
            return
        pull.chunks_left -= 1
        if pull.chunks_left == 0:
            self._succeed(pull)

    def _on_abort(self, pull: _Pull, what: str, error: BaseException | None) -> None:
        pull.abort_receive = None
        if pull.done:
            return
        if error is not None:
            self._fail(pull, errors.TransferError(f"{what}: {_describe(error)}"), drop_peer=True)
            return
        frame = _parse_status(pull.status_buf, pull.request_id)
        text = frame[3].decode("utf-8", "replace") if frame is not None else "malformed abort frame"
        # Every chunk the server sent was delivered before this frame; the
        # receives still posted are for chunks that will never come.
        self._fail(pull, errors.TransferError(f"{what}: holder failed mid-pull: {text}"))

    def _cancel_receives(self, pull: _Pull) -> None:
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

    def _on_deadline(self, pull: _Pull) -> None:
        if not pull.done:
            where = pull.peer.label if pull.peer is not None else f"{pull.address.host}:{pull.address.port}"
            if not pull.nbytes and not pull.chunks_left:
                stage = "no reply yet"
            else:
                stage = f"{pull.chunks_left} of {-(-pull.nbytes // max(pull.chunk, 1))} messages missing"
            self._fail(pull, errors.KVTimeoutError(
                f"{where}: pull of {pull.key.hex()} not complete after {pull.timeout_s}s ({stage})"),
                drop_peer=True)

    def _succeed(self, pull: _Pull) -> None:
        pull.done = True
        self._cancel_receives(pull)  # the abort receive
        self.pulls += 1
        self.bytes_received += pull.nbytes
        self._detach(pull)
        if not pull.future.done():
            pull.future.set_result(pull.nbytes)

    def _fail(self, pull: _Pull, exc: BaseException, *, drop_peer: bool = False) -> None:
        if pull.done:
            return
        peer = pull.peer
        if drop_peer and peer is not None:
            self._drop_peer(peer, f"{type(exc).__name__} on {pull.key.hex()}", first=(pull, exc))
            return
        self._finish_failed([(pull, exc)])

    def _finish_failed(self, failed: list[tuple[_Pull, BaseException]]) -> None:
        for pull, exc in failed:
            pull.done = True
            self._cancel_receives(pull)
            self._detach(pull)
            self.failures += 1
            self.timeouts += isinstance(exc, errors.KVTimeoutError)
            if not pull.future.done():
                pull.future.set_exception(exc)

    def _detach(self, pull: _Pull) -> None:
        if pull.timer is not None:
            pull.timer.cancel()
        if pull.peer is not None:
            pull.peer.pulls.discard(pull)
            pull.peer = None

    def _drop_peer(
        self, peer: _Peer, reason: str, first: tuple[_Pull, BaseException] | None = None
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
        _close_endpoint(peer.ep)
        self._finish_failed(failed)

    def _close_on_thread(self) -> None:
        for peer in list(self._peers.values()):
            for pull in list(peer.pulls):
                self._fail(pull, errors.PoolClosedError(f"{self._name} closed"))
            self._drop_peer(peer, "client closing")


def _as_peer_address(address: PeerAddress | tuple[str, int]) -> PeerAddress:
    if isinstance(address, PeerAddress):
        return address
    try:
        host, port = address
        return PeerAddress(str(host), int(port))
    except (TypeError, ValueError):
        raise ValueError(f"address must be a PeerAddress or (host, port), got {address!r}") from None


def _as_layer_range(layers: LayerRange | tuple[int, int] | range) -> LayerRange:
    if isinstance(layers, LayerRange):
        start, stop = layers.start, layers.stop
    elif isinstance(layers, range) and layers.step == 1:
        start, stop = layers.start, layers.stop
    elif isinstance(layers, tuple) and len(layers) == 2:
        start, stop = int(layers[0]), int(layers[1])
    else:
        raise errors.LayerRangeError(f"cannot read {layers!r} as a layer range")
    if not 0 <= start < stop < 2**32:
        raise errors.LayerRangeError(f"layer range [{start}, {stop}) is empty or negative")
    return LayerRange(start, stop)


def _as_out_view(out: Any) -> memoryview:
    try:
        view = memoryview(out)
    except TypeError:
        raise errors.OutBufferError(
            f"out must support the buffer protocol, got {type(out).__name__}") from None
    if view.readonly:
        raise errors.OutBufferError("out buffer is read-only")
    if not view.c_contiguous:
        raise errors.OutBufferError("out buffer must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes == 0:
        raise errors.OutBufferError("out buffer is empty")
    return view


def _pack_request(
    client_id: int, conn_id: int, pull: _Pull, max_chunk: int, reply_address: bytes,
    reply_error_handling: bool = False,
) -> bytearray:
    token = pull.token
    frame = bytearray(_REQUEST.size + len(pull.key) + len(token) + len(reply_address))
    _REQUEST.pack_into(
        frame, 0, _REQUEST_MAGIC, PROTOCOL_VERSION,
        (_FLAG_REPLY_TO_ADDRESS if reply_address else 0)
        | (_FLAG_REPLY_ERROR_HANDLING if reply_address and reply_error_handling else 0)
        | (_FLAG_WANT_HEADER if pull.header_out is not None else 0),
        len(pull.key), len(reply_address), client_id, conn_id, pull.request_id,
        pull.layer_range.start, pull.layer_range.stop, pull.out.nbytes, max_chunk,
        xxhash.xxh3_64_intdigest(reply_address), len(token),
    )
    key_end = _REQUEST.size + len(pull.key)
    frame[_REQUEST.size:key_end] = pull.key
    frame[key_end:key_end + len(token)] = token
    frame[key_end + len(token):] = reply_address
    return frame


__all__ = [
    "DEFAULT_UCX_OPTIONS",
    "PeerAddress",
    "Provider",
    "PullClient",
    "PullServer",
    "ServeSource",
    "TRANSPORTS",
    "local_host_id",
    "plausible_worker_address",
]
