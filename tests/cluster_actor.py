"""A pool client in its own process, for the cluster tests.

``writer``: connect, put ``--keys`` objects (content derived from the key
index, so any process can check it), print ``READY <node_id>``, then keep
serving them until SIGTERM. ``reader``: connect, get every key (whole or
``--layers a:b``), check content, print one JSON line of results, exit.
``stream``: get the keys round robin for ``--seconds`` with no location cache
(every get asks the master), printing one JSON line of every outcome with its
wall-clock time (for failover tests). ``--etcd URLS`` finds the master leader
in etcd instead of at ``--master``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import kvpool
from kvpool.config import Config

SHAPE = (8, 2, 32, 4, 64)  # 8 layers x 32 KiB float16


def key_of(i: int) -> bytes:
    return b"cluster-key-%04d" % i


SMALL_SHAPE = (2, 2, 8, 2, 16)  # 2 layers x 1 KiB: many puts fit a small storage node


def content(i: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal(shape).astype(np.float16)


def small_config(master: str, name: str, data_dir: str, heartbeat_ms: int, dram: str = "4MiB",
                 host: str = "", etcd: str = "", etcd_prefix: str = "/kvpool", location_cache: int = 65536) -> Config:
    return Config.load({
        "pool": {"name": name, "data_dir": data_dir},
        "tiers": {"dram": {"capacity": dram, "mlock": False}, "cxl": {"capacity": "4MiB", "path": f"{data_dir}/cxl",
                                                                    # every actor's arena lives beside ours
                                                                    "shared_dirs": os.path.dirname(data_dir)},
                  "nvme": {"capacity": "16MiB", "segment_size": "8MiB"}},
        "master": {"listen": master, "heartbeat_ms": heartbeat_ms, "request_timeout_s": 3.0,
                   "etcd": etcd, "etcd_prefix": etcd_prefix},
        "node": {"pull_timeout_s": 3.0, "host": host, "location_cache": location_cache},
    })


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("writer", "reader", "stream", "putstream"))
    parser.add_argument("--master", default="tcp://127.0.0.1:7700")
    parser.add_argument("--etcd", default="", help="find the master leader in etcd at these URLs")
    parser.add_argument("--etcd-prefix", default="/kvpool")
    parser.add_argument("--seconds", type=float, default=10.0, help="stream: how long to read")
    parser.add_argument("--name", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--layers", default="")
    parser.add_argument("--durable", action="store_true")
    parser.add_argument("--small", action="store_true", help="putstream: objects of SMALL_SHAPE")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--heartbeat-ms", type=int, default=200)
    parser.add_argument("--host", default="", help="node.host (default: auto, from the route to the master)")
    parser.add_argument("--dram", default="4MiB",
                        help="0: puts land in the cxl arena (same-host readers read in place)")
    parser.add_argument("--hand-off-s", type=float, default=0.0, help="node.hand_off_s")
    args = parser.parse_args()
    config = small_config(args.master, args.name, args.data_dir, args.heartbeat_ms, args.dram, args.host,
                          args.etcd, args.etcd_prefix, 0 if args.role == "stream" else 65536)
    config.set("node.hand_off_s", args.hand_off_s, origin="cluster_actor")
    pool = kvpool.connect(None if args.etcd else args.master, config=config, transport=args.transport)
    try:
        keys = range(args.first, args.first + args.keys)
        if args.role == "writer":
            for i in keys:
                pool.put(key_of(i), content(i), durable=args.durable, replicas=args.replicas)
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())  # before READY: a test may stop it at once
            print(f"READY {pool.node_id}", flush=True)
            while not stop.wait(0.5):
                pass
            return 0
        if args.role == "putstream":
            return put_stream(pool, list(keys), args.seconds, durable=args.durable,
                              shape=SMALL_SHAPE if args.small else SHAPE)
        layers = range(*map(int, args.layers.split(":"))) if args.layers else None
        if args.role == "stream":
            print("READY", flush=True)
            return stream(pool, list(keys), args.seconds)
        results = {"ok": 0, "miss": 0, "wrong": 0}
        started = time.monotonic()
        for i in keys:
            got = pool.get(key_of(i), layers=layers)
            if got is None:
                results["miss"] += 1
            elif np.array_equal(got, content(i)[layers.start:layers.stop] if layers else content(i)):
                results["ok"] += 1
            else:
                results["wrong"] += 1
        results["seconds"] = time.monotonic() - started
        print(json.dumps(results), flush=True)
        return 0
    finally:
        pool.close()


def put_stream(pool: kvpool.Pool, keys: list[int], seconds: float, *, durable: bool = False,
               shape: tuple[int, ...] = SHAPE) -> int:
    """Put ``keys`` one after another, spread over ``seconds``; print ``{"ok": [i...], "failed":
    {i: error}, "acked": [[i, wall time], ...]}``, then keep serving them until SIGTERM
    (non-durable keys live here)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("READY", flush=True)
    ok: list[int] = []
    acked: list[tuple[int, float]] = []
    failed: dict[int, str] = {}
    pause = seconds / max(1, len(keys))
    for i in keys:
        try:
            pool.put(key_of(i), content(i, shape), durable=durable)
            ok.append(i)
            acked.append((i, time.time()))
        except Exception as exc:  # reported: the test decides what is acceptable
            failed[i] = type(exc).__name__
        time.sleep(pause)
    print(json.dumps({"ok": ok, "failed": failed, "acked": acked}), flush=True)
    while not stop.wait(0.5):
        pass
    return 0


def stream(pool: kvpool.Pool, keys: list[int], seconds: float) -> int:
    """Get ``keys`` round robin for ``seconds``: ``{"events": [[time, "ok"|"miss"|"wrong"|error], ...]}``."""
    events: list[list] = []
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        i = keys[n % len(keys)]
        n += 1
        try:
            got = pool.get(key_of(i))
            outcome = "miss" if got is None else "ok" if np.array_equal(got, content(i)) else "wrong"
        except Exception as exc:  # reported, never hidden: the test decides what is acceptable
            outcome = type(exc).__name__
        events.append([time.time(), outcome])
        time.sleep(0.01)
    print(json.dumps({"events": events}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
