"""Master round-trip benchmark: batched prefix lookup and single-key lookup rate.

Measures, against a real master process on 127.0.0.1:

* a batched ``lookup`` of N hashes (one round trip): p50/p99 latency;
* single-key ``lookup`` calls per second from K client processes at once;

and, as the physical limit in the same run, the same message sizes bounced
off a bare ZeroMQ ROUTER echo (no msgpack, no Python work per message beyond
recv/send), so the table shows what the protocol and the master cost on top
of the transport. Does not measure nodes or KV bytes (the master never sees
them).

    python bench/master_bench.py [--clients 4] [--threads 1 4] [--duration 3] [--hashes 1000] [--iters 300]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kvpool.cluster.wire import protocol as P  # noqa: E402
from kvpool.cluster.wire.master_client import MasterClient  # noqa: E402
from kvpool.cluster.wire.security import ClusterKey  # noqa: E402
from kvpool.config import Config  # noqa: E402
from kvpool.hashing import prefix_hashes  # noqa: E402
from kvpool.objformat import ObjectSpec  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ping(address: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with MasterClient(address, request_timeout_s=0.5) as c:
                c.ping()
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- workers (run in spawned processes) ------------------------------------------------------


def _echo_server(address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    # CURVE like the master, so the ratio is the master's own cost
    ClusterKey.from_config(Config.load(None)).secure_server(sock)
    sock.bind(address)
    while True:  # terminated by the parent
        sock.send_multipart(sock.recv_multipart())


def _single_lookup_worker(
    address: str, mode: str, key: bytes, threads: int, duration_s: float, go: Any, out: Any
) -> None:
    """``threads`` threads each doing back-to-back single-key lookups (one in flight each)."""
    if mode == "master":
        client = MasterClient(address, request_timeout_s=5)  # shared: it is thread-safe

    def make_call() -> Any:
        if mode == "master":
            client.lookup([key])  # connect this thread's socket before the clock starts
            return lambda: client.lookup([key])
        sock = zmq.Context.instance().socket(zmq.DEALER)
        ClusterKey.from_config(Config.load(None)).secure_client(sock)
        sock.connect(address)
        frame = P.pack_request(1, P.LOOKUP, {"keys": [key]})
        sock.send(frame)
        sock.recv()

        def call() -> None:
            sock.send(frame)
            sock.recv()

        return call

    results: list[tuple[int, float, list[float]]] = []
    connected = threading.Barrier(threads + 1)

    def loop() -> None:
        call = make_call()
        connected.wait()
        latencies: list[float] = []
        perf = time.perf_counter
        start = now = perf()
        end = start + duration_s
        while now < end:
            call()
            t = perf()
            latencies.append(t - now)
            now = t
        results.append((len(latencies), now - start, latencies))

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for w in workers:
        w.start()
    go.wait(timeout=120)  # every process connected
    connected.wait()      # start all threads together
    for w in workers:
        w.join()
    calls = sum(r[0] for r in results)
    elapsed = max(r[1] for r in results)
    latencies = np.concatenate([r[2] for r in results])
    out.put((calls, elapsed, float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99))))


def _rate(
    address: str, mode: str, key: bytes, clients: int, threads: int, duration_s: float
) -> tuple[float, float, float]:
    """(calls/s over all clients, p50 s, p99 s) for single-key lookups from ``clients`` processes."""
    ctx = mp.get_context("spawn")
    # Every worker imports and connects first; the clock starts when all are in.
    go, out = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_single_lookup_worker, args=(address, mode, key, threads, duration_s, go, out))
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    go.wait(timeout=120)
    results = [out.get(timeout=duration_s + 60) for _ in procs]
    for p in procs:
        p.join(10)
    total = sum(n / elapsed for n, elapsed, _, _ in results)
    return total, statistics.median(r[2] for r in results), max(r[3] for r in results)


def _batched(address: str, mode: str, hashes: list[bytes], iters: int, warmup: int) -> list[float]:
    if mode == "master":
        client = MasterClient(address, request_timeout_s=5)

        def call() -> None:
            assert client.lookup(hashes) == len(hashes)
    else:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        ClusterKey.from_config(Config.load(None)).secure_client(sock)
        sock.connect(address)
        frame = P.pack_request(1, P.LOOKUP, {"keys": hashes})

        def call() -> None:
            sock.send(frame)
            sock.recv()

    for _ in range(warmup):
        call()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="use a running master instead of starting one")
    parser.add_argument("--hashes", type=int, default=1000, help="hashes per batched lookup")
    parser.add_argument("--iters", type=int, default=300, help="batched lookups measured")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--clients", type=int, default=4, help="client processes for the single-key rate")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4],
                        help="threads per client process (one request in flight each); one run per value")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of single-key lookups")
    args = parser.parse_args()

    started: list[subprocess.Popen[bytes]] = []
    echo = None
    try:
        address = args.address
        if address is None:
            address = f"tcp://127.0.0.1:{_free_port()}"
            # A long heartbeat: the benchmark's one fake node does not beat.
            started.append(subprocess.Popen(
                [sys.executable, "-m", "kvpool.cluster.master", "--listen", address, "--log-level", "WARNING",
                 "--master.heartbeat_ms", "3600000"],
                cwd=REPO_ROOT,
            ))
        _wait_ping(address)
        echo_address = f"tcp://127.0.0.1:{_free_port()}"
        echo = mp.get_context("spawn").Process(target=_echo_server, args=(echo_address,), daemon=True)
        echo.start()

        hashes = prefix_hashes(list(range(args.hashes * 16)), chunk_tokens=16, namespace=os.urandom(8).hex())
        spec = ObjectSpec("float16", 32, 16, 8, 128)
        node_id = f"bench-{os.getpid()}"
        with MasterClient(address) as client:
            client.register(node_id, "ucx://127.0.0.1:1", "bench-host",
                            {"dram": {"capacity": 1 << 34, "free": 1 << 33}},
                            [P.replica_record("dram", spec, spec.total_nbytes, key=h) for h in hashes])

        print(f"master {address}; {args.hashes} hashes indexed; {os.cpu_count()} CPUs", flush=True)
        print("batched lookups ...", flush=True)
        batch = np.array(_batched(address, "master", hashes, args.iters, args.warmup)) * 1e6
        batch_echo = np.array(_batched(echo_address, "echo", hashes, args.iters, args.warmup)) * 1e6
        rates = []
        for threads in args.threads:
            print(f"single-key lookups: {args.clients} processes x {threads} threads, {args.duration:.0f} s ...",
                  flush=True)
            rates.append((threads,
                          _rate(address, "master", hashes[0], args.clients, threads, args.duration),
                          _rate(echo_address, "echo", hashes[0], args.clients, threads, args.duration)))

        rows = [
            (f"batched lookup of {args.hashes}: p50 (us)", np.percentile(batch, 50), np.percentile(batch_echo, 50),
             False),
            (f"batched lookup of {args.hashes}: p99 (us)", np.percentile(batch, 99), np.percentile(batch_echo, 99),
             False),
            ("batched lookup: hashes/s (p50)", args.hashes / np.percentile(batch, 50) * 1e6,
             args.hashes / np.percentile(batch_echo, 50) * 1e6, True),
        ]
        for threads, (rate, p50, p99), (rate_echo, p50_echo, p99_echo) in rates:
            tag = f"{args.clients} procs x {threads} thr"
            rows += [
                (f"single-key lookups/s, {tag}", rate, rate_echo, True),
                (f"single-key p50 (us), {tag}", p50 * 1e6, p50_echo * 1e6, False),
                (f"single-key p99 (us), {tag}", p99 * 1e6, p99_echo * 1e6, False),
            ]
        print()
        print(f"{'metric':<44} {'master':>12} {'zmq echo':>12} {'master/echo':>12}")
        for name, value, limit, higher_better in rows:
            ratio = value / limit if higher_better else limit / value
            print(f"{name:<44} {value:>12,.1f} {limit:>12,.1f} {ratio:>11.0%}")
        print("\n(zmq echo = same frames bounced off a bare ROUTER with the same CURVE security: the transport's"
              " limit on this machine; ratio = share of that limit the master reaches)")
    finally:
        if echo is not None:
            echo.terminate()
            echo.join(5)
        for proc in started:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
