"""The embedded ``Pool``: kvpool's public API over local tiers.

Owns input validation (keys, KV arrays, layer ranges, ``out=`` buffers), the
sync/async surface, and the local read/write paths through the tier manager.
It does not own placement (``tiers.manager``) or the cluster; the cluster
client subclasses it and adds the master and remote pulls.

Every async method runs the same code as its sync twin in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.config import Config
from kvpool.metrics import ApiLatency, MetricsServer, StatsCollector
from kvpool.objformat import LayerRange, ObjectSpec, byte_view, numpy_dtype, spec_of, storage_dtype
from tiers import TIER_ORDER, tier_class
from tiers.manager import PinnedObject, TierManager

log = logging.getLogger(__name__)

Key = bytes | bytearray | memoryview | str


def timed(op: str) -> Any:
    """Observe the call's latency in the pool's ``op`` histogram (``put``/``get``)."""
    def decorate(method: Any) -> Any:
        @functools.wraps(method)
        def wrapper(self: Pool, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                getattr(self.latency, op).observe(time.perf_counter() - started)
        return wrapper
    return decorate


def build_tier_manager(config: Config) -> TierManager:
    """Open every tier with a capacity above 0, fastest first."""
    tiers, put_enabled = [], []
    try:
        for name in TIER_ORDER:
            section = getattr(config.tiers, name)
            if section.capacity <= 0:
                continue
            try:
                tiers.append(tier_class(name).from_config(section, config))
            except errors.PoolLockedError as exc:
                raise errors.PoolLockedError(
                    f"{exc}. Pool {config.pool.name!r} is open in another process (a kvpool-server or another "
                    f"Pool with the same settings): share it with kvpool.connect(<its master address>), or give "
                    f"this process its own pool.name and pool.data_dir") from None
            put_enabled.append(section.put)
        return TierManager(
            tiers, put_enabled=put_enabled, policy=config.eviction.policy,
            promote=config.eviction.promote, promote_min_hits=config.eviction.promote_min_hits,
        )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise


class Pool:
    """A KV-cache pool over local tiers (hbm, dram, cxl, nvme).

    ``Pool()`` opens the embedded defaults (``conf/default.toml``);
    ``Pool(config="my.toml")`` or ``Pool(config=Config(...))`` overrides them.
    Thread-safe: any number of threads may share one pool.
    """

    def __init__(self, config: str | Config | Mapping[str, Any] | None = None) -> None:
        self.config = Config.load(config)
        self._manager = build_tier_manager(self.config)
        self._closed = False
        self.latency = ApiLatency()
        self._metrics: MetricsServer | None = None
        log.info("kvpool %r: tiers %s", self.config.pool.name,
                 ", ".join(f"{t.name} {t.capacity_bytes} B" for t in self._manager.tiers))

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

    @staticmethod
    def _out_view(spec: ObjectSpec, layer_range: LayerRange, out: Any) -> tuple[np.ndarray, memoryview]:
        """(array to return, byte view to fill) for ``out=``, or fresh if ``out`` is None."""
        shape = spec.array_shape(layer_range)
        if out is None:
            arr = np.empty(shape, dtype=numpy_dtype(spec.dtype))
            return arr, byte_view(arr)
        if isinstance(out, np.ndarray):
            if out.shape != shape:
                raise errors.OutBufferError(f"out has shape {out.shape}, layers need {shape}")
            if out.dtype != numpy_dtype(spec.dtype) and out.dtype != storage_dtype(spec.dtype):
                raise errors.OutBufferError(f"out has dtype {out.dtype}, object is {spec.dtype}")
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise errors.OutBufferError("out must be C-contiguous and writable")
            return out, byte_view(out)
        try:
            mv = memoryview(out)
        except TypeError:
            raise errors.OutBufferError(
                f"out must be a numpy array or a writable buffer, got {type(out).__name__}"
            ) from None
        if mv.readonly or not mv.c_contiguous:
            raise errors.OutBufferError("out must be C-contiguous and writable")
        mv = mv.cast("B")
        need = spec.layer_nbytes * layer_range.count
        if len(mv) != need:
            raise errors.OutBufferError(f"out holds {len(mv)} bytes, layers need {need}")
        arr = np.frombuffer(mv, dtype=numpy_dtype(spec.dtype)).reshape(shape)
        return arr, mv

    # -- core API -----------------------------------------------------------------

    @timed("put")
    def put(self, prefix_hash: Key, kv: Any, *, dtype: str | None = None) -> None:
        """Store ``kv`` ([layers, 2, tokens, kv_heads, head_dim]) under ``prefix_hash``.

        ``kv`` may be a numpy array, a CuPy array, anything with ``__dlpack__``
        (e.g. a torch tensor) or a buffer. ``dtype`` names the stored type when
        the array's own dtype cannot (``"bfloat16"`` for uint16 bytes).
        Overwrites an existing object of the same key. Raises ShapeError,
        DTypeError, InvalidKeyError, ObjectTooLargeError, PoolFullError,
        DiskFullError, PoolClosedError.
        """
        self._check_open()
        key = self._key(prefix_hash)
        spec, arr = spec_of(kv, dtype)
        self._put_local(key, spec, byte_view(arr))

    def _put_local(self, key: bytes, spec: ObjectSpec, payload: memoryview) -> str:
        return self._manager.put(key, spec, payload)

    @timed("get")
    def get(self, prefix_hash: Key, *, layers: Any = None, out: Any = None) -> np.ndarray | None:
        """The object (or only ``layers``: int, range, slice or (start, stop)), or None on a miss.

        With ``out=`` (a numpy array of the right shape, or a writable buffer of
        the right size) the bytes land there and ``out`` is returned as an array.
        Bytes that fail their checksum are dropped and reported as a miss, never
        returned. Raises LayerRangeError / OutBufferError for bad arguments.
        """
        self._check_open()
        return self._get_local(self._key(prefix_hash), layers, out)

    def _get_local(self, key: bytes, layers: Any, out: Any) -> np.ndarray | None:
        obj = self._manager.pin(key)
        if obj is None:
            return None
        nbytes = 0
        try:
            layer_range = LayerRange.resolve(layers, obj.spec.layers)
            arr, buf = self._out_view(obj.spec, layer_range, out)
            try:
                obj.read_layers(layer_range, buf)
            except errors.ChecksumError:
                self._manager.discard_corrupt(obj)
                return None
            nbytes = len(buf)
            return arr
        finally:
            self._manager.unpin(obj, bytes_read=nbytes)

    def exists(self, prefix_hash: Key) -> bool:
        """Whether the object is cached (a later get may still miss if it is evicted meanwhile)."""
        self._check_open()
        return self._key(prefix_hash) in self._manager

    def lookup(self, prefix_hashes: Sequence[Key]) -> int:
        """How many leading hashes of this prefix chain are cached (longest cached prefix)."""
        found = 0
        for present in self.exists_many(prefix_hashes):
            if not present:
                break
            found += 1
        return found

    def delete(self, prefix_hash: Key) -> None:
        """Remove an object; raises KeyNotFoundError if it is not cached."""
        self._check_open()
        self._manager.delete(self._key(prefix_hash))

    def stats(self) -> dict[str, Any]:
        """Tiers (capacity, usage, objects, hits), counters, misses by reason."""
        self._check_open()
        counters = dict(self._manager.counters)
        tiers = self._manager.tier_stats()
        return {
            "pool": self.config.pool.name,
            "role": "embedded",
            "objects": len(self._manager),
            "tiers": {t["tier"]: t for t in tiers},
            "hits": sum(t["hits"] for t in tiers),
            "misses": {reason: counters.get(f"miss_{reason}", 0) for reason in ("absent", "checksum")},
            "counters": counters,
        }

    # -- batches --------------------------------------------------------------------

    def put_many(self, items: Mapping[Key, Any] | Iterable[tuple[Key, Any]], *, dtype: str | None = None) -> None:
        """Put every (prefix_hash, kv) pair; all are validated before any is stored."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        prepared = []
        for prefix_hash, kv in pairs:
            spec, arr = spec_of(kv, dtype)
            prepared.append((self._key(prefix_hash), spec, arr))
        self._check_open()
        for key, spec, arr in prepared:
            self._put_local(key, spec, byte_view(arr))

    def get_many(self, prefix_hashes: Sequence[Key], *, layers: Any = None,
                 outs: Sequence[Any] | None = None) -> list[np.ndarray | None]:
        """``get`` for each key (None for each miss); ``outs`` gives one ``out=`` buffer per key."""
        self._check_open()
        keys = [self._key(h) for h in prefix_hashes]
        return [self._get_local(k, layers, out) for k, out in zip(keys, self._outs(keys, outs))]

    @staticmethod
    def _outs(keys: Sequence[bytes], outs: Sequence[Any] | None) -> Sequence[Any]:
        if outs is None:
            return [None] * len(keys)
        if len(outs) != len(keys):
            raise errors.OutBufferError(f"{len(outs)} out buffers for {len(keys)} keys")
        return outs

    def exists_many(self, prefix_hashes: Sequence[Key]) -> list[bool]:
        self._check_open()
        return [self._key(h) in self._manager for h in prefix_hashes]

    # -- asyncio twins -----------------------------------------------------------------

    async def aput(self, prefix_hash: Key, kv: Any, *, dtype: str | None = None) -> None:
        await asyncio.to_thread(self.put, prefix_hash, kv, dtype=dtype)

    async def aget(self, prefix_hash: Key, *, layers: Any = None, out: Any = None) -> np.ndarray | None:
        return await asyncio.to_thread(self.get, prefix_hash, layers=layers, out=out)

    async def aexists(self, prefix_hash: Key) -> bool:
        return await asyncio.to_thread(self.exists, prefix_hash)

    async def alookup(self, prefix_hashes: Sequence[Key]) -> int:
        return await asyncio.to_thread(self.lookup, prefix_hashes)

    async def iter_layers(self, prefix_hash: Key, *, layers: Any = None,
                          out: Any = None) -> AsyncIterator[tuple[int, np.ndarray]]:
        """Yield ``(layer, array)`` in order; layer i+1 is read while the caller uses layer i.

        The object stays pinned for the whole iteration, so all layers come from
        one version. Yields nothing on a miss; raises ChecksumError if a layer
        turns out corrupt after earlier layers were handed out (they cannot be
        taken back, so this is not silently a miss).
        """
        self._check_open()
        obj = self._manager.pin(self._key(prefix_hash))
        if obj is None:
            return
        nbytes = 0
        try:
            layer_range = LayerRange.resolve(layers, obj.spec.layers)
            arr, _ = self._out_view(obj.spec, layer_range, out)
            async for i in _pipelined(obj, layer_range, arr):
                nbytes += obj.spec.layer_nbytes
                yield layer_range.start + i, arr[i]
        finally:
            self._manager.unpin(obj, bytes_read=nbytes)

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
        """Flush what must survive (the nvme index) and release every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._metrics is not None:
            self._metrics.close()
        self._manager.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # interpreter shutdown: nothing useful to report
                pass


async def _pipelined(obj: PinnedObject, layer_range: LayerRange, arr: np.ndarray) -> AsyncIterator[int]:
    """Read layer i+1 in a worker thread while layer i is handed out; yields indices."""
    def read(i: int) -> None:
        layer = layer_range.start + i
        obj.read_layers(LayerRange(layer, layer + 1), byte_view(arr[i]))

    pending = asyncio.ensure_future(asyncio.to_thread(read, 0))
    try:
        for i in range(layer_range.count):
            await pending
            if i + 1 < layer_range.count:
                pending = asyncio.ensure_future(asyncio.to_thread(read, i + 1))
            yield i
    finally:
        if not pending.done():
            await asyncio.wait([pending])
