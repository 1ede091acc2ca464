"""The ``Tier`` ABC and the extent allocator every tier shares.

A tier owns space and bytes: it allocates extents, copies object bytes in and
out, and (if persistent) remembers which key lives in which extent. It does not
know about other tiers, eviction order, or the master: the tier manager decides
what goes where, and calls a tier only with extents it allocated from it.

Objects are stored whole (header + layer-major payload, see
``kvpool.objformat``), so a layer range is one byte range of one extent.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvpool import errors
from kvpool.objformat import LayerRange, ObjectHeader


@dataclass(frozen=True, slots=True)
class Extent:
    """Where one object lives inside a tier: ``nbytes`` at ``offset`` of ``segment``."""

    segment: int
    offset: int
    nbytes: int


def close_mapping(region: Any) -> None:
    """Unmap an ``mmap``; if a caller still holds a view, the mapping dies with the view."""
    if region is None:
        return
    try:
        region.close()
    except BufferError:
        pass


def advise_huge_pages(region: Any) -> bool:
    """Ask for transparent huge pages on an ``mmap``; False where the kernel or Python cannot.
    A file mapping gets them only where its file system gives them (a tmpfs mounted with
    ``huge=always``, ``within_size``, or ``advise`` with this advice)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        region.madvise(advice)
        return True
    except (OSError, ValueError):
        return False


def mount_of(path: Any) -> tuple[str, str]:
    """(file system type, mount options) of the deepest mount holding ``path`` (/proc/mounts),
    or ``("", "")`` where it cannot be read."""
    real = os.path.realpath(path)
    best, found = "", ("", "")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mount_point = parts[1].replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, found = mount_point, (parts[2], parts[3])
    except OSError:
        pass
    return found


def tmpfs_huge_pages(path: Any) -> str:
    """The ``huge=`` option of the tmpfs mount holding ``path`` (``never`` when it has none, as
    ``/dev/shm`` usually has not), or ``""`` when ``path`` is not on a tmpfs (or /proc/mounts
    cannot be read)."""
    kind, options = mount_of(path)
    if kind != "tmpfs":
        return ""
    huge = [o.split("=", 1)[1] for o in options.split(",") if o.startswith("huge=")]
    return huge[-1] if huge else "never"


@functools.cache
def libc() -> Any:
    """The C library through ctypes (errno kept), whose calls give up the GIL (raises OSError
    where it cannot be loaded)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _libc_madvise() -> Any:
    """libc's ``madvise``; None without it."""
    try:
        madvise = libc().madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_libc_madvise_fn = _libc_madvise()


