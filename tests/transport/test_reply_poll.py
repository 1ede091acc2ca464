"""ReplyPoll: a reply polled for before the caller blocks, on real loopback TCP connections.

Counters, not clocks, say what happened (a caught reply, a poll that ran out, a poll skipped):
speed is bench/poll_bench.py's to measure.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool import errors
from kvpool.objformat import LayerRange
from kvpool.transport import PeerAddress, PullRequest, ServeSource
from kvpool.transport.tcp import TcpPullClient, TcpPullServer
from kvpool.transport.tcp.stream import POLL_RETRY_EVERY, ReplyPoll
from tests.transport.test_transfer import LAYER_NBYTES, LAYERS, expected, layer_nbytes_of


def _payload(key: bytes, nbytes: int) -> bytes:
    """Bytes only ``key`` has: a reply read into the wrong place, or short, would not match."""
    blocks = (hashlib.sha256(key + i.to_bytes(4, "little")).digest() for i in range(nbytes // 32 + 1))
    return b"".join(blocks)[:nbytes]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(client, server) ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    try:
        yield client, server
    finally:
        client.close()
        server.close()


def test_a_reply_that_comes_while_polled_for_is_taken_then(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    poll = ReplyPoll(5.0)  # far longer than a loopback reply takes, even on a loaded machine
    reply = _payload(b"soon", 3000)
    answer = threading.Timer(0.01, server.sendall, (reply,))
    answer.start()
    head, rest = bytearray(100), bytearray(4000)
    got = poll.receive(client, [head, rest], poll.mark())
    answer.join()
    while got is not None and got < len(reply):  # (loopback may deliver it in pieces)
        got += client.recv_into(memoryview(rest)[got - len(head):])
    assert got == len(reply) and bytes(head + rest)[:got] == reply
    assert (poll.caught, poll.ran_out) == (1, 0)


def test_polls_that_keep_running_out_stop_and_are_tried_again_later(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Nothing to read: each poll runs out (the caller would block); after two, polling stops,
    and one poll is tried again every POLL_RETRY_EVERY replies. A reply that does come is
    still the caller's to read, whole."""
    client, server = pair
    poll = ReplyPoll(0.001)
    buf = bytearray(64)
    assert poll.receive(client, [buf], poll.mark()) is None and poll.receive(client, [buf], poll.mark()) is None
    assert poll.ran_out == 2
    for _ in range(POLL_RETRY_EVERY - 1):
        assert poll.receive(client, [buf], poll.mark()) is None  # not polled at all
    assert poll.ran_out == 2
    assert poll.receive(client, [buf], poll.mark()) is None and poll.ran_out == 3  # tried once more
    server.sendall(_payload(b"late", 64))
    client.settimeout(5.0)
    assert client.recv_into(buf) == 64 and bytes(buf) == _payload(b"late", 64)
    assert poll.caught == 0


def test_no_poll_when_off_or_while_another_thread_polls(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    assert ReplyPoll(0.0).receive(client, [bytearray(8)], 0) is None  # off: never touches the socket
    poll = ReplyPoll(5.0)
    first: list[int | None] = []
    polling = threading.Thread(target=lambda: first.append(poll.receive(client, [bytearray(8)], poll.mark())))
    polling.start()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        other = socket.create_connection(listener.getsockname())
        other_server, _ = listener.accept()
        with other, other_server:
            other_server.sendall(b"x" * 8)
            deadline = time.monotonic() + 5.0
            while not poll._polling and time.monotonic() < deadline:
                time.sleep(0.001)
            assert poll._polling
            # this thread's reply is there, but one thread polls at a time: it blocks as usual
            assert poll.receive(other, [bytearray(8)], poll.mark()) is None
    server.sendall(b"y" * 8)
    polling.join()
    assert first == [8] and (poll.caught, poll.ran_out) == (1, 0)


def test_a_connection_that_ends_or_fails_while_polled_for_says_so(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    poll = ReplyPoll(5.0)
    server.close()  # the stream ends: 0, as from a blocking receive
    assert poll.receive(client, [bytearray(8)], poll.mark()) == 0
    with socket.create_server(("127.0.0.1", 0)) as listener:
        reset = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        peer.close()  # an RST
        with reset, pytest.raises(ConnectionResetError):
            poll.receive(reset, [bytearray(8)], poll.mark())


_ECHO = """
import os, socket, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
with socket.create_server(("127.0.0.1", 0)) as listener:
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
while conn.recv(64):
    conn.sendall(b"r" * 64)
"""


def test_a_peer_on_the_pollers_cpu_turns_polling_off() -> None:
    """The peer answering on the poller's own CPU (another process) can only answer once the
    poller is preempted: those polls count against polling, which stops after two, though
    every reply is read whole."""
    cpu = min(os.sched_getaffinity(0))
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, str(cpu)], stdout=subprocess.PIPE, text=True)
    mine = os.sched_getaffinity(0)
    try:
        assert echo.stdout is not None
        sock = socket.create_connection(("127.0.0.1", int(echo.stdout.readline())))
        os.sched_setaffinity(threading.get_native_id(), {cpu})
        poll = ReplyPoll(1.0)  # long: the peer gets the CPU only when the scheduler takes it from the poll
        with sock:
            for _ in range(8):
                mark = poll.mark()
                sock.sendall(b"q")
                buf = bytearray(64)
                got = poll.receive(sock, [buf], mark) or 0
                while got < 64:
                    got += sock.recv_into(memoryview(buf)[got:])
                assert bytes(buf) == b"r" * 64
        assert poll.preempted == 2 and poll.caught + poll.ran_out == 2  # then no more polls
    finally:
        os.sched_setaffinity(threading.get_native_id(), mine)
        echo.kill()
        echo.wait()


