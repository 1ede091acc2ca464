"""The ``nvme`` tier: objects in preallocated segment files on a local SSD.

Modules: :mod:`.layout` (on-disk constants, the record prefix), :mod:`.lmdbcheck` (the index
file checked before LMDB maps it), :mod:`.fs` (filesystem probes), :mod:`.segments` (segment
files, aligned parallel I/O), :mod:`.index` (opening, the LMDB index, rebuilding it),
:mod:`.tier` (:class:`NvmeTier`).

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

Headroom. Before a segment file is first prepared, the tier checks the
filesystem: if preallocating it would leave less than ``tiers.nvme.headroom``
free (auto: the larger of 64 MiB and 2% of the filesystem, at most a quarter of
it), only the part that keeps it free is used and the effective capacity is
lowered as for a full disk below (one warning; ``stats()["headroom_bytes"]``),
so the segments never take the bytes the index, ``durable.log`` and every other
writer on that filesystem need.

Full disk. Segment files are preallocated with ``posix_fallocate``, so a full
filesystem shows up when a segment is prepared, not as a torn write later.
ENOSPC/EDQUOT/EFBIG there (or from any write) lowers the tier's *effective*
capacity, ``capacity_bytes``, to what the filesystem really holds (space
already preallocated plus what is free now, less the headroom or at least a
reserve for the index;
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
split into ``io_chunk`` pieces with ``io_threads`` in flight, since an SSD serves
several requests in parallel and one at a time leaves it idle between them.

This module does not decide what is stored here or when it is evicted (the
tier manager does), and it knows nothing of other tiers or the master.
"""

from tiers.nvme.tier import NvmeTier

__all__ = ["NvmeTier"]
