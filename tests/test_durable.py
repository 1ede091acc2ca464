"""Durable puts over real processes: storage nodes only, nvme, re-replication, restarts,
clean departures and malformed master addresses. Every process is stopped at the end."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvpool
from kvpool import errors
from kvpool.cluster.node import durable_log
from kvpool.cluster.wire.master_client import MasterClient
from tests.cluster_actor import content, key_of
from tests.conftest import REPO_ROOT, wait_for
from tests.test_cluster import HEARTBEAT_MS, Cluster, node_config

pytestmark = pytest.mark.timeout(180)

FORGET_S = 1.5
MiB = 1 << 20
KEYS = 3


def start_master(cluster: Cluster, log_name: str = "master.log"):
    cluster.master = cluster.spawn(
        ["-m", "kvpool.cli.server", "--role", "master", "--master.listen", cluster.master_address,
         "--master.heartbeat_ms", str(HEARTBEAT_MS), "--master.dead_after_missed", "3",
         "--master.forget_nodes_after_s", str(FORGET_S)],
        log_path=cluster.tmp_path / log_name,
        ready=lambda: cluster.client.ping(timeout_s=0.5), timeout_s=30)
    return cluster.master


def node_id_from_log(child) -> str:
    """The id a storage node logged when it registered (8 hex characters)."""
    for line in child.output().splitlines():
        if "registered with master" in line:
            return line.split("node ", 1)[1].split()[0]
    raise AssertionError("node did not log its registration")


def storage_holders(cluster: Cluster, key: bytes) -> dict[str, str]:
    """node id -> tier of each holder of ``key`` that is a storage node: "nvme" for a durable
    copy, whether the master lists it there or in the node's shared arena (cxl), where a
    storage node also keeps a durable copy it took while there is room (TierManager.share_copy;
    the nvme copy stays its backing)."""
    nodes = cluster.client.stats()["nodes"]
    located = cluster.client.locate(key, lease=False).replicas[0] or []
    return {r["node_id"]: "nvme" if r["tier"] == "cxl" else r["tier"] for r in located
            if nodes[r["node_id"]]["role"] == "storage"}


@pytest.mark.slow
def test_durable_copies_survive_writer_and_holder_loss_and_full_restart(cluster: Cluster) -> None:
    master = start_master(cluster)
    store_a = cluster.start_node("store-a")
    store_b = cluster.start_node("store-b")
    bystander = cluster.connect("bystander")  # an inference client: never a durable target
    try:
        wait_for(lambda: len(cluster.alive_nodes()) == 3, 10, "nodes to register")
        writer = cluster.start_actor("writer", "writer", "--keys", str(KEYS), "--durable", "--replicas", "2")
        writer_id = cluster.node_id_of(writer)
        a_id, b_id = (next(n for n in cluster.alive_nodes() if n.startswith(node_id_from_log(s)))
                      for s in (store_a, store_b))
        for i in range(KEYS):  # committed before put returned: two copies, both in nvme
            assert storage_holders(cluster, key_of(i)) == {a_id: "nvme", b_id: "nvme"}
            holders = {r["node_id"] for r in cluster.client.locate(key_of(i), lease=False).replicas[0]}
            assert bystander.node_id not in holders and writer_id in holders
        assert cluster.client.stats()["durable_keys"] == KEYS

        # A third storage node joins; the writer and one holder are killed (no goodbye).
        store_c = cluster.start_node("store-c")
        wait_for(lambda: len(cluster.alive_nodes()) == 5, 10, "third storage node to register")
        c_id = next(n for n in cluster.alive_nodes() if n.startswith(node_id_from_log(store_c)))
        writer.kill()
        store_a.kill()
        killed = time.monotonic()
        wait_for(lambda: all(storage_holders(cluster, key_of(i)) == {b_id: "nvme", c_id: "nvme"}
                             for i in range(KEYS)), 15, "the master to re-replicate onto the third node",
                 interval_s=0.05)
        restored_s = time.monotonic() - killed
        assert "re-replication: " in master.output()
        got = bystander.get(key_of(0))
        np.testing.assert_array_equal(got, content(0))

        # Every holder dies; storage nodes restart from their data dirs: nvme brings the keys back.
        store_b.kill()
        store_c.kill()
        wait_for(lambda: cluster.client.lookup([key_of(0)]) == 0, 5, "holders declared dead")
        cluster.start_node("store-b")
        cluster.start_node("store-c")
        wait_for(lambda: cluster.client.lookup([key_of(i) for i in range(KEYS)]) == KEYS, 10,
                 "durable keys registered again")
        for i in range(KEYS):
            np.testing.assert_array_equal(bystander.get(key_of(i)), content(i))  # bit-exact

        # A master restart: the storage nodes' records say which keys are durable.
        master.kill()
        start_master(cluster, "master-2.log")
        wait_for(lambda: cluster.client.stats()["durable_keys"] == KEYS, 10, "durability known again")
        print(f"re-replication restored the count {restored_s:.2f} s after kill -9 "
              f"(heartbeat {HEARTBEAT_MS} ms x 3 to detect)")
    finally:
        bystander.close()


@pytest.mark.slow
def test_replicas_are_checked_before_anything_is_copied_and_a_clean_close_is_a_departure(
        cluster: Cluster) -> None:
    master = start_master(cluster)
    cluster.start_node("store-a")
    cluster.start_node("store-b")
    pool = cluster.connect("client")
    node_id = pool.node_id
    try:
        wait_for(lambda: len(cluster.alive_nodes()) == 3, 10, "nodes to register")
        before = cluster.client.stats()
        with pytest.raises(errors.NotEnoughReplicasError, match="only 2 storage nodes"):
            pool.put(b"too-many", content(1), durable=True, replicas=3)
        with pytest.raises(errors.InvalidArgumentError):
            pool.put(b"zero", content(1), durable=True, replicas=0)
        after = cluster.client.stats()
        assert not cluster.client.exists_many([b"too-many", b"zero"]) == [True, True]
        assert cluster.client.exists_many([b"too-many", b"zero"]) == [False, False]
        assert (after["replicas"], after["reservations"]) == (before["replicas"], before["reservations"])
        assert after["counters"]["commits"] == before["counters"]["commits"]
        assert pool.get(b"too-many") is None  # not even the local copy

        pool.put(b"ok", content(2), durable=True, replicas=2)
        assert len(storage_holders(cluster, b"ok")) == 2
    finally:
        pool.close()
    assert cluster.client.stats()["nodes"][node_id]["state"] == "left"  # at once, not after missed beats
    wait_for(lambda: node_id not in cluster.client.stats()["nodes"], FORGET_S + 3, "departed row to expire")
    log = master.output()
    assert f"node {node_id[:8]} " in log and "left:" in log
    assert "declared dead" not in log
    for line in log.splitlines():
        assert '"worker"' not in line and '{"ucx"' not in line, line  # no raw address blob


@pytest.mark.parametrize("make", [
    lambda: kvpool.connect("localhost:7700"),
    lambda: kvpool.connect("127.0.0.1:7700"),
    lambda: MasterClient("127.0.0.1:7700"),
    lambda: MasterClient(config=kvpool.Config.load({"master": {"listen": "tcp://127.0.0.1:99999"}})),
], ids=["connect-localhost", "connect-no-scheme", "master-client", "config-port"])
def test_malformed_master_address_is_a_config_error_at_once(make) -> None:
    with pytest.raises(errors.ConfigError, match="tcp://HOST:PORT"):  # checked before any socket
        make()


@pytest.mark.parametrize("argv", [
    ["-m", "kvpool.cli.server", "--role", "node", "--master.listen", "127.0.0.1:7700"],
    ["-m", "kvpool.cluster.master", "--listen", "localhost:7700"],
])
def test_malformed_master_address_stops_the_daemon_at_once(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    assert done.returncode == 2
    assert "tcp://HOST:PORT" in done.stdout + done.stderr


@pytest.mark.slow
def test_put_many_durable_by_config_is_one_placement_and_one_exchange_per_storage_node(cluster: Cluster) -> None:
    """``node.durable`` / ``node.replicas`` from the writer's config make put_many durable (the
    rule put follows); the batch costs one placement at the master and one replicate exchange
    per storage node however many keys it holds; the copies outlive the writer."""
    start_master(cluster)
    stores = [cluster.start_node("store-a"), cluster.start_node("store-b")]
    writer = cluster.connect("writer", node__durable=True, node__replicas=2)
    reader = None
    try:
        wait_for(lambda: len(cluster.alive_nodes()) == 3, 10, "nodes to register")
        store_ids = [next(n for n in cluster.alive_nodes() if n.startswith(node_id_from_log(s))) for s in stores]

        def counters() -> tuple[int, list[int], list[int]]:
            nodes = [cluster.node_stats(n)["counters"] for n in store_ids]
            return (cluster.client.stats()["counters"].get("placements", 0),
                    [c.get("replicate_requests", 0) for c in nodes], [c.get("replicated_objects", 0) for c in nodes])

        batch = 12
        keys = [b"batch-%02d" % i for i in range(batch)]
        before = counters()
        writer.put_many([(k, content(i)) for i, k in enumerate(keys)])  # durable: from the config
        placements, requests, copies = counters()
        assert placements - before[0] == 1
        assert [r - b for r, b in zip(requests, before[1])] == [1, 1]  # O(1) exchanges for 12 keys
        assert [c - b for c, b in zip(copies, before[2])] == [batch, batch]
        for key in keys:
            assert sorted(storage_holders(cluster, key).values()) == ["nvme", "nvme"]
        assert cluster.client.stats()["durable_keys"] == batch

        # An explicit durable=False overrides the config: stored and published, no copies.
        writer.put_many([(b"not-durable", content(99))], durable=False)
        assert counters()[0] == placements and storage_holders(cluster, b"not-durable") == {}
        # The same rule for one put: a replicas override, the config's durable.
        writer.put(b"single", content(50), replicas=1)
        assert len(storage_holders(cluster, b"single")) == 1
        # A key given twice in a batch: the later object, copied once to each node.
        writer.put_many([(b"dup", content(60)), (b"dup", content(61))])
        assert sorted(storage_holders(cluster, b"dup").values()) == ["nvme", "nvme"]
        with pytest.raises(errors.InvalidArgumentError):
            writer.put_many([(b"bad", content(1))], replicas=0)
        assert cluster.client.exists_many([b"bad"]) == [False]

        writer.close()  # the writer's own copies go with it
        reader = cluster.connect("reader")
        for i, key in enumerate(keys):
            np.testing.assert_array_equal(reader.get(key), content(i))
        assert reader.get(b"not-durable") is None
        np.testing.assert_array_equal(reader.get(b"dup"), content(61))
    finally:
        writer.close()
        if reader is not None:
            reader.close()


def test_durable_copies_follow_one_rule() -> None:
    from kvpool.client import durable_copies
    from kvpool.config import Config

    node = Config.load({}).node
    assert (node.durable, durable_copies(node, None, None), durable_copies(node, True, None)) == (False, 0, 1)
    assert durable_copies(node, True, 3) == 3 and durable_copies(node, None, 3) == 0
    durable = Config.load({"node": {"durable": True, "replicas": 2}}).node
    assert durable_copies(durable, None, None) == 2 and durable_copies(durable, False, None) == 0
    assert durable_copies(durable, None, 1) == 1
    for bad in ({"replicas": 0}, {"replicas": True}, {"durable": "yes"}):
        with pytest.raises(errors.InvalidArgumentError):
            durable_copies(durable, bad.get("durable"), bad.get("replicas"))  # type: ignore[arg-type]


def test_a_full_disk_refuses_new_durable_copies_and_loses_no_acknowledged_one(
        cluster: Cluster, tmpfs: Callable[[str], Path]) -> None:
    """A storage node alone on a real 48 MiB filesystem (its nvme tier configured at 64 MiB),
    durable puts of 256 KiB: the disk is filled by another file for a while, then freed, then the
    puts go on past what the filesystem holds. Puts fail with a typed error while there is no
    room (never by evicting an acknowledged copy); the tier keeps tiers.nvme.headroom free for
    durable.log; with the writer gone, every acknowledged put is read back, exact bytes, from
    the storage node, and it dropped no durable copy."""
    disk = tmpfs("48m")
    start_master(cluster)
    config = cluster.tmp_path / "store.toml"
    config.write_text(node_config("store", cluster.tmp_path / "store", cluster.master_address).replace(
        'capacity = "16MiB"\nsegment_size = "8MiB"',
        f'capacity = "64MiB"\nsegment_size = "2MiB"\npath = "{disk}/nvme"'))
    log = cluster.tmp_path / "store.log"
    store = cluster.spawn(["-m", "kvpool.cli.server", "--role", "node", "--config", str(config)],
                          log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=30)
    writer = cluster.connect("writer")
    acked: list[int] = []
    refused: dict[int, str] = {}

    def put(i: int) -> None:
        try:
            writer.put(key_of(i), content(i), durable=True)
        except errors.KVPoolError as exc:  # typed, or the test fails here
            refused[i] = f"{type(exc).__name__}: {exc}"
        else:
            acked.append(i)

    try:
        wait_for(lambda: len(cluster.alive_nodes()) == 2, 10, "nodes to register")
        for i in range(40):
            put(i)
        assert acked == list(range(40)), refused
        filler = disk / "filler"
        with open(filler, "wb") as fh:  # another writer takes every byte left
            with contextlib.suppress(OSError):
                while True:
                    fh.write(b"\0" * MiB)
                    fh.flush()
        during = len(acked)
        for i in range(40, 60):
            put(i)
        assert len(refused) > 0, "the full disk refused nothing"
        filler.unlink()
        for i in range(60, 200):  # 35 MiB more: past what the filesystem holds
            put(i)
        assert len(acked) > during + 20 and any(i > 60 for i in refused), (len(acked), sorted(refused)[:5])
        assert any("DiskFull" in why or "PoolFull" in why or "room" in why for why in refused.values()), refused
        assert set(durable_log.read(disk / "nvme", 256)) >= {key_of(i) for i in acked}
    finally:
        writer.close()  # a clean leave: only the storage node's durable copies remain
    reader = cluster.connect("reader")
    try:
        wrong = [i for i in acked if not np.array_equal(reader.get(key_of(i)), content(i))]
        assert wrong == [], f"{len(wrong)} of {len(acked)} acknowledged durable puts lost: {wrong[:10]}"
    finally:
        reader.close()
    assert "durable copy of" not in store.output()  # no "durable copy ... dropped" warning
    print(f"{len(acked)} durable puts acknowledged, {len(refused)} refused typed, 0 lost")


def test_durable_log_compaction_keeps_exactly_the_copies_held(tmp_path: Path) -> None:
    """compact() rewrites durable.log to the given lines through a renamed new file: what read()
    returns after it is exactly those; a garbage or torn tail is gone with the rest."""
    for i in range(50):
        durable_log.append(tmp_path, key_of(i), 1 + i % 3)
    (tmp_path / "durable.log").open("ab").write(b"\xc3\x28 torn")
    held = {key_of(i): 1 + i % 3 for i in range(0, 50, 7)}
    durable_log.compact(tmp_path, held)
    assert durable_log.read(tmp_path, 256) == held
    assert sorted(p.name for p in tmp_path.iterdir()) == ["durable.log"]
    durable_log.compact(tmp_path, {})
    assert durable_log.read(tmp_path, 256) == {} and (tmp_path / "durable.log").stat().st_size == 0
