"""The cluster between emulated hosts: a master, two storage nodes, a writer and readers,
each in its own network namespace with its own address (tests/netns.py)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster_actor import content
from tests.conftest import wait_for
from tests.netns import Host, Lab, lab_or_skip
from tests.test_cluster import node_config

pytestmark = pytest.mark.slow  # clusters across network namespaces

LAYER_NBYTES = content(0)[0].nbytes
KEYS = 4

PROBE = """
import json, sys
from kvpool.cluster.wire.control import control_call
from kvpool.cluster.wire.master_client import MasterClient
from kvpool.cluster.node.server import NodeAddress
with MasterClient(sys.argv[1], request_timeout_s=5) as client:
    stats = client.stats()
    alive = {nid: n for nid, n in stats["nodes"].items() if n["alive"]}
    sent = {nid: control_call(NodeAddress.decode(n["address"]).control, "stats", {},
                              timeout_s=5, cluster_key=client.cluster_key)["transfer"]["bytes_sent"]
            for nid, n in alive.items()}
    keys = client.lookup([b"cluster-key-%04d" % i for i in range({keys})])
    print(json.dumps({"alive": sorted(alive), "sent": sent, "keys": keys}))
""".replace("{keys}", str(KEYS))


class Hosts:
    """The lab's four hosts and what runs on them: h1 master (and the readers), h2/h3 storage nodes, h4 writer."""

    def __init__(self, lab: Lab, tmp_path: Path) -> None:
        self.lab, self.tmp_path = lab, tmp_path
        self.h1, self.h2, self.h3, self.h4 = lab.hosts
        self.master_address = f"tcp://{self.h1.address}:7700"  # each namespace has its own port space
        self.readers = 0

    def start_master(self) -> Any:
        log = self.tmp_path / f"master-{time.monotonic_ns()}.log"
        return self.lab.spawn(self.h1, ["-m", "kvpool.cli.server", "--role", "master", "--master.listen",
                                        self.master_address, "--master.heartbeat_ms", "200",
                                        "--master.dead_after_missed", "3"],
                              log, ready=lambda: "listening on" in log.read_text())

    def start_node(self, host: Host, name: str, *, auto_host: bool = False) -> Any:
        data_dir = self.tmp_path / name
        config = self.tmp_path / f"{name}.toml"
        # auto_host: node.host left to its default (the route to the master)
        config.write_text(node_config(name, data_dir, self.master_address, None if auto_host else host.address))
        log = self.tmp_path / f"{name}.log"
        return self.lab.spawn(host, ["-m", "kvpool.cli.server", "--role", "node", "--config", str(config)], log,
                              ready=lambda: "ready" in log.read_text())

    def actor(self, host: Host | None, role: str, name: str, *args: str) -> list[str]:
        """A cluster_actor command; ``host`` None leaves node.host to its default (auto)."""
        return ["-m", "tests.cluster_actor", role, "--master", self.master_address, "--name", name,
                "--data-dir", str(self.tmp_path / name), *(["--host", host.address] if host else []),
                "--keys", str(KEYS), *args]

    def read(self, *args: str) -> dict[str, Any]:
        """A reader process on h1 gets every key; its JSON result."""
        self.readers += 1
        name = f"reader-{self.readers}"
        log = self.tmp_path / f"{name}.log"
        child = self.lab.spawn(self.h1, self.actor(None, "reader", name, *args), log)  # node.host: auto
        wait_for(lambda: child.popen.poll() is not None, 90, f"{name} to finish")
        lines = [line for line in child.output().splitlines() if line.startswith("{")]
        assert child.popen.returncode == 0 and lines, child.output()
        return json.loads(lines[-1])

    def probe(self) -> dict[str, Any]:
        done = self.lab.run(self.h1, [sys.executable, "-c", PROBE, self.master_address])
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_a_cluster_across_network_namespaces(tmp_path: Path) -> None:
    lab = lab_or_skip(4, rate="1gbit")
    try:
        hosts = Hosts(lab, tmp_path)
        h1, h2, h3, h4 = lab.hosts
        master = hosts.start_master()
        store_a = hosts.start_node(h2, "store-a")
        hosts.start_node(h3, "store-b", auto_host=True)
        wait_for(lambda: len(hosts.probe()["alive"]) == 2, 20, "both storage nodes to register")
        log = tmp_path / "writer.log"
        writer = lab.spawn(h4, hosts.actor(h4, "writer", "writer", "--durable", "--replicas", "2"), log,
                           ready=lambda: "READY" in log.read_text())

        # Exact bytes, and a layer range moves exactly those layers' bytes over the network.
        before = hosts.probe()
        assert before["keys"] == KEYS and len(before["alive"]) == 3
        for transport in ("tcp", "auto"):
            result = hosts.read("--layers", "2:5", "--transport", transport)
            assert (result["ok"], result["miss"], result["wrong"]) == (KEYS, 0, 0), (transport, result)
        after = hosts.probe()
        moved = sum(after["sent"][nid] - before["sent"][nid] for nid in before["sent"])
        assert moved == 2 * KEYS * 3 * LAYER_NBYTES

        # Every listener binds its host's own address: nothing on 0.0.0.0, ::, or loopback.
        for host in lab.hosts:
            listening = lab.listeners(host)
            print(host.name, listening)
            assert listening, host.name  # master (h1), node control and UCX sockets (h2-h4)
            for address, process in listening:
                assert address.rsplit(":", 1)[0] == host.address, (host.name, address, process)

        # The writer and then one storage node die: the durable copies still serve every key.
        writer.kill()
        store_a.kill()
        wait_for(lambda: len(hosts.probe()["alive"]) == 1, 10, "the master to declare both dead")
        result = hosts.read()
        assert (result["ok"], result["miss"], result["wrong"]) == (KEYS, 0, 0), result

        # The master restarts with nothing; the surviving node re-registers its keys.
        master.kill()
        hosts.start_master()
        wait_for(lambda: hosts.probe()["keys"] == KEYS, 20, "keys to be found again after re-registration")
        result = hosts.read("--transport", "tcp")
        assert (result["ok"], result["miss"], result["wrong"]) == (KEYS, 0, 0), result
    finally:
        lab.close()


