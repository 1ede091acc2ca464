"""One UCX context and worker per engine, driven by its progress thread or by a waiting caller.

The UCX environment defaults and the interface / host helpers live here too.
"""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import itertools
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvpool import errors
from kvpool.transport.frames import INDEX_BITS

# ucxx is imported on first use, not with this module: importing it loads UCX's shared
# libraries and probes its transports, a cost every process would pay at import, and a process
# that pulls only over plain TCP (a CLI ``kvpool get``, a reader of small objects) never needs
# it. It sets UCX_RNDV_THRESH=8192 when imported (for GPU buffers): a value found before that
# import is the user's, one found after it is ucxx's and our default replaces it.
_ucx_modules: tuple[Any, Any] | None = None
_ucx_import_lock = threading.Lock()
_USER_RNDV_THRESH = False


def _ucx() -> tuple[Any, Any]:
    """``(ucxx._lib.libucxx, ucxx._lib.arr.Array)``, imported on the first call."""
    global _ucx_modules, _USER_RNDV_THRESH
    if _ucx_modules is None:
        with _ucx_import_lock:
            if _ucx_modules is None:
                _USER_RNDV_THRESH = "UCX_RNDV_THRESH" in os.environ
                # ucxx's own variable otherwise triggers a warning about unused UCX variables
                os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
                import ucxx._lib.libucxx as libucxx
                from ucxx._lib.arr import Array as array_type

                _ucx_modules = (libucxx, array_type)
    return _ucx_modules


