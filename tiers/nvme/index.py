"""Opening the nvme tier: its directory lock, the LMDB index (checked before LMDB maps it),
the layout check, and rebuilding the index from the segments when it is missing or corrupt."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import msgspec
import numpy as np

from kvpool import errors
from kvpool.config import GiB, MiB
from kvpool.objformat import LayerRange, ObjectHeader, stored_header_checksum
from tiers.base import Extent, ExtentAllocator, round_up
from tiers.nvme.fs import filesystem_type, make_private_dirs, probe_direct_io
from tiers.nvme.layout import (
    ALIGN,
    INDEX_ASIDE,
    INDEX_DIR,
    LAYOUT_VERSION,
    LOCK_NAME,
    MAGIC_U64,
    MEMORY_FILESYSTEMS,
    PREFIX_GAP_BYTES,
    PREFIX_NBYTES,
    PREFIX_WINDOW_BYTES,
    SCAN_WINDOW_BYTES,
    SEGMENT_RE,
    TOMBSTONE,
    Prefix,
    pack_prefix,
    parse_prefix,
)
from tiers.nvme.lmdbcheck import lmdb_file_problem
from tiers.nvme.segments import SegmentFiles

if TYPE_CHECKING:
    pass


log = logging.getLogger("tiers.nvme")
_MAX_SEGMENTS = 100_000  # segment files are named with five digits


class _BeyondCapacity(errors.TierError):
    """An index record of an object stored past this tier's capacity: written when
    ``tiers.nvme.capacity`` was larger (its segment file is there). Dropped, not a
    sign of a damaged index."""


class IndexedSegments(SegmentFiles):
    """Segment files plus their LMDB index (a base of NvmeTier)."""

    # Set by NvmeTier.__init__.
    configured_capacity_bytes: int
    direct_io_reason: str
    _lock_fd: int | None
    _env: Any
    _objects_db: Any
    _meta_db: Any
    _index_lock: threading.Lock
    _blocked: list[int]
    _blocked_ranges: list[list[tuple[int, int]]]
    _file_limit: int | None
    _loaded: list[tuple[bytes, Extent, ObjectHeader]] | None
    dropped_records: int
    dropped_keys: list[bytes]  # keys of the objects dropped at open because they lay beyond the capacity
    index_rebuilt: str
    recovered_objects: int

    # -- space the index and the allocators share ------------------------------------

    def allocated_size(self, nbytes: int) -> int:
        return PREFIX_NBYTES + round_up(max(nbytes, 1), ALIGN)

    def _reserve_recovered(self, extent: Extent) -> None:
        with self._alloc_lock:
            self._segments[extent.segment].reserve(extent.offset - PREFIX_NBYTES, self.allocated_size(extent.nbytes))

    def _reset_allocators(self) -> None:
        """Forget every reservation (before rebuilding them from the segment files)."""
        with self._alloc_lock:
            self._segments = [ExtentAllocator(s.capacity, ALIGN) for s in self._segments]
            self._blocked = [0] * len(self._segments)
            self._blocked_ranges = [[] for _ in self._segments]

    def _index_write(self, operation: Callable[[Any], Any]) -> Any:
        """Run ``operation(txn)`` in one write transaction, growing the map when full."""
        with self._index_lock:
            self._loaded = None
            while True:
                try:
                    with self._env.begin(write=True, db=self._objects_db) as txn:
                        return operation(txn)
                except lmdb.MapFullError:
                    # No write txn is open now (it aborted); readers here only
                    # hold short transactions, so growing the map is safe.
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
                except lmdb.Error as exc:
                    if isinstance(exc, lmdb.DiskError) or "No space" in str(exc):
                        raise errors.DiskFullError(errno.ENOSPC, f"nvme: index update failed at {self.path}: "
                                                                 f"{exc}") from exc
                    raise errors.TierError(f"nvme: index update failed at {self.path}: {exc}") from exc

    # -- opening ----------------------------------------------------------------

    def _open(self, direct_io: str) -> None:
        try:
            make_private_dirs(self.path)
        except OSError as exc:
            raise errors.TierError(f"nvme: cannot create {self.path}: {exc}") from exc
        self._take_lock()
        self._choose_io_mode(direct_io)
        self._open_index()
        if self.io_threads > 1:
            # The calling thread does I/O too, so io_threads - 1 helpers give io_threads in flight.
            self._pool = ThreadPoolExecutor(self.io_threads - 1, thread_name_prefix="kvpool-nvme-io")

    def _take_lock(self) -> None:
        lock_path = self.path / LOCK_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise errors.PoolLockedError(
                f"nvme directory {self.path} is in use by another live tier (pid {holder})"
            ) from None
        os.fchmod(fd, 0o600)  # a LOCK left by an older build may be world-readable
        # The pid is only for the message above; the flock is what excludes (and dies with us).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _choose_io_mode(self, mode: str) -> None:
        if mode == "off":
            self.direct_io, self.direct_io_reason = False, "disabled (direct_io='off')"
            return
        refused = probe_direct_io(self.path)
        if refused is not None:
            if mode == "on":
                raise errors.TierError(f"nvme: direct_io='on' but {self.path}: {refused}")
            self.direct_io, self.direct_io_reason = False, f"buffered I/O: {refused}"
            log.warning("nvme tier at %s: O_DIRECT unavailable, using buffered I/O: %s", self.path, refused)
            return
        memory_fs = MEMORY_FILESYSTEMS.get(filesystem_type(self.path) or 0)
        if memory_fs and mode == "auto":
            self.direct_io = False
            self.direct_io_reason = (f"buffered I/O: {memory_fs} keeps files in memory, "
                                     "so O_DIRECT would bypass no cache")
            log.info("nvme tier at %s: %s", self.path, self.direct_io_reason)
            return
        self.direct_io, self.direct_io_reason = True, "O_DIRECT"

    def _segment_files(self) -> dict[int, Path]:
        found = {}
        for entry in self.path.iterdir():
            match = SEGMENT_RE.fullmatch(entry.name)
            if match:
                found[int(match.group(1))] = entry
        return found

    def _layout(self) -> dict[str, int]:
        return {"version": LAYOUT_VERSION, "alignment": ALIGN, "segment_bytes": self.segment_bytes}

    def _open_index(self) -> None:
        """Open the index, or rebuild it from the segments if it is missing or cannot be trusted."""
        index_path = self.path / INDEX_DIR
        segments = self._segment_files()
        problem: str | None = None
        if not os.path.lexists(index_path):
            problem = "it is missing" if segments else None
        elif index_path.is_symlink() or not index_path.is_dir():
            problem = "it is not a directory"
        elif (index_path / "data.mdb").exists():
            problem = lmdb_file_problem(index_path / "data.mdb")
        elif segments:
            problem = "it holds no data.mdb"
        if problem is None:
            try:
                self._open_env()
                problem = self._check_layout()
                if problem is None:
                    problem = self._load_index()
            except lmdb.Error as exc:
                problem = f"LMDB refused it: {type(exc).__name__}: {exc}"
        if problem is not None:
            self._rebuild(problem)

    def _open_env(self) -> None:
        index_path = self.path / INDEX_DIR
        index_path.mkdir(mode=0o700, exist_ok=True)
        # Only this process uses the index (LOCK is ours), so no reader table
        # can be live: a stale or corrupt lock file would only be trouble.
        (index_path / "lock.mdb").unlink(missing_ok=True)
        for name in ("data.mdb",):
            if (index_path / name).exists():
                os.chmod(index_path / name, 0o600)
        # The map grows on demand (_index_write); start near what realistic objects (MiBs) need.
        map_size = round_up(max(64 * MiB, min(self.configured_capacity_bytes // 256, 4 * GiB)), mmap.PAGESIZE)
        # sync follows fsync: without it a commit survives a process crash
        # (the pages are in the kernel) but not a power loss.
        self._env = lmdb.open(str(index_path), map_size=map_size, max_dbs=2, subdir=True, mode=0o600,
                              sync=self.fsync, metasync=self.fsync, readahead=False)
        self._objects_db = self._env.open_db(b"objects")
        self._meta_db = self._env.open_db(b"meta")

    def _close_env(self) -> None:
        if self._env is not None:
            try:
                self._env.close()
            finally:
                self._env = None

    def _check_layout(self) -> str | None:
        """None if the index's layout matches; a problem if it is unreadable. Raises on another geometry."""
        layout = self._layout()
        with self._env.begin(write=True, db=self._meta_db) as txn:
            stored = txn.get(b"layout")
            if stored is None:
                if txn.stat(self._objects_db)["entries"]:
                    return "it has records but no layout"
                txn.put(b"layout", msgspec.msgpack.encode(layout))
                return None
            stored = bytes(stored)
        try:
            found = msgspec.msgpack.decode(stored)
        except (ValueError, TypeError, msgspec.DecodeError) as exc:
            return f"its layout record is unreadable ({exc})"
        if not (isinstance(found, dict) and set(found) == set(layout)
                and all(isinstance(v, int) for v in found.values())):
            return f"its layout record is malformed ({found!r:.80})"
        if found != layout:
            # Offsets in the index are relative to segments of the old size: reading
            # them with another geometry would hand out other objects' bytes.
            raise errors.TierError(
                f"nvme: {self.path} was laid out as {found}, this tier asks for {layout}; "
                f"reopen with segment_size={found.get('segment_bytes')} or use another directory"
            )
        return None

    def _load_index(self) -> str | None:
        """Reserve every indexed extent, each checked against its segment's record prefix.

        Returns why the index cannot be trusted (then the caller rebuilds it),
        or None. Records whose prefix is already a tombstone of the same put (a
        forget that died between the two) are dropped here; that is the one
        disagreement a crash leaves.
        """
        with self._env.begin(db=self._objects_db) as txn:
            entries = txn.stat(self._objects_db)["entries"]
            raws = [(bytes(key), bytes(raw)) for key, raw in txn.cursor()]
        if len(raws) != entries:
            return f"it lists {len(raws)} records but counts {entries}"
        bad: list[tuple[bytes, str]] = []
        outside: list[bytes] = []  # records of objects past the capacity (see _BeyondCapacity)
        parsed = []
        for key, raw in raws:
            try:
                parsed.append((key, *self._parse_record(raw)))
            except _BeyondCapacity:
                outside.append(key)
            except (errors.FormatError, errors.TierError, ValueError, TypeError, msgspec.DecodeError) as exc:
                bad.append((key, str(exc)))
        parsed.sort(key=lambda item: (item[1].segment, item[1].offset))  # sequential prefix reads
        stale: list[bytes] = []
        loaded: list[tuple[bytes, Extent, ObjectHeader]] = []
        for key, extent, header, prefix in self._recovered_prefixes(parsed):
            if isinstance(prefix, Exception):
                bad.append((key, str(prefix)))
                continue
            same = (prefix is not None and prefix.key == key and prefix.generation == header.generation
                    and prefix.nbytes == extent.nbytes and prefix.header_sum == stored_header_checksum(header.pack()))
            if same and prefix is not None and prefix.state == TOMBSTONE:
                stale.append(key)
                continue
            if not same:
                bad.append((key, "its segment record disagrees (" + ("no record prefix" if prefix is None else
                                                                    f"prefix names {prefix.key[:32].hex()}") + ")"))
                continue
            try:
                self._reserve_recovered(extent)
            except errors.TierError as exc:
                bad.append((key, str(exc)))
                continue
            self.recovered_objects += 1
            loaded.append((key, extent, header))
        self._release_big_staging()
        if bad:
            for key, why in bad[:20]:
                log.warning("nvme tier at %s: dropped index record %s: %s", self.path, key[:64].hex(), why)
            self.dropped_records = len(bad)
            self.recovered_objects = 0
            self._reset_allocators()
            return f"{len(bad)} of its {len(raws)} records are unreadable or disagree with the segment files"
        if stale or outside:
            self._index_write(lambda txn: [txn.delete(key) for key in stale + outside])
            self.dropped_records = len(stale) + len(outside)
            self.dropped_keys = outside
        if stale:
            log.info("nvme tier at %s: dropped %d index records of objects already tombstoned", self.path, len(stale))
        if outside:
            log.warning("nvme tier at %s: dropped %d objects stored beyond tiers.nvme.capacity (%d bytes; they "
                        "were put with a larger one)", self.path, len(outside), self.configured_capacity_bytes)
        self._trim_to_capacity()
        self._loaded = loaded
        return None

    def _trim_to_capacity(self) -> None:
        """Delete the segment files wholly past the capacity and cut a longer last segment to
        its share, once no index record names what lies there (the capacity is the bytes of
        segment files this tier keeps). Nothing put with a larger capacity can come back then,
        not even in a later rescan after the capacity was raised again (it may have been
        deleted meanwhile, where this tier could not mark it so)."""
        beyond = sorted(i for i in self._segment_files() if i >= len(self._segments))
        for index in beyond:
            try:
                self._segment_path(index).unlink()
            except OSError as exc:
                log.warning("nvme tier at %s: cannot remove %s beyond the capacity: %s", self.path,
                            self._segment_path(index).name, exc)
        if beyond:
            log.warning("nvme tier at %s: removed %d segment file(s) beyond tiers.nvme.capacity (%s .. %s)",
                        self.path, len(beyond), self._segment_path(beyond[0]).name,
                        self._segment_path(beyond[-1]).name)
        if self._segments:
            last = len(self._segments) - 1
            share = self._segments[last].capacity // ALIGN * ALIGN
            path = self._segment_path(last)
            try:
                if path.exists() and path.stat().st_size > share:
                    os.truncate(path, share)
                    log.warning("nvme tier at %s: cut %s to %d bytes, its share of tiers.nvme.capacity",
                                self.path, path.name, share)
            except OSError as exc:
                log.warning("nvme tier at %s: cannot cut %s to the capacity: %s", self.path, path.name, exc)

    def _recovered_prefixes(
        self, parsed: list[tuple[bytes, Extent, ObjectHeader]],
    ) -> Iterator[tuple[bytes, Extent, ObjectHeader, Prefix | None | Exception]]:
        """Each indexed record with the prefix its segment holds (or why it cannot be read).

        ``parsed`` is sorted by position. Prefixes close together are read in one
        ``pread`` of up to ``PREFIX_WINDOW_BYTES`` (the bytes between them come
        along when the gap is under ``PREFIX_GAP_BYTES``): small objects sit a few
        KiB apart, and one 4 KiB read each would make opening a large tier one disk round
        trip per object."""
        sizes: dict[int, int | Exception] = {}
        i = 0
        while i < len(parsed):
            segment = parsed[i][1].segment
            if segment not in sizes:
                try:
                    self._open_segment_fd(segment)
                    sizes[segment] = os.fstat(self._fds[segment]).st_size
                except (errors.TierError, OSError) as exc:
                    sizes[segment] = exc if isinstance(exc, errors.TierError) else errors.TierError(str(exc))
            size = sizes[segment]
            start = parsed[i][1].offset - PREFIX_NBYTES
            end, j = start + PREFIX_NBYTES, i + 1
            while j < len(parsed) and parsed[j][1].segment == segment:
                position = parsed[j][1].offset - PREFIX_NBYTES
                if position + PREFIX_NBYTES - start > PREFIX_WINDOW_BYTES or position - end > PREFIX_GAP_BYTES:
                    break
                end, j = position + PREFIX_NBYTES, j + 1
            window: np.ndarray | Exception
            if isinstance(size, Exception):
                window = size
            else:
                try:
                    window = self._staging(end - start)[:end - start]
                    self._pread_all(self._fds[segment], window, start)
                except (errors.KVPoolError, OSError) as exc:  # read one by one: one bad block spoils only its record
                    window = exc
            for key, extent, header in parsed[i:j]:
                position = extent.offset - PREFIX_NBYTES
                if isinstance(size, Exception):
                    yield key, extent, header, size
                elif size < position + self.allocated_size(extent.nbytes):
                    yield key, extent, header, errors.TierError(
                        f"segment file {self._segment_path(segment).name} is too short")
                elif isinstance(window, Exception):
                    try:
                        yield key, extent, header, self._read_prefix(self._fds[segment], position)
                    except (errors.TierError, errors.FormatError) as exc:
                        yield key, extent, header, exc
                else:
                    yield key, extent, header, parse_prefix(window[position - start:position - start + PREFIX_NBYTES])
            i = j

    def _parse_record(self, raw: Any) -> tuple[Extent, ObjectHeader]:
        fields = msgspec.msgpack.decode(bytes(raw))
        if not (isinstance(fields, list) and len(fields) == 4):
            raise errors.FormatError(f"index record is not [segment, offset, nbytes, header]: {fields!r:.80}")
        segment, offset, nbytes, header_bytes = fields
        if not (all(isinstance(v, int) for v in (segment, offset, nbytes)) and isinstance(header_bytes, bytes)):
            raise errors.FormatError("index record has fields of the wrong type")
        header = ObjectHeader.unpack(header_bytes)
        if header.spec.total_nbytes != nbytes:
            raise errors.FormatError(f"record says {nbytes} bytes, its header {header.spec.total_nbytes}")
        start = offset - PREFIX_NBYTES
        if start < 0 or start % ALIGN or start + self.allocated_size(nbytes) > self.segment_bytes \
                or not 0 <= segment < _MAX_SEGMENTS:
            raise errors.TierError(f"extent at {offset} (+{nbytes}) does not fit segment {segment}")
        if segment >= len(self._segments) or start + self.allocated_size(nbytes) > self._segments[segment].capacity:
            if self._segment_path(segment).exists():  # written with a larger capacity
                raise _BeyondCapacity(f"segment {segment} is beyond this tier's capacity")
            raise errors.TierError(f"segment {segment} is beyond this tier's capacity and its file is missing")
        return Extent(segment, offset, nbytes), header

    def _open_segment_fd(self, index: int) -> None:
        if index not in self._fds:
            path = self._segment_path(index)
            try:
                self._fds[index] = self._open_io_fd(path)
            except FileNotFoundError:
                raise errors.TierError(f"segment file {path.name} is missing") from None
            except OSError as exc:
                raise errors.TierError(f"cannot open {path}: {exc}") from exc

    # -- rebuilding the index from the segments ---------------------------------------

    def _set_index_aside(self) -> str:
        index_path, aside = self.path / INDEX_DIR, self.path / INDEX_ASIDE
        self._close_env()
        if not os.path.lexists(index_path):
            return "nothing to move aside"
        try:
            if os.path.lexists(aside):  # keep only the latest bad index: they are not small
                if aside.is_dir() and not aside.is_symlink():
                    shutil.rmtree(aside)
                else:
                    aside.unlink()
            os.rename(index_path, aside)
            return f"moved aside to {aside}"
        except OSError:
            if index_path.is_dir() and not index_path.is_symlink():
                shutil.rmtree(index_path, ignore_errors=True)
            else:
                index_path.unlink(missing_ok=True)
            return "deleted"

    def _rebuild(self, problem: str) -> None:
        """Replace the index with one rebuilt by scanning every segment file."""
        where = self._set_index_aside()
        log.warning("nvme tier at %s: the index %s cannot be used (%s); %s; rebuilding it from the segment files",
                    self.path, self.path / INDEX_DIR, problem, where)
        self.index_rebuilt = problem
        self._reset_allocators()
        self._open_env()
        self._check_layout()  # a fresh index: writes the layout
        live, tombstones, dropped, files = self._scan_segments()
        # Per key: the highest generation wins; a tombstone wins over live records
        # of lower generations; a tie goes to the live record (a moved object
        # keeps its generation, its old place may hold a tombstone of it).
        winners: dict[bytes, tuple[Extent, ObjectHeader]] = {}
        superseded: list[tuple[bytes, Extent, ObjectHeader]] = []
        for key, extent, header in sorted(live, key=lambda r: -r[2].generation):
            if key in winners or tombstones.get(key, -1) > header.generation:
                superseded.append((key, extent, header))
            else:
                winners[key] = (extent, header)
        for extent, _ in sorted(winners.values(), key=lambda found: (found[0].segment, found[0].offset)):
            self._reserve_recovered(extent)
        records = {key: msgspec.msgpack.encode([e.segment, e.offset, e.nbytes, h.pack()])
                   for key, (e, h) in winners.items()}

        def put_all(txn: Any) -> None:
            for key, record in records.items():
                txn.put(key, record)

        self._index_write(put_all)
        for key, extent, header in superseded:
            # Left live, it could come back in a later rescan once the newer record's space is reused.
            self._write_prefix(extent, pack_prefix(TOMBSTONE, key, extent.nbytes, header.generation,
                                                   stored_header_checksum(header.pack())))
        if self.fsync:
            for fd in self._fds.values():
                os.fdatasync(fd)
        self._env.sync(True)
        self._trim_to_capacity()
        self.recovered_objects = len(winners)
        self.dropped_records += dropped + len(superseded)
        log.warning("nvme tier at %s: index rebuilt from %d segment files: recovered %d objects, dropped %d "
                    "records (%d torn or corrupt, %d superseded by a newer generation or a tombstone), "
                    "%d tombstones seen", self.path, files, len(winners), dropped + len(superseded), dropped,
                    len(superseded), len(tombstones))

    def _scan_segments(self) -> tuple[list[tuple[bytes, Extent, ObjectHeader]], dict[bytes, int], int, int]:
        """Every verified live record, the newest tombstone per key, the count of bad records, files scanned."""
        live: list[tuple[bytes, Extent, ObjectHeader]] = []
        tombstones: dict[bytes, int] = {}
        dropped = 0
        files = 0
        for index, path in sorted(self._segment_files().items()):
            if index >= len(self._segments):
                log.warning("nvme tier at %s: ignoring %s, beyond this tier's capacity", self.path, path.name)
                continue
            size = path.stat().st_size
            if size > self.segment_bytes:
                raise errors.TierError(
                    f"nvme: {path} holds {size} bytes, more than segment_size={self.segment_bytes}: the directory "
                    f"was laid out with another segment_size (reopen with segment_size={size}?)")
            self._open_segment_fd(index)
            files += 1
            limit = min(size, self._segments[index].capacity) // ALIGN * ALIGN
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # buffered: a sequential scan wants readahead
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                dropped += self._scan_file(fd, index, limit, live, tombstones)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # do not leave the segment in the cache
            finally:
                os.close(fd)
        return live, tombstones, dropped, files

    def _scan_file(self, fd: int, index: int, limit: int, live: list[tuple[bytes, Extent, ObjectHeader]],
                   tombstones: dict[bytes, int]) -> int:
        dropped = 0
        window = bytearray(SCAN_WINDOW_BYTES)
        pos = 0
        while pos + 2 * ALIGN <= limit:
            wlen = min(SCAN_WINDOW_BYTES, limit - pos)
            got = os.preadv(fd, [memoryview(window)[:wlen]], pos)
            if got < ALIGN:
                break
            wlen = got // ALIGN * ALIGN
            heads = np.frombuffer(window, dtype="<u8", count=wlen // 8)[::ALIGN // 8]
            skip_until = pos
            for block in np.flatnonzero(heads == MAGIC_U64).tolist():
                at = pos + block * ALIGN
                if at < skip_until:
                    continue  # inside a record already taken: its payload, not a prefix
                prefix = parse_prefix(memoryview(window)[block * ALIGN:(block + 1) * ALIGN])
                if prefix is None:
                    continue
                if prefix.state == TOMBSTONE:
                    tombstones[prefix.key] = max(tombstones.get(prefix.key, -1), prefix.generation)
                    continue
                end = at + PREFIX_NBYTES + prefix.nbytes
                if end > limit:
                    dropped += 1
                    continue
                if end <= pos + wlen:
                    body: Any = memoryview(window)[at - pos + PREFIX_NBYTES:end - pos]
                else:
                    body = os.pread(fd, prefix.nbytes, at + PREFIX_NBYTES)
                header = self._verify_record(prefix, body)
                if header is None:
                    dropped += 1
                    continue
                live.append((prefix.key, Extent(index, at + PREFIX_NBYTES, prefix.nbytes), header))
                skip_until = at + PREFIX_NBYTES + round_up(prefix.nbytes, ALIGN)
            pos = max(pos + wlen, skip_until)
        return dropped

    @staticmethod
    def _verify_record(prefix: Prefix, body: Any) -> ObjectHeader | None:
        """The object's header if ``body`` is exactly the intact object ``prefix`` names, else None."""
        try:
            if len(body) != prefix.nbytes:
                return None
            header = ObjectHeader.unpack(body)
            if (stored_header_checksum(body) != prefix.header_sum or header.generation != prefix.generation
                    or not header.is_for(prefix.key) or header.spec.total_nbytes != prefix.nbytes):
                return None
            header.verify(LayerRange(0, header.spec.layers), memoryview(body)[header.nbytes:])
        except errors.FormatError:
            return None
        return header

