"""Pulls between two emulated hosts over a shaped link: where a transfer is bound by round
trips and where by bandwidth, page-by-page vs aggregated, and k of L layers.

For each ``--rates`` value it builds two network namespaces joined by a bridge
(bench/netlab.py; needs root and iproute2), shapes each host's link with ``tc tbf`` at
that rate, and runs a master and a writer on host 1 and a reader on host 2 (``transport =
"tcp"`` between their own addresses: pulls up to ``node.tcp_pull_max``, 16 MiB, on the
holder's plain TCP port, larger ones over UCX's TCP transport). The writer holds one
``--layers``-layer object per size; the reader measures, per size (median of ``--iters``):

* aggregated: the whole object in one get (one pull, split into ``node.max_message``
  messages);
* page by page: one get per layer (L pulls of one layer each, one at a time);
* k of L: layers [0, L/4) in one get: the bytes are k/L of the object; the time is k/L
  of it plus the per-pull floor.

    sudo python bench/network_bench.py [--rates 1gbit,10gbit,25gbit] [--sizes 64K,1M,16M,64M]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import format_table, parse_sizes, size_label  # noqa: E402
from bench.netlab import Lab, unavailable, wait_for  # noqa: E402

HEADS, DIM = 8, 128


def shape_of(nbytes: int, layers: int) -> tuple[int, ...]:
    tokens = max(1, nbytes // (layers * 2 * HEADS * DIM * 2))
    return (layers, 2, tokens, HEADS, DIM)


def key_of(nbytes: int) -> bytes:
    return b"net-bench-%d" % nbytes


def content(nbytes: int, layers: int) -> Any:
    import numpy as np

    return np.random.default_rng(nbytes).standard_normal(shape_of(nbytes, layers)).astype(np.float16)


def config(master: str, name: str, data_dir: str, dram: str) -> dict[str, Any]:
    return {"pool": {"name": name, "data_dir": data_dir},
            "tiers": {"dram": {"capacity": dram, "mlock": False}, "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
            "master": {"listen": master}, "node": {"pull_timeout_s": 30.0}}


def writer(args: argparse.Namespace) -> int:
    import kvpool

    pool = kvpool.connect(args.master, config=config(args.master, "net-writer", args.data_dir, "512MiB"),
                          transport="tcp")
    try:
        for nbytes in parse_sizes(args.sizes):
            pool.put(key_of(nbytes), content(nbytes, args.layers))
        print("READY", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while not stop.wait(0.5):  # serve pulls until the lab stops this process
            pass
        return 0
    finally:
        pool.close()


def reader(args: argparse.Namespace) -> int:
    import numpy as np

    import kvpool

    pool = kvpool.connect(args.master, config=config(args.master, "net-reader", args.data_dir, "1MiB"),
                          transport="tcp")
    results = []
    try:
        for nbytes in parse_sizes(args.sizes):
            key, want = key_of(nbytes), content(nbytes, args.layers)
            layers = want.shape[0]
            k = max(1, layers // 4)
            out = np.empty_like(want)
            got = pool.get(key, out=out)  # warm: located once, then straight to the holder
            if got is None:
                raise RuntimeError(f"{size_label(nbytes)}: a miss ({pool.stats().get('remote')})")
            assert got is out and np.array_equal(out, want), "wrong bytes"

            def timed(fn: Any) -> float:
                samples = []
                for _ in range(args.iters):
                    t = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t)
                return statistics.median(samples)

            whole = timed(lambda: pool.get(key, out=out))
            paged = timed(lambda: [pool.get(key, layers=range(i, i + 1), out=out[i:i + 1]) for i in range(layers)])
            part = timed(lambda: pool.get(key, layers=range(0, k), out=out[:k]))
            assert np.array_equal(out, want), "wrong bytes"
            results.append({"nbytes": int(want.nbytes), "layers": layers, "k": k, "whole_s": whole,
                            "paged_s": paged, "part_s": part})
        print(json.dumps(results), flush=True)
        return 0
    finally:
        pool.close()


def run_rate(rate: str, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    lab = Lab(2, rate=rate)
    try:
        h1, h2 = lab.hosts
        master = f"tcp://{h1.address}:7700"
        log = tmp / f"master-{rate}.log"
        lab.spawn(h1, ["-m", "kvpool.cli.server", "--role", "master", "--master.listen", master], log,
                  ready=lambda: "listening on" in log.read_text())
        common = ["--master", master, "--sizes", args.sizes, "--layers", str(args.layers), "--iters", str(args.iters)]
        log = tmp / f"writer-{rate}.log"
        lab.spawn(h1, [str(Path(__file__)), "--role", "writer", "--data-dir", str(tmp / "w"), *common],
                                 log, ready=lambda: "READY" in log.read_text(), timeout_s=120)
        log = tmp / f"reader-{rate}.log"
        child = lab.spawn(h2, [str(Path(__file__)), "--role", "reader", "--data-dir", str(tmp / "r"), *common], log)
        wait_for(lambda: child.popen.poll() is not None, 1800, "the reader")
        lines = [line for line in child.output().splitlines() if line.startswith("[")]
        if child.popen.returncode != 0 or not lines:
            raise RuntimeError(f"reader failed:\n{child.output()[-3000:]}")
        return json.loads(lines[-1])
    finally:
        lab.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("bench", "writer", "reader"), default="bench")
    parser.add_argument("--rates", default="1gbit,10gbit,25gbit", help="tc tbf rates, one lab each")
    parser.add_argument("--sizes", default="64K,1M,16M,64M")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--master", default="")
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed path)")
    args = parser.parse_args()
    if args.role == "writer":
        return writer(args)
    if args.role == "reader":
        return reader(args)
    why = unavailable()
    if why:
        print(f"network_bench: {why}", file=sys.stderr)
        return 2
    rows = []
    tmp = tempfile.mkdtemp(prefix="kvpool-netbench-")
    try:
        for rate in args.rates.split(","):
            print(f"link {rate} ...", file=sys.stderr)
            for r in run_rate(rate, args, Path(tmp)):
                n, layers, k = r["nbytes"], r["layers"], r["k"]
                rows.append([rate, size_label(n), f"{r['whole_s'] * 1e3:.2f}", f"{n / r['whole_s'] / 1e9:.3f}",
                             f"{r['paged_s'] * 1e3:.2f}", f"{r['paged_s'] / r['whole_s']:.2f}",
                             f"{k}/{layers}", f"{r['part_s'] * 1e3:.2f}", f"{r['part_s'] / r['whole_s']:.2f}"])
    finally:
        if args.keep:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(format_table(["link", "object", "whole ms", "whole GB/s", "per-layer ms", "per-layer/whole",
                        "k/L", "k of L ms", "time ratio"], rows))
    print("\n(two network namespaces on one VM, veth + bridge, tbf on each host's egress; pulls up to 4 MiB over "
          "plain TCP, larger ones over UCX over TCP; "
          "median of --iters; the time ratio of k of L vs the whole object is k/L when bandwidth-bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
