"""The public surface every pool shares: :class:`PoolAPI`.

Owns what does not depend on where the bytes are: key and ``out=`` validation,
the asyncio twins, the layer-wise read pipeline (:func:`stream_layers`, one for
local, same-host and remote reads), Prometheus metrics, and the lifecycle. The
embedded :class:`kvpool.pool.Pool` implements the core over its local tiers;
the cluster client (:class:`kvpool.client.ClusterPool`) composes such a pool
with a view of the cluster. Neither overrides the other.

Every async method runs the same code as its sync twin in a worker thread.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import concurrent.futures
import functools
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, Self, TypeVar, cast

import numpy as np

from kvpool import errors
from kvpool.config import Config
from kvpool.metrics import ApiLatency, MetricsServer, StatsCollector
from kvpool.objformat import LayerRange, ObjectSpec, byte_view, out_view

Key = bytes | bytearray | memoryview | str


_Method = TypeVar("_Method", bound=Callable[..., Any])


def timed(op: str) -> Callable[[_Method], _Method]:
    """Observe the call's latency in the pool's ``op`` histogram (``put``/``get``)."""
    def decorate(method: _Method) -> _Method:
        @functools.wraps(method)
        def wrapper(self: PoolAPI, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                getattr(self.latency, op).observe(time.perf_counter() - started)
        return cast(_Method, wrapper)
    return decorate


class LayerSource(Protocol):
    """One version of one object, held for a layer-wise read (a pinned local object, or
    located replicas under a lease). Every layer read from it is verified against the
    same header, so a layer-wise read never mixes two versions."""

    spec: ObjectSpec

    def read(self, layer_range: LayerRange, buf: memoryview) -> None:
        """Fill ``buf`` with the verified layers, or raise (ChecksumError, TransferError, ...)."""

    def done(self, nbytes_read: int) -> None:
        """Release what holds the object (pin, lease). Called once, also after a failure."""


class _LayerPlan:
    """One layer-wise read: the layers, the array they land in, and how one layer is read.
    Both drivers below (threads for ``for``, asyncio for ``async for``) run it."""

    def __init__(self, source: LayerSource, layers: Any, out: Any) -> None:
        self.source = source
        self.range = LayerRange.resolve(layers, source.spec.layers)
        self.arr, _ = out_view(source.spec, self.range, out)

    def read(self, i: int) -> None:
        layer = self.range.start + i
        self.source.read(LayerRange(layer, layer + 1), byte_view(self.arr[i]))


def iterate_layers(source: LayerSource, layers: Any, out: Any) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(layer, array)`` in order; layer i+1 is read in a worker thread while the
    caller uses layer i. ``source.done`` runs when the iteration ends, however it ends."""
    nbytes = 0
    pending: concurrent.futures.Future[None] | None = None
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-layers")
    try:
        plan = _LayerPlan(source, layers, out)
        pending = worker.submit(plan.read, 0)
        for i in range(plan.range.count):
            pending.result()
            if i + 1 < plan.range.count:
                pending = worker.submit(plan.read, i + 1)
            nbytes += source.spec.layer_nbytes
            yield plan.range.start + i, plan.arr[i]
    finally:
        worker.shutdown(wait=True)  # never release what a worker thread still reads
        source.done(nbytes)


async def stream_layers(source: LayerSource, layers: Any, out: Any) -> AsyncIterator[tuple[int, np.ndarray]]:
    """:func:`iterate_layers` for ``async for``: layer i+1 is read in a worker thread while
    the caller's coroutine uses layer i."""
    nbytes = 0
    pending: asyncio.Future[None] | None = None
    try:
        plan = _LayerPlan(source, layers, out)
        pending = asyncio.ensure_future(asyncio.to_thread(plan.read, 0))
        for i in range(plan.range.count):
            await pending
            if i + 1 < plan.range.count:
                pending = asyncio.ensure_future(asyncio.to_thread(plan.read, i + 1))
            nbytes += source.spec.layer_nbytes
            yield plan.range.start + i, plan.arr[i]
    finally:
        if pending is not None and not pending.done():
            await asyncio.wait([pending])  # never release what a worker thread still reads
        source.done(nbytes)


