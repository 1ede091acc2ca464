"""The ``nvme`` tier: objects in preallocated segment files on a local SSD.

Owns one directory (created 0700; every file in it is created 0600)::

    LOCK              flock'ed by the live tier (a second one gets PoolLockedError)
    seg-00000.kvs     segment files, ``segment_size`` bytes each, created on first use
    index/            LMDB: key -> (segment, offset, nbytes, packed object header)
    index.corrupt/    the last index found unusable at open, kept for inspection

Record layout. Every object is stored as one *record*: a 4096-byte prefix
block followed by the object (packed header + layer-major payload), so both
stay 4096-aligned for O_DIRECT::

    record start (4096-aligned)              +4096                        +4096+nbytes
    | magic "KVPLREC1" | version u16 | state u16 | key_len u32 | nbytes u64
    | generation u64 | header_xxh3 u64 | prefix_xxh3 u64 | key | zeros | object ... | pad to 4096 |

``state`` is 1 (live) or 2 (tombstone); ``nbytes`` the object's length,
``generation`` and ``header_xxh3`` copies of the object header's generation
and stored checksum (they bind the prefix to exactly one put of the key);
``prefix_xxh3`` covers the fixed fields (itself zeroed) and the key. The
:class:`~tiers.base.Extent` the tier manager sees addresses the object only
(``offset`` = record start + 4096), and :meth:`NvmeTier.allocated_size`
counts the prefix block, so capacity accounting stays exact.

Write protocol. ``write_object`` zeroes the prefix block and writes the
object; ``commit(key)`` then writes the live prefix (the segment's own commit
record), fdatasyncs with ``fsync=True``, and only then records the key in
LMDB. ``forget`` overwrites the prefix with a tombstone of the same key and
generation *before* the index record goes, and a commit that replaces a key's
record tombstones the replaced one, so a forgotten object never comes back
from a rescan. An object whose write was cut short (kill -9) has no index
record, and on a rescan its prefix is missing, names another object's header
checksum, or its header/layer checksums fail: it is absent either way.

Open and recovery. The LMDB index is the fast path, and it is never trusted
blindly: before LMDB maps ``data.mdb`` its meta pages and whole B-tree are
checked in Python (magic, page size, every page number below the meta's
``last_pg``, ``last_pg`` inside the file, node bounds, overflow runs, page and
entry counts, free list disjoint from live pages). That is what keeps LMDB from
touching memory past the end of a truncated file (its map is larger than the
file, so such a read is SIGBUS, not an error). Every index record is then
checked against its segment prefix (key, generation, size, header checksum).
Any disagreement other than a known crash window (a prefix already
tombstoned by a ``forget`` that died before its index delete), a raw
``lmdb.Error``, a missing index or garbage in its place makes the tier log a
warning naming the path, move the index aside and rebuild it by scanning the
segment files: every 4096-aligned block that starts with the magic and has a
valid prefix checksum is a candidate; a live record counts only if its
object's header checksum, generation, key digest and every layer checksum
verify. Per key the highest generation wins (a tombstone beats live records of
lower generations; ties go to the live one, since a moved object keeps its
generation); superseded live records are tombstoned. One line logs the
counts (recovered / dropped / superseded / tombstones).

Full disk. Segment files are preallocated with ``posix_fallocate``, so a full
filesystem shows up when a segment is prepared, not as a torn write later.
ENOSPC/EDQUOT/EFBIG there (or from any write) lowers the tier's *effective*
capacity, ``capacity_bytes``, to what the filesystem really holds (space
already preallocated plus what is free now, less a reserve for the index;
with EFBIG the process's RLIMIT_FSIZE caps every segment file), logs one
warning naming the directory and that capacity, and raises
:class:`kvpool.errors.DiskFullError` for the failed operation. The space above
the effective capacity is blocked in the allocators, so ``allocate`` returns
None once the rest is used, which makes the tier manager evict. Nothing
stored is touched. The capacity stays lowered until the tier is reopened;
``stats()`` reports ``capacity_bytes`` (effective),
``configured_capacity_bytes`` and ``disk_limited``.

Reads. Stored bytes are verified on every read (per-layer xxh3). A record cut
short (segment truncated under a running tier) or unreadable (EIO and kin)
raises ChecksumError, which the tier manager turns into a miss.

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
import re
import resource
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import lmdb
import msgpack
import numpy as np
import xxhash

from kvpool import errors
from kvpool.config import GiB, MiB
from kvpool.objformat import LayerRange, ObjectHeader, stored_header_checksum
from tiers.base import Extent, ExtentAllocator, Tier, round_up

if TYPE_CHECKING:
    from kvpool.config import Config, NvmeSection

log = logging.getLogger(__name__)

#: Extent and I/O alignment: O_DIRECT needs the logical block size (512 or 4096).
ALIGN = 4096
#: Bytes of record prefix in front of every object (one aligned block).
PREFIX_NBYTES = ALIGN
# Opening: record prefixes closer than _PREFIX_GAP_BYTES are read together, up to a window.
_PREFIX_WINDOW_BYTES = 8 << 20
_PREFIX_GAP_BYTES = 64 << 10
LAYOUT_VERSION = 2  # 2: every object is preceded by a record prefix
SEGMENT_NAME = "seg-{:05d}.kvs"
_SEGMENT_RE = re.compile(r"seg-(\d{5})\.kvs")
INDEX_DIR = "index"
INDEX_ASIDE = "index.corrupt"
LOCK_NAME = "LOCK"

RECORD_MAGIC = b"KVPLREC1"
_RECORD_VERSION = 1
_LIVE, _TOMBSTONE = 1, 2
# magic | version | state | key_len | nbytes | generation | header_xxh3 | prefix_xxh3, then the key
_PREFIX = struct.Struct("<8sHHIQQQQ")
_PREFIX_SUM_OFFSET = 40
MAX_KEY_NBYTES = PREFIX_NBYTES - _PREFIX.size
_MAGIC_U64 = int.from_bytes(RECORD_MAGIC, "little")

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
# Read errors that mean "these stored bytes cannot be had": a miss, like rot.
_UNREADABLE_ERRNOS = frozenset(
    e for e in (errno.EIO, errno.ENXIO, errno.ENODATA, errno.EBADMSG, getattr(errno, "EUCLEAN", None),
                getattr(errno, "ESTALE", None)) if e is not None
)
# statfs f_type of filesystems that keep file data in memory: there is no page
# cache to bypass, so O_DIRECT buys nothing and only adds alignment rules.
_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
# Staging buffers grow in these steps and are kept per thread unless larger than
# the limit (a one-off huge object should not pin that much memory forever).
_STAGING_GRAIN_BYTES = 1 * MiB
_STAGING_KEEP_BYTES = 256 * MiB
# When the disk fills, this much of the free space is left to the LMDB index
# (on the same filesystem): records are ~100 B + 8 B per layer, copy-on-write.
_INDEX_RESERVE_BYTES = 1 * MiB
_SCAN_WINDOW_BYTES = 8 * MiB


class _Prefix(NamedTuple):
    state: int
    key: bytes
    nbytes: int
    generation: int
    header_sum: int


def pack_prefix(state: int, key: bytes, nbytes: int, generation: int, header_sum: int) -> bytes:
    """One prefix block (``PREFIX_NBYTES``) for a live record or a tombstone."""
    if len(key) > MAX_KEY_NBYTES:
        raise errors.InvalidKeyError(f"nvme: keys must be at most {MAX_KEY_NBYTES} bytes, got {len(key)}")
    block = bytearray(PREFIX_NBYTES)
    _PREFIX.pack_into(block, 0, RECORD_MAGIC, _RECORD_VERSION, state, len(key), nbytes, generation, header_sum, 0)
    block[_PREFIX.size:_PREFIX.size + len(key)] = key
    struct.pack_into("<Q", block, _PREFIX_SUM_OFFSET, xxhash.xxh3_64_intdigest(bytes(block[:_PREFIX.size + len(key)])))
    return bytes(block)


def parse_prefix(block: Any) -> _Prefix | None:
    """The record a prefix block describes, or None if it is not an intact prefix."""
    mv = memoryview(block).cast("B")
    if len(mv) < _PREFIX.size:
        return None
    magic, version, state, key_len, nbytes, generation, header_sum, prefix_sum = _PREFIX.unpack_from(mv, 0)
    if magic != RECORD_MAGIC or version != _RECORD_VERSION or state not in (_LIVE, _TOMBSTONE):
        return None
    if not 0 < key_len <= MAX_KEY_NBYTES or len(mv) < _PREFIX.size + key_len:
        return None
    covered = bytearray(mv[:_PREFIX.size + key_len])
    struct.pack_into("<Q", covered, _PREFIX_SUM_OFFSET, 0)
    if xxhash.xxh3_64_intdigest(bytes(covered)) != prefix_sum:
        return None
    return _Prefix(state, bytes(mv[_PREFIX.size:_PREFIX.size + key_len]), nbytes, generation, header_sum)


# -- LMDB file check -----------------------------------------------------------------
#
# LMDB 0.9 on-disk format: page header = pgno u64, pad u16, flags u16, lower
# u16, upper u16 (overflow pages: page count u32 in place of lower/upper); the
# meta (pages 0 and 1) follows the header: magic u32, version u32, address u64,
# mapsize u64, two MDB_db (free, main), last_pg u64, txnid u64. MDB_db = pad
# u32 (page size in the free DB's), flags u16, depth u16, branch/leaf/overflow
# page counts, entries, root (u64 each). Nodes: lo u16, hi u16, flags u16,
# ksize u16, key, data.

_PAGE_HDR = struct.Struct("<QHHHH")
_MDB_DB = struct.Struct("<IHHQQQQQ")
_NODE = struct.Struct("<HHHH")
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_DATA_VERSION = 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_MDB_DUPSORT = 0x04
_P_INVALID = (1 << 64) - 1


class _LmdbCorrupt(Exception):
    pass


class _LmdbFileCheck:
    """Walks an LMDB data file the way LMDB would read it, refusing anything out of bounds."""

    def __init__(self, data: Any, size: int) -> None:
        self.data = data
        self.size = size
        self.psize = 0
        self.next_pgno = 0
        self.seen: set[int] = set()

    def run(self) -> None:
        if self.size < 2 * 512:
            raise _LmdbCorrupt(f"{self.size} bytes is shorter than two meta pages")
        metas = []
        offset = 0
        for i in range(2):
            if offset + 152 > self.size:
                raise _LmdbCorrupt(f"meta page {i} lies past the end of the file")
            pgno, _pad, flags, _lo, _up = _PAGE_HDR.unpack_from(self.data, offset)
            magic, version = struct.unpack_from("<II", self.data, offset + 16)
            if not flags & _P_META or magic != _LMDB_MAGIC or version != _LMDB_DATA_VERSION:
                raise _LmdbCorrupt(f"meta page {i} is not an LMDB meta page")
            free_db = _MDB_DB.unpack_from(self.data, offset + 40)
            main_db = _MDB_DB.unpack_from(self.data, offset + 88)
            last_pg, txnid = struct.unpack_from("<QQ", self.data, offset + 136)
            psize = free_db[0]
            if i == 0:
                if psize < 512 or psize > 65536 or psize & (psize - 1):
                    raise _LmdbCorrupt(f"page size {psize} is impossible")
                self.psize = psize
            elif psize != self.psize:
                raise _LmdbCorrupt("the two meta pages disagree on the page size")
            if not 2 <= last_pg + 1 or (last_pg + 1) * psize > self.size or last_pg >= 1 << 40:
                # LMDB would map and read pages up to last_pg: past the file's end that is SIGBUS.
                raise _LmdbCorrupt(f"meta page {i} claims {last_pg + 1} pages, the file holds "
                                   f"{self.size // psize}")
            metas.append((txnid, last_pg, free_db, main_db))
            offset += psize
        # LMDB uses the meta with the higher txnid (meta 0 on a tie).
        _txnid, last_pg, free_db, main_db = metas[1] if metas[1][0] > metas[0][0] else metas[0]
        self.next_pgno = last_pg + 1
        self.seen = {0, 1}
        subs: list[tuple[bytes, tuple[int, ...]]] = []

        def main_value(key: bytes, flags: int, value: bytes) -> None:
            if flags & _F_SUBDATA:
                if len(value) != _MDB_DB.size:
                    raise _LmdbCorrupt("a named database record has the wrong size")
                subs.append((key, _MDB_DB.unpack(value)))

        self.walk("main", main_db, main_value)
        for name, db in subs:
            if db[1] & _MDB_DUPSORT:
                raise _LmdbCorrupt(f"database {name!r} claims DUPSORT, which this index never uses")
            self.walk(repr(name), db, None)
        free_pages: list[int] = []

        def free_value(_key: bytes, _flags: int, value: bytes) -> None:
            if len(value) < 8 or len(value) % 8:
                raise _LmdbCorrupt("a free-list record is not a page list")
            ids = np.frombuffer(value, dtype="<u8")
            if int(ids[0]) != len(ids) - 1:
                raise _LmdbCorrupt("a free-list record's count disagrees with its length")
            free_pages.extend(int(p) for p in ids[1:])

        self.walk("free", free_db, free_value)
        for pgno in free_pages:
            if not 2 <= pgno < self.next_pgno or pgno in self.seen:
                # LMDB would hand such a page out for a new write: over a live page, or past the end.
                raise _LmdbCorrupt(f"free list names page {pgno}, which is live or out of range")

    def page(self, pgno: int) -> int:
        if not 2 <= pgno < self.next_pgno:
            raise _LmdbCorrupt(f"page number {pgno} is outside [2, {self.next_pgno})")
        if pgno in self.seen:
            raise _LmdbCorrupt(f"page {pgno} is reachable twice")
        self.seen.add(pgno)
        return pgno * self.psize

    def walk(self, name: str, db: tuple[int, ...], on_value: Callable[[bytes, int, bytes], None] | None) -> None:
        _pad, _flags, depth, branch_pages, leaf_pages, overflow_pages, entries, root = db
        if root == _P_INVALID:
            if entries or depth or branch_pages or leaf_pages or overflow_pages:
                raise _LmdbCorrupt(f"empty database {name} claims {entries} entries")
            return
        counts = {"branch": 0, "leaf": 0, "overflow": 0, "entries": 0}
        leaf_level: set[int] = set()
        stack = [(root, 1)]
        psize = self.psize
        while stack:
            pgno, level = stack.pop()
            if level > 64:
                raise _LmdbCorrupt(f"database {name} is deeper than any real B-tree")
            base = self.page(pgno)
            stored, _pad2, flags, lower, upper = _PAGE_HDR.unpack_from(self.data, base)
            kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META | _P_LEAF2)
            if stored != pgno or kind not in (_P_BRANCH, _P_LEAF):
                raise _LmdbCorrupt(f"page {pgno} of {name} has a bad header")
            if not (16 <= lower <= upper <= psize) or (lower - 16) % 2 or lower == 16:
                raise _LmdbCorrupt(f"page {pgno} of {name} has bad bounds")
            nodes = (lower - 16) // 2
            counts["branch" if kind == _P_BRANCH else "leaf"] += 1
            if kind == _P_LEAF:
                leaf_level.add(level)
            for i in range(nodes):
                ptr = struct.unpack_from("<H", self.data, base + 16 + 2 * i)[0]
                if not upper <= ptr <= psize - _NODE.size:
                    raise _LmdbCorrupt(f"page {pgno} of {name} has a node outside the page")
                lo, hi, nflags, ksize = _NODE.unpack_from(self.data, base + ptr)
                key_end = ptr + _NODE.size + ksize
                if key_end > psize:
                    raise _LmdbCorrupt(f"page {pgno} of {name} has a key past the page")
                if kind == _P_BRANCH:
                    stack.append((lo | hi << 16 | nflags << 32, level + 1))
                    continue
                counts["entries"] += 1
                dsize = lo | hi << 16
                if nflags & _F_DUPDATA:
                    raise _LmdbCorrupt(f"page {pgno} of {name} holds duplicate data, never written here")
                if nflags & _F_BIGDATA:
                    if key_end + 8 > psize:
                        raise _LmdbCorrupt(f"page {pgno} of {name} has an overflow pointer past the page")
                    first = struct.unpack_from("<Q", self.data, base + key_end)[0]
                    obase = self.page(first)
                    _s, _p, oflags, pages = struct.unpack_from("<QHHI", self.data, obase)
                    if not oflags & _P_OVERFLOW or pages < 1 or first + pages > self.next_pgno \
                            or pages * psize - 16 < dsize:
                        raise _LmdbCorrupt(f"overflow run at page {first} of {name} is out of bounds")
                    for extra in range(first + 1, first + pages):
                        self.page(extra)
                    counts["overflow"] += pages
                    value_at = obase + 16
                else:
                    if key_end + dsize > psize:
                        raise _LmdbCorrupt(f"page {pgno} of {name} has a value past the page")
                    value_at = base + key_end
                if on_value is not None:
                    key = bytes(self.data[base + ptr + _NODE.size:base + key_end])
                    on_value(key, nflags, bytes(self.data[value_at:value_at + dsize]))
        if len(leaf_level) != 1 or leaf_level.pop() != depth:
            raise _LmdbCorrupt(f"database {name}'s leaves are not all at its depth {depth}")
        if (counts["branch"], counts["leaf"], counts["overflow"], counts["entries"]) != (
                branch_pages, leaf_pages, overflow_pages, entries):
            raise _LmdbCorrupt(f"database {name}'s page and entry counts disagree with its tree")


def _lmdb_file_problem(data_path: Path) -> str | None:
    """Why LMDB must not open ``data_path``, or None if every page it could read is sound."""
    try:
        with open(data_path, "rb") as f:
            # read, not mmap: a file that shrank under us must not SIGBUS the check itself
            data = f.read()
    except OSError as exc:
        return f"cannot read {data_path.name}: {exc}"
    try:
        _LmdbFileCheck(data, len(data)).run()
    except _LmdbCorrupt as exc:
        return f"{data_path.name}: {exc}"
    except struct.error as exc:  # a structure read past the end of the file
        return f"{data_path.name}: truncated structure ({exc})"
    return None


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


def _file_size_limit() -> int | None:
    """This process's RLIMIT_FSIZE (None when unlimited): writes past it fail with EFBIG."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _make_private_dirs(path: Path) -> None:
    """``mkdir -p`` where every directory this creates (the data dir too, not only ``nvme/``)
    is 0700; directories that already exist keep their mode."""
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made meanwhile by another process: not ours to change
        os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask


