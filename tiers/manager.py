"""The tier manager: placement, eviction (demotion), promotion, pinning.

Owns the local key index (key -> tier, extent, header) over an ordered list of
tiers, fastest first. It decides where a put lands, which objects move down
when a tier fills, and which move up when they turn hot; the tiers only copy
bytes. It knows nothing of the master or the network.

Invariants:

- A tier never holds more than its capacity (the tiers' allocators are exact).
- An object is visible only once its bytes are completely written (and, for
  persistent tiers, committed to their index).
- An object pinned by a reader is neither evicted, demoted, promoted nor
  freed until the reader unpins it; a delete or overwrite of a pinned object
  hides it at once and frees its space on the last unpin.

Concurrency: one lock guards the index, the policies and the allocators'
callers. Bulk copies of a put and of a read run outside the lock; demotions and
promotions copy under it (they are rarer than reads and must not race).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from kvpool import errors
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec, layer_checksums
from tiers.base import Extent, Tier
from tiers.policy import make_policy

log = logging.getLogger(__name__)

MISS_REASONS = ("absent", "checksum")


@dataclass
class _Entry:
    key: bytes
    tier: int
    extent: Extent
    header: ObjectHeader
    pins: int = 0
    doomed: bool = False  # deleted or overwritten while pinned: free on last unpin
    lower_hits: int = 0  # hits since it landed in a tier below the top


@dataclass(frozen=True)
class PinnedObject:
    """A read-pinned object: its bytes stay put until ``TierManager.unpin``."""

    key: bytes
    header: ObjectHeader
    tier: Tier
    extent: Extent
    _entry: _Entry = field(repr=False, compare=False)

    @property
    def spec(self) -> ObjectSpec:
        return self.header.spec

    def read_layers(self, layer_range: LayerRange, out: Any) -> None:
        """Copy the layers into ``out`` (verified where the tier can rot)."""
        self.tier.read_layers(self.extent, self.header, layer_range, out)

    def view_layers(self, layer_range: LayerRange) -> memoryview | None:
        """Zero-copy view of the layers in tier memory, or None if the tier has none."""
        if not self.tier.supports_views:
            return None
        rng = self.header.spec.layer_bytes(layer_range)
        return self.tier.view(self.extent, rng.offset, rng.nbytes)


class ManagerListener(Protocol):
    """Told of every change to the index (called with the manager's lock held: keep it cheap)."""

    def stored(self, key: bytes, tier: Tier, extent: Extent, header: ObjectHeader) -> None: ...

    def moved(self, key: bytes, tier: Tier, extent: Extent, header: ObjectHeader) -> None: ...

    def removed(self, key: bytes, reason: str) -> None: ...


class TierManager:
    """Places objects in ``tiers`` (fastest first) and moves them between them."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        put_enabled: Sequence[bool] | None = None,
        policy: str = "lru",
        promote: bool = True,
        promote_min_hits: int = 2,
    ) -> None:
        if not tiers:
            raise errors.ConfigError("at least one tier needs a capacity above 0")
        self.tiers = list(tiers)
        self.put_enabled = list(put_enabled) if put_enabled is not None else [True] * len(tiers)
        if not any(self.put_enabled):
            raise errors.ConfigError("no tier accepts puts (every tiers.*.put is false)")
        self.policies = [make_policy(policy, t.capacity_bytes) for t in self.tiers]
        self._hit_counters = [f"hits_{t.name}" for t in self.tiers]
        self.promote_enabled = promote
        self.promote_min_hits = promote_min_hits
        self._index: dict[bytes, _Entry] = {}
        self._lock = threading.RLock()
        self.counters: Counter[str] = Counter()
        self.closed = False
        #: told of puts, moves and removals (the cluster node publishes them)
        self.listener: ManagerListener | None = None
        #: asked before the bottom tier drops an object; False keeps it (a remote reader holds a lease)
        self.may_drop: Callable[[bytes], bool] | None = None
        self._recover()

    # -- lookup ---------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def header(self, key: bytes) -> ObjectHeader | None:
        entry = self._index.get(key)
        return entry.header if entry else None

    # -- put ------------------------------------------------------------------

    def put(self, key: bytes, spec: ObjectSpec, payload: memoryview) -> str:
        """Store an object (payload = layer-major bytes); returns the tier it landed in.

        Raises ObjectTooLargeError if no put-enabled tier could ever hold it,
        PoolFullError if every candidate tier is full of pinned objects.
        """
        self._check_open()
        nbytes = spec.total_nbytes
        if len(payload) != spec.payload_nbytes:
            raise errors.InvalidKVError(f"payload is {len(payload)} bytes, spec needs {spec.payload_nbytes}")
        if not any(on and t.fits_ever(nbytes) for on, t in zip(self.put_enabled, self.tiers)):
            largest = max(t.capacity_bytes for on, t in zip(self.put_enabled, self.tiers) if on)
            raise errors.ObjectTooLargeError(
                f"object of {nbytes} bytes is larger than every tier that takes puts (largest {largest})"
            )
        with self._lock:
            index, extent = self._place(nbytes)
        tier = self.tiers[index]
        try:
            header = self._write_new(tier, extent, key, spec, payload)
            tier.commit(key, extent, header)
        except BaseException:
            with self._lock:
                tier.free(extent)
            raise
        with self._lock:
            old = self._index.get(key)
            if old is not None:
                self._unindex(old, keep_persistent_record=old.tier == index, reason=None)
            self._index[key] = _Entry(key, index, extent, header)
            self.policies[index].insert(key, nbytes)
            if self.listener is not None:
                self.listener.stored(key, tier, extent, header)
            self.counters["puts"] += 1
            self.counters["bytes_put"] += spec.payload_nbytes
        return tier.name

    @staticmethod
    def _write_new(tier: Tier, extent: Extent, key: bytes, spec: ObjectSpec, payload: memoryview) -> ObjectHeader:
        if tier.supports_views:
            # Copy once into tier memory, then hash the copy: the checksums then
            # describe exactly the bytes stored, and no staging buffer is needed.
            dest = tier.view(extent, spec.header_nbytes, spec.payload_nbytes)
            dest[:] = payload
            header = ObjectHeader.for_key(key, spec, layer_checksums(dest, spec.layer_nbytes))
            tier.write(extent, 0, header.pack())
            return header
        header = ObjectHeader.for_key(key, spec, layer_checksums(payload, spec.layer_nbytes))
        tier.write_object(extent, header, payload)
        return header

    def _place(self, nbytes: int) -> tuple[int, Extent]:
        """Allocate in the highest put-enabled tier that has (or can make) room."""
        for index, tier in enumerate(self.tiers):
            if not self.put_enabled[index] or not tier.fits_ever(nbytes):
                continue
            extent = self._allocate_making_room(index, nbytes)
            if extent is not None:
                return index, extent
        raise errors.PoolFullError(f"no room for {nbytes} bytes: every tier is full of pinned objects")

    def _allocate_making_room(self, index: int, nbytes: int) -> Extent | None:
        tier, policy = self.tiers[index], self.policies[index]
        is_pinned = self._is_pinned
        if index == len(self.tiers) - 1 and self.may_drop is not None:
            may_drop = self.may_drop
            is_pinned = lambda key: self._is_pinned(key) or not may_drop(key)  # noqa: E731
        while (extent := tier.allocate(nbytes)) is None:
            victim = policy.victim(is_pinned)
            if victim is None:
                return None
            self._demote(self._index[victim])
        return extent

    def _is_pinned(self, key: bytes) -> bool:
        return self._index[key].pins > 0

    # -- movement between tiers -------------------------------------------------

    def _demote(self, entry: _Entry) -> None:
        """Move an (already policy-removed) object one tier down, or drop it from the bottom."""
        nbytes = entry.header.spec.total_nbytes
        for lower in range(entry.tier + 1, len(self.tiers)):
            if not self.tiers[lower].fits_ever(nbytes):
                continue
            try:
                extent = self._allocate_making_room(lower, nbytes)
                if extent is None:
                    continue
                self._move(entry, lower, extent)
            except errors.DiskFullError as exc:  # treat as no room below; never fail the put
                log.warning("demotion of %s to %s failed: %s", entry.key.hex(), self.tiers[lower].name, exc)
                continue
            self.counters["demotions"] += 1
            return
        self._unindex(entry, policy_removed=True, reason="evicted")
        self.counters["evictions"] += 1

    def _move(self, entry: _Entry, dest_index: int, extent: Extent) -> None:
        src, dest = self.tiers[entry.tier], self.tiers[dest_index]
        header = entry.header
        try:
            if src.supports_views:
                payload = src.view(entry.extent, header.nbytes, header.spec.payload_nbytes)
            else:
                buf = bytearray(header.spec.payload_nbytes)
                src.read_layers(entry.extent, header, LayerRange(0, header.spec.layers), buf)
                payload = memoryview(buf)
            dest.write_object(extent, header, payload)
            dest.commit(entry.key, extent, header)
        except BaseException:
            dest.free(extent)
            raise
        src.forget(entry.key, entry.extent)
        src.free(entry.extent)
        entry.tier, entry.extent, entry.lower_hits = dest_index, extent, 0
        self.policies[dest_index].insert(entry.key, header.spec.total_nbytes)
        if self.listener is not None:
            self.listener.moved(entry.key, dest, extent, header)

    def _maybe_promote(self, entry: _Entry) -> None:
        """Copy a hot object from a lower tier up to the highest put-enabled tier (lock held)."""
        if entry.pins or entry.doomed or self._index.get(entry.key) is not entry:
            return
        target = next((i for i in range(entry.tier) if self.put_enabled[i]), None)
        if target is None:
            return
        nbytes = entry.header.spec.total_nbytes
        if not self.tiers[target].fits_ever(nbytes):
            return
        entry.pins += 1  # making room above may demote into this object's tier: keep it put
        try:
            extent = self._allocate_making_room(target, nbytes)
        finally:
            entry.pins -= 1
        if extent is None:
            return
        self.policies[entry.tier].remove(entry.key)
        try:
            self._move(entry, target, extent)
        except errors.KVPoolError as exc:
            log.warning("promotion of %s failed: %s", entry.key.hex(), exc)
            self._unindex(entry, policy_removed=True, reason="error")
            return
        self.counters["promotions"] += 1

    # -- read -----------------------------------------------------------------

    def pin(self, key: bytes) -> PinnedObject | None:
        """Pin an object for reading, or None on a miss. Always pair with ``unpin``."""
        self._check_open()
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self.counters["miss_absent"] += 1
                return None
            entry.pins += 1
            self.policies[entry.tier].touch(key)
            self.counters[self._hit_counters[entry.tier]] += 1
            if entry.tier > 0:
                entry.lower_hits += 1
            return PinnedObject(key, entry.header, self.tiers[entry.tier], entry.extent, entry)

    def unpin(self, obj: PinnedObject, *, bytes_read: int = 0) -> None:
        with self._lock:
            entry = obj._entry
            entry.pins -= 1
            self.counters["bytes_got"] += bytes_read
            if entry.pins == 0 and entry.doomed:
                self.tiers[entry.tier].free(entry.extent)
            elif (self.promote_enabled and entry.tier > 0 and entry.pins == 0
                  and entry.lower_hits >= self.promote_min_hits and not self.closed):
                self._maybe_promote(entry)

    def discard_corrupt(self, obj: PinnedObject) -> None:
        """Drop an object whose bytes failed their checksum (counted as a miss)."""
        with self._lock:
            self.counters["miss_checksum"] += 1
            self.counters[f"hits_{obj.tier.name}"] -= 1
            entry = obj._entry
            if self._index.get(entry.key) is entry:
                log.warning("dropping %s from %s: checksum mismatch", entry.key.hex(), obj.tier.name)
                self._unindex(entry, reason="checksum")

    # -- delete ---------------------------------------------------------------

    def delete(self, key: bytes) -> None:
        """Remove an object; KeyNotFoundError if absent. Readers in flight finish first."""
        self._check_open()
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                raise errors.KeyNotFoundError(key)
            self._unindex(entry, reason="deleted")
            self.counters["deletes"] += 1

    def _unindex(self, entry: _Entry, *, reason: str | None, policy_removed: bool = False,
                 keep_persistent_record: bool = False) -> None:
        """Hide an entry now; free its space now or, if pinned, on its last unpin.

        ``reason`` is told to the listener; None when a new version replaces it.
        """
        if self._index.get(entry.key) is entry:
            del self._index[entry.key]
            if reason is not None and self.listener is not None:
                self.listener.removed(entry.key, reason)
        if not policy_removed:
            self.policies[entry.tier].remove(entry.key)
        tier = self.tiers[entry.tier]
        if not keep_persistent_record:
            # The persistent record would resurrect the key after a restart.
            tier.forget(entry.key, entry.extent)
        if entry.pins:
            entry.doomed = True
        else:
            tier.free(entry.extent)

    # -- lifecycle ----------------------------------------------------------------

    def _recover(self) -> None:
        for index, tier in enumerate(self.tiers):
            for key, extent, header in tier.recover():
                if key in self._index:  # found in two tiers (crash mid-move): keep the upper copy
                    tier.forget(key, extent)
                    tier.free(extent)
                    continue
                self._index[key] = _Entry(key, index, extent, header)
                self.policies[index].insert(key, header.spec.total_nbytes)
                self.counters["recovered"] += 1

    def describe(self, key: bytes) -> tuple[Tier, Extent, ObjectHeader] | None:
        """Where an object lives now (may change as soon as the lock is released)."""
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else (self.tiers[entry.tier], entry.extent, entry.header)

    def snapshot(self) -> list[tuple[bytes, Tier, Extent, ObjectHeader]]:
        """Every object with its tier, extent and header, taken under the lock."""
        with self._lock:
            return [(k, self.tiers[e.tier], e.extent, e.header) for k, e in self._index.items()]

    def tier_stats(self) -> list[dict[str, Any]]:
        with self._lock:
            objects = Counter(e.tier for e in self._index.values())
            out = []
            for index, tier in enumerate(self.tiers):
                out.append({**tier.stats(), "objects": objects[index], "put_enabled": self.put_enabled[index],
                            "hits": self.counters[f"hits_{tier.name}"]})
            return out

    def _check_open(self) -> None:
        if self.closed:
            raise errors.PoolClosedError("the pool is closed")

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for tier in self.tiers:
                tier.close()
