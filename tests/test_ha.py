"""The highly available master: masters elect a leader in a real etcd, clients and nodes follow it.

Every process is real (etcd, masters, a storage node, pool clients, each its own
process on 127.0.0.1). What is checked: one leader, standbys refuse with a
typed error naming it, clients follow a leader that stops or is killed (-9)
within the same call, no wrong bytes and a bounded gap while a leader dies
under a stream of gets, durable keys readable after failover, and no split
brain: a leader paused past its lease, or cut off from etcd, stops answering.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvpool import errors
from kvpool.cluster.wire.etcd import masters
from kvpool.cluster.wire.master_client import MasterClient
from kvpool.cluster.wire.security import ClusterKey
from kvpool.config import Config
from tests.conftest import ChildProcess, Etcd, free_tcp_port, wait_for
from tests.test_cluster import node_config

pytestmark = pytest.mark.slow  # etcd and several master processes per test

HEARTBEAT_MS = 200


class HA:
    def __init__(self, tmp_path: Path, spawn: Callable[..., ChildProcess], etcd: Etcd) -> None:
        self.tmp_path, self.spawn, self.etcd = tmp_path, spawn, etcd
        self.prefix = f"/kvpool-test-{uuid.uuid4().hex[:8]}"
        self.masters: dict[str, ChildProcess] = {}

    def settings(self) -> list[str]:
        return ["--master.etcd", self.etcd.url, "--master.etcd_prefix", self.prefix,
                "--master.heartbeat_ms", str(HEARTBEAT_MS)]

    def config(self, **master: object) -> Config:
        return Config.load({"master": {"etcd": self.etcd.url, "etcd_prefix": self.prefix,
                                       "heartbeat_ms": HEARTBEAT_MS, **master}})

    def write_config(self) -> Path:
        path = self.tmp_path / "ha.toml"
        path.write_text(f'[master]\netcd = "{self.etcd.url}"\netcd_prefix = "{self.prefix}"\n')
        return path

    def start_master(self, *flags: str) -> str:
        address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.masters[address] = self.spawn(
            ["-m", "kvpool.cli.server", "--role", "master", "--master.listen", address, *self.settings(), *flags],
            log_path=self.tmp_path / f"master-{len(self.masters)}.log",
            ready=lambda: address in masters(self.etcd.url, self.prefix)[1], timeout_s=30)
        return address

    def leader(self, other_than: str | None = None, timeout_s: float = 15.0) -> str:
        def elected() -> str | None:
            leader = masters(self.etcd.url, self.prefix)[0]
            return leader if leader is not None and leader != other_than else None
        return wait_for(elected, timeout_s, "a master leader in etcd", interval_s=0.05)

    def start_node(self, name: str) -> ChildProcess:
        data_dir = self.tmp_path / name
        config = self.tmp_path / f"{name}.toml"
        config.write_text(node_config(name, data_dir, "tcp://127.0.0.1:7700"))
        log = self.tmp_path / f"{name}.log"
        return self.spawn(["-m", "kvpool.cli.server", "--role", "node", "--config", str(config), *self.settings()],
                          log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=30)

    def start_actor(self, role: str, name: str, *args: str) -> ChildProcess:
        log = self.tmp_path / f"{name}.log"
        return self.spawn(["-m", "tests.cluster_actor", role, "--etcd", self.etcd.url, "--etcd-prefix", self.prefix,
                           "--name", name, "--data-dir", str(self.tmp_path / name),
                           "--heartbeat-ms", str(HEARTBEAT_MS), *args],
                          log_path=log, ready=lambda: "READY" in log.read_text(), timeout_s=40)


@pytest.fixture
def ha(tmp_path: Path, spawn_python: Callable[..., ChildProcess], etcd: Etcd) -> HA:
    return HA(tmp_path, spawn_python, etcd)


def test_one_leader_standbys_refuse_and_clients_follow_a_clean_handover(ha: HA) -> None:
    addresses = [ha.start_master() for _ in range(3)]
    leader = ha.leader()
    assert leader in addresses
    assert sorted(masters(ha.etcd.url, ha.prefix)[1]) == sorted(addresses)
    for standby in (a for a in addresses if a != leader):
        with MasterClient(standby, config=ha.config(), request_timeout_s=2.0) as fixed:
            with pytest.raises(errors.NotLeaderError, match=leader):
                fixed.ping()
    standby = next(a for a in addresses if a != leader)
    cli = [sys.executable, "-m", "kvpool.cli", "stats"]
    shown = subprocess.run([*cli, "--etcd", ha.etcd.url, "--config", str(ha.write_config())],
                           capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and f"master {leader} (leader, term 1" in shown.stdout, shown
    listed = next(line for line in shown.stdout.splitlines() if line.startswith("standby masters: "))
    assert sorted(listed.removeprefix("standby masters: ").split(", ")) == sorted(a for a in addresses if a != leader)
    refused = subprocess.run([*cli, "--master", standby], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and f"standby; the leader is {leader}" in refused.stderr, refused
    with MasterClient(config=ha.config(), request_timeout_s=5.0) as follower:
        follower.ping()
        assert follower.address == leader
        assert follower.stats()["ha"] == {"etcd": ha.etcd.url, "prefix": ha.prefix, "term": 1, "endpoint": leader}
        # A clean stop revokes the leader's lease: a standby takes over at once, and the same
        # client follows it within one call.
        ha.masters[leader].stop()
        new_leader = ha.leader(other_than=leader, timeout_s=3.0)
        follower.ping()
        assert follower.address == new_leader != leader
        assert follower.stats()["ha"]["term"] == 2  # the cluster's term, not this process's first win


def test_kill9_of_the_leader_during_gets_costs_a_short_gap_and_no_wrong_bytes(ha: HA) -> None:
    """Two masters, a storage node, a writer of plain keys and one of durable keys (copies in
    the storage node's nvme; that writer then leaves, so the storage node holds the only copy),
    and a reader asking the master for every get (no location cache).
    The leader is killed -9 mid-stream: no get returns wrong bytes, gets succeed again within
    5 s, and the new leader indexes every key again from the nodes' re-registration."""
    first = ha.start_master()
    ha.start_master()
    leader = ha.leader()
    ha.start_node("storage")
    ha.start_actor("writer", "plain", "--keys", "6", "--first", "0")
    durable = ha.start_actor("writer", "durable", "--keys", "6", "--first", "6", "--durable")
    assert durable.stop() == 0  # a clean leave: its own copies leave the index, the durable ones stay
    reader = ha.start_actor("stream", "reader", "--keys", "12", "--seconds", "12")
    time.sleep(3.0)
    killed_at = time.time()
    ha.masters[leader].kill()
    wait_for(lambda: reader.popen.poll() is not None, 60, "the reader to finish")
    assert reader.popen.returncode == 0, reader.output()
    events = json.loads(reader.output().strip().splitlines()[-1])["events"]
    outcomes = [outcome for _t, outcome in events]
    assert "wrong" not in outcomes
    assert set(outcomes) <= {"ok", "miss", "MasterUnreachableError"}, sorted(set(outcomes))
    before = [o for t, o in events if t < killed_at]
    assert before and set(before) == {"ok"}
    # The gap: from the kill until the first get after which every get succeeded.
    last_failure = max((t for t, o in events if o != "ok"), default=killed_at)
    after = [t for t, o in events if t > last_failure]
    assert after, f"no get succeeded after the kill: {outcomes[-20:]}"
    gap = after[0] - killed_at
    print(f"failover gap {gap:.2f} s ({len(events)} gets, {outcomes.count('miss')} misses while the index was rebuilt)")
    assert gap <= 5.0
    new_leader = ha.leader(other_than=leader)
    assert new_leader != leader and (new_leader == first or leader == first)
    with MasterClient(config=ha.config()) as follower:
        stats = follower.stats()
        assert stats["ha"]["term"] == 2 and stats["ha"]["endpoint"] == new_leader  # the cluster's second term
        assert stats["keys"] == 12
        assert stats["durable_keys"] == 6


def test_a_paused_leader_stops_answering_before_another_is_elected(ha: HA) -> None:
    """No split brain: a leader frozen past its lease (SIGSTOP) has lost it when it resumes,
    and refuses what it is asked (NotLeaderError) instead of answering from a stale index."""
    for _ in range(2):
        ha.start_master()
    old = ha.leader()
    with MasterClient(old, config=ha.config(), request_timeout_s=2.0) as fixed:
        fixed.ping()
        ha.masters[old].popen.send_signal(signal.SIGSTOP)
        try:
            new = ha.leader(other_than=old, timeout_s=10.0)
        finally:
            ha.masters[old].popen.send_signal(signal.SIGCONT)
        with pytest.raises(errors.NotLeaderError):
            fixed.ping()  # the first thing it is asked after resuming is refused
        assert masters(ha.etcd.url, ha.prefix)[0] == new
    with MasterClient(config=ha.config()) as follower:
        follower.ping()
        assert follower.address == new


def test_a_leader_cut_off_from_etcd_stops_serving_within_its_lease(ha: HA) -> None:
    address = ha.start_master()
    assert ha.leader() == address
    with MasterClient(address, config=ha.config(), request_timeout_s=2.0) as fixed:
        fixed.ping()
        ha.etcd.child.popen.send_signal(signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            def refused() -> bool:
                try:
                    fixed.ping()
                except errors.NotLeaderError:
                    return True
                return False

            wait_for(refused, 10, "the leader to stop serving")
            # It had to stop before etcd could have given its lease to anyone (TTL 2 s).
            assert time.monotonic() - stopped <= 2.0 + 2.0  # + one ping's deadline of slack
        finally:
            ha.etcd.child.popen.send_signal(signal.SIGCONT)
    with MasterClient(config=ha.config(), request_timeout_s=10.0) as follower:
        wait_for(lambda: follower.ping(), 20, "a leader again once etcd is back")
        assert follower.address == address


def test_no_leader_and_bad_etcd_settings_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="master.etcd"):
        Config.load({"master": {"etcd": "localhost"}})
    with pytest.raises(errors.ConfigError, match="master.etcd"):
        Config.load({"master": {"etcd": "https://10.0.0.1:2379"}})
    dead = f"http://127.0.0.1:{free_tcp_port()}"
    with MasterClient(config=Config.load({"master": {"etcd": dead}}), request_timeout_s=0.5) as client:
        with pytest.raises(errors.MasterUnreachableError, match="no master leader in etcd"):
            client.ping()
    from kvpool.cluster.master.server import MasterServer

    with pytest.raises(errors.ConfigError, match="wildcard"):
        MasterServer(Config.load({"master": {"etcd": dead, "listen": f"tcp://0.0.0.0:{free_tcp_port()}"}}).master,
                     cluster_key=ClusterKey(None)).start()


def test_kvpool_server_with_etcd_runs_its_own_etcd_for_a_demo(tmp_path: Path,
                                                              spawn_python: Callable[..., ChildProcess]) -> None:
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (Debian: apt-get install etcd-server)")
    url = f"http://127.0.0.1:{free_tcp_port()}"
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    master = spawn_python(["-m", "kvpool.cli.server", "--role", "master", "--with-etcd", "--master.etcd", url,
                           "--master.listen", address, "--pool.data_dir", str(tmp_path / "data")],
                          log_path=tmp_path / "demo.log", ready=lambda: masters(url, "/kvpool")[0] == address,
                          timeout_s=40)
    etcd_data = tmp_path / "data" / "etcd"
    assert (etcd_data / "member").is_dir()
    with MasterClient(config=Config.load({"master": {"etcd": url}})) as follower:
        follower.ping()
        assert follower.address == address
    assert master.stop(grace_s=20) == 0, master.output()

    def etcd_gone() -> bool:  # the etcd it started stopped with it
        try:
            masters(url, "/kvpool")
        except errors.CoordinatorError:
            return True
        return False

    wait_for(etcd_gone, 10, "the demo etcd to stop with kvpool-server")


def test_puts_during_a_failover_are_visible_afterwards_or_fail_typed(ha: HA) -> None:
    """A writer puts a key every 100 ms while the leader is killed -9: every put that returned is
    readable from another process once the new leader has the index (none lost by the
    failover), the others failed with a typed error, and no get returns wrong bytes."""
    ha.start_master()
    ha.start_master()
    leader = ha.leader()
    # 60 keys of 256 KiB fit the writer's tiers (24 MiB): none is evicted, so none may be missing.
    writer = ha.start_actor("putstream", "writer", "--keys", "60", "--seconds", "6")
    time.sleep(1.5)
    ha.masters[leader].kill()
    wait_for(lambda: any(line.startswith("{") for line in writer.output().splitlines()), 60,
             "the writer to finish its puts")
    report = json.loads(next(line for line in writer.output().splitlines() if line.startswith("{")))
    failed = {int(i): error for i, error in report["failed"].items()}
    assert set(failed.values()) <= {"MasterUnreachableError", "NotLeaderError"}, failed
    assert len(report["ok"]) >= 30, report  # most puts went through, before and after the failover
    with MasterClient(config=ha.config()) as follower:
        def missing() -> list[int]:
            return [i for i, there in zip(report["ok"], follower.exists_many([b"cluster-key-%04d" % i
                                                                                for i in report["ok"]]))
                    if not there]
        try:
            wait_for(lambda: not missing(), 20, "every acknowledged put to be indexed by the new leader")
        except AssertionError:
            raise AssertionError(f"not indexed: {missing()}; failed: {failed}\n{writer.output()[-3000:]}") from None
    import kvpool
    from tests.cluster_actor import content, key_of

    with kvpool.connect(config=ha.config()) as pool:
        for i in report["ok"]:
            got = pool.get(key_of(i))
            assert got is not None and np.array_equal(got, content(i)), i


def test_a_leader_whose_key_is_deleted_by_hand_steps_down(ha: HA) -> None:
    """An operator deleting the leader key lets a standby win it; the old leader notices at its
    next renewal (a quarter of the TTL) and stops answering, so two never serve for long."""
    from kvpool.cluster.wire.etcd import EtcdClient, leader_key

    addresses = [ha.start_master() for _ in range(2)]
    old = ha.leader()
    client = EtcdClient(ha.etcd.url)
    try:
        client.delete(leader_key(ha.prefix))
    finally:
        client.close()

    def refused(address: str) -> bool:
        with MasterClient(address, config=ha.config(), request_timeout_s=2.0) as fixed:
            try:
                fixed.ping()
            except errors.NotLeaderError:
                return True
            return False

    def stepped_down() -> str | None:  # the old leader's term ended: a new term somewhere
        leader = ha.leader()
        with MasterClient(leader, config=ha.config(), request_timeout_s=2.0) as fixed:
            term = fixed.stats()["ha"]["term"]
        return leader if leader != old or term == 2 else None

    new = wait_for(stepped_down, 10, "the old leader to step down and a leader to be elected")
    other = next(a for a in addresses if a != new)
    wait_for(lambda: refused(other), 5, "the master not named in etcd to stop answering")
    assert not refused(new)
    print(f"old leader {old}, leader after the deletion {new}")


def test_health_of_leader_and_standby(ha: HA) -> None:
    """/health says which masters lead and which stand by; both are ready (a standby answers
    and takes over), so monitoring does not page for a healthy standby."""
    import urllib.request

    ports = {}
    for _ in range(2):
        port = free_tcp_port()
        ports[ha.start_master("--metrics.port", str(port))] = port
    leader = ha.leader()

    def health(address: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[address]}/health", timeout=5) as reply:
            assert reply.status == 200
            return json.loads(reply.read())

    for address in ports:
        wanted = "leader" if address == leader else "standby"
        got = wait_for(lambda address=address: (h := health(address)).get("master") and h, 10, "health")
        assert got["ready"] is True and got["master"] == wanted, (address, got)


def _followers_caught_up(ha: HA, standbys: int, behind: int = 0) -> Callable[[], bool]:
    """The leader's stats show ``standbys`` followers with at most ``behind`` changes left to
    fetch (under a stream of writes a follower is rarely seen at 0)."""
    def caught_up() -> bool:
        with MasterClient(config=ha.config(), request_timeout_s=5.0) as client:
            stream = client.stats()["change_stream"]
        followers = stream["followers"] if stream else {}
        return sum(f["behind"] <= behind and f["asked_s_ago"] < 1.0 for f in followers.values()) >= standbys
    return caught_up


def test_a_standby_that_followed_the_leader_takes_over_warm(ha: HA) -> None:
    """Warm standby: the standby follows the leader's change stream, so after a kill -9 of the
    leader it answers from the full index at once: gets succeed again within 5 s with no wrong
    bytes, every key is indexed the moment it leads, and no node had to re-register. A standby
    restarted meanwhile loads a snapshot and catches up before it is eligible."""
    ha.start_master()
    standby = ha.start_master()
    leader = ha.leader()
    if standby == leader:
        standby = next(a for a in ha.masters if a != leader)
    storage = ha.start_node("storage")
    ha.start_actor("writer", "plain", "--keys", "6", "--first", "0")
    durable = ha.start_actor("writer", "durable", "--keys", "6", "--first", "6", "--durable")
    assert durable.stop() == 0
    # Every node is older than the standby's copy (a node that registered within the takeover's
    # gap registers again, rightly): the reader starts before the standby is restarted.
    reader = ha.start_actor("stream", "reader", "--keys", "12", "--seconds", "16")
    # The standby is stopped and started again: it reloads from a snapshot before it may lead.
    ha.masters[standby].kill()
    standby = ha.start_master()
    wait_for(_followers_caught_up(ha, 1), 20, "the restarted standby to catch up")
    time.sleep(2.0)
    killed_at = time.time()
    ha.masters[leader].kill()
    assert ha.leader(other_than=leader, timeout_s=10.0) == standby
    with MasterClient(standby, config=ha.config(), request_timeout_s=5.0) as fixed:
        stats = fixed.stats()
    assert stats["takeover"]["warm"] is True, stats["takeover"]
    assert stats["takeover"]["keys"] == 12 and stats["durable_keys"] == 6
    wait_for(lambda: reader.popen.poll() is not None, 60, "the reader to finish")
    assert reader.popen.returncode == 0, reader.output()
    events = json.loads(reader.output().strip().splitlines()[-1])["events"]
    outcomes = [outcome for _t, outcome in events]
    assert "wrong" not in outcomes and "miss" not in outcomes, sorted(set(outcomes))
    last_failure = max((t for t, o in events if o != "ok"), default=killed_at)
    after = [t for t, o in events if t > last_failure]
    assert after and after[0] - killed_at <= 5.0, outcomes[-20:]
    print(f"warm failover gap {after[0] - killed_at:.2f} s ({len(events)} gets)")
    with MasterClient(standby, config=ha.config(), request_timeout_s=5.0) as fixed:
        stats = fixed.stats()
    # The nodes kept beating: none whose register the copy holds registered again. (A node that
    # registered within the takeover's gap, as seen from its in-flight beat, registers again.)
    after = ha.masters[standby].output().split("serving as master leader", 1)[1]
    storage_id = next(line.split("node ", 1)[1].split()[0] for line in storage.output().splitlines()
                      if "registered with master" in line)
    again = [line for line in after.splitlines() if " registered: " in line]
    assert not any(storage_id in line for line in again) and len(again) <= 1, again
    assert "warm:" in ha.masters[standby].output()


def test_a_master_without_a_copy_leads_cold_and_says_so(ha: HA) -> None:
    """A master started after the leader died has nothing to follow: it waits for a warm standby
    a while, then leads cold (log and stats say so) and the nodes re-register what they hold."""
    first = ha.start_master()
    assert ha.leader() == first
    ha.start_node("storage")
    ha.start_actor("writer", "plain", "--keys", "4", "--first", "0")
    ha.masters[first].kill()
    late = ha.start_master()
    assert ha.leader(other_than=first, timeout_s=20.0) == late
    with MasterClient(late, config=ha.config(), request_timeout_s=5.0) as fixed:
        takeover = fixed.stats()["takeover"]
        assert takeover["warm"] is False and "cold" in takeover["how"], takeover
        wait_for(lambda: fixed.stats()["keys"] == 4, 20, "the nodes to re-register their keys")
    assert "leading cold" in ha.masters[late].output() or "cold:" in ha.masters[late].output()


def test_acknowledged_durable_puts_survive_leaders_frozen_and_killed_mid_stream(ha: HA) -> None:
    """A writer makes durable puts back to back while the leader is frozen past its lease
    (SIGSTOP) five times and killed -9 once, each time a fraction of a second after a put was
    acknowledged: the standby takes over warm from a copy that may lack the last changes, and the
    nodes publish again what they changed since. With the writer gone (its own copies withdrawn),
    every acknowledged put is found, with exact bytes, on the storage node: 0 lost."""
    import kvpool
    from tests.cluster_actor import SMALL_SHAPE, content, key_of

    for _ in range(2):
        ha.start_master()
    ha.start_node("storage")
    writer = ha.start_actor("putstream", "writer", "--keys", "900", "--seconds", "36", "--durable", "--small")
    rng = np.random.default_rng(7)
    takeovers = []
    for round_ in range(6):
        wait_for(_followers_caught_up(ha, 1, behind=20), 30, f"the standby to catch up (round {round_})")
        time.sleep(float(rng.uniform(0.3, 1.2)))
        leader = ha.leader()
        if round_ < 5:
            ha.masters[leader].popen.send_signal(signal.SIGSTOP)
            new = ha.leader(other_than=leader, timeout_s=15.0)
            ha.masters[leader].popen.send_signal(signal.SIGCONT)  # it finds itself deposed: a standby
        else:
            ha.masters[leader].kill()
            new = ha.leader(other_than=leader, timeout_s=15.0)
            ha.start_master()
        with MasterClient(new, config=ha.config(), request_timeout_s=5.0) as fixed:
            takeovers.append(fixed.stats()["takeover"])
    assert all(t["warm"] for t in takeovers), takeovers
    wait_for(lambda: any(line.startswith("{") for line in writer.output().splitlines()), 120,
             "the writer to finish its puts")
    report = json.loads(next(line for line in writer.output().splitlines() if line.startswith("{")))
    failed = {int(i): error for i, error in report["failed"].items()}
    assert set(failed.values()) <= {"MasterUnreachableError", "NotLeaderError", "TransferError",
                                    "ReservationError"}, failed
    acked = report["ok"]
    assert len(acked) >= 300, report["failed"]
    assert writer.stop() == 0  # a clean leave: only the storage node's durable copies remain
    keys = [key_of(i) for i in acked]
    with MasterClient(config=ha.config(), request_timeout_s=5.0) as client:
        def missing() -> list[int]:
            found: list[bool] = []
            for lo in range(0, len(keys), 256):
                found += client.exists_many(keys[lo:lo + 256])
            return [i for i, there in zip(acked, found) if not there]
        try:
            wait_for(lambda: not missing(), 10, "every acknowledged durable put to be indexed")
        except AssertionError:
            at = dict(map(tuple, report["acked"]))  # type: ignore[arg-type]
            lost = missing()
            raise AssertionError(f"{len(lost)} of {len(acked)} acknowledged durable puts lost: "
                                 f"{[(i, at[i]) for i in lost][:20]}; takeovers {takeovers}") from None
        assert client.stats()["durable_keys"] >= len(acked)
    with kvpool.connect(config=ha.config()) as pool:
        wrong = [i for i in acked
                 if not np.array_equal(pool.get(key_of(i)), content(i, SMALL_SHAPE))]
    assert wrong == [], wrong
    print(f"{len(acked)} acknowledged durable puts, {len(failed)} failed typed, 0 lost across "
          f"{len(takeovers)} takeovers")
