"""No descriptor or thread of a storage node grows with the number of clients that came and went.

A real master and one storage node (``kvpool-server``), and 200 short-lived clients in this
process (150 one after another, then 50 in five concurrent streams), each doing a durable
put (the storage node pulls the copy from the client: a pooled TCP pull connection there)
and a get of the previous client's key (pulled from the storage node), then closing. After
a bounded wait the storage node holds at most 10 descriptors and 10 threads more than before
the first client, and no socket of its is left in CLOSE-WAIT.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvpool
from kvpool.config import Config
from tests.conftest import ChildProcess, wait_for
from tests.test_cluster import HEARTBEAT_MS, Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SEQUENTIAL = 150
CONCURRENT_STREAMS = 5
PER_STREAM = 10
SHAPE = (2, 2, 4, 2, 16)  # 1 KiB of float16: 200 durable copies fit any nvme tier


def key_of(i: int) -> bytes:
    return b"churn-key-%04d" % i


def content(i: int) -> np.ndarray:
    return np.random.default_rng(7000 + i).standard_normal(SHAPE).astype(np.float16)


def client_config(cluster: Cluster, name: str) -> Config:
    data_dir = cluster.tmp_path / "clients" / name
    return Config.load({
        "pool": {"name": name, "data_dir": str(data_dir)},
        "tiers": {"dram": {"capacity": "1MiB", "mlock": False},
                  "cxl": {"capacity": "1MiB", "path": f"{data_dir}/cxl"}},
        "master": {"listen": cluster.master_address, "heartbeat_ms": HEARTBEAT_MS, "request_timeout_s": 5.0},
        "node": {"pull_timeout_s": 5.0},
    })


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def close_wait(pid: int) -> list[str]:
    """The node's TCP sockets in CLOSE-WAIT (their peer closed, the node did not)."""
    out = subprocess.run(["ss", "-tnpH", "state", "close-wait"], capture_output=True, text=True, timeout=30).stdout
    return [line for line in out.splitlines() if f"pid={pid}," in line]


def test_descriptors_and_threads_of_a_storage_node_stay_bounded_under_client_churn(
        tmp_path: Path, spawn_python: Callable[..., ChildProcess]) -> None:
    cluster = Cluster(tmp_path, spawn_python)
    try:
        cluster.start_master()
        storage = cluster.start_node("store")
        pid = storage.pid
        wait_for(lambda: len(cluster.alive_nodes()) == 1, 10, "the storage node to register")
        time.sleep(1.0)  # let its start-up settle (threads, sockets) before counting
        before = descriptors(pid), threads(pid)
        errors: list[str] = []

        def one_client(i: int) -> None:
            try:
                with kvpool.connect(cluster.master_address, config=client_config(cluster, f"c{i}")) as pool:
                    pool.put(key_of(i), content(i), durable=True)
                    # A key of a client that has closed: only the storage node holds it now.
                    other = i - 1 if i < SEQUENTIAL else i - SEQUENTIAL
                    if i:
                        got = pool.get(key_of(other))
                        if got is None or not np.array_equal(got, content(other)):
                            errors.append(f"client {i}: get of key {other} returned {got!r:.60}")
            except Exception as exc:  # reported below, with every other failure
                errors.append(f"client {i}: {type(exc).__name__}: {exc}")

        started = time.monotonic()
        for i in range(SEQUENTIAL):
            one_client(i)
        peak = descriptors(pid), threads(pid)

        def stream(first: int) -> None:
            for i in range(first, first + PER_STREAM):
                one_client(i)

        streams = [threading.Thread(target=stream, args=(SEQUENTIAL + s * PER_STREAM,))
                   for s in range(CONCURRENT_STREAMS)]
        for t in streams:
            t.start()
        for t in streams:
            t.join(300)
        churn_s = time.monotonic() - started
        assert not errors, errors[:10]
        with kvpool.connect(cluster.master_address, config=client_config(cluster, "check")) as pool:
            n = SEQUENTIAL + CONCURRENT_STREAMS * PER_STREAM
            assert all(np.array_equal(pool.get(key_of(i)), content(i)) for i in range(0, n, 17))

        def settled() -> bool:
            return descriptors(pid) <= before[0] + 10 and threads(pid) <= before[1] + 10 and not close_wait(pid)

        waited = time.monotonic()
        try:
            wait_for(settled, 30, "the storage node's descriptors and threads to settle", interval_s=0.5)
        except AssertionError:
            raise AssertionError(f"before {before}, after 150 clients {peak}, now "
                                 f"{(descriptors(pid), threads(pid))}; CLOSE-WAIT: {close_wait(pid)[:5]} "
                                 f"({len(close_wait(pid))})") from None
        print(f"storage node descriptors/threads: before {before}, after {SEQUENTIAL} clients {peak}, "
              f"settled {(descriptors(pid), threads(pid))} {time.monotonic() - waited:.1f} s after the last "
              f"client; {n} clients in {churn_s:.1f} s")
        assert storage.popen.poll() is None
    finally:
        cluster.client.close()
