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
- Promotion out of a persistent tier *copies*: the persistent copy stays as the
  object's backing until its tier needs the space, so reading an nvme object
  never makes it volatile. Demoting an object that has a backing copy only
  frees the upper copy.
- A full disk is capacity, not failure: DiskFullError from a tier (which then
  lowers its effective capacity) makes the manager evict and retry, so the
  newest objects are the ones that survive.
- A durable copy (``put(persistent=True)``, or named by ``protect`` after a
  restart) is never evicted to make room: its persistent copy is in no eviction
  policy, so a persistent tier full of durable copies refuses new puts
  (PoolFullError) instead. It goes only by ``delete``, an overwrite, or a read
  that finds it corrupt or gone (counted in ``durable_dropped`` and logged).

Concurrency: one lock guards the index, the policies and the allocators'
callers. Bulk copies of a put and of a read run outside the lock; demotions and
promotions copy under it (they are rarer than reads and must not race). No
remote call ever runs under the lock: when the bottom tier must drop objects
and a ``may_drop_many`` hook is set (the cluster node asks the master whether a
remote reader holds a lease), victims are chosen under the lock, the hook is
asked once for the batch outside it, and under the lock again only the
victims that are still the same unpinned objects are dropped. The UCX progress
thread only ever *tries* the lock (``pin(blocking=False)``), so it never waits
on a copy.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvpool import errors
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec, copy_layer_checksums, layer_checksums
from tiers.base import Extent, Tier
from tiers.entries import Entry, LockBusy, ManagerListener, NeedsApproval, PinnedObject, largest_fit
from tiers.policy import make_policy

log = logging.getLogger(__name__)

MISS_REASONS = ("absent", "checksum")