def madvise(region: Any, advice: int, start: int, length: int) -> None:
    """``region.madvise(advice, start, length)`` of an ``mmap`` (``start`` page-aligned), with
    the GIL given up while the kernel works. CPython's ``mmap.madvise`` holds it for the whole
    call: an ``MADV_POPULATE_*`` of 16 MiB takes ~4 ms on a VM, and a readier thread asking
    for that stalled every other thread of the process (the puts it readied for ran 1.5x
    slower). A numpy view of the range holds a buffer export on ``region`` meanwhile (read-only
    mappings too), so the mapping cannot be closed under the call. Raises OSError (errno set)
    and ValueError (``start`` outside the mapping) as ``mmap.madvise`` does, and as it does,
    stops at the mapping's end."""
    if _libc_madvise_fn is None or length <= 0:
        region.madvise(advice, start, length)
        return
    if not 0 <= start < len(region):
        raise ValueError(f"madvise start {start} outside a mapping of {len(region)} bytes")
    length = min(length, len(region) - start)
    span = np.frombuffer(region, dtype=np.uint8, count=length, offset=start)
    try:
        if _libc_madvise_fn(span.ctypes.data, length, advice) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        del span


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class ExtentAllocator:
    """Best-fit allocator over ``[0, capacity)`` with coalescing of freed blocks.

    Best fit plus immediate coalescing keeps fragmentation bounded under churn
    of mixed sizes: freeing everything always restores one block of the whole
    capacity. Not thread-safe; the owning tier serialises calls.
    """

    def __init__(self, capacity: int, alignment: int) -> None:
        self.capacity = capacity // alignment * alignment
        self.alignment = alignment
        self.used = 0
        self._by_offset: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._sizes: list[tuple[int, int]] = []  # sorted (size, offset)
        if self.capacity:
            self._add(0, self.capacity)

    def _add(self, offset: int, size: int) -> None:
        self._by_offset[offset] = size
        self._by_end[offset + size] = offset
        bisect.insort(self._sizes, (size, offset))

    def _remove(self, offset: int, size: int) -> None:
        del self._by_offset[offset]
        del self._by_end[offset + size]
        i = bisect.bisect_left(self._sizes, (size, offset))
        del self._sizes[i]

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a fresh block of ``nbytes`` (rounded up), or None if none fits."""
        size = round_up(max(nbytes, 1), self.alignment)
        i = bisect.bisect_left(self._sizes, (size, -1))
        if i == len(self._sizes):
            return None
        block_size, offset = self._sizes[i]
        self._remove(offset, block_size)
        if block_size > size:
            self._add(offset + size, block_size - size)
        self.used += size
        return offset

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark a specific block used (rebuilding state from a persistent index)."""
        size = round_up(max(nbytes, 1), self.alignment)
        for start, free_size in list(self._by_offset.items()):
            if start <= offset and offset + size <= start + free_size:
                self._remove(start, free_size)
                if offset > start:
                    self._add(start, offset - start)
                if offset + size < start + free_size:
                    self._add(offset + size, start + free_size - offset - size)
                self.used += size
                return
        raise errors.TierError(f"extent [{offset}, {offset + size}) overlaps a used block")

    def free(self, offset: int, nbytes: int) -> None:
        size = round_up(max(nbytes, 1), self.alignment)
        self.used -= size
        start, end = offset, offset + size
        after = self._by_offset.get(end)
        if after is not None:
            self._remove(end, after)
            end += after
        before = self._by_end.get(start)
        if before is not None:
            self._remove(before, start - before)
            start = before
        self._add(start, end - start)

    def truncate(self, new_capacity: int) -> None:
        """Lower the capacity to ``new_capacity`` (aligned down); the bytes cut off must be free."""
        new_capacity = new_capacity // self.alignment * self.alignment
        if new_capacity >= self.capacity:
            return
        start = self._by_end.get(self.capacity)  # the free block that reaches the end
        if start is None or start > new_capacity:
            raise errors.TierError(f"cannot lower the capacity to {new_capacity}: bytes beyond it are in use")
        self._remove(start, self.capacity - start)
        if new_capacity > start:
            self._add(start, new_capacity - start)
        self.capacity = new_capacity

    @property
    def largest_free(self) -> int:
        return self._sizes[-1][0] if self._sizes else 0

    @property
    def free_blocks(self) -> int:
        return len(self._sizes)