class NvmeTier(Tier):
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
        self._file_limit: int | None = None  # no segment byte at or past this offset is usable (EFBIG)
        self.disk_limited = ""  # why capacity_bytes is below the configured capacity
        self.disk_full_events = 0
        self.recovered_objects = 0  # found at open (from the index or a rescan)
        # What the open checked, kept for the first recover() (else the index is parsed twice);
        # dropped at the first index write.
        self._loaded: list[tuple[bytes, Extent, ObjectHeader]] | None = None
        self.dropped_records = 0  # index or segment records discarded at open
        self.index_rebuilt = ""  # why the index was rebuilt from the segments at open ("" if it was not)
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

    # -- space ------------------------------------------------------------------
    #
    # The allocators hand out whole records (prefix + object); extents name the object.

    def allocated_size(self, nbytes: int) -> int:
        return PREFIX_NBYTES + round_up(max(nbytes, 1), ALIGN)

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
            for index, segment in enumerate(self._segments):
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
                return Extent(index, start + PREFIX_NBYTES, nbytes)
        return None

    def free(self, extent: Extent) -> None:
        start, size = extent.offset - PREFIX_NBYTES, self.allocated_size(extent.nbytes)
        with self._alloc_lock:
            self._segments[extent.segment].free(start, size)
            if self._file_limit is not None and start + size > self._file_limit:
                # Space past the file size limit that an older object held is unusable now.
                self._block(extent.segment, max(start, self._file_limit), start + size)

    def _reserve_recovered(self, extent: Extent) -> None:
        with self._alloc_lock:
            self._segments[extent.segment].reserve(extent.offset - PREFIX_NBYTES, self.allocated_size(extent.nbytes))

    def _reset_allocators(self) -> None:
        """Forget every reservation (before rebuilding them from the segment files)."""
        with self._alloc_lock:
            self._segments = [ExtentAllocator(s.capacity, ALIGN) for s in self._segments]
            self._blocked = [0] * len(self._segments)

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
                self.capacity_bytes -= hi - lo

    def _lower_capacity(self, err: int | None, preallocated: int, why: str) -> None:
        """Lower ``capacity_bytes`` to what the filesystem holds (alloc lock held).

        ``preallocated``: bytes the tier holds on disk for sure (prepared
        segments, or the objects already written); to that comes what is free
        on the filesystem now, less a reserve for the index.
        """
        before = self.capacity_bytes
        self.disk_full_events += 1
        if err == errno.EFBIG:
            limit = _file_size_limit()
            if limit is not None:
                limit = limit // ALIGN * ALIGN
                self._file_limit = limit if self._file_limit is None else min(limit, self._file_limit)
                for index, segment in enumerate(self._segments):
                    self._block(index, self._file_limit, segment.capacity)
        try:
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        usable = max(0, free - _INDEX_RESERVE_BYTES - free // 128)
        excess = self.capacity_bytes - (preallocated + usable) // ALIGN * ALIGN
        # Block the highest free space first: new segments are prepared from the
        # front, so a partly usable segment keeps a usable head [0, x).
        for index in range(len(self._segments) - 1, -1, -1):
            if excess <= 0:
                break
            for offset, size in sorted(self._segments[index]._by_offset.items(), reverse=True):
                if excess <= 0:
                    break
                take = min(size, excess)
                self._block(index, offset + size - take, offset + size)
                excess -= take
        if self.capacity_bytes < before:
            first = not self.disk_limited
            self.disk_limited = (f"the filesystem under {self.path} holds {self.capacity_bytes} bytes for this tier "
                                 f"({why})")
            # One warning when the tier first learns its disk is smaller; later lowerings are routine.
            (log.warning if first else log.info)(
                "nvme tier at %s: the filesystem is smaller than tiers.nvme.capacity (%d bytes): "
                "effective capacity lowered to %d bytes (%s)",
                self.path, self.configured_capacity_bytes, self.capacity_bytes, why)

    def _disk_full_on_write(self, exc: errors.DiskFullError, extent: Extent) -> None:
        with self._alloc_lock:
            self._lower_capacity(exc.errno, self.used_bytes - self.allocated_size(extent.nbytes), str(exc))

    # -- opening ----------------------------------------------------------------

    def _open(self, direct_io: str) -> None:
        try:
            _make_private_dirs(self.path)
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

    def _segment_files(self) -> dict[int, Path]:
        found = {}
        for entry in self.path.iterdir():
            match = _SEGMENT_RE.fullmatch(entry.name)
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
            problem = _lmdb_file_problem(index_path / "data.mdb")
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
                txn.put(b"layout", msgpack.packb(layout))
                return None
            stored = bytes(stored)
        try:
            found = msgpack.unpackb(stored)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
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
        parsed = []
        for key, raw in raws:
            try:
                parsed.append((key, *self._parse_record(raw)))
            except (errors.FormatError, errors.TierError, ValueError, TypeError, msgpack.UnpackException) as exc:
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
            if same and prefix is not None and prefix.state == _TOMBSTONE:
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
        if stale:
            self._index_write(lambda txn: [txn.delete(key) for key in stale])
            self.dropped_records = len(stale)
            log.info("nvme tier at %s: dropped %d index records of objects already tombstoned", self.path, len(stale))
        self._loaded = loaded
        return None

    def _recovered_prefixes(
        self, parsed: list[tuple[bytes, Extent, ObjectHeader]],
    ) -> Iterator[tuple[bytes, Extent, ObjectHeader, _Prefix | None | Exception]]:
        """Each indexed record with the prefix its segment holds (or why it cannot be read).

        ``parsed`` is sorted by position. Prefixes close together are read in one
        ``pread`` of up to ``_PREFIX_WINDOW_BYTES`` (the bytes between them come
        along when the gap is under ``_PREFIX_GAP_BYTES``): small objects sit a few
        KiB apart, and one 4 KiB read each made opening 27k objects take 6 s."""
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
                if position + PREFIX_NBYTES - start > _PREFIX_WINDOW_BYTES or position - end > _PREFIX_GAP_BYTES:
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
        start = offset - PREFIX_NBYTES
        if start < 0 or start % ALIGN or start + self.allocated_size(nbytes) > self._segments[segment].capacity:
            raise errors.TierError(f"extent at {offset} (+{nbytes}) does not fit segment {segment}")
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
        records = {key: msgpack.packb([e.segment, e.offset, e.nbytes, h.pack()]) for key, (e, h) in winners.items()}

        def put_all(txn: Any) -> None:
            for key, record in records.items():
                txn.put(key, record)

        self._index_write(put_all)
        for key, extent, header in superseded:
            # Left live, it could come back in a later rescan once the newer record's space is reused.
            self._write_prefix(extent, pack_prefix(_TOMBSTONE, key, extent.nbytes, header.generation,
                                                   stored_header_checksum(header.pack())))
        if self.fsync:
            for fd in self._fds.values():
                os.fdatasync(fd)
        self._env.sync(True)
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
        window = bytearray(_SCAN_WINDOW_BYTES)
        pos = 0
        while pos + 2 * ALIGN <= limit:
            wlen = min(_SCAN_WINDOW_BYTES, limit - pos)
            got = os.preadv(fd, [memoryview(window)[:wlen]], pos)
            if got < ALIGN:
                break
            wlen = got // ALIGN * ALIGN
            heads = np.frombuffer(window, dtype="<u8", count=wlen // 8)[::ALIGN // 8]
            skip_until = pos
            for block in np.flatnonzero(heads == _MAGIC_U64).tolist():
                at = pos + block * ALIGN
                if at < skip_until:
                    continue  # inside a record already taken: its payload, not a prefix
                prefix = parse_prefix(memoryview(window)[block * ALIGN:(block + 1) * ALIGN])
                if prefix is None:
                    continue
                if prefix.state == _TOMBSTONE:
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
    def _verify_record(prefix: _Prefix, body: Any) -> ObjectHeader | None:
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

    # -- segments -----------------------------------------------------------------

    def _segment_path(self, index: int) -> Path:
        return self.path / SEGMENT_NAME.format(index)

    def _open_io_fd(self, path: Path) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        fd = os.open(path, flags)
        os.fchmod(fd, 0o600)  # segments written by an older build may be world-readable
        return fd

    def _prepare_segment(self, index: int, nbytes: int) -> None:
        """Create (or extend) segment ``index`` to ``nbytes`` of preallocated space."""
        path = self._segment_path(index)
        created = not path.exists()
        try:
            # A buffered fd for fallocate: where the filesystem lacks it, glibc
            # emulates it with one-byte writes, which O_DIRECT would refuse.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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

    def _prefix_buffer(self) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "prefix", None)
        if buf is None:
            buf = self._local.prefix = np.frombuffer(mmap.mmap(-1, PREFIX_NBYTES), dtype=np.uint8)
        return buf

    def _read_prefix(self, fd: int, position: int) -> _Prefix | None:
        buf = self._prefix_buffer()
        self._pread_all(fd, buf, position)
        return parse_prefix(buf)

    def _write_prefix(self, extent: Extent, block: bytes) -> None:
        buf = self._prefix_buffer()
        buf[:] = np.frombuffer(block, dtype=np.uint8)
        self._pwrite_all(self._fd(extent), buf, extent.offset - PREFIX_NBYTES)

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
        """Fill ``out`` from ``position``; a short or unreadable record is a ChecksumError (a miss)."""
        view = memoryview(out)  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            try:
                got = os.preadv(fd, [view[done:]], position + done)
            except OSError as exc:
                if exc.errno in _UNREADABLE_ERRNOS:
                    raise errors.ChecksumError(
                        f"nvme tier at {self.path}: stored bytes at {position + done} are unreadable: {exc}"
                    ) from exc
                raise self._io_error(exc, f"reading {len(view)} bytes at {position}") from exc
            if got <= 0:
                # The segment file was truncated under us: the record is gone, like rot.
                raise errors.ChecksumError(
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
        """Write a zeroed record prefix, then header + payload, into ``extent``'s record.

        The prefix is zeroed so no earlier record's prefix survives in front of
        new bytes; ``commit`` writes the real one. Raises DiskFullError on
        ENOSPC/EFBIG/EDQUOT after lowering the effective capacity (nothing
        outside the record is touched, so every stored object stays intact),
        TierError otherwise.
        """
        self._check_open()
        head = np.frombuffer(header.pack(), dtype=np.uint8)
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
        header_sum = stored_header_checksum(header.pack())
        try:
            self._write_prefix(extent, pack_prefix(_LIVE, key, extent.nbytes, header.generation, header_sum))
            if self.fsync:
                os.fdatasync(self._fd(extent))
        except OSError as exc:  # DiskFullError is an OSError too
            if isinstance(exc, errors.DiskFullError):
                self._disk_full_on_write(exc, extent)
                raise
            raise self._io_error(exc, "fdatasync before commit") from exc
        record = msgpack.packb([extent.segment, extent.offset, extent.nbytes, header.pack()])

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
            except (errors.FormatError, errors.TierError, ValueError, TypeError, msgpack.UnpackException):
                return
            if old_extent != extent:
                self._tombstone_quietly(key, old_extent, old_header.generation,
                                        stored_header_checksum(old_header.pack()))

    def _tombstone_quietly(self, key: bytes, extent: Extent, generation: int, header_sum: int) -> None:
        try:
            self._write_prefix(extent, pack_prefix(_TOMBSTONE, key, extent.nbytes, generation, header_sum))
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
        if prefix is not None and prefix.state == _LIVE and prefix.key == key:
            self._tombstone_quietly(key, extent, prefix.generation, prefix.header_sum)

        def delete_if_same(txn: Any) -> None:
            raw = txn.get(key)
            if raw is None:
                return
            try:
                segment, offset, nbytes, _ = msgpack.unpackb(raw)
            except (ValueError, TypeError, msgpack.UnpackException):
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
