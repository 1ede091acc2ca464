"""The cluster between emulated hosts: a master, two storage nodes, a writer and readers,
each in its own network namespace with its own address (tests/netns.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster_actor import content
from tests.conftest import wait_for
from tests.test_cluster import node_config
from tests.netns import Host, Lab, lab_or_skip

LAYER_NBYTES = content(0)[0].nbytes
KEYS = 4

PROBE = """
import json, sys
from kvpool.master_client import MasterClient, control_call
from kvpool.node import NodeAddress
with MasterClient(sys.argv[1], request_timeout_s=5) as client:
    stats = client.stats()
    alive = {nid: n for nid, n in stats["nodes"].items() if n["alive"]}
    sent = {nid: control_call(NodeAddress.decode(n["address"]).control, "stats", {}, timeout_s=5)["transfer"]["bytes_sent"]
            for nid, n in alive.items()}
    print(json.dumps({"alive": sorted(alive), "sent": sent, "keys": client.lookup([b"cluster-key-%04d" % i for i in range({keys})])}))
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
        return self.lab.spawn(self.h1, ["-m", "kvpool.daemon", "--role", "master", "--master.listen",
                                        self.master_address, "--master.heartbeat_ms", "200",
                                        "--master.dead_after_missed", "3"],
                              log, ready=lambda: "listening on" in log.read_text())

    def start_node(self, host: Host, name: str, *, auto_host: bool = False) -> Any:
        data_dir = self.tmp_path / name
        config = self.tmp_path / f"{name}.toml"
        # auto_host: node.host left to its default (the route to the master)
        config.write_text(node_config(name, data_dir, self.master_address, None if auto_host else host.address))
        log = self.tmp_path / f"{name}.log"
        return self.lab.spawn(host, ["-m", "kvpool.daemon", "--role", "node", "--config", str(config)], log,
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
