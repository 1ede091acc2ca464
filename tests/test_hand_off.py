"""A closing client's hand-off (``node.hand_off_s``, on in the vLLM connector's default pool):
a storage node on its host keeps what the client held, so a process started after it still
finds every object, in place from the storage node's arena. Real master, storage node and
clients; every process stopped at the end."""

from __future__ import annotations

import numpy as np
import pytest

import kvpool
from tests.cluster_actor import content, key_of, small_config
from tests.conftest import wait_for
from tests.test_cluster import HEARTBEAT_MS, Cluster, node_config
from tests.test_durable import node_id_from_log

pytestmark = pytest.mark.timeout(120)

KEYS = 8  # 256 KiB objects: all fit the storage node's 4 MiB arena


def engine(cluster: Cluster, name: str, hand_off_s: float) -> kvpool.Pool:
    """A client laid out as an engine's default pool: no dram, every object in its cxl arena."""
    config = small_config(cluster.master_address, name, str(cluster.tmp_path / name), HEARTBEAT_MS, dram="0")
    config.set("node.hand_off_s", hand_off_s, origin="test")
    return kvpool.connect(cluster.master_address, config=config)


def start_store(cluster: Cluster, in_place: bool):
    """The storage node; ``in_place``: it may map the clients' arenas (tiers.cxl.shared_dirs), so
    a rescue can read a dead client's arena."""
    if not in_place:
        return cluster.start_node("store")
    data_dir = cluster.tmp_path / "store"
    config = cluster.tmp_path / "store.toml"
    config.write_text(node_config("store", data_dir, cluster.master_address).replace(
        '[tiers.cxl]\n', f'[tiers.cxl]\nshared_dirs = "{cluster.tmp_path}"\n'))
    log = cluster.tmp_path / "store.log"
    return cluster.spawn(["-m", "kvpool.cli.server", "--role", "node", "--config", str(config)],
                         log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=30)


@pytest.mark.parametrize("may_map", [True, False], ids=["arena-mappable", "arena-elsewhere"])
def test_a_closing_client_hands_its_objects_to_the_storage_node_beside_it_verified(
        cluster: Cluster, may_map: bool) -> None:
    """Pulled from the live client either way (a rescue reads arenas: below)."""
    cluster.start_master()
    store = start_store(cluster, may_map)
    wait_for(lambda: len(cluster.alive_nodes()) == 1, 10, "the storage node to register")
    store_id = next(n for n in cluster.alive_nodes() if n.startswith(node_id_from_log(store)))

    first = engine(cluster, "engine-a", hand_off_s=10.0)
    try:
        first.put(key_of(0), content(0), durable=True)  # the storage node holds this one already
        for i in range(1, KEYS):
            first.put(key_of(i), content(i))
        # One object goes bad in the engine's arena after it was stored: its checksums no
        # longer match, so the storage node must refuse it (a miss later, never these bytes).
        tier, extent, header = first.local.manager.describe(key_of(3))
        assert tier.name == "cxl"
        view = tier.view(extent, header.spec.header_nbytes, header.spec.payload_nbytes)
        np.asarray(view)[100] ^= 0xFF
    finally:
        first.close()  # the hand-off runs here

    counters = cluster.node_stats(store_id)["counters"]
    assert counters["adopt_requests"] == 1
    assert counters["adopted_objects"] == KEYS - 2  # not key 0 (held already), not key 3 (corrupt)
    assert counters["adopt_failures"] == 1
    assert counters.get("rescued_objects", 0) == 0  # pulled: a live client's arena is never read here
    # The engine is gone; the storage node is now the one holder of every object it kept.
    wait_for(lambda: len(cluster.alive_nodes()) == 1, 10, "the engine to leave")
    holders = {i: {r["node_id"] for r in cluster.client.locate(key_of(i), lease=False).replicas[0] or []}
               for i in range(KEYS)}
    assert holders == {i: set() if i == 3 else {store_id} for i in range(KEYS)}

    later = engine(cluster, "engine-b", hand_off_s=0.0)
    try:
        for i in range(KEYS):
            got = later.get(key_of(i))
            if i == 3:
                assert got is None
            else:
                assert got is not None and np.array_equal(got, content(i)), f"key {i}"
        remote = later.stats()["remote"]
        # In place from the storage node's arena, found through its shared index: no pull.
        assert remote["hits_same_host"] == KEYS - 1, remote
        assert remote["tcp_pull_client"]["pulls"] == remote["pull_client"]["pulls"] == 0, remote
    finally:
        later.close()


