"""The master at scale: memory and lookup rate by keys indexed, many nodes heartbeating,
re-registration after a master restart (a cold failover), and with ``--ha`` a warm standby's
failover.

It starts a real master process (``kvpool.cli.server --role master``, auth on) on 127.0.0.1
and drives it with the real client (``MasterClient``) from this process:

* keys: ``--nodes-with-keys`` simulated nodes publish records like a node's own (a
  ``--layers``-layer float16 object's spec and size, a 16-byte key, a header checksum, tier
  dram; built with numpy, byte for byte what a real node sends, ``--batch`` per request, the
  next built while the master indexes one; ``--publishers`` nodes at a time) until 10k, 100k,
  1M ... keys are indexed (``--keys``); at each step the master's RSS (and per key), the
  publish rate (keys per wall-clock second of the step's publishing, and per CPU second of
  the master, which a shared machine skews less), the single-key ``lookup`` rate and
  latency with one request in flight, batched ``exists`` of 1000 keys (keys/s), and the
  latency of one ``lookup`` of a ``--chain``-hash prefix (a 128k-token prompt is 1000 chunks).
* heartbeats: ``--heartbeat-nodes`` nodes, each with its own ``Heartbeater`` thread and
  socket (the node code path), beat for ``--heartbeat-seconds`` at the default period;
  the master must declare none of them dead.
* failover without a standby: the master is killed (-9) and started again empty; the
  key-holding nodes re-register everything (as they do on a ``reregister`` answer) and the
  time until every key is found again is printed.
* ``--ha``: etcd and two masters; the keys are published to the leader while the standby
  follows its change stream; the leader is killed (-9) and the time until the standby is
  elected and until every sampled key hits again is printed, then a new standby's snapshot
  catch-up.

    python bench/scale_bench.py [--keys 10000,100000,1000000,10000000] [--heartbeat-seconds 120]
    python bench/scale_bench.py --ha --keys 10000000
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import format_table, percentile  # noqa: E402
from kvpool import errors  # noqa: E402
from kvpool.cluster.node.heartbeat import Heartbeater  # noqa: E402
from kvpool.cluster.wire import protocol as P  # noqa: E402
from kvpool.cluster.wire.master_client import MasterClient  # noqa: E402
from kvpool.config import Config  # noqa: E402
from kvpool.objformat import ObjectHeader, ObjectSpec  # noqa: E402

TIERS = {"dram": {"capacity": 1 << 30, "free": 1 << 30}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


class Master:
    def __init__(self, address: str, extra_args: list[str] | None = None) -> None:
        self.address = address
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it; returns seconds until it answers."""
        started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli.server", "--role", "master",
                                      "--master.listen", self.address, *self.extra_args], cwd=REPO_ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with MasterClient(self.address, request_timeout_s=0.5) as probe:
            while True:
                try:
                    probe.ping()
                    return time.monotonic() - started
                except errors.NotLeaderError:  # a standby: up, following the leader
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


_M64 = (1 << 64) - 1