class LayerStream:
    """What :meth:`PoolAPI.iter_layers` returns: iterate it with ``for`` (in a thread or plain
    code) or ``async for`` (in a coroutine); either way layer i+1 is read while the caller
    uses layer i. Nothing is read (or pinned) before the iteration starts."""

    def __init__(self, pool: PoolAPI, key: bytes, layers: Any, out: Any) -> None:
        self._pool, self._key, self._layers, self._out = pool, key, layers, out
        self._agen: AsyncIterator[tuple[int, np.ndarray]] | None = None

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        self._pool._check_open()
        source = self._pool._layer_source(self._key)
        if source is not None:
            yield from iterate_layers(source, self._layers, self._out)

    async def _stream(self) -> AsyncIterator[tuple[int, np.ndarray]]:
        self._pool._check_open()
        source = await asyncio.to_thread(self._pool._layer_source, self._key)
        if source is None:
            return
        async for item in stream_layers(source, self._layers, self._out):
            yield item

    def __aiter__(self) -> AsyncIterator[tuple[int, np.ndarray]]:
        if self._agen is None:
            self._agen = self._stream()
        return self._agen

    async def __anext__(self) -> tuple[int, np.ndarray]:  # anext(pool.iter_layers(h)) works too
        return await self.__aiter__().__anext__()


_OPEN: weakref.WeakSet[PoolAPI] = weakref.WeakSet()


def _close_open_pools() -> None:
    """Close what a program left open while its threads still run: a pool closed later, from
    ``__del__`` at interpreter shutdown, would wait on progress and heartbeat threads that
    no longer run (30 s per pool, then warnings about half-torn modules). Registered again
    with every pool, so it runs before the exit hooks of what the pool imported (ZeroMQ
    terminates its sockets in one)."""
    for pool in list(_OPEN):
        try:
            pool.close()
        except Exception:  # exiting anyway: nothing useful to report
            pass


