"""PullServer / PullClient over real UCX endpoints on 127.0.0.1.

The server always runs in a separate process (this file, run as a script with
``--serve``): it serves deterministic bytes per key from a small provider and
answers ``stats`` on stdin with its counters as one JSON line. Special keys
exercise the failure paths: ``miss:*`` is a miss, ``boom`` raises in the
provider, ``slow`` answers after a second, ``file:*`` is served through
``read_into`` from a real file (the nvme path; ``file:slow`` reads for a
second, ``file:bad`` fails reading after its first chunk), ``split:*`` comes
as two buffers, ``stall`` blocks in the provider,
and ``stall-mid`` sends its first chunk and then blocks reading the second, so
killing the process leaves a pull half done.

Progress is blocking on both sides (the module's only mode).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool import errors
from kvpool.objformat import LayerRange
from kvpool.transport import PeerAddress, PullClient, PullRequest, PullServer, ServeSource
from kvpool.transport.engine import Engine, ucx_interface_options
from kvpool.transport.frames import Request, pack_request, parse_request
from kvpool.transport.tcp import TcpPullServer

LAYERS = 8
LAYER_NBYTES = 96 * 1024 + 40  # odd size: chunk boundaries fall inside layers
SERVER_MAX_MESSAGE = 256 * 1024  # small, so a whole object needs several messages
BIG_LAYER_NBYTES = 1 << 20


def object_bytes(key: bytes) -> np.ndarray:
    """The deterministic payload of ``key`` (all layers), as the server builds it."""
    layer_nbytes = BIG_LAYER_NBYTES if key.startswith(b"big") else LAYER_NBYTES
    seed = int.from_bytes(key.ljust(8, b"\0")[:8], "little") ^ len(key)
    return np.random.default_rng(seed).integers(0, 256, LAYERS * layer_nbytes, dtype=np.uint8)


def header_of(key: bytes) -> bytes:
    """The header the server sends with ``key`` when asked: binary, longer than any failure
    text; none for ``nohdr:*`` keys, one over the protocol's limit for ``hugehdr``."""
    if key.startswith(b"nohdr:"):
        return b""
    if key == b"hugehdr":
        return b"h" * 70_000
    return hashlib.sha256(key).digest() * 40  # 1280 bytes


def layer_nbytes_of(key: bytes) -> int:
    return BIG_LAYER_NBYTES if key.startswith(b"big") else LAYER_NBYTES


def expected(key: bytes, start: int, stop: int) -> np.ndarray:
    step = layer_nbytes_of(key)
    return object_bytes(key)[start * step:stop * step]


# -- the server process ----------------------------------------------------------------


def _serve(tmpdir: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="server %(levelname)s %(name)s: %(message)s")
    cache: dict[bytes, np.ndarray] = {}
    cache_lock = threading.Lock()
    file_lock = threading.Lock()
    released = [0]
    never = threading.Event()

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def payload(key: bytes) -> np.ndarray:
        with cache_lock:
            if key not in cache:
                cache[key] = object_bytes(key)
            return cache[key]

    def release() -> None:
        released[0] += 1

    def authorize(key: bytes, token: bytes) -> None:  # TCP pulls of "secret:*" keys need a token
        if key.startswith(b"secret:") and token != b"open-sesame":
            raise errors.AuthenticationError("token refused")

    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        if key.startswith(b"miss:"):
            return None
        if key == b"boom":
            raise RuntimeError("disk on fire")
        if key == b"stall":
            say("stalled")
            never.wait()
        if key == b"slow":
            never.wait(1.0)
        if layer_range.stop > LAYERS:
            raise errors.LayerRangeError(f"layers [{layer_range.start}, {layer_range.stop}) of {LAYERS}")
        step = layer_nbytes_of(key)
        lo, hi = layer_range.start * step, layer_range.stop * step
        if key.startswith(b"file:") or key == b"stall-mid":
            path = Path(tmpdir) / key.hex()
            with file_lock:  # concurrent first pulls: one writes, atomically
                if not path.exists():
                    partial = path.with_suffix(".partial")
                    partial.write_bytes(payload(key).tobytes())
                    partial.replace(path)
            fd = os.open(path, os.O_RDONLY)

            def read_into(offset: int, out: memoryview) -> int:
                if key == b"file:slow":
                    never.wait(1.0)
                if key == b"file:bad" and offset > 0:
                    raise OSError(5, "Input/output error")
                if key == b"stall-mid" and offset > 0:
                    say("stalled")
                    never.wait()
                return os.preadv(fd, [out], lo + offset)

            def close_file() -> None:
                os.close(fd)
                release()

            return ServeSource(nbytes=hi - lo, read_into=read_into, release=close_file)
        view = memoryview(payload(key))[lo:hi]
        if key.startswith(b"split:"):  # two buffers, a chunk straddles them
            cut = (hi - lo) // 3
            return ServeSource(nbytes=hi - lo, buffers=[view[:cut], view[cut:]], release=release)
        return ServeSource(nbytes=hi - lo, buffers=[view], release=release, header=header_of(key))

    server = PullServer(provider, max_message=SERVER_MAX_MESSAGE, send_timeout_s=3.0).start()
    # The same provider over plain TCP (tests/transport/test_tcp_pulls.py)
    tcp = TcpPullServer(provider, send_timeout_s=3.0, authorize=authorize, staging_nbytes=SERVER_MAX_MESSAGE).start()
    peer = server.peer_address
    say("ready " + json.dumps({"peer": [peer.host, peer.port, peer.worker_address.hex(), peer.host_id, tcp.port]}))
    for line in sys.stdin:
        if line.strip() == "stats":
            say("stats " + json.dumps({**server.stats(), "released": released[0], "tcp": tcp.stats()}))
        elif line.strip() == "quit":
            break
    tcp.close()
    server.close()
    say("bye")