class Tier(ABC):
    """One storage tier: exact-capacity space plus byte copies in and out.

    Thread-safe: allocation is serialised by the tier's lock; reads and writes
    of distinct extents may run concurrently.
    """

    name: ClassVar[str]
    #: ``view()`` returns a zero-copy memoryview of tier memory.
    supports_views: ClassVar[bool] = False
    #: objects survive a restart (``recover()`` yields them).
    persistent: ClassVar[bool] = False
    #: ``read_layers`` verifies per-layer checksums (storage that can rot).
    verifies_reads: ClassVar[bool] = False

    def __init__(self, capacity_bytes: int, alignment: int, segment_bytes: int | None = None) -> None:
        if capacity_bytes < alignment:
            raise errors.TierError(f"{self.name}: capacity {capacity_bytes} is below one {alignment}-byte block")
        segment_bytes = segment_bytes or capacity_bytes
        self.alignment = alignment
        self._segments: list[ExtentAllocator] = []
        left = capacity_bytes
        while left >= alignment:
            self._segments.append(ExtentAllocator(min(left, segment_bytes), alignment))
            left -= min(left, segment_bytes)
        self.capacity_bytes = sum(s.capacity for s in self._segments)
        self._prepared: set[int] = set()
        self._alloc_lock = threading.Lock()
        self.closed = False

    # -- space ----------------------------------------------------------------

    def allocated_size(self, nbytes: int) -> int:
        """Bytes of capacity an object of ``nbytes`` consumes here."""
        return round_up(max(nbytes, 1), self.alignment)

    def fits_ever(self, nbytes: int) -> bool:
        """Whether an object of ``nbytes`` could fit once the tier is empty."""
        return any(self.allocated_size(nbytes) <= s.capacity for s in self._segments)

    def allocate(self, nbytes: int) -> Extent | None:
        """Reserve space for an ``nbytes`` object, or None if no block fits now."""
        self._check_open()
        with self._alloc_lock:
            for index, segment in enumerate(self._segments):
                offset = segment.allocate(nbytes)
                if offset is None:
                    continue
                if index not in self._prepared:
                    try:
                        self._prepare_segment(index, segment.capacity)
                    except BaseException:
                        segment.free(offset, nbytes)
                        raise
                    self._prepared.add(index)
                return Extent(index, offset, nbytes)
        return None

    def free(self, extent: Extent) -> None:
        with self._alloc_lock:
            self._segments[extent.segment].free(extent.offset, extent.nbytes)

    def _reserve_recovered(self, extent: Extent) -> None:
        with self._alloc_lock:
            self._segments[extent.segment].reserve(extent.offset, extent.nbytes)

    def _prepare_segment(self, index: int, nbytes: int) -> None:
        """Hook: make segment ``index`` usable before its first allocation."""

    @property
    def used_bytes(self) -> int:
        return sum(s.used for s in self._segments)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    # -- bytes ----------------------------------------------------------------

    @abstractmethod
    def write(self, extent: Extent, offset: int, data: Any) -> None:
        """Copy ``data`` (a buffer) to ``offset`` bytes into ``extent``."""

    @abstractmethod
    def read_into(self, extent: Extent, offset: int, out: Any) -> None:
        """Fill the writable buffer ``out`` from ``offset`` bytes into ``extent``."""

    def view(self, extent: Extent, offset: int, nbytes: int) -> memoryview:
        """Zero-copy view of tier memory (only where ``supports_views``)."""
        raise NotImplementedError(f"the {self.name} tier cannot expose its bytes in place")

    def write_object(self, extent: Extent, header: ObjectHeader, payload: Any) -> None:
        """Write a whole object (header + payload) into ``extent``."""
        self.write(extent, 0, header.packed)
        self.write(extent, header.nbytes, payload)

    def read_layers(self, extent: Extent, header: ObjectHeader, layer_range: LayerRange, out: Any) -> None:
        """Fill ``out`` with the bytes of ``layer_range``; verify them if this tier can rot.

        Raises ChecksumError (``verifies_reads`` tiers) instead of returning bad bytes.
        """
        rng = header.spec.layer_bytes(layer_range)
        mv = memoryview(out).cast("B")
        if len(mv) != rng.nbytes:
            raise errors.OutBufferError(f"out holds {len(mv)} bytes, layers need {rng.nbytes}")
        self.read_into(extent, rng.offset, mv)
        if self.verifies_reads:
            header.verify(layer_range, mv)

    # -- persistence ------------------------------------------------------------

    def commit(self, key: bytes, extent: Extent, header: ObjectHeader) -> None:
        """Make a fully written object durable and findable after a restart."""

    def forget(self, key: bytes, extent: Extent) -> None:
        """Remove a key from the persistent index (before its extent is freed)."""

    def recover(self) -> Iterator[tuple[bytes, Extent, ObjectHeader]]:
        """Objects found again at open (persistent tiers only); their space is reserved."""
        return iter(())

    # -- construction and sharing ---------------------------------------------------

    @classmethod
    def from_config(cls, section: Any, config: Any) -> Tier:
        """The tier its ``[tiers.<name>]`` section describes (``config``: the whole Config)."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from settings")

    def location(self, extent: Extent) -> dict[str, Any]:
        """Where a process on this host can read the object at ``extent`` in place, for the
        master's replica record; ``{}``: nowhere but through this process."""
        return {}

    def arena_info(self) -> dict[str, Any] | None:
        """The shared arena same-host readers may map and index (None: this tier has none)."""
        return None

    # -- lifecycle ----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "tier": self.name,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "largest_free_bytes": max((s.largest_free for s in self._segments), default=0),
            "free_blocks": sum(s.free_blocks for s in self._segments),
        }

    def _check_open(self) -> None:
        if self.closed:
            raise errors.PoolClosedError(f"the {self.name} tier is closed")

    def close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.used_bytes}/{self.capacity_bytes} bytes>"


