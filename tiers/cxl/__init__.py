"""The ``cxl`` tier: a shared-memory arena that every process on the host can map.

Modules: :mod:`.arena` (header, access model, placement), :mod:`.tier` (:class:`CxlTier`, the
owner), :mod:`.index` (the shared-memory key index beside the arena), :mod:`.reader`
(:class:`CxlArenaReader`, other processes), :mod:`.stale` (arenas of dead owners).

CXL 3.0 Type 3 memory is byte-addressable memory that several hosts (here:
processes) map at once. We emulate it with one file under ``/dev/shm``
(``/dev/shm/kvpool-<uid>/kvpool-<pool name>-<data dir hash>-cxl`` unless a path is configured), sized with
``ftruncate`` and mapped ``MAP_SHARED``. Its pages are allocated with
``posix_fallocate`` in steps as objects first reach them, never written sparse (a
write to a page tmpfs cannot back is a SIGBUS): a full ``/dev/shm`` lowers the
tier's capacity (:class:`~kvpool.errors.DiskFullError`, then eviction), as a full
disk does for the nvme tier. ``tiers.cxl.prefault = true`` allocates and maps it
whole at start instead (a too-small ``/dev/shm`` then fails at start with
:class:`~kvpool.errors.CapacityError`).

This module owns the arena file format, the owning tier (:class:`CxlTier`),
the same-host reader (:class:`CxlArenaReader`) and the optional latency /
bandwidth model. It does not own which key lives where (the tier manager and
the master do) nor how long a reader may keep a view (leases do).

Arena file layout::

    0                       DATA_OFFSET (one page)            DATA_OFFSET + capacity
    | arena header | zeros  | data area: objects at extent offsets ...           |

Arena header (little-endian, see ``ARENA``)::

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

from tiers.cxl.arena import DATA_OFFSET, SHM_DIR, default_arena_path
from tiers.cxl.reader import CxlArenaReader
from tiers.cxl.stale import collect_stale_arenas
from tiers.cxl.tier import CxlTier

__all__ = ["DATA_OFFSET", "SHM_DIR", "CxlArenaReader", "CxlTier", "collect_stale_arenas", "default_arena_path"]