def test_a_client_without_a_hand_off_takes_its_objects_with_it_and_one_with_no_storage_node_closes_at_once(
        cluster: Cluster) -> None:
    cluster.start_master()
    alone = engine(cluster, "engine-alone", hand_off_s=10.0)
    alone.put(key_of(0), content(0))
    alone.close()  # no storage node on this host: nothing to wait for
    assert cluster.client.lookup([key_of(0)]) == 0

    store = cluster.start_node("store")
    wait_for(lambda: len(cluster.alive_nodes()) == 1, 10, "the storage node to register")
    store_id = next(n for n in cluster.alive_nodes() if n.startswith(node_id_from_log(store)))
    plain = engine(cluster, "engine-plain", hand_off_s=0.0)
    plain.put(key_of(1), content(1))
    assert cluster.client.lookup([key_of(1)]) == 1
    plain.close()
    wait_for(lambda: cluster.client.lookup([key_of(1)]) == 0, 10, "the key to leave with its holder")
    assert cluster.node_stats(store_id)["counters"].get("adopt_requests", 0) == 0


def test_a_hand_off_within_no_time_sends_nothing_and_one_repeated_finds_everything_held(cluster: Cluster) -> None:
    cluster.start_master()
    store = cluster.start_node("store")
    wait_for(lambda: len(cluster.alive_nodes()) == 1, 10, "the storage node to register")
    store_id = next(n for n in cluster.alive_nodes() if n.startswith(node_id_from_log(store)))
    client = engine(cluster, "engine-a", hand_off_s=10.0)
    try:
        for i in range(KEYS):
            client.put(key_of(i), content(i))
        done = client.cluster.hand_off(0.0)  # no time at all: nothing is sent
        assert done["adopted"] == 0 and cluster.node_stats(store_id)["counters"].get("adopt_requests", 0) == 0
        done = client.cluster.hand_off(10.0)
        assert (done["adopted"], done["held"], done["failed"], done["left"]) == (KEYS, 0, 0, 0)
        assert done["target"] == store_id
        again = client.cluster.hand_off(10.0)  # the storage node holds them all now
        assert (again["adopted"], again["held"]) == (0, KEYS)
    finally:
        client.close()


@pytest.mark.parametrize("hand_off", [True, False], ids=["asked-for", "not-asked-for"])
def test_a_killed_clients_arena_is_rescued_by_the_storage_node_on_its_host_when_it_asked_for_a_hand_off(
        cluster: Cluster, hand_off: bool) -> None:
    """``kill -9`` of a client whose objects live in its arena: no hand-off ran. Once the master
    declares it dead, it has the storage node on its host read the objects out of the dead
    client's arena (checked against the header checksums the master indexed, every layer
    against its header) and keep them: a reader then gets every one, exact. Only for a client
    that asked for a hand-off (``node.hand_off_s``); any other's objects go with it."""
    cluster.start_master()
    store = start_store(cluster, in_place=True)
    wait_for(lambda: len(cluster.alive_nodes()) == 1, 10, "the storage node to register")
    store_id = next(n for n in cluster.alive_nodes() if n.startswith(node_id_from_log(store)))
    writer = cluster.start_actor("writer", "writer", "--keys", str(KEYS), "--dram", "0",
                                 "--hand-off-s", "3" if hand_off else "0")
    assert cluster.client.lookup([key_of(i) for i in range(KEYS)]) == KEYS
    writer.kill()  # SIGKILL: its close (and hand-off) never runs; its arena file stays behind
    if hand_off:
        wait_for(lambda: cluster.client.stats()["counters"]["rescues_done"] == 1, 20, "the rescue")
        counters = cluster.node_stats(store_id)["counters"]
        assert counters["rescued_objects"] == counters["adopted_objects"] == KEYS, counters
        assert cluster.client.stats()["counters"]["rescued_objects"] == KEYS
        reader = engine(cluster, "reader", hand_off_s=0.0)
        try:
            for i in range(KEYS):
                got = reader.get(key_of(i))
                assert got is not None and np.array_equal(got, content(i)), f"key {i}"
        finally:
            reader.close()
    else:
        wait_for(lambda: cluster.client.stats()["counters"]["nodes_dead"] == 1, 20, "the writer declared dead")
        assert cluster.client.lookup([key_of(0)]) == 0
        assert cluster.client.stats()["counters"]["rescues_planned"] == 0
        assert cluster.node_stats(store_id)["counters"].get("adopt_requests", 0) == 0
