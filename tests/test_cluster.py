"""The cluster end to end: a master, storage nodes, writers and readers, each a
real process on 127.0.0.1, always stopped at the end of the test."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool import errors
from kvpool.cluster.node.checks import Speculation
from kvpool.cluster.node.located import checked_replicas
from kvpool.cluster.node.reader import ReplicaReader
from kvpool.cluster.node.server import NodeAddress
from kvpool.cluster.wire.control import control_call
from kvpool.cluster.wire.master_client import MasterClient
from kvpool.objformat import ObjectSpec
from kvpool.transport import local_host_id
from tests.cluster_actor import content, key_of, small_config
from tests.conftest import ChildProcess, default_cluster_key, free_tcp_port, wait_for
from tests.test_metrics import sample, scrape

HEARTBEAT_MS = 200
LAYER_NBYTES = 2 * 32 * 4 * 64 * 2  # one layer of tests.cluster_actor.SHAPE, float16

pytestmark = pytest.mark.timeout(180)


def node_config(name: str, data_dir: Path, master_address: str, host: str | None = None) -> str:
    """The TOML of a small storage node (``host``: node.host; None leaves it to the default)."""
    return (f'[pool]\nname = "{name}"\ndata_dir = "{data_dir}"\n'
            f'[tiers.dram]\ncapacity = "4MiB"\nmlock = false\n'
            f'[tiers.cxl]\ncapacity = "4MiB"\npath = "{data_dir}/cxl"\n'
            f'[tiers.nvme]\ncapacity = "16MiB"\nsegment_size = "8MiB"\n'
            f'[master]\nlisten = "{master_address}"\nheartbeat_ms = {HEARTBEAT_MS}\n'
            + (f'[node]\nhost = "{host}"\n' if host else ""))


class Cluster:
    def __init__(self, tmp_path: Path, spawn: Callable[..., ChildProcess]) -> None:
        self.tmp_path = tmp_path
        self.spawn = spawn
        self.port = free_tcp_port()
        self.master_address = f"tcp://127.0.0.1:{self.port}"
        self.client = MasterClient(self.master_address, request_timeout_s=2.0)
        self.master: ChildProcess | None = None

    def start_master(self, dead_after_missed: int = 3) -> ChildProcess:
        self.master = self.spawn(
            ["-m", "kvpool.cli.server", "--role", "master", "--master.listen", self.master_address,
             "--master.heartbeat_ms", str(HEARTBEAT_MS), "--master.dead_after_missed", str(dead_after_missed)],
            ready=lambda: self.client.ping(timeout_s=0.5), timeout_s=30)
        return self.master

    def start_node(self, name: str) -> ChildProcess:
        data_dir = self.tmp_path / name
        config = self.tmp_path / f"{name}.toml"
        config.write_text(node_config(name, data_dir, self.master_address))
        log = self.tmp_path / f"{name}.log"
        return self.spawn(["-m", "kvpool.cli.server", "--role", "node", "--config", str(config)],
                          log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=30)

    def start_actor(self, role: str, name: str, *args: str) -> ChildProcess:
        log = self.tmp_path / f"{name}.log"
        ready = (lambda: "READY" in log.read_text()) if role == "writer" else None
        return self.spawn(["-m", "tests.cluster_actor", role, "--master", self.master_address, "--name", name,
                           "--data-dir", str(self.tmp_path / name), "--heartbeat-ms", str(HEARTBEAT_MS), *args],
                          log_path=log, ready=ready, timeout_s=40)

    def node_id_of(self, writer: ChildProcess) -> str:
        return writer.output().split("READY ", 1)[1].split()[0]

    def node_stats(self, node_id: str) -> dict:
        address = self.client.stats()["nodes"][node_id]["address"]
        return control_call(NodeAddress.decode(address).control, "stats", {}, timeout_s=5.0,
                            cluster_key=self.client.cluster_key)

    def alive_nodes(self) -> set[str]:
        return {nid for nid, n in self.client.stats()["nodes"].items() if n["alive"]}

    def connect(self, name: str, **settings: object) -> kvpool.Pool:
        """A client pool; ``settings``: dotted names with ``__`` for the dot (``node__port=0``)."""
        config = small_config(self.master_address, name, str(self.tmp_path / name), HEARTBEAT_MS)
        for setting, value in settings.items():
            config.set(setting.replace("__", "."), value, origin="test")
        return kvpool.connect(self.master_address, config=config)


def reader_result(child: ChildProcess) -> dict:
    wait_for(lambda: child.popen.poll() is not None, 60, "reader to finish")
    assert child.popen.returncode == 0, child.output()
    return json.loads(child.output().strip().splitlines()[-1])


@pytest.mark.slow
def test_reader_pulls_exactly_the_layers_it_asks_for(cluster: Cluster) -> None:
    cluster.start_master()
    cluster.start_node("store-a")
    cluster.start_node("store-b")
    writer = cluster.start_actor("writer", "writer", "--keys", "3")
    holder = cluster.node_id_of(writer)
    before = cluster.node_stats(holder)["transfer"]["bytes_sent"]

    reader = cluster.connect("reader")
    try:
        assert reader.lookup([key_of(0), key_of(1), key_of(2), key_of(3)]) == 3
        got = reader.get(key_of(1), layers=range(2, 5))
        np.testing.assert_array_equal(got, content(1)[2:5])
        after = cluster.node_stats(holder)["transfer"]["bytes_sent"]
        assert after - before == 3 * LAYER_NBYTES  # exactly the payload of layers [2, 5)

        # A repeat get goes straight to the remembered holder: the master is not asked.
        asked = cluster.client.stats()["counters"]["key_hits"]
        np.testing.assert_array_equal(reader.get(key_of(1), layers=4), content(1)[4:5])
        assert reader.stats()["remote"]["location_cache_hits"] == 1
        assert cluster.client.stats()["counters"]["key_hits"] == asked
        out = np.empty((1,) + content(0).shape[1:], np.float16)
        assert reader.get(key_of(0), layers=7, out=out) is out
        np.testing.assert_array_equal(out, content(0)[7:8])
        assert reader.get(b"never-put") is None
        assert reader.exists_many([key_of(2), b"never-put"]) == [True, False]
        many = reader.get_many([key_of(0), b"never-put", key_of(2)], layers=range(0, 2))  # pulled together
        assert many[1] is None
        np.testing.assert_array_equal(many[0], content(0)[:2])
        np.testing.assert_array_equal(many[2], content(2)[:2])
        reader.delete(key_of(1))  # deleted everywhere: the remembered location is forgotten too
        assert reader.get(key_of(1)) is None
        outs = [np.empty((2,) + content(0).shape[1:], np.float16) for _ in range(2)]
        asked = cluster.client.stats()["counters"]["key_hits"]

        def without_master() -> int:  # reads of a remembered location or from the guessed last holder
            remote = reader.stats()["remote"]
            return int(remote.get("location_cache_hits", 0) + remote.get("speculative_hits", 0))

        hits = without_master()
        into = reader.get_many([key_of(0), key_of(2)], layers=range(3, 5), outs=outs)
        assert into[0] is outs[0] and into[1] is outs[1]
        np.testing.assert_array_equal(outs[0], content(0)[3:5])
        np.testing.assert_array_equal(outs[1], content(2)[3:5])
        # both were read before: pulled from where they were, the master not asked
        assert without_master() == hits + 2
        assert cluster.client.stats()["counters"]["key_hits"] == asked
    finally:
        reader.close()

    separate = cluster.start_actor("reader", "reader-process", "--keys", "3", "--layers", "0:8")
    result = reader_result(separate)
    assert (result["ok"], result["miss"], result["wrong"]) == (2, 1, 0)  # key 1 was deleted above


@pytest.mark.slow
def test_get_many_takes_a_layer_range_per_key_and_tells_each_result_as_its_pull_lands(cluster: Cluster) -> None:
    """``get_many`` with one layer range per key (each key once per layer group, group by
    group, as the vLLM connector asks) and ``landed``: each result is told once, verified, in
    the order the holder's pulls arrive over its TCP connection, each while the pulls behind it
    are still being read; a miss is told None; an error the callback raises comes out of the
    get_many after the pulls, and every key was still told."""
    cluster.start_master()
    holder = cluster.connect("holder")
    reader = cluster.connect("reader")
    try:
        for i in range(3):
            holder.put(key_of(i), content(i))
        keys = [key_of(i) for _ in range(4) for i in range(3)] + [b"never-put"]
        layers = [range(2 * g, 2 * g + 2) for g in range(4) for _ in range(3)] + [range(0, 2)]
        tcp = reader.cluster.reader.pulls.tcp
        assert tcp is not None
        told: list[tuple[int, np.ndarray | None, int]] = []
        before = tcp.pulls
        got = reader.get_many(keys, layers=layers, landed=lambda i, arr: told.append((i, arr, tcp.pulls - before)))
        assert [i for i, _, _ in told] == list(range(13))
        # each pull told before the client counted it done: the next ones were still to be read
        assert [pulled for _, _, pulled in told[:12]] == list(range(12))
        for i, layer in enumerate(layers[:12]):
            np.testing.assert_array_equal(got[i], content(i % 3)[layer.start:layer.stop])
            assert told[i][1] is got[i]
        assert got[12] is None and told[12][1] is None

        class Refused(Exception):
            pass

        def refuse(i: int, arr: np.ndarray | None) -> None:
            told.append((i, arr, 0))
            raise Refused(f"key {i}")

        told.clear()
        with pytest.raises(Refused, match="key 0"):
            reader.get_many(keys[:3], layers=layers[:3], landed=refuse)
        assert sorted(i for i, _, _ in told) == [0, 1, 2] and all(arr is not None for _, arr, _ in told)
    finally:
        reader.close()
        holder.close()


async def layers_of(pool: kvpool.PoolAPI, key: bytes, **kwargs: object) -> list[tuple[int, np.ndarray]]:
    return [(layer, arr.copy()) async for layer, arr in pool.iter_layers(key, **kwargs)]  # type: ignore[arg-type]


@pytest.mark.slow
def test_iter_layers_reads_local_and_remote_objects_through_one_pipeline(cluster: Cluster) -> None:
    cluster.start_master()
    writer = cluster.start_actor("writer", "writer", "--keys", "2")
    holder = cluster.node_id_of(writer)
    reader = cluster.connect("reader")
    try:
        before = cluster.node_stats(holder)["transfer"]["bytes_sent"]
        got = asyncio.run(layers_of(reader, key_of(1), layers=range(2, 6)))  # pulled layer by layer
        assert [layer for layer, _ in got] == [2, 3, 4, 5]
        for layer, arr in got:
            np.testing.assert_array_equal(arr, content(1)[layer])
        assert cluster.node_stats(holder)["transfer"]["bytes_sent"] - before == 4 * LAYER_NBYTES
        out = np.empty((2,) + content(0).shape[1:], np.float16)
        assert [layer for layer, _ in asyncio.run(layers_of(reader, key_of(0), layers=(6, 8), out=out))] == [6, 7]
        np.testing.assert_array_equal(out, content(0)[6:8])
        assert asyncio.run(layers_of(reader, b"never-put")) == []
        reader.put(b"local-key", content(5))  # held here: pinned, not pulled
        sent = cluster.node_stats(holder)["transfer"]["bytes_sent"]
        got = asyncio.run(layers_of(reader, b"local-key"))
        assert [layer for layer, _ in got] == list(range(content(5).shape[0]))
        np.testing.assert_array_equal(np.stack([arr for _, arr in got]), content(5))
        assert cluster.node_stats(holder)["transfer"]["bytes_sent"] == sent
        # every lease a layer-wise read took is given back (released in batches, moments later)
        wait_for(lambda: cluster.client.stats()["leases"] == 0, 5.0, "the read leases to be released")
    finally:
        reader.close()


def test_a_get_pulls_from_the_last_holder_and_uses_its_verified_answer_without_the_master(
        cluster: Cluster) -> None:
    """Speculative pulls (node.speculative_pulls, by default unconfirmed): a one-key get first
    pulls from the node it last pulled from, and uses that holder's answer when its header is
    whole, names the key, has the guessed spec and every layer matches it; the master is not
    asked. Anything else is a wasted guess, and the get locates the key as usual."""
    from kvpool.api import out_view

    cluster.start_master()
    a, b, reader = cluster.connect("holder-a"), cluster.connect("holder-b"), cluster.connect("reader")
    guesser = reader.cluster.reader  # type: ignore[attr-defined]

    def counter(name: str) -> int:
        return int(reader.stats()["remote"].get(name, 0))

    def master_hits() -> int:
        return int(cluster.client.stats()["counters"]["key_hits"])

    try:
        for i in range(4):
            a.put(key_of(i), content(i))
        for i in (10, 11, 12):
            b.put(key_of(i), content(i))
        np.testing.assert_array_equal(reader.get(key_of(0)), content(0))  # nothing to guess yet: located
        asked = master_hits()
        np.testing.assert_array_equal(reader.get(key_of(1)), content(1))  # guessed a: used as a answered
        out = np.empty((3,) + content(0).shape[1:], np.float16)
        assert reader.get(key_of(3), layers=range(2, 5), out=out) is out
        np.testing.assert_array_equal(out, content(3)[2:5])
        assert master_hits() == asked  # neither get asked the master
        assert counter("speculative_hits") == counter("speculative_unconfirmed") == 2
        _, text = scrape(reader.serve_metrics().address, "/metrics")
        assert sample(text, 'kvpool_speculative_pulls_total{outcome="used"}') == 2
        assert sample(text, 'kvpool_speculative_pulls_total{outcome="confirmed"}') == 0

        np.testing.assert_array_equal(reader.get(key_of(10)), content(10))  # on b only: a misses, located
        assert counter("speculative_wasted") == 1
        np.testing.assert_array_equal(reader.get(key_of(11)), content(11))  # b guessed now
        assert counter("speculative_unconfirmed") == 3

        # Put again on the guessed holder with other bytes: that holder's current version.
        b.delete(key_of(11))
        b.put(key_of(11), content(21))
        np.testing.assert_array_equal(reader.get(key_of(11)), content(21))

        # The holder's answer must be the asked key's, whole. Key 10's answer taken as an answer
        # for key 11 (its header names key 10), or with a flipped bit in a layer: wasted.
        guess = guesser.speculate(key_of(10), None, None)
        assert guess is not None
        guesser.run_proven(guess, None, out_view)
        assert guess.pulled and guess.proven
        np.testing.assert_array_equal(guess.arr, content(10))
        for damage in ("another key", "a flipped bit"):
            answer = Speculation(key_of(11) if damage == "another key" else key_of(10), guess.replica,
                                 guess.layer_range)
            assert answer.bind(guess.arr.copy(), out_view)
            answer.buf[:] = guess.buf
            answer.raw_header[:] = guess.raw_header
            answer.pulled = answer.proven = True
            if damage == "a flipped bit":
                answer.buf[LAYER_NBYTES + 5] ^= 1
            assert guesser.accept(answer) is None, damage
        assert counter("speculative_wasted") == 3
        np.testing.assert_array_equal(guesser.accept(guess), content(10))  # as it came: used

        # An out of the guessed size but another shape: the guess's request went out before out
        # was checked; its reply is dropped unread (the connection closed), and the get says
        # what is wrong with out.
        connects = guesser.pulls.tcp.connects
        with pytest.raises(errors.OutBufferError):
            reader.get(key_of(11), out=np.empty(content(11).shape[::-1], np.float16))
        assert counter("speculative_wasted") == 4
        np.testing.assert_array_equal(reader.get(key_of(11)), content(21))
        assert guesser.pulls.tcp.connects == connects + 1

        # Deleted through the reader itself while b still holds it: never guessed, a miss.
        assert key_of(12) in b.local.manager  # type: ignore[attr-defined]
        reader.delete(key_of(12))
        assert guesser.speculate(key_of(12), None, None) is None
        assert reader.get(key_of(12)) is None

        # Deleted by another process: b's copy may answer until b's heartbeat drops it, then a miss.
        assert cluster.client.delete([key_of(10)]) == [True]

        def gone() -> bool:
            got = reader.get(key_of(10))
            assert got is None or np.array_equal(got, content(10))  # the key's bytes until then
            return got is None

        wait_for(gone, 10, "another process's delete to reach the holder")
    finally:
        for pool in (a, b, reader):
            pool.close()


def test_get_many_pulls_the_whole_batch_from_the_last_holder_and_locates_only_what_it_did_not_answer(
        cluster: Cluster) -> None:
    """get_many guesses every key of a batch on the node the reader last pulled from (the
    LastHolder locator) and uses each answer of that holder, which proves the cluster key,
    whose header is whole, names the key, has the guessed spec and matches every layer: the
    master is not asked. The keys it did not answer so (held elsewhere, of another spec,
    deleted through this reader) are located together in one round trip, and each key's
    result is told once."""
    cluster.start_master()
    a, b, reader = cluster.connect("holder-a"), cluster.connect("holder-b"), cluster.connect("reader")

    def counter(name: str) -> int:
        return int(reader.stats()["remote"].get(name, 0))

    def master_asked() -> int:  # keys the master was asked to locate, found or not
        counters = cluster.client.stats()["counters"]
        return int(counters["key_hits"] + counters["key_misses"])

    two_layers = (2, *content(0).shape[1:])
    try:
        for i in range(6):
            a.put(key_of(i), content(i))
        for i in (10, 11):
            b.put(key_of(i), content(i))
        a.put(key_of(20), content(20, two_layers))
        np.testing.assert_array_equal(reader.get(key_of(0)), content(0))  # nothing to guess yet: located
        asked = master_asked()

        got = reader.get_many([key_of(i) for i in (1, 2, 3)], layers=range(2, 5))
        for i, arr in zip((1, 2, 3), got):
            np.testing.assert_array_equal(arr, content(i)[2:5])
        assert master_asked() == asked  # all three were a's answers, used as they came
        assert counter("speculative_hits") == counter("speculative_unconfirmed") == 3

        reader.delete(key_of(5))  # a keeps it until its next heartbeat; never guessed here
        keys = [key_of(4), key_of(10), key_of(20), key_of(5), key_of(11)]
        told: list[int] = []
        got = reader.get_many(keys, landed=lambda i, arr: told.append(i))
        np.testing.assert_array_equal(got[0], content(4))  # a's answer
        np.testing.assert_array_equal(got[1], content(10))  # a lacks it: located on b
        np.testing.assert_array_equal(got[2], content(20, two_layers))  # not the guessed spec: located
        assert got[3] is None  # deleted: not guessed, and the master says so
        np.testing.assert_array_equal(got[4], content(11))
        assert sorted(told) == list(range(len(keys)))  # each key told once, a miss included
        assert master_asked() == asked + 4  # one locate of the four keys a did not answer
        assert counter("speculative_hits") == 4
        assert counter("speculative_wasted") == 3  # 10, 20, 11 (5 was not pulled at all)
    finally:
        for pool in (a, b, reader):
            pool.close()


def test_a_confirmed_speculative_pull_is_used_only_when_the_master_names_that_holder_and_version(
        cluster: Cluster) -> None:
    """node.confirm_speculative: while ``locate`` travels, a get pulls from the node it last
    pulled from. The bytes count only when the master names that node with the same header
    checksum; otherwise the get goes on as if nothing had been guessed."""
    from kvpool.api import out_view

    cluster.start_master()
    a, b = cluster.connect("holder-a"), cluster.connect("holder-b")
    reader = cluster.connect("reader", node__confirm_speculative=True)

    def counter(name: str) -> int:
        return int(reader.stats()["remote"].get(name, 0))

    try:
        for i in range(4):
            a.put(key_of(i), content(i))
        b.put(key_of(10), content(10))
        other_spec = np.arange(2 * 2 * 32 * 4 * 64, dtype=np.float16).reshape(2, 2, 32, 4, 64)
        a.put(b"two-layers", other_spec)

        np.testing.assert_array_equal(reader.get(key_of(0)), content(0))  # nothing to guess yet
        assert counter("speculative_hits") == counter("speculative_wasted") == 0
        np.testing.assert_array_equal(reader.get(key_of(1)), content(1))  # guessed a: confirmed
        out = np.empty((3,) + content(0).shape[1:], np.float16)
        assert reader.get(key_of(3), layers=range(2, 5), out=out) is out
        np.testing.assert_array_equal(out, content(3)[2:5])
        assert counter("speculative_hits") == 2
        _, text = scrape(reader.serve_metrics().address, "/metrics")
        assert sample(text, 'kvpool_speculative_pulls_total{outcome="confirmed"}') == 2
        assert sample(text, 'kvpool_speculative_pulls_total{outcome="wasted"}') == 0
        asked = cluster.client.stats()["counters"]["key_hits"]
        np.testing.assert_array_equal(reader.get(key_of(1)), content(1))  # confirmed reads are remembered
        assert cluster.client.stats()["counters"]["key_hits"] == asked

        np.testing.assert_array_equal(reader.get(key_of(10)), content(10))  # on b only: a misses
        assert counter("speculative_wasted") == 1

        # Deleted at the master while a still holds it (until its next heartbeat): a miss, never a's bytes.
        np.testing.assert_array_equal(reader.get(key_of(1)), content(1))
        assert cluster.client.delete([key_of(2)]) == [True]
        assert reader.get(key_of(2)) is None
        assert counter("speculative_wasted") == 2

        # A version the master did not locate: pulled, then refused by its header checksum.
        key = key_of(1)
        [[located]] = reader.cluster.master.locate(key, lease=False).replicas  # type: ignore[attr-defined]
        a.delete(key)
        a.put(key, content(20))
        guess = reader.cluster.reader.speculate(key, None, None)
        assert guess is not None and guess.replica.node_id == a.node_id and guess.bind(None, out_view)
        reader.cluster.reader.run(guess, reader.cluster.node.cluster_key.mint_token(key, a.node_id))
        assert guess.pulled
        np.testing.assert_array_equal(guess.arr, content(20))  # the holder's bytes, unverified
        assert reader.cluster.reader.confirm(guess, checked_replicas([located], reader.cluster.reader.counters)) is None
        assert counter("speculative_wasted") == 3
        np.testing.assert_array_equal(reader.get(key), content(20))

        # Guesses kept missing (3 wasted against 2 confirmed): no more guessing for a while, and
        # an object of another spec is read as located.
        np.testing.assert_array_equal(reader.get(b"two-layers"), other_spec)
        assert counter("speculative_wasted") == 3 and counter("speculative_hits") == 2
    finally:
        for pool in (a, b, reader):
            pool.close()


def test_a_guess_pulled_over_ucx_is_used_only_once_the_master_confirms_it(cluster: Cluster) -> None:
    """A UCX endpoint proves nothing about who answers (a TCP pull server proves it holds the
    cluster key): with every pull over UCX (node.tcp_pull_max = 0) a guess always waits for
    the master's confirmation."""
    cluster.start_master()
    holder = cluster.connect("holder", node__tcp_pull_max=LAYER_NBYTES)  # (its first put starts its UCX)
    reader = cluster.connect("reader", node__tcp_pull_max=0)
    try:
        for i in range(3):
            holder.put(key_of(i), content(i))
        ucx_published(cluster, holder)
        asked = cluster.client.stats()["counters"]["key_hits"]
        for i in range(3):
            np.testing.assert_array_equal(reader.get(key_of(i)), content(i))
        remote = reader.stats()["remote"]
        assert remote["speculative_hits"] == 2 and "speculative_unconfirmed" not in remote
        assert cluster.client.stats()["counters"]["key_hits"] == asked + 3  # every get located
    finally:
        holder.close()
        reader.close()


