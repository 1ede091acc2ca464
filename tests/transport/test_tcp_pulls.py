"""TcpPullServer / TcpPullClient: pulls over plain TCP on 127.0.0.1.

The holder is the server process of ``test_transfer.py`` (the same provider, served over
UCX and TCP); tests of connection limits and idle connections run a server in this process.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import errors
from kvpool.cluster.node.reader import ReplicaReader
from kvpool.cluster.wire.security import ClusterKey
from kvpool.objformat import LayerRange
from kvpool.transport import PeerAddress, PullRequest, ServeSource, local_host_id
from kvpool.transport.frames import OK_STATUSES, STATUS, pack_request, parse_status_head
from kvpool.transport.puller import SAME_HOST_TCP_PULL_MAX
from kvpool.transport.tcp import TcpPathUnusable, TcpPullClient, TcpPullServer
from kvpool.transport.tcp.stream import PROOF_NBYTES, PULL_HELLO, recv_exactly
from tests.conftest import wait_for
from tests.transport.test_transfer import LAYER_NBYTES, LAYERS, ServerProcess, expected, header_of


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("tcp-holder"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client() -> Iterator[TcpPullClient]:
    with TcpPullClient() as c:
        yield c


def test_pull_lands_exact_bytes_and_header(holder: ServerProcess, client: TcpPullClient) -> None:
    out = np.zeros(LAYERS * LAYER_NBYTES, np.uint8)
    header = bytearray(4096)
    got = client.pull_into(holder.peer, b"k1", (2, 5), out, header_out=header, timeout_s=10)
    assert got == 3 * LAYER_NBYTES
    assert np.array_equal(out[:got], expected(b"k1", 2, 5))
    assert bytes(header) == header_of(b"k1")
    split = np.zeros(LAYERS * LAYER_NBYTES, np.uint8)  # a payload from two buffers
    assert client.pull_into(holder.peer, b"split:x", (0, LAYERS), split) == split.nbytes
    assert np.array_equal(split, expected(b"split:x", 0, LAYERS))


def test_progress_is_told_the_bytes_received_after_the_header_landed(holder: ServerProcess,
                                                                    client: TcpPullClient) -> None:
    """``PullRequest.progress`` (what lets a reader verify layers while later ones arrive)."""
    out = np.zeros(LAYERS * LAYER_NBYTES, np.uint8)
    header = bytearray(len(header_of(b"k5")))
    seen: list[tuple[int, bytes]] = []
    (got,) = client.pull_many([PullRequest(holder.peer, b"k5", (0, LAYERS), out, header_out=header,
                                           progress=lambda n: seen.append((n, bytes(header))))])
    assert got == out.nbytes and np.array_equal(out, expected(b"k5", 0, LAYERS))
    assert seen and seen[-1][0] == out.nbytes
    assert [n for n, _ in seen] == sorted(n for n, _ in seen)
    assert all(h == header_of(b"k5") for _, h in seen)  # the header was there from the first call


def test_failures_are_typed_and_keep_the_connection(holder: ServerProcess, client: TcpPullClient) -> None:
    def request(key: bytes, layers: tuple[int, int] = (0, 1), nbytes: int = LAYER_NBYTES) -> PullRequest:
        return PullRequest(holder.peer, key, layers, bytearray(nbytes))

    ok = request(b"k2", (1, 3), 2 * LAYER_NBYTES)
    results = client.pull_many([
        request(b"miss:1"), ok, request(b"k3", (0, LAYERS + 1), 9 * LAYER_NBYTES), request(b"k3", (0, 2)),
        request(b"boom"), request(b"secret:x"), request(b"", (0, 1)), request(b"k4"),
    ], timeout_s=10)
    assert isinstance(results[0], errors.RemoteMissError)
    assert results[1] == 2 * LAYER_NBYTES and bytes(ok.out) == expected(b"k2", 1, 3).tobytes()
    assert isinstance(results[2], errors.LayerRangeError)
    assert isinstance(results[3], errors.OutBufferError)
    assert isinstance(results[4], errors.TransferError) and "disk on fire" in str(results[4])
    assert isinstance(results[5], errors.AuthenticationError)
    assert isinstance(results[6], errors.InvalidKeyError)  # refused before anything was sent
    assert results[7] == LAYER_NBYTES
    # all on one connection, which stayed in step with its replies
    assert client.connects == 1
    out = bytearray(LAYER_NBYTES)
    assert client.pull_into(holder.peer, b"secret:x", (0, 1), out, token=b"open-sesame") == LAYER_NBYTES
    assert bytes(out) == expected(b"secret:x", 0, 1).tobytes()
    assert client.connects == 1


def test_read_while_sent_and_a_read_failing_midway(holder: ServerProcess, client: TcpPullClient) -> None:
    out = np.zeros(LAYERS * LAYER_NBYTES, np.uint8)
    assert client.pull_into(holder.peer, b"file:a", (0, LAYERS), out) == out.nbytes
    assert np.array_equal(out, expected(b"file:a", 0, LAYERS))
    # the OK went out, then the second read fails: the pull fails, the payload is not taken
    with pytest.raises(errors.TransferError, match="closed"):
        client.pull_into(holder.peer, b"file:bad", (0, LAYERS), out)
    out[:] = 0
    assert client.pull_into(holder.peer, b"file:b", (0, 2), out) == 2 * LAYER_NBYTES
    assert np.array_equal(out[:2 * LAYER_NBYTES], expected(b"file:b", 0, 2))


def test_many_pulls_to_one_holder_are_pipelined_without_blocking(holder: ServerProcess,
                                                                 client: TcpPullClient) -> None:
    """More request bytes than a window and replies far larger than socket buffers."""
    keys = [f"many-{i}-{'x' * 900}".encode() for i in range(120)]
    outs = [np.zeros(2 * LAYER_NBYTES, np.uint8) for _ in keys]
    results = client.pull_many([PullRequest(holder.peer, key, (3, 5), out) for key, out in zip(keys, outs)],
                               timeout_s=30)
    assert results == [2 * LAYER_NBYTES] * len(keys)
    for key, out in zip(keys, outs):
        assert np.array_equal(out, expected(key, 3, 5))


def test_concurrent_callers_each_get_their_own_bytes(holder: ServerProcess, client: TcpPullClient) -> None:
    wrong: list[str] = []

    def worker(n: int) -> None:
        out = np.zeros(2 * LAYER_NBYTES, np.uint8)
        for i in range(25):
            key = f"c{n}-{i}".encode()
            start = i % (LAYERS - 1)
            client.pull_into(holder.peer, key, (start, start + 2), out, timeout_s=20)
            if not np.array_equal(out, expected(key, start, start + 2)):
                wrong.append(key.decode())

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not wrong
    assert client.connects <= 4


def test_a_killed_holder_fails_the_pull_at_once(tmp_path: Path) -> None:
    proc = ServerProcess(tmp_path)
    try:
        with TcpPullClient() as client:
            out = np.zeros(LAYERS * LAYER_NBYTES, np.uint8)
            result: list[BaseException | int] = []
            t = threading.Thread(target=lambda: result.append(
                client.pull_many([PullRequest(proc.peer, b"stall-mid", (0, LAYERS), out)], timeout_s=30)[0]))
            t.start()
            proc.wait_for("stalled")
            started = time.monotonic()
            proc.kill()
            t.join(30)
            assert isinstance(result[0], errors.TransferError) and not isinstance(result[0], errors.KVTimeoutError)
            assert time.monotonic() - started < 10  # not the 30 s deadline
            with pytest.raises(errors.TransferError, match="refused"):  # nothing listens now
                client.pull_into(proc.peer, b"k", (0, 1), out, timeout_s=5)
    finally:
        proc.stop()


def test_a_frozen_holder_costs_the_deadline_or_until_it_is_known_gone(holder: ServerProcess,
                                                                     client: TcpPullClient) -> None:
    out = bytearray(LAYER_NBYTES)
    with pytest.raises(errors.KVTimeoutError):
        client.pull_into(holder.peer, b"slow", (0, 1), out, timeout_s=0.3)
    gone = threading.Event()
    threading.Timer(0.2, gone.set).start()
    started = time.monotonic()
    with pytest.raises(errors.TransferError, match="gone"):
        client.pull_into(holder.peer, b"slow", (0, 1), out, timeout_s=30, alive=lambda: not gone.is_set())
    assert time.monotonic() - started < 10
    assert client.pull_into(holder.peer, b"k5", (0, 1), out) == LAYER_NBYTES  # a new connection
    assert bytes(out) == expected(b"k5", 0, 1).tobytes()


# -- a server in this process ------------------------------------------------------------------


def _memory_provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
    data = expected(key, layer_range.start, layer_range.stop)
    return ServeSource(data.nbytes, buffers=[memoryview(data)], header=b"h" * 16)


@pytest.mark.parametrize("sent_first", [False, True])
def test_an_idle_connection_the_holder_closed_is_replaced_once(sent_first: bool) -> None:
    """``sent_first``: start() sent the request on it; finish() sends it again on the new one."""
    with TcpPullServer(_memory_provider, idle_timeout_s=0.2) as server, TcpPullClient() as client:
        peer = PeerAddress("127.0.0.1", 0, tcp_port=server.port)
        out = bytearray(LAYER_NBYTES)
        assert client.pull_into(peer, b"a", (0, 1), out) == LAYER_NBYTES
        deadline = time.monotonic() + 10
        while server.stats()["connections"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the server drops the idle connection
        if sent_first:
            got = client.finish(client.start(peer, b"b", LayerRange(0, 1), LAYER_NBYTES), out)
        else:
            got = client.pull_into(peer, b"b", (0, 1), out)
        assert got == LAYER_NBYTES
        assert bytes(out) == expected(b"b", 0, 1).tobytes()
        assert client.connects == 2 and client.failures == 0


def test_pooled_connections_whose_holder_hung_up_or_left_are_swept() -> None:
    """A pooled connection outlives neither its holder's socket nor its node (issue 44): sweep()
    closes the idle ones their holder closed (each sat in CLOSE-WAIT, a descriptor, until
    reused, and a departed holder's never is) and, told the master's alive nodes, those to the
    others."""
    from kvpool.cluster.node.server import NodeAddress, alive_peers_of
    from kvpool.transport.puller import Pulls

    with TcpPullServer(_memory_provider, idle_timeout_s=0.3) as hanging_up, \
            TcpPullServer(_memory_provider) as leaving, TcpPullServer(_memory_provider) as staying:
        pulls = Pulls(local_host_id(), tcp_pull_max=1 << 20)
        try:
            tcp = pulls.tcp
            assert tcp is not None
            peers = [PeerAddress("127.0.0.1", 0, tcp_port=s.port) for s in (hanging_up, leaving, staying)]
            out = bytearray(LAYER_NBYTES)
            for peer in peers:
                pulls.pull(peer, b"a", LayerRange(0, 1), memoryview(out), timeout_s=10)
            assert tcp.idle_connections() == 3 and pulls.sweep() == 0
            deadline = time.monotonic() + 10
            while hanging_up.stats()["connections"] and time.monotonic() < deadline:
                time.sleep(0.05)  # the holder drops its idle connection
            assert pulls.sweep() == 1 and tcp.idle_connections() == 2  # the hung-up one
            stats = {"nodes": {
                "staying": {"alive": True, "address": NodeAddress(peers[2], "tcp://127.0.0.1:1").encode()},
                "leaving": {"alive": False, "address": NodeAddress(peers[1], "tcp://127.0.0.1:2").encode()},
                "garbled": {"alive": True, "address": "{not json"},
            }}
            alive = alive_peers_of(stats)
            assert alive == [peers[2]] and alive_peers_of({"nodes": "?"}) is None
            assert pulls.sweep(alive) == 1 and tcp.idle_connections() == 1  # the departed node's
            assert tcp.stats()["swept"] == 2 and tcp.connects == 3
            pulls.pull(peers[2], b"b", LayerRange(0, 1), memoryview(out), timeout_s=10)  # the kept one, reused
            assert bytes(out) == expected(b"b", 0, 1).tobytes() and tcp.connects == 3
            pulls.pull(peers[0], b"c", LayerRange(0, 1), memoryview(out), timeout_s=10)  # a new one
            assert bytes(out) == expected(b"c", 0, 1).tobytes() and tcp.connects == 4 and tcp.failures == 0
        finally:
            pulls.close()


def test_a_pull_sent_first_lands_in_the_buffer_bound_after_it_went_out(holder: ServerProcess,
                                                                      client: TcpPullClient) -> None:
    """start() sends on an idle connection; finish() reads into a buffer prepared meanwhile."""
    client.pull_into(holder.peer, b"k1", (0, 1), bytearray(LAYER_NBYTES))  # an idle connection
    pull = client.start(holder.peer, b"k7", LayerRange(1, 4), 3 * LAYER_NBYTES)
    assert pull.sent_on is not None  # out on the wire before any buffer exists
    out, header = np.zeros(3 * LAYER_NBYTES, np.uint8), bytearray(len(header_of(b"k7")))
    seen: list[int] = []
    assert client.finish(pull, out, header, progress=seen.append) == out.nbytes
    assert np.array_equal(out, expected(b"k7", 1, 4)) and bytes(header) == header_of(b"k7")
    assert seen and seen[-1] == out.nbytes
    # a miss and a bad range are raised by finish, and the connection stays in step
    with pytest.raises(errors.RemoteMissError):
        client.finish(client.start(holder.peer, b"miss:2", LayerRange(0, 1), LAYER_NBYTES), bytearray(LAYER_NBYTES))
    with pytest.raises(errors.LayerRangeError):
        client.finish(client.start(holder.peer, b"k7", LayerRange(0, LAYERS + 1), (LAYERS + 1) * LAYER_NBYTES),
                      bytearray((LAYERS + 1) * LAYER_NBYTES))
    out2 = bytearray(LAYER_NBYTES)
    assert client.finish(client.start(holder.peer, b"k8", LayerRange(2, 3), LAYER_NBYTES), out2) == LAYER_NBYTES
    assert bytes(out2) == expected(b"k8", 2, 3).tobytes()
    assert client.connects == 1 and client.failures == 2


def _slow_provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
    """The payload is read while it is sent, after a pause: the status and header arrive first."""
    if key.startswith(b"miss:"):
        return None
    data = expected(key, layer_range.start, layer_range.stop)

    def read_into(offset: int, out: memoryview) -> int:
        time.sleep(0.05)
        out[:] = memoryview(data)[offset:offset + len(out)]
        return len(out)

    return ServeSource(data.nbytes, read_into=read_into, header=key.ljust(16, b"."))


class _Ledger:
    """A provider that logs what the server asks and releases: misses (``miss:*``), a provider
    that raises (``boom``), payloads read while sent (``read:*``), the rest from memory."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()

    def log(self, what: str, key: bytes) -> None:
        with self.lock:
            self.events.append((what, key))

    def __call__(self, key: bytes, layer_range: LayerRange) -> ServeSource | None:
        self.log("provide", key)
        if key.startswith(b"miss:"):
            return None
        if key == b"boom":
            raise RuntimeError("disk on fire")
        data = expected(key, layer_range.start, layer_range.stop)
        release = lambda: self.log("release", key)  # noqa: E731
        if key.startswith(b"read:"):
            def read_into(offset: int, out: memoryview) -> int:
                out[:] = memoryview(data)[offset:offset + len(out)]
                return len(out)
            return ServeSource(data.nbytes, read_into=read_into, release=release)
        return ServeSource(data.nbytes, buffers=[memoryview(data)], release=release)

    def released(self) -> list[bytes]:
        with self.lock:
            return [key for what, key in self.events if what == "release"]


def _opened(port: int) -> socket.socket:
    """A raw connection to a TCP pull server, its opening done (as a client without the key)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        nonce, hello = PULL_HELLO.opening()
        sock.sendall(hello)
        PULL_HELLO.check_answer(_received(sock, PULL_HELLO.ANSWER.size), nonce, None)
        sock.sendall(bytes(PROOF_NBYTES))
    except BaseException:
        sock.close()
        raise
    return sock


def _received(sock: socket.socket, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    recv_exactly(sock, memoryview(buf))
    return buf


def _requests(keys: list[bytes]) -> bytes:
    """Request frames for layer 0 of each key, sent at once (one segment: the server's first
    receive takes them all)."""
    return b"".join(pack_request(key, b"", LayerRange(0, 1), LAYER_NBYTES, want_header=False,
                                 max_chunk=LAYER_NBYTES, request_id=7) for key in keys)


def test_pipelined_requests_are_answered_together_in_order_each_source_released_once() -> None:
    """Small requests that arrive together are answered with one send (every object is provided
    before the first is released); a miss, a provider that raises and a payload read while sent
    keep their place in the stream, and every source is released exactly once."""
    ledger = _Ledger()
    keys = [b"a", b"miss:b", b"c", b"boom", b"read:d", b"e"]
    with TcpPullServer(ledger) as server, _opened(server.port) as sock:
        sock.sendall(_requests(keys))
        for key in keys:
            head = _received(sock, STATUS.size)
            parsed = parse_status_head(head, 7)
            assert parsed is not None
            status, body_len, nbytes, _ = parsed
            body = _received(sock, body_len)
            if key.startswith(b"miss:") or key == b"boom":
                assert status not in OK_STATUSES, key
                assert key != b"boom" or b"disk on fire" in body
                continue
            assert status in OK_STATUSES and nbytes == LAYER_NBYTES, key
            assert bytes(_received(sock, nbytes)) == expected(key, 0, 1).tobytes(), key
        wait_for(lambda: len(ledger.released()) >= 4, 10, "every served source released")
        assert sorted(ledger.released()) == [b"a", b"c", b"e", b"read:d"]
        # the first two answers went out together: b"c" was provided before b"a" was released
        events = ledger.events
        assert events.index(("provide", b"c")) < events.index(("release", b"a"))
        stats = server.stats()
        assert stats["requests_served"] == 4 and stats["misses"] == 1 and stats["errors"] == 1
        assert stats["bytes_sent"] == 4 * LAYER_NBYTES


def test_a_reader_gone_mid_batch_leaves_nothing_pinned() -> None:
    """The reader closes with answers unsent: the failed send releases every source it held."""
    ledger = _Ledger()
    keys = [f"k{i}".encode() for i in range(10)]
    with TcpPullServer(ledger) as server:
        with _opened(server.port) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the answers cannot all fit
            sock.sendall(_requests(keys * 40))
            _received(sock, STATUS.size)  # the first answer is on its way
        wait_for(lambda: not server.stats()["connections"], 10, "the server to drop the connection")
        with ledger.lock:
            provided = sum(what == "provide" for what, _ in ledger.events)
        assert 0 < provided < len(keys) * 40
        assert len(ledger.released()) == provided


def test_a_reply_that_does_not_come_whole_in_one_receive_is_read_the_general_way() -> None:
    """finish()'s first receive lands the usual small pull whole (status, header, payload, each in
    place); a reply arriving in pieces, a miss, and a header of another size than the buffer given
    for it are read on from there, the connection staying in step for the next pull."""
    with TcpPullServer(_slow_provider) as server, TcpPullClient() as client:
        peer = PeerAddress("127.0.0.1", 0, tcp_port=server.port)
        out = memoryview(bytearray(2 * LAYER_NBYTES))
        for key in (b"a", b"bb", b"ccc"):  # the first connects; the others are sent on the idle connection
            header = bytearray(16)
            pull = client.start(peer, key, LayerRange(1, 3), out.nbytes)
            assert client.finish(pull, out, header) == out.nbytes
            assert bytes(out) == expected(key, 1, 3).tobytes() and bytes(header) == key.ljust(16, b".")
        with pytest.raises(errors.RemoteMissError):
            client.finish(client.start(peer, b"miss:1", LayerRange(0, 1), LAYER_NBYTES), out[:LAYER_NBYTES],
                          bytearray(16))
        long_header = bytearray(64)  # room for more than the holder's 16 bytes
        assert client.finish(client.start(peer, b"dd", LayerRange(0, 2), out.nbytes), out, long_header) == out.nbytes
        assert bytes(out) == expected(b"dd", 0, 2).tobytes() and bytes(long_header[:16]) == b"dd".ljust(16, b".")
        assert client.connects == 1 and client.pulls == 4 and client.failures == 1


def test_a_holder_that_stalls_mid_payload_costs_the_deadline_or_until_it_is_known_gone() -> None:
    """Once a reply's status and header are in, its payload is received a piece at a time, each
    with one receive that waits for the whole piece: a holder that stops sending halfway through
    still ends the pull at its deadline, or as soon as ``alive`` says it is gone, and the bytes
    that did land are never taken for a payload. Every piece is checked on arrival (``progress``)."""
    stall = threading.Event()

    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        data = expected(key, layer_range.start, layer_range.stop)

        def read_into(offset: int, out: memoryview) -> int:
            if key.startswith(b"stall") and offset >= data.nbytes // 2:
                stall.wait(20)  # (set when the test ends)
            out[:] = memoryview(data)[offset:offset + len(out)]
            return len(out)

        return ServeSource(data.nbytes, read_into=read_into, header=key.ljust(16, b"."))

    nbytes = LAYERS * LAYER_NBYTES
    with TcpPullServer(provider, staging_nbytes=nbytes // 8) as server, TcpPullClient() as client:
        try:
            peer = PeerAddress("127.0.0.1", 0, tcp_port=server.port)
            out = np.zeros(nbytes, np.uint8)
            seen: list[int] = []
            (got,) = client.pull_many([PullRequest(peer, b"whole", LayerRange(0, LAYERS), out, header_out=bytearray(16),
                                                   progress=seen.append)])
            assert got == nbytes and np.array_equal(out, expected(b"whole", 0, LAYERS))
            assert seen[-1] == nbytes and seen == sorted(seen)
            out[:] = 0
            started = time.monotonic()
            with pytest.raises(errors.KVTimeoutError):
                client.pull_into(peer, b"stall-a", LayerRange(0, LAYERS), out, timeout_s=0.5)
            assert time.monotonic() - started < 5
            gone = threading.Event()
            threading.Timer(0.3, gone.set).start()
            started = time.monotonic()
            with pytest.raises(errors.TransferError, match="gone"):
                client.pull_into(peer, b"stall-b", LayerRange(0, LAYERS), out, timeout_s=30,
                                 alive=lambda: not gone.is_set())
            assert time.monotonic() - started < 5
            assert np.any(out[:nbytes // 2]) and not np.any(out[-LAYER_NBYTES:])  # half landed, not taken
            assert client.failures == 2 and client.pulls == 1
        finally:
            stall.set()


def test_a_pull_sent_first_whose_buffer_does_not_fit_is_dropped_unread(holder: ServerProcess,
                                                                        client: TcpPullClient) -> None:
    """A buffer smaller than asked for, read-only or strided never takes the reply: finish
    raises OutBufferError and closes that connection (its reply is never read into anything);
    cancel() does the same; the next pull gets exact bytes on a new connection."""
    wrong = [bytearray(LAYER_NBYTES - 1), bytes(LAYER_NBYTES), np.zeros(2 * LAYER_NBYTES, np.uint8)[::2],
             memoryview(bytes(LAYER_NBYTES)), memoryview(np.zeros(2 * LAYER_NBYTES, np.uint8))[::2]]
    for n, out in enumerate(wrong):
        for header in (None, bytearray(len(header_of(b"k0")))):  # (with a header: as the reader asks)
            client.pull_into(holder.peer, b"k1", (0, 1), bytearray(LAYER_NBYTES))  # an idle connection
            pull = client.start(holder.peer, f"k{n}".encode(), LayerRange(0, 1), LAYER_NBYTES)
            assert pull.sent_on is not None
            with pytest.raises(errors.OutBufferError):
                client.finish(pull, out, header)
    client.cancel(client.start(holder.peer, b"k4", LayerRange(0, 1), LAYER_NBYTES))
    right = bytearray(LAYER_NBYTES)
    assert client.pull_into(holder.peer, b"k5", (3, 4), right) == LAYER_NBYTES
    assert bytes(right) == expected(b"k5", 3, 4).tobytes()
    for bad in (0, -1):
        with pytest.raises(errors.OutBufferError):
            client.start(holder.peer, b"k5", LayerRange(0, 1), bad)
    with pytest.raises(errors.InvalidKeyError):
        client.start(holder.peer, b"", LayerRange(0, 1), LAYER_NBYTES)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True


def test_garbage_and_too_many_connections_are_dropped_without_harm() -> None:
    with TcpPullServer(_memory_provider, max_connections=2) as server, TcpPullClient() as client:
        peer = PeerAddress("127.0.0.1", 0, tcp_port=server.port)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as bad:
            bad.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 200)
            assert _closed_by_peer(bad)  # nothing answered
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as idle:
            out = bytearray(LAYER_NBYTES)
            assert client.pull_into(peer, b"a", (0, 1), out) == LAYER_NBYTES  # the second connection
            with TcpPullClient() as second:  # at the limit: the idle one (no opening yet) is cut for it
                assert second.pull_into(peer, b"b", (0, 1), out) == LAYER_NBYTES
                assert _closed_by_peer(idle)
                assert server.stats()["connections_cut"] >= 1
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as third:
                    assert _closed_by_peer(third)  # every slot opened and in use: closed at once
                assert server.stats()["connections_refused"] >= 1
            assert client.pull_into(peer, b"b", (0, 1), out) == LAYER_NBYTES
            assert bytes(out) == expected(b"b", 0, 1).tobytes()
            del idle
        assert server.stats()["errors"] >= 1


def test_a_server_that_cannot_prove_the_cluster_key_gets_no_pull() -> None:
    """Whatever took over a dead holder's port (here a full TCP pull server under another
    cluster key, with the key asked for) sends its proof before any reply; the client checks
    it first and takes nothing from a server that fails it."""
    ours, theirs = ClusterKey(b"o" * 32), ClusterKey(b"t" * 32)
    with TcpPullServer(_memory_provider, prove=theirs.holder_proof) as impostor, \
            TcpPullServer(_memory_provider, prove=ours.holder_proof) as holder, \
            TcpPullClient(check_proof=ours.check_holder_proof) as client:
        out = bytearray(LAYER_NBYTES)
        with pytest.raises(errors.AuthenticationError, match="cluster key"):
            client.pull_into(PeerAddress("127.0.0.1", 0, tcp_port=impostor.port), b"a", (0, 1), out)
        assert out == bytearray(LAYER_NBYTES) and impostor.stats()["connections"] <= 1
        unproven = TcpPullServer(_memory_provider).start()  # no key: it answers zeros
        try:
            with pytest.raises(errors.AuthenticationError):
                client.pull_into(PeerAddress("127.0.0.1", 0, tcp_port=unproven.port), b"a", (0, 1), out)
        finally:
            unproven.close()
        assert client.pull_into(PeerAddress("127.0.0.1", 0, tcp_port=holder.port), b"a", (0, 1), out) == len(out)
        assert bytes(out) == expected(b"a", 0, 1).tobytes()
        assert ours.check_holder_proof(b"n" * 16, ours.holder_proof(b"n" * 16))
        assert not ours.check_holder_proof(b"m" * 16, ours.holder_proof(b"n" * 16))


def test_a_reader_that_proves_the_cluster_key_pulls_without_tokens_others_need_one() -> None:
    """The holder answers a reader's proof of the cluster key with trust for that connection
    (such a reader could mint any token); a reader without the key, or with another key, is
    asked for a token on every pull."""
    ours, theirs = ClusterKey(b"o" * 32), ClusterKey(b"t" * 32)
    checked: list[bytes] = []

    def authorize(key: bytes, token: bytes) -> None:
        checked.append(key)
        ours.check_token(token, key, "holder")

    with TcpPullServer(_memory_provider, authorize=authorize, prove=ours.holder_proof,
                       trust=ours.check_reader_proof) as holder:
        peer = PeerAddress("127.0.0.1", 0, tcp_port=holder.port)
        out = bytearray(LAYER_NBYTES)
        with TcpPullClient(check_proof=ours.check_holder_proof, prove=ours.reader_proof) as member:
            assert member.pull_into(peer, b"a", (0, 1), out) == LAYER_NBYTES
            assert bytes(out) == expected(b"a", 0, 1).tobytes()
        assert checked == [] and holder.stats()["connections_trusted"] == 1
        for prove in (None, theirs.reader_proof):
            with TcpPullClient(check_proof=ours.check_holder_proof, prove=prove) as stranger:
                with pytest.raises(errors.AuthenticationError):
                    stranger.pull_into(peer, b"b", (0, 1), out)
                assert stranger.pull_into(peer, b"b", (0, 1), out, token=ours.mint_token(b"b", "holder")) == len(out)
                assert bytes(out) == expected(b"b", 0, 1).tobytes()
        assert checked == [b"b"] * 4 and holder.stats()["connections_trusted"] == 1
        # one side's proof is never the other's
        assert not ours.check_reader_proof(b"n" * 16, ours.holder_proof(b"n" * 16))
        assert not ClusterKey(None).check_reader_proof(b"n" * 16, ClusterKey(None).reader_proof(b"n" * 16))


def test_a_holder_that_drops_every_connection_after_its_hello_is_tried_once() -> None:
    """A new connection closed before its first reply is not retried (only an idle one is):
    a holder that answers the hello and then hangs up fails the pull at once."""
    accepted: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(5.0)

        def hang_up_after_hello() -> None:
            while len(accepted) < 3:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                accepted.append(1)
                with conn:
                    conn.recv(22)  # the hello
                    conn.sendall(b"KVTH" + (2).to_bytes(2, "little") + bytes(32))  # a proof and a nonce

        thread = threading.Thread(target=hang_up_after_hello, daemon=True)
        thread.start()
        with TcpPullClient() as client:
            with pytest.raises(TcpPathUnusable):
                client.pull_into(PeerAddress("127.0.0.1", 0, tcp_port=listener.getsockname()[1]), b"a", (0, 1),
                                 bytearray(LAYER_NBYTES), timeout_s=5.0)
        assert len(accepted) == 1
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        thread.join(timeout=10)


def test_a_port_that_refuses_or_turns_connections_away_is_not_reachable_for_a_while() -> None:
    with TcpPullServer(_memory_provider, max_connections=0) as full, TcpPullClient() as client:
        nobody = PeerAddress("127.0.0.1", 0, tcp_port=full.port)
        with pytest.raises(TcpPathUnusable):  # over its limit: the holder may serve over UCX
            client.pull_into(nobody, b"a", (0, 1), bytearray(LAYER_NBYTES))
        assert not client.reachable(nobody)
        full.close()
        with socket.socket() as s:  # a port nothing listens on: the holder is gone
            s.bind(("127.0.0.1", 0))
            gone = PeerAddress("127.0.0.1", 0, tcp_port=s.getsockname()[1])
        with pytest.raises(errors.TransferError) as caught:
            client.pull_into(gone, b"a", (0, 1), bytearray(LAYER_NBYTES))
        assert not isinstance(caught.value, TcpPathUnusable)
        assert not client.reachable(gone)
        assert not client.reachable(PeerAddress("127.0.0.1", 1))  # no TCP port at all
    with TcpPullClient(retry_after_s=0.0) as eager:
        with pytest.raises(errors.TransferError):
            eager.pull_into(gone, b"a", (0, 1), bytearray(LAYER_NBYTES))
        assert eager.reachable(gone)  # tried again at once


def test_failed_connects_in_a_row_back_off_doubling_and_one_that_opens_ends_the_row() -> None:
    """One dropped SYN (a flood filled the accept queue) costs ``first_retry_s`` of TCP; a port
    that keeps turning connections away is tried less often, up to ``retry_after_s``."""
    with (TcpPullServer(_memory_provider, max_connections=0) as holder,
          TcpPullClient(first_retry_s=1.0, retry_after_s=3.0) as client):
        peer = PeerAddress("127.0.0.1", 0, tcp_port=holder.port)
        waits = []
        for _ in range(4):
            with pytest.raises(TcpPathUnusable):
                client.pull_into(peer, b"a", (0, 1), bytearray(LAYER_NBYTES))
            waits.append(client.retry_in_s(peer))
        assert 0 < waits[0] <= 1.0 < waits[1] <= 2.0 < waits[2] <= 3.0 and 2.0 < waits[3] <= 3.0, waits
        holder.max_connections = 8
        assert client.pull_into(peer, b"a", (0, 1), bytearray(LAYER_NBYTES)) == LAYER_NBYTES
        assert client.reachable(peer) and client.retry_in_s(peer) == 0.0
        holder.max_connections = 0
        client.sweep(keep=lambda where: False)  # no idle connection left: the next pull opens one
        with pytest.raises(TcpPathUnusable):
            client.pull_into(peer, b"a", (0, 1), bytearray(LAYER_NBYTES))
        assert 0 < client.retry_in_s(peer) <= 1.0  # a new row
    with (TcpPullServer(_memory_provider, max_connections=0) as holder,
          TcpPullClient(first_retry_s=0.2, retry_after_s=0.4) as client):
        peer = PeerAddress("127.0.0.1", 0, tcp_port=holder.port)
        for _ in range(2):
            with pytest.raises(TcpPathUnusable):
                client.pull_into(peer, b"a", (0, 1), bytearray(LAYER_NBYTES))
        assert client.retry_in_s(peer) > 0.2
        time.sleep(client.retry_in_s(peer) + 0.45)  # its mark ran out, and retry_after_s more
        client.sweep()  # not tried for that long: a holder that left; its row is forgotten
        with pytest.raises(TcpPathUnusable):
            client.pull_into(peer, b"a", (0, 1), bytearray(LAYER_NBYTES))
        assert 0 < client.retry_in_s(peer) <= 0.2


def test_closing_the_server_fails_a_waiting_pull() -> None:
    release = threading.Event()

    def stalling(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        release.wait(10)
        return None

    server = TcpPullServer(stalling).start()
    try:
        with TcpPullClient() as client:
            peer = PeerAddress("127.0.0.1", 0, tcp_port=server.port)
            threading.Timer(0.2, server.close).start()
            with pytest.raises(errors.TransferError):
                client.pull_into(peer, b"a", (0, 1), bytearray(16), timeout_s=20)
    finally:
        release.set()
        server.close()


def test_a_peer_without_a_tcp_port_is_refused_up_front(client: TcpPullClient) -> None:
    (outcome,) = client.pull_many([PullRequest(PeerAddress("127.0.0.1", 1), b"a", (0, 1), bytearray(8))])
    assert isinstance(outcome, errors.TransferError)


def test_which_pulls_a_reader_sends_over_tcp() -> None:
    """Up to tcp_pull_max; from a same-host holder UCX reaches by shared memory, up to 1 MiB."""
    worker = bytes([1]) + b"w" * 40
    here = PeerAddress("127.0.0.1", 0, worker, local_host_id(), tcp_port=1)
    elsewhere = PeerAddress("10.0.0.2", 0, worker, "another-host", tcp_port=1)
    for transport, same_host_limit in (("auto", SAME_HOST_TCP_PULL_MAX), ("tcp", 4 << 20)):
        reader = ReplicaReader(local_host_id(), transport=transport, tcp_pull_max=4 << 20)
        try:
            for peer, limit in ((here, same_host_limit), (elsewhere, 4 << 20)):
                assert reader.pulls.client_for(peer, limit) is reader.pulls.tcp
                assert reader.pulls.client_for(peer, limit + 1) is reader.pulls.ucx
            assert reader.pulls.client_for(PeerAddress("10.0.0.2", 0, worker, "h"), 4096) is reader.pulls.ucx  # no port
        finally:
            reader.close()
    off = ReplicaReader(local_host_id(), tcp_pull_max=0)
    try:
        assert off.pulls.tcp is None and off.pulls.client_for(elsewhere, 4096) is off.pulls.ucx
        # A client node that has not started UCX publishes its TCP port alone: TCP, whatever
        # the size, also for this reader (and its pulls elsewhere stay UCX).
        no_ucx = PeerAddress("10.0.0.3", 0, b"", "another-host", tcp_port=1)
        assert off.pulls.client_for(no_ucx, 1 << 30) is off.pulls.tcp is not None
        assert off.pulls.client_for(elsewhere, 4096) is off.pulls.ucx
    finally:
        off.close()
