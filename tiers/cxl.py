"""The ``cxl`` tier: a shared-memory arena that every process on the host can map.

CXL 3.0 Type 3 memory is byte-addressable memory that several hosts (here:
processes) map at once. We emulate it with one file under ``/dev/shm``
(``/dev/shm/kvpool-<pool name>-cxl`` unless a path is configured), sized with
``ftruncate`` + ``posix_fallocate`` so a too-small ``/dev/shm`` fails at start
with :class:`~kvpool.errors.CapacityError` instead of a SIGBUS on some later
put, mapped ``MAP_SHARED`` and pre-faulted (first touch of fresh pages runs at
~1/4 of memcpy speed, so we pay it once).

This module owns the arena file format, the owning tier (:class:`CxlTier`),
the same-host reader (:class:`CxlArenaReader`) and the optional latency /
bandwidth model. It does not own which key lives where (the tier manager and
the master do) nor how long a reader may keep a view (leases do).

Arena file layout::

    0                       DATA_OFFSET (one page)            DATA_OFFSET + capacity
    | arena header | zeros  | data area: objects at extent offsets ...           |

Arena header (little-endian, see ``_ARENA``)::

    magic 8s "KVPLCXL\\0" | version u16 | flags u16 | data_offset u32
    | capacity u64 | alignment u32 | instance 16s | owner_pid u32
    | latency_ns f64 | bandwidth_gbps f64 | header_xxh3_64 u64

**Offsets are relative to the data area**: an :class:`~tiers.base.Extent`'s
``offset`` is what :meth:`CxlTier.location` ships and what
:meth:`CxlArenaReader.read_object` takes; the reader adds ``data_offset``
itself. ``instance`` is random per owner start, so metadata that names an older
arena at the same path is refused instead of read.

Ownership and replacement: the owning process holds an exclusive ``flock`` on
the file for its whole life and unlinks the file on close. A second owner gets
:class:`~kvpool.errors.PoolLockedError`. A file left by a dead owner (no lock
held) is **replaced, never truncated**: the new owner builds a fresh file under
a temporary name and ``rename``s it over the path, so a process that still
maps the old arena keeps valid (if stale) memory instead of dying of SIGBUS,
and notices the replacement (the path names another inode, the old owner's
lock is free) at its next check and drops the mapping. Stale arenas (and their
indexes and temporary files) of dead owners are removed by
:func:`collect_stale_arenas`, which every cxl tier runs at start and
``kvpool gc`` runs on demand. Readers never lock for long; they probe the lock
to tell a live arena from a stale one.

Same-host reads by key (:meth:`CxlArenaReader.read_key_into`) take one private
copy of the object header, check it (header checksum, the key digest it names,
the checksum the shared index recorded), copy the layers and verify the copy
against that same header copy: whatever the owner does to the extent meanwhile
(free, reuse for another key, rewrite), the reader returns those exact bytes or
a miss.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import mmap
import os
import re
import stat
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvpool import errors
from kvpool.objformat import FIXED_HEADER_NBYTES, LayerRange, ObjectHeader, ObjectSpec, decode, header_nbytes_at
from tiers.base import ArenaTier, Extent, close_mapping
from tiers.shm_index import (
    IndexEntry,
    SharedIndexReader,
    SharedIndexWriter,
    index_path,
    share_with_group,
    slot_count_for,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvpool.config import Config, CxlSection

PAGE = mmap.PAGESIZE
DATA_OFFSET = max(PAGE, 4096)
ARENA_MAGIC = b"KVPLCXL\x00"
ARENA_VERSION = 1
ALIGNMENT = 64  # one cache line: CXL.mem moves 64-byte flits
_ARENA = struct.Struct("<8sHHIQI16sIddQ")
_ARENA_CHECKSUM_OFFSET = _ARENA.size - 8
SHM_DIR = Path("/dev/shm")
# How long a starting owner retries the lock: a reader probing liveness holds a
# shared lock for microseconds, which must not look like a second owner.
_LOCK_RETRY_S = 0.25


_ARENA_NAME = re.compile(r"^kvpool-.+-cxl(\.tmp-[0-9a-f]+)?$")
#: the largest object header read from an arena (layers <= 4096 -> 80 + 8 * 4096 bytes, rounded)
_MAX_HEADER_NBYTES = FIXED_HEADER_NBYTES + 8 * 4096 + 64


def resolve_group(group: str | int | None) -> int | None:
    """``tiers.cxl.group`` (a group name or gid; empty for none) as a gid."""
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise errors.ConfigError(f"tiers.cxl.group: no group named {group!r} on this host") from None


def default_arena_path(pool_name: str) -> Path:
    """``/dev/shm/kvpool-<pool name>-cxl``, the name made safe for a file name."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", pool_name) or "default"
    return SHM_DIR / f"kvpool-{safe}-cxl"