class ArenaTier(Tier):
    """A tier whose bytes are one contiguous host-addressable arena (a uint8 array).

    Memory tiers (dram, cxl, emulated hbm) differ only in where the arena comes
    from; reads, writes and zero-copy views are the same slice copies.

    The arena is mapped whole but may be made *ready* (backed, locked) as it is
    used: every allocated extent lies below ``ready_bytes``, which grows in steps
    of ``grow_step_bytes`` through :meth:`_grow` when an allocation ends beyond
    it. A tier that readies everything at start sets ``ready_bytes`` to its
    capacity and never grows.
    """

    supports_views = True
    #: how much more of the arena one growth readies (a put crossing the mark pays for it)
    grow_step_bytes: ClassVar[int] = 64 << 20

    def __init__(self, capacity_bytes: int, alignment: int = 64) -> None:
        super().__init__(capacity_bytes, alignment)
        self._arena: Any = None  # set by the subclass: np.ndarray[uint8] of capacity_bytes
        self.ready_bytes = self.capacity_bytes  # [0, ready_bytes) is backed; subclasses that grow set 0
        #: the highest end of any extent allocated so far (where growth stands, for readying ahead)
        self.used_end = 0

    def allocate(self, nbytes: int) -> Extent | None:
        """Best fit in the arena, readied first where it ends beyond ``ready_bytes``.

        Raises DiskFullError (after lowering the capacity to what is ready) where the
        arena's backing has run out, as a full filesystem does for the nvme tier.
        """
        self._check_open()
        with self._alloc_lock:
            [segment] = self._segments
            offset = segment.allocate(nbytes)
            if offset is None:
                return None
            end = offset + self.allocated_size(nbytes)
            if end > self.used_end:
                self.used_end = end
                self._used_to(end)
            if end > self.ready_bytes:
                grown = min(self.capacity_bytes, round_up(end, self.grow_step_bytes))
                try:
                    self._grow(self.ready_bytes, grown)
                except errors.DiskFullError:
                    segment.free(offset, nbytes)
                    segment.truncate(self.ready_bytes)  # nothing is allocated beyond it
                    self.capacity_bytes = segment.capacity
                    raise
                except BaseException:
                    segment.free(offset, nbytes)
                    raise
                self.ready_bytes = max(self.ready_bytes, grown)  # (a background readier may be past it)
            return Extent(0, offset, nbytes)

    def _grow(self, start: int, end: int) -> None:
        """Hook: make arena bytes ``[start, end)`` ready before their first use (lock held).

        Raises DiskFullError where no more backing can be had."""

    def _used_to(self, end: int) -> None:
        """Hook: allocations now reach ``end`` (lock held; a tier that readies ahead of use wakes
        its readier here)."""

    def _slice(self, extent: Extent, offset: int, nbytes: int) -> Any:
        if offset < 0 or offset + nbytes > extent.nbytes:
            raise errors.TierError(
                f"{self.name}: bytes [{offset}, {offset + nbytes}) outside a {extent.nbytes}-byte object"
            )
        start = extent.offset + offset
        return self._arena[start:start + nbytes]

    def write(self, extent: Extent, offset: int, data: Any) -> None:
        self._check_open()
        src = memoryview(data).cast("B")
        self._slice(extent, offset, len(src))[:] = src

    def read_into(self, extent: Extent, offset: int, out: Any) -> None:
        self._check_open()
        dst = memoryview(out).cast("B")
        dst[:] = self._slice(extent, offset, len(dst)).data

    def view(self, extent: Extent, offset: int, nbytes: int) -> memoryview:
        self._check_open()
        view: memoryview = self._slice(extent, offset, nbytes).data
        return view
