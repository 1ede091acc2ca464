"""The master at scale: memory and lookup rate by keys indexed, many nodes heartbeating,
and re-registration after a master restart (what a failover costs).

It starts a real master process (``kvpool.cli.server --role master``, auth on) on 127.0.0.1
and drives it with the real client (``MasterClient``) from this process:

* keys: ``--nodes-with-keys`` simulated nodes publish records like a node's own (a
  ``--layers``-layer float16 object: spec, header with its layer checksums, tier) until
  10k, 100k, 1M ... keys are indexed (``--keys``); at each step the master's RSS, the
  single-key ``lookup`` rate with one request in flight, and batched ``exists`` of 1000
  keys (keys/s).
* heartbeats: ``--heartbeat-nodes`` nodes, each with its own ``Heartbeater`` thread and
  socket (the node code path), beat for ``--heartbeat-seconds`` at the default period;
  the master must declare none of them dead.
* failover: the master is killed (-9) and started again empty; the key-holding nodes
  re-register everything (as they do on a ``reregister`` answer) in parallel, and the
  time until every key is found again is printed.

    python bench/scale_bench.py [--keys 10000,100000,1000000] [--heartbeat-seconds 120]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import format_table, percentile  # noqa: E402
from kvpool.cluster import protocol as P  # noqa: E402
from kvpool.cluster.heartbeat import Heartbeater  # noqa: E402
from kvpool.cluster.master_client import MasterClient  # noqa: E402
from kvpool.objformat import ObjectHeader, ObjectSpec  # noqa: E402

TIERS = {"dram": {"capacity": 1 << 30, "free": 1 << 30}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


class Master:
    def __init__(self, address: str) -> None:
        self.address = address
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it; returns seconds until it answers."""
        started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli.server", "--role", "master",
                                      "--master.listen", self.address], cwd=REPO_ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with MasterClient(self.address, request_timeout_s=0.5) as probe:
            while True:
                try:
                    probe.ping()
                    return time.monotonic() - started
                except Exception:  # noqa: BLE001 - not up yet
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"master exited with {self.proc.returncode}") from None
                    time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class KeyNode:
    """A simulated node holding keys [first, stop): its records are built once and reused."""

    def __init__(self, index: int, spec: ObjectSpec) -> None:
        self.node_id = f"scale-node-{index:03d}"
        self.address = f"tcp://127.0.0.1:{20000 + index}"
        self.spec = spec
        self.records: list[P.ReplicaRecord] = []

    def reregister(self, address: str) -> Any:
        def send_all() -> None:
            with MasterClient(address, request_timeout_s=120) as client:
                client.register(self.node_id, self.address, "scale-host", TIERS, self.records)
        return send_all

    def add(self, first: int, stop: int) -> list[P.ReplicaRecord]:
        checksums = tuple(range(self.spec.layers))
        new = []
        for i in range(first, stop):
            key = b"scale-%012d" % i
            header = ObjectHeader.for_key(key, self.spec, checksums).pack()
            new.append(P.replica_record("dram", self.spec, self.spec.total_nbytes, key=key, header=header))
        self.records += new
        return new


def lookup_rate(address: str, keys: list[bytes], seconds: float) -> tuple[float, float, float]:
    """(single-key lookups/s, p50 us, p99 us) with one request in flight."""
    with MasterClient(address, request_timeout_s=10) as client:
        client.lookup([keys[0]])
        samples: list[float] = []
        end = time.perf_counter() + seconds
        i = 0
        while True:
            t = time.perf_counter()
            if t >= end:
                break
            client.lookup([keys[i % len(keys)]])
            samples.append(time.perf_counter() - t)
            i += 1
    return len(samples) / seconds, percentile(samples, 50) * 1e6, percentile(samples, 99) * 1e6


def exists_rate(address: str, keys: list[bytes], rounds: int = 20) -> float:
    """Keys/s of batched exists, 1000 keys per request."""
    with MasterClient(address, request_timeout_s=30) as client:
        batch = keys[:1000]
        assert all(client.exists_many(batch))
        t = time.perf_counter()
        for _ in range(rounds):
            client.exists_many(batch)
        return rounds * len(batch) / (time.perf_counter() - t)


def wait_until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout_s} s")
        time.sleep(0.05)
    return True


def _stats(address: str) -> dict[str, Any]:
    with MasterClient(address, request_timeout_s=60) as client:
        return client.stats()


def _alive(address: str) -> int:
    return sum(1 for n in _stats(address)["nodes"].values() if n["alive"])


def _keys(address: str) -> int:
    try:
        return int(_stats(address)["keys"])
    except Exception:  # noqa: BLE001 - the master is busy re-indexing: ask again
        return -1


