"""The ``dram`` tier: one host arena, page-locked as far as ``RLIMIT_MEMLOCK`` allows.

Where a CUDA device exists the arena is CuPy pinned memory (so device copies
run at DMA speed), allocated and pinned whole at start. Elsewhere it is an
anonymous ``mmap`` that costs what is used: pages are faulted in by their first
write and ``mlock``ed in steps as objects first reach them (``prefault = false``,
the default: a pool starts in milliseconds and its resident memory is what it
holds). ``prefault = true`` touches and locks every page at start instead (first
touch of fresh pages runs at ~1/4 of memcpy speed, so a long-lived process may
prefer to pay it once). A refused lock never fails the pool: ``stats()`` reports
how many bytes are locked and why not more; the advice to raise the limit is
logged once per host.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import errors
from kvpool.config import format_size
from tiers.base import ArenaTier, advise_huge_pages, close_mapping, libc

if TYPE_CHECKING:
    from kvpool.config import Config, DramSection

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE


def mlock_region(address: int, nbytes: int) -> tuple[int, str]:
    """Lock as much of ``[address, address+nbytes)`` as RLIMIT_MEMLOCK allows.

    Returns (bytes locked, note). Raises the soft limit to the hard limit first
    (allowed without privileges); CAP_SYS_RESOURCE lets the hard limit rise too.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    for target in ((hard, hard), (resource.RLIM_INFINITY, resource.RLIM_INFINITY)):
        try:  # the first is always allowed; the second needs CAP_SYS_RESOURCE
            resource.setrlimit(resource.RLIMIT_MEMLOCK, target)
        except (ValueError, OSError):
            pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    allowed = nbytes if soft == resource.RLIM_INFINITY else min(nbytes, soft)
    # Leave a little of the limit for others in this process (UCX registers memory too).
    if allowed < nbytes:
        allowed = max(0, allowed - 4 * PAGE)
    allowed = allowed // PAGE * PAGE
    if allowed == 0:
        return 0, f"RLIMIT_MEMLOCK is {soft} bytes: nothing locked"
    clib = libc()
    while allowed >= PAGE:
        if clib.mlock(ctypes.c_void_p(address), ctypes.c_size_t(allowed)) == 0:
            note = "fully locked" if allowed == nbytes else f"RLIMIT_MEMLOCK allows {allowed} of {nbytes} bytes"
            return allowed, note
        allowed = allowed // 2 // PAGE * PAGE  # the limit is shared with earlier locks: back off
    return 0, f"mlock refused (errno {ctypes.get_errno()})"


_memlock_warned = False


