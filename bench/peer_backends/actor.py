"""An actor process of the peers benchmark: one system's client, driven over stdin/stdout.

``python -m bench.peer_backends.actor SYSTEM ROLE [--cpus 0]`` pins itself,
then answers one JSON request per line (one JSON reply per line):

* ``init {settings}``: open the system's client (:class:`PeerClient`) in ROLE;
* ``setup {size, count, batch, seed}``: build the random values (same seed,
  same bytes in every process) and the get buffers;
* ``put {set, batch, rounds}`` / ``get {set, batch, rounds}``: every key of a
  key set, ``batch`` keys per call, timed per call (``perf_counter``), split
  into ``rounds``; one untimed warm-up call first (connections, first touch).
  ``first`` and ``calls`` (optional): only that many calls, from call ``first``
  on (wrapping around the set);
* ``verify {sets, sample}``: get a sample of keys (untimed) and compare bytes;
* ``exists {sets, total, batch}``: ``total`` keys, half stored and half
  never stored, interleaved; checks every answer;
* ``info``, ``quit``.

The timing loops are here, the same for every system; a client only does one
call. Library output on stdout would corrupt the protocol, so the replies go
to a private copy of fd 1 and fd 1 itself is pointed at stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.peer_backends import client_class
from bench.peer_backends.base import PeerClient, ValueSource, key_name


class Actor:
    def __init__(self, system: str, role: str) -> None:
        self.system, self.role = system, role
        self.client: PeerClient | None = None
        self.source: ValueSource | None = None
        self.outs: list[np.ndarray] = []

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "init":
            self.client = client_class(self.system)(self.role, request.get("settings", {}))
            return {"ok": True, "pid": os.getpid()}
        assert self.client is not None, "init first"
        if op == "setup":
            self.source = ValueSource(request["size"], request["count"], request["seed"])
            self.batch = request["batch"]
            self.outs = self.client.prepare(self.source, self.batch)
            return {"ok": True}
        if op == "put":
            return {"rounds": self._timed(request, self._put)}
        if op == "get":
            misses = [0]

            def get(keys: list[str], _indices: list[int]) -> None:
                results = self.client.get(keys, self.outs[: len(keys)])  # type: ignore[union-attr]
                misses[0] += sum(r is None for r in results)

            rounds = self._timed(request, get)
            return {"rounds": rounds, "misses": misses[0]}
        if op == "verify":
            return self._verify(request["sets"], request["sample"])
        if op == "exists":
            return self._exists(request["sets"], request["total"], request["batch"])
        if op == "info":
            return {"info": self.client.info()}
        raise ValueError(f"unknown op {op!r}")

    def _put(self, keys: list[str], indices: list[int]) -> None:
        assert self.client is not None and self.source is not None
        self.client.put(keys, indices, self.source)

    def _timed(self, request: dict[str, Any], call: Any) -> list[list[float]]:
        """Per-call latencies (s) over every key of the set, in ``rounds`` groups."""
        assert self.source is not None
        kind, batch, rounds = request["set"], request["batch"], request["rounds"]
        size, count = self.source.size, self.source.count
        warm = list(range(min(batch, count)))
        # puts warm up on keys of their own; gets on the first keys of the set (already stored)
        prefix = f"warm{kind}" if request["op"] == "put" else kind
        call([key_name(prefix, size, j) for j in warm], warm)
        calls = [list(range(start, min(start + batch, count))) for start in range(0, count, batch)]
        if "calls" in request:  # a slice of the set's calls, wrapping around
            first = request.get("first", 0)
            calls = [calls[(first + j) % len(calls)] for j in range(request["calls"])]
        per_round = max(1, -(-len(calls) // rounds))
        out: list[list[float]] = []
        perf = time.perf_counter
        for r in range(0, len(calls), per_round):
            samples = []
            for indices in calls[r: r + per_round]:
                keys = [key_name(kind, size, i) for i in indices]
                t0 = perf()
                call(keys, indices)
                samples.append(perf() - t0)
            out.append(samples)
        return out

    def _verify(self, sets: Sequence[str], sample: int) -> dict[str, Any]:
        assert self.client is not None and self.source is not None
        count = self.source.count
        picks = sorted({min(count - 1, round(j * (count - 1) / max(sample - 1, 1))) for j in range(sample)})
        checked = bad = missing = 0
        for kind in sets:
            for i in picks:
                out = self.outs[0]  # the library's own (registered / shared) get memory
                out[:] = 0
                got = self.client.get([key_name(kind, self.source.size, i)], [out])[0]
                checked += 1
                if got is None:
                    missing += 1
                elif not np.array_equal(_as_bytes(got), self.source.value(i)):
                    bad += 1
        return {"checked": checked, "bad": bad, "missing": missing}

    def _exists(self, sets: Sequence[str], total: int, batch: int) -> dict[str, Any]:
        assert self.client is not None and self.source is not None
        size, count = self.source.size, self.source.count
        stored = [key_name(kind, size, i) for kind in sets for i in range(count)]
        keys, expect = [], []
        for j in range(total):
            if j % 2 == 0:
                keys.append(stored[(j // 2) % len(stored)])
                expect.append(True)
            else:
                keys.append(f"absent-{size}-{j}")
                expect.append(False)
        self.client.exists(keys[:batch])  # warm-up
        wrong = 0
        t0 = time.perf_counter()
        answers: list[bool] = []
        for start in range(0, total, batch):
            answers.extend(self.client.exists(keys[start: start + batch]))
        seconds = time.perf_counter() - t0
        wrong = sum(bool(a) != e for a, e in zip(answers, expect)) + abs(len(answers) - len(expect))
        return {"seconds": seconds, "keys": total, "calls": -(-total // batch), "wrong": wrong}


def _as_bytes(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value.reshape(-1).view(np.uint8)
    return np.frombuffer(value, np.uint8)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="peers benchmark actor (started by bench/peers.py)")
    parser.add_argument("system")
    parser.add_argument("role")
    parser.add_argument("--cpus", default="", help="pin to these CPUs, e.g. 0 or 0,1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("KVPOOL_PEERS_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints to stdout goes to the log instead
    sys.stdout = sys.stderr
    actor = Actor(args.system, args.role)
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "quit":
                break
            try:
                reply = actor.handle(request)
            except Exception as exc:  # reported to the orchestrator, which decides
                traceback.print_exc()
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            replies.write(json.dumps(reply) + "\n")
    finally:
        if actor.client is not None:
            actor.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
