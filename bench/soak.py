"""Soak: many real client processes put/get/delete the same keys and check every byte they get.

``python bench/soak.py --minutes 1 --processes 8 --keys 64`` starts a master
(``kvpool-server --role master``) and ``--processes`` worker processes on
127.0.0.1. Each worker is a ``kvpool.connect`` client whose puts land in its
shared-memory ``cxl`` arena (dram capacity 0), with small cxl and nvme tiers so
objects are demoted, dropped and their extents reused all the time. Workers
put, overwrite, get (whole objects and layer ranges, into fresh arrays or
``out=`` buffers, one key or ``get_many``) and delete random keys of one shared
key set for the given time, then report counts as one JSON line.

Every value is derived from its key and a version number (:func:`content`),
and every layer starts with a tag naming (key, version, layer), so any process
can check any value it receives: the whole returned array must equal one
version of the asked key's value, layer for layer. kvpool promises exact bytes
or a miss; a value that is anything else is counted as **wrong** and a sample
of what came back (which key's, which version's, which layer's bytes) is
printed. So is a get that raised an error about the caller's own request
(OutBufferError, LayerRangeError, ShapeError) although the request matched the
key's real shape: that means the reader used another object's header.

Prints one row per process and a total: ops, puts, gets, hits, misses, wrong,
errors, which path the hits took (same-host arena index / located replica),
and get latency p99 and max (p99 from a log histogram with 2% buckets).
Exit code 1 when anything was wrong or a worker did not report.

The module is also the worker (``python -m bench.soak worker ...``) and the
content/checking library the stress tests use (``tests/test_stress.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.soak_report import RESULT_PREFIX, Latencies, parse_result, table, worker_command  # noqa: E402

KV_HEADS, HEAD_DIM = 2, 32
TAG = struct.Struct("<4sIII")  # magic, key index, version, layer index: the first 16 bytes of every layer
TAG_MAGIC = b"SOAK"
WRONG_SAMPLES = 8
# A get raising one of these for a request that fits the key's real shape read another object's header.
CALLER_ERRORS = ("OutBufferError", "LayerRangeError", "ShapeError")
DEFAULT_MIX = "put=3,get=5,get_many=1,delete=1"


# -- values ----------------------------------------------------------------------------


def key_of(i: int) -> bytes:
    return b"soak-key-%05d" % i


def shape_of(i: int, shapes: int = 0) -> tuple[int, int, int, int, int]:
    """``[layers 2..8, 2, tokens 16..64, 2, 32]`` float16, from the key (``shapes`` > 0: key i
    has the shape of key ``i % shapes``, so several keys share a size and reuse each other's extents)."""
    h = xxhash.xxh3_64_intdigest(key_of(i % shapes if shapes else i))
    return (2 + h % 7, 2, 16 + (h >> 8) % 49, KV_HEADS, HEAD_DIM)


@functools.lru_cache(maxsize=4096)
def _content(i: int, version: int, shapes: int) -> np.ndarray:
    shape = shape_of(i, shapes)
    layers = shape[0]
    raw = np.frombuffer(np.random.default_rng([xxhash.xxh3_64_intdigest(key_of(i)), version]).bytes(
        int(np.prod(shape)) * 2), dtype=np.uint8).copy()
    per_layer = raw.reshape(layers, -1)
    for layer in range(layers):
        per_layer[layer, :TAG.size] = np.frombuffer(TAG.pack(TAG_MAGIC, i, version, layer), np.uint8)
    arr = raw.view(np.float16).reshape(shape)
    arr.flags.writeable = False
    return arr


def content(i: int, version: int = 0, shapes: int = 0) -> np.ndarray:
    """Value of key ``i`` at ``version`` (read-only): random bytes seeded by the key and version,
    each layer starting with the tag (key, version, layer)."""
    return _content(i, version, shapes)


def layer_tags(got: np.ndarray) -> list[tuple[int, int, int] | str]:
    """The (key, version, layer) tag at the start of each layer of ``got`` (a string if there is none)."""
    raw = np.ascontiguousarray(got).view(np.uint8).reshape(-1)
    layers = got.shape[0] if got.ndim else 1
    if layers == 0 or raw.size % layers:
        return ["unparseable"]
    step = raw.size // layers
    tags: list[tuple[int, int, int] | str] = []
    for layer in range(layers):
        chunk = raw[layer * step: layer * step + TAG.size].tobytes()
        if len(chunk) < TAG.size:
            tags.append("short")
            continue
        magic, key, version, index = TAG.unpack(chunk)
        tags.append((key, version, index) if magic == TAG_MAGIC else f"untagged:{chunk[:8].hex()}")
    return tags


def check(i: int, start: int, stop: int, got: Any, versions: int, shapes: int = 0) -> str | None:
    """None when ``got`` is exactly layers [start, stop) of one version of key ``i``; else what it is."""
    shape = shape_of(i, shapes)
    want_shape = (stop - start,) + shape[1:]
    if not isinstance(got, np.ndarray):
        return f"not an array: {type(got).__name__}"
    if got.shape != want_shape or got.dtype != np.float16:
        return (f"key {i} layers {start}:{stop}: shape {got.shape} {got.dtype}, want {want_shape} float16; "
                f"layer tags {_summarise(layer_tags(got))}")
    tags = layer_tags(got)
    first = tags[0]
    version = first[1] if isinstance(first, tuple) and first[0] == i and 0 <= first[1] < versions else 0
    expected = content(i, version, shapes)[start:stop]
    if np.array_equal(got.view(np.uint16), expected.view(np.uint16)):
        return None
    want_tags = [(i, version, start + k) for k in range(stop - start)]
    diff = (got.view(np.uint8).reshape(stop - start, -1) != expected.view(np.uint8).reshape(stop - start, -1))
    bad_layers = [start + k for k in range(stop - start) if diff[k].any()]
    return (f"key {i} layers {start}:{stop} (v{version}): {int(diff.sum())} bytes differ in layers {bad_layers}; "
            f"layer tags {_summarise(tags)}" + (" (tags as expected: bytes differ after the tag)"
                                                if tags == want_tags else ""))


def _summarise(tags: Sequence[Any]) -> str:
    """``[key 3 v1 layer 0..4]`` style runs of (key, version, layer) tags."""
    runs: list[list[Any]] = []
    for tag in tags:
        if (isinstance(tag, tuple) and runs and isinstance(runs[-1][0], tuple)
                and runs[-1][0][:2] == tag[:2] and runs[-1][1][2] + 1 == tag[2]):
            runs[-1][1] = tag
        else:
            runs.append([tag, tag])
    parts = []
    for first, last in runs:
        if isinstance(first, tuple):
            layers = f"{first[2]}" if first == last else f"{first[2]}..{last[2]}"
            parts.append(f"key {first[0]} v{first[1]} layer {layers}")
        else:
            parts.append(str(first))
    return "[" + ", ".join(parts) + "]"


# -- one worker process -------------------------------------------------------------------------


def worker_config(args: argparse.Namespace) -> dict[str, Any]:
    """dram off (puts land in the cxl arena, which same-host readers read in place), small cxl/nvme."""
    data_dir = Path(args.data_dir)
    cxl_path = args.cxl_path or str(data_dir / "cxl")
    tiers: dict[str, Any] = {
        "dram": {"capacity": args.dram, "mlock": False, "prefault": False},
        # Workers' arenas live under their data dirs, not /dev/shm: name the common parent as a
        # shared directory so that same-host readers may map each other's arenas.
        "cxl": {"capacity": args.cxl, "path": cxl_path,
                "shared_dirs": ":".join({str(data_dir.parent), str(Path(cxl_path).parent)})},
        "nvme": {"capacity": args.nvme, "segment_size": "1MiB"},
    }
    for tier in ("cxl", "nvme"):
        if str(getattr(args, tier)).strip() in ("", "0"):
            tiers[tier] = {"capacity": 0, **({"shared_dirs": tiers["cxl"]["shared_dirs"]} if tier == "cxl" else {})}
    return {
        "pool": {"name": args.name, "data_dir": str(data_dir)},
        "tiers": tiers,
        "master": {"listen": args.master, "heartbeat_ms": args.heartbeat_ms, "request_timeout_s": 5.0,
                   **({"etcd": args.etcd, "etcd_prefix": args.etcd_prefix} if getattr(args, "etcd", "") else {})},
        "node": {"pull_timeout_s": 5.0, "same_host_index": not args.no_same_host_index},
    }


class Worker:
    """Random ops on the shared key set; every value received is checked (see :func:`check`)."""

    def __init__(self, pool: Any, args: argparse.Namespace) -> None:
        self.pool = pool
        self.args = args
        self.rng = random.Random(args.seed)
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.error_samples: list[str] = []
        self.wrong_samples: list[str] = []
        self.get_latency = Latencies()
        self.put_latency = Latencies()
        # The op in flight (name, monotonic start) for a watchdog: a get that never returns shows
        # as blocked, though it never lands in get_latency.
        self.in_flight: tuple[str, float] | None = None
        self.longest_blocked: dict[str, float] = {}  # op -> the longest one was in flight (s)
        weights = dict(w.split("=") for w in args.mix.split(","))
        self.ops = list(weights)
        self.weights = [float(weights[op]) for op in self.ops]
        unknown = set(self.ops) - {"put", "dput", "get", "get_many", "delete"}
        if unknown:
            raise SystemExit(f"--mix: unknown ops {sorted(unknown)}")

    def key_index(self) -> int:
        return self.rng.randrange(self.args.first, self.args.first + self.args.keys)

    def put(self, i: int, version: int | None = None, durable: bool = False) -> None:
        version = self.rng.randrange(self.args.versions) if version is None else version
        started = time.perf_counter()
        if durable:  # a copy on a storage node (kvpool-server --role node), as well as here
            self.pool.put(key_of(i), content(i, version, self.args.shapes), durable=True, replicas=1)
        else:
            self.pool.put(key_of(i), content(i, version, self.args.shapes))
        self.put_latency.add(time.perf_counter() - started)
        self.counts["puts"] += 1

    def delete(self, i: int) -> None:
        from kvpool import errors

        try:
            self.pool.delete(key_of(i))
            self.counts["deletes"] += 1
        except errors.KeyNotFoundError:
            self.counts["deletes_absent"] += 1

    def request(self, i: int) -> tuple[Any, int, int, np.ndarray | None]:
        """(layers argument, start, stop, out buffer or None) for a random get of key ``i``."""
        layers_total = shape_of(i, self.args.shapes)[0]
        kind = self.rng.random()
        if kind < 0.4:
            layers, start, stop = None, 0, layers_total
        elif kind < 0.5:
            start = self.rng.randrange(layers_total)
            layers, stop = start, start + 1  # one layer as an int
        else:
            start = self.rng.randrange(layers_total)
            stop = self.rng.randrange(start + 1, layers_total + 1)
            layers = range(start, stop)
        out = None
        if self.rng.random() < 0.4:
            out = np.empty((stop - start,) + shape_of(i, self.args.shapes)[1:], np.float16)
            out.view(np.uint16).fill(0xFFFF)  # poison: a partial write shows
        return layers, start, stop, out

    def verify(self, i: int, start: int, stop: int, got: Any, out: np.ndarray | None, how: str) -> None:
        if got is None:
            self.counts["misses"] += 1
            return
        problem = check(i, start, stop, got, self.args.versions, self.args.shapes)
        if problem is None and out is not None and got is not out:
            problem = "a get with out= returned another array"
        if problem is None:
            self.counts["hits"] += 1
            return
        self.counts["wrong"] += 1
        if len(self.wrong_samples) < WRONG_SAMPLES:
            self.wrong_samples.append(f"{how}: {problem}")

    def get(self, i: int) -> None:
        layers, start, stop, out = self.request(i)
        self.counts["gets"] += 1
        started = time.perf_counter()
        try:
            got = self.pool.get(key_of(i), layers=layers, out=out)
        finally:
            self.get_latency.add(time.perf_counter() - started)
        self.verify(i, start, stop, got, out, f"get(key {i}, layers={_layers_text(layers)}, "
                                               f"out={'yes' if out is not None else 'no'})")

    def get_many(self) -> None:
        indices = [self.key_index() for _ in range(self.rng.randrange(2, 5))]
        # one layer range for the batch, within the smallest layer count; all layers when the counts agree
        counts = {shape_of(i, self.args.shapes)[0] for i in indices}
        common = min(counts)
        if len(counts) == 1 and self.rng.random() < 0.3:
            layers, start, stop = None, 0, common
        else:
            start = self.rng.randrange(common)
            stop = self.rng.randrange(start + 1, common + 1)
            layers = range(start, stop)
        outs = None
        if self.rng.random() < 0.5:
            outs = [np.empty((stop - start,) + shape_of(i, self.args.shapes)[1:], np.float16) for i in indices]
            for o in outs:
                o.view(np.uint16).fill(0xFFFF)
        self.counts["gets"] += len(indices)
        started = time.perf_counter()
        try:
            results = self.pool.get_many([key_of(i) for i in indices], layers=layers, outs=outs)
        finally:
            self.get_latency.add(time.perf_counter() - started)
        for n, (i, got) in enumerate(zip(indices, results)):
            self.verify(i, start, stop, got, outs[n] if outs else None,
                        f"get_many(key {i} of {indices}, layers={_layers_text(layers)})")

    def step(self) -> None:
        op = self.rng.choices(self.ops, self.weights)[0]
        self.counts["ops"] += 1
        self.in_flight = (op, time.monotonic())
        try:
            if op == "put":
                self.put(self.key_index())
            elif op == "dput":
                self.put(self.key_index(), durable=True)
            elif op == "get":
                self.get(self.key_index())
            elif op == "get_many":
                self.get_many()
            else:
                self.delete(self.key_index())
        except Exception as exc:  # counted by type; the caller-mistake kinds are wrong answers
            name = type(exc).__name__
            self.errors[f"{op}:{name}"] += 1
            if op.startswith("get") and name in CALLER_ERRORS:
                self.counts["wrong"] += 1
                if len(self.wrong_samples) < WRONG_SAMPLES:
                    self.wrong_samples.append(f"{op} raised {name} for a request that fits the key: {exc}")
            elif len(self.error_samples) < 5:
                self.error_samples.append(f"{op}: {name}: {exc}\n{traceback.format_exc(limit=4)}")
        finally:
            self.note_blocked()
            self.in_flight = None

    def note_blocked(self) -> None:
        """Record how long the op in flight has been blocked so far (a watchdog calls this too)."""
        in_flight = self.in_flight
        if in_flight is not None:
            op, since = in_flight
            self.longest_blocked[op] = max(self.longest_blocked.get(op, 0.0), time.monotonic() - since)

    def result(self, seconds: float) -> dict[str, Any]:
        stats = {}
        try:
            stats = self.pool.stats()
        except Exception as exc:  # report what we have
            stats = {"error": repr(exc)}
        remote = {k: v for k, v in stats.get("remote", {}).items() if isinstance(v, (int, float))}
        return {
            "name": self.args.name, "seconds": seconds, **{k: self.counts[k] for k in
                                                           ("ops", "puts", "gets", "hits", "misses", "wrong",
                                                            "deletes", "deletes_absent")},
            "errors": dict(self.errors), "error_samples": self.error_samples, "wrong_samples": self.wrong_samples,
            "get_latency": self.get_latency.to_json(), "put_latency": self.put_latency.to_json(),
            "remote": remote, "local_hits": stats.get("hits", 0),
            "longest_blocked_s": dict(self.longest_blocked),
        }


def _layers_text(layers: Any) -> str:
    if isinstance(layers, range):
        return f"{layers.start}:{layers.stop}"
    return repr(layers)


def wait_for_file(path: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_worker(args: argparse.Namespace) -> int:
    import kvpool

    pool = kvpool.connect(None if args.etcd else args.master, config=worker_config(args), transport=args.transport)
    try:
        worker = Worker(pool, args)
        for i in range(args.first, args.first + args.keys):  # seed: this worker's share of the keys
            if args.seed_share and i % args.seed_share[1] == args.seed_share[0]:
                worker.put(i, 0)
        return drive_worker(pool, worker, args)
    finally:
        pool.close()


def drive_worker(pool: Any, worker: Any, args: argparse.Namespace) -> int:
    """Say READY, wait for the go file, step the workload for ``args.seconds``, print the result."""
    print(f"READY {pool.node_id}", flush=True)
    if args.go_file and not wait_for_file(args.go_file, args.go_timeout_s):
        print(f"no go file {args.go_file} within {args.go_timeout_s} s", flush=True)
        return 2
    started = time.monotonic()
    deadline = started + args.seconds
    done = threading.Event()

    def watchdog() -> None:
        """Samples the op in flight; one still blocked a minute past the end reports for the worker."""
        while not done.wait(0.05):
            if hasattr(worker, "note_blocked"):
                worker.note_blocked()
            if time.monotonic() > deadline + 60.0 and getattr(worker, "in_flight", None) is not None:
                result = worker.result(time.monotonic() - started)
                result["errors"][f"{worker.in_flight[0]}:StillBlockedAtEnd"] = 1
                print(RESULT_PREFIX + json.dumps(result), flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, name="soak-watchdog", daemon=True).start()
    while time.monotonic() < deadline:
        worker.step()
        if args.think_ms:
            time.sleep(args.think_ms / 1000.0)
    done.set()
    print(RESULT_PREFIX + json.dumps(worker.result(time.monotonic() - started)), flush=True)
    return 0


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", required=True)
    parser.add_argument("--etcd", default="", help="master.etcd: follow the master leader in this etcd")
    parser.add_argument("--etcd-prefix", default="/kvpool")
    parser.add_argument("--name", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--cxl-path", default="", help="default <data-dir>/cxl")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--first", type=int, default=0, help="first key index")
    parser.add_argument("--versions", type=int, default=4, help="values per key (overwrites pick one)")
    parser.add_argument("--shapes", type=int, default=0, help="0: a shape per key; N: key i has key i%%N's shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seed-share", type=lambda s: tuple(map(int, s.split("/"))), default=None,
                        metavar="I/N", help="put keys with index %% N == I before starting")
    parser.add_argument("--mix", default="put=3,get=5,get_many=1,delete=1", help="op weights")
    parser.add_argument("--dram", default="0")
    parser.add_argument("--cxl", default="1MiB")
    parser.add_argument("--nvme", default="2MiB")
    parser.add_argument("--heartbeat-ms", type=int, default=500)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--go-file", default="", help="wait until this file exists before starting")
    parser.add_argument("--go-timeout-s", type=float, default=120.0)
    parser.add_argument("--think-ms", type=float, default=0.0, help="sleep between ops")
    parser.add_argument("--no-same-host-index", action="store_true",
                        help="node.same_host_index = false: no reads through other processes' arena indexes")


# -- the orchestrator -----------------------------------------------------------------------------


def run_soak(args: argparse.Namespace) -> int:
    from bench.peer_backends.base import PeerError, ServerProcess, free_port

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvpool-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    seconds = args.minutes * 60.0
    processes: list[ServerProcess] = []
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        from kvpool.cluster.wire.master_client import MasterClient

        master = ServerProcess("master", [sys.executable, "-m", "kvpool.cli.server", "--role", "master",
                                          "--master.listen", address, "--master.heartbeat_ms", str(args.heartbeat_ms),
                                          "--master.dead_after_missed", "6", "--log-level", "WARNING"],
                               work / "master.log", None)
        processes.append(master)
        client = MasterClient(address, request_timeout_s=1.0)
        try:
            master.wait_ready(lambda: client.ping(timeout_s=0.5), 60)
        finally:
            client.close()
        go = work / "go"
        workers = []
        for n in range(args.processes):
            name = f"soak-{n}"
            command = worker_command(
                sys.executable, address, name, work / name, seconds=seconds, keys=args.keys, seed=args.seed + n,
                seed_share=(n, args.processes), versions=args.versions, shapes=args.shapes, cxl=args.cxl,
                nvme=args.nvme,
                heartbeat_ms=args.heartbeat_ms, go_file=str(go), go_timeout_s=120 + 10 * args.processes,
                mix=args.mix, think_ms=args.think_ms or None)
            worker = ServerProcess(name, command, work / f"{name}.log", None)
            processes.append(worker)
            workers.append(worker)
        print(f"master {address}; {args.processes} workers starting (logs in {work})", file=sys.stderr, flush=True)
        for worker in workers:
            worker.wait_ready(lambda w=worker: "READY" in w.output(), 60 + 10 * args.processes)
        go.touch()
        print(f"running {seconds:g} s ...", file=sys.stderr, flush=True)
        deadline = time.monotonic() + seconds + 60 + 5 * args.processes
        for worker in workers:
            while worker.alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            result = parse_result(worker.output(tail_chars=1 << 22))
            if result is None:
                failures.append(f"{worker.name} reported nothing (exit {worker.popen.poll()}):\n{worker.output()}")
            else:
                results.append(result)
    except PeerError as exc:
        failures.append(str(exc))
    finally:
        for process in reversed(processes):
            process.stop()
        clean = not failures and all(not r["wrong"] and not r["errors"] for r in results)
        if not args.work_dir and not args.keep and clean:
            shutil.rmtree(work, ignore_errors=True)
    if results:
        text, total = table(results)
        print(text)
        for r in results:
            for sample in r["wrong_samples"]:
                print(f"WRONG {r['name']}: {sample}")
            for name, n in sorted(r["errors"].items()):
                print(f"error {r['name']}: {name} x{n}")
            for sample in r["error_samples"][:2]:
                print(f"error sample {r['name']}: {sample}")
        print(f"\n{total['wrong']} wrong values in {total['gets']} gets "
              f"({total['hits']} hits, {total['misses']} misses) over {seconds:g} s; "
              f"get p99 {total['get_p99_s'] * 1e3:.2f} ms, max {total['get_max_s'] * 1e3:.2f} ms")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if not clean:
        print(f"logs kept in {work}", file=sys.stderr)
    bad = bool(failures) or not results or sum(r["wrong"] for r in results) > 0
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    worker = sub.add_parser("worker", help="one worker process (started by the soak itself)")
    add_worker_args(worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return run_worker(build_parser().parse_args(argv))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--shapes", type=int, default=0,
                        help="0: a shape per key; N: only N sizes (freed extents are refilled by other keys)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mix", default=DEFAULT_MIX, help="op weights")
    parser.add_argument("--cxl", default="1MiB", help="each worker's cxl arena")
    parser.add_argument("--nvme", default="2MiB", help="each worker's nvme tier (0: none)")
    parser.add_argument("--heartbeat-ms", type=int, default=500)
    parser.add_argument("--think-ms", type=float, default=0.0, help="sleep between a worker's ops")
    parser.add_argument("--work-dir", default="", help="default: a temporary directory, removed after a clean run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    faults = parser.add_argument_group("timed fault soak (bench/soak_faults.py): --duration turns it on")
    faults.add_argument("--duration", type=_duration, default=None,
                        help="run this long (90s, 30m, 1h) with every fault applied in turn, then report")
    faults.add_argument("--faults", default="", help="comma-separated subset of kill9,sigstop,master,disk_full,"
                                                     "small_arena,corrupt,freeze_leader,etcd (default: all)")
    faults.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults")
    faults.add_argument("--stop-s", type=float, default=6.0, help="how long a SIGSTOP or a full disk lasts")
    faults.add_argument("--victims", type=int, default=2, help="worker processes the faults hit")
    faults.add_argument("--victim-mix", default="put=6,dput=1,get=2,delete=1", help="the victims' op weights")
    faults.add_argument("--store-nvme", default="64MiB", help="each storage node's nvme capacity")
    faults.add_argument("--store-disk", default="24m", help="size of the tmpfs under the first storage node")
    faults.add_argument("--no-etcd", action="store_true", help="one master restarted in place, even with etcd")
    args = parser.parse_args(argv)
    if args.duration is not None:
        from bench.soak_faults import run_fault_soak

        if args.mix == DEFAULT_MIX:
            args.mix = "put=2,dput=1,get=5,get_many=1,delete=1"  # durable puts reach the storage nodes
        return run_fault_soak(args)
    return run_soak(args)


def _duration(text: str) -> float:
    from bench.soak_faults import parse_duration

    return parse_duration(text)


if __name__ == "__main__":
    sys.exit(main())