@pytest.mark.timeout(300)
def test_ha_masters_on_two_hosts_fail_over_to_each_other(tmp_path: Path) -> None:
    """etcd on h1, a master on h1 and one on h2, a storage node on h3, a durable writer on h4:
    clients and nodes find the leader through etcd from their own hosts, and when the leader's
    host loses its master (kill -9) the other host's master takes over and every key is read
    back exact from another host."""
    etcd_binary = shutil.which("etcd")
    if etcd_binary is None:
        pytest.skip("no etcd binary (Debian: apt-get install etcd-server)")
    lab = lab_or_skip(4)
    try:
        h1, h2, h3, h4 = lab.hosts
        url = f"http://{h1.address}:2379"
        lab.spawn(h1, ["-c", "import os, sys; os.execvp(sys.argv[1], sys.argv[1:])", etcd_binary,
                       "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", url, "--advertise-client-urls",
                       url, "--listen-peer-urls", f"http://{h1.address}:2380",
                       "--initial-advertise-peer-urls", f"http://{h1.address}:2380",
                       "--initial-cluster", f"default=http://{h1.address}:2380"],
                  tmp_path / "etcd.log", ready=lambda: "ready to serve client requests" in
                  (tmp_path / "etcd.log").read_text())
        ha = ["--master.etcd", url, "--master.heartbeat_ms", "200"]
        masters = {}
        for host in (h1, h2):
            address = f"tcp://{host.address}:7700"
            log = tmp_path / f"master-{host.name}.log"
            masters[address] = lab.spawn(host, ["-m", "kvpool.cli.server", "--role", "master", "--master.listen",
                                                address, *ha], log, ready=lambda log=log: "standby" in
                                         log.read_text() or "elected" in log.read_text())
        config = tmp_path / "store.toml"
        config.write_text(node_config("store", tmp_path / "store", "tcp://127.0.0.1:7700"))
        log = tmp_path / "store.log"
        lab.spawn(h3, ["-m", "kvpool.cli.server", "--role", "node", "--config", str(config), *ha], log,
                  ready=lambda: "ready" in log.read_text())
        actor = ["-m", "tests.cluster_actor", "--etcd", url, "--keys", str(KEYS)]
        log = tmp_path / "writer.log"
        lab.spawn(h4, [*actor[:2], "writer", *actor[2:], "--name", "writer", "--data-dir",
                       str(tmp_path / "writer"), "--durable"], log, ready=lambda: "READY" in log.read_text())

        def read(name: str) -> dict[str, Any]:
            log = tmp_path / f"{name}.log"
            child = lab.spawn(h2, [*actor[:2], "reader", *actor[2:], "--name", name, "--data-dir",
                                   str(tmp_path / name)], log)
            wait_for(lambda: child.popen.poll() is not None, 90, f"{name} to finish")
            lines = [line for line in child.output().splitlines() if line.startswith("{")]
            assert child.popen.returncode == 0 and lines, child.output()
            return json.loads(lines[-1])

        def leader() -> str | None:
            done = lab.run(h3, [sys.executable, "-c", "import sys; from kvpool.cluster.wire.etcd import masters; "
                                "print(masters(sys.argv[1], '/kvpool')[0])", url])
            return done.stdout.strip() if done.returncode == 0 else None

        first = wait_for(lambda: leader() in masters and leader(), 20, "a leader")
        result = read("reader-1")
        assert (result["ok"], result["miss"], result["wrong"]) == (KEYS, 0, 0), result
        masters[first].kill()
        second = wait_for(lambda: (lambda now: now if now in masters and now != first else None)(leader()),
                          20, "the other host's master to lead")
        assert second.split("//")[1].split(":")[0] != first.split("//")[1].split(":")[0]
        # The durable copies on h3 re-register with the new leader; a reader on h2 finds them.
        wait_for(lambda: read(f"reader-{time.monotonic_ns()}")["ok"] == KEYS, 30, "every key after the failover")
        # Both masters listened on their own host's address only.
        for host in (h1, h2):
            for address, process in lab.listeners(host):
                if "python" in process:
                    assert address.rsplit(":", 1)[0] == host.address, (host.name, address, process)
    finally:
        lab.close()
