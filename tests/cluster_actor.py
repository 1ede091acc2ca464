"""A pool client in its own process, for the cluster tests.

``writer``: connect, put ``--keys`` objects (content derived from the key
index, so any process can check it), print ``READY <node_id>``, then keep
serving them until SIGTERM. ``reader``: connect, get every key (whole or
``--layers a:b``), check content, print one JSON line of results, exit.
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


def content(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal(SHAPE).astype(np.float16)


def small_config(master: str, name: str, data_dir: str, heartbeat_ms: int, dram: str = "4MiB",
                 host: str = "") -> Config:
    return Config.load({
        "pool": {"name": name, "data_dir": data_dir},
        "tiers": {"dram": {"capacity": dram, "mlock": False}, "cxl": {"capacity": "4MiB", "path": f"{data_dir}/cxl",
                                                                    # every actor's arena lives beside ours
                                                                    "shared_dirs": os.path.dirname(data_dir)},
                  "nvme": {"capacity": "16MiB", "segment_size": "8MiB"}},
        "master": {"listen": master, "heartbeat_ms": heartbeat_ms, "request_timeout_s": 3.0},
        "node": {"pull_timeout_s": 3.0, "host": host},
    })


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("writer", "reader"))
    parser.add_argument("--master", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--layers", default="")
    parser.add_argument("--durable", action="store_true")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--heartbeat-ms", type=int, default=200)
    parser.add_argument("--host", default="", help="node.host (default: auto, from the route to the master)")
    parser.add_argument("--dram", default="4MiB", help="0: puts land in the cxl arena (same-host readers read in place)")
    args = parser.parse_args()
    config = small_config(args.master, args.name, args.data_dir, args.heartbeat_ms, args.dram, args.host)
    pool = kvpool.connect(args.master, config=config, transport=args.transport)
    try:
        keys = range(args.first, args.first + args.keys)
        if args.role == "writer":
            for i in keys:
                pool.put(key_of(i), content(i), durable=args.durable, replicas=args.replicas)
            print(f"READY {pool.node_id}", flush=True)
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            while not stop.wait(0.5):
                pass
            return 0
        layers = range(*map(int, args.layers.split(":"))) if args.layers else None
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


if __name__ == "__main__":
    sys.exit(main())
