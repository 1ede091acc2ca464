"""Large ``publish`` and ``register`` requests decoded in one pass in C, for the master.

:class:`kvpool.cluster.wire.schema.Record` checks each record in a ``__post_init__``: a Python call
per record, which at a million records is most of what a publish costs. Here the same checks
are msgspec constraints, checked while decoding, and a batch of one kind of object without
locations (a node's dram or nvme puts) decodes its spec once. A frame this decoder refuses
for any reason (or a batch of mixed specs, or with locations)
goes the general way (:func:`kvpool.cluster.wire.protocol.unpack_request`), which names what is
wrong with it, so errors read the same either way.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec

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
    with collector_paused():
        for decoder in _DECODERS:  # a frame of another op fails at its op name, before the body
            try:
                _, request_id, op, body = decoder.decode(frame)
                break
            except (msgspec.ValidationError, msgspec.DecodeError, errors.KVPoolError, ValueError):
                continue
        else:
            return None
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
            record.spec = spec  # type: ignore[assignment]
            record.location = location  # type: ignore[assignment]
    return P.Request(request_id, op, body)
