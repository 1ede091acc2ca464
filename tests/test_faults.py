"""Faults over real processes: what every *other* process sees when a holder is killed,
frozen or restarted under it. Each test starts a real master and real pool processes on
127.0.0.1 and stops them all, also on failure."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.cluster_actor import content, key_of
from tests.conftest import wait_for
from tests.test_cluster import Cluster

pytestmark = pytest.mark.timeout(180)
KEYS = 4


def _timed_gets(pool, rounds: int) -> list[float]:
    """Seconds per get over ``rounds`` passes of every key; every value must be exact."""
    seconds = []
    for _ in range(rounds):
        for i in range(KEYS):
            started = time.perf_counter()
            got = pool.get(key_of(i))
            seconds.append(time.perf_counter() - started)
            assert got is not None, f"key {i} missed although a live replica holds it"
            np.testing.assert_array_equal(got, content(i))
    return seconds


def _two_holders(cluster: Cluster):
    cluster.start_master()
    first = cluster.start_actor("writer", "holder-a", "--keys", str(KEYS))
    second = cluster.start_actor("writer", "holder-b", "--keys", str(KEYS))
    return first, second


def _holder_that_serves(cluster: Cluster, reader, first, second):
    """Read every key once (the reader remembers where) and return (serving, other) holders."""
    _timed_gets(reader, 1)
    served = {w: cluster.node_stats(cluster.node_id_of(w))["transfer"]["bytes_sent"] for w in (first, second)}
    serving = max(served, key=served.get)
    return serving, (second if serving is first else first)


@pytest.mark.slow
def test_a_killed_holder_costs_at_most_one_deadline_once(cluster: Cluster) -> None:
    first, second = _two_holders(cluster)
    reader = cluster.connect("reader")
    try:
        serving, _ = _holder_that_serves(cluster, reader, first, second)
        dead = cluster.node_id_of(serving)
        serving.kill()
        after_kill = _timed_gets(reader, 1)
        later = _timed_gets(reader, 3)
        print(f"worst get after kill -9 of the serving holder: {max(after_kill) * 1e3:.1f} ms; "
              f"afterwards: {max(later) * 1e3:.1f} ms")
        remote = reader.stats()["remote"]
        assert remote.get("miss_timeout", 0) == 0  # no pull waited out its deadline on the dead holder
        locations = reader.cluster.reader._locations  # type: ignore[attr-defined]
        assert all(r.node_id != dead for replicas in locations.values() for r in replicas)
        pull_timeout_s = reader.config.node.pull_timeout_s
        assert max(later) < pull_timeout_s  # a dead holder is never waited on again
    finally:
        reader.close()


@pytest.mark.slow
def test_a_frozen_holder_is_skipped_once_the_master_declares_it_dead(cluster: Cluster) -> None:
    first, second = _two_holders(cluster)
    reader = cluster.connect("reader")
    frozen = None
    try:
        serving, _ = _holder_that_serves(cluster, reader, first, second)
        frozen = serving
        os.kill(frozen.pid, signal.SIGSTOP)
        during = _timed_gets(reader, 1)
        wait_for(lambda: cluster.node_id_of(frozen) not in cluster.alive_nodes(), 10, "the frozen node to be dead")
        time.sleep(0.5)  # one refresh of the reader's view of the alive set
        later = _timed_gets(reader, 3)
        print(f"worst get while the serving holder is SIGSTOPped: {max(during) * 1e3:.1f} ms; "
              f"after it was declared dead: {max(later) * 1e3:.1f} ms")
        assert max(later) < reader.config.node.pull_timeout_s
        assert max(during) <= reader.config.node.pull_timeout_s + 2.0  # at most one deadline
    finally:
        if frozen is not None:
            os.kill(frozen.pid, signal.SIGCONT)
        reader.close()


@pytest.mark.slow
def test_restarting_a_holder_never_breaks_same_host_readers(cluster: Cluster) -> None:
    """kill -9 a holder whose cxl arena a reader maps, start it again under the same name:
    the reader neither crashes nor returns wrong bytes, and reads the new arena once it is up."""
    cluster.start_master()
    writer = cluster.start_actor("writer", "holder", "--keys", str(KEYS), "--dram", "0")
    reader = cluster.connect("reader")
    try:
        _timed_gets(reader, 1)
        assert reader.stats()["remote"]["hits_same_host"] == KEYS  # read in place from its arena
        for round_ in range(3):
            writer.kill()
            for i in range(KEYS):  # while it is down: a miss or the exact bytes, nothing else
                got = reader.get(key_of(i))
                assert got is None or np.array_equal(got, content(i))
            writer = cluster.start_actor("writer", "holder", "--keys", str(KEYS), "--dram", "0")
            wait_for(lambda: all(reader.get(key_of(i)) is not None for i in range(KEYS)), 15,
                     f"reads from the restarted holder (round {round_})")
            _timed_gets(reader, 1)
    finally:
        reader.close()


# -- a disk smaller than the configured nvme capacity ------------------------------------------


@pytest.fixture
def small_disk(tmpfs) -> Path:
    """A real 8 MiB filesystem (tmpfs; root only)."""
    return tmpfs("8m")


def test_a_full_disk_is_capacity_and_the_newest_objects_survive(small_disk: Path, tmp_path: Path, caplog) -> None:
    import logging

    import kvpool
    from tests.pool_configs import small_config

    config = small_config(tmp_path, ("dram", "nvme"), dram=1 << 20, nvme=64 << 20)
    config.tiers.nvme.path = str(small_disk / "nvme")
    config.tiers.nvme.segment_size = 2 << 20
    pool = kvpool.Pool(config)
    objects = {b"obj-%03d" % i: np.random.default_rng(i).standard_normal((4, 2, 128, 2, 64)).astype(np.float16)
               for i in range(48)}  # 256 KiB each: 12 MiB in all, for 1 MiB of dram + an 8 MiB disk
    try:
        with caplog.at_level(logging.WARNING):
            for key, arr in objects.items():
                pool.put(key, arr)  # never DiskFullError: the full disk is capacity
        got = {key: pool.get(key) for key in objects}
        for key, arr in got.items():
            assert arr is None or np.array_equal(arr, objects[key])
        survivors = [i for i, key in enumerate(objects) if got[key] is not None]
        assert len(survivors) >= 20  # most of what the disk and dram hold
        assert survivors == list(range(48 - len(survivors), 48))  # the newest, not the oldest
        warnings = [r for r in caplog.records if "full" in r.getMessage() and r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert str(small_disk) in warnings[0].getMessage() or "nvme" in warnings[0].getMessage()
    finally:
        pool.close()


@pytest.mark.slow
def test_a_frozen_last_holder_delays_a_speculative_get_once_and_never_serves_it(cluster: Cluster) -> None:
    """A get pulls from the node it last pulled from while the master locates the key
    (node.speculative_pulls). That node frozen (SIGSTOP) and the key held elsewhere: the
    exact bytes from the other holder; the frozen node is waited on once, until the master
    declares it dead, and is not guessed again."""
    cluster.start_master()
    frozen = cluster.start_actor("writer", "holder-a", "--keys", "2")
    cluster.start_actor("writer", "holder-b", "--keys", "3", "--first", "10")
    reader = cluster.connect("reader")
    stopped = False
    try:
        np.testing.assert_array_equal(reader.get(key_of(0)), content(0))  # from a: a is guessed next
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped = True
        np.testing.assert_array_equal(reader.get(key_of(10)), content(10))
        remote = reader.stats()["remote"]
        assert remote["speculative_wasted"] == 1
        failures = remote["pull_client"]["failures"]
        assert failures <= 1  # the guess on a, at most; the located read went to b
        for i in (11, 12):  # b is the holder guessed now, and right
            np.testing.assert_array_equal(reader.get(key_of(i)), content(i))
        remote = reader.stats()["remote"]
        assert remote["speculative_hits"] >= 1 and remote["pull_client"]["failures"] == failures
    finally:
        if stopped:
            os.kill(frozen.pid, signal.SIGCONT)
        reader.close()


@pytest.mark.slow
def test_a_frozen_last_holder_delays_a_guessed_batch_once_and_never_serves_it(cluster: Cluster) -> None:
    """get_many first pulls the whole batch from the node it last pulled from (the LastHolder
    locator). That node frozen (SIGSTOP) and the keys held elsewhere: the exact bytes from the
    other holder; the frozen node is waited on once, until the master declares it dead, the
    located read does not wait on it again, and it is not guessed again."""
    cluster.start_master()
    frozen = cluster.start_actor("writer", "holder-a", "--keys", "2")
    cluster.start_actor("writer", "holder-b", "--keys", "4", "--first", "10")
    reader = cluster.connect("reader")
    stopped = False

    def tcp_failures() -> int:
        return int(reader.stats()["remote"]["tcp_pull_client"]["failures"])

    try:
        np.testing.assert_array_equal(reader.get(key_of(0)), content(0))  # from a: a is guessed next
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped = True
        got = reader.get_many([key_of(i) for i in (10, 11)])
        for i, arr in zip((10, 11), got):
            np.testing.assert_array_equal(arr, content(i))
        remote = reader.stats()["remote"]
        assert remote["speculative_wasted"] == 2 and remote.get("miss_timeout", 0) == 0
        failures = tcp_failures()
        assert failures <= 2  # the guesses on a; the located read went to b
        got = reader.get_many([key_of(i) for i in (12, 13)])  # b is the holder guessed now, and right
        for i, arr in zip((12, 13), got):
            np.testing.assert_array_equal(arr, content(i))
        remote = reader.stats()["remote"]
        assert remote["speculative_hits"] == 2 and tcp_failures() == failures
    finally:
        if stopped:
            os.kill(frozen.pid, signal.SIGCONT)
        reader.close()


@pytest.mark.slow
def test_get_many_moves_on_to_the_next_replica_when_the_first_choice_was_killed(cluster: Cluster) -> None:
    """get_many pulls every key's first choice of replica at once (one PullClient.pull_many);
    the keys whose holder was killed under it are read from the other replica, exact."""
    first, second = _two_holders(cluster)
    reader = cluster.connect("reader")
    try:
        serving, _ = _holder_that_serves(cluster, reader, first, second)  # remembered: first choice
        serving.kill()
        keys = [key_of(i) for i in range(KEYS)]
        got = reader.get_many(keys)
        for i, arr in enumerate(got):
            assert arr is not None, f"key {i} missed although a live replica holds it"
            np.testing.assert_array_equal(arr, content(i))
        assert reader.stats()["remote"].get("miss_timeout", 0) == 0
        got = reader.get_many(keys, layers=range(2, 4))  # and again, now without the dead holder
        for i, arr in enumerate(got):
            np.testing.assert_array_equal(arr, content(i)[2:4])
    finally:
        reader.close()