def test_speculative_pulls_can_be_turned_off(cluster: Cluster) -> None:
    cluster.start_master()
    holder = cluster.connect("holder")
    config = small_config(cluster.master_address, "reader", str(cluster.tmp_path / "reader"), HEARTBEAT_MS)
    config.set("node.speculative_pulls", False, origin="test")
    reader = kvpool.connect(cluster.master_address, config=config)
    try:
        for i in range(3):
            holder.put(key_of(i), content(i))
        for i in range(3):
            np.testing.assert_array_equal(reader.get(key_of(i)), content(i))
        remote = reader.stats()["remote"]
        assert remote["pulls"] == 3 and "speculative_hits" not in remote and "speculative_wasted" not in remote
    finally:
        holder.close()
        reader.close()


def ucx_published(cluster: Cluster, pool: kvpool.Pool) -> None:
    """Wait until the master has ``pool``'s node's UCX worker address (a client node starts UCX
    after connect() returns, and registers it then)."""
    node_id = pool.cluster.node.node_id
    wait_for(lambda: NodeAddress.decode(cluster.client.stats()["nodes"][node_id]["address"]).peer.worker_address,
             30, "the client's UCX address at the master")


def test_start_ucx_starts_a_clients_ucx_now_and_registers_it(cluster: Cluster) -> None:
    """A client starts UCX when first wanted, and starting it holds the GIL for ~0.4 s:
    ``start_ucx()`` starts it before the process serves (the vLLM connector does); the master
    then has its worker address, and a large object is pulled from it over UCX."""
    cluster.start_master()
    holder = cluster.connect("holder")
    reader = cluster.connect("reader", node__speculative_pulls=False)
    try:
        node = holder.cluster.node
        assert node.engine is None  # connect() started none
        assert holder.start_ucx() is True
        assert node.engine is not None
        ucx_published(cluster, holder)
        big = (np.arange(2 << 20) % 4093).astype(np.float16).reshape(4, 2, 256, 16, 64)  # 4 MiB
        holder.put(key_of(5), big)
        np.testing.assert_array_equal(reader.get(key_of(5)), big)
        assert reader.stats()["remote"]["pull_client"]["pulls"] == 1
        assert holder.start_ucx() is True  # once started, again is nothing
    finally:
        holder.close()
        reader.close()
    with pytest.raises(errors.PoolClosedError):
        holder.start_ucx()


