"""Pull tokens, loopback-only listeners, and untrusted master metadata (issue "Authenticated by
default, bounded everywhere")."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool import errors
from kvpool.api import out_view
from kvpool.cluster.node.located import alive_nodes_of, checked_replicas
from kvpool.cluster.node.reader import ReplicaReader
from kvpool.cluster.node.server import NodeAddress
from kvpool.config import Config
from kvpool.objformat import ObjectHeader, encode
from kvpool.transport import PeerAddress, local_host_id
from tests.conftest import ChildProcess, default_cluster_key, free_tcp_port, wait_for

SHAPE = (2, 2, 4, 2, 8)


def listeners_of(pid: int) -> list[str]:
    """Local addresses pid listens on (TCP, v4 and v6), from ``ss -ltnp``."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def only_loopback(addresses: list[str]) -> bool:
    return all(a.rsplit(":", 1)[0] in ("127.0.0.1", "[::1]") for a in addresses)


def test_default_daemon_and_its_clients_listen_only_on_loopback(
        tmp_path: Path, spawn_python: Callable[..., ChildProcess]) -> None:
    import kvpool

    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    log = tmp_path / "daemon.log"
    daemon = spawn_python(["-m", "kvpool.cli.server", "--pool.data_dir", str(tmp_path / "d"),
                           "--tiers.cxl.path", str(tmp_path / "d" / "cxl"), "--tiers.dram.mlock", "false",
                           "--master.listen", master, "--metrics.port", str(free_tcp_port())],
                          log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=60)
    config = Config.load({"pool": {"name": "w", "data_dir": str(tmp_path / "w")},
                          "tiers": {"dram": {"capacity": "4MiB", "mlock": False}, "cxl": {"capacity": 0},
                                    "nvme": {"capacity": 0}},
                          "master": {"listen": master}})
    pool = kvpool.connect(master, config=config)
    try:
        kv = np.ones(SHAPE, np.float16)
        pool.put(b"loopback-key", kv, durable=True)  # the daemon pulls a copy from this process
        located = pool.cluster.master.locate(b"loopback-key")
        theirs = [r for r in located.replicas[0] if r["node_id"] != pool.node_id]
        assert theirs, located
        # and this process pulls it back from the daemon: UCX over TCP, UCX same-host, plain TCP
        for transport, tcp_pull_max in (("tcp", 0), ("auto", 0), ("auto", 1 << 20)):
            reader = ReplicaReader(local_host_id(), transport=transport, pull_timeout_s=5.0,
                                   tcp_pull_max=tcp_pull_max)
            try:
                got = reader.read(b"loopback-key", checked_replicas(theirs, reader.counters), None, None, out_view)
                assert got is not None and np.array_equal(got, kv), reader.counters
                assert (reader.pulls.tcp is not None and reader.pulls.tcp.pulls == 1) == bool(tcp_pull_max)
            finally:
                reader.close()
        daemon_listens, own_listens = listeners_of(daemon.pid), listeners_of(os.getpid())
        assert daemon_listens and only_loopback(daemon_listens), daemon_listens
        assert only_loopback(own_listens), own_listens
    finally:
        pool.close()
        daemon.stop()


