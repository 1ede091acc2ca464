"""The cxl arena's format and model: its header, the latency/bandwidth model, where arenas
live and how large they may be."""

from __future__ import annotations

import fcntl
import grp
import logging
import mmap
import os
import pwd
import re
import stat
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from kvpool import errors
from kvpool.objformat import FIXED_HEADER_NBYTES
from tiers.cxl.index import (
    slot_count_for,
)

if TYPE_CHECKING:
    pass


log = logging.getLogger("tiers.cxl")

PAGE = mmap.PAGESIZE
DATA_OFFSET = max(PAGE, 4096)
ARENA_MAGIC = b"KVPLCXL\x00"
ARENA_VERSION = 1
ALIGNMENT = 64  # one cache line: CXL.mem moves 64-byte flits
ARENA = struct.Struct("<8sHHIQI16sIddQ")
_ARENA_CHECKSUM_OFFSET = ARENA.size - 8
SHM_DIR = Path("/dev/shm")
# How long a starting owner retries the lock: a reader probing liveness holds a
# shared lock for microseconds, which must not look like a second owner.
LOCK_RETRY_S = 0.25


ARENA_NAME = re.compile(r"^kvpool-.+-cxl(\.tmp-[0-9a-f]+)?$")
#: the largest object header read from an arena (layers <= 4096 -> 80 + 8 * 4096 bytes, rounded)
MAX_HEADER_NBYTES = FIXED_HEADER_NBYTES + 8 * 4096 + 64


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


def user_shm_dir(uid: int | None = None) -> Path:
    """``/dev/shm/kvpool-<uid>``: this user's arenas live there (see :func:`private_arena_dir`)."""
    return SHM_DIR / f"kvpool-{os.geteuid() if uid is None else uid}"


#: where same-host arenas may be mapped from when nothing else is allowed (tiers.cxl.shared_dirs adds more)
DEFAULT_SHARED_DIRS = ("/dev/shm",)


def shared_dirs_of(config: Any) -> tuple[str, ...]:
    """The directories whose cxl arenas this process may map: /dev/shm, the directory of its own
    configured arena, and ``tiers.cxl.shared_dirs`` (``:``-separated)."""
    dirs = list(DEFAULT_SHARED_DIRS)
    cxl = getattr(getattr(config, "tiers", None), "cxl", None)
    own = getattr(cxl, "path", "") or ""
    if own:
        dirs.append(os.path.dirname(os.path.abspath(os.path.expanduser(own))))
    extra = getattr(cxl, "shared_dirs", "") or ""
    dirs += [os.path.expanduser(d) for d in str(extra).split(":") if d]
    return tuple(dirs)


def inside_dirs(real_path: str, dirs: Sequence[str]) -> bool:
    """Whether the resolved ``real_path`` lies inside (at any depth) one of the resolved ``dirs``."""
    return any(real_path.startswith(folder.rstrip("/") + "/") for folder in dirs)


def default_arena_path(pool_name: str, data_dir: str | os.PathLike[str]) -> Path:
    """``/dev/shm/kvpool-<uid>/kvpool-<pool name>-<data dir hash>-cxl``, the name made safe for
    a file name.

    In this user's own directory, not ``/dev/shm`` itself: ``/dev/shm`` is writable by every
    user and the names are predictable, so another user could create (and lock) the arena's
    name first; only this user can create names in its directory (:func:`private_arena_dir`).
    A pool is its name and its data directory (its nvme tier lives there), so both name the
    arena: two pools of one name with different data directories never meet in shared memory;
    one pool opened twice does (PoolLockedError). The hash is 8 hex digits of xxh3-64 over the
    data directory's absolute, resolved path.
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", pool_name) or "default"
    where = Path(os.path.expandvars(os.path.expanduser(os.fspath(data_dir)))).resolve()
    return user_shm_dir() / f"kvpool-{safe}-{xxhash.xxh3_64_hexdigest(os.fsencode(where))[:8]}-cxl"


def owner_name(uid: int) -> str:
    """``name (uid N)`` of a user id, for errors that say who owns a file."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def refuse_foreign(st: os.stat_result, path: str | os.PathLike[str], what: str) -> None:
    """ForeignOwnerError when ``st`` (of ``path``) belongs to another user than this process's."""
    if st.st_uid != os.geteuid():
        raise errors.ForeignOwnerError(
            f"cxl: {what} {path} belongs to {owner_name(st.st_uid)}, not to this user "
            f"{owner_name(os.geteuid())}: another user made it (maybe to block this pool); "
            f"remove it (as its owner or root) or set tiers.cxl.path elsewhere")