def advice_marker() -> Path:
    """Where this host's memlock advice is remembered: the user's state dir, one file per host
    (a home directory may be shared by several hosts)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "kvpool" / f"memlock-advised-{socket.gethostname()}"


def _warn_memlock_once(note: str, locked: int, wanted: int) -> None:
    """The memlock advice, one line once per host and limit (every pool of every process hits the
    same limit): remembered in a marker file (:func:`advice_marker`) holding the limit it was
    given for, so a changed limit is reported again; later pools log it at debug level."""
    global _memlock_warned
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    marker = advice_marker()
    try:
        seen = marker.read_text().strip() == str(soft)
    except OSError:
        seen = False
    if _memlock_warned or seen:
        log.debug("dram tier: %s (%d of %d bytes locked)", note, locked, wanted)
        return
    _memlock_warned = True
    log.warning(
        "dram tier: %s, so %s of %s is locked and the rest may be swapped out; raise the limit (`ulimit -l "
        "unlimited`, LimitMEMLOCK=infinity in systemd, docker --ulimit memlock=-1) or set tiers.dram.mlock = "
        "false (said once on this host; stats() has the lock_note)", note, format_size(locked), format_size(wanted))
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f"{marker.name}.{os.getpid()}")
        tmp.write_text(f"{soft}\n")
        os.replace(tmp, marker)
    except OSError as exc:  # a read-only home: the advice comes once per process instead
        log.debug("cannot remember the memlock advice in %s: %s", marker, exc)


def munlock_region(address: int, nbytes: int) -> None:
    if nbytes:
        libc().munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


def _cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return False


class DramTier(ArenaTier):
    name = "dram"

    def __init__(self, capacity_bytes: int, *, mlock: bool = True, prefault: bool = False) -> None:
        super().__init__(capacity_bytes, alignment=64)
        self._mmap: mmap.mmap | None = None
        self._pinned: Any = None
        self.locked_bytes = 0
        self.lock_note = "mlock disabled"
        self.huge_pages = False
        self._mlock = False  # more of the arena is to be locked as it is used
        if _cuda_available():
            import cupy

            self._pinned = cupy.cuda.alloc_pinned_memory(self.capacity_bytes)
            self._arena = np.frombuffer(self._pinned, dtype=np.uint8, count=self.capacity_bytes)
            self.backing = "cupy-pinned"
            self.locked_bytes, self.lock_note = self.capacity_bytes, "CUDA pinned memory"
            return
        try:
            self._mmap = mmap.mmap(-1, self.capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:  # ENOMEM: more than the kernel lets this process map
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            raise errors.ConfigError(
                f"tiers.dram.capacity = {format_size(self.capacity_bytes)}: cannot map that much memory "
                f"({exc.strerror}); this host has {format_size(total)} of RAM") from None
        # Huge pages before the first touch: with THP in "madvise" mode (the common
        # default) the arena would otherwise get 4 KiB pages, and a copy out of it then
        # misses the TLB once per 4 KiB instead of once per 2 MiB.
        self.huge_pages = advise_huge_pages(self._mmap)
        self._arena = np.frombuffer(self._mmap, dtype=np.uint8)
        self.backing = "mmap"
        self._mlock = mlock
        if not prefault:
            # Pages are faulted in by their first write, and locked (as far as RLIMIT_MEMLOCK
            # allows) in grow_step_bytes steps as objects first reach them (_grow).
            self.ready_bytes = 0
            self.lock_note = "locked as used" if mlock else self.lock_note
            return
        self._arena[::PAGE] = 0  # fault every page in now, not on the first puts
        if mlock:
            self.locked_bytes, self.lock_note = mlock_region(self._arena.ctypes.data, self.capacity_bytes)
            if self.locked_bytes < self.capacity_bytes:
                _warn_memlock_once(self.lock_note, self.locked_bytes, self.capacity_bytes)
            self._mlock = False  # all of it is tried: nothing more to lock as the arena is used

    def _grow(self, start: int, end: int) -> None:
        """Lock ``[start, end)`` of the arena (which faults it in) while RLIMIT_MEMLOCK allows."""
        if not self._mlock:
            return
        locked, note = mlock_region(self._arena.ctypes.data + start, end - start)
        self.locked_bytes += locked
        if locked < end - start:  # the limit is reached: the rest of the arena stays unlocked
            self._mlock = False
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            if note.startswith("RLIMIT_MEMLOCK") and soft != resource.RLIM_INFINITY:
                note = f"RLIMIT_MEMLOCK is {format_size(soft)}"
            self.lock_note = f"{note}: {format_size(self.locked_bytes)} locked"
            _warn_memlock_once(note, self.locked_bytes, self.capacity_bytes)

    @classmethod
    def from_config(cls, section: DramSection, config: Config) -> DramTier:
        return cls(section.capacity, mlock=section.mlock, prefault=section.prefault)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "backing": self.backing, "locked_bytes": self.locked_bytes,
                "lock_note": self.lock_note, "huge_pages": getattr(self, "huge_pages", False)}

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self._mmap is not None and self.locked_bytes:
            munlock_region(self._arena.ctypes.data, self.locked_bytes)
        self._arena = None
        self._pinned = None
        close_mapping(self._mmap)
        self._mmap = None
