"""Checks a reader runs on what a holder sent, before any of it is returned.

:class:`ArrivalCheck` verifies a pull's layers while they arrive; :class:`Speculation` is a
pull from a guessed holder whose bytes count only once the holder's own header (or the
master's ``locate``) vouches for them. See :class:`kvpool.cluster.node.reader.ReplicaReader`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.cluster.node.located import LocatedReplica
from kvpool.cluster.node.same_host import OutView
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec


class Speculation:
    """A pull from a guessed holder, before the master said where the key is
    (:meth:`ReplicaReader.speculate`). Its bytes count only once :meth:`ReplicaReader.accept`
    (a holder that proved itself sent them, whole and naming the key) or
    :meth:`ReplicaReader.confirm` (the master's ``locate`` names the guessed node with the
    same spec and header checksum) took them: until then they are unverified, and when
    neither does they are thrown away (the read then goes on as if no guess had been made)."""

    __slots__ = ("arr", "buf", "check", "failure", "key", "layer_range", "nbytes", "proven", "pulled", "raw_header",
                 "replica")

    arr: np.ndarray
    buf: memoryview
    raw_header: bytearray
    check: ArrivalCheck

    def __init__(self, key: bytes, replica: LocatedReplica, layer_range: LayerRange) -> None:
        self.key, self.replica, self.layer_range = key, replica, layer_range
        self.nbytes = layer_range.count * replica.spec.layer_nbytes
        self.pulled = False
        self.proven = False  # pulled from a holder that proved it holds the cluster key
        #: why the guessed holder failed as a holder (dead, frozen, timed out), if it did: the
        #: located read then skips it rather than wait on it a second time
        self.failure: str | None = None

    def bind(self, out: Any, out_view: OutView) -> bool:
        """Take the caller's ``out`` for the guessed bytes (``arr``, ``buf``; ``check`` checks
        the holder's answer as it arrives, as :meth:`ReplicaReader.accept` takes it), or False
        when it does not fit the guessed spec (the located read says what is wrong)."""
        spec: ObjectSpec = self.replica.spec
        try:
            self.arr, self.buf = out_view(spec, self.layer_range, out)
        except errors.KVPoolError:
            return False
        self.check = guessed_check(self.key, self.replica, self.layer_range, self.buf)
        self.raw_header = self.check.raw_header
        return True


class ArrivalCheck:
    """Checks a pull's bytes as they arrive: the TCP client calls it (``PullRequest.progress``)
    with the payload bytes received so far, between its reads, so hashing layer *i* overlaps
    receiving layer *i+1*. ``check_header`` turns the header the holder sent into the header to
    verify against, or raises; :meth:`finish` checks what is left (everything, after a pull
    that made no progress calls) and returns that header, or raises the first failure.
    ``landed``: called once, from the progress call that verified the last layer (the pull's
    bytes are all in and intact while later pulls are still arriving); never after a failure."""

    __slots__ = ("buf", "check_header", "checked", "error", "header", "landed", "layer_range", "raw_header")

    def __init__(self, check_header: Callable[[bytearray], ObjectHeader], raw_header: bytearray,
                 layer_range: LayerRange, buf: memoryview) -> None:
        self.check_header, self.raw_header, self.layer_range, self.buf = check_header, raw_header, layer_range, buf
        self.header: ObjectHeader | None = None
        self.error: errors.KVPoolError | None = None
        self.checked = 0  # layers verified
        self.landed: Callable[[], None] | None = None

    def __call__(self, received: int) -> None:
        if self.error is None:
            try:
                self._check(received)
            except errors.KVPoolError as exc:  # raised by finish(); the pull reads on meanwhile
                self.error = exc
                return
            landed = self.landed
            if landed is not None and self.checked == self.layer_range.count:
                self.landed = None
                landed()

    def finish(self) -> ObjectHeader:
        if self.error is not None:
            raise self.error
        header = self.header
        if header is None:
            header = self.header = self.check_header(self.raw_header)
        if not self.checked:  # all at once (a pull without progress calls)
            header.verify(self.layer_range, self.buf)
            self.checked = self.layer_range.count
        elif self.checked < self.layer_range.count:
            self._check(len(self.buf))
        return header

    def _check(self, received: int) -> None:
        if self.header is None:
            self.header = self.check_header(self.raw_header)
        step = self.header.spec.layer_nbytes
        count = self.layer_range.count
        ready = min(received // step, count)
        if ready == count and not self.checked:  # all at once (the usual small pull)
            self.header.verify(self.layer_range, self.buf)
            self.checked = ready
        elif ready > self.checked:
            start = self.layer_range.start
            self.header.verify(LayerRange(start + self.checked, start + ready),
                               self.buf[self.checked * step:ready * step])
            self.checked = ready


def guessed_check(key: bytes, replica: LocatedReplica, layer_range: LayerRange, buf: memoryview) -> ArrivalCheck:
    """The check of a pull from a guessed holder, which no master vouched for: the header the
    holder sends must be whole, name ``key`` and have the guessed spec (``replica.spec``), and
    every layer in ``buf`` must match it."""
    spec: ObjectSpec = replica.spec

    def own(raw: bytearray) -> ObjectHeader:
        header = ObjectHeader.unpack_exact(raw, spec)
        header.check_identity(key)
        if header.spec is not spec and header.spec != spec:
            raise errors.WrongObjectError(f"the holder's object is {header.spec}, guessed {spec}")
        return header

    return ArrivalCheck(own, bytearray(spec.header_nbytes), layer_range, buf)


def check_same(header: ObjectHeader, same_as: ObjectHeader | None, layer_range: LayerRange) -> None:
    if same_as is not None and header.layer_checksums[layer_range.start:layer_range.stop] != \
            same_as.layer_checksums[layer_range.start:layer_range.stop]:
        raise errors.WrongObjectError("this replica holds other bytes than the one read before")


def located_check(key: bytes, replica: LocatedReplica, layer_range: LayerRange, buf: memoryview,
                  same_as: ObjectHeader | None = None, raw_header: bytearray | None = None) -> ArrivalCheck:
    """The check of a pull from a located ``replica``: the header the holder sends (into
    ``raw_header``, a new buffer by default) must be the one the master indexed for it (and agree
    with ``same_as``), and every layer in ``buf`` must match that header."""
    spec: ObjectSpec = replica.spec

    def indexed(raw: bytearray) -> ObjectHeader:
        header = ObjectHeader.unpack_expected(raw, key, replica.header_sum, spec)
        check_same(header, same_as, layer_range)
        return header

    return ArrivalCheck(indexed, bytearray(spec.header_nbytes) if raw_header is None else raw_header,
                        layer_range, buf)
