"""The master's key index: which node holds each key, with what record, in fixed-width arrays.

What it owns
    key -> replicas (node, tier, spec, size, header checksum, location) for every key the
    master knows, and a replica count per node. Not the node registry, leases, durability or
    deletes sent to nodes (:mod:`kvpool.cluster.master.state` keeps those).

How (see docs/master_index.md for the numbers and the choice)
    Keys are 16-byte prefix hashes, so a key is two u64 in a table with open addressing
    (linear probing, at most :data:`MAX_LOAD` full): the key, its first replica's node (u16
    id into a node table; 0 empty, 0xFFFF a deleted slot), a *shape* id (u32 into an interned
    table of (tier, spec, size, location without its offset)), the header checksum (u64) and,
    only where some location carries one, an offset (i64). Everything else goes into small
    Python side tables that cost CPython prices only for what needs them: a key's second and
    later replicas, keys that are not 16 bytes long, and records whose shape cannot be
    interned (a location with a list in it, or more shapes than :data:`MAX_SHAPES`).

    Batches (publish, register, exists, lookup) are probed in C (``kvpool._index``: one pass
    over each key's probe; a lookup stops at its first miss), or with numpy over the whole
    batch where the extension is not built; a single key is probed in Python through
    memoryviews of the same arrays.

Bounds
    ``max_keys`` (``master.max_keys``) is checked before anything changes: a request that
    would index more keys than that is refused whole with PoolFullError.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvpool import errors
from kvpool.cluster.master.records import Holders, Replica
from kvpool.native import extension

if TYPE_CHECKING:
    from kvpool import _index as _native
else:
    _native = extension("_index")  # None where not built: batches are probed with numpy

KEY_BYTES = 16
EMPTY, TOMB = 0, 0xFFFF  # node column: a slot never used / a slot whose key was removed
MAX_NODES = 0xFFFE       # node ids 1..0xFFFE
MAX_LOAD = 0.6           # full + deleted slots, as a fraction of the table, before it is rebuilt
MIN_CAPACITY = 16
MAX_SHAPES = 1 << 20
SPARSE_PROBE = 256       # keys still probing from which a probe step reads the low halves first
REBUILD_CHUNK = 1 << 18  # table slots moved per numpy step of a rebuild (bounds its temporaries)
WHOLE = 0                # shape id of a record kept whole in a side table
_C1, _C2, _M64 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, (1 << 64) - 1
_U64 = np.uint64

# One replica as the Python paths carry it: (node id, shape id, header checksum, offset).
Enc = tuple[int, int, int, int]
U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]


def slot_hash(lo: int, hi: int) -> int:
    h = (lo * _C1 + hi * _C2) & _M64
    return h ^ (h >> 31)


def _hash_vec(lo: U64Array, hi: U64Array) -> U64Array:
    h = lo * _U64(_C1) + hi * _U64(_C2)
    mixed: U64Array = h ^ (h >> _U64(31))
    return mixed


def split_keys(keys: Sequence[bytes]) -> tuple[U64Array, U64Array]:
    """16-byte keys as their (low, high) u64 halves, little-endian."""
    return split_key_bytes(b"".join(keys))


def split_key_bytes(keys: bytes) -> tuple[U64Array, U64Array]:
    """16-byte keys end to end as their (low, high) u64 halves, little-endian."""
    halves = np.frombuffer(keys, dtype="<u8").reshape(-1, 2)
    return np.ascontiguousarray(halves[:, 0]), np.ascontiguousarray(halves[:, 1])


def key_list(keys: bytes) -> list[bytes]:
    """16-byte keys end to end, one by one."""
    return [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]


def distinct(h: U64Array, lo: U64Array, hi: U64Array) -> bool:
    """Whether the keys (``lo``, ``hi``; ``h`` their hashes) are all different, in O(n): each
    key writes its position into a claim table at its hash's bucket; a key whose write did not
    stay is compared with the one whose did, and the keys that lost go round again (equal keys
    share a bucket every round, so one of them wins one and the other is compared with it)."""
    n = h.size
    bits = max(4, (2 * n - 1).bit_length())
    claim = np.empty(1 << bits, np.int64)
    bucket = (h & _U64((1 << bits) - 1)).astype(np.int64)
    cand = np.arange(n)
    while cand.size:
        b = bucket[cand]
        claim[b] = cand
        winner = claim[b]
        lost = winner != cand
        if not lost.any():
            return True
        cand, winner = cand[lost], winner[lost]
        if ((lo[cand] == lo[winner]) & (hi[cand] == hi[winner])).any():
            return False
    return True


def tune_process_memory() -> None:
    """Memory settings for a process serving a large index (the master calls this at start).

    * numpy stops asking the kernel for transparent huge pages for its arrays (it does for
      every array of 4 MiB or more). Where the kernel compacts memory to find them (THP defrag
      "madvise", a common default) a first touch can stall while the kernel compacts, and
      table rebuilds and batch temporaries touch fresh memory all the time, so the stalls add
      up to more than huge pages save (measurements: docs/master_index.md).
    * glibc's malloc keeps up to 64 MiB of freed memory instead of giving it back at once,
      and maps blocks of 32 MiB or more on their own: a batch's temporaries (a few MiB each)
      then reuse memory instead of faulting fresh pages in for every batch (a third fewer page
      faults indexing 30M keys); the table's columns, larger than that, still go back to the
      system when a rebuild frees them.
    """
    for module in ("_core", "core"):  # numpy 2, numpy 1
        setter = getattr(getattr(np, module, None), "multiarray", None)
        if setter is not None and hasattr(setter, "_set_madvise_hugepage"):
            setter._set_madvise_hugepage(False)
            break
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc; elsewhere nothing to tune
    except (AttributeError, OSError):
        return
    mallopt(-1, 64 << 20)   # M_TRIM_THRESHOLD
    mallopt(-3, 32 << 20)   # M_MMAP_THRESHOLD


class Shape(tuple[Any, ...]):
    """(tier, spec, nbytes, location template items or None, has header checksum, has offset)."""

    __slots__ = ()


class KeyIndex:
    """key -> {node id: Replica}, compact (see the module). Node ids are the master's strings;
    inside, each is a u16 given out by :meth:`node_index`."""

    def __init__(self, max_keys: int = 0, capacity: int = MIN_CAPACITY) -> None:
        self.max_keys = max_keys  # 0: no limit
        self._used = 0    # table slots holding a key
        self._tombs = 0   # table slots whose key was removed (probes pass over them)
        self.replicas = 0  # replicas indexed, all keys
        self.generation = 0  # bumped whenever the table is rebuilt
        self._has_offsets = False
        self._alloc(max(MIN_CAPACITY, 1 << (max(capacity, 1) - 1).bit_length()))
        self._extra: dict[bytes, list[Enc]] = {}  # 16-byte keys: replicas after the one in the table
        self._odd: dict[bytes, list[Enc]] = {}    # keys of other lengths: all their replicas
        self._whole: dict[tuple[bytes, int], Replica] = {}  # (key, node) of records with shape WHOLE
        self._shapes: list[Shape | None] = [None]
        self._shape_ids: dict[Shape, int] = {}
        self._shape_nbytes: list[int] = [0]
        self.node_ids: list[str | None] = [None]
        self._node_index: dict[str, int] = {}
        self._node_counts: list[int] = [0]
        self._free_nodes: list[int] = []
        #: every change, as a list of msgpack-able values, for a standby to replay (see
        #: kvpool.cluster.master.follow); None: changes are not recorded
        self.journal: Callable[[list[Any]], None] | None = None

    # -- table storage -------------------------------------------------------------------

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self._mask = capacity - 1
        # np.zeros: pages are only resident once written (an untouched offset column costs nothing).
        self.k0 = np.zeros(capacity, np.uint64)
        self.k1 = np.zeros(capacity, np.uint64)
        self.nd = np.zeros(capacity, np.uint16)
        self.sh = np.zeros(capacity, np.uint32)
        self.hs = np.zeros(capacity, np.uint64)
        self.off = np.zeros(capacity, np.int64)
        self._views()

    def _views(self) -> None:
        # memoryview indexing gives Python ints without a numpy scalar each: the one-key paths.
        self._k0, self._k1, self._nd = self.k0.data, self.k1.data, self.nd.data
        self._sh, self._hs, self._off = self.sh.data, self.hs.data, self.off.data

    def _rebuild(self, capacity: int) -> None:
        """A new table of ``capacity`` slots holding the live keys (no deleted slots left). The
        old table is moved over in slices of REBUILD_CHUNK slots: nothing larger than a slice is
        copied, and a slice's keys land in one or two narrow ranges of the new table."""
        old: list[npt.NDArray[Any]] = [self.k0, self.k1, self.nd, self.sh, self.hs]
        old_off = self.off if self._has_offsets else None
        old_capacity = self.capacity
        self._alloc(capacity)
        self._used = self._tombs = 0
        if capacity == 2 * old_capacity:
            self._move_doubled(old, old_off, old_capacity)
            self.generation += 1
            return
        for start in range(0, old_capacity, REBUILD_CHUNK):
            part = slice(start, start + REBUILD_CHUNK)
            nd = old[2][part]
            live = np.flatnonzero((nd != EMPTY) & (nd != TOMB))
            if live.size:
                k0, k1, nd, sh, hs = (column[part][live] for column in old)
                self._place(k0, k1, nd, sh, hs, None if old_off is None else old_off[part][live])
        self.generation += 1

    def _move_doubled(self, old: list[npt.NDArray[Any]], old_off: I64Array | None, old_capacity: int) -> None:
        """Move the old table's keys into this empty one of twice its size, without probing.

        A key's new home is its old home, or that plus the old capacity: the two halves of the
        new table. Read in the old table's slot order, a slice's keys are nearly in the order
        of their homes; sorted (a stable sort of nearly sorted numbers) and placed each at
        ``max(home, the slot after the one placed before it in that half)`` (a running maximum,
        vectorised), every slot from a key's home to its own is taken, as linear probing
        requires. Keys that would break the order go in last, by probing (:meth:`_place`):
        those whose old probe wrapped past the table's end, those that come after a key of a
        later home (the edges of slices), and those that would run past their half's end."""
        half = old_capacity
        last = [-1, half - 1]         # the last slot placed in each half
        top = [-1, -1]                # the largest home placed in each half
        later: list[tuple[npt.NDArray[Any], ...]] = []
        for start in range(0, old_capacity, REBUILD_CHUNK):
            part = slice(start, start + REBUILD_CHUNK)
            nd = old[2][part]
            live = np.flatnonzero((nd != EMPTY) & (nd != TOMB))
            if not live.size:
                continue
            k0, k1, nd, sh, hs = (column[part][live] for column in old)
            off = None if old_off is None else old_off[part][live]
            home = (_hash_vec(k0, k1) & _U64(2 * half - 1)).astype(np.int64)
            wrapped = live + start < (home & (half - 1))  # its old probe passed the table's end
            for b in (0, 1):
                mine = (home >= half) if b else (home < half)
                late = mine & (wrapped | (home < top[b]))
                if late.any():
                    later.append(tuple(a[late] for a in (k0, k1, nd, sh, hs, off) if a is not None))
                pick = np.flatnonzero(mine & ~late)
                if not pick.size:
                    continue
                order = pick[np.argsort(home[pick], kind="stable")]
                homes = home[order]
                steps = np.arange(order.size)
                slots = np.maximum(np.maximum.accumulate(homes - steps), last[b] + 1) + steps
                fits = int(np.searchsorted(slots, (b + 1) * half))  # slots only grow
                if fits < order.size:
                    rest = order[fits:]
                    later.append(tuple(a[rest] for a in (k0, k1, nd, sh, hs, off) if a is not None))
                    order, slots = order[:fits], slots[:fits]
                    if not fits:
                        continue
                self.k0[slots], self.k1[slots], self.nd[slots] = k0[order], k1[order], nd[order]
                self.sh[slots], self.hs[slots] = sh[order], hs[order]
                if off is not None:
                    self.off[slots] = off[order]
                self._used += fits
                last[b] = int(slots[-1])
                top[b] = int(homes[fits - 1])
        for columns in later:
            k0, k1, nd, sh, hs = columns[:5]
            self._place(k0, k1, nd, sh, hs, columns[5] if old_off is not None else None)

    def _reserve_slots(self, more: int) -> bool:
        """Room for ``more`` new keys within MAX_LOAD: rebuilt larger, or the same size without
        its deleted slots. True if the table was rebuilt (slots found before have moved)."""
        if self._used + self._tombs + more <= self.capacity * MAX_LOAD:
            return False
        capacity = self.capacity  # the same size if it was mostly deleted slots, else larger
        while self._used + more > capacity * MAX_LOAD * 0.75:
            capacity *= 2
        self._rebuild(capacity)
        return True

    def _place(self, lo: U64Array, hi: U64Array, nd: Any, sh: Any, hs: Any, off: Any,
               start: I64Array | None = None) -> None:
        """Put keys known to be absent (and distinct) into free slots; vectorised over the batch.
        ``nd`` and ``sh`` may be one value for all; ``start``: where each key's probe may begin
        (its home slot when not given; else a slot no further than its first free one, as
        :meth:`_probe` finds)."""
        n = lo.size
        if not n:
            return
        mask = self._mask
        cur = (_hash_vec(lo, hi) & _U64(mask)).astype(np.int64) if start is None else start
        pend = np.arange(n)
        ndc = self.nd
        one_nd, one_sh = np.isscalar(nd), np.isscalar(sh)
        # Two keys of the batch may want one free slot: each writes its position into a small
        # claim table at the slot's bucket, and the one whose write stayed takes it (O(n), no
        # sort). A loser of a free slot tries it again; a key at a full slot moves on.
        buckets = 1 << max(4, (2 * n - 1).bit_length())
        claim = np.empty(buckets, np.int64)
        bmask = buckets - 1
        # From where _probe found them free, with no deleted slots to count: every start is
        # free but for the batch's own claims (no need to read the node column again).
        known_free = start is not None and not self._tombs
        while pend.size:
            if known_free:
                known_free = False
                state = free_here = None
                free = np.arange(pend.size)
            else:
                state = ndc[cur]
                free_here = (state == EMPTY) | (state == TOMB)
                free = np.flatnonzero(free_here)
                if not free.size:
                    cur = (cur + 1) & mask
                    continue
            b = cur[free] & bmask
            claim[b] = free
            won = free[claim[b] == free]
            slots, win = cur[won], pend[won]
            if self._tombs and state is not None:
                self._tombs -= int(np.count_nonzero(state[won] == TOMB))
            self.k0[slots], self.k1[slots] = lo[win], hi[win]
            ndc[slots] = nd if one_nd else nd[win]
            self.sh[slots] = sh if one_sh else sh[win]
            self.hs[slots] = hs[win]
            if off is not None:
                self.off[slots] = off[win]
            self._used += slots.size
            if won.size == pend.size:
                return
            keep = np.ones(pend.size, bool)
            keep[won] = False
            cur = (cur if free_here is None else np.where(free_here, cur, (cur + 1) & mask))[keep]
            pend = pend[keep]

    def _find_many(self, lo: U64Array, hi: U64Array) -> I64Array:
        """Table slot of each key, -1 where absent."""
        if _native is None:
            return self._probe(lo, hi)[0]
        out = np.empty(lo.size, np.int64)
        _native.find(self.k0, self.k1, self.nd, lo, hi, out, False)
        return out

    def _leading(self, lo: U64Array, hi: U64Array) -> int:
        """How many leading keys are indexed (in C: the probes stop at the first miss)."""
        if _native is None:
            found = self._probe(lo, hi)[0] >= 0
            return lo.size if found.all() else int(np.argmin(found))
        return _native.find(self.k0, self.k1, self.nd, lo, hi, np.empty(lo.size, np.int64), True)

    def _probe(self, lo: U64Array, hi: U64Array, h: U64Array | None = None,
               free: bool = False) -> tuple[I64Array, I64Array]:
        """(table slot of each key or -1 where absent, and with ``free`` where each absent key
        would go: the first deleted or empty slot of its probe). ``h``: the keys' hashes."""
        mask = self._mask
        cur = ((_hash_vec(lo, hi) if h is None else h) & _U64(mask)).astype(np.int64)
        n = lo.size
        out = np.full(n, -1, np.int64)
        ins = np.full(n, -1, np.int64) if free else out
        pend = np.arange(n)
        plo, phi = lo, hi
        k0, k1, ndc = self.k0, self.k1, self.nd
        tombs = self._tombs
        while pend.size:
            if pend.size >= SPARSE_PROBE and not (free and tombs):
                # Most probes of many keys meet other keys: the low halves are read first, the
                # node column and the high half only where the low half matched or is zero (an
                # empty slot's key is zero; so is a key's now and then: the node column decides).
                g = k0[cur]
                go = np.ones(pend.size, bool)
                maybe = np.flatnonzero(g == plo)
                if maybe.size:
                    at = cur[maybe]
                    st = ndc[at]
                    hits = maybe[(k1[at] == phi[maybe]) & (st != EMPTY) & (st != TOMB)]
                    out[pend[hits]] = cur[hits]
                    go[hits] = False
                zero = np.flatnonzero(g == 0)
                if zero.size:
                    ends = zero[ndc[cur[zero]] == EMPTY]
                    if free:
                        ins[pend[ends]] = cur[ends]
                    go[ends] = False
                if go.all():
                    cur = (cur + 1) & mask
                else:
                    pend, cur, plo, phi = pend[go], (cur[go] + 1) & mask, plo[go], phi[go]
                continue
            state = ndc[cur]
            hit = (k0[cur] == plo) & (k1[cur] == phi) & (state != EMPTY) & (state != TOMB)
            if hit.any():
                out[pend[hit]] = cur[hit]
            empty = state == EMPTY
            if free:
                if tombs:
                    first = np.flatnonzero(empty | (state == TOMB))
                    first = first[ins[pend[first]] < 0]
                else:
                    first = np.flatnonzero(empty)
                ins[pend[first]] = cur[first]
            go = ~(empty | hit)
            pend, cur, plo, phi = pend[go], (cur[go] + 1) & mask, plo[go], phi[go]
        return out, ins

    def _find(self, key: bytes) -> tuple[int, int, int]:
        """(slot or -1, low half, high half) of a 16-byte key."""
        lo, hi = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
        mask = self._mask
        s = slot_hash(lo, hi) & mask
        nd, k0, k1 = self._nd, self._k0, self._k1
        while True:
            state = nd[s]
            if state == EMPTY:
                return -1, lo, hi
            if state != TOMB and k0[s] == lo and k1[s] == hi:
                return s, lo, hi
            s = (s + 1) & mask

    def _clear_slot(self, s: int) -> None:
        self._nd[s] = TOMB
        self._used -= 1
        self._tombs += 1

    def _slot_enc(self, s: int) -> Enc:
        return (self._nd[s], self._sh[s], self._hs[s], self._off[s] if self._has_offsets else 0)

    def _set_slot(self, s: int, enc: Enc) -> None:
        self._nd[s], self._sh[s], self._hs[s] = enc[0], enc[1], enc[2]
        if enc[3]:
            self._mark_offsets()
            self._off[s] = enc[3]
        elif self._has_offsets:
            self._off[s] = 0

    def _mark_offsets(self) -> None:
        self._has_offsets = True

    # -- nodes and shapes ------------------------------------------------------------------

    def node_index(self, node_id: str) -> int:
        """The u16 id of ``node_id``, given out on first use."""
        idx = self._node_index.get(node_id)
        if idx is None:
            if self._free_nodes:
                idx = self._free_nodes.pop()
                self.node_ids[idx] = node_id
            else:
                idx = len(self.node_ids)
                if idx > MAX_NODES:
                    raise errors.PoolFullError(f"the master indexes at most {MAX_NODES} nodes")
                self.node_ids.append(node_id)
                self._node_counts.append(0)
            self._node_index[node_id] = idx
        return idx

    def forget_node(self, node_id: str) -> None:
        """``node_id`` holds nothing and is gone: its id may be given to another node."""
        idx = self._node_index.get(node_id)
        if idx is not None and not self._node_counts[idx]:
            del self._node_index[node_id]
            self.node_ids[idx] = None
            self._free_nodes.append(idx)

    def node_count(self, node_id: str) -> int:
        """Replicas indexed on ``node_id``."""
        idx = self._node_index.get(node_id)
        return 0 if idx is None else self._node_counts[idx]

    def encode(self, tier: str, spec: Sequence[Any], nbytes: int, header_sum: int | None,
               location: dict[str, Any] | None) -> tuple[int, int, int]:
        """(shape id, header checksum or 0, offset or 0) of one record; shape WHOLE: keep it whole."""
        offset = 0
        template: tuple[Any, ...] = ()
        if location:
            items = []
            for name, value in location.items():
                if name == "offset" and type(value) is int and 0 < value < 1 << 63:
                    offset = value
                elif isinstance(value, (str, int, float, bytes, bool)) or value is None:
                    items.append((name, value))
                else:
                    return WHOLE, 0, 0
            template = tuple(sorted(items))
        shape = Shape((tier, tuple(spec), nbytes, template, header_sum is not None, offset != 0))
        sid = self._shape_ids.get(shape)
        if sid is None:
            if len(self._shapes) >= MAX_SHAPES:
                return WHOLE, 0, 0
            sid = self._shape_ids[shape] = len(self._shapes)
            self._shapes.append(shape)
            self._shape_nbytes.append(nbytes)
            if self.journal is not None:
                self.journal(["shape", sid, tier, list(spec), nbytes, [list(i) for i in template],
                              header_sum is not None, offset != 0])
        return sid, header_sum or 0, offset

    def encode_record(self, record: Replica) -> tuple[int, int, int]:
        return self.encode(record.tier, record.spec, record.nbytes, record.header_sum, record.location)

    def nbytes_of(self, shape_id: int) -> int:
        return self._shape_nbytes[shape_id]

    def _decode(self, key: bytes, enc: Enc) -> Replica:
        idx, sid, _, _ = enc
        if sid == WHOLE:
            return self._whole[(key, idx)]
        return Replica(*self._shaped(enc), None)

    def _shaped(self, enc: Enc) -> tuple[str, Any, int, int | None, dict[str, Any]]:
        """(tier, spec, nbytes, header checksum or None, location) of a record kept by shape."""
        _, sid, header_sum, offset = enc
        shape = self._shapes[sid]
        assert shape is not None
        tier, spec, nbytes, template, has_sum, has_offset = shape
        location = dict(template)
        if has_offset:
            location["offset"] = offset
        return tier, spec, nbytes, header_sum if has_sum else None, location

    # -- questions ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._used + len(self._odd)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, key: object) -> bool:
        if type(key) is not bytes:
            return False
        if len(key) != KEY_BYTES:
            return key in self._odd
        return self._find(key)[0] >= 0

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is indexed (one probe of the batch for 16-byte keys)."""
        if len(keys) < 8 or set(map(len, keys)) != {KEY_BYTES}:
            return [k in self for k in keys]
        slots = self._find_many(*split_keys(keys))
        found: list[bool] = (slots >= 0).tolist()
        return found

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are indexed."""
        if len(keys) < 8:
            n = 0
            for key in keys:
                if key not in self:
                    break
                n += 1
            return n
        if set(map(len, keys)) != {KEY_BYTES}:
            found = self.contains_many(keys)
            return found.index(False) if False in found else len(found)
        return self._leading(*split_keys(keys))

    def _encs(self, key: bytes) -> list[Enc]:
        if len(key) != KEY_BYTES:
            return list(self._odd.get(key, ()))
        s = self._find(key)[0]
        if s < 0:
            return []
        return [self._slot_enc(s), *self._extra.get(key, ())]

    def get(self, key: bytes) -> Holders | None:
        """The replicas of ``key`` by node id, built for the caller (changing it changes nothing
        here); None if it is not indexed."""
        encs = self._encs(key) if type(key) is bytes else []
        if not encs:
            return None
        held = Holders()
        for enc in encs:
            held[self.node_ids[enc[0]]] = self._decode(key, enc)  # type: ignore[index]
        return held

    def located_many(self, keys: Sequence[bytes]) -> list[list[tuple[str, dict[str, Any]]] | None]:
        """Each key's replicas as ``(node id, record)``, the record as a fresh map of what
        ``{**replica}`` gives (:class:`Replica`'s fields that are set, ``location`` always) for
        the caller to add to; None where the key is not indexed. What ``locate`` answers, in one
        probe of the batch for 16-byte keys, without a Replica or Holders per key."""
        if len(keys) >= 8 and set(map(len, keys)) == {KEY_BYTES}:
            slots: list[int] = self._find_many(*split_keys(keys)).tolist()
        else:
            slots = [self._find(key)[0] if type(key) is bytes and len(key) == KEY_BYTES else -2 for key in keys]
        node_ids, extra = self.node_ids, self._extra
        out: list[list[tuple[str, dict[str, Any]]] | None] = []
        for key, s in zip(keys, slots):
            if s == -2:  # not 16 bytes long: kept whole
                held = self.get(key)
                out.append(None if held is None else [(node_id, {**record}) for node_id, record in held.items()])
                continue
            if s < 0:
                out.append(None)
                continue
            encs = [self._slot_enc(s), *extra.get(key, ())] if extra else [self._slot_enc(s)]
            located = []
            for enc in encs:
                node_id = node_ids[enc[0]]
                assert node_id is not None
                located.append((node_id, self._record_map(key, node_id, enc)))
            out.append(located)
        return out

    def _record_map(self, key: bytes, node_id: str, enc: Enc) -> dict[str, Any]:
        """``{**self._decode(key, enc)}`` with its ``node_id``, built straight from the shape."""
        idx, sid, _, _ = enc
        if sid == WHOLE:
            return {**self._whole[(key, idx)], "node_id": node_id}
        tier, spec, nbytes, header_sum, location = self._shaped(enc)
        record: dict[str, Any] = {"tier": tier, "spec": spec, "nbytes": nbytes}
        if header_sum is not None:
            record["header_sum"] = header_sum
        record["location"] = location
        record["node_id"] = node_id
        return record

    def holder_ids(self, key: bytes) -> list[str]:
        return [self.node_ids[e[0]] for e in self._encs(key)]  # type: ignore[misc]

    def holds(self, key: bytes, node_id: str) -> bool:
        idx = self._node_index.get(node_id)
        return idx is not None and any(e[0] == idx for e in self._encs(key))

    def items(self, prefix: bytes = b"") -> Iterator[tuple[bytes, Holders]]:
        """(key, replicas) of every key starting with ``prefix``, in no particular order."""
        for key in list(self._odd):
            if key.startswith(prefix):
                held = self.get(key)
                if held is not None:
                    yield key, held
        live = (self.nd != EMPTY) & (self.nd != TOMB)
        if prefix:
            if len(prefix) > KEY_BYTES:
                return
            padded = prefix.ljust(KEY_BYTES, b"\0")
            mask = (b"\xff" * len(prefix)).ljust(KEY_BYTES, b"\0")
            p0, p1 = int.from_bytes(padded[:8], "little"), int.from_bytes(padded[8:], "little")
            m0, m1 = int.from_bytes(mask[:8], "little"), int.from_bytes(mask[8:], "little")
            live &= ((self.k0 & _U64(m0)) == _U64(p0)) & ((self.k1 & _U64(m1)) == _U64(p1))
        generation = self.generation
        slots = np.flatnonzero(live)
        for start in range(0, slots.size, 4096):  # a few thousand Python ints at a time
            for s in slots[start:start + 4096].tolist():
                if self.generation != generation:  # changed under the caller: stop rather than mislead
                    return
                key = self._k0[s].to_bytes(8, "little") + self._k1[s].to_bytes(8, "little")
                held = self.get(key)
                if held is not None:
                    yield key, held

    # -- changes ---------------------------------------------------------------------------

    def _check_room(self, new_keys: int) -> None:
        if self.max_keys and new_keys and len(self) + new_keys > self.max_keys:
            raise errors.PoolFullError(
                f"the master's index is full: {len(self):,} keys indexed, {new_keys:,} more asked for, "
                f"master.max_keys = {self.max_keys:,} (nothing of this request was indexed)")

    def add(self, key: bytes, node_id: str, record: Replica) -> bool:
        """Index ``record`` for ``key`` on ``node_id`` (replacing that node's record); True if the
        node did not hold the key. PoolFullError (nothing changed) past ``max_keys``."""
        sid, header_sum, offset = self.encode_record(record)
        new = self.add_encoded(key, self.node_index(node_id), sid, header_sum, offset, record)
        if self.journal is not None:
            self.journal(["add", node_id, [key], [sid], [header_sum], [offset],
                          [[0, _record_wire(record)]] if sid == WHOLE else []])
        return new

    def add_encoded(self, key: bytes, idx: int, sid: int, header_sum: int, offset: int,
                    record: Replica | None = None) -> bool:
        enc: Enc = (idx, sid, header_sum, offset)
        if sid == WHOLE:
            assert record is not None
            record.node_id = None
        if len(key) != KEY_BYTES:
            encs = self._odd.get(key)
            if encs is None:
                self._check_room(1)
                encs = self._odd[key] = []
            new = self._replace_in(encs, enc)
        else:
            s, lo, hi = self._find(key)
            if s < 0:
                self._check_room(1)
                self._reserve_slots(1)
                s = slot_hash(lo, hi) & self._mask
                while self._nd[s] not in (EMPTY, TOMB):
                    s = (s + 1) & self._mask
                if self._nd[s] == TOMB:
                    self._tombs -= 1
                self._k0[s], self._k1[s] = lo, hi
                self._set_slot(s, enc)
                self._used += 1
                new = True
            elif self._nd[s] == idx:
                self._set_slot(s, enc)
                new = False
            else:
                new = self._replace_in(self._extra.setdefault(key, []), enc)
        if sid == WHOLE:
            self._whole[(key, idx)] = record  # type: ignore[assignment]
        elif not new:
            self._whole.pop((key, idx), None)
        if new:
            self.replicas += 1
            self._node_counts[idx] += 1
        return new

    @staticmethod
    def _replace_in(encs: list[Enc], enc: Enc) -> bool:
        for i, old in enumerate(encs):
            if old[0] == enc[0]:
                encs[i] = enc
                return False
        encs.append(enc)
        return True

    def add_many(self, node_id: str, keys: list[bytes], sids: list[int], header_sums: list[int],
                 offsets: list[int], records: Sequence[Replica | None] = ()) -> tuple[int, int]:
        """Index one node's records (parallel lists; ``records`` needed only for shape WHOLE);
        the last of repeated keys wins. Returns (replicas the node did not hold, their bytes).
        PoolFullError before anything changes when the new keys would pass ``max_keys``."""
        added = self._add_many(node_id, keys, sids, header_sums, offsets, records)
        if self.journal is not None and keys:
            self.journal(["add", node_id, keys, sids, header_sums, offsets,
                          [[i, _record_wire(r)] for i, r in enumerate(records) if r is not None]])
        return added

    def _add_many(self, node_id: str, keys: list[bytes], sids: list[int], header_sums: list[int],
                  offsets: list[int], records: Sequence[Replica | None] = ()) -> tuple[int, int]:
        idx = self.node_index(node_id)
        n = len(keys)
        if n < 16 or WHOLE in sids or min(map(len, keys)) != KEY_BYTES or max(map(len, keys)) != KEY_BYTES:
            self._check_room(self._new_keys(keys))
            new = nbytes = 0
            for i, key in enumerate(keys):
                if self.add_encoded(key, idx, sids[i], header_sums[i], offsets[i], records[i] if records else None):
                    new += 1
                    nbytes += self._shape_nbytes[sids[i]]
            return new, nbytes
        if len(set(keys)) != n:  # the last of each repeated key wins
            last = {k: i for i, k in enumerate(keys)}
            order = sorted(last.values())
            keys = [keys[i] for i in order]
            sids = [sids[i] for i in order]
            header_sums = [header_sums[i] for i in order]
            offsets = [offsets[i] for i in order]
            n = len(keys)
        lo, hi = split_keys(keys)
        slots = self._find_many(lo, hi)
        absent = slots < 0
        fresh = int(np.count_nonzero(absent))
        self._check_room(fresh)
        sid_a = np.full(n, sids[0], np.uint32) if sids.count(sids[0]) == n else np.asarray(sids, np.uint32)
        hs_a = np.asarray(header_sums, np.uint64)
        off_a = np.asarray(offsets, np.int64) if offsets.count(0) != n else None
        if off_a is not None:
            self._mark_offsets()
        # Keys whose table slot is this node's: replaced in place.
        present = np.flatnonzero(~absent)
        new = fresh
        new_shapes: list[int] = []  # of the extra replicas
        if present.size:
            at = slots[present]
            mine = self.nd[at] == idx
            same, other = present[mine], present[~mine]
            ss = slots[same]
            self.sh[ss], self.hs[ss] = sid_a[same], hs_a[same]
            if self._has_offsets:
                self.off[ss] = off_a[same] if off_a is not None else 0
            for i in other.tolist():  # another node's key: this node's copy is an extra replica
                enc = (idx, sids[i], header_sums[i], offsets[i])
                if self._replace_in(self._extra.setdefault(keys[i], []), enc):
                    new += 1
                    new_shapes.append(sids[i])
            if self._whole:
                for i in same.tolist():
                    self._whole.pop((keys[i], idx), None)
        if fresh:
            self._reserve_slots(fresh)
            sel = np.flatnonzero(absent)
            self._place(lo[sel], hi[sel], idx, sid_a[sel], hs_a[sel], off_a[sel] if off_a is not None else None)
        self.replicas += new
        self._node_counts[idx] += new
        nbytes_of = self._shape_nbytes
        new_bytes = sum(nbytes_of[s] for s in new_shapes)
        if fresh:
            counts = np.bincount(sid_a[absent])
            new_bytes += sum(int(c) * nbytes_of[s] for s, c in enumerate(counts.tolist()) if c)
        return new, new_bytes

    def add_columns(self, node_id: str, keys: bytes, lo: U64Array, hi: U64Array, sid: int,
                    header_sums: U64Array) -> tuple[int, int]:
        """:meth:`add_many` for a batch of one node's records of one shape ``sid`` (not WHOLE)
        without offsets, as columns: 16-byte ``keys`` end to end, the same keys as (``lo``,
        ``hi``) halves, and their header checksums. Probed, checked and written with numpy only
        (no Python object per key) unless some keys repeat in the batch or are already held by
        another node."""
        h = _hash_vec(lo, hi)
        if lo.size < 16 or not distinct(h, lo, hi):
            n = lo.size
            return self.add_many(node_id, key_list(keys), [sid] * n, header_sums.tolist(), [0] * n)
        added = self._add_columns(self.node_index(node_id), keys, lo, hi, h, sid, header_sums)
        if self.journal is not None:
            self.journal(["addc", node_id, keys, sid, header_sums.astype("<u8").tobytes()])
        return added

    def _add_columns(self, idx: int, keys: bytes, lo: U64Array, hi: U64Array, h: U64Array, sid: int,
                     header_sums: U64Array) -> tuple[int, int]:
        slots, free = self._probe(lo, hi, h, free=True)
        absent = slots < 0
        fresh = int(np.count_nonzero(absent))
        self._check_room(fresh)
        new = fresh
        if fresh < lo.size:
            present = np.flatnonzero(~absent)
            at = slots[present]
            mine = self.nd[at] == idx
            same, other = present[mine], present[~mine]
            ss = at[mine]
            self.sh[ss], self.hs[ss] = sid, header_sums[same]
            if self._has_offsets:
                self.off[ss] = 0
            # Another node's key: this node's copy is an extra replica.
            for i, header_sum in zip(other.tolist(), header_sums[other].tolist()):
                key = keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]
                if self._replace_in(self._extra.setdefault(key, []), (idx, sid, header_sum, 0)):
                    new += 1
                elif self._whole:
                    self._whole.pop((key, idx), None)
            if self._whole:
                for i in same.tolist():
                    self._whole.pop((keys[i * KEY_BYTES:(i + 1) * KEY_BYTES], idx), None)
        if fresh:
            sel = np.flatnonzero(absent) if fresh < lo.size else None
            start = None if self._reserve_slots(fresh) else free if sel is None else free[sel]
            if sel is None:
                self._place(lo, hi, idx, sid, header_sums, None, start)
            else:
                self._place(lo[sel], hi[sel], idx, sid, header_sums[sel], None, start)
        self.replicas += new
        self._node_counts[idx] += new
        return new, new * self._shape_nbytes[sid]

    def check_room_columns(self, keys: bytes, lo: U64Array, hi: U64Array) -> None:
        """:meth:`check_room` for keys given as :meth:`add_columns` takes them."""
        if not self.max_keys:
            return
        h = _hash_vec(lo, hi)
        if distinct(h, lo, hi):
            self._check_room(int(np.count_nonzero(self._probe(lo, hi, h)[0] < 0)))
        else:
            self.check_room(key_list(keys))

    def _new_keys(self, keys: Sequence[bytes]) -> int:
        if not self.max_keys:
            return 0
        return self.contains_many(list(set(keys))).count(False)

    def check_room(self, keys: Sequence[bytes]) -> None:
        """PoolFullError if indexing ``keys`` would pass ``max_keys``."""
        self._check_room(self._new_keys(keys))

    def remove(self, key: bytes, node_id: str) -> bool:
        """Drop ``node_id``'s replica of ``key``; False if it held none."""
        idx = self._node_index.get(node_id)
        if idx is None:
            return False
        if len(key) != KEY_BYTES:
            encs = self._odd.get(key)
            if not encs or not self._drop_from(encs, idx):
                return False
            if not encs:
                del self._odd[key]
        else:
            s = self._find(key)[0]
            if s < 0:
                return False
            extra = self._extra.get(key)
            if self._nd[s] == idx:
                if extra:
                    self._set_slot(s, extra.pop(0))
                    if not extra:
                        del self._extra[key]
                else:
                    self._clear_slot(s)
            elif not extra or not self._drop_from(extra, idx):
                return False
            elif not extra:
                del self._extra[key]
        self._whole.pop((key, idx), None)
        self.replicas -= 1
        self._node_counts[idx] -= 1
        if self.journal is not None:
            self.journal(["rm", node_id, key])
        return True

    @staticmethod
    def _drop_from(encs: list[Enc], idx: int) -> bool:
        for i, enc in enumerate(encs):
            if enc[0] == idx:
                del encs[i]
                return True
        return False

    def pop(self, key: bytes) -> list[str] | None:
        """Forget ``key`` entirely; its former holders' ids, or None if it was not indexed."""
        encs = self._encs(key)
        if not encs:
            return None
        if len(key) != KEY_BYTES:
            del self._odd[key]
        else:
            self._clear_slot(self._find(key)[0])
            self._extra.pop(key, None)
        holders = []
        for idx, sid, _, _ in encs:
            if sid == WHOLE:
                self._whole.pop((key, idx), None)
            self._node_counts[idx] -= 1
            holders.append(self.node_ids[idx])
        self.replicas -= len(encs)
        if self.journal is not None:
            self.journal(["pop", key])
        return holders  # type: ignore[return-value]

    def records_of(self, node_id: str, tier: str | None = None) -> list[tuple[bytes, Replica]]:
        """Every (key, replica) ``node_id`` holds (in ``tier`` only, if given): its table slots
        found in one pass over the node column, then the keys with more than one holder."""
        idx = self._node_index.get(node_id)
        if idx is None or not self._node_counts[idx]:
            return []
        out: list[tuple[bytes, Replica]] = []
        for s in np.flatnonzero(self.nd == idx).tolist():
            key = self._k0[s].to_bytes(8, "little") + self._k1[s].to_bytes(8, "little")
            out.append((key, self._decode(key, self._slot_enc(s))))
        for table in (self._extra, self._odd):
            for key, encs in table.items():
                out += [(key, self._decode(key, enc)) for enc in encs if enc[0] == idx]
        return out if tier is None else [(key, record) for key, record in out if record.tier == tier]

    def drop_node(self, node_id: str) -> int:
        """Drop every replica of ``node_id``; how many there were."""
        idx = self._node_index.get(node_id)
        if idx is None or not self._node_counts[idx]:
            return 0
        dropped = self._node_counts[idx]
        for table in (self._extra, self._odd):
            for key in [k for k, encs in table.items() if any(e[0] == idx for e in encs)]:
                encs = table[key]
                encs[:] = [e for e in encs if e[0] != idx]
                if not encs:
                    del table[key]
        # A table slot of this node whose key has other holders takes the next one's record.
        for key, encs in list(self._extra.items()):
            s = self._find(key)[0]
            if s >= 0 and self._nd[s] == idx:
                self._set_slot(s, encs.pop(0))
                if not encs:
                    del self._extra[key]
        gone = np.flatnonzero(self.nd == idx)
        self.nd[gone] = TOMB
        self._used -= gone.size
        self._tombs += gone.size
        if self._whole:
            for pair in [p for p in self._whole if p[1] == idx]:
                del self._whole[pair]
        self.replicas -= dropped
        self._node_counts[idx] = 0
        if self.journal is not None:
            self.journal(["drop", node_id])
        return dropped

    # -- a standby's copy (kvpool.cluster.master.follow) ------------------------------------------

    def put_shape(self, sid: int, tier: str, spec: list[Any], nbytes: int, template: list[list[Any]],
                  has_sum: bool, has_offset: bool) -> None:
        """Replay a shape the leader interned (shapes arrive in the order they were given ids)."""
        if sid != len(self._shapes):
            raise errors.ProtocolError(f"change stream: shape {sid} arrived when {len(self._shapes)} was next")
        shape = Shape((tier, tuple(spec), nbytes, tuple(tuple(i) for i in template), has_sum, has_offset))
        self._shape_ids[shape] = sid
        self._shapes.append(shape)
        self._shape_nbytes.append(nbytes)

    def snapshot(self) -> tuple[dict[str, Any], list[npt.NDArray[Any]]]:
        """Everything, as (msgpack-able tables, the live table columns); :meth:`load` takes it."""
        live = np.flatnonzero((self.nd != EMPTY) & (self.nd != TOMB))
        columns: list[npt.NDArray[Any]] = [self.k0[live], self.k1[live], self.nd[live], self.sh[live], self.hs[live]]
        if self._has_offsets:
            columns.append(self.off[live])
        tables: dict[str, Any] = {
            "shapes": [None if s is None else [s[0], list(s[1]), s[2], [list(i) for i in s[3]], s[4], s[5]]
                       for s in self._shapes],
            "node_ids": self.node_ids, "node_counts": self._node_counts, "free_nodes": self._free_nodes,
            "extra": [[k, [list(e) for e in v]] for k, v in self._extra.items()],
            "odd": [[k, [list(e) for e in v]] for k, v in self._odd.items()],
            "whole": [[k, idx, _record_wire(r)] for (k, idx), r in self._whole.items()],
            "replicas": self.replicas, "live": int(live.size), "has_offsets": self._has_offsets,
        }
        return tables, columns

    def load(self, tables: dict[str, Any], columns: list[npt.NDArray[Any]]) -> None:
        """Become the index :meth:`snapshot` described (replacing everything)."""
        live = int(tables["live"])
        capacity = MIN_CAPACITY
        while live > capacity * MAX_LOAD * 0.75:
            capacity *= 2
        self._has_offsets = bool(tables["has_offsets"])
        self._alloc(capacity)
        self._used = self._tombs = 0
        parts = columns[:6] if self._has_offsets else columns[:5]
        for start in range(0, live, REBUILD_CHUNK):
            k0, k1, nd, sh, hs, *off = (c[start:start + REBUILD_CHUNK] for c in parts)
            self._place(k0, k1, nd, sh, hs, off[0] if off else None)
        self.generation += 1
        self._shapes = [None]
        self._shape_ids = {}
        self._shape_nbytes = [0]
        for sid, shape in enumerate(tables["shapes"]):
            if shape is not None:
                self.put_shape(sid, *shape)
        self.node_ids = list(tables["node_ids"])
        self._node_index = {nid: i for i, nid in enumerate(self.node_ids) if nid is not None}
        self._node_counts = list(tables["node_counts"])
        self._free_nodes = list(tables["free_nodes"])
        self._extra = {bytes(k): [tuple(e) for e in v] for k, v in tables["extra"]}
        self._odd = {bytes(k): [tuple(e) for e in v] for k, v in tables["odd"]}
        self._whole = {(bytes(k), idx): _replica(r) for k, idx, r in tables["whole"]}
        self.replicas = int(tables["replicas"])

    def stats(self) -> dict[str, Any]:
        """Sizes for ``stats`` (and docs/master_index.md)."""
        table_bytes = sum(a.nbytes for a in (self.k0, self.k1, self.nd, self.sh, self.hs))
        return {
            "keys": len(self), "replicas": self.replicas, "capacity": self.capacity,
            "table_bytes": table_bytes + (self.off.nbytes if self._has_offsets else 0),
            "deleted_slots": self._tombs, "extra_replicas": sum(len(v) for v in self._extra.values()),
            "other_length_keys": len(self._odd), "shapes": len(self._shapes) - 1,
            "whole_records": len(self._whole), "max_keys": self.max_keys,
        }


def _record_wire(record: Replica) -> dict[str, Any]:
    return {"tier": record.tier, "spec": list(record.spec), "nbytes": record.nbytes,
            "header_sum": record.header_sum, "location": dict(record.location or {})}


def _replica(wire: dict[str, Any]) -> Replica:
    return Replica(wire["tier"], wire["spec"], wire["nbytes"], wire["header_sum"], wire["location"], None)
