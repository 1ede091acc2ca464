"""The owning side of a cxl arena: :class:`CxlTier`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import errors
from kvpool.config import format_size
from kvpool.objformat import ObjectHeader
from tiers.base import ArenaTier, Extent, advise_huge_pages, close_mapping, madvise, tmpfs_huge_pages
from tiers.cxl.arena import (
    ALIGNMENT,
    DATA_OFFSET,
    LOCK_RETRY_S,
    PAGE,
    AccessModel,
    ArenaHeader,
    default_arena_path,
    fit_to_filesystem,
    private_arena_dir,
    refuse_foreign,
    resolve_group,
    user_shm_dir,
)
from tiers.cxl.index import (
    IndexEntry,
    SharedIndexWriter,
    index_path,
    share_with_group,
    slot_count_for,
)
from tiers.cxl.stale import collect_stale_arenas

if TYPE_CHECKING:
    from kvpool.config import Config, CxlSection


log = logging.getLogger("tiers.cxl")
_told_about_huge_pages = threading.Event()  # the hint is logged once a process

#: a starting tier spares the arena of an owner whose heartbeat touched it this recently: the
#: master declares a node dead after 3 missed beats (3 s by default) and then has a storage node
#: on the host rescue the dead client's objects out of it (kvpool.cluster.master.state
#: ._plan_rescue), which takes a second or two for a full engine arena
DEAD_OWNER_GRACE_S = 20.0

# madvise(MADV_POPULATE_WRITE) (Linux 5.14+): map a freshly allocated range writable in one call.
# Without it the first write to each 4 KiB page of the range traps into the kernel once per page,
# which costs several times the copy a put makes there.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if os.uname().sysname == "Linux" else 0)


def populate_writable(mm: mmap.mmap | None, start: int, nbytes: int) -> None:
    """Map ``[start, start + nbytes)`` of ``mm`` writable now (best effort: a kernel without
    MADV_POPULATE_WRITE faults the pages in on first touch instead)."""
    global _MADV_POPULATE_WRITE
    if not _MADV_POPULATE_WRITE or mm is None or nbytes <= 0:
        return
    at = start - start % mmap.PAGESIZE
    try:
        madvise(mm, _MADV_POPULATE_WRITE, at, start + nbytes - at)  # without the GIL
    except (OSError, ValueError) as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ENOSYS):
            _MADV_POPULATE_WRITE = 0  # not in this kernel: never asked again
        log.debug("madvise(MADV_POPULATE_WRITE) of %d bytes: %s", nbytes, exc)

def _refuse_foreign_index(path: Path) -> None:
    """ForeignOwnerError when the arena's index name is another user's file (it would be renamed
    over, which a sticky directory refuses)."""
    try:
        st = os.lstat(index_path(path))
    except OSError:
        return
    refuse_foreign(st, index_path(path), "arena index")


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
    #: a put that reaches past what is ready (or the readier's step) waits for at most one
    #: step's allocation: small enough to keep that wait short, large enough to keep the calls few
    grow_step_bytes = 16 << 20

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *,
                 latency_ns: float = 0.0, bandwidth_gbps: float = 0.0, prefault: bool = False,
                 group: int | None = None, ready_ahead: int = 0) -> None:
        """``group``: a gid whose members may read the arena and its index (files 0640 in that
        group); None keeps both 0600, readable by this user's processes only.

        ``ready_ahead``: once objects reach the arena, a background thread keeps this many bytes
        beyond the highest one allocated and mapped (``kvpool-cxl-ready``), so puts write at
        memory speed instead of paying for new shared-memory pages themselves (allocating and
        zeroing a tmpfs page costs several times the copy into it); 0: each put that crosses
        the ready mark readies the next step itself.

        ``prefault``: allocate and map every page of the arena at start; else (the default)
        the file is sparse and is allocated (``posix_fallocate``) in steps as objects first
        reach its pages, so a put never meets a SIGBUS and a full ``/dev/shm`` lowers the
        capacity (DiskFullError, as for the nvme tier) instead."""
        if Path(path).parent == user_shm_dir():  # the default place: made or checked private to this user
            private_arena_dir(Path(path).parent, group)
        _refuse_foreign_index(Path(path))
        # A dead owner's arena must not count as used; one that died moments ago may still be
        # rescued by a storage node (see DEAD_OWNER_GRACE_S).
        collect_stale_arenas(Path(path).parent, grace_s=DEAD_OWNER_GRACE_S)
        capacity_bytes = fit_to_filesystem(Path(path), capacity_bytes)
        super().__init__(capacity_bytes, alignment=ALIGNMENT)
        self.model = AccessModel(latency_ns, bandwidth_gbps)
        self.path = Path(path)
        self.instance = uuid.uuid4().bytes
        self.group = group
        self._full_warned = False
        self.ready_ahead_bytes = 0 if prefault else max(0, int(ready_ahead))
        self._readier: threading.Thread | None = None
        self._readier_wake = threading.Event()
        self._readier_stop = False
        #: the step the readier is allocating now (under _alloc_lock), and its end being told:
        #: a put that needs that step waits for it rather than allocating the same range beside it
        self._readying: tuple[int, int] | None = None
        self._readied = threading.Condition(self._alloc_lock)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise errors.TierError(f"cxl: cannot create the directory of {self.path}: {exc}") from exc
        self._huge = tmpfs_huge_pages(self.path.parent)
        if self._huge in ("never", "deny") and not _told_about_huge_pages.is_set():
            _told_about_huge_pages.set()
            log.info("cxl arena %s: its tmpfs gives 4 KiB pages; on a tmpfs mounted with huge=within_size "
                     "its cold writes and same-host reads cost far fewer page faults (docs/tiers.md)", self.path)
        path_fd = self._open_and_lock(self.path)  # held until the new file has replaced the old
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self.index: SharedIndexWriter | None = None
        tmp = self.path.with_name(f"{self.path.name}.tmp-{self.instance.hex()[:12]}")
        try:
            self._fd = self._create_locked(tmp)
            share_with_group(self._fd, group)
            file_nbytes = DATA_OFFSET + self.capacity_bytes
            self._size_file(file_nbytes, prefault)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            self._mmap = mmap.mmap(self._fd, file_nbytes, flags=flags,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # 2 MiB pages where the arena's tmpfs gives them (see huge_pages)
            advise_huge_pages(self._mmap)
            self._file = np.frombuffer(self._mmap, dtype=np.uint8)
            self._arena = self._file[DATA_OFFSET:]
            if prefault and not getattr(mmap, "MAP_POPULATE", 0):
                self._arena[::PAGE] = 0
            if not prefault:
                self.ready_bytes = 0  # allocated as it is used (_grow)
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
        path = section.path or default_arena_path(config.pool.name, config.pool.resolved_data_dir())
        return cls(os.path.expanduser(path), section.capacity,
                   latency_ns=section.latency_ns, bandwidth_gbps=section.bandwidth_gbps,
                   prefault=section.prefault, group=resolve_group(section.group),
                   ready_ahead=section.ready_ahead)

    # -- file setup ---------------------------------------------------------------------

    @staticmethod
    def _open_and_lock(path: Path) -> int:
        """Hold an exclusive flock on the inode ``path`` names (created empty if absent).

        Success means no live owner: the caller then replaces the file. Raises
        PoolLockedError while another live process owns it.
        """
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             0o600)
            except OSError as exc:
                with contextlib.suppress(OSError):  # e.g. EACCES of another user's file in a sticky /dev/shm
                    refuse_foreign(os.lstat(path), path, "arena file")
                raise errors.TierError(f"cxl: cannot open arena file {path}: {exc}") from exc
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                os.close(fd)
                refuse_foreign(st, path, "arena file")  # never another user's, even at an explicit path
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

    def _size_file(self, file_nbytes: int, allocate: bool) -> None:
        fs = os.fstatvfs(self._fd)
        available = fs.f_bavail * fs.f_frsize
        if fs.f_blocks and file_nbytes > available:
            raise errors.CapacityError(
                f"cxl: arena {self.path} needs {file_nbytes} bytes, its filesystem has {available} free "
                f"(lower tiers.cxl.capacity or enlarge {self.path.parent})")
        os.ftruncate(self._fd, file_nbytes)
        try:
            os.posix_fallocate(self._fd, 0, file_nbytes if allocate else DATA_OFFSET)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise errors.CapacityError(
                    f"cxl: no room for a {file_nbytes}-byte arena at {self.path}: {exc}") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise errors.TierError(f"cxl: cannot allocate arena {self.path}: {exc}") from exc
            # The filesystem cannot preallocate; the pre-fault below still touches every page.

    def _grow(self, start: int, end: int) -> None:
        """Allocate arena bytes ``[start, end)`` in the file before objects are written there: a
        write to a sparse page that tmpfs cannot back would be a SIGBUS, this is DiskFullError.
        (Allocation lock held.) Waits first while the readier allocates a step this range
        needs, then allocates what is still missing."""
        while self._readying is not None and self._readying[0] < end:
            self._readied.wait()
        start = max(start, self.ready_bytes)
        if start < end:
            self._fill(start, end)

    def _fill(self, start: int, end: int) -> None:
        """Allocate (``fallocate``) and map (``MADV_POPULATE_WRITE``) arena bytes ``[start, end)``."""
        try:
            os.posix_fallocate(self._fd, DATA_OFFSET + start, end - start)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                if not self._full_warned:
                    self._full_warned = True
                    log.warning("cxl: %s is full: arena %s stays at %s (tiers.cxl.capacity asked for %s)",
                                self.path.parent, self.path, format_size(start), format_size(self.capacity_bytes))
                raise errors.DiskFullError(exc.errno, f"cxl: no room to grow arena {self.path} past {start} "
                                                      f"bytes: {exc.strerror}") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise errors.TierError(f"cxl: cannot allocate arena {self.path}: {exc}") from exc
        populate_writable(self._mmap, DATA_OFFSET + start, end - start)

    # -- readying ahead of use ----------------------------------------------------------

    def _used_to(self, end: int) -> None:
        if not self.ready_ahead_bytes or self.ready_bytes >= self.capacity_bytes \
                or self.ready_bytes - end >= self.ready_ahead_bytes:
            return
        if self._readier is None and not self._readier_stop:
            self._readier = threading.Thread(target=self._ready_ahead, name="kvpool-cxl-ready", daemon=True)
            self._readier.start()
        self._readier_wake.set()

    def _ready_ahead(self) -> None:
        """Ready the arena in ``grow_step_bytes`` steps up to ``ready_ahead_bytes`` past the
        highest allocation, outside the allocation lock (a put that outruns it readies what it
        needs itself; readying a range twice is harmless). Stops for good where the arena's
        filesystem is full: puts then meet that themselves (DiskFullError lowers the capacity)."""
        step = self.grow_step_bytes
        while True:
            self._readier_wake.wait()
            self._readier_wake.clear()
            while not self._readier_stop:
                with self._alloc_lock:
                    start = self.ready_bytes
                    want = min(self.capacity_bytes, -(-(self.used_end + self.ready_ahead_bytes) // step) * step)
                    if start >= want:
                        break
                    end = min(start + step, want)
                    self._readying = (start, end)
                failed: Exception | None = None
                try:
                    self._fill(start, end)
                except Exception as exc:  # full, or the arena is going: puts meet it themselves
                    failed = exc
                with self._alloc_lock:
                    self._readying = None
                    if failed is None and self.ready_bytes == start:  # else a put readied past it meanwhile
                        self.ready_bytes = end
                    self._readied.notify_all()
                if failed is not None:
                    log.info("cxl: readying %s ahead of use stopped: %s", self.path, failed)
                    return
            if self._readier_stop:
                return

    def _stop_readier(self) -> None:
        self._readier_stop = True
        self._readier_wake.set()
        if self._readier is not None:
            self._readier.join()
            self._readier = None

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

    def mark_in_use(self) -> None:
        """Mark the arena file as in use now (its mtime): the owner's node does so with every
        heartbeat, so a starting tier spares a freshly dead owner's arena for a while
        (:data:`DEAD_OWNER_GRACE_S`). Best effort."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.utime(self._fd)

    def arena_info(self) -> dict[str, Any]:
        """What another process on this host needs to open this arena and its index."""
        return {"path": str(self.path), "instance": self.instance.hex()}

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def huge_pages(self) -> bool:
        """Whether the arena's pages are 2 MiB ones: its file is on a tmpfs mounted with
        ``huge=always``, ``within_size`` or ``advise`` (the arena asks for them). A new page then
        costs one fault and one zero-fill per 2 MiB for the owner, and one mapping per 2 MiB for
        a same-host reader, instead of one per 4 KiB (see docs/operating.md)."""
        return self._huge in ("always", "within_size", "advise")

    def stats(self) -> dict[str, Any]:
        index = self.index
        return {**super().stats(), "path": str(self.path), "shared": True, "huge_pages": self.huge_pages,
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
        self._stop_readier()  # before the file and mapping it readies go
        super().close()
        self._release(unlink=True)


