"""The ``dram`` tier: one preallocated, pre-faulted, page-locked host arena.

Where a CUDA device exists the arena is CuPy pinned memory (so device copies
run at DMA speed); elsewhere it is an anonymous ``mmap`` populated at start
(first touch of fresh pages runs at ~1/4 of memcpy speed, so we pay it once)
and ``mlock``ed as far as ``RLIMIT_MEMLOCK`` allows. A refused lock never fails
the pool: ``stats()`` reports how many bytes are locked and why not more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import resource
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import errors
from kvpool.config import format_size
from tiers.base import ArenaTier, close_mapping

if TYPE_CHECKING:
    from kvpool.config import Config, DramSection

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


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
    libc = _libc()
    while allowed >= PAGE:
        if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(allowed)) == 0:
            note = "fully locked" if allowed == nbytes else f"RLIMIT_MEMLOCK allows {allowed} of {nbytes} bytes"
            return allowed, note
        allowed = allowed // 2 // PAGE * PAGE  # the limit is shared with earlier locks: back off
    return 0, f"mlock refused (errno {ctypes.get_errno()})"


_memlock_warned = False


def _warn_memlock_once(note: str, locked: int, wanted: int) -> None:
    """One warning per process (every pool of a process hits the same limit), with the fix."""
    global _memlock_warned
    if _memlock_warned:
        log.debug("dram tier: %s (%d of %d bytes locked)", note, locked, wanted)
        return
    _memlock_warned = True
    log.warning(
        "dram tier: %s: %s of %s locked, the rest may be swapped out. To lock it all, raise the "
        "memlock limit: `ulimit -l unlimited` before starting (root), LimitMEMLOCK=infinity in a systemd "
        "unit, `--ulimit memlock=-1` for docker, or a `memlock` line in /etc/security/limits.conf; "
        "or set tiers.dram.mlock = false to silence this", note, format_size(locked), format_size(wanted))


def munlock_region(address: int, nbytes: int) -> None:
    if nbytes:
        _libc().munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


def _advise_huge_pages(region: mmap.mmap) -> bool:
    """Ask for transparent huge pages; False where the kernel or Python cannot."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        region.madvise(advice)
        return True
    except OSError:
        return False


def _cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return False


class DramTier(ArenaTier):
    name = "dram"

    def __init__(self, capacity_bytes: int, *, mlock: bool = True, prefault: bool = True) -> None:
        super().__init__(capacity_bytes, alignment=64)
        self._mmap: mmap.mmap | None = None
        self._pinned: Any = None
        self.locked_bytes = 0
        self.lock_note = "mlock disabled"
        self.huge_pages = False
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
        # Huge pages before the first touch: with THP in "madvise" mode (the
        # common default) copies out of a 4 KiB-page arena measured ~25% slower.
        self.huge_pages = _advise_huge_pages(self._mmap)
        self._arena = np.frombuffer(self._mmap, dtype=np.uint8)
        if prefault:
            self._arena[::PAGE] = 0  # fault every page in now, not on the first puts
        self.backing = "mmap"
        if mlock:
            self.locked_bytes, self.lock_note = mlock_region(self._arena.ctypes.data, self.capacity_bytes)
            if self.locked_bytes < self.capacity_bytes:
                _warn_memlock_once(self.lock_note, self.locked_bytes, self.capacity_bytes)

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
