"""Tier benchmark: put / get(out=) throughput and latency of each kvpool tier.

For each tier (hbm, dram, cxl, nvme; each in its own single-tier ``kvpool.Pool``)
and each object size, puts a working set of distinct KV objects
(``[layers, 2, tokens, kv_heads, head_dim]`` float16), gets every one back into
a preallocated ``out=`` array, deletes them (untimed) and repeats. In the same
run it measures the physical reference on this machine, with the same access
pattern and working set:

- memory tiers: single-thread ``np.copyto`` between pre-faulted buffers
  (get: working set -> one reused buffer; put: working set -> working set);
- nvme: raw sequential ``O_DIRECT`` ``os.preadv`` / ``os.pwritev`` of the same
  sizes, page-aligned ``mmap`` buffers, on a preallocated file in the same
  directory as the tier's segment files.

It prints one table (GB/s, p50/p99 latency, reference GB/s, tier/reference
ratio) and the project's throughput targets with the measured ratio (reported,
not asserted). It owns nothing of the pool: tier code is measured, never
patched. Usage::

    .venv/bin/python bench/tier_bench.py                      # all tiers, 64K..64M
    .venv/bin/python bench/tier_bench.py --tiers dram,nvme --plot tiers.png
    .venv/bin/python bench/tier_bench.py --quick --tiers dram # smoke run, seconds
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``kvpool`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvpool
from bench.common import Progress, Timing, add_common_args, format_table, parse_size, plot_series, size_label
from kvpool.config import Config
from kvpool.errors import ConfigError
from kvpool.objformat import ObjectSpec

TIERS = ("hbm", "dram", "cxl", "nvme")
HEAD_DIM = 128
DTYPE = np.float16
DIRECT_ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the logical block
MiB = 1 << 20

# (tier, op, smallest size it applies to, minimum ratio, reference name): the
# issue's targets, printed against what was measured.
TARGETS = (
    ("dram", "get", MiB, 0.8, "memcpy"),
    ("dram", "put", MiB, 0.5, "memcpy (put copies and checksums)"),
    ("nvme", "get", MiB, 0.7, "raw O_DIRECT read"),
)


@dataclass
class Row:
    tier: str
    op: str
    size: int
    objects: int
    timing: Timing
    reference: str
    ref_timing: Timing

    @property
    def ratio(self) -> float:
        """Tier GB/s over reference GB/s (NaN when the reference could not run)."""
        ref = self.ref_timing.gbps
        return self.timing.gbps / ref if ref > 0 else float("nan")


# -- object shapes and working sets ------------------------------------------------------


def kv_shape(nbytes: int, layers: int) -> tuple[int, int, int, int, int]:
    """``[layers, 2, tokens, kv_heads, head_dim]`` float16 of exactly ``nbytes``.

    head_dim is 128 and kv_heads at most 8 (a Llama-style GQA model); tokens
    take the rest. Raises ValueError when ``nbytes`` is not a whole number of
    (layer x K,V x one head x head_dim) rows.
    """
    row = layers * 2 * HEAD_DIM * np.dtype(DTYPE).itemsize
    if nbytes % row:
        raise ValueError(f"size {nbytes} is not a multiple of {row} bytes "
                         f"({layers} layers x K,V x head_dim {HEAD_DIM} x float16)")
    heads_x_tokens = nbytes // row
    kv_heads = next(h for h in (8, 4, 2, 1) if heads_x_tokens % h == 0)
    return (layers, 2, heads_x_tokens // kv_heads, kv_heads, HEAD_DIM)


def objects_for(size: int, working_set: int, min_objects: int, max_objects: int) -> int:
    """How many distinct objects of ``size`` make up the working set."""
    return max(min_objects, min(max_objects, working_set // size))


def make_sources(shape: tuple[int, ...], count: int, seed: int) -> np.ndarray:
    """``count`` distinct KV arrays in one pre-faulted block (random bytes, tiled for speed)."""
    block = np.empty((count, *shape), dtype=DTYPE)
    flat = block.reshape(-1).view(np.uint8)
    pattern = np.random.default_rng(seed).integers(0, 256, size=min(len(flat), MiB) + 4093, dtype=np.uint8)
    # A tile length of 1 MiB + 4093 (odd) keeps objects from being byte-identical.
    for start in range(0, len(flat), len(pattern)):
        chunk = flat[start:start + len(pattern)]
        chunk[:] = pattern[:len(chunk)]
    return block


# -- references ------------------------------------------------------------------------------


class Reference:
    """The physical limit a tier is compared against, measured operation by operation next to it.

    Each tier operation is preceded by the same operation on the reference
    (write object i, then put object i; read object i, then get object i), so
    both see the same machine: on a shared VM memory and disk bandwidth drift
    by 2-3x within seconds. ``write(i)`` / ``read(i)`` return seconds taken.
    """

    get_name = put_name = ""

    def prepare(self, size: int, objects: int) -> None:
        raise NotImplementedError

    def write(self, index: int) -> float:
        raise NotImplementedError

    def read(self, index: int) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemcpyReference(Reference):
    """Single-thread ``np.copyto`` between pre-faulted buffers, the access pattern of a memory tier.

    put: working set -> working set (user arrays into the arena); get: working
    set -> one reused buffer (arena into one ``out=`` array).
    """

    get_name, put_name = "memcpy ws->1", "memcpy ws->ws"

    def prepare(self, size: int, objects: int) -> None:
        self.src = np.ones((objects, size), dtype=np.uint8)  # np.ones touches every page
        self.dst = np.ones((objects, size), dtype=np.uint8)
        self.one = np.ones(size, dtype=np.uint8)

    def write(self, index: int) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst[index], self.src[index])
        return time.perf_counter() - t0

    def read(self, index: int) -> float:
        t0 = time.perf_counter()
        np.copyto(self.one, self.src[index])
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.src, self.dst, self.one


class DirectIOReference(Reference):
    """Raw sequential O_DIRECT ``pwritev`` / ``preadv`` of whole objects, one syscall each.

    The file is preallocated (like the tier's segments) in the directory the
    nvme tier uses, and the buffer is a page-aligned anonymous mmap. Where the
    filesystem refuses O_DIRECT, ``unavailable`` says so and nothing is timed.
    """

    get_name, put_name = "O_DIRECT read", "O_DIRECT write"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.unavailable: str | None = None if hasattr(os, "O_DIRECT") else "this platform has no O_DIRECT"
        self.fd: int | None = None

    def prepare(self, size: int, objects: int) -> None:
        self.size = size
        self.slot = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
        self.path = self.directory / f"raw-odirect-{os.getpid()}.bin"
        if self.unavailable:
            return
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.unavailable = f"O_DIRECT unavailable on {self.directory} ({exc.strerror})"
            return
        os.posix_fallocate(self.fd, 0, self.slot * objects)
        self.buf = mmap.mmap(-1, self.slot)  # page-aligned, as O_DIRECT needs
        self.buf.write(np.random.default_rng(size).integers(0, 256, size=self.slot, dtype=np.uint8).tobytes())
        self.view = memoryview(self.buf)[:size]

    def _io(self, syscall: Any, index: int) -> float:
        if self.fd is None:
            return math.nan
        t0 = time.perf_counter()
        done = syscall(self.fd, [self.view], index * self.slot)
        elapsed = time.perf_counter() - t0
        if done != self.size:
            raise OSError(f"short O_DIRECT {syscall.__name__}: {done} of {self.size} bytes")
        return elapsed

    def write(self, index: int) -> float:
        return self._io(os.pwritev, index)

    def read(self, index: int) -> float:
        return self._io(os.preadv, index)

    def close(self) -> None:
        if self.fd is not None:
            self.view.release()
            self.buf.close()
            os.close(self.fd)
            self.fd = None
        self.path.unlink(missing_ok=True)


# -- filesystem checks -----------------------------------------------------------------------


def filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` lives on (longest mount point prefix), or ``?``."""
    target = str(path.resolve())
    best, fstype = "", "?"
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                before, _, after = line.partition(" - ")
                mount_point = before.split()[4].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, fstype = mount_point, after.split()[0]
    except OSError:
        pass
    return fstype


def transparent_hugepages() -> str:
    """The kernel's THP mode (``always``/``madvise``/``never``): copies from huge pages run faster."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else text.strip()


# -- one tier ------------------------------------------------------------------------------


def tier_config(tier: str, capacity: int, data_dir: Path, pool_name: str,
                overrides: Sequence[tuple[str, str]] = ()) -> Config:
    """A pool with only ``tier`` enabled, no promotion, capacity for the largest working set."""
    data: dict[str, Any] = {
        "pool": {"name": pool_name, "data_dir": str(data_dir)},
        "tiers": {t: {"capacity": capacity if t == tier else 0} for t in TIERS},
        "eviction": {"promote": False},
    }
    if tier == "nvme":
        data["tiers"]["nvme"]["segment_size"] = capacity
    config = Config.load(data)
    for key, value in overrides:
        config.set(key, value, origin="--set")
    return config


def bench_tier(tier: str, pool_capacity: int, plan: list[tuple[int, int]], args: argparse.Namespace,
               data_dir: Path, reference: Reference, progress: Progress) -> tuple[list[Row], dict[str, Any]]:
    """Measure one tier over every (size, objects) in ``plan``, each operation next to the reference's.

    Returns one get and one put row per size, and the tier's own stats.
    """
    config = tier_config(tier, pool_capacity, data_dir, f"bench-{os.getpid()}-{tier}", args.set)
    rows: list[Row] = []
    rounds = args.warmup + args.iters
    clock = time.perf_counter
    progress.show(f"{tier}: opening a {size_label(pool_capacity)} tier")
    with kvpool.Pool(config) as pool:
        for size, objects in plan:
            shape = kv_shape(size, args.layers)
            sources = make_sources(shape, objects, seed=size)
            out = np.empty(shape, dtype=DTYPE)
            out.fill(0)  # touch every page now: the get measures the copy, not first-touch page faults
            keys = [f"bench-{tier}-{size}-{i}".encode() for i in range(objects)]
            put, get, ref_get, ref_put = Timing(size), Timing(size), Timing(size), Timing(size)
            reference.prepare(size, objects)
            try:
                for r in range(rounds):
                    timed = r >= args.warmup
                    progress.show(f"{tier} {size_label(size)} x{objects}: round {r + 1}/{rounds}")
                    put_round, get_round, ref_put_round, ref_get_round = [], [], [], []
                    for i, (key, kv) in enumerate(zip(keys, sources)):
                        ref_put_round.append(reference.write(i))
                        t0 = clock()
                        pool.put(key, kv)
                        put_round.append(clock() - t0)
                    for i, key in enumerate(keys):
                        ref_get_round.append(reference.read(i))
                        t0 = clock()
                        got = pool.get(key, out=out)
                        get_round.append(clock() - t0)
                        if got is None:
                            raise RuntimeError(f"{tier}: {size_label(size)} object {i} missed right after its "
                                               f"put (pool stats: {pool.stats()['tiers'][tier]})")
                        if r == 0 and i == 0 and not np.array_equal(out.view(np.uint16), sources[0].view(np.uint16)):
                            raise RuntimeError(f"{tier}: {size_label(size)} get returned other bytes than put")
                    for key in keys:  # untimed: every put of the next round is a fresh insert
                        pool.delete(key)
                    if timed:
                        put.add_round(put_round)
                        get.add_round(get_round)
                        # NaN samples: the reference could not run (no O_DIRECT here)
                        ref_get.add_round([t for t in ref_get_round if not math.isnan(t)])
                        ref_put.add_round([t for t in ref_put_round if not math.isnan(t)])
                    progress.advance(f"{tier} {size_label(size)} round {r + 1}/{rounds} done")
            finally:
                reference.close()
            rows.append(Row(tier, "get", size, objects, get, reference.get_name, ref_get))
            rows.append(Row(tier, "put", size, objects, put, reference.put_name, ref_put))
            del sources
        stats = pool.stats()["tiers"][tier]
    return rows, stats


def describe_tier(tier: str, stats: dict[str, Any]) -> str:
    """One line of what the tier reported about itself (the facts a reader needs to trust a row)."""
    keys = {
        "hbm": ("emulated", "backing", "device"),
        "dram": ("backing", "locked_bytes", "lock_note"),
        "cxl": ("path", "model"),
        "nvme": ("direct_io", "path", "io_threads", "fsync"),
    }[tier]
    shown = {k: stats[k] for k in keys if k in stats}
    return f"{tier}: " + ", ".join(f"{k}={v}" for k, v in shown.items()) if shown else f"{tier}: (no details)"


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, iters=7, warmup=1)
    parser.add_argument("--tiers", default=",".join(TIERS),
                        help=f"comma-separated tiers to measure (default: {','.join(TIERS)})")
    parser.add_argument("--layers", type=int, default=32, help="layers per KV object (default: 32)")
    parser.add_argument("--working-set", default="256M", metavar="SIZE",
                        help="bytes of distinct objects per size, at least --min-objects (default: 256M)")
    parser.add_argument("--min-objects", type=int, default=4, help="objects per size at least (default: 4)")
    parser.add_argument("--max-objects", type=int, default=64, help="objects per size at most (default: 64)")
    parser.add_argument("--data-dir", default=None,
                        help="directory for the nvme tier and the raw O_DIRECT file; must not be tmpfs "
                             "(default: a fresh directory under /var/tmp, removed afterwards)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one timed round, no warmup, 8M working set (numbers are rough)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config setting for every tier's pool, e.g. tiers.nvme.io_chunk=16MiB (repeatable)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write every row as JSON")
    args = parser.parse_args(argv)
    args.tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = [t for t in args.tiers if t not in TIERS]
    if unknown or not args.tiers:
        parser.error(f"--tiers: unknown {unknown or 'empty list'}; choose from {','.join(TIERS)}")
    try:
        args.working_set = parse_size(args.working_set)
        for size in args.sizes:
            kv_shape(size, args.layers)
    except ValueError as exc:
        parser.error(str(exc))
    if any("=" not in item for item in args.set):
        parser.error("--set takes KEY=VALUE, e.g. tiers.nvme.io_chunk=16MiB")
    args.set = [tuple(item.split("=", 1)) for item in args.set]
    try:
        for key, value in args.set:
            Config().set(key, value, origin="--set")
    except ConfigError as exc:  # names the unknown key or the bad value
        parser.error(str(exc))
    if args.quick:
        args.iters, args.warmup, args.working_set, args.min_objects = 1, 0, 8 * MiB, 2
    if args.min_objects < 1 or args.max_objects < args.min_objects:
        parser.error("need 1 <= --min-objects <= --max-objects")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = [(s, objects_for(s, args.working_set, args.min_objects, args.max_objects)) for s in args.sizes]
    largest = max(s for s, _ in plan)
    # Room for the largest working set with every object's header and alignment, plus one spare object.
    header = ObjectSpec("float16", args.layers, 1, 1, HEAD_DIM).header_nbytes  # depends on layers only
    pool_capacity = max(n * (s + header + DIRECT_ALIGN) for s, n in plan) + largest + 2 * MiB
    pool_capacity = -(-pool_capacity // MiB) * MiB

    base = Path(args.data_dir or "/var/tmp").expanduser()
    base.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="kvpool-tier-bench-", dir=base))
    notes: list[str] = []
    skipped: dict[str, str] = {}
    rows: list[Row] = []
    fstype = filesystem_type(data_dir)
    if "nvme" in args.tiers and fstype in ("tmpfs", "ramfs"):
        skipped["nvme"] = (f"data dir {data_dir} is on {fstype}: an nvme benchmark there measures RAM; "
                           "pass --data-dir on a disk filesystem")

    rounds = args.warmup + args.iters
    tiers = [t for t in args.tiers if t not in skipped]
    progress = Progress(len(plan) * len(tiers) * rounds)
    direct = DirectIOReference(data_dir)
    tier_lines: list[str] = []
    wall_start = time.perf_counter()
    try:
        for tier in tiers:
            reference = direct if tier == "nvme" else MemcpyReference()
            try:
                tier_rows, stats = bench_tier(tier, pool_capacity, plan, args, data_dir, reference, progress)
            except (ImportError, NotImplementedError) as exc:
                skipped[tier] = f"cannot open: {type(exc).__name__}: {exc}"
                progress.advance(f"{tier} skipped", len(plan) * rounds)
                continue
            rows.extend(tier_rows)
            tier_lines.append(describe_tier(tier, stats))
            if tier == "nvme" and stats.get("direct_io") is not True:
                notes.append(f"nvme tier reports direct_io={stats.get('direct_io')!r}: its reads may come from "
                             "the page cache, so its get numbers can exceed the disk")
    finally:
        progress.done()
        shutil.rmtree(data_dir, ignore_errors=True)  # the fresh subdirectory made above, never --data-dir

    if direct.unavailable:
        notes.append(f"nvme reference: {direct.unavailable}; ratios for nvme are n/a")
    print_report(args, rows, plan, tier_lines, notes, skipped, fstype, data_dir,
                 time.perf_counter() - wall_start)
    if args.json:
        write_json(args.json, rows)
    if args.plot and rows:
        draw_plot(args.plot, rows)
    return 1 if skipped else 0


def print_report(args: argparse.Namespace, rows: list[Row], plan: list[tuple[int, int]], tier_lines: list[str],
                 notes: list[str], skipped: dict[str, str], fstype: str, data_dir: Path, wall_s: float) -> None:
    print(f"kvpool tier benchmark: {args.layers}-layer float16 KV objects, head_dim {HEAD_DIM}; "
          f"{args.iters} timed round(s) after {args.warmup} warmup; each round puts every object of the "
          f"working set, then gets each into one preallocated out= array")
    print("working set per size: " + ", ".join(f"{size_label(s)} x{n}" for s, n in plan))
    # Other processes move both tier and reference numbers; the load says how busy the machine was.
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end of the run, "
          f"transparent huge pages: {transparent_hugepages()}")
    print(f"references (same run, single thread, each tier operation right after the same one on the "
          f"reference): "
          f"memcpy = np.copyto between pre-faulted numpy buffers, which numpy backs with huge pages where "
          f"THP allows (get: ws->1 buffer, put: ws->ws); "
          f"nvme = raw O_DIRECT preadv/pwritev, one syscall per object, on a preallocated file in "
          f"{data_dir.parent} ({fstype})")
    if any(r.tier == "nvme" for r in rows):
        print("nvme reads bypass the page cache (no inflated gets) only where the tier reports direct_io=True:")
    if args.set:
        print("config overrides: " + ", ".join(f"{k}={v}" for k, v in args.set))
    for line in tier_lines:
        print("  " + line)
    headers = ["tier", "op", "size", "n", "GB/s", "p50 ms", "p99 ms", "reference", "ref GB/s", "ratio"]
    table = [[r.tier, r.op, size_label(r.size), r.timing.count, r.timing.gbps, r.timing.p(50) * 1e3,
              r.timing.p(99) * 1e3, r.reference, r.ref_timing.gbps, r.ratio]
             for r in rows]
    print()
    print(format_table(headers, table, align="lllrrrrlrr") if table else "(no tier measured)")
    print()
    print("GB/s: median over rounds of bytes / round time; p50/p99: per operation over all rounds")
    print("targets (reported, not asserted): ratio = tier GB/s / reference GB/s, worst size >= 1M")
    for tier, op, min_size, want, ref in TARGETS:
        matching = [r for r in rows if r.tier == tier and r.op == op and r.size >= min_size]
        ratios = [(r.ratio, r.size) for r in matching if r.ratio == r.ratio]
        if not ratios:
            print(f"  {tier} {op} >= {want}x {ref}: not measured")
            continue
        worst, at = min(ratios)
        verdict = "met" if worst >= want else "MISSED"
        listed = ", ".join(f"{size_label(s)} {x:.2f}" for x, s in sorted(ratios, key=lambda t: t[1]))
        print(f"  {tier} {op} >= {want}x {ref}: {verdict} (worst {worst:.2f} at {size_label(at)}; {listed})")
    for note in notes:
        print("note: " + note)
    for tier, why in skipped.items():
        print(f"skipped {tier}: {why}")
    print(f"wall time {wall_s:.1f} s")


def write_json(path: str, rows: list[Row]) -> None:
    records = [{"tier": r.tier, "op": r.op, "size": r.size, "objects": r.objects, "samples": r.timing.count,
                "gbps": r.timing.gbps, "p50_s": r.timing.p(50), "p99_s": r.timing.p(99),
                "reference": r.reference, "ref_gbps": r.ref_timing.gbps, "ratio": r.ratio} for r in rows]
    Path(path).write_text(json.dumps(records, indent=1))


def draw_plot(path: str, rows: list[Row]) -> None:
    """GB/s against size: memory tiers in one panel, nvme in another (their scales differ ~10x)."""
    def panel(tier: str) -> str:
        return "nvme tier vs raw O_DIRECT" if tier == "nvme" else "memory tiers vs memcpy"

    series: list[dict[str, Any]] = []
    for tier in dict.fromkeys(r.tier for r in rows):
        for op, marker in (("get", "o"), ("put", "s")):
            mine = [r for r in rows if r.tier == tier and r.op == op]
            series.append({"label": f"{tier} {op}", "group": tier, "marker": marker, "panel": panel(tier),
                           "sizes": [r.size for r in mine], "values": [r.timing.gbps for r in mine]})
    # One dashed line per reference and panel (each memory tier measured its own; show the first).
    references: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        if r.ref_timing.count:
            references.setdefault((panel(r.tier), r.reference), {}).setdefault(r.size, r.ref_timing.gbps)
    for (where, ref), by_size in references.items():
        series.append({"label": f"{ref} (reference)", "group": ref.split()[0], "dashed": True, "panel": where,
                       "marker": "o" if ("read" in ref or "ws->1" in ref) else "s",
                       "sizes": list(by_size), "values": list(by_size.values())})
    if plot_series(path, series, title="kvpool tiers: put and get(out=) throughput against object size "
                                        "(dashed: physical reference measured in the same run)"):
        print(f"plot written to {path}")


if __name__ == "__main__":
    sys.exit(main())