@pytest.mark.slow
def test_pulls_need_the_token_the_master_issued(cluster: Any) -> None:
    cluster.start_master()
    cluster.start_node("storage")
    writer = cluster.connect("writer")
    try:
        kv = np.arange(np.prod(SHAPE), dtype=np.float16).reshape(SHAPE)
        writer.put(b"token-key", kv, durable=True)  # replication pulls carry the writer's token
        replicas = cluster.client.locate(b"token-key").replicas[0]
        by_node = {r["node_id"]: r for r in replicas}
        stored = next(r for nid, r in by_node.items() if nid != writer.node_id)
        assert len(stored["token"]) == 24
        key = default_cluster_key()
        cases = {
            "no token": b"",
            "another node's token": by_node[writer.node_id]["token"],
            "another key's token": key.mint_token(b"other-key", stored["node_id"]),
            "expired": key.mint_token(b"token-key", stored["node_id"], now=time.time() - 3600),
            "garbage": os.urandom(24),
        }
        for transport, tcp_pull_max in (("tcp", 0), ("auto", 0), ("tcp", 1 << 20)):  # the last: plain TCP
            reader = ReplicaReader(local_host_id(), transport=transport, pull_timeout_s=5.0,
                                   tcp_pull_max=tcp_pull_max)
            try:
                got = reader.read(b"token-key", checked_replicas([stored], reader.counters), None, None, out_view)
                assert got is not None and np.array_equal(got, kv)
                for what, token in cases.items():
                    assert reader.read(b"token-key", checked_replicas([{**stored, "token": token}], reader.counters),
                                       None, None, out_view) is None, what
                assert reader.counters["miss_unauthorized"] == len(cases), reader.counters
                peer = NodeAddress.decode(stored["address"]).peer
                assert peer.tcp_port
                with pytest.raises(errors.AuthenticationError):
                    reader.pulls.ucx.pull_into(peer, b"token-key", (0, 2), bytearray(1 << 16), timeout_s=5)
                if reader.pulls.tcp is not None:
                    assert reader.pulls.tcp.pulls == 1 and reader.pulls.tcp.failures == len(cases)
                    with pytest.raises(errors.AuthenticationError):
                        reader.pulls.tcp.pull_into(peer, b"token-key", (0, 2), bytearray(1 << 16), timeout_s=5)
            finally:
                reader.close()
        # the location cache drops a replica whose token expired: locate again
        remembered = ReplicaReader(local_host_id(), pull_timeout_s=5.0, location_cache_size=8)
        try:
            stale = {**stored, "token": key.mint_token(b"token-key", stored["node_id"], now=time.time() - 29.5)}
            checked = checked_replicas([stale], remembered.counters)
            assert remembered.read(b"token-key", checked, None, None, out_view) is not None
            assert remembered.read_cached(b"token-key", None, None, out_view) is None
            assert remembered.counters["location_cache_expired"] == 1
        finally:
            remembered.close()
        # the neighbours thread survives garbage from the master
        for garbage in ({"nodes": [1, 2, {"x": None}]}, None):
            asked: list[int] = []

            def stats(*_: Any, garbage: Any = garbage, asked: list[int] = asked, **__: Any) -> Any:
                asked.append(1)
                return garbage

            writer.cluster.master.stats = stats  # type: ignore[method-assign]
            wait_for(lambda asked=asked: len(asked) >= 2, 10, "the neighbours thread to read it twice")
        assert writer.cluster._neighbours_thread is not None and writer.cluster._neighbours_thread.is_alive()
    finally:
        writer.close()


@pytest.fixture
def reader(tmp_path: Path) -> Any:
    shared = tmp_path / "shm"
    shared.mkdir()
    reader = ReplicaReader(local_host_id(), transport="tcp", pull_timeout_s=2.0, allowed_dirs=[str(shared)])
    yield reader, shared
    reader.close()


