"""The nvme tier proper: allocation, whole-object writes, verified reads, commits and
tombstones in the index, recovery at open, stats (see the package docstring)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvpool import errors
from kvpool.config import GiB, MiB, TiB, headroom_bytes
from kvpool.objformat import ObjectHeader, stored_header_checksum
from tiers.base import Extent, round_up
from tiers.nvme.fs import file_size_limit
from tiers.nvme.index import IndexedSegments
from tiers.nvme.layout import ALIGN, INDEX_RESERVE_BYTES, LIVE, MAX_KEY_NBYTES, PREFIX_NBYTES, TOMBSTONE, pack_prefix

if TYPE_CHECKING:
    from kvpool.config import Config, NvmeSection


REGAIN_EVERY_S = 0.1  # a full tier looks at its filesystem for room again at most this often (a statvfs)

log = logging.getLogger("tiers.nvme")


class NvmeTier(IndexedSegments):
    """Objects in preallocated, aligned segment files plus an LMDB index.

    Thread-safe like every tier: allocation is serialised, reads and writes of
    distinct extents run concurrently, index updates are serialised by LMDB.
    ``write`` (the generic partial write) read-modify-writes whole 4 KiB blocks,
    so two concurrent partial writes into the same block of one object race;
    the tier manager only ever writes whole objects (``write_object``).

    ``capacity_bytes`` is the *effective* capacity: it starts at the configured
    capacity and is lowered when the filesystem turns out to hold less (see the
    module docstring); the tier manager reads it like any tier's.
    """

    name = "nvme"
    persistent = True
    verifies_reads = True
    supports_views = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        segment_size: int = 1 * GiB,
        direct_io: str = "auto",
        fsync: bool = False,
        io_threads: int = 4,
        io_chunk: int = 4 * MiB,
        headroom: str | int = "auto",
    ) -> None:
        """Open (or create) the tier in directory ``path``.

        Objects committed by an earlier tier on the same directory are found
        again (see :meth:`recover`), from the index or, if that is missing or
        corrupt, by scanning the segment files. Raises PoolLockedError if
        another live tier owns the directory, TierError if ``direct_io="on"``
        but the filesystem refuses O_DIRECT, or if the directory was laid out
        with a different ``segment_size``.
        """
        if direct_io not in ("auto", "on", "off"):
            raise errors.TierError(f"nvme: direct_io must be 'auto', 'on' or 'off', got {direct_io!r}")
        if io_threads < 1:
            raise errors.TierError(f"nvme: io_threads must be >= 1, got {io_threads}")
        try:
            headroom_bytes(headroom, TiB)
        except ValueError as exc:
            raise errors.TierError(f"nvme: headroom: {exc}") from None
        segment_bytes = segment_size // ALIGN * ALIGN
        if segment_bytes < 2 * ALIGN:
            raise errors.TierError(f"nvme: segment_size {segment_size} is below two {ALIGN}-byte blocks "
                                   "(a record prefix and an object)")
        super().__init__(capacity_bytes, ALIGN, segment_bytes=segment_bytes)
        self.path = Path(path)
        self.segment_bytes = segment_bytes
        self.configured_capacity_bytes = self.capacity_bytes
        self.fsync = fsync
        self.io_threads = io_threads
        self.io_chunk = round_up(max(io_chunk, ALIGN), ALIGN)
        self.direct_io = False
        self.direct_io_reason = ""
        self._lock_fd: int | None = None
        self._env: Any = None
        self._objects_db: Any = None
        self._meta_db: Any = None
        self._fds: dict[int, int] = {}  # segment index -> open fd (O_DIRECT when direct_io)
        self._segments_created = 0
        self._index_lock = threading.Lock()
        self._local = threading.local()  # per thread: .buf (staging), .prefix (one aligned block)
        self._pool: ThreadPoolExecutor | None = None
        # Space above the effective capacity, reserved in the allocators so nothing lands there.
        self._blocked = [0] * len(self._segments)
        # The ranges behind _blocked, per segment: (offset, bytes), given back by _regain.
        self._blocked_ranges: list[list[tuple[int, int]]] = [[] for _ in self._segments]
        self._regain_checked = 0.0  # when _regain last looked at the filesystem
        self._file_limit: int | None = None  # no segment byte at or past this offset is usable (EFBIG)
        self.disk_limited = ""  # why capacity_bytes is below the configured capacity
        self.disk_full_events = 0
        #: tiers.nvme.headroom, and the bytes it came to when a segment was last prepared
        self.headroom: str | int = headroom
        self.headroom_bytes = 0
        self.recovered_objects = 0  # found at open (from the index or a rescan)
        # What the open checked, kept for the first recover() (else the index is parsed twice);
        # dropped at the first index write.
        self._loaded: list[tuple[bytes, Extent, ObjectHeader]] | None = None
        self.dropped_records = 0  # index or segment records discarded at open
        self.dropped_keys: list[bytes] = []
        self.index_rebuilt = ""  # why the index was rebuilt from the segments at open ("" if it was not)
        try:
            self._open(direct_io)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, section: NvmeSection, config: Config) -> NvmeTier:
        name = config.pool.name
        # Pools of different names never share a directory (pool "default" keeps the one it has used).
        path = (Path(os.path.expandvars(os.path.expanduser(section.path))) if section.path
                else config.pool.resolved_data_dir() / ("nvme" if name == "default" else f"nvme-{name}"))
        return cls(path, section.capacity, segment_size=section.segment_size, direct_io=section.direct_io,
                   fsync=section.fsync, io_threads=section.io_threads, io_chunk=section.io_chunk,
                   headroom=section.headroom)

    # -- space ------------------------------------------------------------------
    #
    # The allocators hand out whole records (prefix + object); extents name the object.

    def fits_ever(self, nbytes: int) -> bool:
        size = self.allocated_size(nbytes)
        return any(size <= s.capacity - blocked for s, blocked in zip(self._segments, self._blocked))

    def allocate(self, nbytes: int) -> Extent | None:
        """Reserve a record for an ``nbytes`` object, or None if none fits now.

        Raises DiskFullError when the filesystem cannot hold a new segment (the
        effective capacity is lowered first, so a retry after eviction fits).
        """
        self._check_open()
        size = self.allocated_size(nbytes)
        with self._alloc_lock:
            while True:
                found = self._allocate(size)
                if found is not None or not self._regain():
                    break
        if found is None:
            return None
        index, start = found
        return Extent(index, start + PREFIX_NBYTES, nbytes)

    def _allocate(self, size: int) -> tuple[int, int] | None:
        """(segment, record offset) of ``size`` bytes, preparing the segment first if new (alloc
        lock held)."""
        for index, segment in enumerate(self._segments):
            if index not in self._prepared:
                self._keep_headroom(index)
            start = segment.allocate(size)
            if start is None:
                continue
            if index not in self._prepared:
                try:
                    self._prepare_segment(index, segment.capacity - self._blocked[index])
                except errors.DiskFullError as exc:
                    segment.free(start, size)
                    preallocated = sum(s.capacity - b for i, (s, b) in
                                       enumerate(zip(self._segments, self._blocked)) if i in self._prepared)
                    self._lower_capacity(exc.errno, preallocated, str(exc))
                    raise
                except BaseException:
                    segment.free(start, size)
                    raise
                self._prepared.add(index)
            return index, start
        return None

    def free(self, extent: Extent) -> None:
        start, size = extent.offset - PREFIX_NBYTES, self.allocated_size(extent.nbytes)
        with self._alloc_lock:
            self._segments[extent.segment].free(start, size)
            if self._file_limit is not None and start + size > self._file_limit:
                # Space past the file size limit that an older object held is unusable now.
                self._block(extent.segment, max(start, self._file_limit), start + size)

    @property
    def used_bytes(self) -> int:
        return sum(s.used for s in self._segments) - sum(self._blocked)

    def _block(self, index: int, start: int, end: int) -> None:
        """Take the free parts of ``[start, end)`` of segment ``index`` out of service (lock held)."""
        segment = self._segments[index]
        for offset, size in sorted(segment._by_offset.items()):
            lo, hi = max(offset, start), min(offset + size, end)
            if hi > lo:
                segment.reserve(lo, hi - lo)
                self._blocked[index] += hi - lo
                self._blocked_ranges[index].append((lo, hi - lo))
                self.capacity_bytes -= hi - lo

    def _regain(self) -> bool:
        """Give back capacity that a full filesystem took away, once it has room again (alloc
        lock held; looks at the filesystem at most every REGAIN_EVERY_S): a disk filled by
        another writer and freed must not leave the tier refusing puts until it is reopened.
        Returns True if any capacity came back. Space past a file size limit (EFBIG) stays out."""
        if not self.disk_limited or self._file_limit is not None:
            return False
        now = time.monotonic()
        if now - self._regain_checked < REGAIN_EVERY_S:
            return False
        self._regain_checked = now
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        free = st.f_bavail * st.f_frsize
        headroom = headroom_bytes(self.headroom, st.f_blocks * st.f_frsize)
        # What segments not prepared yet will take when they are, comes first; a blocked range
        # may lie past what its segment's file holds, so each costs its size.
        budget = max(0, free - max(headroom, INDEX_RESERVE_BYTES + free // 128)) - sum(
            s.capacity - b for i, (s, b) in enumerate(zip(self._segments, self._blocked)) if i not in self._prepared)
        before = self.capacity_bytes
        for index, ranges in enumerate(self._blocked_ranges):
            while ranges and ranges[-1][1] <= budget:
                offset, size = ranges.pop()
                self._segments[index].free(offset, size)
                self._blocked[index] -= size
                self.capacity_bytes += size
                budget -= size
        if self.capacity_bytes == before:
            return False
        if self.capacity_bytes >= self.configured_capacity_bytes:
            self.disk_limited = ""
        log.info("nvme tier at %s: the filesystem has room again: effective capacity raised from %d to %d bytes",
                 self.path, before, self.capacity_bytes)
        return True

    def _keep_headroom(self, index: int) -> None:
        """Before segment ``index`` is first prepared (alloc lock held): take out of service the
        part of it that would leave less than the headroom free on the filesystem, so the
        segments never take the last bytes that the index, ``durable.log`` and every other
        writer there need. Like a full disk, it lowers the capacity until the tier is reopened."""
        segment = self._segments[index]
        wanted = segment.capacity - self._blocked[index]
        if wanted <= 0:
            return
        try:
            st = os.statvfs(self.path)
        except OSError:
            return
        headroom = self.headroom_bytes = headroom_bytes(self.headroom, st.f_blocks * st.f_frsize)
        if not headroom:
            return
        try:  # a segment file found at open holds its space already
            held = os.stat(self._segment_path(index)).st_blocks * 512
        except OSError:
            held = 0
        room = max(0, st.f_bavail * st.f_frsize - headroom)
        if wanted - held <= room:
            return
        preallocated = held + sum(s.capacity - b for i, (s, b) in enumerate(zip(self._segments, self._blocked))
                                  if i in self._prepared)
        self._lower_to(preallocated + room,
                       f"{headroom} bytes kept free on it, tiers.nvme.headroom {self.headroom}", self.capacity_bytes)

    def _lower_capacity(self, err: int | None, preallocated: int, why: str) -> None:
        """Lower ``capacity_bytes`` to what the filesystem holds (alloc lock held).

        ``preallocated``: bytes the tier holds on disk for sure (prepared
        segments, or the objects already written); to that comes what is free
        on the filesystem now, less a reserve for the index.
        """
        before = self.capacity_bytes
        self.disk_full_events += 1
        if err == errno.EFBIG:
            limit = file_size_limit()
            if limit is not None:
                limit = limit // ALIGN * ALIGN
                self._file_limit = limit if self._file_limit is None else min(limit, self._file_limit)
                for index, segment in enumerate(self._segments):
                    self._block(index, self._file_limit, segment.capacity)
        try:
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
            headroom = headroom_bytes(self.headroom, st.f_blocks * st.f_frsize)
        except OSError:
            free = headroom = 0
        usable = max(0, free - max(headroom, INDEX_RESERVE_BYTES + free // 128))
        self._lower_to(preallocated + usable, why, before)

    def _lower_to(self, room: int, why: str, before: int) -> None:
        """Block what this tier holds beyond ``room`` bytes (aligned down) and say so if the
        capacity is now below ``before``: one warning when the tier first learns its
        filesystem is smaller, later lowerings are routine (alloc lock held)."""
        self._block_excess(self.capacity_bytes - room // ALIGN * ALIGN)
        if self.capacity_bytes < before:
            first = not self.disk_limited
            self.disk_limited = (f"the filesystem under {self.path} holds {self.capacity_bytes} bytes for this tier "
                                 f"({why})")
            (log.warning if first else log.info)(
                "nvme tier at %s: the filesystem is smaller than tiers.nvme.capacity (%d bytes): "
                "effective capacity lowered to %d bytes (%s)",
                self.path, self.configured_capacity_bytes, self.capacity_bytes, why)

    def _block_excess(self, excess: int) -> None:
        """Take ``excess`` bytes of free space out of service (alloc lock held): the highest
        first, in segments not prepared yet before prepared ones (their space is held on disk
        already). New segments are prepared from the front, so a partly usable segment keeps a
        usable head [0, x)."""
        for prepared in (False, True):
            for index in range(len(self._segments) - 1, -1, -1):
                if excess <= 0:
                    return
                if (index in self._prepared) != prepared:
                    continue
                for offset, size in sorted(self._segments[index]._by_offset.items(), reverse=True):
                    if excess <= 0:
                        break
                    take = min(size, excess)
                    self._block(index, offset + size - take, offset + size)
                    excess -= take

    def _disk_full_on_write(self, exc: errors.DiskFullError, extent: Extent) -> None:
        with self._alloc_lock:
            self._lower_capacity(exc.errno, self.used_bytes - self.allocated_size(extent.nbytes), str(exc))

    # -- bytes -------------------------------------------------------------------------

    def write_object(self, extent: Extent, header: ObjectHeader, payload: Any) -> None:
        """Write a zeroed record prefix, then header + payload, into ``extent``'s record.

        The prefix is zeroed so no earlier record's prefix survives in front of
        new bytes; ``commit`` writes the real one. Raises DiskFullError on
        ENOSPC/EFBIG/EDQUOT after lowering the effective capacity (nothing
        outside the record is touched, so every stored object stays intact),
        TierError otherwise.
        """
        self._check_open()
        head = np.frombuffer(header.packed, dtype=np.uint8)
        body = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
        total = len(head) + len(body)
        self._check_range(extent, 0, total)
        fd = self._fd(extent)
        base = extent.offset - PREFIX_NBYTES  # file position of the record
        try:
            if not self.direct_io:
                # Buffered: the kernel copies into the page cache anyway; no staging copy.
                self._pwrite_all(fd, np.zeros(PREFIX_NBYTES, dtype=np.uint8), base)

                def write_buffered(offset: int, n: int) -> None:
                    if offset < len(head):
                        self._pwrite_all(fd, head[offset:offset + n], extent.offset + offset)
                        n, offset = n - (len(head) - offset), len(head)
                    if n > 0:
                        self._pwrite_all(fd, body[offset - len(head):offset - len(head) + n],
                                         extent.offset + offset)

                self._parallel(total, write_buffered)
                return
            span = PREFIX_NBYTES + round_up(total, ALIGN)
            staging = self._staging(span)
            obj_end = PREFIX_NBYTES + total

            def write_direct(offset: int, n: int) -> None:
                # Each piece is copied just before it is written, so copies of later
                # pieces overlap the I/O of earlier ones. Staging holds the record:
                # [zero prefix | header | payload | zero tail].
                end = offset + n
                if offset < PREFIX_NBYTES:
                    staging[offset:min(end, PREFIX_NBYTES)] = 0
                lo, hi = max(offset, PREFIX_NBYTES), min(end, PREFIX_NBYTES + len(head))
                if hi > lo:
                    staging[lo:hi] = head[lo - PREFIX_NBYTES:hi - PREFIX_NBYTES]
                lo, hi = max(offset, PREFIX_NBYTES + len(head)), min(end, obj_end)
                if hi > lo:
                    staging[lo:hi] = body[lo - PREFIX_NBYTES - len(head):hi - PREFIX_NBYTES - len(head)]
                if end > obj_end:
                    staging[max(offset, obj_end):end] = 0  # the block tail: no stale bytes of other objects
                self._pwrite_all(fd, staging[offset:end], base + offset)

            try:
                self._parallel(span, write_direct)
            finally:
                self._release_big_staging()
        except errors.DiskFullError as exc:
            self._disk_full_on_write(exc, extent)
            raise

    def write(self, extent: Extent, offset: int, data: Any) -> None:
        """Write ``data`` at ``offset`` bytes into ``extent``'s object (any offset and length).

        With O_DIRECT, partial blocks at either edge are read first so their
        other bytes survive (read-modify-write); not a hot path.
        """
        self._check_open()
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        if len(src) == 0:
            return
        self._check_range(extent, offset, len(src))
        fd = self._fd(extent)
        position = extent.offset + offset
        try:
            if not self.direct_io:
                self._parallel(len(src), lambda o, n: self._pwrite_all(fd, src[o:o + n], position + o))
                return
            start, end = position // ALIGN * ALIGN, round_up(position + len(src), ALIGN)
            staging = self._staging(end - start)
            try:
                if position != start:
                    self._pread_all(fd, staging[:ALIGN], start)
                if position + len(src) != end and (end - ALIGN > start or position == start):
                    self._pread_all(fd, staging[end - start - ALIGN:end - start], end - ALIGN)
                staging[position - start:position - start + len(src)] = src
                self._parallel(end - start, lambda o, n: self._pwrite_all(fd, staging[o:o + n], start + o))
            finally:
                self._release_big_staging()
        except errors.DiskFullError as exc:
            self._disk_full_on_write(exc, extent)
            raise

    def read_into(self, extent: Extent, offset: int, out: Any) -> None:
        """Fill ``out`` from ``offset`` bytes into ``extent`` (no verification; see read_layers).

        Reads straight into ``out`` when it and the range are 4 KiB-aligned (or
        I/O is buffered); otherwise through an aligned bounce buffer. A record
        cut short or unreadable raises ChecksumError.
        """
        self._check_open()
        try:
            view = memoryview(out).cast("B")
        except TypeError as exc:
            raise errors.OutBufferError(f"out must be a contiguous buffer: {exc}") from None
        if view.readonly:
            raise errors.OutBufferError("out is read-only")
        dst = np.frombuffer(view, dtype=np.uint8)
        nbytes = len(dst)
        if nbytes == 0:
            return
        self._check_range(extent, offset, nbytes)
        fd = self._fd(extent)
        position = extent.offset + offset
        aligned = position % ALIGN == 0 and nbytes % ALIGN == 0 and dst.ctypes.data % ALIGN == 0
        if aligned or not self.direct_io:
            self._parallel(nbytes, lambda o, n: self._pread_all(fd, dst[o:o + n], position + o))
            return
        start, end = position // ALIGN * ALIGN, round_up(position + nbytes, ALIGN)
        skip = position - start
        bounce = self._staging(end - start)

        def read_piece(o: int, n: int) -> None:
            self._pread_all(fd, bounce[o:o + n], start + o)
            lo, hi = max(o, skip), min(o + n, skip + nbytes)
            if hi > lo:  # copy out while other pieces are still being read
                dst[lo - skip:hi - skip] = bounce[lo:hi]

        try:
            self._parallel(end - start, read_piece)
        finally:
            self._release_big_staging()

    # -- persistence -------------------------------------------------------------------

    def commit(self, key: bytes, extent: Extent, header: ObjectHeader) -> None:
        """Record a fully written object so a restarted tier finds it.

        Writes the record prefix (key, generation, header checksum) in front of
        the object, then the index record, replacing any record of the same key
        (whose prefix is then tombstoned). With ``fsync`` the segment is
        fdatasync'ed before the index record commits, so the record never points
        at bytes still in flight.
        """
        self._check_open()
        key = bytes(key)
        limit = min(self._env.max_key_size(), MAX_KEY_NBYTES)
        if not 0 < len(key) <= limit:
            raise errors.InvalidKeyError(f"nvme: keys must be 1..{limit} bytes, got {len(key)}")
        self._check_range(extent, 0, header.spec.total_nbytes)
        # The prefix names the key and a rescan checks the header's digest against it:
        # a header for another key would be an object no rescan could ever find.
        header.check_identity(key)
        header_sum = stored_header_checksum(header.packed)
        try:
            self._write_prefix(extent, pack_prefix(LIVE, key, extent.nbytes, header.generation, header_sum))
            if self.fsync:
                os.fdatasync(self._fd(extent))
        except OSError as exc:  # DiskFullError is an OSError too
            if isinstance(exc, errors.DiskFullError):
                self._disk_full_on_write(exc, extent)
                raise
            raise self._io_error(exc, "fdatasync before commit") from exc
        record = msgspec.msgpack.encode([extent.segment, extent.offset, extent.nbytes, header.packed])

        def replace(txn: Any) -> bytes | None:
            old = txn.get(key)
            txn.put(key, record)
            return None if old is None else bytes(old)

        try:
            old = self._index_write(replace)
        except BaseException:
            # Not committed: the caller frees the extent, so its prefix must not
            # bring the object back in a later rescan.
            self._tombstone_quietly(key, extent, header.generation, header_sum)
            raise
        if old is not None:
            try:
                old_extent, old_header = self._parse_record(old)
            except (errors.FormatError, errors.TierError, ValueError, TypeError, msgspec.DecodeError):
                return
            if old_extent != extent:
                self._tombstone_quietly(key, old_extent, old_header.generation,
                                        stored_header_checksum(old_header.pack()))

    def _tombstone_quietly(self, key: bytes, extent: Extent, generation: int, header_sum: int) -> None:
        try:
            self._write_prefix(extent, pack_prefix(TOMBSTONE, key, extent.nbytes, generation, header_sum))
        except (OSError, errors.KVPoolError) as exc:
            log.warning("nvme tier at %s: could not tombstone the record of %s: %s", self.path, key[:64].hex(), exc)

    def forget(self, key: bytes, extent: Extent) -> None:
        """Tombstone ``extent``'s record, then delete ``key``'s index record if it still names ``extent``.

        A newer commit of the key elsewhere keeps its record (and its prefix).
        """
        self._check_open()
        key = bytes(key)
        try:
            prefix = self._read_prefix(self._fd(extent), extent.offset - PREFIX_NBYTES)
        except errors.KVPoolError:
            prefix = None  # unreadable: nothing a rescan could take for an object either
        if prefix is not None and prefix.state == LIVE and prefix.key == key:
            self._tombstone_quietly(key, extent, prefix.generation, prefix.header_sum)

        def delete_if_same(txn: Any) -> None:
            raw = txn.get(key)
            if raw is None:
                return
            try:
                segment, offset, nbytes, _ = msgspec.msgpack.decode(raw)
            except (ValueError, TypeError, msgspec.DecodeError):
                txn.delete(key)  # unreadable: it could only ever be dropped
                return
            if (segment, offset, nbytes) == (extent.segment, extent.offset, extent.nbytes):
                txn.delete(key)

        self._index_write(delete_if_same)

    def recover(self) -> Iterator[tuple[bytes, Extent, ObjectHeader]]:
        """Every object in the index, as (key, extent, header).

        Their space was reserved when the tier opened (every record was checked
        against its segment, or the index rebuilt from the segments), so the
        caller may forget and free what it does not want while iterating.
        """
        self._check_open()
        loaded, self._loaded = self._loaded, None
        if loaded is not None:  # what the open just read and checked, nothing written since
            yield from loaded
            return
        with self._env.begin(db=self._objects_db) as txn:
            raws = [(bytes(key), bytes(raw)) for key, raw in txn.cursor()]
        for key, raw in raws:  # outside the transaction: the caller may write to the index
            extent, header = self._parse_record(raw)
            yield key, extent, header

    # -- lifecycle ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        indexed = 0
        if self._env is not None:
            with self._env.begin(db=self._objects_db) as txn:
                indexed = txn.stat(self._objects_db)["entries"]
        return {
            **super().stats(),
            "configured_capacity_bytes": self.configured_capacity_bytes,
            "disk_limited": self.disk_limited,
            "disk_full_events": self.disk_full_events,
            "headroom_bytes": self.headroom_bytes,
            "path": str(self.path),
            "segment_bytes": self.segment_bytes,
            "segments_created": len(self._fds),
            "indexed_objects": indexed,
            "recovered_objects": self.recovered_objects,
            "dropped_records": self.dropped_records,
            "index_rebuilt": self.index_rebuilt,
            "direct_io": self.direct_io,
            "direct_io_reason": self.direct_io_reason,
            "fsync": self.fsync,
            "io_threads": self.io_threads,
            "io_chunk_bytes": self.io_chunk,
        }

    def close(self) -> None:
        """Finish in-flight I/O, sync and close the index, release the directory. Idempotent."""
        if self.closed:
            return
        super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._env is not None:
            try:
                self._env.sync(True)
            finally:
                self._close_env()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._local = threading.local()  # drops this thread's buffers; others die with their threads
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __repr__(self) -> str:
        return f"<NvmeTier {self.path} {self.used_bytes}/{self.capacity_bytes} bytes direct_io={self.direct_io}>"