def private_arena_dir(directory: Path, group: int | None = None) -> None:
    """Create (mode 0700; 0710 in ``group`` when arenas are shared with a group) or check this
    user's arena directory: a real directory (no symlink followed), owned by this user, that no
    one else may create names in. ForeignOwnerError naming the owner otherwise."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise errors.TierError(f"cxl: cannot create the arena directory {directory}: {exc.strerror}") from None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file planted at the name
        st = os.lstat(directory)
        refuse_foreign(st, directory, "arena directory")
        raise errors.TierError(f"cxl: arena directory {directory} is not a directory ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        refuse_foreign(st, directory, "arena directory")
        mode = stat.S_IMODE(st.st_mode)
        wanted = 0o700 if group is None else 0o710
        if group is not None and st.st_gid != group:
            os.fchown(fd, -1, group)  # the group's members may reach arenas shared with them
        if mode & 0o022 or (group is not None and not mode & 0o010):
            os.fchmod(fd, (mode & ~0o077) | wanted)  # never writable by others: names stay ours
    except PermissionError:
        raise errors.ConfigError(f"tiers.cxl.group: this user may not give {directory} to gid {group}") from None
    finally:
        os.close(fd)


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
        unsummed = ARENA.pack(*fields, 0)
        return ARENA.pack(*fields, xxhash.xxh3_64_intdigest(unsummed))

    @classmethod
    def unpack(cls, data: Any, file_nbytes: int) -> ArenaHeader:
        """Parse and check an arena header; ``file_nbytes`` is the mapped file's size.

        Raises BadMagicError, UnsupportedVersionError, ChecksumError (a torn or
        corrupt header), FormatError (sizes that do not fit the file).
        """
        mv = memoryview(data).cast("B")
        if len(mv) < ARENA.size:
            raise errors.TruncatedObjectError(f"arena file holds {len(mv)} bytes, no arena header")
        (magic, version, _flags, data_offset, capacity, alignment, instance, owner_pid,
         latency_ns, bandwidth_gbps, checksum) = ARENA.unpack_from(mv, 0)
        if magic != ARENA_MAGIC:
            raise errors.BadMagicError(f"not a kvpool cxl arena: magic {bytes(magic)!r}, "
                                       f"expected {ARENA_MAGIC!r}")
        if version != ARENA_VERSION:
            raise errors.UnsupportedVersionError(
                f"cxl arena version {version}; this build reads {ARENA_VERSION}")
        unsummed = bytearray(mv[:ARENA.size])
        struct.pack_into("<Q", unsummed, _ARENA_CHECKSUM_OFFSET, 0)
        if xxhash.xxh3_64_intdigest(bytes(unsummed)) != checksum:
            raise errors.ChecksumError("cxl arena header checksum mismatch (corrupt arena)")
        if data_offset < ARENA.size or data_offset + capacity > file_nbytes:
            raise errors.FormatError(f"cxl arena claims data [{data_offset}, {data_offset + capacity}) "
                                     f"but the file holds {file_nbytes} bytes")
        return cls(data_offset, capacity, alignment, bytes(instance), owner_pid, latency_ns, bandwidth_gbps)


def lock_is_free(fd: int) -> bool:
    """Whether no process holds an exclusive lock on ``fd``'s file (probe, then release)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True



_MIN_ARENA_BYTES = 1 << 20


def fit_to_filesystem(path: Path, capacity_bytes: int) -> int:
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