def bench_key(i: int) -> bytes:
    """Key ``i``: 16 bytes that look like a prefix hash (splitmix64 of i and of ~i)."""
    return _splitmix(i).to_bytes(8, "little") + _splitmix(i ^ _M64).to_bytes(8, "little")


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _splitmix_vec(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class RecordFrames:
    """The msgpack of a node's publish batches, built with numpy: every record is byte for byte
    what a real node sends for a ``--layers``-layer object in dram (``replica_record`` of tier
    dram, the spec, its size, the key, the header checksum and an empty location, encoded by
    msgspec as ``MasterClient`` does; only key and checksum differ from record to record).
    Keys are :func:`bench_key`; each checksum a distinct 64-bit value at or above 2**32 (as
    good as every real one: a 64-bit checksum is below that once in four billion)."""

    def __init__(self, spec: ObjectSpec) -> None:
        import msgspec

        from kvpool.cluster.master.bulk import record_layout

        template = msgspec.msgpack.encode(P.replica_record("dram", spec, spec.total_nbytes, key=bytes(16),
                                                           header_sum=1 << 63, location={}))
        layout = record_layout(template)
        assert layout is not None
        _, self.key_at, self.sum_at = layout
        self.template = np.frombuffer(template, np.uint8)
        self.width = len(template)

    def batch(self, first: int, stop: int) -> Any:
        """msgspec.Raw of the list of records of keys [first, stop)."""
        import msgspec

        n = stop - first
        ids = np.arange(first, stop, dtype=np.uint64)
        rows = np.empty((n, self.width), np.uint8)
        rows[:] = self.template
        k, c = self.key_at, self.sum_at
        rows[:, k:k + 8] = _splitmix_vec(ids).astype("<u8").view(np.uint8).reshape(n, 8)
        rows[:, k + 8:k + 16] = _splitmix_vec(ids ^ np.uint64(_M64)).astype("<u8").view(np.uint8).reshape(n, 8)
        sums = _splitmix_vec(ids ^ np.uint64(0x5555555555555555)) | np.uint64(1 << 32)
        rows[:, c:c + 8] = sums.astype(">u8").view(np.uint8).reshape(n, 8)
        header = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else \
            b"\xdd" + n.to_bytes(4, "big")  # msgpack's array header, as msgspec writes it
        return msgspec.Raw(header + rows.tobytes())


class KeyNode:
    """A simulated node holding keys in ranges; its records are built when sent, never kept."""

    def __init__(self, index: int, frames: RecordFrames, batch: int) -> None:
        self.node_id = f"scale-node-{index:03d}"
        self.address = f"tcp://127.0.0.1:{20000 + index}"
        self.frames = frames
        self.batch = batch
        self.ranges: list[tuple[int, int]] = []

    def batches(self, ranges: list[tuple[int, int]]) -> Iterator[Any]:
        for first, stop in ranges:
            for lo in range(first, stop, self.batch):
                yield self.frames.batch(lo, min(stop, lo + self.batch))

    def send(self, client: MasterClient, ranges: list[tuple[int, int]], *, register: bool) -> float:
        """Register (when asked: replacing what the master believed) with the first batch and
        publish the rest; each batch is built while the master indexes the one before.
        Returns the seconds spent waiting for the master."""
        waited = 0.0
        batches = self.batches(ranges)
        nxt: list[Any] = [next(batches, None)]
        if nxt[0] is None and register:
            nxt[0] = self.frames.batch(0, 0)

        def build() -> None:
            nxt[0] = next(batches, None)

        first = True
        while nxt[0] is not None:
            objects = nxt[0]
            if first and register:
                op, body = P.REGISTER, {"node_id": self.node_id, "address": self.address, "host_id": "scale-host",
                                        "tiers": TIERS, "objects": objects}
            else:
                op, body = P.PUBLISH, {"node_id": self.node_id, "objects": objects}
            first = False
            started = time.perf_counter()
            client.call(op, body, meanwhile=build)
            waited += time.perf_counter() - started
        return waited

    def reregister(self, connect: Any) -> Any:
        def send_all() -> None:
            with connect() as client:
                self.send(client, self.ranges, register=True)
        return send_all


def real_node_encoding(spec: ObjectSpec, n: int) -> tuple[float, float]:
    """(records/s, records/s) a real node builds its records (``replica_record``, as
    ``record_for`` does, less the header checksum it computes) and encodes them into a publish
    (``pack_request``, as ``MasterClient`` does): the CPU a real node spends, on its own
    machine, for what the simulated nodes build with numpy."""
    keys = [bench_key(i) for i in range(n)]
    started = time.perf_counter()
    records = [P.replica_record("dram", spec, spec.total_nbytes, key=key, header_sum=(1 << 63) | i, location={})
               for i, key in enumerate(keys)]
    built = time.perf_counter()
    P.pack_request(1, P.PUBLISH, {"node_id": "n", "objects": records})
    return n / (built - started), n / (time.perf_counter() - built)


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


def publish_all(address: str, work: list[tuple[KeyNode, tuple[int, int]]], publishers: int = 1) -> float:
    """The nodes publish their new keys, ``publishers`` of them at a time (each on its own
    thread and connection, so the master finds the next request waiting when it answers one;
    more would starve this process's heartbeat threads); wall seconds until all are done
    (each builds its next batch while the master indexes the one before)."""
    import threading

    for node, span in work:
        node.ranges.append(span)
    failed: list[BaseException] = []

    def run(share: list[tuple[KeyNode, tuple[int, int]]]) -> None:
        try:
            with MasterClient(address, request_timeout_s=120) as client:
                for node, span in share:
                    node.send(client, [span], register=False)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failed.append(exc)

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(work[i::publishers],)) for i in range(publishers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return time.perf_counter() - started


def chain_lookup(address: str, keys: list[bytes], iters: int) -> tuple[float, float]:
    """(p50, p99) ms of one ``lookup`` of the whole chain ``keys`` (all cached), one in flight."""
    samples = []
    with MasterClient(address, request_timeout_s=10) as client:
        assert client.lookup(keys) == len(keys)
        for _ in range(iters):
            t = time.perf_counter()
            client.lookup(keys)
            samples.append(time.perf_counter() - t)
    return percentile(samples, 50) * 1e3, percentile(samples, 99) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="10000,100000,1000000", help="key counts to measure at (ascending)")
    parser.add_argument("--layers", type=int, default=32, help="layers per object (the header holds a checksum each)")
    parser.add_argument("--nodes-with-keys", type=int, default=8)
    parser.add_argument("--publishers", type=int, default=1,
                        help="nodes publishing at the same time (each on its own thread and connection)")
    parser.add_argument("--batch", type=int, default=65536, help="records per publish request")
    parser.add_argument("--lookup-seconds", type=float, default=2.0)
    parser.add_argument("--chain", type=int, default=1000, help="hashes in the prefix-lookup chain")
    parser.add_argument("--chain-iters", type=int, default=500)
    parser.add_argument("--heartbeat-nodes", type=int, default=100)
    parser.add_argument("--heartbeat-seconds", type=float, default=120.0)
    parser.add_argument("--no-failover", action="store_true", help="skip the kill -9 and cold re-registration")
    parser.add_argument("--master-arg", action="append", default=[], help="extra master flag (repeatable)")
    parser.add_argument("--ha", action="store_true",
                        help="two masters in etcd (etcd on PATH): index the keys on the leader, let the standby "
                             "catch up, kill -9 the leader, time until every sampled key is a hit again")
    args = parser.parse_args()
    if args.ha:
        return ha_failover(args)
    steps = sorted(int(k) for k in args.keys.split(","))
    spec = ObjectSpec("float16", args.layers, 256, 8, 128)
    address = f"tcp://127.0.0.1:{_free_port()}"
    master = Master(address, args.master_arg)
    master.start()
    frames = RecordFrames(spec)
    nodes = [KeyNode(i, frames, args.batch) for i in range(args.nodes_with_keys)]
    print(f"master {address} (pid {master.proc.pid if master.proc else '?'}); {os.cpu_count()} CPUs; "
          f"{args.layers}-layer objects, header {len(ObjectHeader.for_key(b'k', spec, (0,) * args.layers).pack())} B",
          file=sys.stderr)
    headers = ["keys", "master RSS MiB", "RSS B/key", "B/key over empty", "publish keys/s",
               "per master CPU s",
               "lookups/s (1 in flight)", "p50 us", "p99 us", "exists keys/s (1000/req)",
               f"lookup {args.chain}-chain p50 ms", "p99 ms"]
    rows: list[list[Any]] = []
    key_beaters: list[Heartbeater] = []
    beaters: list[Heartbeater] = []
    try:
        for node in nodes:
            # Registered by its first beat; after a master restart the beat's answer makes it
            # re-register everything it holds, as a real node does.
            key_beaters.append(Heartbeater(lambda: MasterClient(address, request_timeout_s=120), node.node_id, 1.0,
                                           lambda: TIERS,
                                           node.reregister(lambda: MasterClient(address, request_timeout_s=120)))
                               .start())
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
                work.append((node, (first, stop)))
            cpu_before = cpu_s(master.proc.pid)  # type: ignore[union-attr]
            publish_s = publish_all(address, work, args.publishers)
            publish_cpu_s = cpu_s(master.proc.pid) - cpu_before  # type: ignore[union-attr]
            indexed = target
            with MasterClient(address, request_timeout_s=60) as client:
                assert client.stats()["keys"] == target
            keys = [bench_key(i) for i in range(0, target, max(1, target // 5000))]
            rate, p50, p99 = lookup_rate(address, keys, args.lookup_seconds)
            chain_at = (target // 2) // args.chain * args.chain
            chain = [bench_key(i) for i in range(chain_at, chain_at + min(args.chain, target))]
            chain_p50, chain_p99 = chain_lookup(address, chain, args.chain_iters)
            rss = rss_mib(master.proc.pid)  # type: ignore[union-attr]
            rows.append([f"{target:,}", f"{rss:.0f}", f"{rss * (1 << 20) / target:.0f}",
                         f"{(rss - base_rss) * (1 << 20) / target:.0f}",
                         f"{sum(b - a for _, (a, b) in work) / publish_s:,.0f}",
                         f"{sum(b - a for _, (a, b) in work) / max(publish_cpu_s, 1e-3):,.0f}",
                         f"{rate:,.0f}", f"{p50:.0f}", f"{p99:.0f}", f"{exists_rate(address, keys):,.0f}",
                         f"{chain_p50:.2f}", f"{chain_p99:.2f}"])
            print(format_table(headers, rows[-1:]), file=sys.stderr)

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
        checks = [[f"{args.heartbeat_nodes} nodes beating 1/s for {args.heartbeat_seconds:.0f} s",
                   f"{alive_beaters} alive, {dead} declared dead"],
                  ["index", str(stats.get("index"))]]
        build_rate, encode_rate = real_node_encoding(spec, min(args.batch, 65536))
        checks.append(["a real node's records for a publish (replica_record / pack_request)",
                       f"built {build_rate:,.0f}/s, encoded {encode_rate:,.0f}/s (the simulated nodes build "
                       f"the same bytes with numpy)"])
        found = indexed
        if not args.no_failover:
            # Failover without a standby: a new master with nothing; every key-holding node is
            # told to re-register at its next beat and sends everything it holds.
            master.kill()
            started = time.monotonic()
            up_s = master.start()
            found = wait_until(lambda: _keys(address) == indexed, 900) and _keys(address)
            register_s = time.monotonic() - started
            checks += [["master restart (no standby): up and answering", f"{up_s:.2f} s"],
                       [f"restart -> all {indexed:,} keys of {len(nodes)} nodes indexed again",
                        f"{register_s:.2f} s ({indexed / register_s:,.0f} keys/s), {found:,} found"]]
        print()
        print(format_table(headers, rows))
        print()
        print(format_table(["check", "result"], checks))
        return 0 if dead == 0 and found == indexed else 1
    finally:
        for beater in key_beaters + beaters:  # before the master goes, and before zmq is torn down
            beater.stop()
        master.stop()


def ha_failover(args: Any) -> int:
    """--ha: warm standby failover at the largest of --keys (see --help)."""
    import shutil
    import tempfile

    etcd_bin = shutil.which("etcd")
    if etcd_bin is None:
        print("no etcd binary on PATH (Debian: apt-get install etcd-server)", file=sys.stderr)
        return 2
    keys_total = max(int(k) for k in args.keys.split(","))
    spec = ObjectSpec("float16", args.layers, 256, 8, 128)
    tmp = tempfile.mkdtemp(prefix="kvpool-ha-bench-")
    port, peer = _free_port(), _free_port()
    url = f"http://127.0.0.1:{port}"
    etcd = subprocess.Popen([etcd_bin, "--name", "bench", "--data-dir", f"{tmp}/etcd",
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"bench=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefix = f"/kvpool-bench-{os.getpid()}"
    flags = ["--master.etcd", url, "--master.etcd_prefix", prefix, *args.master_arg]
    config = Config.load({"master": {"etcd": url, "etcd_prefix": prefix}})
    from kvpool.cluster.wire.etcd import masters as etcd_masters

    def connect() -> MasterClient:
        return MasterClient(config=config, request_timeout_s=120)

    def leader(other_than: str | None = None) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                current = etcd_masters(url, prefix)[0]
            except errors.KVPoolError:
                current = None
            if current is not None and current != other_than:
                return current
            time.sleep(0.02)
        raise TimeoutError("no leader")

    started_masters = [Master(f"tcp://127.0.0.1:{_free_port()}", flags) for _ in range(2)]
    beaters: list[Heartbeater] = []
    rows: list[list[str]] = []
    try:
        time.sleep(0.5)
        for m in started_masters:
            m.start()
        first = leader()
        frames = RecordFrames(spec)
        nodes = [KeyNode(i, frames, args.batch) for i in range(args.nodes_with_keys)]
        for node in nodes:
            beaters.append(Heartbeater(connect, node.node_id, 1.0, lambda: TIERS, node.reregister(connect)).start())
            beaters[-1].beat_now()
        wait_until(lambda: _alive(first) >= len(nodes), 30)  # registered by their first beats
        per_node = keys_total // len(nodes)
        t = time.perf_counter()
        waited = 0.0
        with connect() as client:
            for n, node in enumerate(nodes):
                span = (n * per_node, keys_total if n == len(nodes) - 1 else (n + 1) * per_node)
                node.ranges.append(span)
                waited += node.send(client, [span], register=False)
        rows.append([f"{keys_total:,} keys published to the leader (standby following)",
                     f"{time.perf_counter() - t:.1f} s ({keys_total / waited:,.0f} keys/s in publish round trips)"])

        def caught_up() -> dict[str, Any] | None:
            with connect() as client:
                stats = client.stats()
            followers = (stats.get("change_stream") or {}).get("followers", {})
            done = [f for f in followers.values() if f["behind"] == 0 and f["asked_s_ago"] < 1.0]
            return stats if done else None

        t = time.perf_counter()
        wait_until(lambda: caught_up() is not None, 900)
        rows.append(["standby caught up after the last publish", f"{time.perf_counter() - t:.1f} s"])
        pids = {m.address: m.proc.pid for m in started_masters if m.proc is not None}
        rows.append(["RSS leader / standby", " / ".join(
            f"{rss_mib(pids[a]):.0f} MiB" for a in (first, next(a for a in pids if a != first)))])
        sample = [bench_key(i) for i in range(0, keys_total, max(1, keys_total // 5000))]
        old = next(m for m in started_masters if m.address == first)
        killed = time.monotonic()
        old.kill()
        new = leader(other_than=first)
        elected_s = time.monotonic() - killed
        with MasterClient(new, config=config, request_timeout_s=10) as client:
            while True:
                try:
                    if all(client.exists_many(sample)):
                        break
                except errors.KVPoolError:
                    pass
                time.sleep(0.01)
            hits_s = time.monotonic() - killed
            stats = client.stats()
        rows += [["kill -9 leader -> standby elected", f"{elected_s:.2f} s"],
                 [f"kill -9 leader -> all {len(sample):,} sampled keys hit", f"{hits_s:.2f} s"],
                 ["new leader: takeover", str(stats["takeover"])],
                 ["new leader: keys indexed / nodes re-registered",
                  f"{stats['keys']:,} / {stats['counters']['registers']}"]]
        # A fresh standby joining the new leader: snapshot, then the stream.
        joiner = Master(f"tcp://127.0.0.1:{_free_port()}", flags)
        started_masters.append(joiner)
        t = time.perf_counter()
        joiner.start()
        wait_until(lambda: caught_up() is not None, 900)
        rows.append([f"a new standby loads a snapshot of {stats['keys']:,} keys and catches up",
                     f"{time.perf_counter() - t:.1f} s"])
        print(format_table(["HA check", "result"], rows))
        return 0 if stats["keys"] == keys_total and stats["takeover"]["warm"] else 1
    finally:
        for beater in beaters:
            beater.stop()
        for m in started_masters:
            m.stop()
        etcd.kill()
        etcd.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