class PoolAPI(abc.ABC):
    """kvpool's API; see :class:`kvpool.pool.Pool` (local tiers) and
    :func:`kvpool.connect` (the cluster). Thread-safe."""

    config: Config

    def __init__(self, config: Config) -> None:
        self.config = config
        self.latency = ApiLatency()
        self._closed = False
        self._metrics: MetricsServer | None = None
        _OPEN.add(self)
        atexit.unregister(_close_open_pools)
        atexit.register(_close_open_pools)

    def _adopt(self, part: PoolAPI) -> None:
        """``part`` is closed by this pool's close, not on its own at exit."""
        _OPEN.discard(part)

    # -- validation -------------------------------------------------------------

    def _key(self, prefix_hash: Key) -> bytes:
        if isinstance(prefix_hash, str):
            key = prefix_hash.encode()
        elif isinstance(prefix_hash, (bytes, bytearray, memoryview)):
            key = bytes(prefix_hash)
        else:
            raise errors.InvalidKeyError(
                f"a key is bytes (a prefix hash) or str, got {type(prefix_hash).__name__}"
            )
        if not 0 < len(key) <= self.config.pool.max_key_bytes:
            raise errors.InvalidKeyError(
                f"key length {len(key)} outside 1..{self.config.pool.max_key_bytes} bytes"
            )
        return key

    def _check_open(self) -> None:
        if self._closed:
            raise errors.PoolClosedError("the pool is closed")

    _out_view = staticmethod(out_view)

    @staticmethod
    def _outs(keys: Sequence[bytes], outs: Sequence[Any] | None) -> Sequence[Any]:
        if outs is None:
            return [None] * len(keys)
        if len(outs) != len(keys):
            raise errors.OutBufferError(f"{len(outs)} out buffers for {len(keys)} keys")
        return outs

    @staticmethod
    def _layers_each(keys: Sequence[bytes], layers: Any) -> Sequence[Any]:
        """``get_many``'s ``layers`` as one layer spec per key (a list gives each key its own)."""
        if not isinstance(layers, list):
            return [layers] * len(keys)
        if len(layers) != len(keys):
            raise errors.LayerRangeError(f"{len(layers)} layer ranges for {len(keys)} keys")
        return layers

    # -- the core, implemented by each pool --------------------------------------------

    @abc.abstractmethod
    def put(self, prefix_hash: Key, kv: Any, *, dtype: str | None = None) -> None: ...

    @abc.abstractmethod
    def get(self, prefix_hash: Key, *, layers: Any = None, out: Any = None) -> np.ndarray | None: ...

    @abc.abstractmethod
    def put_many(self, items: Mapping[Key, Any] | Iterable[tuple[Key, Any]], *,
                 dtype: str | None = None) -> None: ...

    @abc.abstractmethod
    def get_many(self, prefix_hashes: Sequence[Key], *, layers: Any = None, outs: Sequence[Any] | None = None,
                 landed: Callable[[int, np.ndarray | None], None] | None = None) -> list[np.ndarray | None]:
        """``get`` of each key (None for each miss). ``layers``: one layer spec for every key, or
        a list with each key's own (one key may appear several times, once per layer range);
        ``outs``: one ``out=`` buffer per key. ``landed(i, result)``: called on this thread with
        each key's result as soon as it is final (a pull's when its last layer is verified,
        while later pulls still arrive), once per key; an error it raises ends the get_many
        (pulls already in flight are read first)."""

    @abc.abstractmethod
    def exists_many(self, prefix_hashes: Sequence[Key]) -> list[bool]: ...

    @abc.abstractmethod
    def delete(self, prefix_hash: Key) -> None: ...

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _layer_source(self, key: bytes) -> LayerSource | None:
        """The object held for a layer-wise read, or None on a miss (may block)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release what this pool holds (called once)."""

    # -- derived -----------------------------------------------------------------------

    def exists(self, prefix_hash: Key) -> bool:
        """Whether the object is cached (a later get may still miss if it is evicted meanwhile)."""
        return self.exists_many([prefix_hash])[0]

    def lookup(self, prefix_hashes: Sequence[Key]) -> int:
        """How many leading hashes of this prefix chain are cached (longest cached prefix)."""
        found = 0
        for present in self.exists_many(prefix_hashes):
            if not present:
                break
            found += 1
        return found

    def iter_layers(self, prefix_hash: Key, *, layers: Any = None, out: Any = None) -> LayerStream:
        """``(layer, array)`` in order, with ``for`` or ``async for``; layer i+1 is read while
        the caller uses layer i.

        All layers come from one version of the object (pinned locally, or
        leased and checked against the first header read). Yields nothing on a
        miss; raises ChecksumError / TransferError if a layer cannot be read
        intact after earlier layers were handed out (they cannot be taken back,
        so this is not silently a miss). Bad ``layers`` / ``out`` raise when the
        iteration starts.
        """
        self._check_open()
        return LayerStream(self, self._key(prefix_hash), layers, out)

    # -- asyncio twins -----------------------------------------------------------------

    async def aput(self, prefix_hash: Key, kv: Any, *, dtype: str | None = None) -> None:
        await asyncio.to_thread(self.put, prefix_hash, kv, dtype=dtype)

    async def aget(self, prefix_hash: Key, *, layers: Any = None, out: Any = None) -> np.ndarray | None:
        return await asyncio.to_thread(self.get, prefix_hash, layers=layers, out=out)

    async def aexists(self, prefix_hash: Key) -> bool:
        return await asyncio.to_thread(self.exists, prefix_hash)

    async def alookup(self, prefix_hashes: Sequence[Key]) -> int:
        return await asyncio.to_thread(self.lookup, prefix_hashes)

    # -- lifecycle -----------------------------------------------------------------------

    def serve_metrics(self, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
        """Expose this pool's Prometheus metrics and /health over HTTP (port 0: any free port)."""
        self._check_open()
        if self._metrics is None:
            self._metrics = MetricsServer(
                port, host=host, role=self.stats()["role"], ready=lambda: not self._closed,
                registries=[self.latency, StatsCollector(pool_stats=self.stats)],
            ).start()
        return self._metrics

    def close(self) -> None:
        """Flush what must survive (the nvme index) and release everything held. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._metrics is not None:
            self._metrics.close()
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # interpreter shutdown: nothing useful to report
                pass
