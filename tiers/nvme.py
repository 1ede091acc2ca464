"""The ``nvme`` tier: objects in preallocated segment files on a local SSD.

Owns one directory::

    LOCK              flock'ed by the live tier (a second one gets PoolLockedError)
    seg-00000.kvs     segment files, ``segment_size`` bytes each, created on first use
    index/            LMDB: key -> (segment, offset, nbytes, packed object header)

Every extent is 4096-aligned and lies inside one segment, so an object is one
contiguous file range. Segment files are preallocated with ``posix_fallocate``:
a full disk surfaces as :class:`kvpool.errors.DiskFullError` when space is
allocated, not as a torn write later; an ENOSPC/EFBIG from any write is
mapped to the same error, and never touches bytes already stored.

Crash consistency comes from ordering: the tier manager calls ``commit`` only
after the whole object was written, and the index record is the only thing
that makes an object exist. An object whose write was cut short has no record
and is therefore absent after a restart, never half-present. With
``fsync=True`` the segment is fdatasync'ed before the record commits (and
LMDB syncs), which extends the guarantee from process crashes to power loss.
Stored bytes are verified on every read (per-layer xxh3), so rot on disk is a
``ChecksumError``, never data.

I/O uses O_DIRECT where the filesystem allows it (probed at open), so reads
measure the disk and large objects do not evict the page cache. Writes are
assembled into a page-aligned per-thread staging buffer; large objects are
split into ``io_chunk`` pieces with ``io_threads`` in flight, since the SSD is
faster at queue depth >1 (~1.6 GB/s at depth 1, ~2 GB/s at depth 16 here).

This module does not decide what is stored here or when it is evicted (the
tier manager does), and it knows nothing of other tiers or the master.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import lmdb
import msgpack
import numpy as np

from kvpool import errors
from kvpool.config import GiB, MiB
from kvpool.objformat import ObjectHeader
from tiers.base import Extent, Tier, round_up

if TYPE_CHECKING:
    from kvpool.config import Config, NvmeSection

log = logging.getLogger(__name__)

#: Extent and I/O alignment: O_DIRECT needs the logical block size (512 or 4096).
ALIGN = 4096
LAYOUT_VERSION = 1
SEGMENT_NAME = "seg-{:05d}.kvs"
INDEX_DIR = "index"
LOCK_NAME = "LOCK"

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
# statfs f_type of filesystems that keep file data in memory: there is no page
# cache to bypass, so O_DIRECT buys nothing and only adds alignment rules.
_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
# Staging buffers grow in these steps and are kept per thread unless larger than
# the limit (a one-off huge object should not pin that much memory forever).
_STAGING_GRAIN_BYTES = 1 * MiB
_STAGING_KEEP_BYTES = 256 * MiB


def _filesystem_type(path: Path) -> int | None:
    """statfs(2) f_type of ``path`` (None where it cannot be read)."""
    if ctypes.sizeof(ctypes.c_long) != 8:
        return None  # f_type is a long on the 64-bit Linux ABIs this reads
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return int(ctypes.c_long.from_buffer(buf).value)


def _probe_direct_io(directory: Path) -> str | None:
    """None if O_DIRECT writes and reads work in ``directory``, else why not."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = directory / ".direct-io-probe"
    block = mmap.mmap(-1, ALIGN)  # page-aligned, as O_DIRECT requires
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        block.close()
        return f"the filesystem refuses O_DIRECT at open ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    try:
        os.pwrite(fd, block, 0)
        os.preadv(fd, [block], 0)
    except OSError as exc:
        return f"O_DIRECT I/O failed ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        block.close()
    return None


