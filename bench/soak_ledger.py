"""The fault soak's ledger of acknowledged durable puts (``python -m bench.soak_ledger``).

One process, for the whole soak: a stream of short-lived clients (client churn: each is a new
node of the cluster) that each make ``--batch`` durable puts of keys of their own
(``ledger-key-N``, values derived from the key), note every put that returned, and leave
(a clean close withdraws their own copies, so only the storage nodes' durable copies remain).
A long-lived verifier client then reads every acknowledged key back, exact bytes, and deletes it
(the storage nodes stay bounded; a key whose delete failed is no longer counted either way). A
key whose put failed is deleted at once: the copies such a put committed stay durable.

A read that misses is retried for ``--grace-s`` (a master takeover or a node restart may hide a
key for a moment); a key still missing then is **lost**: acknowledged, yet gone. Every result is
one JSON line (``LEDGER {...}``) at the end: acknowledged, verified, lost, wrong, refused puts by
error type, clients started. On SIGTERM it stops putting and verifies what is left.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULT_PREFIX = "LEDGER "
SHAPE = (2, 2, 16, 2, 32)  # 2 layers x 4 KiB float16: many fit the storage nodes


def key_of(i: int) -> bytes:
    return b"ledger-key-%07d" % i


def value_of(i: int) -> np.ndarray:
    return np.random.default_rng(xxhash.xxh3_64_intdigest(key_of(i))).standard_normal(SHAPE).astype(np.float16)


def config_of(args: argparse.Namespace, name: str) -> dict[str, Any]:
    data_dir = Path(args.data_dir) / name
    master: dict[str, Any] = {"listen": args.master, "heartbeat_ms": args.heartbeat_ms, "request_timeout_s": 5.0}
    if args.etcd:
        master.update({"etcd": args.etcd, "etcd_prefix": args.etcd_prefix})
    return {
        "pool": {"name": name, "data_dir": str(data_dir)},
        "tiers": {"dram": {"capacity": "4MiB", "mlock": False, "prefault": False},
                  "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
        "master": master,
        "node": {"pull_timeout_s": 5.0, "location_cache": 0},
    }


class Ledger:
    def __init__(self, args: argparse.Namespace) -> None:
        import kvpool
        from kvpool.config import Config

        self.args = args
        self.kvpool, self.Config = kvpool, Config
        self.stop = threading.Event()
        self.next_key = 0
        self.pending: list[int] = []  # acknowledged, writer gone, not yet read back
        self.counts: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.lost: list[int] = []
        self.wrong: list[int] = []
        self.verifier: Any = None

    def connect(self, name: str) -> Any:
        return self.kvpool.connect(None if self.args.etcd else self.args.master,
                                   config=self.Config.load(config_of(self.args, name)))

    def one_client(self) -> None:
        """A new client: ``--batch`` durable puts, then a clean leave."""
        self.counts["clients"] += 1
        try:
            pool = self.connect(f"ledger-client-{self.counts['clients']}")
        except Exception as exc:  # a master away: counted, the next client tries again
            self.refused[f"connect:{type(exc).__name__}"] += 1
            self.stop.wait(0.5)
            return
        acked: list[int] = []
        try:
            for _ in range(self.args.batch):
                i, self.next_key = self.next_key, self.next_key + 1
                try:
                    pool.put(key_of(i), value_of(i), durable=True, replicas=self.args.replicas)
                except Exception as exc:
                    self.refused[type(exc).__name__] += 1
                    # Copies a failed durable put committed stay (and the master completes their
                    # count): as a user would, give the key up, or the storage nodes fill with them.
                    self.give_up(pool, i)
                    continue
                acked.append(i)
                self.counts["acknowledged"] += 1
        finally:
            try:
                pool.close()
            except Exception as exc:
                self.refused[f"close:{type(exc).__name__}"] += 1
        self.pending.extend(acked)

    def give_up(self, pool: Any, i: int) -> None:
        try:
            pool.delete(key_of(i))
            self.counts["given_up"] += 1
        except Exception as exc:  # KeyNotFoundError: nothing was committed
            self.counts[f"give_up_error:{type(exc).__name__}"] += 1

    def verify(self, keys: list[int], grace_s: float) -> None:
        """Read each key back (exact bytes), retrying misses for ``grace_s``; then delete it."""
        deadline = time.monotonic() + grace_s
        waiting = list(keys)
        while waiting:
            missing = []
            for i in waiting:
                try:
                    got = self.verifier.get(key_of(i))
                except Exception as exc:  # a master away: as a miss, retried
                    self.counts[f"verify_error:{type(exc).__name__}"] += 1
                    got = None
                if got is None:
                    missing.append(i)
                elif not np.array_equal(got, value_of(i)):
                    self.wrong.append(i)
                else:
                    self.counts["verified"] += 1
                    self.delete(i)
            waiting = missing
            if waiting and time.monotonic() >= deadline:
                self.lost.extend(waiting)
                print(f"LOST {len(waiting)} acknowledged durable puts: {[key_of(i).decode() for i in waiting[:10]]}",
                      file=sys.stderr, flush=True)
                return
            if waiting:
                time.sleep(0.5)

    def delete(self, i: int) -> None:
        try:
            self.verifier.delete(key_of(i))
            self.counts["deleted"] += 1
        except Exception as exc:
            self.counts[f"delete_error:{type(exc).__name__}"] += 1

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        self.verifier = self.connect("ledger-verifier")
        print("READY", flush=True)
        end = time.monotonic() + self.args.seconds
        try:
            while not self.stop.is_set() and time.monotonic() < end:
                self.one_client()
                if len(self.pending) >= self.args.verify_every:
                    batch, self.pending = self.pending, []
                    self.verify(batch, self.args.grace_s)
                self.stop.wait(self.args.pause_s)
            batch, self.pending = self.pending, []
            self.verify(batch, self.args.final_grace_s)
        finally:
            self.verifier.close()
        result = {"acknowledged": self.counts["acknowledged"], "verified": self.counts["verified"],
                  "lost": len(self.lost), "lost_keys": [key_of(i).decode() for i in self.lost[:20]],
                  "wrong": len(self.wrong), "refused": dict(self.refused), "clients": self.counts["clients"],
                  "other": {k: v for k, v in self.counts.items()
                            if k not in ("acknowledged", "verified", "clients")}}
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 1 if self.lost or self.wrong else 0


def parse_ledger(output: str) -> dict[str, Any] | None:
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            parsed: dict[str, Any] = json.loads(line[len(RESULT_PREFIX):])
            return parsed
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="tcp://127.0.0.1:7700")
    parser.add_argument("--etcd", default="")
    parser.add_argument("--etcd-prefix", default="/kvpool")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--batch", type=int, default=20, help="durable puts per short-lived client")
    parser.add_argument("--replicas", type=int, default=2, help="durable copies per put")
    parser.add_argument("--verify-every", type=int, default=100, help="read back once this many are pending")
    parser.add_argument("--grace-s", type=float, default=30.0, help="how long a miss is retried before it is lost")
    parser.add_argument("--final-grace-s", type=float, default=60.0)
    parser.add_argument("--pause-s", type=float, default=0.2, help="between clients")
    parser.add_argument("--heartbeat-ms", type=int, default=500)
    return Ledger(parser.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
