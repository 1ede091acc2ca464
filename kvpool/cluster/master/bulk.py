"""Large ``publish`` and ``register`` requests decoded without a Python object per record.

Two ways, tried in this order; a frame neither takes goes the general way
(:func:`kvpool.cluster.wire.protocol.unpack_request`), which names what is wrong with it, so errors
read the same whichever way a frame went.

* **Columns** (:class:`RecordColumns`): a node's dram or nvme records of one kind of object are
  msgpack maps that differ only in the 16 bytes of the key and the 8 bytes of the header
  checksum, so the records are rows of one width. The first row is decoded and checked as
  :class:`~kvpool.cluster.wire.schema.Record` would be, and re-encoded field by field, which must
  give back its exact bytes (so the positions of the key and checksum are known, not searched
  for); every other row must equal it byte for byte outside those two fields. Such a row
  decodes to what the first decodes to with its own key and checksum: the batch becomes a key
  array and a checksum array (numpy) without a Python object per record.
* **Records** (:class:`BulkRecord`): ``Record``'s ``__post_init__`` checks as msgspec
  constraints, checked while decoding, and one shared spec for a batch of one kind of object
  without locations.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from kvpool import errors
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire import schema as S

# Frames shorter than this are decoded the general way: the bulk path pays off for batches.
BULK_MIN_BYTES = 16 << 10


class BulkRecord(S.Body, gc=False):
    """:class:`~kvpool.cluster.wire.schema.Record` with its checks as constraints (untracked by the
    garbage collector: a record holds no cycles). ``spec`` and ``location`` stay encoded while
    the batch is decoded: a batch of one kind of object with no locations gets one shared
    spec list and location map (anything else goes the general way)."""

    tier: Annotated[str, msgspec.Meta(max_length=S.MAX_TIER_NAME_BYTES)]
    spec: msgspec.Raw
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    key: bytes | None = None
    header_sum: Annotated[int, msgspec.Meta(ge=0)] | None = None  # msgpack has no int above a u64
    location: msgspec.Raw = msgspec.Raw(b"\x80")
    durable: Annotated[int, msgspec.Meta(ge=1)] | None = None


_EMPTY_MAP = msgspec.Raw(b"\x80")
_SPEC = msgspec.msgpack.Decoder(Annotated[list[int | str], msgspec.Meta(max_length=S.MAX_SPEC_FIELDS)])


class BulkPublish(S.Publish):
    objects: list[BulkRecord]  # type: ignore[assignment]


class BulkRegister(S.Register):
    objects: list[BulkRecord] = []  # type: ignore[assignment]


_ID = int | Annotated[str, msgspec.Meta(max_length=256)]
_VERSION = Annotated[int, msgspec.Meta(ge=P.PROTOCOL_VERSION, le=P.PROTOCOL_VERSION)]
_DECODERS = (
    msgspec.msgpack.Decoder(tuple[_VERSION, _ID, Literal["publish"], BulkPublish]),
    msgspec.msgpack.Decoder(tuple[_VERSION, _ID, Literal["register"], BulkRegister]),
)


# -- columns -------------------------------------------------------------------------------

KEY_BYTES = 16
_SUM_PREFIX = b"\xcf"             # msgpack uint64: a header checksum at or above 2**32
_KEY_PREFIX = b"\xc4\x10"         # msgpack bin8 of 16 bytes


class RawPublish(S.Publish):
    objects: msgspec.Raw  # type: ignore[assignment]


class RawRegister(S.Register):
    objects: msgspec.Raw = msgspec.Raw(b"\x90")  # type: ignore[assignment]


_RAW_DECODERS = (
    msgspec.msgpack.Decoder(tuple[_VERSION, _ID, Literal["publish"], RawPublish]),
    msgspec.msgpack.Decoder(tuple[_VERSION, _ID, Literal["register"], RawRegister]),
)
_RECORD = msgspec.msgpack.Decoder(S.Record)
_ANY = msgspec.msgpack.Decoder()
_encode = msgspec.msgpack.encode


class RecordColumns:
    """A batch of records that differ only in key (16 bytes) and header checksum, as columns.

    ``first``: the first record, decoded and checked the general way (its tier, spec, size,
    location and ``durable`` are every record's); ``keys``: the keys, 16 bytes each, end to
    end; ``lo``/``hi``: each key as two little-endian u64; ``sums``: the header checksums.
    """

    __slots__ = ("first", "keys", "lo", "hi", "sums")

    def __init__(self, first: S.Record, keys: bytes, lo: npt.NDArray[np.uint64], hi: npt.NDArray[np.uint64],
                 sums: npt.NDArray[np.uint64]) -> None:
        self.first, self.keys, self.lo, self.hi, self.sums = first, keys, lo, hi, sums

    def __len__(self) -> int:
        return len(self.lo)

    def key_list(self) -> list[bytes]:
        keys = self.keys
        return [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]

    def durable_pairs(self) -> list[tuple[bytes, int]]:
        """(key, replicas wanted) of each record, when the records are durable copies."""
        wanted = self.first.durable
        return [(key, wanted) for key in self.key_list()] if wanted else []

    def records(self) -> list[S.Record]:
        """The records one by one (the general way, for what the columns do not cover)."""
        f = self.first
        return [S.Record(f.tier, f.spec, f.nbytes, key, header_sum, dict(f.location), f.durable)
                for key, header_sum in zip(self.key_list(), self.sums.tolist())]


def _array_payload(raw: memoryview) -> tuple[int, memoryview] | None:
    """(items, the bytes after the header) of a msgpack array of at least 16 items."""
    if len(raw) < 3:
        return None
    kind = raw[0]
    if kind == 0xdc:
        return int.from_bytes(raw[1:3], "big"), raw[3:]
    if kind == 0xdd and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big"), raw[5:]
    return None


def record_layout(row: bytes) -> tuple[S.Record, int, int] | None:
    """(the record, where its key's bytes start, where its checksum's bytes start) of one
    record whose every byte is accounted for by re-encoding it; None: not of that form."""
    try:
        record = _RECORD.decode(row)
        fields = _ANY.decode(row)
    except (msgspec.ValidationError, msgspec.DecodeError, errors.KVPoolError, ValueError, TypeError):
        return None
    if not isinstance(fields, dict) or type(record.key) is not bytes or len(record.key) != KEY_BYTES \
            or record.header_sum is None or record.location:
        return None
    n = len(fields)
    parts = [bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")]
    at = len(parts[0])
    key_at = sum_at = -1
    for name, value in fields.items():
        name_bytes, value_bytes = _encode(name), _encode(value)
        at += len(name_bytes)
        if name == "key" and value_bytes.startswith(_KEY_PREFIX):
            key_at = at + len(_KEY_PREFIX)
        elif name == "header_sum" and row[at:at + 1] == _SUM_PREFIX:
            # a u64 (msgpack's shortest form for a checksum at or above 2**32; any value in it)
            value_bytes = _SUM_PREFIX + value.to_bytes(8, "big")
            sum_at = at + 1
        at += len(value_bytes)
        parts += (name_bytes, value_bytes)
    if key_at < 0 or sum_at < 0 or b"".join(parts) != row:
        return None
    return record, key_at, sum_at


def record_columns(objects: msgspec.Raw | memoryview) -> RecordColumns | None:
    """The records of a publish or register as :class:`RecordColumns`, or None where they are
    not all of one layout (they are then decoded record by record)."""
    header = _array_payload(memoryview(objects))
    if header is None:
        return None
    n, payload = header
    if n < 16 or len(payload) % n:
        return None
    width = len(payload) // n
    rows = np.frombuffer(payload, np.uint8).reshape(n, width)
    row0 = bytes(payload[:width])
    layout = record_layout(row0)
    if layout is None:
        return None
    first, key_at, sum_at = layout
    first0 = np.frombuffer(row0, np.uint8)
    varying = sorted([(key_at, key_at + KEY_BYTES), (sum_at, sum_at + 8)])
    start = 0
    for lo, hi in [*varying, (width, width)]:
        if lo > start and not (rows[:, start:lo] == first0[start:lo]).all():
            return None
        start = hi
    keys = np.ascontiguousarray(rows[:, key_at:key_at + KEY_BYTES])
    halves = keys.view("<u8")
    sums = np.ascontiguousarray(rows[:, sum_at:sum_at + 8]).view(">u8").ravel().astype(np.uint64)
    return RecordColumns(first, keys.tobytes(), np.ascontiguousarray(halves[:, 0]),
                         np.ascontiguousarray(halves[:, 1]), sums)


_OBJECTS = msgspec.msgpack.encode("objects")
_HEAD_BYTES = 4096  # a publish's fields before its records: ids of at most 256 characters


def _first_decoded(decoders: tuple[msgspec.msgpack.Decoder[Any], ...],
                   frame: bytes | memoryview) -> tuple[int | str, str, Any] | None:
    """``(request_id, op, body)`` from the first decoder that takes ``frame`` (one per op: a
    frame of another op fails at its op name, before the body), or None."""
    for decoder in decoders:
        try:
            _, request_id, op, body = decoder.decode(frame)
            return request_id, op, body
        except (msgspec.ValidationError, msgspec.DecodeError, errors.KVPoolError, ValueError):
            continue
    return None


def unpack_columns(frame: bytes | memoryview) -> P.Request | None:
    # A publish whose records come last (as MasterClient sends one): everything before them is
    # decoded with an empty list in their place, so msgspec does not walk the records only to
    # find where they end. That decodes cleanly only if the records are the body's last field
    # and the body the frame's last item; the rest of the frame must then be their array, and
    # record_columns takes it only if it is.
    head = bytes(frame[:_HEAD_BYTES])
    at = head.find(_OBJECTS)
    if at >= 0:
        start = at + len(_OBJECTS)
        try:
            _, request_id, _, publish = _RAW_DECODERS[0].decode(head[:start] + b"\x90")
        except (msgspec.ValidationError, msgspec.DecodeError, errors.KVPoolError, ValueError):
            pass
        else:
            columns = record_columns(memoryview(frame)[start:])
            if columns is not None:
                publish.objects = columns  # type: ignore[assignment]
                return P.Request(request_id, P.PUBLISH, publish)
    decoded = _first_decoded(_RAW_DECODERS, frame)
    if decoded is None:
        return None
    request_id, op, body = decoded
    columns = record_columns(body.objects)
    if columns is None:
        return None
    body.objects = columns
    return P.Request(request_id, op, body)


# -- records -------------------------------------------------------------------------------


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection meanwhile. While a large batch is decoded and indexed the
    collector would walk the young containers again and again (it cost more than the work
    itself); decoded records and their index entries hold no cycles."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def unpack_bulk(frame: bytes | memoryview) -> P.Request | None:
    """A large publish or register frame parsed as :func:`~kvpool.cluster.wire.protocol.unpack_request`
    would, or None: anything else, or anything it would refuse (decode it the general way)."""
    if len(frame) < BULK_MIN_BYTES:
        return None
    columns = unpack_columns(frame)
    if columns is not None:
        return columns
    with collector_paused():
        decoded = _first_decoded(_DECODERS, frame)
    if decoded is None:
        return None
    request_id, op, body = decoded
    records = body.objects
    if records:
        # One kind of object and no locations, or the general way.
        first = records[0]
        n = len(records)
        if [r.spec for r in records].count(first.spec) != n or \
                [r.location for r in records].count(_EMPTY_MAP) != n:
            return None
        try:
            spec = _SPEC.decode(first.spec)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        location: dict[str, Any] = {}  # shared: nothing changes a record's location
        for record in records:
            record.spec = spec
            record.location = location
    return P.Request(request_id, op, body)
