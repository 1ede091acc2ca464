"""A check of an LMDB data file's structure before LMDB maps it (LMDB trusts its file:
a corrupt one can crash the process)."""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    pass


log = logging.getLogger("tiers.nvme")

# -- LMDB file check -----------------------------------------------------------------
#
# LMDB 0.9 on-disk format: page header = pgno u64, pad u16, flags u16, lower
# u16, upper u16 (overflow pages: page count u32 in place of lower/upper); the
# meta (pages 0 and 1) follows the header: magic u32, version u32, address u64,
# mapsize u64, two MDB_db (free, main), last_pg u64, txnid u64. MDB_db = pad
# u32 (page size in the free DB's), flags u16, depth u16, branch/leaf/overflow
# page counts, entries, root (u64 each). Nodes: lo u16, hi u16, flags u16,
# ksize u16, key, data.

_PAGE_HDR = struct.Struct("<QHHHH")
_MDB_DB = struct.Struct("<IHHQQQQQ")
_NODE = struct.Struct("<HHHH")
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_DATA_VERSION = 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_MDB_DUPSORT = 0x04
_P_INVALID = (1 << 64) - 1


class _LmdbCorrupt(Exception):
    pass


class _LmdbFileCheck:
    """Walks an LMDB data file the way LMDB would read it, refusing anything out of bounds."""

    def __init__(self, data: Any, size: int) -> None:
        self.data = data
        self.size = size
        self.psize = 0
        self.next_pgno = 0
        self.seen: set[int] = set()

    def run(self) -> None:
        if self.size < 2 * 512:
            raise _LmdbCorrupt(f"{self.size} bytes is shorter than two meta pages")
        metas = []
        offset = 0
        for i in range(2):
            if offset + 152 > self.size:
                raise _LmdbCorrupt(f"meta page {i} lies past the end of the file")
            pgno, _pad, flags, _lo, _up = _PAGE_HDR.unpack_from(self.data, offset)
            magic, version = struct.unpack_from("<II", self.data, offset + 16)
            if not flags & _P_META or magic != _LMDB_MAGIC or version != _LMDB_DATA_VERSION:
                raise _LmdbCorrupt(f"meta page {i} is not an LMDB meta page")
            free_db = _MDB_DB.unpack_from(self.data, offset + 40)
            main_db = _MDB_DB.unpack_from(self.data, offset + 88)
            last_pg, txnid = struct.unpack_from("<QQ", self.data, offset + 136)
            psize = free_db[0]
            if i == 0:
                if psize < 512 or psize > 65536 or psize & (psize - 1):
                    raise _LmdbCorrupt(f"page size {psize} is impossible")
                self.psize = psize
            elif psize != self.psize:
                raise _LmdbCorrupt("the two meta pages disagree on the page size")
            if not 2 <= last_pg + 1 or (last_pg + 1) * psize > self.size or last_pg >= 1 << 40:
                # LMDB would map and read pages up to last_pg: past the file's end that is SIGBUS.
                raise _LmdbCorrupt(f"meta page {i} claims {last_pg + 1} pages, the file holds "
                                   f"{self.size // psize}")
            metas.append((txnid, last_pg, free_db, main_db))
            offset += psize
        # LMDB uses the meta with the higher txnid (meta 0 on a tie).
        _txnid, last_pg, free_db, main_db = metas[1] if metas[1][0] > metas[0][0] else metas[0]
        self.next_pgno = last_pg + 1
        self.seen = {0, 1}
        subs: list[tuple[bytes, tuple[int, ...]]] = []

        def main_value(key: bytes, flags: int, value: bytes) -> None:
            if flags & _F_SUBDATA:
                if len(value) != _MDB_DB.size:
                    raise _LmdbCorrupt("a named database record has the wrong size")
                subs.append((key, _MDB_DB.unpack(value)))

        self.walk("main", main_db, main_value)
        for name, db in subs:
            if db[1] & _MDB_DUPSORT:
                raise _LmdbCorrupt(f"database {name!r} claims DUPSORT, which this index never uses")
            self.walk(repr(name), db, None)
        free_pages: list[int] = []

        def free_value(_key: bytes, _flags: int, value: bytes) -> None:
            if len(value) < 8 or len(value) % 8:
                raise _LmdbCorrupt("a free-list record is not a page list")
            ids = np.frombuffer(value, dtype="<u8")
            if int(ids[0]) != len(ids) - 1:
                raise _LmdbCorrupt("a free-list record's count disagrees with its length")
            free_pages.extend(int(p) for p in ids[1:])

        self.walk("free", free_db, free_value)
        for pgno in free_pages:
            if not 2 <= pgno < self.next_pgno or pgno in self.seen:
                # LMDB would hand such a page out for a new write: over a live page, or past the end.
                raise _LmdbCorrupt(f"free list names page {pgno}, which is live or out of range")

    def page(self, pgno: int) -> int:
        if not 2 <= pgno < self.next_pgno:
            raise _LmdbCorrupt(f"page number {pgno} is outside [2, {self.next_pgno})")
        if pgno in self.seen:
            raise _LmdbCorrupt(f"page {pgno} is reachable twice")
        self.seen.add(pgno)
        return pgno * self.psize

    def walk(self, name: str, db: tuple[int, ...], on_value: Callable[[bytes, int, bytes], None] | None) -> None:
        _pad, _flags, depth, branch_pages, leaf_pages, overflow_pages, entries, root = db
        if root == _P_INVALID:
            if entries or depth or branch_pages or leaf_pages or overflow_pages:
                raise _LmdbCorrupt(f"empty database {name} claims {entries} entries")
            return
        counts = {"branch": 0, "leaf": 0, "overflow": 0, "entries": 0}
        leaf_level: set[int] = set()
        stack = [(root, 1)]
        psize = self.psize
        while stack:
            pgno, level = stack.pop()
            if level > 64:
                raise _LmdbCorrupt(f"database {name} is deeper than any real B-tree")
            base = self.page(pgno)
            stored, _pad2, flags, lower, upper = _PAGE_HDR.unpack_from(self.data, base)
            kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META | _P_LEAF2)
            if stored != pgno or kind not in (_P_BRANCH, _P_LEAF):
                raise _LmdbCorrupt(f"page {pgno} of {name} has a bad header")
            if not (16 <= lower <= upper <= psize) or (lower - 16) % 2 or lower == 16:
                raise _LmdbCorrupt(f"page {pgno} of {name} has bad bounds")
            nodes = (lower - 16) // 2
            counts["branch" if kind == _P_BRANCH else "leaf"] += 1
            if kind == _P_LEAF:
                leaf_level.add(level)
            for i in range(nodes):
                ptr = struct.unpack_from("<H", self.data, base + 16 + 2 * i)[0]
                if not upper <= ptr <= psize - _NODE.size:
                    raise _LmdbCorrupt(f"page {pgno} of {name} has a node outside the page")
                lo, hi, nflags, ksize = _NODE.unpack_from(self.data, base + ptr)
                key_end = ptr + _NODE.size + ksize
                if key_end > psize:
                    raise _LmdbCorrupt(f"page {pgno} of {name} has a key past the page")
                if kind == _P_BRANCH:
                    stack.append((lo | hi << 16 | nflags << 32, level + 1))
                    continue
                counts["entries"] += 1
                dsize = lo | hi << 16
                if nflags & _F_DUPDATA:
                    raise _LmdbCorrupt(f"page {pgno} of {name} holds duplicate data, never written here")
                if nflags & _F_BIGDATA:
                    if key_end + 8 > psize:
                        raise _LmdbCorrupt(f"page {pgno} of {name} has an overflow pointer past the page")
                    first = struct.unpack_from("<Q", self.data, base + key_end)[0]
                    obase = self.page(first)
                    _s, _p, oflags, pages = struct.unpack_from("<QHHI", self.data, obase)
                    if not oflags & _P_OVERFLOW or pages < 1 or first + pages > self.next_pgno \
                            or pages * psize - 16 < dsize:
                        raise _LmdbCorrupt(f"overflow run at page {first} of {name} is out of bounds")
                    for extra in range(first + 1, first + pages):
                        self.page(extra)
                    counts["overflow"] += pages
                    value_at = obase + 16
                else:
                    if key_end + dsize > psize:
                        raise _LmdbCorrupt(f"page {pgno} of {name} has a value past the page")
                    value_at = base + key_end
                if on_value is not None:
                    key = bytes(self.data[base + ptr + _NODE.size:base + key_end])
                    on_value(key, nflags, bytes(self.data[value_at:value_at + dsize]))
        if len(leaf_level) != 1 or leaf_level.pop() != depth:
            raise _LmdbCorrupt(f"database {name}'s leaves are not all at its depth {depth}")
        if (counts["branch"], counts["leaf"], counts["overflow"], counts["entries"]) != (
                branch_pages, leaf_pages, overflow_pages, entries):
            raise _LmdbCorrupt(f"database {name}'s page and entry counts disagree with its tree")


def lmdb_file_problem(data_path: Path) -> str | None:
    """Why LMDB must not open ``data_path``, or None if every page it could read is sound."""
    try:
        with open(data_path, "rb") as f:
            # read, not mmap: a file that shrank under us must not SIGBUS the check itself
            data = f.read()
    except OSError as exc:
        return f"cannot read {data_path.name}: {exc}"
    try:
        _LmdbFileCheck(data, len(data)).run()
    except _LmdbCorrupt as exc:
        return f"{data_path.name}: {exc}"
    except struct.error as exc:  # a structure read past the end of the file
        return f"{data_path.name}: truncated structure ({exc})"
    return None


