"""The embedded ``Pool``: kvpool's API over local tiers.

Owns the local read and write paths through the tier manager (build, put, get,
pin for layer-wise reads). The shared surface (validation, asyncio twins, the
layer pipeline, metrics) is :class:`kvpool.api.PoolAPI`; placement and
eviction are :mod:`tiers.manager`'s. The cluster client composes a ``Pool``
with its view of the cluster (:class:`kvpool.client.ClusterPool`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.api import Key, LayerSource, PoolAPI, timed
from kvpool.config import EMBEDDED_POOL, Config, settings_for
from kvpool.objformat import LayerRange, ObjectSpec, byte_view, spec_of
from tiers import TIER_ORDER, tier_class
from tiers.entries import PinnedObject
from tiers.manager import TierManager

log = logging.getLogger(__name__)

__all__ = ["EMBEDDED_POOL", "Pool", "PinnedLayers", "build_tier_manager"]


# The pools open in this process, by (name, data dir): a second open of one of them is this
# process's doing, and its error says so.
_open_here: Counter[tuple[str, str]] = Counter()
_open_here_lock = threading.Lock()


def pool_identity(config: Config) -> tuple[str, str]:
    return config.pool.name, str(config.pool.resolved_data_dir().resolve())


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
                if _open_here[pool_identity(config)] > 0:
                    raise errors.PoolLockedError(
                        f"pool {config.pool.name!r} (data_dir {config.pool.data_dir}) is already open in this "
                        f"process (pid {os.getpid()}): use that Pool (it is thread-safe) or close it first, or give "
                        f"this one its own pool.name") from None
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


class PinnedLayers:
    """A local object pinned for a layer-wise read (:class:`kvpool.api.LayerSource`)."""

    def __init__(self, manager: TierManager, obj: PinnedObject) -> None:
        self.manager, self.obj = manager, obj
        self.spec = obj.spec

    def read(self, layer_range: LayerRange, buf: memoryview) -> None:
        try:
            self.obj.read_layers(layer_range, buf)
        except errors.ChecksumError:
            self.manager.discard_corrupt(self.obj)  # no later reader gets these bytes either
            raise

    def done(self, nbytes_read: int) -> None:
        self.manager.unpin(self.obj, bytes_read=nbytes_read)


class Pool(PoolAPI):
    """A KV-cache pool over local tiers (hbm, dram, cxl, nvme).

    ``Pool()`` opens the defaults (``kvpool-server --print-defaults`` lists them) as pool ``embedded``;
    ``Pool(config="my.toml")`` or ``Pool(config=Config(...))`` overrides them.
    Thread-safe: any number of threads may share one pool.
    """

    def __init__(self, config: str | Config | Mapping[str, Any] | None = None) -> None:
        # No pool named (in any form of settings): pool "embedded", never the one a kvpool-server
        # on this host opens with the same defaults (see kvpool.config.settings_for).
        super().__init__(settings_for(config, process="embedded"))
        self.manager = build_tier_manager(self.config)
        self._identity = pool_identity(self.config)
        with _open_here_lock:
            _open_here[self._identity] += 1
        log.info("kvpool %r: tiers %s", self.config.pool.name,
                 ", ".join(f"{t.name} {t.capacity_bytes} B" for t in self.manager.tiers))

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
        self.put_object(key, spec, byte_view(arr))

    def put_object(self, key: bytes, spec: ObjectSpec, payload: memoryview) -> str:
        """Store a validated object; returns the tier it landed in."""
        return self.manager.put(key, spec, payload)

    @timed("get")
    def get(self, prefix_hash: Key, *, layers: Any = None, out: Any = None) -> np.ndarray | None:
        """The object (or only ``layers``: int, range, slice or (start, stop)), or None on a miss.

        With ``out=`` (a numpy array of the right shape, or a writable buffer of
        the right size) the bytes land there and ``out`` is returned as an array.
        Bytes that fail their checksum are dropped and reported as a miss, never
        returned. Raises LayerRangeError / OutBufferError for bad arguments.
        """
        self._check_open()
        return self.get_object(self._key(prefix_hash), layers, out)

    def get_object(self, key: bytes, layers: Any, out: Any) -> np.ndarray | None:
        """``get`` of a validated key from the local tiers."""
        obj = self.manager.pin(key)
        if obj is None:
            return None
        nbytes = 0
        try:
            layer_range = LayerRange.resolve(layers, obj.spec.layers)
            arr, buf = self._out_view(obj.spec, layer_range, out)
            try:
                obj.read_layers(layer_range, buf)
            except errors.ChecksumError:
                self.manager.discard_corrupt(obj)
                return None
            nbytes = len(buf)
            return arr
        finally:
            self.manager.unpin(obj, bytes_read=nbytes)

    def pin_layers(self, key: bytes) -> PinnedLayers | None:
        """The local object pinned for a layer-wise read, or None if it is not here."""
        obj = self.manager.pin(key)
        return None if obj is None else PinnedLayers(self.manager, obj)

    def _layer_source(self, key: bytes) -> LayerSource | None:
        return self.pin_layers(key)

    def delete(self, prefix_hash: Key) -> None:
        """Remove an object; raises KeyNotFoundError if it is not cached."""
        self._check_open()
        self.manager.delete(self._key(prefix_hash))

    def stats(self) -> dict[str, Any]:
        """Tiers (capacity, usage, objects, hits), counters, misses by reason."""
        self._check_open()
        counters = dict(self.manager.counters)
        tiers = self.manager.tier_stats()
        return {
            "pool": self.config.pool.name,
            "role": "embedded",
            "objects": len(self.manager),
            "tiers": {t["tier"]: t for t in tiers},
            "hits": sum(t["hits"] for t in tiers),
            "misses": {reason: counters.get(f"miss_{reason}", 0) for reason in ("absent", "checksum")},
            "counters": counters,
        }

    # -- batches --------------------------------------------------------------------

    def put_many(self, items: Mapping[Key, Any] | Iterable[tuple[Key, Any]], *, dtype: str | None = None) -> None:
        """Put every (prefix_hash, kv) pair; all are validated before any is stored."""
        prepared = self.prepare_many(items, dtype)
        self._check_open()
        for key, spec, payload in prepared:
            self.put_object(key, spec, payload)

    def prepare_many(self, items: Mapping[Key, Any] | Iterable[tuple[Key, Any]],
                     dtype: str | None) -> list[tuple[bytes, ObjectSpec, memoryview]]:
        """Validate every (prefix_hash, kv) pair: (key, spec, payload) each, or raise."""
        pairs = items.items() if isinstance(items, Mapping) else items
        prepared = []
        for prefix_hash, kv in pairs:
            spec, arr = spec_of(kv, dtype)
            prepared.append((self._key(prefix_hash), spec, byte_view(arr)))
        return prepared

    def get_many(self, prefix_hashes: Sequence[Key], *, layers: Any = None, outs: Sequence[Any] | None = None,
                 landed: Callable[[int, np.ndarray | None], None] | None = None) -> list[np.ndarray | None]:
        """``get`` for each key (see :meth:`PoolAPI.get_many`)."""
        self._check_open()
        keys = [self._key(h) for h in prefix_hashes]
        results = []
        for i, (key, layer, out) in enumerate(zip(keys, self._layers_each(keys, layers), self._outs(keys, outs))):
            results.append(self.get_object(key, layer, out))
            if landed is not None:
                landed(i, results[-1])
        return results

    def exists_many(self, prefix_hashes: Sequence[Key]) -> list[bool]:
        self._check_open()
        return [self._key(h) in self.manager for h in prefix_hashes]

    def _close(self) -> None:
        with _open_here_lock:
            _open_here[self._identity] -= 1
            if _open_here[self._identity] <= 0:
                del _open_here[self._identity]
        self.manager.close()