def _provider(delay_s: float):  # type: ignore[no-untyped-def]
    """Key-derived layers and header, answered after ``delay_s``."""
    def provide(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        time.sleep(delay_s)
        if key.startswith(b"miss:"):
            return None
        data = expected(key, layer_range.start, layer_range.stop)
        return ServeSource(data.nbytes, buffers=[memoryview(data)], header=key.ljust(16, b"."))
    return provide


@pytest.mark.parametrize(("delay_s", "poll_s"), [(0.0, 5.0), (0.05, 0.001)], ids=["within-the-poll", "after-it"])
def test_tcp_pulls_polled_for_land_exact_bytes(delay_s: float, poll_s: float) -> None:
    """A reader's one-receive reply is polled for: one that comes within the poll is taken then;
    one that comes later is read after the poll ran out, whole. A miss stays a miss, and the
    connection stays in step throughout."""
    with TcpPullServer(_provider(delay_s)) as server, TcpPullClient(poll_s=poll_s) as client:
        peer = PeerAddress("127.0.0.1", 0, tcp_port=server.port)
        out = memoryview(bytearray(2 * LAYER_NBYTES))
        for key in (b"a", b"bb", b"ccc"):  # the first connects; the others reuse the connection
            header = bytearray(16)
            assert client.finish(client.start(peer, key, LayerRange(1, 3), out.nbytes), out, header) == out.nbytes
            assert bytes(out) == expected(key, 1, 3).tobytes() and bytes(header) == key.ljust(16, b".")
        with pytest.raises(errors.RemoteMissError):
            client.finish(client.start(peer, b"miss:1", LayerRange(0, 1), LAYER_NBYTES), out[:LAYER_NBYTES],
                          bytearray(16))
        stats = client.stats()
        if delay_s:  # every wait for bytes is polled first (a new connection's too): some ran out
            assert stats["polls_ran_out"] >= 1
        else:  # caught (the holder's thread may preempt this one on its CPU: then polling stops)
            assert stats["polls_caught"] >= 1 and stats["polls_ran_out"] == 0
        assert client.connects == 1 and client.pulls == 3 and client.failures == 1


def test_a_large_reply_in_pieces_and_pipelined_replies_are_exact_with_polling_on() -> None:
    """With polling on (a hello's answer and each reply's status and header are polled for, the
    rest of a payload is waited for a piece at a time): a payload read while it is sent, in
    pieces with pauses, lands whole; so do pipelined replies of a batch."""
    def provide(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        data = expected(key, layer_range.start, layer_range.stop)

        def read_into(offset: int, out: memoryview) -> int:
            if offset // len(out) % 3 == 2:
                time.sleep(0.002)  # longer than the poll: that wait runs out and blocks
            out[:] = memoryview(data)[offset:offset + len(out)]
            return len(out)
        return ServeSource(data.nbytes, read_into=read_into, header=key.ljust(16, b"."))

    with TcpPullServer(provide, staging_nbytes=64 << 10) as server, TcpPullClient(poll_s=0.0005) as client:
        peer = PeerAddress("127.0.0.1", 0, tcp_port=server.port)
        for key in (b"big1", b"small"):  # 8 MiB and 768 KiB
            out, header = np.zeros(LAYERS * layer_nbytes_of(key), np.uint8), bytearray(16)
            assert client.pull_into(peer, key, (0, LAYERS), out, header_out=header) == out.nbytes
            assert np.array_equal(out, expected(key, 0, LAYERS)) and bytes(header) == key.ljust(16, b".")
        # more replies than POLL_RETRY_EVERY: where the first polls run out (polling paused), it resumes
        outs = [np.zeros(2 * LAYER_NBYTES, np.uint8) for _ in range(POLL_RETRY_EVERY + 16)]
        keys = [b"p%d" % i for i in range(len(outs))]
        assert client.pull_many([PullRequest(peer, k, (i % 3, i % 3 + 2), o)
                                 for i, (k, o) in enumerate(zip(keys, outs))]) == [o.nbytes for o in outs]
        for i, (k, o) in enumerate(zip(keys, outs)):
            assert np.array_equal(o, expected(k, i % 3, i % 3 + 2)), k
        stats = client.stats()
        assert stats["polls_caught"] + stats["polls_ran_out"] > 2 and client.connects == 1
