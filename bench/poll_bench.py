"""What polling before blocking (``node.reply_poll_us``, ``node.serve_poll_us``) buys, and costs.

A thread blocked in ``recv`` sleeps and its CPU goes idle; on a virtual machine an idle vCPU
halts, and waking it when the bytes land costs tens of microseconds. A kvpool reader polls
for the bytes of a TCP pull's reply and for a master query's answer for up to
``node.reply_poll_us`` before it blocks, each time it waits; a holder's connection thread
polls for the reader's next request for up to ``node.serve_poll_us`` after answering one
(:class:`kvpool.transport.tcp.stream.ReplyPoll`). Measured side by side, in one run:

* ``socket``: the floor. A ``--size`` reply to a 48-byte request between two processes over
  loopback TCP, no kvpool code: the client blocked in ``recv_into`` against the client
  polling with ``MSG_DONTWAIT`` (the server blocks in both).
* ``kvpool``: "polls", a reader with ``reply_poll_us = --poll-us`` (default 200) reading from
  a writer with ``serve_poll_us = --poll-us``, and "blocks", a reader and a writer with both
  0, taking turns round by round (one master): one-key get p50 of ``--size`` objects (each
  key read once, as ``bench/peers.py`` reads them: the guessed-holder path) and one-key
  exists p50 (the master's query port, which only the reader polls for). Every get's bytes
  are compared with what the writer put.

Placements (``--placements``):

* ``split``: this process (the readers) on CPU 0, master and writers on CPU 1 (as
  ``bench/peers.py``);
* ``shared``: every process on CPU 0 (more processes than cores: a poller must not starve
  the peer it waits for);
* ``hog-reader`` / ``hog-holder``: ``split`` plus a CPU-bound process on CPU 0 / CPU 1: its
  loop rate during each pair's turns is what that pair's waiting left to a neighbour.

Usage::

    python bench/poll_bench.py                    # 64K, 8 rounds, all placements
    python bench/poll_bench.py --rounds 4 --per-round 32 --placements split --json out.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import format_table, parse_size, percentile, size_label  # noqa: E402
from bench.peer_backends.base import ServerProcess, free_port, kv_shape  # noqa: E402

PLACEMENTS = ("split", "shared", "hog-reader", "hog-holder")
_COUNTER = struct.Struct("<Q")

# A writer: puts keys <prefix><i> (content from seed i), says "ready", serves until stdin closes.
_WRITER = """
import os, sys, numpy as np, kvpool
master, n, size, data_dir, prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[6]
shape = tuple(int(x) for x in sys.argv[5].split(","))
pool = kvpool.connect(master, transport="tcp", config={
    "pool": {"name": f"pollbench-w-{prefix}{os.getpid()}", "data_dir": data_dir},
    "tiers": {"dram": {"capacity": max(64 << 20, 2 * n * size)}, "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
    "master": {"listen": master}, "node": {"serve_poll_us": int(sys.argv[7])}})
for i in range(n):
    pool.put(f"{prefix}{i}", np.random.default_rng(i).integers(0, 255, size, np.uint8).view(np.float16).reshape(shape))
print("ready", flush=True)
sys.stdin.read()
tcp = pool.stats()["node"]["transfer_by_path"]["tcp"]
print(" ".join(str(tcp.get(k, 0)) for k in ("polls_caught", "polls_ran_out", "polls_preempted")), flush=True)
pool.close()
"""

# The hog: counts loops into a shared counter until killed.
_HOG = """
import mmap, struct, sys
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 8)
n = 0
while True:
    n += 1
    if not n & 0xFFF:
        struct.pack_into("<Q", m, 0, n)
