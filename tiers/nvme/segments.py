"""The nvme tier's segment files and the aligned, parallel I/O on them."""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvpool import errors
from tiers.base import Extent, Tier, round_up
from tiers.nvme.layout import (
    DISK_FULL_ERRNOS,
    PREFIX_NBYTES,
    SEGMENT_NAME,
    STAGING_GRAIN_BYTES,
    STAGING_KEEP_BYTES,
    UNREADABLE_ERRNOS,
    Prefix,
    parse_prefix,
)

if TYPE_CHECKING:
    pass


log = logging.getLogger("tiers.nvme")


class SegmentFiles(Tier):
    """Segment files under ``path`` (one fd each, O_DIRECT when ``direct_io``), per-thread
    aligned staging buffers, and reads/writes split over ``io_threads`` (a base of NvmeTier)."""

    # Set by NvmeTier.__init__.
    path: Path
    segment_bytes: int
    fsync: bool
    io_threads: int
    io_chunk: int
    direct_io: bool
    _fds: dict[int, int]
    _segments_created: int
    _local: threading.local
    _pool: ThreadPoolExecutor | None

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
        if exc.errno in DISK_FULL_ERRNOS:
            return errors.DiskFullError(exc.errno, f"nvme tier at {self.path}: {doing}: {exc.strerror}")
        return errors.TierError(f"nvme tier at {self.path}: {doing}: {exc}")

    def _prefix_buffer(self) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "prefix", None)
        if buf is None:
            buf = self._local.prefix = np.frombuffer(mmap.mmap(-1, PREFIX_NBYTES), dtype=np.uint8)
        return buf

    def _read_prefix(self, fd: int, position: int) -> Prefix | None:
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
            buf = np.frombuffer(mmap.mmap(-1, round_up(nbytes, STAGING_GRAIN_BYTES)), dtype=np.uint8)
            self._local.buf = buf
        return buf

    def _release_big_staging(self) -> None:
        buf = getattr(self._local, "buf", None)
        if buf is not None and len(buf) > STAGING_KEEP_BYTES:
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
                if exc.errno in UNREADABLE_ERRNOS:
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