class _LazyUcxApi:
    """``ucxx._lib.libucxx``, imported when an attribute is first asked for."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_ucx()[0], name)


ucx_api: Any = _LazyUcxApi()


def Array(obj: Any) -> Any:  # noqa: N802  (stands in for ucxx's Array class)
    """``ucxx._lib.arr.Array(obj)``: a buffer UCX can send from or receive into."""
    return _ucx()[1](obj)

log = logging.getLogger("kvpool.transport")

MiB = 1 << 20

#: UCX options passed to every context this module creates, unless the matching
#: ``UCX_<NAME>`` environment variable is set. put_zcopy lets the sender write
#: rendezvous data straight into the receiver's buffer, where the default get-based scheme
#: has the receiver fetch it; over TCP the sender writing is the faster of the two.
#: PROTO_ENABLE=n selects UCX's first protocol layer: the newer one offers no rendezvous at all
#: to a same-host peer reached by worker address with peer-failure detection
#: (``transport="tcp"``, no listener), so a large pull goes as eager fragments instead of one
#: zero-copy transfer, and through a listener or over shared memory it is slower too.
#: (Measurements: docs/benchmarks.md, "Measurements behind defaults".)
DEFAULT_UCX_OPTIONS: dict[str, str] = {"RNDV_SCHEME": "put_zcopy", "PROTO_ENABLE": "n"}


def _host_without_rdma_or_gpu() -> bool:
    """No RDMA device (``/sys/class/infiniband``) and no NVIDIA GPU: UCX has TCP and shared
    memory only, where sending eagerly beats the rendezvous handshake up to a few MiB."""
    try:
        if os.listdir("/sys/class/infiniband"):
            return False
    except OSError:
        pass
    return not os.path.exists("/dev/nvidiactl")


#: Where UCX has only TCP and shared memory, messages below 8 MiB go eagerly instead of by
#: rendezvous (ucxx's 8192, meant for GPU buffers, or UCX's own choice): on those transports
#: rendezvous saves at most a copy, which below a few MiB costs less than its handshake (a
#: round trip before the data moves). With an RDMA device or a GPU, rendezvous (zero-copy)
#: is what those fabrics are for: left to UCX and ucxx. (Measurements: docs/benchmarks.md.)
if _host_without_rdma_or_gpu():
    DEFAULT_UCX_OPTIONS["RNDV_THRESH"] = "8m"

TRANSPORTS = ("tcp", "auto")

_POLL_FALLBACK_S = 0.5  # wake at least this often even if UCX raised no event


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



# -- the progress thread -------------------------------------------------------------


class Timer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """One UCX context and worker, created, used and destroyed by one thread.

    Other threads only call :meth:`submit` / :meth:`call` / :meth:`drive`. Everything else
    (``watch``, ``call_later``, the ``worker`` attribute) is for code already running on
    the thread (or driving it). One engine may carry a process's pull server *and* its pull
    client (``engine=``): one worker, one progress thread, and a caller waiting for its own
    pull also serves the requests that arrive meanwhile. Whoever created it stops it, after
    the server and client on it are closed.
    """

    def __init__(self, name: str, ucx_options: Mapping[str, str] | None) -> None:
        self.name = name
        self.worker: Any = None
        self.context: Any = None
        # Whoever holds this lock drives the worker: the thread below, or a caller waiting for
        # its own pull (:meth:`drive`), so a pull's reply is handled on the thread that waits for
        # it instead of being handed over. ``_driver`` is the holder's thread id.
        self._lock = threading.Lock()
        #: pull request ids: reply tags are matched worker-wide, so every client on this worker
        #: draws from one counter
        self.request_ids = itertools.count(1)
        self._driver: int | None = None
        self._drive_epoll: select.epoll | None = None
        self._loop_epoll: select.epoll | None = None  # the progress thread's (muted while a caller drives)
        self._options = effective_ucx_options(ucx_options)
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._watched: list[tuple[Any, Callable[[BaseException | None], None], Any]] = []
        self._timers: list[tuple[float, int, Timer]] = []
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
        settled = False
        try:
            if self._stop_requested or self.worker is None or self._drive_epoll is None:
                raise errors.PoolClosedError(f"{self.name} is closed")
            self._driver = threading.get_ident()
            worker, epoll = self.worker, self._drive_epoll
            # The progress thread sleeps on the same descriptors: muted while this thread drives,
            # so the events of this pull do not wake it only to wait for the lock (a context switch
            # and a GIL hand-off per event, on this caller's vCPU when they share one).
            self._mute_loop(True)
            start()
            next_tick = time.monotonic() + tick_s if tick is not None else math.inf
            while True:
                busy = self._turn(worker)
                if done():
                    settled = self._settle(worker)
                    return True
                now = time.monotonic()
                if now >= next_tick:
                    assert tick is not None
                    tick()
                    next_tick = now + tick_s
                    continue
                if now >= deadline:
                    return True
                if busy or self._commands or not worker.arm():
                    continue
                if epoll.poll(max(0.0, min(self._poll_timeout(), deadline - now, next_tick - now))):
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
        finally:
            self._driver = None
            # Leave the worker armed for the progress thread, or wake it for what is pending.
            kick = bool(self._commands)
            try:
                kick = kick or (self.worker is not None and not (settled or self.worker.arm()))
            except Exception:
                kick = True
            self._mute_loop(False)  # level-triggered: what arrived meanwhile wakes it now
            self._lock.release()
            if kick and not self._closed:
                try:
                    os.eventfd_write(self._wake_fd, 1)
                except OSError:
                    pass

    def _settle(self, worker: Any, rounds: int = 4) -> bool:
        """Finish what this drive left behind (send completions, releases) until the worker arms,
        so the progress thread need not be woken for it; whether it armed."""
        for _ in range(rounds):
            if not self._commands and worker.arm():
                return True
            self._turn(worker)
        return False

    def _mute_loop(self, mute: bool) -> None:
        epoll, worker = self._loop_epoll, self.worker
        if epoll is None or worker is None:
            return
        events = 0 if mute else select.EPOLLIN
        try:
            epoll.modify(worker.epoll_file_descriptor, events)
            epoll.modify(self._wake_fd, events)
        except (OSError, ValueError):  # closed meanwhile: the loop is gone
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

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(callback)
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
            self._loop_epoll = epoll
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
                    busy = self._turn(worker)
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
            self._loop_epoll = None
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

    def _turn(self, worker: Any) -> bool:
        """One round of the driving thread's work: commands, UCX progress, completions, due
        timers; whether any of it did something."""
        busy = self._run_commands()
        worker.progress()
        busy = self._reap() or busy
        return self._run_due_timers() or busy

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


def effective_ucx_options(extra: Mapping[str, str] | None) -> dict[str, str]:
    _ucx()  # whether UCX_RNDV_THRESH is the user's is known once ucxx is imported
    options = {**DEFAULT_UCX_OPTIONS, **(extra or {})}
    # The environment wins, so UCX_* variables keep their usual meaning (except ucxx's own
    # UCX_RNDV_THRESH, set on its import: see _USER_RNDV_THRESH).
    return {k: str(v) for k, v in options.items()
            if f"UCX_{k}" not in os.environ or (k == "RNDV_THRESH" and not _USER_RNDV_THRESH)}


def close_endpoint(ep: Any) -> None:
    # close_blocking cancels the endpoint's in-flight requests, then closes it
    # (forcibly when error handling is on). The non-blocking close() returns a
    # request that may be null, which ucxx cannot safely free.
    try:
        ep.close_blocking()
    except Exception as exc:
        log.debug("closing endpoint: %s", exc)


class RecentFailures:
    """Endpoints that could not be made lately, by key, each left alone for ``retry_s`` (read
    when it fails, so a caller may change it): the pulls of a batch to a process that just died
    make one attempt between them, not one each (UCX logs four ERROR lines per attempt). On the
    progress thread only, as the endpoints are."""

    def __init__(self, retry_s: Callable[[], float]) -> None:
        self._retry_s = retry_s
        self._until: dict[Any, tuple[float, str]] = {}  # key -> (left alone until, why it failed)

    def why(self, key: Any) -> str | None:
        """Why ``key`` failed, if it did within its window (None: try it)."""
        failed = self._until.get(key)
        if failed is None:
            return None
        if time.monotonic() < failed[0]:
            return failed[1]
        del self._until[key]
        return None

    def failed(self, key: Any, why: str) -> None:
        now = time.monotonic()
        for stale in [k for k, (until, _) in self._until.items() if until <= now]:
            del self._until[stale]
        self._until[key] = (now + self._retry_s(), why)

    def clear(self) -> None:
        self._until.clear()


def reply_tag(request_id: int, index: int) -> Any:
    return ucx_api.UCXXTag((request_id << INDEX_BITS) | index)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