"""


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):  # a thread that just ended
            pass


def socket_floor(nbytes: int, iters: int, poll: bool, client_cpu: int, server_cpu: int) -> float:
    """p50 seconds of a ``nbytes`` reply to a 48-byte request over loopback TCP (fork; no kvpool)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        pid = os.fork()
        if pid == 0:  # the server: answer every request with nbytes
            try:
                os.sched_setaffinity(0, {server_cpu})
                conn, _ = listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                reply = memoryview(np.random.default_rng(0).integers(0, 255, nbytes, np.uint8))
                while conn.recv(64):
                    conn.sendall(reply)
            finally:
                os._exit(0)
        os.sched_setaffinity(0, {client_cpu})
        sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(nbytes))
    times = []
    try:
        for _ in range(iters):
            t0 = time.perf_counter()
            sock.sendall(b"r" * 48)
            got = 0
            while got < nbytes:
                if poll:
                    try:
                        got += sock.recv_into(buf[got:], 0, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        pass
                else:
                    got += sock.recv_into(buf[got:])
            times.append(time.perf_counter() - t0)
    finally:
        sock.close()
        os.waitpid(pid, 0)
    return percentile(times[iters // 10:], 50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=64 << 10, help="object size (default 64K)")
    parser.add_argument("--rounds", type=int, default=8, help="turns of each reader per placement")
    parser.add_argument("--per-round", type=int, default=64, help="gets (and exists) per reader per turn")
    parser.add_argument("--poll-us", type=int, default=200,
                        help="node.reply_poll_us of the polling reader and node.serve_poll_us of its writer")
    parser.add_argument("--serve-poll-us", type=int, default=None,
                        help="the polling pair's writer's node.serve_poll_us (default: --poll-us)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma-separated: {','.join(PLACEMENTS)}")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    placements = [p for p in args.placements.split(",") if p]
    if unknown := set(placements) - set(PLACEMENTS):
        parser.error(f"unknown placements {sorted(unknown)}")
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        print("poll bench: needs CPUs 0 and 1", file=sys.stderr)
        return 2
    shape = kv_shape(args.size)

    print(f"poll bench: {size_label(args.size)} objects {shape}; {args.rounds} rounds x {args.per_round} per reader "
          f"per placement; CPUs pinned with sched_setaffinity (every thread of each process)")
    floor_rows = []
    for placement, server_cpu in (("split", 1), ("shared", 0)):
        if placement in placements:
            blocked = socket_floor(args.size, 2000, False, 0, server_cpu)
            polled = socket_floor(args.size, 2000, True, 0, server_cpu)
            floor_rows.append([placement, f"{blocked * 1e6:.1f}", f"{polled * 1e6:.1f}", f"{polled / blocked:.2f}x"])
    print(f"\n== socket floor: a {size_label(args.size)} reply over loopback TCP, no kvpool (p50 us) ==")
    print(format_table(["placement", "client blocks", "client polls", "polls / blocks"], floor_rows))

    import kvpool

    keys_needed = len(placements) * args.rounds * args.per_round
    modes = {"polls": args.poll_us, "blocks": 0}  # each reader pulls from a writer of its own kind
    serve_poll = {"polls": args.poll_us if args.serve_poll_us is None else args.serve_poll_us, "blocks": 0}
    work = Path(tempfile.mkdtemp(prefix="kvpool-pollbench-"))
    master_address = f"tcp://127.0.0.1:{free_port()}"
    master = ServerProcess("kvpool master", [sys.executable, "-m", "kvpool.cli.server", "--role", "master",
                                             "--master.listen", master_address, "--log-level", "WARNING"],
                           work / "master.log", frozenset({1}))
    writers = {mode: subprocess.Popen(
        [sys.executable, "-c", _WRITER, master_address, str(keys_needed), str(args.size), str(work / f"writer-{mode}"),
         ",".join(map(str, shape)), mode[0], str(serve_poll[mode])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT) for mode, poll_us in modes.items()}
    hog: subprocess.Popen[bytes] | None = None
    readers: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    try:
        for writer in writers.values():
            pin_process(writer.pid, {1})
            if writer.stdout is None or writer.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a writer did not start (exit code {writer.poll()})")
        for mode, poll_us in modes.items():
            readers[mode] = kvpool.connect(master_address, transport="tcp", config={
                "pool": {"name": f"pollbench-r-{mode}-{os.getpid()}", "data_dir": str(work / mode)},
                "tiers": {"dram": {"capacity": "64MiB", "mlock": False, "prefault": False},
                          "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                "master": {"listen": master_address}, "node": {"reply_poll_us": poll_us}})
        out = np.empty(args.size, np.uint8)
        view = out.view(np.float16).reshape(shape)
        next_key = dict.fromkeys(modes, 0)
        # what each get must return (the writers put seed i's bytes under <p|b><i>)
        digests = [xxhash.xxh3_64_intdigest(np.random.default_rng(i).integers(0, 255, args.size, np.uint8))
                   for i in range(keys_needed)]
        counter_path = work / "hog-counter"
        counter_path.write_bytes(bytes(8))
        with counter_path.open("r+b") as f:
            counter = mmap.mmap(f.fileno(), 8)
        for placement in placements:
            cpus = {0} if placement == "shared" else {1}
            pin_process(master.pid, cpus)
            for writer in writers.values():
                pin_process(writer.pid, cpus)
            pin_process(os.getpid(), {0})
            if placement.startswith("hog"):
                hog = subprocess.Popen([sys.executable, "-c", _HOG, str(counter_path)])
                pin_process(hog.pid, {0} if placement == "hog-reader" else {1})
                time.sleep(0.5)
            results: dict[str, dict[str, list[float]]] = {m: {"get": [], "exists": [], "hog": []} for m in readers}
            stats_before = {m: _polls(p) for m, p in readers.items()}
            for rnd in range(args.rounds):
                order = list(readers) if rnd % 2 == 0 else list(reversed(readers))
                for mode in order:
                    pool = readers[mode]
                    gets, exists = [], []
                    loops0, t_start = _COUNTER.unpack_from(counter)[0], time.perf_counter()
                    keys = [f"{mode[0]}{next_key[mode] + i}" for i in range(args.per_round)]
                    next_key[mode] += args.per_round
                    for key in keys:  # back to back, as a decode step reads consecutive prefixes
                        t0 = time.perf_counter()
                        got = pool.get(key, out=view)
                        gets.append(time.perf_counter() - t0)
                        if got is None or xxhash.xxh3_64_intdigest(out) != digests[int(key[1:])]:
                            raise RuntimeError(f"{mode} reader: get of {key} did not return the bytes put")
                    for key in keys:
                        t0 = time.perf_counter()
                        present = pool.exists(key)
                        exists.append(time.perf_counter() - t0)
                        if not present:
                            raise RuntimeError(f"{mode} reader: exists of {key} said no")
                    elapsed = time.perf_counter() - t_start
                    results[mode]["get"].append(percentile(gets, 50))
                    results[mode]["exists"].append(percentile(exists, 50))
                    results[mode]["hog"].append((_COUNTER.unpack_from(counter)[0] - loops0) / elapsed)
            if hog is not None:
                hog.kill()
                hog.wait()
                hog = None
            for mode, pool in readers.items():
                after = _polls(pool)
                rows.append({
                    "placement": placement, "reader": mode,
                    "get_p50_us": float(np.median(results[mode]["get"])) * 1e6,
                    "exists_p50_us": float(np.median(results[mode]["exists"])) * 1e6,
                    "polls_caught": after[0] - stats_before[mode][0],
                    "polls_ran_out": after[1] - stats_before[mode][1],
                    "polls_preempted": after[2] - stats_before[mode][2],
                    "hog_mloops_per_s": (float(np.median(results[mode]["hog"])) / 1e6
                                         if placement.startswith("hog") else None),
                    "rounds": results[mode],
                })
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        for pool in readers.values():
            pool.close()
        for mode, writer in writers.items():
            if writer.stdin is not None:
                writer.stdin.close()
            try:
                holder_polls = writer.stdout.read().strip() if writer.stdout is not None else ""
                writer.wait(20)
            except subprocess.TimeoutExpired:
                writer.kill()
                writer.wait()
            else:
                print(f"{mode} writer (holder) polls caught/ran out/preempted: {holder_polls.replace(' ', '/')}")
        master.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)

    print(f"\n== kvpool: one-key {size_label(args.size)} get and exists, reader+writer pairs taking turns "
          f"(reply_poll_us and serve_poll_us {args.poll_us} vs 0) ==")
    table = [[r["placement"], f"{r['reader']} ({args.poll_us if r['reader'] == 'polls' else 0} us)",
              f"{r['get_p50_us']:.1f}", f"{r['exists_p50_us']:.1f}",
              f"{r['polls_caught']}/{r['polls_ran_out']}/{r['polls_preempted']}",
              "-" if r["hog_mloops_per_s"] is None else f"{r['hog_mloops_per_s']:.2f}"] for r in rows]
    print(format_table(["placement", "pair", "get p50 us", "exists p50 us", "reader polls caught/ran out/preempted",
                        "hog Mloops/s"], table))
    print("\npolling pair / blocking pair, median of the rounds' ratios (lowest-highest):")
    for placement in placements:
        by_mode = {r["reader"]: r["rounds"] for r in rows if r["placement"] == placement}
        for what in ("get", "exists") + (("hog",) if placement.startswith("hog") else ()):
            ratios = [a / b for a, b in zip(by_mode["polls"][what], by_mode["blocks"][what]) if b]
            print(f"  {placement:10s} {what:7s} {np.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    print("hog: its loop rate while that pair took its turns (what their waiting left to a CPU-bound neighbour)")
    if args.json:
        Path(args.json).write_text(json.dumps({"floor": floor_rows, "rows": rows}, indent=1))
    return 0


def _polls(pool: Any) -> tuple[int, int, int]:
    tcp = pool.stats()["remote"].get("tcp_pull_client", {})
    return tcp.get("polls_caught", 0), tcp.get("polls_ran_out", 0), tcp.get("polls_preempted", 0)


if __name__ == "__main__":
    sys.exit(main())