def test_garbage_from_the_master_is_a_miss_never_an_exception(reader: Any, tmp_path: Path) -> None:
    reader, shared = reader
    key = b"garbage-key"
    header = ObjectHeader.unpack(encode(np.zeros(SHAPE, np.float16), key))
    os.mkfifo(shared / "fifo")
    outside = tmp_path / "outside"
    outside.write_bytes(b"\0" * 8192)
    (shared / "link").symlink_to(outside)
    (shared / "dir").mkdir()
    (shared / "short").write_bytes(b"x")
    address = NodeAddress(PeerAddress("127.0.0.1", 0, b"", reader.host_id), "tcp://127.0.0.1:1").encode()
    good = {"node_id": "n1", "address": address, "host_id": reader.host_id, "tier": "cxl",
            "spec": header.spec.to_wire(), "header_sum": header.checksum(), "token": b"",
            "location": {"path": str(shared / "fifo"), "offset": 0}}

    def loc(**fields: Any) -> dict[str, Any]:
        return {**good, "location": {**good["location"], **fields}}

    bad_addresses = ["not json", json.dumps({"ucx": ["127.0.0.1", 1], "worker": "!!!", "host_id": "",
                                             "control": ""}),
                     json.dumps({"ucx": ["127.0.0.1", "x"], "worker": "", "host_id": "", "control": ""}),
                     json.dumps({"ucx": ["127.0.0.1", 1, 2], "worker": "", "host_id": "", "control": ""}),
                     json.dumps({"ucx": ["127.0.0.1", 1e300], "worker": "", "host_id": "", "control": ""}),
                     json.dumps({"ucx": [None, 1], "worker": "", "host_id": "", "control": ""}),
                     json.dumps({"ucx": ["h", 1], "worker": "AAAA", "host_id": "", "control": "",
                                 "arena": "x"}),
                     json.dumps([1, 2]), "[" * 100000, 5, None, b"bytes"]
    replicas: list[Any] = [
        good, loc(path=str(shared / "link")), loc(path=str(outside)), loc(path=str(shared / "dir")),
        loc(path=str(shared / "short")), loc(path=str(shared / ".." / "outside")), loc(path="/etc/passwd"),
        loc(offset=-1), loc(offset=2 ** 70), loc(offset=True), loc(offset="0"), loc(path=7), loc(path="a\0b"),
        loc(instance=[1]), {**good, "location": [1, 2]}, {**good, "location": "str"}, {**good, "location": 5},
        {**good, "header_sum": "str"}, {**good, "header_sum": -1}, {**good, "header_sum": 1 << 64},
        {**good, "header_sum": None}, {**good, "spec": [1, 2]}, {**good, "spec": ["float16", 0, 1, 1, 1]},
        {**good, "spec": "x"},
        {**good, "token": "str"}, {**good, "token": b"t" * 1000}, {**good, "node_id": 5},
        {**good, "host_id": None}, {**good, "tier": 3},
        *[{k: v for k, v in good.items() if k != missing} for missing in ("node_id", "address", "header_sum", "spec")],
        *[{**good, "address": a, "location": {}} for a in bad_addresses],
        None, 5, "x", [], {},
    ]
    results: list[Any] = []

    def run() -> None:
        for one in replicas:
            results.append(reader.read(key, checked_replicas([one], reader.counters), None, None, out_view))
        for many in ({"a": 1}, "str", 7, [None, 1.5], replicas):
            results.append(reader.read(key, checked_replicas(many, reader.counters), None, None, out_view))
        for stats in (None, [], {"nodes": []}, {"nodes": {"a": 5}}, {"nodes": {5: {}}},
                      *[{"nodes": {"n1": {"alive": True, "host_id": reader.host_id, "address": r.get("address")}}}
                        for r in replicas if isinstance(r, dict)],
                      *[{"nodes": {"n2": {"alive": True, "host_id": reader.host_id, "address": NodeAddress(
                          PeerAddress("127.0.0.1", 0), "", {"path": p, "instance": "00"}).encode()}}}
                        for p in (str(shared / "fifo"), str(shared / "link"), str(outside), "/etc/passwd")]):
            reader.arenas.refresh(stats)  # type: ignore[arg-type]
            results.append(alive_nodes_of(stats))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)  # a FIFO opened blocking would hang here
    assert not thread.is_alive(), "a read hung on a crafted record"
    n = len(replicas) + 5
    assert len(results) == n + len(results[n:]) and all(r is None for r in results[:n]), results[:n]
    assert not reader.arenas.mapped()
    assert reader.counters["bad_records"] > 0 and reader.counters["refused_paths"] > 0, reader.counters
    assert alive_nodes_of({"nodes": {"a": {"alive": True}, "b": {"alive": 1}, "c": 5}}) == {"a"}
