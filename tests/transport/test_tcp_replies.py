"""Every shape of reply the TCP client reads (one path, ``TcpPullClient._reply``): an OK whose
header lands in place, one whose header has another size than the buffer given for it, one
too long for it, failures, and replies arriving in pieces, each leaving the connection in step
for the next pull. A TcpPullServer in this process; no stand-ins."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpool import errors
from kvpool.objformat import LayerRange
from kvpool.transport import PeerAddress, PullRequest, ServeSource
from kvpool.transport.tcp import TcpPullClient, TcpPullServer

LAYERS = 4
LAYER_NBYTES = 48 << 10
HEADER = b"the header".ljust(16, b".")


def payload(key: bytes, layers: LayerRange) -> bytes:
    one = (key * (LAYER_NBYTES // len(key) + 1))[:LAYER_NBYTES]
    return b"".join(bytes([n]) + one[1:] for n in range(layers.start, layers.stop))


def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
    if key.startswith(b"miss"):
        return None
    layers = LayerRange.resolve(layer_range, LAYERS)
    data = payload(key, layers)
    if key.startswith(b"slow"):  # status and header first, the payload read while it is sent
        def read_into(offset: int, out: memoryview) -> int:
            time.sleep(0.02)
            out[:] = data[offset:offset + out.nbytes]
            return out.nbytes

        return ServeSource(len(data), read_into=read_into, header=HEADER)
    return ServeSource(len(data), buffers=[memoryview(data)], header=HEADER)


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerAddress]:
    with TcpPullServer(provider, staging_nbytes=LAYER_NBYTES) as server:
        yield PeerAddress("127.0.0.1", 0, tcp_port=server.port)


@pytest.fixture
def client() -> Iterator[TcpPullClient]:
    with TcpPullClient() as c:
        yield c


@pytest.mark.parametrize("key", [b"fast", b"slow"])
def test_headers_of_every_size_in_turn_on_one_connection(peer: PeerAddress, client: TcpPullClient,
                                                         key: bytes) -> None:
    whole = LayerRange(0, LAYERS)
    out = bytearray(LAYERS * LAYER_NBYTES)
    for header_out in (bytearray(len(HEADER)), bytearray(), bytearray(100), None):
        out[:] = bytes(len(out))
        seen: list[int] = []
        pull = client.start(peer, key, whole, len(out), want_header=header_out is not None)
        assert client.finish(pull, out, header_out, progress=seen.append) == len(out)
        assert bytes(out) == payload(key, whole)
        if header_out is not None:
            assert bytes(header_out) == HEADER  # resized to the holder's header where it was another size
        assert seen[-1] == len(out) and seen == sorted(seen)
    # a header buffer too small for the holder's: a typed failure, the payload still read past
    with pytest.raises(errors.ProtocolError, match="usable header"):
        client.finish(client.start(peer, key, whole, len(out)), out, bytearray(3))
    assert client.pull_into(peer, key, (1, 3), out) == 2 * LAYER_NBYTES
    assert bytes(out[:2 * LAYER_NBYTES]) == payload(key, LayerRange(1, 3))
    assert client.connects == 1 and client.failures == 1


def test_a_pipelined_batch_of_every_outcome(peer: PeerAddress, client: TcpPullClient) -> None:
    outs = [bytearray(LAYERS * LAYER_NBYTES) for _ in range(7)]
    headers = [bytearray(len(HEADER)), None, bytearray(len(HEADER)), bytearray(len(HEADER)), bytearray(),
               bytearray(len(HEADER)), None]
    asks: list[tuple[bytes, tuple[int, int], memoryview]] = [
        (b"a", (0, 2), memoryview(outs[0])),
        (b"miss", (0, 1), memoryview(outs[1])),
        (b"slow", (1, 4), memoryview(outs[2])),
        (b"c", (0, LAYERS + 1), memoryview(outs[3])),  # bad range
        (b"d", (0, 4), memoryview(outs[4])),
        (b"e", (0, 4), memoryview(outs[5])[:LAYER_NBYTES]),  # out too small
        (b"f", (3, 4), memoryview(outs[6])),
    ]
    results = client.pull_many([PullRequest(peer, key, layers, out, b"", header)
                                for (key, layers, out), header in zip(asks, headers)])
    assert [type(r) for r in results[1::2]] == [errors.RemoteMissError, errors.LayerRangeError,
                                                errors.OutBufferError]
    for i in (0, 2, 4, 6):
        key, (start, stop), _ = asks[i]
        nbytes = (stop - start) * LAYER_NBYTES
        header = headers[i]
        assert results[i] == nbytes and bytes(outs[i][:nbytes]) == payload(key, LayerRange(start, stop))
        assert header is None or bytes(header) == HEADER
    assert client.connects == 1
