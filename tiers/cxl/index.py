"""A key index in shared memory: same-host processes find ``cxl`` objects without the master.

Owns one open-addressing hash table in a ``/dev/shm`` file beside a cxl arena
(``<arena>.index``), written by the arena's owner only and read in place by
any process on the host. It maps a key (by its xxh3-128) to where the object
sits in the arena and the checksum of its header; it never holds KV bytes.

Concurrency: single writer, many readers, a seqlock per slot. The writer makes
a slot's sequence odd, writes the fields, makes it even again; a reader copies
the fields between two reads of the sequence and retries if it was odd or
moved. On x86 (TSO) stores are seen in program order, which is all this
needs. A reader must still verify what it then reads from the arena — the
header checksum recorded here against the header at the offset, and every
layer against its checksum — because the owner may free and reuse the extent
at any moment after the lookup: the index says where to look, the checksums
say whether what was found is the object.

Deletion uses tombstones; a full table (live + tombstones over 3/4) stops
taking inserts (those objects stay reachable through the master) until
removals make room.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvpool import errors
from kvpool.native import extension
from tiers.base import close_mapping

_index = extension("_index")  # None without a C compiler: probes go key by key in Python
# (offset, header snapshot, nbytes, header_sum) per key, found and checked in C; a build older
# than this file lacks it
find_shared = getattr(_index, "find_shared", None)

MAGIC = b"KVPLIDX1"
DEAD = b"KVPLDEAD"  # written over MAGIC when the owner closes the index
_HEADER = struct.Struct("<8sQQ16s")  # magic, slot count, slot size, arena instance
HEADER_NBYTES = 64
EMPTY, LIVE, TOMBSTONE = 0, 1, 2
# A slot is 8 little-endian u64 words (one cache line):
SEQ, STATE, HASH_LO, HASH_HI, OFFSET, NBYTES, HEADER_SUM = range(7)
SLOT_WORDS = 8
SLOT_NBYTES = 8 * SLOT_WORDS
_MAX_LOAD = 0.75
_RETRIES = 64


def share_with_group(fd: int, gid: int | None) -> None:
    """Make a freshly created 0600 file readable by ``gid`` (0640, group ``gid``); no-op for None."""
    if gid is None:
        return
    try:
        os.fchown(fd, -1, gid)
    except PermissionError:
        raise errors.ConfigError(
            f"tiers.cxl.group: this user may not give files to gid {gid} (not a member)") from None
    os.fchmod(fd, 0o640)


def index_path(arena_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(arena_path)}.index")


def slot_count_for(capacity_bytes: int) -> int:
    """A power of two with room for one object per 16 KiB of arena at under half load."""
    want = max(1024, 2 * capacity_bytes // (16 << 10))
    return 1 << (want - 1).bit_length()


def _hash(key: bytes) -> tuple[int, int]:
    digest = xxhash.xxh3_128_intdigest(key)
    return digest & 0xFFFFFFFFFFFFFFFF, digest >> 64


@dataclass(frozen=True, slots=True)
class IndexEntry:
    offset: int
    nbytes: int
    header_sum: int


class _Table:
    def __init__(self, mm: mmap.mmap, slots: int) -> None:
        self.mm = mm
        self.words = np.frombuffer(mm, dtype="<u8", count=slots * SLOT_WORDS, offset=HEADER_NBYTES)
        self.mask = slots - 1

    def probe(self, hash_lo: int) -> range:
        start = hash_lo & self.mask
        return range(start, start + self.mask + 1)


class SharedIndexWriter:
    """The arena owner's side: insert and remove entries (call from one thread at a time)."""

    def __init__(self, path: str | os.PathLike[str], slots: int, instance: bytes, *,
                 group: int | None = None) -> None:
        if slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        self.path = Path(path)
        nbytes = HEADER_NBYTES + slots * SLOT_NBYTES
        # A fresh file renamed over the path, never an old one truncated: a process
        # still mapping a previous owner's index must not fault (SIGBUS).
        tmp = self.path.with_name(f"{self.path.name}.tmp-{instance.hex()[:12]}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            share_with_group(fd, group)  # readable by that group's members too (tiers.cxl.group)
            os.ftruncate(fd, nbytes)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise errors.CapacityError(f"cannot size {self.path} to {nbytes} bytes: {exc}") from exc
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            self._ino = os.fstat(fd)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self._table = _Table(mm, slots)
        self._table.words[:] = 0
        self.slot_count = slots
        self.live = 0
        self.used = 0  # live + tombstones
        mm[:_HEADER.size] = _HEADER.pack(MAGIC, slots, SLOT_NBYTES, instance)  # readers see a whole table
        os.rename(tmp, self.path)

    def insert(self, key: bytes, entry: IndexEntry) -> bool:
        """Add or replace ``key``; False when the table is too full (the entry is then absent)."""
        if self._insert(key, entry):
            return True
        if self.used > self.live:  # tombstones fill the table: sweep them out, then retry
            self._compact()
            return self._insert(key, entry)
        return False

    def _compact(self) -> None:
        """Re-insert the live entries into an emptied table (drops every tombstone).

        Readers racing with this may miss an entry for a moment and ask the
        master instead; they never see a wrong one (every slot write is seqlocked).
        """
        words = self._table.words
        live = []
        for base in range(0, len(words), SLOT_WORDS):
            state = int(words[base + STATE])
            if state == LIVE:
                live.append(words[base:base + SLOT_WORDS].tolist())
            if state != EMPTY:
                self._write(base, EMPTY, 0, 0, IndexEntry(0, 0, 0))
        self.used = self.live = 0
        for row in live:
            self._place(row[HASH_LO], row[HASH_HI], IndexEntry(row[OFFSET], row[NBYTES], row[HEADER_SUM]))

    def _insert(self, key: bytes, entry: IndexEntry) -> bool:
        lo, hi = _hash(key)
        return self._place(lo, hi, entry)

    def _place(self, lo: int, hi: int, entry: IndexEntry) -> bool:
        words, mask = self._table.words, self._table.mask
        target = None
        for i in self._table.probe(lo):
            base = (i & mask) * SLOT_WORDS
            state = int(words[base + STATE])
            if state == EMPTY:
                if target is None:
                    if self.used + 1 > _MAX_LOAD * self.slot_count:
                        return False
                    target = base
                    self.used += 1
                break
            if state == TOMBSTONE:
                if target is None:
                    target = base
                continue
            if int(words[base + HASH_LO]) == lo and int(words[base + HASH_HI]) == hi:
                target = base
                self.live -= 1
                break
        if target is None:
            return False
        self._write(target, LIVE, lo, hi, entry)
        self.live += 1
        return True

    def remove(self, key: bytes, offset: int) -> bool:
        """Remove ``key`` if it still points at ``offset`` (a newer entry is kept)."""
        lo, hi = _hash(key)
        words, mask = self._table.words, self._table.mask
        for i in self._table.probe(lo):
            base = (i & mask) * SLOT_WORDS
            state = int(words[base + STATE])
            if state == EMPTY:
                return False
            if state == LIVE and int(words[base + HASH_LO]) == lo and int(words[base + HASH_HI]) == hi:
                if int(words[base + OFFSET]) != offset:
                    return False
                self._write(base, TOMBSTONE, 0, 0, IndexEntry(0, 0, 0))
                self.live -= 1
                return True
        return False

    def _write(self, base: int, state: int, lo: int, hi: int, entry: IndexEntry) -> None:
        words = self._table.words
        seq = int(words[base + SEQ])
        words[base + SEQ] = seq + 1  # odd: readers retry
        words[base + STATE:base + HEADER_SUM + 1] = (state, lo, hi, entry.offset, entry.nbytes, entry.header_sum)
        words[base + SEQ] = seq + 2

    def close(self, *, unlink: bool = True) -> None:
        """Tell readers the index is gone (they stop finding anything), then unmap it."""
        self._table.mm[:8] = DEAD
        self._table.words = None  # type: ignore[assignment]
        close_mapping(self._table.mm)
        if unlink:
            try:
                if os.path.samestat(self._ino, os.stat(self.path)):  # never a successor's index
                    self.path.unlink()
            except FileNotFoundError:
                pass


class SharedIndexReader:
    """Another process's read-only view of an index; ``find`` never blocks the writer."""

    def __init__(self, path: str | os.PathLike[str], instance: bytes | None = None) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise errors.TierError(f"cannot open shared index {self.path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise errors.TierError(f"{self.path} is not a regular file")
            size = st.st_size
            if size < HEADER_NBYTES:
                raise errors.FormatError(f"{self.path}: {size} bytes is not an index")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept: every lookup checks the file was not shrunk under the mapping
        self._mapped_nbytes = size
        magic, slots, slot_size, owner = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC:
            mm.close()
            os.close(fd)
            raise errors.BadMagicError(f"{self.path}: not a kvpool shared index")
        if slot_size != SLOT_NBYTES or HEADER_NBYTES + slots * slot_size > size or slots & (slots - 1):
            mm.close()
            os.close(fd)
            raise errors.FormatError(f"{self.path}: index geometry does not fit the file")
        if instance is not None and owner != instance:
            mm.close()
            os.close(fd)
            raise errors.TierError(f"{self.path} belongs to another arena instance")
        self.instance = owner
        self._table = _Table(mm, slots)

    def find(self, key: bytes) -> IndexEntry | None:
        """Where ``key`` was at the moment of the lookup, or None (absent, or the slot stayed busy)."""
        return self.find_many([key])[0]

    def find_many(self, keys: Sequence[bytes]) -> list[IndexEntry | None]:
        """:meth:`find` of each key, the mapping checked once for them all."""
        if not self._readable():
            return [None] * len(keys)
        return [self._probe(key) for key in keys]

    def _readable(self) -> bool:
        """Whether the table may be read now: not shrunk under the mapping (touching it would
        fault), not closed by its owner."""
        return os.fstat(self._fd).st_size >= self._mapped_nbytes and self._table.mm[:8] == MAGIC

    def find_snapshots(self, digests: bytes, arena: np.ndarray,
                       max_header: int) -> list[tuple[int, bytes, int, int] | None]:
        """Each key's entry and its header, copied once out of ``arena`` (the owner's data area,
        its file checked by the caller not to have shrunk) and checked on that copy: whole as it
        claims (at most ``max_header`` bytes), naming the key, the version indexed. ``digests``:
        the keys' 16-byte xxh3-128 digests, joined. Per key (offset, snapshot, nbytes,
        header_sum) or None. The snapshot's own checksum and dims are the caller's to check
        (:meth:`ObjectHeader.unpack_exact`). Only with the C extension (``find_shared`` not None)."""
        assert find_shared is not None, "kvpool._index is not built"
        if not self._readable():
            return [None] * (len(digests) // 16)
        found: list[tuple[int, bytes, int, int] | None] = find_shared(self._table.words, arena, digests, max_header,
                                                                      _RETRIES)
        return found

    def _probe(self, key: bytes) -> IndexEntry | None:
        lo, hi = _hash(key)
        words, mask = self._table.words, self._table.mask
        for i in self._table.probe(lo):
            base = (i & mask) * SLOT_WORDS
            for _ in range(_RETRIES):
                seq = int(words[base + SEQ])
                row = words[base:base + SLOT_WORDS].tolist()
                if not seq & 1 and int(words[base + SEQ]) == seq == row[SEQ]:
                    break
            else:
                return None  # the writer kept this slot busy: the caller falls back to the master
            if row[STATE] == EMPTY:
                return None
            if row[STATE] == LIVE and row[HASH_LO] == lo and row[HASH_HI] == hi:
                return IndexEntry(row[OFFSET], row[NBYTES], row[HEADER_SUM])
        return None

    def close(self) -> None:
        self._table.words = None  # type: ignore[assignment]
        close_mapping(self._table.mm)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
