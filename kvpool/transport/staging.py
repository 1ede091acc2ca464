"""The nvme read path of both pull servers: a ``read_into`` source's payload read piece by
piece into page-aligned staging buffers (:func:`staging_buffer`), each piece by
:func:`read_piece`, and sent while the next is read.

Over UCX, :class:`StagedReads` pipelines it across threads: it runs on the server's progress
thread except :meth:`StagedReads._read`, which runs on a worker thread and only reads the
job's state; it sends, aborts and releases through the callbacks the server gives it. Over
TCP, :func:`staged_pieces` reads the pieces on the connection's own thread, one buffer per
connection, each sent before the next is read.
"""

from __future__ import annotations

import collections
import mmap
from collections.abc import Callable, Generator
from typing import Any

from kvpool import errors
from kvpool.transport.engine import describe
from kvpool.transport.source import ServeJob, ServeSource


def staging_buffer(nbytes: int) -> mmap.mmap:
    """A staging buffer: anonymous memory, page-aligned as direct (O_DIRECT) reads want."""
    return mmap.mmap(-1, nbytes)


def read_piece(source: ServeSource, offset: int, out: memoryview) -> None:
    """Fill ``out`` with ``source``'s payload bytes from ``offset`` (its ``read_into``).
    Raises what the read raised, or TransferError for a short read."""
    assert source.read_into is not None
    got = source.read_into(offset, out)
    if got is not None and got != out.nbytes:
        raise errors.TransferError(f"short read: {got} of {out.nbytes} bytes at {offset}")


def staged_pieces(source: ServeSource, buf: mmap.mmap, step: int) -> Generator[memoryview, None, None]:
    """``source``'s payload in pieces of at most ``step`` bytes, each read into ``buf`` (so
    valid until the next is asked for). A failed or short read raises TransferError. Close it
    when done early (a failed send): that releases its view of ``buf``."""
    view = memoryview(buf)
    try:
        for offset in range(0, source.nbytes, step):
            piece = view[:min(step, source.nbytes - offset)]
            try:
                read_piece(source, offset, piece)
            except Exception as exc:
                raise errors.TransferError(f"reading the object failed at {offset}: {describe(exc)}") from None
            yield piece
    finally:
        view.release()


class _StagingPool:
    """Page-aligned buffers reused for nvme reads (O_DIRECT needs the alignment)."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._limit = count
        self._free: list[mmap.mmap] = []
        self._made = 0
        self.waiting: collections.deque[ServeJob] = collections.deque()

    def take(self) -> mmap.mmap | None:
        if self._free:
            return self._free.pop()
        if self._made < self._limit:
            self._made += 1
            return staging_buffer(self.nbytes)
        return None

    def give(self, buf: mmap.mmap) -> None:
        self._free.append(buf)

    @property
    def free_count(self) -> int:
        return len(self._free) + self._limit - self._made

    def close(self) -> None:
        for buf in self._free:
            try:
                buf.close()
            except BufferError:  # still exported to an in-flight send; freed with it
                pass
        self._free.clear()


class StagedReads:
    """Reads of ``read_into`` sources, two staging buffers per pull at most (read chunk i+1
    while chunk i is on the wire), ``count`` buffers of ``nbytes`` in all (made on first use).

    ``submit(fn, *args)`` runs ``fn`` on a worker thread; ``post(fn)`` runs it on the
    progress thread (raises PoolClosedError once closing); ``send(job, index, payload,
    staging)`` sends one chunk and hands ``staging`` back through :meth:`give` when done;
    ``abort(job)`` tells the client a read failed once nothing is in flight;
    ``release(job)`` releases a finished job's source.
    """

    def __init__(self, count: int, nbytes: int, *, submit: Callable[..., Any],
                 post: Callable[[Callable[[], None]], Any],
                 send: Callable[[ServeJob, int, memoryview, mmap.mmap], bool],
                 abort: Callable[[ServeJob], None], release: Callable[[ServeJob], None]) -> None:
        self._count, self._nbytes = count, nbytes
        self._submit, self._post, self._send = submit, post, send
        self._abort, self._release = abort, release
        self._pool: _StagingPool | None = None

    def pump(self, job: ServeJob) -> None:
        """Start as many reads of ``job`` as its share of buffers allows."""
        if self._pool is None:
            self._pool = _StagingPool(self._count, self._nbytes)
        pool = self._pool
        while (not job.finished and not job.abort_text
               and job.chunks_started + job.reads_in_flight < job.chunks_total
               and job.reads_in_flight + (job.chunks_started - job.chunks_done) < 2):
            buf = pool.take()
            if buf is None:
                if job not in pool.waiting:
                    pool.waiting.append(job)
                return
            job.staging.append(buf)
            index = job.chunks_started + job.reads_in_flight + 1
            job.reads_in_flight += 1
            assert job.source is not None
            self._submit(self._read, job, job.source, index, buf)

    def _read(self, job: ServeJob, source: ServeSource, index: int, buf: mmap.mmap) -> None:
        # Runs on a worker thread; job state is only read here, never written.
        assert source.read_into is not None
        offset = (index - 1) * job.chunk
        nbytes = min(job.chunk, source.nbytes - offset)
        view = memoryview(buf)[:nbytes]
        error: BaseException | None = None
        try:
            read_piece(source, offset, view)
        except BaseException as exc:
            error = exc
        finally:
            view.release()
        try:
            self._post(lambda: self._on_read(job, index, buf, nbytes, error))
        except errors.PoolClosedError:
            pass

    def _on_read(self, job: ServeJob, index: int, buf: mmap.mmap, nbytes: int, error: BaseException | None) -> None:
        job.reads_in_flight -= 1
        if job.finished:
            self.give(job, buf)
            if job.reads_in_flight == 0:
                self._release(job)  # deferred until no read used the source
            return
        if error is not None or job.abort_text:
            self.give(job, buf)
            if not job.abort_text:
                assert error is not None  # one of the two holds
                job.abort_text = f"reading the object failed: {describe(error)}"
            self._abort(job)
            return
        # Reads may finish out of order; tags carry the chunk index, so order is free.
        self._send(job, index, memoryview(buf)[:nbytes], buf)

    def give(self, job: ServeJob, buf: mmap.mmap) -> None:
        """A staging buffer back from ``job``; hands free buffers to pulls waiting for one."""
        if buf in job.staging:
            job.staging.remove(buf)
        pool = self._pool
        if pool is None:
            return
        pool.give(buf)
        free_before = pool.free_count
        while pool.waiting and pool.free_count >= free_before:
            waiter = pool.waiting.popleft()
            if not waiter.finished:
                self.pump(waiter)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
