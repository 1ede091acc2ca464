"""What authentication costs: master round trips and a 1 MiB pull, auth on vs off, in one run.

For each mode it starts, on 127.0.0.1, a master process (``security.auth`` on with a fresh
key file, or off) and a writer process that joins the pool and holds one object of
``--size`` bytes in its dram tier; then this process measures

* ``ping`` and single-key ``exists`` round trips (p50/p99, one in flight);
* a pull of the whole object from the writer: ``locate`` + read + verify + ``release``,
  as ``kvpool get`` does (p50, GB/s);

and prints both modes side by side with the ratio on/off. Auth on means CURVE on every
ZeroMQ socket (the handshake once per connection, then per-message encryption); pulls
themselves do not go over ZeroMQ.

    python bench/auth_bench.py [--iters 5] [--warmup 1] [--calls 400] [--size 1M]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import Timing, format_table, parse_size  # noqa: E402

KEY = b"auth-bench-object"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(master: str, security: dict[str, Any], data_dir: str, name: str) -> dict[str, Any]:
    return {
        "pool": {"name": name, "data_dir": data_dir},
        "tiers": {"dram": {"capacity": "64MiB", "mlock": False}, "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
        "master": {"listen": master},
        "security": security,
    }


def _shape(nbytes: int) -> tuple[int, ...]:
    """A float16 KV shape [layers, 2, tokens, heads, dim] of about ``nbytes``."""
    tokens = max(1, nbytes // (4 * 2 * 8 * 128 * 2))
    return (4, 2, tokens, 8, 128)


def writer_main(spec: dict[str, Any]) -> None:
    """(In a child process) join the pool, hold one object, wait until stdin closes."""
    import kvpool

    pool = kvpool.connect(spec["master"], config=spec["config"])
    try:
        data = np.random.default_rng(0).standard_normal(_shape(spec["size"])).astype(np.float16)
        pool.put(KEY, data)
        print("ready", flush=True)
        sys.stdin.read()
    finally:
        pool.close()


def measure(mode: str, security: dict[str, Any], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kvpool.api import out_view
    from kvpool.cluster.node.located import located_replicas
    from kvpool.cluster.node.reader import ReplicaReader
    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.config import Config
    from kvpool.transport import local_host_id

    master = f"tcp://127.0.0.1:{_free_port()}"
    argv = [sys.executable, "-m", "kvpool.cluster.master", "--listen", master, "--log-level", "WARNING"]
    for name, value in security.items():
        argv += [f"--security.{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(subprocess.Popen(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, text=True))
        config = Config.load(_config(master, security, str(tmp / f"{mode}-reader"), f"auth-bench-{mode}-r"))
        client = MasterClient(master, config=config, request_timeout_s=10)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping(timeout_s=0.5)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
        writer_spec = {"master": master, "size": args.size,
                       "config": _config(master, security, str(tmp / f"{mode}-writer"), f"auth-bench-{mode}-w")}
        writer = subprocess.Popen([sys.executable, __file__, "--writer", json.dumps(writer_spec)], cwd=REPO_ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(writer)
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready", "writer failed"
        reader = ReplicaReader(local_host_id(), transport="auto", pull_timeout_s=10)
        ping, exists, pull = Timing(0), Timing(0), Timing(0)

        def pull_once() -> None:
            located = client.locate(KEY, lease=True)
            try:
                arr = reader.read(KEY, located_replicas(located, 0, reader.counters), None, None, out_view)
            finally:
                client.release([located.lease_id])
            assert arr is not None, dict(reader.counters)
            pull.nbytes = arr.nbytes

        for rnd in range(args.warmup + args.iters):
            samples: dict[str, list[float]] = {"ping": [], "exists": [], "pull": []}
            for _ in range(args.calls):
                t0 = time.perf_counter()
                client.ping()
                t1 = time.perf_counter()
                client.exists(KEY)
                t2 = time.perf_counter()
                samples["ping"].append(t1 - t0)
                samples["exists"].append(t2 - t1)
            for _ in range(max(1, args.calls // 4)):
                t0 = time.perf_counter()
                pull_once()
                samples["pull"].append(time.perf_counter() - t0)
            if rnd >= args.warmup:
                ping.add_round(samples["ping"])
                exists.add_round(samples["exists"])
                pull.add_round(samples["pull"])
        reader.close()
        client.close()
        return {"ping": ping, "exists": exists, "pull": pull}
    finally:
        for proc in reversed(procs):
            if proc.stdin is not None:
                proc.stdin.close()
            else:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--calls", type=int, default=400, help="round trips per round (pulls: a quarter)")
    parser.add_argument("--size", type=parse_size, default=parse_size("1M"), help="object size (default 1M)")
    parser.add_argument("--writer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.writer:
        writer_main(json.loads(args.writer))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvpool-auth-bench-") as name:
        tmp = Path(name)
        from kvpool.cluster.wire.security import keygen

        key_file = keygen(tmp / "cluster.key")
        results = {
            "off": measure("off", {"auth": False}, args, tmp),
            "on": measure("on", {"auth": True, "key_file": str(key_file)}, args, tmp),
        }
    rows = []
    for what, label in (("ping", "ping"), ("exists", "exists (1 key)")):
        off, on = results["off"][what], results["on"][what]
        rows.append([label, "p50 us", off.p(50) * 1e6, on.p(50) * 1e6, on.p(50) / off.p(50)])
        rows.append([label, "p99 us", off.p(99) * 1e6, on.p(99) * 1e6, on.p(99) / off.p(99)])
    off, on = results["off"]["pull"], results["on"]["pull"]
    size = f"pull {off.nbytes / (1 << 20):.3g} MiB"
    rows.append([size, "p50 us", off.p(50) * 1e6, on.p(50) * 1e6, on.p(50) / off.p(50)])
    rows.append([size, "GB/s", off.gbps, on.gbps, on.gbps / off.gbps])
    print(f"auth cost: {args.iters} rounds x {args.calls} round trips ({args.calls // 4} pulls) per mode, "
          f"127.0.0.1, one request in flight")
    print(format_table(["operation", "metric", "auth off", "auth on", "on/off"], rows, align="llrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