# -- latency / bandwidth model ---------------------------------------------------


class AccessModel:
    """Slows accesses to ``latency_ns + nbytes / bandwidth`` without busy-waiting.

    Each access adds (modelled time - time the copy really took) to a per-thread
    debt; once the debt exceeds ``sleep_threshold_s`` the thread sleeps it off.
    Oversleeping becomes credit (bounded by the threshold), so over many accesses
    the thread's time converges on the model, and one large access is never
    faster than its modelled time minus the threshold. Disabled when both
    parameters are 0.
    """

    def __init__(self, latency_ns: float = 0.0, bandwidth_gbps: float = 0.0,
                 sleep_threshold_s: float = 100e-6) -> None:
        if latency_ns < 0 or bandwidth_gbps < 0:
            raise errors.TierError(f"cxl model: latency_ns and bandwidth_gbps must be >= 0, "
                                   f"got {latency_ns}, {bandwidth_gbps}")
        self.latency_ns = float(latency_ns)
        self.bandwidth_gbps = float(bandwidth_gbps)
        self.sleep_threshold_s = sleep_threshold_s
        self._debt = threading.local()
        self._totals_lock = threading.Lock()
        self.modelled_s = 0.0  # sum of modelled access times
        self.slept_s = 0.0  # time threads actually slept to honour the model

    @property
    def enabled(self) -> bool:
        return self.latency_ns > 0 or self.bandwidth_gbps > 0

    def cost_s(self, nbytes: int) -> float:
        seconds = self.latency_ns * 1e-9
        if self.bandwidth_gbps > 0:
            seconds += nbytes / (self.bandwidth_gbps * 1e9)
        return seconds

    def charge(self, nbytes: int, elapsed_s: float) -> None:
        """Account one access of ``nbytes`` that really took ``elapsed_s``; maybe sleep."""
        cost = self.cost_s(nbytes)
        debt = getattr(self._debt, "s", 0.0) + cost - elapsed_s
        slept = 0.0
        if debt > self.sleep_threshold_s:
            start = time.perf_counter()
            time.sleep(debt)
            slept = time.perf_counter() - start
            debt -= slept
        # A copy slower than its model (or an oversleep) earns at most one
        # threshold of credit: later accesses must not run faster than modelled.
        self._debt.s = max(debt, -self.sleep_threshold_s)
        with self._totals_lock:
            self.modelled_s += cost
            self.slept_s += slept

    def stats(self) -> dict[str, Any]:
        return {"latency_ns": self.latency_ns, "bandwidth_gbps": self.bandwidth_gbps,
                "enabled": self.enabled, "modelled_delay_s": self.modelled_s, "slept_s": self.slept_s}


# -- arena header ------------------------------------------------------------------