_APPROVAL_ROUNDS = 8  # rounds of "propose victims, ask outside the lock" before PoolFullError
_DISK_FULL_RETRIES = 4


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
        self._index: dict[bytes, Entry] = {}
        self._lock = threading.RLock()
        self.counters: Counter[str] = Counter()
        self.closed = False
        #: told of puts, moves and removals (the cluster node publishes them)
        self.listener: ManagerListener | None = None
        #: asked (outside the lock, one batch at a time) before the bottom tier drops objects;
        #: returns the keys that may go (the others are leased by a remote reader and stay)
        self.may_drop_many: Callable[[list[bytes]], set[bytes]] | None = None
        self._disk_full_warned: set[str] = set()
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

    def put(self, key: bytes, spec: ObjectSpec, payload: memoryview, *, persistent: bool = False,
            shared: bool = False) -> str:
        """Store an object (payload = layer-major bytes); returns the tier it landed in.

        ``persistent=True`` places it only in a tier that survives a restart
        (nvme), for durable copies. ``shared=True`` tries a shared-memory tier (a cxl arena,
        which other processes on this host read in place) before the tiers above it, for
        objects kept for the engines beside this node (a departing engine's hand-off).
        Raises ObjectTooLargeError if no candidate tier could ever hold it (CapacityError if
        ``persistent`` and there is no persistent tier), PoolFullError if every candidate tier
        is full of pinned or leased objects.
        """
        self._check_open()
        nbytes = spec.total_nbytes
        if len(payload) != spec.payload_nbytes:
            raise errors.InvalidKVError(f"payload is {len(payload)} bytes, spec needs {spec.payload_nbytes}")
        candidates = self._candidates(persistent)
        if shared:
            candidates.sort(key=lambda i: self.tiers[i].arena_info() is None)  # stable: tier order otherwise
        if not any(self.tiers[i].fits_ever(nbytes) for i in candidates):
            limits = ", ".join(f"{self.tiers[i].name} up to {largest_fit(self.tiers[i])} bytes" for i in candidates)
            raise errors.ObjectTooLargeError(
                f"object of {nbytes} bytes ({nbytes / (1 << 20):.1f} MiB with its header) does not fit any tier "
                f"that takes puts: {limits} (each tier's capacity less its per-object overhead; raise "
                f"tiers.<name>.capacity, or tiers.nvme.segment_size for nvme)")
        for attempt in range(_DISK_FULL_RETRIES):
            index, extent = self._place_outside_lock(nbytes, candidates)
            tier = self.tiers[index]
            try:
                header = self._write_new(tier, extent, key, spec, payload)
                tier.commit(key, extent, header)
            except errors.DiskFullError as exc:
                with self._lock:
                    tier.free(extent)
                self._warn_disk_full(tier, exc)
                if attempt + 1 == _DISK_FULL_RETRIES:
                    raise
                continue  # the tier lowered its capacity: placing again evicts to fit
            except BaseException:
                with self._lock:
                    tier.free(extent)
                raise
            break
        with self._lock:
            old = self._index.get(key)
            if old is not None:
                self._unindex(old, keep_persistent_record=index in (old.tier, (old.backing or (-1,))[0]),
                              reason=None)
            entry = self._index[key] = Entry(key, index, extent, header, durable=persistent)
            if not entry.durable:
                self.policies[index].insert(key, nbytes)
            if self.listener is not None:
                self.listener.stored(key, tier, extent, header)
            self.counters["puts"] += 1
            self.counters["bytes_put"] += spec.payload_nbytes
        return tier.name

    def protect(self, keys: Sequence[bytes]) -> int:
        """Mark the objects of ``keys`` that have a persistent copy as durable (after a restart:
        the keys the node's ``durable.log`` names), so they are never evicted for room; returns
        how many were marked."""
        marked = 0
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                if entry is None or entry.durable:
                    continue
                if self.tiers[entry.tier].persistent:
                    where = entry.tier
                elif entry.backing is not None:
                    where = entry.backing[0]
                else:
                    continue
                entry.durable = True
                self.policies[where].remove(key)
                marked += 1
        return marked

    def is_durable(self, key: bytes) -> bool:
        """Is ``key`` held as a durable copy (see :meth:`protect`)?"""
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and entry.durable

    def durable_keys(self) -> set[bytes]:
        """Every key held as a durable copy (:meth:`is_durable`), in one pass under the lock."""
        with self._lock:
            return {key for key, entry in self._index.items() if entry.durable}

    def _candidates(self, persistent: bool) -> list[int]:
        if persistent:
            found = [i for i, t in enumerate(self.tiers) if t.persistent]
            if not found:
                raise errors.CapacityError("no persistent tier (nvme) here for a durable copy")
            return found
        return [i for i, on in enumerate(self.put_enabled) if on]

    def _warn_disk_full(self, tier: Tier, exc: BaseException) -> None:
        if tier.name not in self._disk_full_warned:
            self._disk_full_warned.add(tier.name)
            # The tier itself warns once, naming its directory and real capacity.
            log.info("%s: the filesystem is full (%s); capacity now %d bytes, evicting to make room",
                     tier.name, exc, tier.capacity_bytes)

    @staticmethod
    def _write_new(tier: Tier, extent: Extent, key: bytes, spec: ObjectSpec, payload: memoryview) -> ObjectHeader:
        if tier.supports_views:
            # Copy once into tier memory, hashing the copy as it is made: the checksums
            # then describe exactly the bytes stored, and no staging buffer is needed.
            dest = tier.view(extent, spec.header_nbytes, spec.payload_nbytes)
            header = ObjectHeader.for_key(key, spec, copy_layer_checksums(dest, payload, spec.layer_nbytes))
            tier.write(extent, 0, header.packed)
            return header
        header = ObjectHeader.for_key(key, spec, layer_checksums(payload, spec.layer_nbytes))
        tier.write_object(extent, header, payload)
        return header

    def _place_outside_lock(self, nbytes: int, candidates: list[int]) -> tuple[int, Extent]:
        """Allocate for a put; takes the lock itself and asks ``may_drop_many`` between rounds."""
        for _ in range(_APPROVAL_ROUNDS):
            with self._lock:
                try:
                    return self._place(nbytes, candidates)
                except NeedsApproval as need:
                    proposals = need.entries
            self._drop_approved(proposals, self._ask_may_drop([e.key for e in proposals]))
        raise errors.PoolFullError(f"no room for {nbytes} bytes: the bottom tier is full of leased objects")

    def _place(self, nbytes: int, candidates: list[int]) -> tuple[int, Extent]:
        """Allocate in the first candidate tier that has (or can make) room (lock held)."""
        for index in candidates:
            if not self.tiers[index].fits_ever(nbytes):
                continue
            extent = self._allocate_making_room(index, nbytes)
            if extent is not None:
                return index, extent
        raise errors.PoolFullError(f"no room for {nbytes} bytes: every tier is full of pinned objects")

    def _ask_may_drop(self, keys: list[bytes]) -> set[bytes]:
        """The hook's answer for a batch of victims, asked without the lock."""
        hook = self.may_drop_many
        if hook is None:
            return set(keys)
        try:
            return set(hook(keys))
        except Exception as exc:  # a cache must make room; readers verify and fall back
            log.debug("may_drop_many failed (%s): dropping %d victims", exc, len(keys))
            return set(keys)

    def _drop_approved(self, proposals: list[Entry], allowed: set[bytes]) -> None:
        """Drop the approved victims that are still the same, unpinned, bottom-tier objects."""
        bottom = len(self.tiers) - 1
        with self._lock:
            for entry in proposals:
                if entry.key not in allowed:
                    continue  # leased: it stays (it went back into the policy when proposed)
                current = self._index.get(entry.key) is entry
                if not current or entry.pins or entry.tier != bottom or entry.doomed:
                    if current and self.listener is not None:
                        # Allowing told the master it is gone; it is still here: say so again.
                        self.listener.moved(entry.key, self.tiers[entry.tier], entry.extent, entry.header)
                    continue
                self.policies[bottom].remove(entry.key)
                self._unindex(entry, policy_removed=True, reason="evicted")
                self.counters["evictions"] += 1

    def _allocate_making_room(self, index: int, nbytes: int) -> Extent | None:
        """An extent in tier ``index``, demoting (or dropping) its coldest objects for room.

        None when everything left is pinned. Raises NeedsApproval (after putting
        the proposed victims back into the policy) when the bottom tier must drop
        objects and the ``may_drop_many`` hook has to be asked first.
        """
        tier, policy = self.tiers[index], self.policies[index]
        ask = index == len(self.tiers) - 1 and self.may_drop_many is not None
        proposals: list[Entry] = []
        proposed_bytes = 0
        needed = tier.allocated_size(nbytes)

        def is_pinned(key: bytes) -> bool:
            entry = self._index[key]
            return entry.pins > 0 and entry.tier == index  # a backing copy is never read

        extent = None
        while True:
            try:
                extent = tier.allocate(nbytes)
            except errors.DiskFullError as exc:  # the tier lowered its capacity: evict to fit
                self._warn_disk_full(tier, exc)
                extent = None
            if extent is not None:
                break
            if proposals and proposed_bytes + tier.free_bytes >= needed:
                break
            victim = policy.victim(is_pinned)
            if victim is None:
                break
            entry = self._index[victim]
            if entry.tier != index:
                self._drop_backing(entry)
            elif ask:
                proposals.append(entry)
                proposed_bytes += tier.allocated_size(entry.header.spec.total_nbytes)
            else:
                self._demote(entry)
        for entry in proposals:  # they stay until the master agrees
            policy.insert(entry.key, entry.header.spec.total_nbytes)
        if extent is None and proposals:
            raise NeedsApproval(proposals)
        return extent

    def _is_pinned(self, key: bytes) -> bool:
        return self._index[key].pins > 0

    # -- movement between tiers -------------------------------------------------

    def _demote(self, entry: Entry) -> None:
        """Move an (already policy-removed) object one tier down, or drop it from the bottom."""
        nbytes = entry.header.spec.total_nbytes
        if entry.backing is not None:  # a persistent copy below already holds these bytes
            self._fall_back_to_backing(entry)
            self.counters["demotions"] += 1
            return
        for lower in range(entry.tier + 1, len(self.tiers)):
            if not self.tiers[lower].fits_ever(nbytes):
                continue
            moved = False
            for _ in range(_DISK_FULL_RETRIES):
                try:
                    extent = self._allocate_making_room(lower, nbytes)
                except NeedsApproval:
                    self.policies[entry.tier].insert(entry.key, nbytes)  # back in place this round
                    raise
                if extent is None:
                    break
                try:
                    self._move(entry, lower, extent)
                except errors.DiskFullError as exc:  # capacity lowered: evict below and retry
                    self._warn_disk_full(self.tiers[lower], exc)
                    continue
                moved = True
                break
            if moved:
                self.counters["demotions"] += 1
                return
        self._unindex(entry, policy_removed=True, reason="evicted")
        self.counters["evictions"] += 1

    def _fall_back_to_backing(self, entry: Entry) -> None:
        """Free the upper copy of an object that still has its persistent copy (lock held, unpinned)."""
        assert entry.backing is not None
        upper = self.tiers[entry.tier]
        upper.forget(entry.key, entry.extent)
        upper.free(entry.extent)
        entry.tier, entry.extent = entry.backing
        entry.backing, entry.lower_hits = None, 0
        if self.listener is not None:
            self.listener.moved(entry.key, self.tiers[entry.tier], entry.extent, entry.header)

    def _drop_backing(self, entry: Entry) -> None:
        """Give up the persistent copy of a promoted object (its tier needs the space)."""
        assert entry.backing is not None
        index, extent = entry.backing
        entry.backing = None
        self.tiers[index].forget(entry.key, extent)
        self.tiers[index].free(extent)
        self.counters["backing_dropped"] += 1

    def _move(self, entry: Entry, dest_index: int, extent: Extent) -> None:
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

    def share_copy(self, key: bytes) -> bool:
        """Keep a copy of ``key``'s object, now in a persistent tier, also in the shared-memory
        tier above it (a cxl arena, which other processes on this host read in place), the
        persistent copy staying its backing: a durable copy a storage node took is then read
        in place by the engines beside it instead of from disk. False, nothing changed: no such
        tier, the object is elsewhere or busy, or no room without asking the master (a
        best effort: the persistent copy is what counts)."""
        self._check_open()
        with self._lock:
            entry = self._index.get(key)
            if entry is None or not self.tiers[entry.tier].persistent:
                return False
            target = next((i for i in range(entry.tier)
                           if self.put_enabled[i] and self.tiers[i].arena_info() is not None), None)
            return target is not None and self._maybe_promote(entry, target)

    def _maybe_promote(self, entry: Entry, target: int | None = None) -> bool:
        """Copy a hot object from a lower tier up to ``target`` (default: the highest put-enabled
        tier), lock held; whether it did. Out of a persistent tier the copy there stays as the
        object's backing.
        """
        if entry.pins or entry.doomed or self._index.get(entry.key) is not entry:
            return False
        if target is None:
            target = next((i for i in range(entry.tier) if self.put_enabled[i]), None)
        if target is None:
            return False
        nbytes = entry.header.spec.total_nbytes
        if not self.tiers[target].fits_ever(nbytes):
            return False
        entry.pins += 1  # making room above may demote into this object's tier: keep it put
        try:
            extent = self._allocate_making_room(target, nbytes)
        except (NeedsApproval, errors.DiskFullError):
            return False  # no room without asking the master: not worth it for a promotion
        finally:
            entry.pins -= 1
        if extent is None:
            return False
        keep_copy = self.tiers[entry.tier].persistent and entry.backing is None
        if not keep_copy:
            self.policies[entry.tier].remove(entry.key)
        try:
            if keep_copy:
                self._copy_up(entry, target, extent)
            else:
                self._move(entry, target, extent)
        except errors.KVPoolError as exc:
            log.warning("promotion of %s failed: %s", entry.key.hex(), exc)
            if not keep_copy:
                self._unindex(entry, policy_removed=True, reason="error")
            return False
        self.counters["promotions"] += 1
        return True

    def _copy_up(self, entry: Entry, dest_index: int, extent: Extent) -> None:
        """Copy an object into a higher tier and keep its current (persistent) copy as backing."""
        src, dest = self.tiers[entry.tier], self.tiers[dest_index]
        header = entry.header
        try:
            buf = bytearray(header.spec.payload_nbytes)
            src.read_layers(entry.extent, header, LayerRange(0, header.spec.layers), buf)
            dest.write_object(extent, header, memoryview(buf))
            dest.commit(entry.key, extent, header)
        except BaseException:
            dest.free(extent)
            raise
        entry.backing = (entry.tier, entry.extent)
        entry.tier, entry.extent, entry.lower_hits = dest_index, extent, 0
        self.policies[dest_index].insert(entry.key, header.spec.total_nbytes)
        if self.listener is not None:
            self.listener.moved(entry.key, dest, extent, header)

    # -- read -----------------------------------------------------------------

    def pin(self, key: bytes, *, blocking: bool = True) -> PinnedObject | None:
        """Pin an object for reading, or None on a miss. Always pair with ``unpin``.

        ``blocking=False`` raises LockBusy instead of waiting for the lock (for
        threads that must never wait on a copy, like UCX progress).
        """
        self._check_open()
        if not self._lock.acquire(blocking=blocking):
            raise LockBusy("tier manager busy")
        try:
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
        finally:
            self._lock.release()

    def unpin(self, obj: PinnedObject, *, bytes_read: int = 0, blocking: bool = True) -> bool:
        """Release a pin. ``blocking=False`` returns False (nothing done) if the lock is taken,
        and never promotes (a promotion copies): call again from a thread that may wait."""
        if not self._lock.acquire(blocking=blocking):
            return False
        try:
            entry = obj._entry
            entry.pins -= 1
            self.counters["bytes_got"] += bytes_read
            if entry.pins == 0 and entry.doomed:
                self.tiers[entry.tier].free(entry.extent)
            elif (blocking and self.promote_enabled and entry.tier > 0 and entry.pins == 0
                  and entry.lower_hits >= self.promote_min_hits and not self.closed):
                self._maybe_promote(entry)
            return True
        finally:
            self._lock.release()

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

    def _unindex(self, entry: Entry, *, reason: str | None, policy_removed: bool = False,
                 keep_persistent_record: bool = False) -> None:
        """Hide an entry now; free its space now or, if pinned, on its last unpin.

        ``reason`` is told to the listener; None when a new version replaces it.
        """
        if self._index.get(entry.key) is entry:
            del self._index[entry.key]
            if entry.durable and reason not in (None, "deleted"):
                self.counters["durable_dropped"] += 1
                log.warning("durable copy of %s dropped (%s): the master re-replicates it from another holder if "
                            "one exists", entry.key[:32].hex(), reason)
            if reason is not None and self.listener is not None:
                self.listener.removed(entry.key, reason)
        if not policy_removed:
            self.policies[entry.tier].remove(entry.key)
        tier = self.tiers[entry.tier]
        if not keep_persistent_record:
            # The persistent record would resurrect the key after a restart.
            tier.forget(entry.key, entry.extent)
        if entry.backing is not None:
            backing_index, backing_extent = entry.backing
            entry.backing = None
            self.policies[backing_index].remove(entry.key)
            if not keep_persistent_record:
                self.tiers[backing_index].forget(entry.key, backing_extent)
            self.tiers[backing_index].free(backing_extent)
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
                self._index[key] = Entry(key, index, extent, header)
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
            objects.update(e.backing[0] for e in self._index.values() if e.backing is not None)
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