class ServerProcess:
    """A PullServer in a child process; always killed on teardown."""

    def __init__(self, tmpdir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(tmpdir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.wait_for("ready", timeout_s=30)
        host, port, worker_address, host_id, tcp_port = json.loads(ready)["peer"]
        self.peer = PeerAddress(host, port, bytes.fromhex(worker_address), host_id, tcp_port)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, word: str, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and self.lines.empty():
                raise AssertionError(f"server never said {word!r} (exit code {self.proc.poll()})")
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line.split(" ", 1)[0] == word:
                return line.partition(" ")[2]

    def quiet_stats(self) -> dict[str, int]:
        """Counters once nothing is in flight (earlier pulls fully released)."""
        return self.wait_stats(lambda s: s["in_flight"] == 0)

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stats\n")
        return json.loads(self.wait_for("stats"))

    def wait_stats(self, predicate: Any, timeout_s: float = 10.0) -> dict[str, int]:
        """Poll the counters until ``predicate(stats)`` holds (the server finishes
        its bookkeeping right after the client has its bytes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("transfer-server"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module", params=["tcp", "auto"])
def client(request: pytest.FixtureRequest) -> Iterator[PullClient]:
    with PullClient(transport=request.param) as pull_client:
        yield pull_client


# -- tests -------------------------------------------------------------------------------------


def test_whole_object_and_layer_ranges_arrive_exact(server: ServerProcess, client: PullClient) -> None:
    before = server.quiet_stats()
    requested = 0
    for start, stop in [(0, LAYERS), (0, 1), (3, 5), (7, 8), (2, 7)]:
        want = expected(b"obj-a", start, stop)
        out = np.zeros(want.nbytes, np.uint8)
        n = client.pull_into(server.peer, b"obj-a", LayerRange(start, stop), out, timeout_s=10)
        assert n == want.nbytes
        assert np.array_equal(out, want), f"layers [{start}, {stop}) differ"
        requested += want.nbytes
    after = server.quiet_stats()
    assert after["bytes_sent"] - before["bytes_sent"] == requested
    assert after["requests_served"] - before["requests_served"] == 5
    assert after["released"] - before["released"] == 5


def test_pull_many_keeps_every_pull_in_flight_and_gives_each_its_own_result(
        server: ServerProcess, client: PullClient) -> None:
    from kvpool.transport import PullRequest

    before = server.quiet_stats()
    wants = [expected(b"obj-m%d" % i, i % LAYERS, LAYERS) for i in range(12)]
    outs = [np.zeros(w.nbytes, np.uint8) for w in wants]
    headers = [bytearray(4096) for _ in wants]
    requests = [PullRequest(server.peer, b"obj-m%d" % i, (i % LAYERS, LAYERS), outs[i], header_out=headers[i],
                            alive=lambda: True) for i in range(12)]
    missing = np.zeros(64, np.uint8)
    requests += [PullRequest(server.peer, b"miss:never", (0, 1), missing),     # the holder misses
                 PullRequest(server.peer, b"", (0, 1), missing),               # a bad key: refused here
                 PullRequest(server.peer, b"obj-m0", (0, 1), np.zeros(1, np.uint8))]  # out too small
    results = client.pull_many(requests, timeout_s=10)
    for i, want in enumerate(wants):
        assert results[i] == want.nbytes and np.array_equal(outs[i], want), f"pull {i}"
        assert bytes(headers[i]) == header_of(b"obj-m%d" % i)
    assert isinstance(results[12], errors.RemoteMissError)
    assert isinstance(results[13], errors.InvalidKeyError)
    assert isinstance(results[14], errors.OutBufferError)
    after = server.quiet_stats()
    assert after["bytes_sent"] - before["bytes_sent"] == sum(w.nbytes for w in wants)
    # a holder reported gone fails its pulls at once, without waiting out the deadline
    gone = client.pull_many([PullRequest(server.peer, b"slow", (0, 1), np.zeros(layer_nbytes_of(b"slow"), np.uint8),
                                         alive=lambda: False)], timeout_s=30)
    assert isinstance(gone[0], errors.TransferError) and "gone" in str(gone[0])
    assert client.pull_into(server.peer, b"obj-m1", (1, LAYERS), outs[1]) == wants[1].nbytes  # still serving


def test_the_header_comes_in_the_same_reply_only_when_asked(server: ServerProcess, client: PullClient) -> None:
    want = expected(b"obj-h", 2, 5)
    out = np.zeros(want.nbytes, np.uint8)
    header = bytearray(4096)  # room for at most 4096 header bytes
    assert client.pull_into(server.peer, b"obj-h", (2, 5), out, header_out=header) == want.nbytes
    assert bytes(header) == header_of(b"obj-h") and np.array_equal(out, want)
    header = bytearray()  # no length given: up to the protocol's limit
    client.pull_into(server.peer, b"obj-h", (0, 1), out[:layer_nbytes_of(b"obj-h")], header_out=header)
    assert bytes(header) == header_of(b"obj-h")
    # A header larger than the room given fails the pull; a truncated header never arrives.
    small = bytearray(b"untouched" * 20)
    with pytest.raises(errors.TransferError):
        client.pull_into(server.peer, b"obj-h", (0, 1), out[:layer_nbytes_of(b"obj-h")], header_out=small)
    assert small == bytearray(b"untouched" * 20)
    # A holder with no header to send (or one too large to send) answers an error, not bytes.
    for key, says in [(b"nohdr:a", "no header"), (b"hugehdr", "70000")]:
        with pytest.raises(errors.TransferError, match=says):
            client.pull_into(server.peer, key, (0, 1), out[:layer_nbytes_of(key)], header_out=bytearray())
        # ... and the same key without asking for the header is served as before
        assert client.pull_into(server.peer, key, (0, 1), out[:layer_nbytes_of(key)]) == layer_nbytes_of(key)
    # the endpoint survived all of that
    assert client.pull_into(server.peer, b"obj-h", (2, 5), out, header_out=bytearray()) == want.nbytes


def test_out_may_be_larger_and_any_buffer_type(server: ServerProcess, client: PullClient) -> None:
    want = expected(b"obj-b", 1, 3)
    out = bytearray(want.nbytes + 1000)
    assert client.pull_into(server.peer, b"obj-b", (1, 3), out, timeout_s=10) == want.nbytes
    assert bytes(out[:want.nbytes]) == want.tobytes()
    assert out[want.nbytes:] == bytes(1000)  # nothing written past the payload
    # A typed array (float16 KV layout) receives bytes in place.
    kv = np.zeros((2, 2, want.nbytes // 16, 2), np.float16)
    assert kv.nbytes == want.nbytes
    client.pull_into(server.peer, b"obj-b", range(1, 3), kv, timeout_s=10)
    assert kv.view(np.uint8).reshape(-1).tobytes() == want.tobytes()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_range_larger_than_max_message_arrives_split(server: ServerProcess, transport: str) -> None:
    client_limit = 64 * 1024  # below the server's 256 KiB: the smaller limit wins
    want = expected(b"big-1", 0, LAYERS)
    with PullClient(transport=transport, max_message=client_limit) as small:
        before = server.quiet_stats()
        out = np.zeros(want.nbytes, np.uint8)
        assert small.pull_into(server.peer, b"big-1", (0, LAYERS), out, timeout_s=20) == want.nbytes
        assert np.array_equal(out, want)
        after = server.quiet_stats()
    assert after["messages_sent"] - before["messages_sent"] == -(-want.nbytes // client_limit)  # 128
    assert after["bytes_sent"] - before["bytes_sent"] == want.nbytes


def test_server_limit_splits_for_a_large_client_limit(server: ServerProcess, client: PullClient) -> None:
    want = expected(b"big-2", 2, 6)
    before = server.quiet_stats()
    out = np.zeros(want.nbytes, np.uint8)
    client.pull_into(server.peer, b"big-2", (2, 6), out, timeout_s=20)
    assert np.array_equal(out, want)
    after = server.quiet_stats()
    assert after["messages_sent"] - before["messages_sent"] == -(-want.nbytes // SERVER_MAX_MESSAGE)


def test_chunk_straddling_two_source_buffers(server: ServerProcess, client: PullClient) -> None:
    want = expected(b"split:x", 0, LAYERS)
    out = np.zeros(want.nbytes, np.uint8)
    client.pull_into(server.peer, b"split:x", (0, LAYERS), out, timeout_s=10)
    assert np.array_equal(out, want)


def test_read_into_path_serves_from_a_file(server: ServerProcess, client: PullClient) -> None:
    before = server.quiet_stats()
    for key, (start, stop) in [(b"file:1", (0, LAYERS)), (b"file:1", (5, 6)), (b"file:big", (1, 8))]:
        want = expected(key, start, stop)
        out = np.zeros(want.nbytes, np.uint8)
        assert client.pull_into(server.peer, key, (start, stop), out, timeout_s=20) == want.nbytes
        assert np.array_equal(out, want)
    # Every source released (its file closed) once its bytes were sent.
    after = server.quiet_stats()
    assert after["released"] - before["released"] == 3


def test_miss_and_remote_errors_are_typed(server: ServerProcess, client: PullClient) -> None:
    out = np.zeros(LAYERS * LAYER_NBYTES, np.uint8)
    before = server.quiet_stats()
    with pytest.raises(errors.RemoteMissError):
        client.pull_into(server.peer, b"miss:1", (0, 1), out, timeout_s=10)
    with pytest.raises(errors.TransferError, match="disk on fire"):
        client.pull_into(server.peer, b"boom", (0, 1), out, timeout_s=10)
    with pytest.raises(errors.LayerRangeError):
        client.pull_into(server.peer, b"obj-a", (0, LAYERS + 1), out, timeout_s=10)
    with pytest.raises(errors.OutBufferError, match="out buffer holds"):
        client.pull_into(server.peer, b"obj-a", (0, 2), out[:LAYER_NBYTES], timeout_s=10)
    assert client.stats()["failures"] >= 4
    after = server.quiet_stats()
    assert after["misses"] - before["misses"] == 1
    assert after["bytes_sent"] == before["bytes_sent"]  # no payload moved for any of them
    # The endpoint survived typed errors: the next pull works.
    want = expected(b"obj-a", 0, 1)
    assert client.pull_into(server.peer, b"obj-a", (0, 1), out[:want.nbytes], timeout_s=10) == want.nbytes
    assert np.array_equal(out[:want.nbytes], want)


def test_bad_local_input_is_rejected_before_sending(server: ServerProcess, client: PullClient) -> None:
    with pytest.raises(errors.OutBufferError):
        client.pull_into(server.peer, b"obj-a", (0, 1), bytes(LAYER_NBYTES), timeout_s=5)  # read-only
    with pytest.raises(errors.OutBufferError):
        client.pull_into(server.peer, b"obj-a", (0, 1), np.zeros((LAYER_NBYTES, 2), np.uint8)[:, 0], timeout_s=5)
    # byte views as the reader passes them are taken as they are, but only when they may be
    with pytest.raises(errors.OutBufferError):  # strided
        client.pull_into(server.peer, b"obj-a", (0, 1), memoryview(bytearray(2 * LAYER_NBYTES))[::2], timeout_s=5)
    with pytest.raises(errors.OutBufferError):  # read-only
        client.pull_into(server.peer, b"obj-a", (0, 1), memoryview(bytes(LAYER_NBYTES)), timeout_s=5)
    with pytest.raises(errors.LayerRangeError):  # as a LayerRange too
        client.pull_into(server.peer, b"obj-a", LayerRange(3, 3), bytearray(10), timeout_s=5)
    with pytest.raises(errors.InvalidKeyError):
        client.pull_into(server.peer, b"", (0, 1), bytearray(10), timeout_s=5)
    with pytest.raises(errors.LayerRangeError):
        client.pull_into(server.peer, b"obj-a", (3, 3), bytearray(10), timeout_s=5)
    with pytest.raises(ValueError):
        PullClient(transport="carrier-pigeon")


def test_unreachable_peer_fails_fast() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free, and nothing listens once closed
    with PullClient() as pull_client:
        # Connection refused is a TransferError at once; waiting out the (long) deadline would
        # be a KVTimeoutError instead.
        with pytest.raises(errors.TransferError) as failure:
            pull_client.pull_into(("127.0.0.1", port), b"k", (0, 1), bytearray(16), timeout_s=60)
        assert not isinstance(failure.value, errors.KVTimeoutError)


def test_malformed_worker_addresses_never_reach_ucx(server: ServerProcess) -> None:
    # UCX aborts the process on some malformed addresses; both ends check first.
    bogus = PeerAddress(server.peer.host, server.peer.port, b"\x07" + bytes(63), server.peer.host_id)
    want = expected(b"obj-a", 0, 1)
    out = np.zeros(want.nbytes, np.uint8)
    with PullClient(transport="auto") as pull_client:
        # A bad advertised address: the client falls back to the listener.
        assert pull_client.pull_into(bogus, b"obj-a", (0, 1), out, timeout_s=10) == want.nbytes
        assert np.array_equal(out, want)
    before = server.quiet_stats()
    with PullClient(transport="auto") as liar:
        liar._worker_address = b"\x07" + bytes(63)  # a client announcing a corrupt reply address
        with pytest.raises(errors.KVTimeoutError):  # the server cannot answer it
            liar.pull_into(server.peer, b"obj-a", (0, 1), out, timeout_s=1.0)
    after = server.quiet_stats()
    assert after["errors"] == before["errors"] + 1
    with PullClient(transport="auto") as honest:  # and the server lives on
        assert honest.pull_into(server.peer, b"obj-a", (0, 1), out, timeout_s=10) == want.nbytes


def test_concurrent_pulls_from_many_threads_and_clients(server: ServerProcess) -> None:
    failures: list[str] = []
    with PullClient(transport="tcp") as tcp_client, PullClient(transport="auto") as shm_client:

        def worker(index: int) -> None:
            rng = np.random.default_rng(index)
            pull_client = tcp_client if index % 2 else shm_client
            for _ in range(6):
                key = [b"obj-a", b"obj-c", b"file:2", b"big-3"][int(rng.integers(0, 4))]
                start = int(rng.integers(0, LAYERS))
                stop = int(rng.integers(start + 1, LAYERS + 1))
                want = expected(key, start, stop)
                out = np.zeros(want.nbytes, np.uint8)
                try:
                    pull_client.pull_into(server.peer, key, (start, stop), out, timeout_s=30)
                except errors.KVPoolError as exc:
                    failures.append(f"{key!r} [{start},{stop}): {exc}")
                    continue
                if not np.array_equal(out, want):
                    failures.append(f"{key!r} [{start},{stop}): bytes differ")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads)
    assert failures == []


async def test_async_pulls_pipeline_layers(server: ServerProcess, client: PullClient) -> None:
    key = b"big-4"
    step = layer_nbytes_of(key)
    out = np.zeros(LAYERS * step, np.uint8)
    want = expected(key, 0, LAYERS)
    # Layer i is checked while layer i+1 is in flight.
    pending = asyncio.ensure_future(client.apull_into(server.peer, key, (0, 1), out[:step], timeout_s=10))
    for layer in range(LAYERS):
        assert await pending == step
        if layer + 1 < LAYERS:
            nxt = out[(layer + 1) * step:(layer + 2) * step]
            pending = asyncio.ensure_future(
                client.apull_into(server.peer, key, (layer + 1, layer + 2), nxt, timeout_s=10))
        assert np.array_equal(out[layer * step:(layer + 1) * step], want[layer * step:(layer + 1) * step])
    # And many at once.
    out2 = np.zeros_like(out)
    sizes = await asyncio.gather(*[
        client.apull_into(server.peer, key, (i, i + 1), out2[i * step:(i + 1) * step], timeout_s=10)
        for i in range(LAYERS)
    ])
    assert sizes == [step] * LAYERS
    assert np.array_equal(out2, want)
    with pytest.raises(errors.RemoteMissError):
        await client.apull_into(server.peer, b"miss:2", (0, 1), out2, timeout_s=10)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "auto"])
@pytest.mark.parametrize("stall_key", [b"stall", b"stall-mid"])
def test_holder_killed_mid_pull_fails_within_deadline(
    fresh_server: ServerProcess, transport: str, stall_key: bytes
) -> None:
    deadline_s = 4.0
    with PullClient(transport=transport) as pull_client:
        # A working pull first, so the endpoint is cached and warm.
        want = expected(b"obj-a", 0, 2)
        out = np.zeros(want.nbytes, np.uint8)
        pull_client.pull_into(fresh_server.peer, b"obj-a", (0, 2), out, timeout_s=10)

        big = np.zeros(LAYERS * LAYER_NBYTES, np.uint8)
        outcome: dict[str, Any] = {}

        def pull() -> None:
            start = time.monotonic()
            try:
                outcome["n"] = pull_client.pull_into(
                    fresh_server.peer, stall_key, (0, LAYERS), big, timeout_s=deadline_s)
            except errors.KVPoolError as exc:
                outcome["error"] = exc
            outcome["elapsed"] = time.monotonic() - start

        thread = threading.Thread(target=pull)
        thread.start()
        fresh_server.wait_for("stalled")
        fresh_server.kill()
        thread.join(deadline_s + 10)
        assert not thread.is_alive()
        assert "n" not in outcome, "a pull from a dead holder reported success"
        assert isinstance(outcome["error"], (errors.TransferError, errors.KVTimeoutError))
        if transport == "tcp":
            # UCX sees the TCP connection reset: a transport error, not the deadline's.
            assert isinstance(outcome["error"], errors.TransferError), outcome["error"]
        # The dead peer's endpoint was dropped: a new pull fails (by its deadline at the
        # latest), never hangs.
        with pytest.raises((errors.TransferError, errors.KVTimeoutError)):
            pull_client.pull_into(fresh_server.peer, b"obj-a", (0, 2), out, timeout_s=2.0)


def test_a_batch_from_a_dead_same_host_holder_tries_one_endpoint_not_one_per_pull(
        fresh_server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage node pulling a hand-off from an engine killed meanwhile: by worker address
    (shared memory), every pull of the batch made its own endpoint and UCX printed four ERROR
    lines for each (56 for 14 blocks). Now the first failure is remembered for
    ``CONNECT_RETRY_S``: one endpoint attempted, every pull a TransferError, and a later batch
    tries again."""
    import kvpool.transport.client as client_module

    monkeypatch.setattr(client_module, "CONNECT_RETRY_S", 0.5)
    fresh_server.kill()  # its shared-memory segments are gone with it
    requests = [PullRequest(fresh_server.peer, b"obj-a", LayerRange(0, 2), np.zeros(2 * LAYER_NBYTES, np.uint8))
                for _ in range(14)]
    with PullClient(transport="auto") as pull_client:
        outcomes = pull_client.pull_many(requests, timeout_s=5.0)
        assert all(type(o) is errors.TransferError for o in outcomes), outcomes
        assert "moments ago" in str(outcomes[-1])
        stats = pull_client.stats()
        assert (stats["connects_failed"], stats["connects_skipped"]) == (1, 13), stats
        time.sleep(0.6)
        (again,) = pull_client.pull_many(requests[:1], timeout_s=5.0)
        assert type(again) is errors.TransferError and "moments ago" not in str(again)
        assert pull_client.stats()["connects_failed"] == 2


def test_a_server_answering_a_dead_client_tries_one_reply_endpoint_not_one_per_request(
        fresh_server: ServerProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The server's side of the same: a same-host client that died with a batch of pulls in
    flight. Its requests reach the server, which makes the reply endpoint to the client's worker
    address: one attempt and one warning for the batch, each request counted as an error and
    never served; after ``REPLY_RETRY_S`` a request tries again."""
    import kvpool.transport.connections as connections

    monkeypatch.setattr(connections, "REPLY_RETRY_S", 0.5)
    dead_address = fresh_server.peer.worker_address  # a worker address whose process is gone
    fresh_server.kill()
    served: list[Request] = []
    failures: list[int] = []
    engine = Engine("test-reply-endpoints", ucx_interface_options("127.0.0.1"))
    try:
        table = connections.ReplyEndpoints(engine, "test", park_s=1.0, dispatch=lambda r, ep: served.append(r),
                                           dropped=lambda ep: None, error=lambda: failures.append(1))

        def requests(first_id: int, count: int) -> list[Request]:
            return [parse_request(pack_request(b"obj-a", b"", LayerRange(0, 1), 4096, want_header=False,
                                               max_chunk=4096, request_id=i, client_id=7, conn_id=9,
                                               reply_address=dead_address))
                    for i in range(first_id, first_id + count)]

        with caplog.at_level(logging.WARNING, logger="kvpool.transport"):
            for request in requests(0, 14):
                engine.call(lambda request=request: table.route(request))
            assert (len(served), len(failures)) == (0, 14)
            assert len([r for r in caplog.records if "cannot reach client" in r.getMessage()]) == 1
            time.sleep(0.6)
            (late,) = requests(14, 1)
            engine.call(lambda: table.route(late))
            assert (len(served), len(failures)) == (0, 15)
            assert len([r for r in caplog.records if "cannot reach client" in r.getMessage()]) == 2
    finally:
        engine.stop(lambda: None)


def test_read_failure_mid_pull_is_reported_at_once(server: ServerProcess, client: PullClient) -> None:
    out = np.zeros(LAYERS * LAYER_NBYTES, np.uint8)  # 3 chunks of 256 KiB; the 2nd read fails
    before = server.quiet_stats()
    # The abort frame's text (the deadline would be a KVTimeoutError saying so).
    with pytest.raises(errors.TransferError, match="mid-pull.*Input/output error"):
        client.pull_into(server.peer, b"file:bad", (0, LAYERS), out, timeout_s=60)
    peers = client.stats()["peers"]
    want = expected(b"obj-a", 0, 1)
    assert client.pull_into(server.peer, b"obj-a", (0, 1), out[:want.nbytes], timeout_s=10) == want.nbytes
    assert np.array_equal(out[:want.nbytes], want)
    assert client.stats()["peers"] == peers  # the endpoint was kept, not dropped
    after = server.quiet_stats()
    assert after["released"] == before["released"] + 2
    assert after["errors"] == before["errors"] + 1


def test_a_caller_waiting_on_its_own_pull_sleeps_instead_of_spinning(server: ServerProcess,
                                                                     client: PullClient) -> None:
    # `slow` answers after a second; the calling thread drives the worker meanwhile (no other
    # thread does) and must spend that second asleep in epoll_wait, not polling.
    want = expected(b"slow", 0, 1)
    out = np.zeros(want.nbytes, np.uint8)
    cpu_before, wall_before = time.thread_time(), time.monotonic()
    assert client.pull_into(server.peer, b"slow", (0, 1), out, timeout_s=10) == want.nbytes
    waited, burned = time.monotonic() - wall_before, time.thread_time() - cpu_before
    assert np.array_equal(out, want)
    assert waited >= 0.9  # the wait happened
    assert burned < 0.25 * waited, f"the waiting thread burned {burned:.2f} s of CPU in {waited:.2f} s"


@pytest.mark.slow
@pytest.mark.parametrize("slow_key", [b"slow", b"file:slow"])
def test_client_deadline_frees_the_server_side(server: ServerProcess, client: PullClient, slow_key: bytes) -> None:
    before = server.quiet_stats()
    out = np.zeros(2 * LAYER_NBYTES, np.uint8)
    # The pull's own deadline, not the 5 s guard against a wedged progress thread.
    with pytest.raises(errors.KVTimeoutError, match="not complete after 0.3s"):
        client.pull_into(server.peer, slow_key, (0, 2), out, timeout_s=0.3)
    # The server answers into a connection the client dropped (tcp) or into
    # tags nobody waits for (auto): either way it must end the pull and
    # release the source, not hold it pinned (for file:slow only after the
    # read that still uses the file has returned).
    after = server.wait_stats(lambda s: s["in_flight"] == 0, timeout_s=15)
    assert after["released"] == before["released"] + 1
    assert after["in_flight"] == 0
    # The client reconnects on the next pull.
    want = expected(b"obj-a", 0, 2)
    client.pull_into(server.peer, b"obj-a", (0, 2), out, timeout_s=10)
    assert np.array_equal(out, want)


async def test_cancelling_an_async_pull_leaves_other_pulls_alone(server: ServerProcess, client: PullClient) -> None:
    slow_out = np.zeros(2 * LAYER_NBYTES, np.uint8)
    slow = asyncio.ensure_future(client.apull_into(server.peer, b"slow", (0, 2), slow_out, timeout_s=10))
    want = expected(b"big-5", 0, LAYERS)
    out = np.zeros(want.nbytes, np.uint8)
    other = asyncio.ensure_future(client.apull_into(server.peer, b"big-5", (0, LAYERS), out, timeout_s=10))
    await asyncio.sleep(0.05)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    # The endpoint both share was not dropped: the concurrent pull completes.
    assert await other == want.nbytes
    assert np.array_equal(out, want)
    # The cancelled pull finishes in the background; the client stays usable.
    before = client.stats()["pulls"]
    deadline = time.monotonic() + 10
    while client.stats()["pulls"] == before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert np.array_equal(slow_out, expected(b"slow", 0, 2))


def test_inline_provider_runs_on_the_progress_thread() -> None:
    # In-process on purpose: the option only changes which thread calls the provider.
    payload = np.arange(3 * 70000, dtype=np.uint32).view(np.uint8)
    callers: list[str] = []

    def provider(key: bytes, layers: LayerRange) -> ServeSource:
        callers.append(threading.current_thread().name)
        step = 70000 * 4
        return ServeSource(nbytes=layers.count * step,
                           buffers=[memoryview(payload)[layers.start * step:layers.stop * step]])

    with PullServer(provider, inline_provider=True, name="inline-test").start() as server, PullClient() as pull_client:
        out = np.zeros(2 * 70000 * 4, np.uint8)
        assert pull_client.pull_into(server.address, b"k", (1, 3), out, timeout_s=10) == out.nbytes
        assert np.array_equal(out, payload[70000 * 4:])
    assert callers == ["inline-test"]


def test_port_in_use_is_a_typed_error() -> None:
    before = {t.ident for t in threading.enumerate()}
    with PullServer(lambda key, layers: None).start() as first:
        with pytest.raises(errors.TransferError, match="cannot listen"):
            PullServer(lambda key, layers: None, port=first.address[1]).start()
    assert [t for t in threading.enumerate() if t.ident not in before] == []  # the failed start cleaned up


def test_close_leaves_no_threads() -> None:
    before = {t.ident for t in threading.enumerate()}
    server = PullServer(lambda key, layers: None).start()
    client = PullClient()
    with pytest.raises(errors.RemoteMissError):
        client.pull_into(server.address, b"k", (0, 1), bytearray(8), timeout_s=5)
    client.close()
    server.close()
    leftover = [t for t in threading.enumerate() if t.ident not in before]
    assert leftover == []
    with pytest.raises(errors.PoolClosedError):
        client.pull_into(("127.0.0.1", 1), b"k", (0, 1), bytearray(8), timeout_s=1)


@pytest.mark.slow
def test_transfer_bench_quick_run_reports_every_size(tmp_path: Path) -> None:
    # Checks the benchmark works and reports what it promises, not how fast
    # anything is (speed on a shared 2-core machine is no test).
    bench = Path(__file__).resolve().parents[2] / "bench" / "transfer_bench.py"
    results = tmp_path / "transfer.json"
    proc = subprocess.run(
        [sys.executable, str(bench), "--quick", "--sizes", "64K,1M", "--no-perftest",
         "--json", str(results), "--plot", str(tmp_path / "transfer.png")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Placement: " in proc.stdout
    table = proc.stdout.split("Throughput (GB/s)")[1].split("\n\n")[0]
    assert "tcp/socket" in table and "64.0 KiB" in table and "1.0 MiB" in table, proc.stdout
    data = json.loads(results.read_text())
    for backend in ("socket", "memcpy", "pull tcp", "pull auto"):
        assert sorted(data["throughput_gbps"][backend]) == ["1048576", "65536"]
        assert all(v > 0 for v in data["throughput_gbps"][backend].values())
    assert set(data["pages_gbps"]) == {"tcp", "auto"}
    assert [row["layers"] for row in data["on_demand"]["tcp"]] == [1, 2, 4, 8]
    assert "[" in proc.stderr  # progress goes to stderr, not into the tables


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        _serve(sys.argv[2])
    else:
        sys.exit("usage: test_transfer.py --serve TMPDIR  (pytest runs the tests)")


@pytest.mark.parametrize("user_value", [None, "64k"])
def test_rendezvous_threshold_default_yields_to_the_users_variable(user_value: str | None) -> None:
    """ucxx sets UCX_RNDV_THRESH=8192 when imported; kvpool's own default (eager below 8 MiB
    where UCX has only TCP and shared memory) replaces that, never a value the user set."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_RNDV_THRESH"}
    if user_value is not None:
        env["UCX_RNDV_THRESH"] = user_value
    code = ("import json, os; from kvpool.transport.engine import effective_ucx_options, _host_without_rdma_or_gpu; "
            "print(json.dumps([effective_ucx_options({}).get('RNDV_THRESH'), _host_without_rdma_or_gpu(), "
            "os.environ['UCX_RNDV_THRESH']]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    option, tcp_and_shm_only, variable = json.loads(out.stdout.strip().splitlines()[-1])
    if user_value is not None:
        assert (option, variable) == (None, user_value)  # the context reads the user's variable
    else:
        assert variable == "8192"  # ucxx's
        assert option == ("8m" if tcp_and_shm_only else None)