@dataclass(frozen=True)
class ArenaHeader:
    """What a process must know to use an arena it maps: where data starts, how much."""

    data_offset: int
    capacity_bytes: int
    alignment: int
    instance: bytes  # 16 random bytes per owner start
    owner_pid: int
    latency_ns: float
    bandwidth_gbps: float

    def pack(self) -> bytes:
        fields = (ARENA_MAGIC, ARENA_VERSION, 0, self.data_offset, self.capacity_bytes,
                  self.alignment, self.instance, self.owner_pid, self.latency_ns, self.bandwidth_gbps)
        unsummed = _ARENA.pack(*fields, 0)
        return _ARENA.pack(*fields, xxhash.xxh3_64_intdigest(unsummed))

    @classmethod
    def unpack(cls, data: Any, file_nbytes: int) -> ArenaHeader:
        """Parse and check an arena header; ``file_nbytes`` is the mapped file's size.

        Raises BadMagicError, UnsupportedVersionError, ChecksumError (a torn or
        corrupt header), FormatError (sizes that do not fit the file).
        """
        mv = memoryview(data).cast("B")
        if len(mv) < _ARENA.size:
            raise errors.TruncatedObjectError(f"arena file holds {len(mv)} bytes, no arena header")
        (magic, version, _flags, data_offset, capacity, alignment, instance, owner_pid,
         latency_ns, bandwidth_gbps, checksum) = _ARENA.unpack_from(mv, 0)
        if magic != ARENA_MAGIC:
            raise errors.BadMagicError(f"not a kvpool cxl arena: magic {bytes(magic)!r}, "
                                       f"expected {ARENA_MAGIC!r}")
        if version != ARENA_VERSION:
            raise errors.UnsupportedVersionError(
                f"cxl arena version {version}; this build reads {ARENA_VERSION}")
        unsummed = bytearray(mv[:_ARENA.size])
        struct.pack_into("<Q", unsummed, _ARENA_CHECKSUM_OFFSET, 0)
        if xxhash.xxh3_64_intdigest(bytes(unsummed)) != checksum:
            raise errors.ChecksumError("cxl arena header checksum mismatch (corrupt arena)")
        if data_offset < _ARENA.size or data_offset + capacity > file_nbytes:
            raise errors.FormatError(f"cxl arena claims data [{data_offset}, {data_offset + capacity}) "
                                     f"but the file holds {file_nbytes} bytes")
        return cls(data_offset, capacity, alignment, bytes(instance), owner_pid, latency_ns, bandwidth_gbps)


