"""The serve core (:mod:`kvpool.transport.answer`): every outcome of a pull request, from real
requests (packed and parsed as on the wire), a real cluster key's token check, a provider over
real bytes in memory and one over a real file; no server, no socket."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import errors
from kvpool.cluster.wire.security import ClusterKey
from kvpool.objformat import LayerRange
from kvpool.transport import frames as T
from kvpool.transport.answer import Answer, decide, provide
from kvpool.transport.source import ServeSource

LAYERS = 8
LAYER_NBYTES = 64 << 10
NODE_ID = "node-a"
KEY = b"held-key"
HEADER = b"packed header"
PAYLOAD = bytes(range(256)) * (LAYERS * LAYER_NBYTES // 256)
CLUSTER_KEY = ClusterKey(os.urandom(32))
WHOLE = LayerRange(0, LAYERS)


def request(key: bytes = KEY, layers: LayerRange = WHOLE, *, capacity: int = LAYERS * LAYER_NBYTES,
            want_header: bool = True, max_chunk: int = 1 << 20, token: bytes | None = None) -> T.Request:
    """A request as a server receives it: packed, then parsed."""
    token = CLUSTER_KEY.mint_token(key, NODE_ID) if token is None else token
    return T.parse_request(T.pack_request(key, token, layers, capacity, want_header=want_header,
                                          max_chunk=max_chunk, request_id=7))


def authorize(key: bytes, token: bytes) -> None:
    CLUSTER_KEY.check_token(token, key, NODE_ID)


def memory_provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
    """A holder of KEY in memory: the layers asked for, in place."""
    if key != KEY:
        return None
    layers = LayerRange.resolve(layer_range, LAYERS)  # LayerRangeError outside the object
    view = memoryview(PAYLOAD)[layers.start * LAYER_NBYTES:layers.stop * LAYER_NBYTES]
    return ServeSource(view.nbytes, buffers=[view], header=HEADER)


@pytest.fixture
def file_provider(tmp_path: Path) -> Iterator[object]:
    """A holder of KEY on disk: read while it is sent."""
    path = tmp_path / "object"
    path.write_bytes(PAYLOAD)
    fd = os.open(path, os.O_RDONLY)

    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        if key != KEY:
            return None
        return ServeSource(len(PAYLOAD), read_into=lambda offset, out: os.preadv(fd, [out], offset), header=HEADER)

    yield provider
    os.close(fd)


def answer_for(req: T.Request, provider: object = memory_provider, max_message: int | None = None) -> Answer:
    return decide(req, provide(req, provider, authorize), max_message)  # type: ignore[arg-type]


def test_ok_from_memory_over_a_stream_is_one_piece_with_the_header() -> None:
    req = request(layers=LayerRange(2, 5))
    answer = answer_for(req)
    assert answer.ok and not answer.is_error and answer.status == T.STATUS_OK
    assert answer.source is not None and bytes(answer.source.buffers[0]) == PAYLOAD[2 * LAYER_NBYTES:5 * LAYER_NBYTES]
    nbytes = 3 * LAYER_NBYTES
    assert (answer.nbytes, answer.chunk, answer.chunks, answer.header) == (nbytes, nbytes, 1, HEADER)
    assert T.parse_status(answer.frame(req.request_id), req.request_id) == (
        T.STATUS_OK, 3 * LAYER_NBYTES, 3 * LAYER_NBYTES, HEADER)


def test_ok_over_messages_is_chunked_within_the_servers_max_message() -> None:
    answer = answer_for(request(max_chunk=100 << 10), max_message=16 << 20)
    assert answer.status == T.STATUS_OK and answer.chunk == 100 << 10
    assert answer.chunks == -(-len(PAYLOAD) // (100 << 10))
    # A client asking for tiny chunks gets MIN_CHUNK; one asking for huge ones the server's max.
    assert answer_for(request(max_chunk=1), max_message=16 << 20).chunk == T.MIN_CHUNK
    assert answer_for(request(max_chunk=1 << 30), max_message=128 << 10).chunk == 128 << 10


def test_ok_without_the_header_when_not_asked_for() -> None:
    answer = answer_for(request(want_header=False))
    assert answer.ok and answer.header == b""


def test_ok_read_from_a_file_may_abort_over_messages_only(file_provider: object) -> None:
    over_messages = answer_for(request(), file_provider, max_message=1 << 20)
    assert over_messages.status == T.STATUS_OK_MAY_ABORT and over_messages.ok
    over_a_stream = answer_for(request(), file_provider)
    assert over_a_stream.status == T.STATUS_OK and over_a_stream.chunks == 1
    source = over_a_stream.source
    assert source is not None and source.read_into is not None
    out = bytearray(LAYER_NBYTES)
    assert source.read_into(LAYER_NBYTES, memoryview(out)) == LAYER_NBYTES
    assert bytes(out) == PAYLOAD[LAYER_NBYTES:2 * LAYER_NBYTES]


def test_miss() -> None:
    req = request(key=b"not-here")
    answer = answer_for(req)
    assert answer.status == T.STATUS_MISS and not answer.ok and not answer.is_error and answer.source is None
    assert answer.text == f"key {b'not-here'.hex()} not held here"
    assert T.parse_status(answer.frame(req.request_id), req.request_id) == (
        T.STATUS_MISS, 0, 0, answer.text.encode())


@pytest.mark.parametrize("token", [b"", b"\0" * 24, "another key's"])
def test_unauthorized(token: bytes | str) -> None:
    minted = CLUSTER_KEY.mint_token(b"another key", NODE_ID) if token == "another key's" else token
    assert isinstance(minted, bytes)
    answer = answer_for(request(token=minted))
    assert answer.status == T.STATUS_UNAUTHORIZED and not answer.is_error and answer.source is None
    assert answer.text.startswith("pull refused")


def test_unauthorized_before_the_provider_runs() -> None:
    calls: list[bytes] = []

    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        calls.append(key)
        return memory_provider(key, layer_range)

    assert answer_for(request(token=b""), provider).status == T.STATUS_UNAUTHORIZED
    assert calls == []
    assert answer_for(request(), provider).ok and calls == [KEY]


def test_bad_range() -> None:
    answer = answer_for(request(layers=LayerRange(6, LAYERS + 1)))
    assert answer.status == T.STATUS_BAD_RANGE and answer.is_error and answer.source is None
    assert answer.text.startswith("LayerRangeError")
    assert T.status_error(answer.status) is errors.LayerRangeError


def test_provider_error() -> None:
    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        raise OSError(5, "Input/output error")

    answer = answer_for(request(), provider)
    assert answer.status == T.STATUS_ERROR and answer.is_error and "Input/output error" in answer.text


def test_wrong_type() -> None:
    def provider(key: bytes, layer_range: LayerRange) -> object:
        return PAYLOAD

    answer = answer_for(request(), provider)
    assert answer.status == T.STATUS_ERROR and answer.is_error and answer.text == "provider returned bytes"


def test_out_too_small() -> None:
    answer = answer_for(request(capacity=len(PAYLOAD) - 1))
    assert answer.status == T.STATUS_OUT_TOO_SMALL and not answer.is_error and answer.source is None
    assert answer.text == f"payload is {len(PAYLOAD)} bytes, out buffer holds {len(PAYLOAD) - 1}"
    assert answer_for(request(capacity=len(PAYLOAD))).ok  # exactly enough is enough


@pytest.mark.parametrize("header", [b"", b"h" * (T.MAX_HEADER_NBYTES + 1)])
def test_no_header_to_send(header: bytes) -> None:
    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        return ServeSource(len(PAYLOAD), buffers=[memoryview(PAYLOAD)], header=header)

    answer = answer_for(request(), provider)
    assert answer.status == T.STATUS_ERROR and answer.text == f"no header to send ({len(header)} bytes)"
    assert answer_for(request(want_header=False), provider).ok  # not asked for: not needed


def test_too_many_messages() -> None:
    nbytes = (T.MAX_CHUNKS + 1) * T.MIN_CHUNK_FLOOR

    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        return ServeSource(nbytes, read_into=lambda offset, out: out.nbytes, header=HEADER)

    req = request(capacity=nbytes, max_chunk=1)
    answer = decide(req, provide(req, provider, authorize), T.MIN_CHUNK_FLOOR)
    assert answer.status == T.STATUS_ERROR and answer.text == "payload needs too many messages"
    assert decide(req, provide(req, provider, authorize)).ok  # one piece over a stream


def test_provide_returns_what_the_provider_raised() -> None:
    exc = errors.TransferError("busy")

    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        raise exc

    assert provide(request(), provider, authorize) is exc
    assert provide(request(token=b""), provider, None) is exc  # no authorize: not checked