class NvmeTier(Tier):
    """Objects in preallocated, aligned segment files plus an LMDB index.

    Thread-safe like every tier: allocation is serialised, reads and writes of
    distinct extents run concurrently, index updates are serialised by LMDB.
    ``write`` (the generic partial write) read-modify-writes whole 4 KiB blocks,
    so two concurrent partial writes into the same block of one object race;
    the tier manager only ever writes whole objects (``write_object``).
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
    ) -> None:
        """Open (or create) the tier in directory ``path``.

        Objects committed by an earlier tier on the same directory are found
        again (see :meth:`recover`). Raises PoolLockedError if another live
        tier owns the directory, TierError if ``direct_io="on"`` but the
        filesystem refuses O_DIRECT, or if the directory was laid out with a
        different ``segment_size``.
        """
        if direct_io not in ("auto", "on", "off"):
            raise errors.TierError(f"nvme: direct_io must be 'auto', 'on' or 'off', got {direct_io!r}")
        if io_threads < 1:
            raise errors.TierError(f"nvme: io_threads must be >= 1, got {io_threads}")
        segment_bytes = segment_size // ALIGN * ALIGN
        if segment_bytes < ALIGN:
            raise errors.TierError(f"nvme: segment_size {segment_size} is below one {ALIGN}-byte block")
        super().__init__(capacity_bytes, ALIGN, segment_bytes=segment_bytes)
        self.path = Path(path)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.io_threads = io_threads
        self.io_chunk = round_up(max(io_chunk, ALIGN), ALIGN)
        self.direct_io = False
        self.direct_io_reason = ""
        self._lock_fd: int | None = None
        self._env: Any = None
        self._objects_db: Any = None
        self._fds: dict[int, int] = {}  # segment index -> open fd (O_DIRECT when direct_io)
        self._segments_created = 0
        self._index_lock = threading.Lock()
        self._local = threading.local()  # per-thread staging buffer: .buf (np.uint8 over an mmap)
        self._pool: ThreadPoolExecutor | None = None
        self.recovered_objects = 0  # found in the index at open
        self.dropped_records = 0  # index records discarded at open (unparseable, overlapping, missing file)
        try:
            self._open(direct_io)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, section: NvmeSection, config: Config) -> NvmeTier:
        path = (Path(os.path.expandvars(os.path.expanduser(section.path))) if section.path
                else config.pool.resolved_data_dir() / "nvme")
        return cls(path, section.capacity, segment_size=section.segment_size, direct_io=section.direct_io,
                   fsync=section.fsync, io_threads=section.io_threads, io_chunk=section.io_chunk)

    # -- opening ----------------------------------------------------------------

    def _open(self, direct_io: str) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise errors.TierError(f"nvme: cannot create {self.path}: {exc}") from exc
        self._take_lock()
        self._choose_io_mode(direct_io)
        self._open_index()
        self._load_index()
        if self.io_threads > 1:
            # The calling thread does I/O too, so io_threads - 1 helpers give io_threads in flight.
            self._pool = ThreadPoolExecutor(self.io_threads - 1, thread_name_prefix="kvpool-nvme-io")

    def _take_lock(self) -> None:
        lock_path = self.path / LOCK_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise errors.PoolLockedError(
                f"nvme directory {self.path} is in use by another live tier (pid {holder})"
            ) from None
        # The pid is only for the message above; the flock is what excludes (and dies with us).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _choose_io_mode(self, mode: str) -> None:
        if mode == "off":
            self.direct_io, self.direct_io_reason = False, "disabled (direct_io='off')"
            return
        refused = _probe_direct_io(self.path)
        if refused is not None:
            if mode == "on":
                raise errors.TierError(f"nvme: direct_io='on' but {self.path}: {refused}")
            self.direct_io, self.direct_io_reason = False, f"buffered I/O: {refused}"
            log.warning("nvme tier at %s: O_DIRECT unavailable, using buffered I/O: %s", self.path, refused)
            return
        memory_fs = _MEMORY_FILESYSTEMS.get(_filesystem_type(self.path) or 0)
        if memory_fs and mode == "auto":
            self.direct_io = False
            self.direct_io_reason = (f"buffered I/O: {memory_fs} keeps files in memory, "
                                     "so O_DIRECT would bypass no cache")
            log.info("nvme tier at %s: %s", self.path, self.direct_io_reason)
            return
        self.direct_io, self.direct_io_reason = True, "O_DIRECT"

    def _open_index(self) -> None:
        # The map grows on demand (_index_write); start near what realistic objects (MiBs) need.
        map_size = round_up(max(64 * MiB, min(self.capacity_bytes // 256, 4 * GiB)), mmap.PAGESIZE)
        try:
            # sync follows fsync: without it a commit survives a process crash
            # (the pages are in the kernel) but not a power loss.
            self._env = lmdb.open(str(self.path / INDEX_DIR), map_size=map_size, max_dbs=2, subdir=True,
                                  sync=self.fsync, metasync=self.fsync, readahead=False)
            self._objects_db = self._env.open_db(b"objects")
            meta_db = self._env.open_db(b"meta")
            layout = {"version": LAYOUT_VERSION, "alignment": ALIGN, "segment_bytes": self.segment_bytes}
            with self._env.begin(write=True, db=meta_db) as txn:
                stored = txn.get(b"layout")
                if stored is None:
                    txn.put(b"layout", msgpack.packb(layout))
                    return
        except lmdb.Error as exc:
            raise errors.TierError(f"nvme: cannot open the index at {self.path / INDEX_DIR}: {exc}") from exc
        found = msgpack.unpackb(stored)
        if found != layout:
            # Offsets in the index are relative to segments of the old size: reading
            # them with another geometry would hand out other objects' bytes.
            raise errors.TierError(
                f"nvme: {self.path} was laid out as {found}, this tier asks for {layout}; "
                f"reopen with segment_size={found.get('segment_bytes')} or use another directory"
            )

    def _load_index(self) -> None:
        """Reserve every indexed extent; drop (and log) records that cannot be trusted."""
        records: list[tuple[bytes, Extent]] = []
        dropped: list[tuple[bytes, str]] = []
        with self._env.begin(db=self._objects_db) as txn:
            for key, raw in txn.cursor():
                try:
                    extent, _ = self._parse_record(raw)
                except (errors.FormatError, errors.TierError, ValueError, TypeError) as exc:
                    dropped.append((bytes(key), str(exc)))
                    continue
                records.append((bytes(key), extent))
        # Offset order keeps each reservation near the end of the free list.
        records.sort(key=lambda record: (record[1].segment, record[1].offset))
        for key, extent in records:
            try:
                self._open_recovered_segment(extent)
                self._reserve_recovered(extent)  # an overlap with an earlier record raises
            except errors.TierError as exc:
                dropped.append((key, str(exc)))
            else:
                self.recovered_objects += 1
        if dropped:
            def drop(txn: Any) -> None:
                for key, _ in dropped:
                    txn.delete(key)

            self._index_write(drop)
            for key, why in dropped:
                log.warning("nvme tier at %s: dropped index record %s: %s", self.path, key.hex(), why)
        self.dropped_records = len(dropped)

    def _parse_record(self, raw: Any) -> tuple[Extent, ObjectHeader]:
        fields = msgpack.unpackb(bytes(raw))
        if not (isinstance(fields, list) and len(fields) == 4):
            raise errors.FormatError(f"index record is not [segment, offset, nbytes, header]: {fields!r:.80}")
        segment, offset, nbytes, header_bytes = fields
        if not (all(isinstance(v, int) for v in (segment, offset, nbytes)) and isinstance(header_bytes, bytes)):
            raise errors.FormatError("index record has fields of the wrong type")
        header = ObjectHeader.unpack(header_bytes)
        if header.spec.total_nbytes != nbytes:
            raise errors.FormatError(f"record says {nbytes} bytes, its header {header.spec.total_nbytes}")
        if not 0 <= segment < len(self._segments):
            raise errors.TierError(f"segment {segment} is beyond this tier's capacity")
        if offset < 0 or offset % ALIGN or offset + self.allocated_size(nbytes) > self._segments[segment].capacity:
            raise errors.TierError(f"extent at {offset} (+{nbytes}) does not fit segment {segment}")
        return Extent(segment, offset, nbytes), header

    def _open_recovered_segment(self, extent: Extent) -> None:
        if extent.segment not in self._fds:
            path = self._segment_path(extent.segment)
            try:
                self._fds[extent.segment] = self._open_io_fd(path)
            except FileNotFoundError:
                raise errors.TierError(f"segment file {path.name} is missing") from None
            except OSError as exc:
                raise errors.TierError(f"cannot open {path}: {exc}") from exc
        if os.fstat(self._fds[extent.segment]).st_size < extent.offset + self.allocated_size(extent.nbytes):
            raise errors.TierError(f"segment file {self._segment_path(extent.segment).name} is too short")

    # -- segments -----------------------------------------------------------------

    def _segment_path(self, index: int) -> Path:
        return self.path / SEGMENT_NAME.format(index)

    def _open_io_fd(self, path: Path) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        return os.open(path, flags)

    def _prepare_segment(self, index: int, nbytes: int) -> None:
        """Create (or extend) segment ``index`` to ``nbytes`` of preallocated space."""
        path = self._segment_path(index)
        created = not path.exists()
        try:
            # A buffered fd for fallocate: where the filesystem lacks it, glibc
            # emulates it with one-byte writes, which O_DIRECT would refuse.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            if index not in self._fds:
                self._fds[index] = self._open_io_fd(path)
        except OSError as exc:
            if created:  # a half-allocated new file holds nothing: give the space back
                path.unlink(missing_ok=True)
            raise self._io_error(exc, f"preallocating {nbytes} bytes for {path.name}") from exc
        if created:
            self._segments_created += 1
            if self.fsync:  # make the new directory entry itself durable
                dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)

    def _fd(self, extent: Extent) -> int:
        fd = self._fds.get(extent.segment)
        if fd is None:
            raise errors.TierError(f"nvme: extent {extent} lies in a segment this tier never allocated from")
        return fd

    def _io_error(self, exc: OSError, doing: str) -> errors.KVPoolError:
        if exc.errno in _DISK_FULL_ERRNOS:
            return errors.DiskFullError(exc.errno, f"nvme tier at {self.path}: {doing}: {exc.strerror}")
        return errors.TierError(f"nvme tier at {self.path}: {doing}: {exc}")

    # -- buffers and parallel I/O ------------------------------------------------------

    def _staging(self, nbytes: int) -> np.ndarray:
        """This thread's page-aligned staging buffer, at least ``nbytes`` long (reused)."""
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            # Anonymous mmap is page-aligned, as O_DIRECT needs; dropping the
            # array unmaps it.
            buf = np.frombuffer(mmap.mmap(-1, round_up(nbytes, _STAGING_GRAIN_BYTES)), dtype=np.uint8)
            self._local.buf = buf
        return buf

    def _release_big_staging(self) -> None:
        buf = getattr(self._local, "buf", None)
        if buf is not None and len(buf) > _STAGING_KEEP_BYTES:
            del self._local.buf

    def _parallel(self, nbytes: int, piece: Callable[[int, int], None]) -> None:
        """Call ``piece(offset, n)`` over ``io_chunk`` pieces of ``[0, nbytes)``, several in flight.

        The caller works through pieces too, so progress never waits on a pool
        thread that another caller keeps busy. The first error is re-raised.
        """
        count = -(-nbytes // self.io_chunk)
        if count <= 1 or self._pool is None:
            for offset in range(0, nbytes, self.io_chunk):
                piece(offset, min(self.io_chunk, nbytes - offset))
            return
        next_piece = iter(range(0, nbytes, self.io_chunk))
        take = threading.Lock()
        failed: list[BaseException] = []

        def drain() -> None:
            while not failed:
                with take:
                    offset = next(next_piece, None)
                if offset is None:
                    return
                try:
                    piece(offset, min(self.io_chunk, nbytes - offset))
                except BaseException as exc:
                    failed.append(exc)
                    raise

        helpers: list[Future[None]] = [self._pool.submit(drain) for _ in range(min(self.io_threads, count) - 1)]
        try:
            drain()
        except BaseException:
            pass  # recorded in `failed`; wait for the helpers before raising
        for helper in helpers:
            try:
                helper.result()
            except BaseException:
                pass  # recorded in `failed`
        if failed:
            raise failed[0]

    def _pwrite_all(self, fd: int, data: np.ndarray, position: int) -> None:
        view = memoryview(data)  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            try:
                written = os.pwrite(fd, view[done:], position + done)
            except OSError as exc:
                raise self._io_error(exc, f"writing {len(view)} bytes at {position}") from exc
            if written <= 0:
                raise errors.TierError(f"nvme tier at {self.path}: pwrite at {position + done} wrote nothing")
            done += written

    def _pread_all(self, fd: int, out: np.ndarray, position: int) -> None:
        view = memoryview(out)  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            try:
                got = os.preadv(fd, [view[done:]], position + done)
            except OSError as exc:
                raise self._io_error(exc, f"reading {len(view)} bytes at {position}") from exc
            if got <= 0:
                raise errors.TierError(
                    f"nvme tier at {self.path}: segment file ends before byte {position + len(view)}"
                )
            done += got

    def _check_range(self, extent: Extent, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > extent.nbytes:
            raise errors.TierError(
                f"{self.name}: bytes [{offset}, {offset + nbytes}) outside a {extent.nbytes}-byte object"
            )

    # -- bytes -------------------------------------------------------------------------

    def write_object(self, extent: Extent, header: ObjectHeader, payload: Any) -> None:
        """Write header + payload into ``extent`` with aligned, parallel I/O.

        Raises DiskFullError on ENOSPC/EFBIG (nothing outside ``extent`` is
        touched, so every stored object stays intact), TierError otherwise.
        """
        self._check_open()
        head = np.frombuffer(header.pack(), dtype=np.uint8)
        body = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
        total = len(head) + len(body)
        self._check_range(extent, 0, total)
        fd = self._fd(extent)
        if not self.direct_io:
            # Buffered: the kernel copies into the page cache anyway; no staging copy.
            def write_buffered(offset: int, n: int) -> None:
                if offset < len(head):
                    self._pwrite_all(fd, head[offset:offset + n], extent.offset + offset)
                    n, offset = n - (len(head) - offset), len(head)
                if n > 0:
                    self._pwrite_all(fd, body[offset - len(head):offset - len(head) + n], extent.offset + offset)

            self._parallel(total, write_buffered)
            return
        span = round_up(total, ALIGN)
        staging = self._staging(span)

        def write_direct(offset: int, n: int) -> None:
            # Each piece is copied just before it is written, so copies of later
            # pieces overlap the I/O of earlier ones.
            end = offset + n
            if offset < len(head):
                staging[offset:min(end, len(head))] = head[offset:min(end, len(head))]
            lo, hi = max(offset, len(head)), min(end, total)
            if hi > lo:
                staging[lo:hi] = body[lo - len(head):hi - len(head)]
            if end > total:
                staging[max(offset, total):end] = 0  # the block tail: no stale bytes of other objects
            self._pwrite_all(fd, staging[offset:end], extent.offset + offset)

        try:
            self._parallel(span, write_direct)
        finally:
            self._release_big_staging()

    def write(self, extent: Extent, offset: int, data: Any) -> None:
        """Write ``data`` at ``offset`` bytes into ``extent`` (any offset and length).

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

    def read_into(self, extent: Extent, offset: int, out: Any) -> None:
        """Fill ``out`` from ``offset`` bytes into ``extent`` (no verification; see read_layers).

        Reads straight into ``out`` when it and the range are 4 KiB-aligned (or
        I/O is buffered); otherwise through an aligned bounce buffer.
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

    def _index_write(self, operation: Callable[[Any], Any]) -> Any:
        """Run ``operation(txn)`` in one write transaction, growing the map when full."""
        with self._index_lock:
            while True:
                try:
                    with self._env.begin(write=True, db=self._objects_db) as txn:
                        return operation(txn)
                except lmdb.MapFullError:
                    # No write txn is open now (it aborted); readers here only
                    # hold short transactions, so growing the map is safe.
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
                except lmdb.Error as exc:
                    raise errors.TierError(f"nvme: index update failed at {self.path}: {exc}") from exc

    def commit(self, key: bytes, extent: Extent, header: ObjectHeader) -> None:
        """Record a fully written object so a restarted tier finds it.

        Replaces any record of the same key. With ``fsync`` the segment is
        fdatasync'ed first, so the record never points at bytes still in flight.
        """
        self._check_open()
        key = bytes(key)
        if not 0 < len(key) <= self._env.max_key_size():
            raise errors.InvalidKeyError(
                f"nvme: keys must be 1..{self._env.max_key_size()} bytes, got {len(key)}"
            )
        self._check_range(extent, 0, header.spec.total_nbytes)
        if self.fsync:
            try:
                os.fdatasync(self._fd(extent))
            except OSError as exc:
                raise self._io_error(exc, "fdatasync before commit") from exc
        record = msgpack.packb([extent.segment, extent.offset, extent.nbytes, header.pack()])
        self._index_write(lambda txn: txn.put(key, record))

    def forget(self, key: bytes, extent: Extent) -> None:
        """Delete ``key``'s record if it still names ``extent`` (a newer commit is kept)."""
        self._check_open()
        key = bytes(key)

        def delete_if_same(txn: Any) -> None:
            raw = txn.get(key)
            if raw is None:
                return
            try:
                segment, offset, nbytes, _ = msgpack.unpackb(raw)
            except (ValueError, TypeError):
                txn.delete(key)  # unreadable: it could only ever be dropped
                return
            if (segment, offset, nbytes) == (extent.segment, extent.offset, extent.nbytes):
                txn.delete(key)

        self._index_write(delete_if_same)

    def recover(self) -> Iterator[tuple[bytes, Extent, ObjectHeader]]:
        """Every object in the index, as (key, extent, header).

        Their space was reserved when the tier opened (records that failed to
        parse or overlapped were dropped and logged then), so the caller may
        forget and free what it does not want while iterating.
        """
        self._check_open()
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
            "path": str(self.path),
            "segment_bytes": self.segment_bytes,
            "segments_created": len(self._fds),
            "indexed_objects": indexed,
            "recovered_objects": self.recovered_objects,
            "dropped_records": self.dropped_records,
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
                self._env.close()
                self._env = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._local = threading.local()  # drops this thread's staging buffer; others die with their threads
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __repr__(self) -> str:
        return f"<NvmeTier {self.path} {self.used_bytes}/{self.capacity_bytes} bytes direct_io={self.direct_io}>"