def _lock_is_free(fd: int) -> bool:
    """Whether no process holds an exclusive lock on ``fd``'s file (probe, then release)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


# -- the owning tier -------------------------------------------------------------------


class CxlTier(ArenaTier):
    """The owner of a shared-memory arena: allocates, writes, reads, frees.

    ``view()`` returns memory every process mapping the arena sees. With a model
    (``latency_ns`` / ``bandwidth_gbps`` > 0) ``write``, ``read_into`` and
    ``view`` take at least the modelled time (a view is charged as a read of its
    bytes, since handing one out is how in-place readers consume them).
    """

    name = "cxl"
    supports_views = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *,
                 latency_ns: float = 0.0, bandwidth_gbps: float = 0.0, prefault: bool = True,
                 group: int | None = None) -> None:
        """``group``: a gid whose members may read the arena and its index (files 0640 in that
        group); None keeps both 0600, readable by this user's processes only."""
        collect_stale_arenas(Path(path).parent)  # a dead owner's arena must not count as used
        capacity_bytes = _fit_to_filesystem(Path(path), capacity_bytes)
        super().__init__(capacity_bytes, alignment=ALIGNMENT)
        self.model = AccessModel(latency_ns, bandwidth_gbps)
        self.path = Path(path)
        self.instance = uuid.uuid4().bytes
        self.group = group
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise errors.TierError(f"cxl: cannot create the directory of {self.path}: {exc}") from exc
        path_fd = self._open_and_lock(self.path)  # held until the new file has replaced the old
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self.index: SharedIndexWriter | None = None
        tmp = self.path.with_name(f"{self.path.name}.tmp-{self.instance.hex()[:12]}")
        try:
            self._fd = self._create_locked(tmp)
            share_with_group(self._fd, group)
            file_nbytes = DATA_OFFSET + self.capacity_bytes
            self._size_file(file_nbytes)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            self._mmap = mmap.mmap(self._fd, file_nbytes, flags=flags,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._file = np.frombuffer(self._mmap, dtype=np.uint8)
            self._arena = self._file[DATA_OFFSET:]
            if prefault and not getattr(mmap, "MAP_POPULATE", 0):
                self._arena[::PAGE] = 0
            # Same-host readers find objects by key here, without asking the master.
            self._index_lock = threading.Lock()
            self.index = SharedIndexWriter(index_path(self.path), slot_count_for(self.capacity_bytes),
                                           self.instance, group=group)
            # Written before the rename: a reader that opens the path sees either
            # the old (stale) arena or this one complete, never a half-made one.
            header = ArenaHeader(DATA_OFFSET, self.capacity_bytes, self.alignment, self.instance,
                                 os.getpid(), self.model.latency_ns, self.model.bandwidth_gbps)
            packed = header.pack()
            self._file[:len(packed)] = np.frombuffer(packed, dtype=np.uint8)
            os.rename(tmp, self.path)
        except BaseException:
            for leftover in (tmp, self.path):  # our temporary file; the placeholder or stale arena we hold
                try:
                    if leftover == tmp or os.path.samestat(os.fstat(path_fd), os.stat(leftover)):
                        os.unlink(leftover)
                except OSError:
                    pass
            self._release(unlink=False)
            raise
        finally:
            os.close(path_fd)  # the old (or placeholder) inode: nobody owns it any more

    @classmethod
    def from_config(cls, section: CxlSection, config: Config) -> CxlTier:
        path = section.path or default_arena_path(config.pool.name)
        return cls(os.path.expanduser(path), section.capacity,
                   latency_ns=section.latency_ns, bandwidth_gbps=section.bandwidth_gbps,
                   group=resolve_group(section.group))

    # -- file setup ---------------------------------------------------------------------

    @staticmethod
    def _open_and_lock(path: Path) -> int:
        """Hold an exclusive flock on the inode ``path`` names (created empty if absent).

        Success means no live owner: the caller then replaces the file. Raises
        PoolLockedError while another live process owns it.
        """
        deadline = time.monotonic() + _LOCK_RETRY_S
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             0o600)
            except OSError as exc:
                raise errors.TierError(f"cxl: cannot open arena file {path}: {exc}") from exc
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise errors.TierError(f"cxl: {path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise errors.PoolLockedError(
                        f"cxl arena {path} is owned by another live process") from None
                time.sleep(0.005)
                continue
            # The previous owner (or another starter) may have replaced or unlinked
            # the file between our open and our lock; then we hold an orphan inode.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    @staticmethod
    def _create_locked(path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh inode: nobody else can hold it
        return fd

    def _size_file(self, file_nbytes: int) -> None:
        fs = os.fstatvfs(self._fd)
        available = fs.f_bavail * fs.f_frsize
        if fs.f_blocks and file_nbytes > available:
            raise errors.CapacityError(
                f"cxl: arena {self.path} needs {file_nbytes} bytes, its filesystem has {available} free "
                f"(lower tiers.cxl.capacity or enlarge {self.path.parent})")
        os.ftruncate(self._fd, file_nbytes)
        try:
            os.posix_fallocate(self._fd, 0, file_nbytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise errors.CapacityError(
                    f"cxl: no room for a {file_nbytes}-byte arena at {self.path}: {exc}") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise errors.TierError(f"cxl: cannot allocate arena {self.path}: {exc}") from exc
            # The filesystem cannot preallocate; the pre-fault below still touches every page.

    # -- bytes ---------------------------------------------------------------------------

    def write(self, extent: Extent, offset: int, data: Any) -> None:
        start = time.perf_counter()
        super().write(extent, offset, data)
        if self.model.enabled:
            self.model.charge(memoryview(data).nbytes, time.perf_counter() - start)

    def read_into(self, extent: Extent, offset: int, out: Any) -> None:
        start = time.perf_counter()
        super().read_into(extent, offset, out)
        if self.model.enabled:
            self.model.charge(memoryview(out).nbytes, time.perf_counter() - start)

    def view(self, extent: Extent, offset: int, nbytes: int) -> memoryview:
        view = super().view(extent, offset, nbytes)
        if self.model.enabled:
            self.model.charge(nbytes, 0.0)
        return view

    def location(self, extent: Extent) -> dict[str, Any]:
        """What a same-host reader needs to find this object (shipped in replica metadata).

        ``offset`` is relative to the arena's data area, as
        :meth:`CxlArenaReader.read_object` expects; ``instance`` names this
        owner's arena so a reader refuses a newer arena at the same path.
        """
        return {**self.arena_info(), "offset": extent.offset, "nbytes": extent.nbytes}

    def commit(self, key: bytes, extent: Extent, header: ObjectHeader) -> None:
        """Publish the object in the shared index (same-host readers find it by key)."""
        if self.index is not None:
            with self._index_lock:
                self.index.insert(key, IndexEntry(extent.offset, extent.nbytes, header.checksum()))

    def forget(self, key: bytes, extent: Extent) -> None:
        if self.index is not None:
            with self._index_lock:
                self.index.remove(key, extent.offset)

    def arena_info(self) -> dict[str, Any]:
        """What another process on this host needs to open this arena and its index."""
        return {"path": str(self.path), "instance": self.instance.hex()}

    # -- lifecycle -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        index = self.index
        return {**super().stats(), "path": str(self.path), "shared": True,
                "instance": self.instance.hex(), "model": self.model.stats(),
                "shared_index": None if index is None else {
                    "path": str(index.path), "slots": index.slot_count, "live": index.live}}

    def _release(self, *, unlink: bool) -> None:
        if self.index is not None:
            self.index.close(unlink=unlink)
            self.index = None
        self._arena = None
        self._file = None  # type: ignore[assignment]  # closed: no use follows
        close_mapping(self._mmap)
        self._mmap = None
        if self._fd < 0:
            return
        if unlink:
            # Only unlink the file we own: the lock guarantees nobody replaced it.
            try:
                if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)  # releases the flock
        self._fd = -1

    def close(self) -> None:
        """Unlink the arena and release it; readers that mapped it keep their mappings."""
        if self.closed:
            return
        super().close()
        self._release(unlink=True)


# -- same-host readers --------------------------------------------------------------------


class CxlArenaReader:
    """Read-only mapping of another process's arena: objects are read in place.

    A view returned by :meth:`read_object` stays valid only while the object's
    replica is pinned (a lease from the master); after the owner frees the
    extent its bytes may be overwritten. Copy with :meth:`read_layers_into`,
    which verifies the copy, when the bytes must outlive the lease.
    """

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, header: ArenaHeader) -> None:
        self.path = path
        self.header = header
        self.model = AccessModel(header.latency_ns, header.bandwidth_gbps)
        self._fd = fd
        self._mmap: mmap.mmap | None = mm
        self._mapped_nbytes = len(mm)
        data = np.frombuffer(mm, dtype=np.uint8)
        #: the whole data area, read-only; object views are slices of it
        self.arena: np.ndarray = data[header.data_offset:header.data_offset + header.capacity_bytes]
        self._index: SharedIndexReader | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, instance: str | bytes | None = None,
             require_owner: bool = True, prefault: bool = True) -> CxlArenaReader:
        """Map the arena at ``path`` read-only and validate its header.

        ``instance`` (from :meth:`CxlTier.location`) must match when given. Raises
        TierError when the file is missing, not yet initialised, owned by nobody
        (``require_owner``) or of another instance; the FormatError family for a
        header that is not a valid arena header.
        """
        path = Path(path)
        try:
            # Non-blocking and no symlinks: a FIFO or a link planted at the path must
            # neither hang this process nor redirect it.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise errors.TierError(f"cxl: cannot open arena {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise errors.TierError(f"cxl: {path} is not a regular file")
            file_nbytes = st.st_size
            if file_nbytes < DATA_OFFSET:
                raise errors.TierError(f"cxl: arena {path} is not initialised ({file_nbytes} bytes)")
            if require_owner and _lock_is_free(fd):
                raise errors.TierError(f"cxl: arena {path} has no live owner (stale file)")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            mm = mmap.mmap(fd, file_nbytes, flags=flags, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        try:
            # A copy: a memoryview of ``mm`` caught in an exception's frame would
            # keep the mapping from closing.
            header = ArenaHeader.unpack(mm[:_ARENA.size], file_nbytes)
            if instance is not None:
                wanted = bytes.fromhex(instance) if isinstance(instance, str) else instance
                if wanted != header.instance:
                    raise errors.TierError(f"cxl: arena {path} belongs to another owner instance "
                                           f"({header.instance.hex()}, expected {wanted.hex()})")
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        return cls(path, fd, mm, header)

    @classmethod
    def from_location(cls, location: dict[str, Any]) -> CxlArenaReader:
        return cls.open(location["path"], instance=location.get("instance"))

    def owner_alive(self) -> bool:
        """Whether the owning process still holds the arena (a released lock means it is gone)."""
        self._check_open()
        return not _lock_is_free(self._fd)

    def current(self) -> bool:
        """Whether this mapping is still the live arena at its path: the owner holds its lock,
        the path names the same file (not a replacement) and the file was not shrunk."""
        if self._mmap is None:
            return False
        try:
            mine, now = os.fstat(self._fd), os.stat(self.path)
        except OSError:
            return False
        return (os.path.samestat(mine, now) and mine.st_size >= self._mapped_nbytes
                and not _lock_is_free(self._fd))

    def _check_size(self) -> None:
        """Refuse to touch a mapping whose file was shrunk under it (that would be SIGBUS)."""
        if os.fstat(self._fd).st_size < self._mapped_nbytes:
            raise errors.TierError(f"cxl: arena {self.path} was truncated under its readers")

    def _object_bytes(self, offset: int, nbytes: int | None) -> tuple[ObjectHeader, np.ndarray]:
        self._check_open()
        self._check_size()
        capacity = self.header.capacity_bytes
        if not 0 <= offset < capacity:
            raise errors.FormatError(f"cxl: offset {offset} outside the {capacity}-byte arena")
        header = ObjectHeader.unpack(self.arena[offset:])
        total = header.spec.total_nbytes
        if nbytes is not None and nbytes != total:
            raise errors.FormatError(f"cxl: object at {offset} is {total} bytes, metadata says {nbytes}")
        if offset + total > capacity:
            raise errors.TruncatedObjectError(f"cxl: object at {offset} runs past the arena end")
        return header, self.arena[offset:offset + total]

    def find(self, key: bytes) -> tuple[int, ObjectHeader] | None:
        """(offset, header) of ``key`` through the owner's shared index, or None.

        The header is parsed from one private copy of the arena's bytes and must
        be whole (its checksum), name ``key`` (its key digest) and be the version
        the index recorded (its checksum equals the index entry's), so an extent
        reused for another object is a miss, not data. Copy the layers with
        :meth:`read_layers_into` and this header: the copy is verified against it.
        """
        self._check_open()
        if self._index is None:
            try:
                self._index = SharedIndexReader(index_path(self.path), self.header.instance)
            except errors.KVPoolError:
                return None  # an owner without an index (or a dead one): use the master
        entry = self._index.find(key)
        capacity = self.header.capacity_bytes
        if entry is None or not 0 <= entry.offset <= capacity - FIXED_HEADER_NBYTES:
            return None
        self._check_size()
        try:
            claimed = header_nbytes_at(self.arena[entry.offset:entry.offset + FIXED_HEADER_NBYTES])
            if not FIXED_HEADER_NBYTES <= claimed <= min(_MAX_HEADER_NBYTES, capacity - entry.offset):
                return None
            snapshot = self.arena[entry.offset:entry.offset + claimed].tobytes()  # the one copy used
            header = ObjectHeader.unpack(snapshot)
        except errors.FormatError:
            return None
        if (not header.is_for(key) or header.checksum() != entry.header_sum
                or header.spec.total_nbytes != entry.nbytes or entry.offset + entry.nbytes > capacity):
            return None
        return entry.offset, header

    def read_key_into(self, key: bytes, layers: Any,
                      out_view: Any) -> tuple[np.ndarray, memoryview] | None:
        """Copy ``layers`` of ``key`` out of the arena, verified; None when the index has no
        intact header of ``key`` (absent, or the extent was reused).

        ``out_view(spec, layer_range)`` returns (array to hand back, byte view to
        fill); LayerRangeError / OutBufferError from it propagate (the caller's
        mistake). ChecksumError when the copied layers fail their checksums (the
        extent changed during the copy, or rot): never returned as data.
        """
        found = self.find(key)
        if found is None:
            return None
        offset, header = found
        layer_range = LayerRange.resolve(layers, header.spec.layers)
        arr, buf = out_view(header.spec, layer_range)
        self.read_layers_into(offset, header, layer_range, buf, verify=True)
        return arr, buf

    def header_at(self, offset: int, key: bytes, header_sum: int, spec: ObjectSpec) -> ObjectHeader:
        """The header of the object at ``offset``, from one private copy of the arena's bytes,
        if it is the version the master indexed (:meth:`ObjectHeader.unpack_expected`); copy its
        layers with :meth:`read_layers_into` and this header, so a reuse of the extent after
        this snapshot fails the copy's checksums."""
        self._check_open()
        self._check_size()
        nbytes = spec.header_nbytes
        if not 0 <= offset <= self.header.capacity_bytes - nbytes:
            raise errors.FormatError(f"cxl: header at {offset} outside the arena")
        return ObjectHeader.unpack_expected(self.arena[offset:offset + nbytes].tobytes(), key, header_sum, spec)

    def read_header(self, offset: int) -> ObjectHeader:
        """The (checked) header of the object at data-area ``offset``."""
        return self._object_bytes(offset, None)[0]

    def read_object(self, offset: int, layers: Any = None, verify: bool = True, *,
                    nbytes: int | None = None) -> tuple[ObjectHeader, np.ndarray]:
        """(header, read-only array of ``layers``) viewing the arena in place, no copy.

        Raises the FormatError family when no valid object starts at ``offset``
        (or it is not ``nbytes`` long), ChecksumError when ``verify`` finds a
        corrupt layer, LayerRangeError for layers outside the object.
        """
        start = time.perf_counter()
        header, blob = self._object_bytes(offset, nbytes)
        header, arr = decode(blob, layers, verify=verify)
        if self.model.enabled:
            self.model.charge(arr.nbytes, time.perf_counter() - start)
        return header, arr

    def read_layers_into(self, offset: int, header: ObjectHeader, layer_range: LayerRange | Any,
                         out: Any, *, verify: bool = True) -> None:
        """Copy ``layer_range`` of the object at ``offset`` into ``out`` and verify the copy.

        Verifying the copy (not the source) catches an owner overwriting the
        extent mid-copy. Raises OutBufferError for a wrongly sized ``out``,
        ChecksumError for bad bytes.
        """
        self._check_open()
        start = time.perf_counter()
        layer_range = LayerRange.resolve(layer_range, header.spec.layers)
        rng = header.spec.layer_bytes(layer_range)
        dst = memoryview(out).cast("B")
        if dst.readonly:
            raise errors.OutBufferError("out is read-only")
        if len(dst) != rng.nbytes:
            raise errors.OutBufferError(f"out holds {len(dst)} bytes, layers need {rng.nbytes}")
        first = offset + rng.offset
        if offset < 0 or first + rng.nbytes > self.header.capacity_bytes:
            raise errors.FormatError(f"cxl: layers at {first}..{first + rng.nbytes} outside the arena")
        self._check_size()
        dst[:] = self.arena[first:first + rng.nbytes].data
        if verify:
            header.verify(layer_range, dst)
        if self.model.enabled:
            self.model.charge(rng.nbytes, time.perf_counter() - start)

    def _check_open(self) -> None:
        if self._mmap is None:
            raise errors.PoolClosedError(f"cxl reader of {self.path} is closed")

    def close(self) -> None:
        if self._mmap is None:
            return
        if self._index is not None:
            self._index.close()
            self._index = None
        self.arena = np.empty(0, dtype=np.uint8)
        close_mapping(self._mmap)
        self._mmap = None
        os.close(self._fd)

    def __enter__(self) -> CxlArenaReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MIN_ARENA_BYTES = 1 << 20


def _fit_to_filesystem(path: Path, capacity_bytes: int) -> int:
    """The arena capacity the filesystem under ``path`` can really hold (full = less capacity).

    A ``/dev/shm`` smaller than the configured capacity lowers it, with one
    warning naming the directory; CapacityError when not even 1 MiB fits.
    """
    try:
        fs = os.statvfs(path.parent)
    except OSError:
        return capacity_bytes  # the directory does not exist yet: sized (and checked) at creation
    if not fs.f_blocks:
        return capacity_bytes  # a filesystem that reports no size
    available = fs.f_bavail * fs.f_frsize
    index_nbytes = 64 + 64 * slot_count_for(capacity_bytes)
    overhead = DATA_OFFSET + index_nbytes
    if capacity_bytes + overhead <= available:
        return capacity_bytes
    fitted = (available - overhead) // ALIGNMENT * ALIGNMENT
    if fitted < _MIN_ARENA_BYTES:
        raise errors.CapacityError(
            f"cxl: arena {path} needs {capacity_bytes + overhead} bytes, its filesystem has {available} free "
            f"(lower tiers.cxl.capacity or enlarge {path.parent})")
    log.warning("cxl: %s has only %d bytes free; arena capacity lowered from %d to %d bytes",
                path.parent, available, capacity_bytes, fitted)
    return fitted


# -- stale arenas -------------------------------------------------------------------------

#: a temporary arena younger than this may belong to an owner still starting up
_TMP_GRACE_S = 60.0


def collect_stale_arenas(directory: str | os.PathLike[str] = SHM_DIR) -> list[Path]:
    """Remove kvpool arenas in ``directory`` whose owner is gone (nobody holds their lock),
    with their shared indexes; return the paths removed.

    Safe against a live owner (its lock is held), a starting one (its fresh
    temporary file is spared for a grace period; a starter that loses its
    placeholder retries) and other processes collecting at the same time.
    Processes that still map a removed arena keep their (stale) memory until
    they notice; nothing is truncated under them.
    """
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _ARENA_NAME.match(name):
            continue
        path = Path(directory) / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if ".tmp-" in name and time.time() - st.st_mtime < _TMP_GRACE_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live owner (or a reader probing for a moment)
            try:
                if not os.path.samestat(st, os.stat(path)):
                    continue
            except FileNotFoundError:
                continue
            os.unlink(path)
            removed.append(path)
            if ".tmp-" not in name:
                _unlink_stale_index(index_path(path))
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d stale cxl arena(s) of dead owners: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def _unlink_stale_index(path: Path) -> None:
    try:
        st = os.stat(path, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
    except OSError:
        pass