def publish_all(address: str, work: list[tuple[KeyNode, list[P.ReplicaRecord]]]) -> float:
    """The nodes publish their new records one after the other (one thread: this process's
    heartbeat threads must not starve behind eight threads packing huge batches); seconds taken."""
    started = time.perf_counter()
    with MasterClient(address, request_timeout_s=120) as client:
        for node, records in work:
            client.publish(node.node_id, records)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="10000,100000,1000000", help="key counts to measure at (ascending)")
    parser.add_argument("--layers", type=int, default=32, help="layers per object (the header holds a checksum each)")
    parser.add_argument("--nodes-with-keys", type=int, default=8)
    parser.add_argument("--lookup-seconds", type=float, default=2.0)
    parser.add_argument("--heartbeat-nodes", type=int, default=100)
    parser.add_argument("--heartbeat-seconds", type=float, default=120.0)
    args = parser.parse_args()
    steps = sorted(int(k) for k in args.keys.split(","))
    spec = ObjectSpec("float16", args.layers, 256, 8, 128)
    address = f"tcp://127.0.0.1:{_free_port()}"
    master = Master(address)
    master.start()
    nodes = [KeyNode(i, spec) for i in range(args.nodes_with_keys)]
    print(f"master {address} (pid {master.proc.pid if master.proc else '?'}); {os.cpu_count()} CPUs; "
          f"{args.layers}-layer objects, header {len(ObjectHeader.for_key(b'k', spec, (0,) * args.layers).pack())} B",
          file=sys.stderr)
    rows: list[list[Any]] = []
    key_beaters: list[Heartbeater] = []
    beaters: list[Heartbeater] = []
    try:
        for node in nodes:
            # Registered by its first beat; after a master restart the beat's answer makes it
            # re-register everything it holds, as a real node does.
            key_beaters.append(Heartbeater(lambda: MasterClient(address, request_timeout_s=120), node.node_id, 1.0,
                                           lambda: TIERS, node.reregister(address)).start())
            key_beaters[-1].beat_now()
        wait_until(lambda: _alive(address) >= len(nodes), 30)
        base_rss = rss_mib(master.proc.pid)  # type: ignore[union-attr]
        indexed = 0
        for target in steps:
            work = []
            per_node = (target - indexed) // len(nodes)
            for n, node in enumerate(nodes):
                first = indexed + n * per_node
                stop = target if n == len(nodes) - 1 else first + per_node
                work.append((node, node.add(first, stop)))
            publish_s = publish_all(address, work)
            indexed = target
            with MasterClient(address, request_timeout_s=60) as client:
                assert client.stats()["keys"] == target
            keys = [b"scale-%012d" % i for i in range(0, target, max(1, target // 5000))]
            rate, p50, p99 = lookup_rate(address, keys, args.lookup_seconds)
            rows.append([f"{target:,}", f"{rss_mib(master.proc.pid):.0f}",  # type: ignore[union-attr]
                         f"{(rss_mib(master.proc.pid) - base_rss) * (1 << 20) / target:.0f}",  # type: ignore[union-attr]
                         f"{target / publish_s:,.0f}", f"{rate:,.0f}", f"{p50:.0f}", f"{p99:.0f}",
                         f"{exists_rate(address, keys):,.0f}"])
            print(format_table(["keys", "master RSS MiB", "B/key", "publish keys/s", "lookups/s (1 in flight)",
                                "p50 us", "p99 us", "exists keys/s (1000/req)"], rows[-1:]), file=sys.stderr)

        # Heartbeats from many nodes: none may be declared dead.
        for i in range(args.heartbeat_nodes):
            node_id = f"beat-node-{i:03d}"

            def reregister(node_id: str = node_id, i: int = i) -> None:
                with MasterClient(address, request_timeout_s=30) as c:
                    c.register(node_id, f"tcp://127.0.0.1:{30000 + i}", "scale-host", TIERS)

            reregister()
            beaters.append(Heartbeater(lambda: MasterClient(address, request_timeout_s=30), node_id, 1.0,
                                       lambda: TIERS, reregister).start())
        time.sleep(args.heartbeat_seconds)
        with MasterClient(address, request_timeout_s=30) as client:
            stats = client.stats()
        for beater in beaters:
            beater.stop()
        beaters.clear()
        dead = stats["counters"]["nodes_dead"]
        alive_beaters = sum(1 for nid, n in stats["nodes"].items() if nid.startswith("beat-node") and n["alive"])

        # Failover: a new master with nothing; every key-holding node is told to re-register at
        # its next beat and sends everything it holds.
        master.kill()
        started = time.monotonic()
        up_s = master.start()
        found = wait_until(lambda: _keys(address) == indexed, 600) and _keys(address)
        register_s = time.monotonic() - started
        print()
        print(format_table(["keys", "master RSS MiB", "B/key", "publish keys/s", "lookups/s (1 in flight)",
                            "p50 us", "p99 us", "exists keys/s (1000/req)"], rows))
        print()
        print(format_table(["check", "result"], [
            [f"{args.heartbeat_nodes} nodes beating 1/s for {args.heartbeat_seconds:.0f} s",
             f"{alive_beaters} alive, {dead} declared dead"],
            ["master restart: up and answering", f"{up_s:.2f} s"],
            [f"restart -> all {indexed:,} keys of {len(nodes)} nodes indexed again",
             f"{register_s:.2f} s ({indexed / register_s:,.0f} keys/s), {found:,} found"],
        ]))
        return 0 if dead == 0 and found == indexed else 1
    finally:
        for beater in key_beaters + beaters:  # before the master goes, and before zmq is torn down
            beater.stop()
        master.stop()


if __name__ == "__main__":
    sys.exit(main())
