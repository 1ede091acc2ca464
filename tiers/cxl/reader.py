"""Same-host readers of another process's cxl arena: :class:`CxlArenaReader`."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.native import extension
from kvpool.objformat import (
    FIXED_HEADER_NBYTES,
    LayerRange,
    ObjectHeader,
    ObjectSpec,
    copy_layer_checksums,
    decode,
    header_nbytes_at,
    key_digest,
    stored_header_checksum,
)
from tiers.base import advise_huge_pages, close_mapping, madvise
from tiers.cxl.arena import ARENA, DATA_OFFSET, MAX_HEADER_NBYTES, AccessModel, ArenaHeader, lock_is_free
from tiers.cxl.index import IndexEntry, SharedIndexReader, find_shared, index_path

log = logging.getLogger("tiers.cxl")

_layersum = extension("_layersum")  # None without a C compiler: the copies below go one by one
_copy_spans = getattr(_layersum, "copy_spans_digests", None)  # a build older than this file lacks it
_NATIVE_MIN_STEP = _layersum.MIN_STEP if _layersum is not None else 1 << 62

# madvise(MADV_POPULATE_READ) (Linux 5.14+): map a range's pages in one call instead of a
# page fault each on first touch; a reader maps another process's arena, so every object it
# has not read before is cold in its page tables, and a copy from it would fault once per page.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if os.uname().sysname == "Linux" else 0)
# ... once per chunk of this size: a populated page stays mapped (an arena never gives pages
# back), and asking again walks the page tables anyway: asked for every layer of every block,
# those walks add up to a sizeable share of a same-host load's copy time.
_POPULATE_CHUNK = 2 << 20
# :meth:`CxlArenaReader.map_ahead` maps this much a call (~2 ms on 4 KiB pages): the call holds
# the process's memory-map lock, which another thread's mmap (a large allocation) waits for,
# and close() waits for the step under way
_MAP_AHEAD_STEP = 8 << 20

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
        # which _POPULATE_CHUNK chunks of the data area this mapping has populated
        self._populated = bytearray(-(-header.capacity_bytes // _POPULATE_CHUNK))
        #: map_ahead's thread, and the lock it holds while it maps (close takes it before unmapping)
        self._ahead: threading.Thread | None = None
        self._ahead_lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, instance: str | bytes | None = None,
             require_owner: bool = True, prefault: bool = False) -> CxlArenaReader:
        """Map the arena at ``path`` read-only and validate its header.

        ``prefault`` maps every page at once (MAP_POPULATE); by default a page is mapped
        by its first read, so a reader costs what it reads, not the owner's whole arena.

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
            if require_owner and lock_is_free(fd):
                raise errors.TierError(f"cxl: arena {path} has no live owner (stale file)")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            mm = mmap.mmap(fd, file_nbytes, flags=flags, prot=mmap.PROT_READ)
            advise_huge_pages(mm)  # mapped 2 MiB at a time where the owner's tmpfs gives huge pages
        except BaseException:
            os.close(fd)
            raise
        try:
            # A copy: a memoryview of ``mm`` caught in an exception's frame would
            # keep the mapping from closing.
            header = ArenaHeader.unpack(mm[:ARENA.size], file_nbytes)
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
        return not lock_is_free(self._fd)

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
                and not lock_is_free(self._fd))

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
        found = self.find_many([key])[0]
        return None if found is None else (found[0], found[1])

    def find_many(self, keys: Sequence[bytes]) -> list[tuple[int, ObjectHeader, int] | None]:
        """:meth:`find` of each key, the index and the arena file checked once for them all:
        (offset, header, the header's checksum) or None."""
        self._check_open()
        if self._index is None:
            try:
                self._index = SharedIndexReader(index_path(self.path), self.header.instance)
            except errors.KVPoolError:
                return [None] * len(keys)  # an owner without an index (or a dead one): use the master
        self._check_size()
        if find_shared is not None:  # found and checked in C: each header is parsed here once
            snapshots = self._index.find_snapshots(b"".join(map(key_digest, keys)), self.arena, MAX_HEADER_NBYTES)
            return [None if found is None else self._snapshot_header(*found) for found in snapshots]
        entries = self._index.find_many(keys)
        if all(entry is None for entry in entries):
            return [None] * len(keys)
        capacity = self.header.capacity_bytes
        return [None if entry is None else self._indexed_header(key, entry, capacity)
                for key, entry in zip(keys, entries)]

    @staticmethod
    def _snapshot_header(offset: int, snapshot: bytes, nbytes: int,
                         header_sum: int) -> tuple[int, ObjectHeader, int] | None:
        """:meth:`_indexed_header` of a snapshot the C probe checked (whole, naming its key, the
        version indexed, inside the arena): its own checksum and dims, and its size."""
        try:
            header = ObjectHeader.unpack_exact(snapshot)
        except errors.FormatError:
            return None
        return (offset, header, header_sum) if header.spec.total_nbytes == nbytes else None

    def _indexed_header(self, key: bytes, entry: IndexEntry, capacity: int) -> tuple[int, ObjectHeader, int] | None:
        """The header at an index entry, if it is whole, names ``key`` and is the version indexed."""
        if not 0 <= entry.offset <= capacity - FIXED_HEADER_NBYTES:
            return None
        try:
            claimed = header_nbytes_at(self.arena[entry.offset:entry.offset + FIXED_HEADER_NBYTES])
            if not FIXED_HEADER_NBYTES <= claimed <= min(MAX_HEADER_NBYTES, capacity - entry.offset):
                return None
            snapshot = self.arena[entry.offset:entry.offset + claimed].tobytes()  # the one copy used
            header = ObjectHeader.unpack_exact(snapshot)  # (parsed once per distinct header)
        except errors.FormatError:
            return None
        if (not header.is_for(key) or stored_header_checksum(snapshot) != entry.header_sum
                or header.spec.total_nbytes != entry.nbytes or entry.offset + entry.nbytes > capacity):
            return None
        return entry.offset, header, entry.header_sum

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
        src = self.arena[first:first + rng.nbytes].data
        if verify:
            header.copy_verified(layer_range, dst, src)  # the copy is hashed as it is made
        else:
            dst[:] = src
        if self.model.enabled:
            self.model.charge(rng.nbytes, time.perf_counter() - start)

    def read_many_into(self, objects: Sequence[tuple[int, ObjectHeader, LayerRange]],
                       outs: Sequence[memoryview]) -> list[bool]:
        """:meth:`read_layers_into` of many objects, each ``(offset, header, layer_range)``
        (``offset`` and ``header`` as :meth:`find_many` gave them), into ``outs[i]`` (a writable
        contiguous view of exactly those layers' bytes): the arena checked once, its pages mapped in one call
        per chunk, every copy hashed as it is made, in one C call. ``ok[i]`` False: that copy
        failed its checksums (the owner reused the extent meanwhile, or rot) or lies outside the
        arena, so ``outs[i]`` holds bytes that must not be used. Raises OutBufferError for an
        ``out`` of another size or read-only (before anything is copied)."""
        self._check_open()
        self._check_size()
        capacity = self.header.capacity_bytes
        spans: list[tuple[int, memoryview, int, int, int]] = []  # (object, out, first byte, bytes, layer size)
        for i, ((offset, header, layer_range), dst) in enumerate(zip(objects, outs, strict=True)):
            rng = header.spec.layer_bytes(layer_range)
            if dst.readonly or dst.nbytes != rng.nbytes:
                raise errors.OutBufferError(f"out of {dst.nbytes} bytes{' (read-only)' if dst.readonly else ''} "
                                            f"for layers of {rng.nbytes}")
            first = offset + rng.offset
            if offset >= 0 and first + rng.nbytes <= capacity:
                spans.append((i, dst, first, rng.nbytes, header.spec.layer_nbytes))
        start = time.perf_counter()
        for _, _, first, n, _ in spans:
            self._populate(first, n)
        arena = self.arena
        ok = [False] * len(outs)
        if _copy_spans is not None and all(step >= _NATIVE_MIN_STEP for *_, step in spans):
            # one C call: the GIL is given up once, not taken back after every object
            sums = _copy_spans([dst for _, dst, _, _, _ in spans],
                               [arena[first:first + n] for _, _, first, n, _ in spans], [step for *_, step in spans])
            at = 0
            for i, _, _, n, step in spans:
                _, header, layer_range = objects[i]
                ok[i] = sums[at:at + n // step] == header.layer_checksums[layer_range.start:layer_range.stop]
                at += n // step
        else:
            for i, dst, first, n, step in spans:
                _, header, layer_range = objects[i]
                ok[i] = (copy_layer_checksums(dst, arena[first:first + n].data, step)
                         == header.layer_checksums[layer_range.start:layer_range.stop])
        if self.model.enabled:  # one modelled access an object, as read one by one
            elapsed = time.perf_counter() - start
            for _, _, _, n, _ in spans:
                self.model.charge(n, elapsed)
                elapsed = 0.0
        return ok

    def copy_layer_out(self, layer: int, objects: Sequence[tuple[int, ObjectHeader]],
                       outs: Sequence[Any]) -> list[bool]:
        """Copy layer ``layer`` of many objects, each ``(offset, header)`` as :meth:`find` gave
        it, into ``outs[i]`` (one layer's bytes each, e.g. a paged KV cache's block): one call
        for a layer of many blocks, each copy hashed as it is made and checked against its
        header. ``ok[i]`` False: that copy failed its checksum (the owner reused the extent
        meanwhile, or rot), so ``outs[i]`` holds bytes that are not the object's and must not
        be used. Raises LayerRangeError for a layer an object lacks, OutBufferError for an
        ``out`` of another size or read-only (before anything is copied)."""
        wanted = []
        for offset, header in objects:
            spec = header.spec
            if not 0 <= layer < spec.layers:
                raise errors.LayerRangeError(f"layer {layer} of an object of {spec.layers} layers")
            first = offset + spec.header_nbytes + layer * spec.layer_nbytes
            if offset < 0 or first + spec.layer_nbytes > self.header.capacity_bytes:
                raise errors.FormatError(f"cxl: layer at {first} outside the arena")
            wanted.append((offset, header, LayerRange(layer, layer + 1)))
        return self.read_many_into(wanted, [memoryview(out) for out in outs])

    def _populate(self, first: int, nbytes: int) -> bool:
        """Map the pages of data-area bytes ``first .. first + nbytes`` now, in one call, once
        per chunk (best effort: a kernel without MADV_POPULATE_READ faults them in on first
        touch as before; a page the kernel took back meanwhile is faulted in the same way).
        False where the call failed (the file shrank, or no such call)."""
        global _MADV_POPULATE_READ
        if not _MADV_POPULATE_READ or self._mmap is None:
            return False
        if nbytes <= 0:
            return True
        lo, hi = first // _POPULATE_CHUNK, (first + nbytes - 1) // _POPULATE_CHUNK + 1
        lo = self._populated.find(0, lo, hi)
        if lo < 0:
            return True
        hi = self._populated.rfind(0, lo, hi) + 1
        # (chunks end within what the owner has allocated: it grows the arena in 16 MiB steps)
        at = self.header.data_offset + lo * _POPULATE_CHUNK
        at -= at % mmap.PAGESIZE
        end = self.header.data_offset + min(hi * _POPULATE_CHUNK, self.header.capacity_bytes)
        try:
            madvise(self._mmap, _MADV_POPULATE_READ, at, end - at)  # without the GIL
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ENOSYS):
                _MADV_POPULATE_READ = 0  # not in this kernel: never asked again
            log.debug("madvise(MADV_POPULATE_READ) of %d bytes: %s", end - at, exc)
            return False
        self._populated[lo:hi] = b"\x01" * (hi - lo)
        return True

    def map_ahead(self) -> bool:
        """Map, in a background thread (``kvpool-cxl-map``), every page the owner has allocated
        that this mapping has not mapped yet, so reads find them mapped instead of paying the
        page-table work themselves (about 1 us a 4 KiB page: a cold same-host read of 64 MiB
        spent a third of its time on it). Only allocated ranges are mapped (``SEEK_DATA`` /
        ``SEEK_HOLE``; a hole would be allocated in the owner's file by a read fault); what it
        costs is this mapping's page tables (2 MiB a GiB). A same-host node calls it when it
        maps a neighbour's arena and again as it refreshes, for what the owner allocated since.
        True when a thread was started (something was left to map)."""
        if self._mmap is None or not _MADV_POPULATE_READ or (self._ahead is not None and self._ahead.is_alive()):
            return False
        spans = self._unmapped_chunks()
        if not spans:
            return False
        self._ahead = threading.Thread(target=self._map_spans, args=(spans,), name="kvpool-cxl-map", daemon=True)
        self._ahead.start()
        return True

    def _unmapped_chunks(self) -> list[tuple[int, int]]:
        """[lo, hi) chunk ranges wholly inside what the owner has allocated and not yet mapped,
        from the first chunk not mapped yet (nothing to seek through once all are: a node asks
        once a heartbeat, and seeking walks the file's pages)."""
        start_of_data, capacity = self.header.data_offset, self.header.capacity_bytes
        spans: list[tuple[int, int]] = []
        first = self._populated.find(0)
        if first < 0:
            return spans
        at = start_of_data + first * _POPULATE_CHUNK
        try:
            while at < start_of_data + capacity:
                data = os.lseek(self._fd, at, os.SEEK_DATA)
                hole = min(os.lseek(self._fd, data, os.SEEK_HOLE), start_of_data + capacity)
                lo = -(-(data - start_of_data) // _POPULATE_CHUNK)
                hi = (hole - start_of_data) // _POPULATE_CHUNK
                while lo < hi:  # the runs of chunks not yet mapped
                    lo = self._populated.find(0, lo, hi)
                    if lo < 0:
                        break
                    end = self._populated.find(1, lo, hi)
                    end = hi if end < 0 else end
                    spans.append((lo, end))
                    lo = end
                at = hole
        except OSError:  # ENXIO: no data past ``at``; or a file system without SEEK_DATA
            pass
        return spans

    def _map_spans(self, spans: list[tuple[int, int]]) -> None:
        step = _MAP_AHEAD_STEP // _POPULATE_CHUNK
        for lo, hi in spans:
            for first in range(lo, hi, step):
                with self._ahead_lock:  # (closed meanwhile, shrunk: stop; reads map what they read)
                    nbytes = (min(hi, first + step) - first) * _POPULATE_CHUNK
                    if not self._populate(first * _POPULATE_CHUNK, nbytes):
                        return

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
        with self._ahead_lock:  # map_ahead's thread is between two steps, and stops at the next
            close_mapping(self._mmap)
            self._mmap = None
            os.close(self._fd)

    def __enter__(self) -> CxlArenaReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


