"""Checksum benchmark: what a verified copy costs against a plain memcpy, per way of computing it.

A same-host read from ``cxl`` copies an object's layers out of another process's arena and
checks every layer of the copy against its xxh3-64 (:meth:`ObjectHeader.copy_verified`). For
each size (a KV object ``[layers, 2, tokens, 8, 128]`` float16 of that many bytes, up to 32
layers) and in one run, interleaved round by round, it times:

- ``memcpy``: ``np.copyto`` of the payload (the reference: a copy with no check);
- ``copy, then hash``: the copy, then one xxhash call per layer (Python);
- ``copy+hash per layer``: each layer hashed right after its copy, while in cache (Python);
- ``one pass (C)``: ``kvpool._layersum``, each layer hashed as it is copied (where built);
- ``hash only (C)`` / ``hash only (xxhash)``: the checksums alone, without a copy.

Source and destination are pre-faulted and the source is a working set larger than the
last-level cache at 16 MiB and above, as an arena is. It prints GB/s (median of rounds) and
each way's time over memcpy's; nothing is asserted. Usage::

    .venv/bin/python bench/checksum_bench.py                 # 64K, 1M, 16M
    .venv/bin/python bench/checksum_bench.py --sizes 16M --iters 50 --cpu 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``kvpool`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_common_args, format_table, size_label
from bench.peer_backends.base import kv_shape
from kvpool.native import extension

WORKING_SET_BYTES = 64 << 20  # sources cycled through, so large copies read from memory, not cache


def ways(size: int, layer_nbytes: int) -> dict[str, Callable[[memoryview, memoryview], object]]:
    def copy_then_hash(dst: memoryview, src: memoryview) -> object:
        dst[:] = src
        return [xxhash.xxh3_64_intdigest(dst[i:i + layer_nbytes]) for i in range(0, size, layer_nbytes)]

    def per_layer(dst: memoryview, src: memoryview) -> object:
        sums = []
        for i in range(0, size, layer_nbytes):
            part = dst[i:i + layer_nbytes]
            part[:] = src[i:i + layer_nbytes]
            sums.append(xxhash.xxh3_64_intdigest(part))
        return sums

    def memcpy(dst: memoryview, src: memoryview) -> object:
        return np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))

    found: dict[str, Callable[[memoryview, memoryview], object]] = {
        "memcpy": memcpy, "copy, then hash": copy_then_hash, "copy+hash per layer": per_layer}
    native = extension("_layersum")
    if native is not None and layer_nbytes >= native.MIN_STEP:
        found["one pass (C)"] = lambda dst, src: native.copy_layer_digests(dst, src, layer_nbytes)
        found["hash only (C)"] = lambda dst, src: native.layer_digests(src, layer_nbytes)
    found["hash only (xxhash)"] = lambda dst, src: [
        xxhash.xxh3_64_intdigest(src[i:i + layer_nbytes]) for i in range(0, size, layer_nbytes)]
    return found


def measure(size: int, iters: int, warmup: int) -> list[list[object]]:
    shape = kv_shape(size)
    layer_nbytes = size // shape[0]
    count = max(2, WORKING_SET_BYTES // size)
    rng = np.random.default_rng(size)
    sources = [memoryview(rng.integers(0, 256, size, dtype=np.uint8)) for _ in range(count)]
    dst = memoryview(np.ones(size, np.uint8))
    chosen = ways(size, layer_nbytes)
    times: dict[str, list[float]] = {name: [] for name in chosen}
    calls = max(1, (16 << 20) // size)  # ~16 MiB copied per timed sample
    for round_ in range(warmup + iters):
        for name, way in chosen.items():  # interleaved: every way meets the same minute
            started = time.perf_counter()
            for j in range(calls):
                way(dst, sources[(round_ * calls + j) % count])
            if round_ >= warmup:
                times[name].append((time.perf_counter() - started) / calls)
    reference = statistics.median(times["memcpy"])
    return [[size_label(size), f"{shape[0]} x {size_label(layer_nbytes)}", name,
             size / statistics.median(t) / 1e9, statistics.median(t) * 1e6, statistics.median(t) / reference]
            for name, t in times.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, sizes="64K,1M,16M", iters=20, warmup=2)
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU (default: not pinned)")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    native = extension("_layersum")
    built = native.VARIANT if native is not None else "not built (checksums in Python)"
    print(f"kvpool._layersum: {built}; " + (f"pinned to CPU {args.cpu}" if args.cpu is not None else "not pinned"))
    rows = [row for size in args.sizes for row in measure(size, args.iters, args.warmup)]
    print(format_table(["size", "layers", "way", "GB/s", "us per copy", "time / memcpy"], rows, align="lllrrr"))
    print("\nGB/s and us: median of rounds; time / memcpy: that median over memcpy's, measured interleaved.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
