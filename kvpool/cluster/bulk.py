"""Large ``publish`` and ``register`` requests decoded in one pass in C, for the master.

:class:`kvpool.cluster.schema.Record` checks each record in a ``__post_init__``: a Python call
per record, which at a million records is most of what a publish costs. Here the same checks
are msgspec constraints, checked while decoding; the only thing left to Python is a
non-empty ``location`` (its values' lengths). A frame this decoder refuses for any reason
goes the general way (:func:`kvpool.cluster.protocol.unpack_request`), which names what is
wrong with it, so errors read the same either way.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec

from kvpool import errors
from kvpool.cluster import protocol as P
from kvpool.cluster import schema as S

# Frames shorter than this are decoded the general way: the bulk path pays off for batches.
BULK_MIN_BYTES = 16 << 10


class BulkRecord(S.Body, gc=False):
    """:class:`~kvpool.cluster.schema.Record` with its checks as constraints (untracked by the
    garbage collector: a record holds no cycles)."""

    tier: Annotated[str, msgspec.Meta(max_length=S.MAX_TIER_NAME_BYTES)]
    spec: Annotated[list[int | str], msgspec.Meta(max_length=S.MAX_SPEC_FIELDS)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    key: bytes | None = None
    header_sum: Annotated[int, msgspec.Meta(ge=0)] | None = None  # msgpack has no int above a u64
    location: Annotated[dict[str, Any], msgspec.Meta(max_length=S.MAX_LOCATION_ENTRIES)] = {}
    durable: Annotated[int, msgspec.Meta(ge=1)] | None = None


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
    """A large publish or register frame parsed as :func:`~kvpool.cluster.protocol.unpack_request`
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
    for record in body.objects:
        location = record.location
        if location and any(isinstance(v, (str, bytes, list, dict)) and len(v) > S.MAX_CONTROL_BYTES
                            for v in location.values()):
            return None
    return P.Request(request_id, op, body)