@pytest.mark.slow
def test_a_client_serves_over_tcp_whatever_the_size_until_its_ucx_has_started(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's connect() starts no UCX: it registers with its TCP port only, and small puts
    leave it so. Its first object above its node.tcp_pull_max starts UCX on a thread; until
    its UCX worker address is registered, peers pull what it holds over TCP even above their
    node.tcp_pull_max (a reader's get, a storage node's durable copy), exact; then the large
    pulls go over UCX."""
    cluster.start_master()
    log = cluster.tmp_path / "store.log"
    (cluster.tmp_path / "store.toml").write_text(node_config("store", cluster.tmp_path / "store",
                                                             cluster.master_address))
    cluster.spawn(["-m", "kvpool.cli.server", "--role", "node", "--config", str(cluster.tmp_path / "store.toml"),
                   "--node.tcp_pull_max", "64KiB"], log_path=log, ready=lambda: "ready" in log.read_text(),
                  timeout_s=30)
    reader = cluster.connect("reader", node__tcp_pull_max=64 << 10, node__speculative_pulls=False)
    from kvpool.cluster.node import server as node_module

    gate = threading.Event()
    real_engine = node_module.Engine

    def gated_engine(*args: Any, **kwargs: Any) -> Any:  # the real Engine, once the test lets it start
        gate.wait(30)
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(node_module, "Engine", gated_engine)
    holder = cluster.connect("holder", node__tcp_pull_max=64 << 10)
    try:
        node = holder.cluster.node
        small = content(9)[:1]  # one layer: 32 KiB
        holder.put(key_of(9), small)
        np.testing.assert_array_equal(reader.get(key_of(9)), small)
        assert node.engine is None and node._ucx_thread is None  # no UCX wanted yet
        assert node.address is not None and not node.address.peer.worker_address
        assert content(0).nbytes > 64 << 10  # above every tcp_pull_max here
        holder.put(key_of(0), content(0))  # starts UCX, which waits for the gate
        assert node._ucx_thread is not None and node.engine is None
        holder.put(key_of(1), content(1), durable=True)  # the storage node pulled it: over TCP
        np.testing.assert_array_equal(reader.get(key_of(0)), content(0))  # (holder joined after it)
        remote = reader.stats()["remote"]
        assert remote["tcp_pull_client"]["pulls"] == 2 and remote["pull_client"]["pulls"] == 0, remote
        served = node.stats()["transfer_by_path"]
        assert served["tcp"]["requests_served"] == 3 and served["ucx"]["requests_served"] == 0, served
        store_id = next(i for i, n in cluster.client.stats()["nodes"].items()
                        if i not in (node.node_id, reader.cluster.node.node_id))
        assert cluster.node_stats(store_id)["counters"]["replicated_objects"] == 1
        gate.set()
        ucx_published(cluster, holder)
        holder.put(key_of(2), content(2))
        np.testing.assert_array_equal(reader.get(key_of(2)), content(2))
        np.testing.assert_array_equal(reader.get(key_of(1)), content(1))  # from the holder or the store
        remote = reader.stats()["remote"]
        assert remote["pull_client"]["pulls"] >= 1, remote
        assert node.stats()["transfer_by_path"]["ucx"]["requests_served"] >= 1
    finally:
        gate.set()
        holder.close()
        reader.close()


def test_a_holder_that_joined_since_the_last_alive_list_is_not_taken_for_gone() -> None:
    """A reader refreshes the master's list of alive nodes once a heartbeat; a node the master
    names that joined since is read from (a get right after a new writer's put is no miss),
    and only a node once listed alive and no longer is known gone."""
    def held_by(node_id: str) -> Any:  # the reader asks a replica only for its holder's id here
        return types.SimpleNamespace(node_id=node_id)

    reader = ReplicaReader(local_host_id(), tcp_pull_max=0)
    try:
        reader.forget_nodes_except({"a"})
        assert reader.holder_alive(held_by("b"))
        reader.forget_nodes_except({"b"})
        assert not reader.holder_alive(held_by("a"))
        assert reader.holder_alive(held_by("b"))
    finally:
        reader.close()


@pytest.mark.slow
def test_small_pulls_go_over_tcp_and_large_ones_over_ucx(cluster: Cluster) -> None:
    """A reader pulls layer ranges up to its node.tcp_pull_max over the holder's TCP port and
    larger ones over UCX; a holder with node.tcp_pull_max = 0 opens no TCP port and is pulled
    from over UCX only."""
    cluster.start_master()
    holder = cluster.connect("holder", node__tcp_pull_max=2 * LAYER_NBYTES)  # (it starts UCX at its first put)
    config = small_config(cluster.master_address, "no-tcp", str(cluster.tmp_path / "no-tcp"), HEARTBEAT_MS)
    config.set("node.tcp_pull_max", 0, origin="test")
    untcp = kvpool.connect(cluster.master_address, config=config)
    config = small_config(cluster.master_address, "reader", str(cluster.tmp_path / "reader"), HEARTBEAT_MS)
    config.set("node.tcp_pull_max", 2 * LAYER_NBYTES, origin="test")
    reader = kvpool.connect(cluster.master_address, config=config)
    try:
        assert holder.cluster.node.address is not None and holder.cluster.node.address.peer.tcp_port
        assert untcp.cluster.node.tcp_server is None
        assert untcp.cluster.node.address is not None and untcp.cluster.node.address.peer.tcp_port == 0
        for i in range(4):
            holder.put(key_of(i), content(i))
            untcp.put(key_of(10 + i), content(10 + i))
        ucx_published(cluster, holder)  # (until then, every pull from it goes over TCP)
        np.testing.assert_array_equal(reader.get(key_of(0), layers=(1, 3)), content(0)[1:3])  # 2 layers: TCP
        np.testing.assert_array_equal(reader.get(key_of(1)), content(1))  # 8 layers: UCX
        got = reader.get_many([key_of(2), key_of(3)], layers=(5, 6))  # one TCP connection for both
        for i, arr in zip((2, 3), got):
            np.testing.assert_array_equal(arr, content(i)[5:6])
        np.testing.assert_array_equal(reader.get(key_of(10), layers=(0, 1)), content(10)[0:1])  # no port: UCX
        remote = reader.stats()["remote"]
        assert remote["tcp_pull_client"]["pulls"] == 3 and remote["tcp_pull_client"]["connects"] == 1, remote
        assert remote["pull_client"]["pulls"] == 2, remote
        assert holder.cluster.node.stats()["transfer_by_path"]["tcp"]["requests_served"] == 3
        # A holder whose TCP port turns new connections away (at its limit) is read over UCX.
        assert holder.cluster.node.tcp_server is not None
        holder.cluster.node.tcp_server.max_connections = 0
        config = small_config(cluster.master_address, "late", str(cluster.tmp_path / "late"), HEARTBEAT_MS)
        config.set("node.tcp_pull_max", 2 * LAYER_NBYTES, origin="test")
        late = kvpool.connect(cluster.master_address, config=config)
        try:
            for i in (0, 1):
                np.testing.assert_array_equal(late.get(key_of(i), layers=(0, 1)), content(i)[0:1])
            remote = late.stats()["remote"]
            assert remote["tcp_fallbacks"] == 1 and remote["pull_client"]["pulls"] == 2, remote  # tried once
        finally:
            late.close()
    finally:
        for pool in (holder, untcp, reader):
            pool.close()


@pytest.mark.slow
def test_eight_concurrent_reader_processes_see_exact_content(cluster: Cluster) -> None:
    cluster.start_master()
    cluster.start_actor("writer", "writer", "--keys", "6")
    readers = [cluster.start_actor("reader", f"reader-{i}", "--keys", "6", "--layers", f"{i % 4}:{i % 4 + 4}")
               for i in range(8)]
    for child in readers:
        result = reader_result(child)
        assert (result["ok"], result["miss"], result["wrong"]) == (6, 0, 0), child.output()


@pytest.mark.slow
def test_killed_holder_gives_a_miss_and_its_keys_leave_the_index(cluster: Cluster) -> None:
    cluster.start_master()
    writer = cluster.start_actor("writer", "writer", "--keys", "2")
    holder = cluster.node_id_of(writer)
    reader = cluster.connect("reader")
    try:
        assert reader.get(key_of(0)) is not None
        writer.kill()
        started = time.monotonic()
        assert reader.get(key_of(1)) is None  # holder gone: a miss, never an exception or bad data
        assert time.monotonic() - started < 5.0
        wait_for(lambda: holder not in cluster.alive_nodes(), 5.0, "master to declare the holder dead")
        wait_for(lambda: reader.lookup([key_of(0)]) == 0, 2.0, "dead holder's keys to leave the index")
    finally:
        reader.close()


@pytest.mark.slow
def test_durable_put_with_two_replicas_survives_losing_a_holder(cluster: Cluster) -> None:
    cluster.start_master()
    store_a = cluster.start_node("store-a")
    cluster.start_node("store-b")
    wait_for(lambda: len(cluster.alive_nodes()) == 2, 10, "storage nodes to register")
    writer = cluster.start_actor("writer", "writer", "--keys", "3", "--durable", "--replicas", "2")
    stats = cluster.client.stats()
    assert stats["replicas"] == 3 * 3  # the writer's own copy + two storage nodes each
    writer.kill()   # the writer is gone ...
    store_a.kill()  # ... and so is one storage node
    reader = cluster.start_actor("reader", "reader", "--keys", "3")
    assert reader_result(reader)["ok"] == 3


@pytest.mark.slow
def test_master_restart_then_nodes_reregister_and_lookup_finds_objects(cluster: Cluster) -> None:
    master = cluster.start_master()
    writer = cluster.start_actor("writer", "writer", "--keys", "4")
    holder = cluster.node_id_of(writer)
    assert cluster.client.lookup([key_of(i) for i in range(4)]) == 4
    master.kill()
    cluster.start_master()  # same address, empty state
    wait_for(lambda: cluster.client.lookup([key_of(i) for i in range(4)]) == 4, 10,
             "objects to be found again after re-registration")
    assert holder in cluster.alive_nodes()
    reader = cluster.connect("reader")
    try:
        np.testing.assert_array_equal(reader.get(key_of(3), layers=range(0, 2)), content(3)[:2])
    finally:
        reader.close()


def damage_in_arena(reader: kvpool.Pool, key: bytes) -> None:
    """Flip one payload byte of ``key`` (an actor's object) where it lies in its holder's cxl arena."""
    location = reader.cluster.master.locate(key, lease=False).replicas[0][0]["location"]
    header_nbytes = ObjectSpec("float16", 8, 32, 4, 64).header_nbytes
    with open(location["path"], "r+b") as arena:
        arena.seek(4096 + location["offset"] + header_nbytes + 5)
        byte = arena.read(1)
        arena.seek(-1, 1)
        arena.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
def test_same_host_reader_finds_cxl_objects_without_the_master_and_verifies_them(cluster: Cluster) -> None:
    cluster.start_master()
    writer = cluster.start_actor("writer", "writer", "--keys", "3", "--dram", "0")  # puts land in cxl
    holder = cluster.node_id_of(writer)
    reader = cluster.connect("reader")
    try:
        def key_requests() -> tuple[int, int, int]:
            counters = cluster.client.stats()["counters"]
            return counters["key_hits"], counters["key_misses"], counters["leases_granted"]

        before = key_requests()
        np.testing.assert_array_equal(reader.get(key_of(0), layers=range(1, 4)), content(0)[1:4])
        np.testing.assert_array_equal(reader.get(key_of(1)), content(1))
        remote = reader.stats()["remote"]
        assert remote["hits_same_host"] == 2 and remote.get("pulls", 0) == 0
        assert key_requests() == before  # the master was never asked about these keys
        assert cluster.node_stats(holder)["transfer"]["bytes_sent"] == 0  # read in place, nothing sent

        # Corrupt key 2 in the holder's arena: the in-place read and the pull both fail
        # their checksums, so the get is a miss, never the wrong bytes.
        damage_in_arena(reader, key_of(2))
        assert reader.get(key_of(2)) is None
        stats = reader.stats()
        assert stats["remote"]["same_host_retries"] >= 1 and stats["misses"]["checksum"] == 1
    finally:
        reader.close()


def test_a_replica_put_again_after_it_was_located_is_never_read_as_the_version_located(cluster: Cluster) -> None:
    """The master keeps only a checksum of each replica's header; the holder sends the header
    with the bytes. A record located before the key was put again names a version the holder
    no longer has: reading it is a miss ("stale"), never the new or a mixed object."""
    from kvpool.api import out_view

    cluster.start_master()
    writer, reader = cluster.connect("writer"), cluster.connect("reader")
    try:
        key, old, new = key_of(50), content(50), content(51)
        writer.put(key, old)
        [[located]] = reader.cluster.master.locate(key, lease=False).replicas  # type: ignore[attr-defined]
        assert "header" not in located and isinstance(located["header_sum"], int)  # no header in the index
        checked = checked_replicas([located], reader.cluster.reader.counters)
        np.testing.assert_array_equal(reader.cluster.reader.read(key, checked, None, None, out_view), old)
        writer.delete(key)
        writer.put(key, new)
        [[current]] = reader.cluster.master.locate(key, lease=False).replicas  # type: ignore[attr-defined]
        assert current["header_sum"] != located["header_sum"]  # a new generation, a new header
        for layers in (None, range(2, 5)):
            assert reader.cluster.reader.read(key, checked, layers, None, out_view) is None
        assert reader.cluster.reader.counters["miss_stale"] == 2
        np.testing.assert_array_equal(reader.get(key), new)
        np.testing.assert_array_equal(reader.get(key, layers=range(2, 5)), new[2:5])
        # delete then put from one process leaves the key there: no heartbeat later drops the new copy
        beats = cluster.client.stats()["counters"]["heartbeats"]
        wait_for(lambda: cluster.client.stats()["counters"]["heartbeats"] >= beats + 6, 5, "three beats of each")
        np.testing.assert_array_equal(writer.get(key), new)
        assert reader.lookup([key]) == 1
    finally:
        writer.close()
        reader.close()


@pytest.mark.slow
def test_unreachable_master_is_a_typed_error_and_local_puts_reappear_after_its_restart(cluster: Cluster) -> None:
    master = cluster.start_master()
    client = cluster.connect("client")
    try:
        master.kill()
        started = time.monotonic()
        with pytest.raises(errors.MasterUnreachableError):
            client.get(b"nowhere-local")
        assert time.monotonic() - started < 6.0  # request_timeout_s is 3 s
        with pytest.raises(errors.MasterUnreachableError):
            client.put(b"written-while-down", content(5))
        np.testing.assert_array_equal(client.get(b"written-while-down"), content(5))  # kept locally
        cluster.start_master()
        wait_for(lambda: cluster.client.lookup([b"written-while-down"]) == 1, 10,
                 "the local put to be registered with the restarted master")
    finally:
        client.close()


EXITS_WITHOUT_CLOSE = """
import sys, numpy as np, kvpool
from tests.cluster_actor import small_config
pool = kvpool.connect(sys.argv[1], config=small_config(sys.argv[1], sys.argv[2], sys.argv[3], 200))
pool.put(b"left-open", np.zeros((2, 2, 16, 2, 32), np.float16))
print("NODE", pool.node_id, flush=True)
if sys.argv[4] == "raise":
    raise RuntimeError("the program fails")
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["return", "raise"])
def test_a_program_that_exits_without_closing_its_pool_leaves_cleanly(cluster: Cluster, ending: str) -> None:
    """No close(): the pool is closed at exit while its threads still run, so the node says
    goodbye (the master lists it as left, not dead) and nothing is logged about half-torn parts."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    cluster.start_master()
    done = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_CLOSE, cluster.master_address, f"exit-{ending}",
                           str(cluster.tmp_path / f"exit-{ending}"), ending],
                          capture_output=True, text=True, timeout=90, cwd=REPO_ROOT)
    assert done.returncode == (0 if ending == "return" else 1), done.stderr[-3000:]
    node_id = done.stdout.split("NODE ", 1)[1].split()[0]
    assert cluster.client.stats()["nodes"][node_id]["state"] == "left"
    noise = [line for line in done.stderr.splitlines() if "closing" in line or "did not answer" in line]
    assert noise == [], done.stderr[-3000:]
    assert ("RuntimeError: the program fails" in done.stderr) == (ending == "raise")


def test_garbage_to_the_master_does_not_stop_it(cluster: Cluster) -> None:
    import zmq

    cluster.start_master()

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    default_cluster_key().secure_client(sock)  # garbage from a key holder: past authentication
    try:
        sock.connect(cluster.master_address)
        for junk in (b"", b"\xff\x00garbage", b"\x93\x01\x02\x03", b"x" * 10000):
            sock.send(junk)
        assert cluster.client.ping(timeout_s=2.0)
    finally:
        sock.close(0)


def test_a_node_beats_as_often_as_its_master_wants_whatever_its_own_setting(cluster: Cluster) -> None:
    """A client whose settings say heartbeat_ms 1000 against a master at 200 ms (dead after 3
    missed beats, 0.6 s) takes the master's period from its register reply: never declared
    dead while alive."""
    cluster.start_master(dead_after_missed=3)
    pool = cluster.connect("slow-beats", master__heartbeat_ms=1000)
    try:
        node_id = pool.node_id
        assert pool.cluster.node.heartbeater.period_s == pytest.approx(HEARTBEAT_MS / 1000)
        time.sleep(2.0)
        node = cluster.client.stats()["nodes"][node_id]
        assert node["alive"], node
    finally:
        pool.close()
