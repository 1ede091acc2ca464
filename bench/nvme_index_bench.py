"""nvme index size benchmark: do gets from the nvme tier slow down as its index grows?

One local ``kvpool.Pool`` whose nvme tier is ``--ratio`` times its dram tier (no
cxl, promotion off, so an object demoted to nvme stays there). Small objects are
put until the nvme tier is full; at each checkpoint (nvme's object count tripled,
and the end) it reads ``--samples`` random keys that live in nvme into one
``out=`` buffer, checks every byte (content derived from the key index), and
prints objects in nvme, the LMDB index size on disk, get p50/p99 and the pool's
RSS. Then it closes the pool and reopens it: the time to find every nvme object
again from the intact index.

Usage::

    .venv/bin/python bench/nvme_index_bench.py                 # dram 64MiB, nvme 640MiB, 16 KiB objects
    .venv/bin/python bench/nvme_index_bench.py --dram 64MiB --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvpool
from kvpool.config import format_size, parse_size

SHAPE = (2, 2, 32, 2, 32)  # 16 KiB of float16 per object (--object changes the tokens)


def content(i: int) -> np.ndarray:
    base = np.arange(int(np.prod(SHAPE)), dtype=np.uint16) * 7 + np.uint16(i * 2654435761 % 65536)
    return base.view(np.float16).reshape(SHAPE)


def key_of(i: int) -> bytes:
    return b"nvme-index-%010d" % i


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def config(data_dir: str, dram: int, nvme: int) -> dict:
    return {
        "pool": {"name": f"nvme-index-{os.getpid()}", "data_dir": data_dir},
        "tiers": {"dram": {"capacity": dram, "mlock": False}, "cxl": {"capacity": 0},
                  "nvme": {"capacity": nvme}},
        "eviction": {"promote": False},
    }


def tier_objects(pool: kvpool.Pool, name: str) -> int:
    return int(pool.stats()["tiers"][name]["objects"])


def nvme_range(pool: kvpool.Pool, n: int) -> tuple[int, int]:
    """Key indexes nvme may hold after ``n`` puts: LRU demotes the oldest from dram, so they lie
    below dram's; a full nvme has evicted some of them (not strictly the oldest: the gets of
    earlier checkpoints refreshed some), so callers skip the absent ones."""
    return 0, n - tier_objects(pool, "dram")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dram", default="64MiB")
    parser.add_argument("--object", default="16KiB", help="object size (a multiple of 512 B)")
    parser.add_argument("--ratio", type=int, default=10, help="nvme capacity = ratio x dram")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--dir", help="directory for the nvme tier (default: a temporary one)")
    args = parser.parse_args()
    global SHAPE
    SHAPE = (2, 2, max(1, parse_size(args.object) // 512), 2, 32)
    dram = parse_size(args.dram)
    nvme = dram * args.ratio
    data_dir = tempfile.mkdtemp(prefix="kvpool-nvme-index-", dir=args.dir)
    rng = random.Random(7)
    rows = []
    try:
        pool = kvpool.Pool(config(data_dir, dram, nvme))
        print(f"dram {format_size(dram)}, nvme {format_size(nvme)} in {data_dir}; objects of "
              f"{content(0).nbytes} B; {os.cpu_count()} CPUs", file=sys.stderr)
        n = 0
        checkpoints: list[int] = []
        started = time.perf_counter()
        # Fill: put until nvme stops growing (it is full and evicting its oldest).
        last, stalled = -1, 0
        while stalled < 3:
            for _ in range(2000):
                pool.put(key_of(n), content(n))
                n += 1
            in_nvme = tier_objects(pool, "nvme")
            stalled = stalled + 1 if in_nvme <= last else 0
            last = max(last, in_nvme)
            if in_nvme and (not checkpoints or in_nvme >= 3 * checkpoints[-1]):
                checkpoints.append(in_nvme)
                p50, p99 = measure_range(pool, *nvme_range(pool, n), args.samples, rng)
                rows.append((in_nvme, index_bytes(data_dir), p50, p99, rss_mib()))
        put_s = time.perf_counter() - started
        in_nvme = tier_objects(pool, "nvme")
        first, stop = nvme_range(pool, n)
        p50, p99 = measure_range(pool, first, stop, args.samples, rng)
        rows.append((in_nvme, index_bytes(data_dir), p50, p99, rss_mib()))
        pool.close()
        started = time.perf_counter()
        pool = kvpool.Pool(config(data_dir, dram, nvme))
        reopen_s = time.perf_counter() - started
        found = tier_objects(pool, "nvme")
        p50r, p99r = measure_range(pool, first, stop, args.samples, rng)
        pool.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    print(f"\n{n:,} puts in {put_s:.1f} s; nvme ends holding {in_nvme:,} objects "
          f"({in_nvme * content(0).nbytes / dram:.1f}x what dram holds in bytes)\n")
    print("| objects in nvme | LMDB index | nvme get p50 | p99 | pool RSS |")
    print("|---|---|---|---|---|")
    for objects, index, p50, p99, rss in rows:
        print(f"| {objects:,} | {format_size(index)} | {p50:.0f} µs | {p99:.0f} µs | {rss:.0f} MiB |")
    print(f"\nreopened in {reopen_s:.2f} s with {found:,} nvme objects found from the index; "
          f"gets then p50 {p50r:.0f} µs, p99 {p99r:.0f} µs (every byte checked)")
    return 0


def measure_range(pool: kvpool.Pool, first: int, stop: int, samples: int, rng: random.Random) -> tuple[float, float]:
    out = np.empty(SHAPE, np.float16)
    times = []
    for _ in range(samples):
        i = rng.randrange(first, stop)
        while not pool.exists(key_of(i)):  # evicted from a full nvme: not a sample
            i = rng.randrange(first, stop)
        started = time.perf_counter()
        got = pool.get(key_of(i), out=out)
        times.append(time.perf_counter() - started)
        if got is None or not np.array_equal(got.view(np.uint16), content(i).view(np.uint16)):
            raise SystemExit(f"key {i} of {first}..{stop}: {'miss' if got is None else 'WRONG BYTES'}; "
                             f"misses {pool.stats()['misses']}, tiers dram {tier_objects(pool, 'dram')} "
                             f"nvme {tier_objects(pool, 'nvme')}, exists {pool.exists(key_of(i))}")
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def index_bytes(data_dir: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(data_dir):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(".mdb"))
    return total


if __name__ == "__main__":
    sys.exit(main())
