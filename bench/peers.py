"""Peers benchmark: kvpool side by side with Mooncake Store, Redis and LMCache.

Every system runs the same workload against its own servers on 127.0.0.1,
client and servers in separate processes:

1. random values of each size (default 64K, 1M, 16M; KV arrays
   ``[layers, 2, tokens, 8, 128]`` float16 of exactly that many bytes):
   put ``--total`` bytes of them (``--total-small`` below 1 MiB), one key per
   call, then get them all back (into a preallocated buffer where the library
   can write into caller memory); then the same batched (``--batch`` keys per
   call, ``--batch-large`` from 16 MiB up) under a second key set;
2. content checked on a sample of both key sets, outside the timed loops;
3. ``exists`` on ``--exists-keys`` keys (half stored, half never stored),
   one per call and ``--exists-batch`` per call, every answer checked
   (measured with the smallest size);
4. RSS (``/proc/<pid>/status`` VmRSS) of every server process after the puts;
5. side by side (``--side-by-side``, on by default), at every size: every
   system up at once holding ``--side-total`` bytes, taking turns: each of
   ``--side-rounds`` rounds gives each system (in an order rotated every
   round) ``--side-turn`` bytes of one-key gets, as many again batched, and at
   the smallest size ``--side-exists`` one-key exists. kvpool's ratio to each
   peer (the issue's targets) is taken round by round, median and range: a
   slow minute of the host lands on every system alike, which runs minutes
   apart cannot promise.

Systems (``--systems``; a peer that is not installed is a "skipped" row):

* ``kvpool-tcp``: master process + a *writer* process that puts and keeps
  serving; the benchmark client (reader) pulls over UCX forced to TCP.
  kvpool's put is pull-on-demand: the timed put is the writer's local tier
  copy + master publish (said under the tables).
* ``kvpool-shm`` / ``kvpool-cxl``: the same on one host with
  ``transport="auto"`` (UCX shared memory), the writer storing in ``dram`` /
  in ``cxl`` (the reader copies in place out of the writer's arena).
* ``mooncake-tcp``: ``mooncake_master`` + a storage process contributing a
  segment; the benchmark client (no segment) uses zero-copy
  ``put_from``/``get_into`` (``batch_*`` for batches) over Mooncake's TCP
  transfer engine.
* ``mooncake-standalone``: ``mooncake_master`` + the ``mooncake_client``
  service holding the segment; the benchmark is a ``setup_dummy`` client
  whose buffers live in the shared memory it maps with the service.
* ``redis``: ``redis-server`` (no persistence); SET/GET, MSET/MGET,
  EXISTS (pipelined for batches).
* ``lmcache``: ``lmcache_server HOST PORT cpu`` and LMCache's own
  Python client, both from LMCache's venv (see bench/install_peers.sh).

A memcpy row (one thread, same values, same order) is the physical
reference, measured in the same run. Ratios kvpool/peer and the project's
targets are printed after the tables (reported, never asserted).
``bash bench/install_peers.sh`` installs the peers; nothing here installs.

    .venv/bin/python bench/peers.py                          # everything installed, ~1 GB per size
    .venv/bin/python bench/peers.py --quick --systems kvpool-tcp,redis
    .venv/bin/python bench/peers.py --plot peers.png --json peers.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``kvpool`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Progress, Timing, add_common_args, format_table, parse_size, plot_series, size_label
from bench.peer_backends import OPT_IN, SYSTEMS, peer_class
from bench.peer_backends.base import (
    ActorProcess,
    CpuPlan,
    Peer,
    PeerError,
    Plan,
    ValueSource,
    rss_bytes,
)

MiB = 1 << 20
DEFAULT_SIZES = "64K,1M,16M"
DEFAULT_LMCACHE_PYTHON = str(Path.home() / ".cache/kvpool-peers/lmcache-venv/bin/python")


@dataclass
class Result:
    """One system at one size."""

    system: str
    label: str
    size: int
    put: Timing | None = None
    get: Timing | None = None
    bput: Timing | None = None
    bget: Timing | None = None
    exists_rate: float | None = None
    bexists_rate: float | None = None
    rss: dict[str, int] = field(default_factory=dict)
    verified: str = ""
    note: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False

    @property
    def rss_total(self) -> int | None:
        return sum(self.rss.values()) if self.rss else None


# -- plan -----------------------------------------------------------------------------


def batch_for(size: int, args: argparse.Namespace) -> int:
    """Keys per batched call for values of ``size``."""
    return args.batch_large if size >= args.large_from else args.batch


def objects_for(size: int, args: argparse.Namespace) -> tuple[int, int]:
    """(values per key set, keys per batched call) for ``size``."""
    batch = batch_for(size, args)
    total = args.total_small if size < MiB else args.total
    count = max(math.ceil(total / size), batch)
    return math.ceil(count / batch) * batch, batch


def holder_capacity(size: int, count: int, batch: int) -> int:
    """Room for both key sets + warm-up keys with slack, so no system evicts mid-run
    (Mooncake's master starts evicting at 90 % of a segment)."""
    need = (2 * count + 2 * batch) * size
    return int(need / 0.8) + 64 * MiB


# -- running one system ------------------------------------------------------------------


class Running:
    """One system at one size: its servers and actor processes, from :meth:`start` to :meth:`stop`."""

    def __init__(self, system: str, size: int, args: argparse.Namespace, cpus: CpuPlan, work_dir: Path, *,
                 count: int | None = None, batch: int | None = None) -> None:
        self.system, self.size, self.args, self.cpus = system, size, args, cpus
        default_count, default_batch = objects_for(size, args)
        self.count, self.batch = count or default_count, batch or default_batch
        self.work_dir = work_dir
        work_dir.mkdir(parents=True)
        plan = Plan(size, self.count, self.batch, args.seed, holder_capacity(size, self.count, self.batch), work_dir)
        self.peer: Peer = peer_class(system)(plan, cpus, vars(args))
        self.actors: dict[str, ActorProcess] = {}
        self.server_actors: list[str] = []

    def start(self) -> None:
        self.peer.start()
        for role, (spec, on_server) in self.peer.actors().items():
            self.actors[role] = ActorProcess(spec, self.cpus.server if on_server else self.cpus.client,
                                             self.work_dir / f"actor-{role}.log", self.args.actor_timeout)
            if on_server:
                self.server_actors.append(role)
        for actor in self.actors.values():
            actor.call({"op": "setup", "size": self.size, "count": self.count, "batch": self.batch,
                        "seed": self.args.seed})

    @property
    def putter(self) -> ActorProcess:
        return self.actors[self.peer.put_role]

    @property
    def getter(self) -> ActorProcess:
        return self.actors[self.peer.get_role]

    def timed(self, actor: ActorProcess, op: str, kind: str, per_call: int, rounds: int,
              **window: int) -> list[list[float]]:
        """``op`` over key set ``kind`` (``window``: ``first``/``calls``, a slice of it): per-call
        seconds, in ``rounds`` groups; PeerError if a get missed a key that was put."""
        reply = actor.call({"op": op, "set": kind, "batch": per_call, "rounds": rounds, **window})
        if reply.get("misses"):
            raise PeerError(f"{op}: {reply['misses']} keys missed (they were put)")
        return list(reply["rounds"])

    def stop(self) -> None:
        for role in sorted(self.actors, key=lambda r: r in self.server_actors):  # clients first, holders last
            self.actors[role].stop()
        self.peer.stop()


def run_one(system: str, size: int, args: argparse.Namespace, cpus: CpuPlan, work_root: Path,
            with_exists: bool, progress: Progress) -> Result:
    run = Running(system, size, args, cpus, work_root / f"{system}-{size_label(size)}")
    result = Result(system, run.peer.label, size)
    batch = run.batch
    tag = f"{system} {size_label(size)}"
    try:
        progress.show(f"{tag}: starting servers")
        run.start()
        putter, getter = run.putter, run.getter

        def timed(actor: ActorProcess, op: str, kind: str, per_call: int) -> Timing:
            progress.show(f"{tag}: {op} x{per_call}")
            timing = Timing(size * per_call)
            for samples in run.timed(actor, op, kind, per_call, args.iters):
                timing.add_round(samples)
            return timing

        result.put = timed(putter, "put", "s", 1)
        result.get = timed(getter, "get", "s", 1)
        sets = ["s"]
        if run.peer.has_batch:
            result.bget = timed(getter, "get", "s", batch)
            result.bput = timed(putter, "put", "b", batch)
            sets.append("b")
        else:
            result.note = "no batch API;"
        pids = dict(run.peer.server_pids())
        for role in run.server_actors:
            pids[f"{system} {role}"] = run.actors[role].pid
        result.rss = {name: rss for name, pid in pids.items() if (rss := rss_bytes(pid)) is not None}
        check = getter.call({"op": "verify", "sets": sets, "sample": args.verify_sample})
        result.verified = f"{check['checked'] - check['bad'] - check['missing']}/{check['checked']} exact"
        if check["bad"] or check["missing"]:
            result.note += f" WRONG DATA: {check['bad']} differ, {check['missing']} missing"
        if with_exists:
            for per_call in (1, args.exists_batch) if run.peer.has_batch else (1,):
                progress.show(f"{tag}: exists x{per_call}")
                reply = getter.call({"op": "exists", "sets": sets, "total": args.exists_keys,
                                     "batch": per_call})
                if reply["wrong"]:
                    result.note += f" exists answered {reply['wrong']} keys wrong;"
                rate = reply["keys"] / reply["seconds"]
                if per_call == 1:
                    result.exists_rate = rate
                else:
                    result.bexists_rate = rate
        result.info = getter.call({"op": "info"})["info"]
    except PeerError as exc:
        result.note += f" failed: {_first_line(str(exc))} (logs: {run.work_dir})"
        print(f"\n{tag} failed:\n{exc}", file=sys.stderr)
    finally:
        run.stop()
    return result


# -- side by side -------------------------------------------------------------------------------


@dataclass
class SideBySide:
    """One system at one size in the side-by-side rounds: what each of its turns measured."""

    system: str
    label: str
    size: int
    get_p50_s: list[float] = field(default_factory=list)  # one-key gets: p50 per turn
    get_gbps: list[float] = field(default_factory=list)   # one-key gets: bytes / summed call time, per turn
    bget_gbps: list[float] = field(default_factory=list)  # batched gets, the same
    exists_per_s: list[float] = field(default_factory=list)  # one-key exists (the smallest size only)
    exists_wrong: int = 0
    note: str = ""


def side_plan(size: int, args: argparse.Namespace) -> tuple[int, int, int]:
    """(values in the key set, keys per batched call, keys per turn) at ``size`` for the
    side-by-side rounds: ``--side-total`` bytes per system, ``--side-turn`` bytes per turn."""
    batch = batch_for(size, args)
    per_turn = max(math.ceil(args.side_turn / size / batch) * batch, 2 * batch)
    count = max(math.ceil(args.side_total / size / per_turn) * per_turn, per_turn)
    return count, batch, per_turn


def side_by_side(systems: Sequence[str], size: int, args: argparse.Namespace, cpus: CpuPlan, work_root: Path,
                 with_exists: bool, progress: Progress) -> list[SideBySide]:
    """Every system up at once, taking turns: in each of ``--side-rounds`` rounds each system
    (in an order rotated every round) gets a turn's keys one per call, then the next turn's
    keys batched, then (``with_exists``) asks ``--side-exists`` one-key exists. A slow phase of
    the host then lands on every system alike, which runs minutes apart cannot promise; each
    turn is compared with the same round's turns of the others."""
    count, batch, per_turn = side_plan(size, args)
    runs: dict[str, Running] = {}
    out = {s: SideBySide(s, peer_class(s).label, size) for s in systems}
    tag = f"side by side {size_label(size)}"
    try:
        for system in systems:
            progress.show(f"{tag}: starting {system}")
            run = runs[system] = Running(system, size, args, cpus, work_root / f"side-{system}-{size_label(size)}",
                                         count=count, batch=batch)
            try:
                run.start()
                run.timed(run.putter, "put", "s", 1, 1)
            except PeerError as exc:
                out[system].note = f"failed: {_first_line(str(exc))} (logs: {run.work_dir})"
                print(f"\n{tag}, {system} failed:\n{exc}", file=sys.stderr)
                run.stop()
                del runs[system]
        order = list(runs)
        for r in range(args.side_rounds):
            progress.show(f"{tag}: round {r + 1}/{args.side_rounds}")
            for system in order[r % len(order):] + order[:r % len(order)] if order else []:
                run, row = runs[system], out[system]
                try:
                    first = (2 * r * per_turn) % count  # each turn its own keys, as far as the set goes
                    [samples] = run.timed(run.getter, "get", "s", 1, 1, first=first, calls=per_turn)
                    row.get_p50_s.append(float(np.median(samples)))
                    row.get_gbps.append(size * len(samples) / sum(samples) / 1e9)
                    if run.peer.has_batch:
                        first = ((2 * r + 1) * per_turn) % count // batch
                        [samples] = run.timed(run.getter, "get", "s", batch, 1, first=first,
                                              calls=per_turn // batch)
                        row.bget_gbps.append(size * batch * len(samples) / sum(samples) / 1e9)
                    if with_exists:
                        reply = run.getter.call({"op": "exists", "sets": ["s"], "total": args.side_exists,
                                                 "batch": 1})
                        row.exists_wrong += reply["wrong"]
                        row.exists_per_s.append(reply["keys"] / reply["seconds"])
                except PeerError as exc:
                    row.note += f" failed: {_first_line(str(exc))} (logs: {run.work_dir})"
                    order.remove(system)
    finally:
        for run in runs.values():
            run.stop()
    for row in out.values():
        if row.exists_wrong:
            row.note += f" exists answered {row.exists_wrong} keys wrong;"
    return list(out.values())


SIDE_HEADERS = ("system / mode", "get p50 us", "round p50s us", "get GB/s", "bget GB/s", "exists/s", "rounds",
                "note")


def side_rows(rows: Sequence[SideBySide]) -> list[list[Any]]:
    def med(values: Sequence[float], scale: float = 1.0) -> float | None:
        return float(np.median(values)) * scale if values else None

    return [[r.label, med(r.get_p50_s, 1e6),
             f"{min(r.get_p50_s) * 1e6:.0f}-{max(r.get_p50_s) * 1e6:.0f}" if r.get_p50_s else None,
             med(r.get_gbps), med(r.bget_gbps), _kilo(med(r.exists_per_s)), len(r.get_p50_s), r.note.strip()]
            for r in rows]


def side_comparisons(rows: Sequence[SideBySide], sizes: Sequence[int]) -> list[str]:
    """The issue's targets, each taken round by round: the median of the rounds' ratios and
    their range (kvpool / peer; for a p50, lower is better)."""
    def series(system: str, size: int, what: str) -> list[float]:
        row = next((r for r in rows if r.system == system and r.size == size), None)
        return list(getattr(row, what)) if row else []

    lines: list[str] = []

    def ratio(what: str, ours: list[float], theirs: list[float], target: str = "",
              met: Callable[[float], bool] | None = None) -> None:
        pairs = [o / t for o, t in zip(ours, theirs) if t]
        if not pairs:
            lines.append(f"  {what:<68} n/a (not measured)")
            return
        mid = float(np.median(pairs))
        verdict = f"  target {target}: {'MET' if met(mid) else 'MISSED'}" if met is not None else ""
        lines.append(f"  {what:<68} {mid:5.2f}x ({min(pairs):.2f}-{max(pairs):.2f}){verdict}")

    small, big = min(sizes), [s for s in sizes if s >= MiB]
    label = size_label(small)
    ratio(f"one-key get p50 {label}: kvpool-tcp / redis", series("kvpool-tcp", small, "get_p50_s"),
          series("redis", small, "get_p50_s"), "<= 1x", lambda x: x <= 1.0)
    ratio(f"one-key get p50 {label}: kvpool-tcp / mooncake-tcp", series("kvpool-tcp", small, "get_p50_s"),
          series("mooncake-tcp", small, "get_p50_s"))
    ratio("one-key exists/s: kvpool-tcp / mooncake-tcp", series("kvpool-tcp", small, "exists_per_s"),
          series("mooncake-tcp", small, "exists_per_s"), ">= 1x", lambda x: x >= 1.0)
    if series("kvpool-tcp-block", small, "get_p50_s"):  # what polling does (only when asked for)
        ratio(f"one-key get p50 {label}: kvpool-tcp-block / redis", series("kvpool-tcp-block", small, "get_p50_s"),
              series("redis", small, "get_p50_s"))
        ratio(f"one-key get p50 {label}: kvpool-tcp / kvpool-tcp-block", series("kvpool-tcp", small, "get_p50_s"),
              series("kvpool-tcp-block", small, "get_p50_s"))
        ratio("one-key exists/s: kvpool-tcp / kvpool-tcp-block", series("kvpool-tcp", small, "exists_per_s"),
              series("kvpool-tcp-block", small, "exists_per_s"))
    for size in big:  # the targets: 1 MB against Redis; 16 MB against Mooncake (TCP; standalone batched)
        label = size_label(size)
        at_1m, at_16m = size == MiB, size >= 16 * MiB
        ratio(f"one-key get {label}: kvpool-tcp / redis", series("kvpool-tcp", size, "get_gbps"),
              series("redis", size, "get_gbps"), ">= 1x", (lambda x: x >= 1.0) if at_1m else None)
        ratio(f"one-key get {label}: kvpool-tcp / mooncake-tcp", series("kvpool-tcp", size, "get_gbps"),
              series("mooncake-tcp", size, "get_gbps"), ">= 2x", (lambda x: x >= 2.0) if at_16m else None)
        shm, cxl = series("kvpool-shm", size, "get_gbps"), series("kvpool-cxl", size, "get_gbps")
        best = [max(pair) for pair in zip(shm, cxl)] if shm and cxl else shm or cxl
        ratio(f"same host, one-key get {label}: kvpool / mooncake-standalone batched", best,
              series("mooncake-standalone", size, "bget_gbps"), ">= 1x", (lambda x: x >= 1.0) if at_16m else None)
    return lines


def _kilo(rate: float | None) -> str | None:
    return None if rate is None else f"{rate / 1000:.1f}k"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else "?"


def memcpy_reference(size: int, args: argparse.Namespace) -> Result:
    """One-thread ``np.copyto`` of the same values in the same order: get = value -> one reused
    buffer; put = value -> a prefaulted destination working set (like a store's arena)."""
    count, _ = objects_for(size, args)
    source = ValueSource(size, count, args.seed)
    out = np.empty(size, np.uint8)
    arena = np.ones(min(count * size, 256 * MiB) + size, np.uint8)  # ones: really faulted in
    slots = max(1, (len(arena) - size) // size)
    result = Result("memcpy", "memcpy (1 thread, same values)", size)
    for op in ("put", "get"):
        timing = Timing(size)
        per_round = max(1, -(-count // args.iters))
        np.copyto(out, source.value(0))
        for start in range(0, count, per_round):
            samples = []
            for i in range(start, min(start + per_round, count)):
                value = source.value(i)
                dest = out if op == "get" else arena[(i % slots) * size: (i % slots + 1) * size]
                t0 = time.perf_counter()
                np.copyto(dest, value)
                samples.append(time.perf_counter() - t0)
            timing.add_round(samples)
        setattr(result, op, timing)
    return result


# -- output --------------------------------------------------------------------------------

HEADERS = ("system / mode", "put GB/s", "get GB/s", "bput GB/s", "bget GB/s", "put p50 us", "put p99 us",
           "get p50 us", "get p99 us", "exists/s", "bexists/s", "server RSS MiB", "check / note")


def table_rows(results: Sequence[Result]) -> list[list[Any]]:
    rows = []
    for r in results:
        if r.skipped:
            rows.append([r.label] + [None] * (len(HEADERS) - 2) + [r.note])
            continue

        def rate(t: Timing | None) -> float | None:
            return t.gbps if t and t.count else None

        def us(t: Timing | None, pct: float) -> float | None:
            return t.p(pct) * 1e6 if t and t.count else None

        rss = r.rss_total
        rows.append([
            r.label, rate(r.put), rate(r.get), rate(r.bput), rate(r.bget), us(r.put, 50), us(r.put, 99),
            us(r.get, 50), us(r.get, 99), _kilo(r.exists_rate), _kilo(r.bexists_rate),
            None if rss is None else rss / MiB, " ".join(filter(None, [r.verified, r.note.strip()])),
        ])
    return rows


def _get(results: Sequence[Result], system: str, size: int) -> Result | None:
    return next((r for r in results if r.system == system and r.size == size and not r.skipped
                 and r.get is not None), None)


@dataclass
class Comparison:
    what: str
    ours: float | None
    theirs: float | None
    target: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.theirs is None or not self.theirs:
            return None
        return self.ours / self.theirs

    def line(self) -> str:
        if self.ratio is None:
            return f"  {self.what:<62} n/a (not measured)"
        verdict = ""
        if self.target is not None:
            verdict = f"  target >= {self.target:g}x: {'MET' if self.ratio >= self.target else 'MISSED'}"
        return f"  {self.what:<62} {self.ours:8.3f} / {self.theirs:8.3f} = {self.ratio:5.2f}x{verdict}"


def comparisons(results: Sequence[Result], sizes: Sequence[int]) -> list[Comparison]:
    def gbps(system: str, size: int, op: str) -> float | None:
        r = _get(results, system, size)
        t = getattr(r, op) if r else None
        return t.gbps if t and t.count else None

    out: list[Comparison] = []
    big = [s for s in sizes if s >= MiB]
    for size in big:
        for peer, target in (("mooncake-tcp", 1.5), ("redis", 2.0)):
            for op, name in (("get", "get"), ("bget", "batched get")):
                out.append(Comparison(f"TCP {name} {size_label(size)}: kvpool-tcp / {peer}",
                                      gbps("kvpool-tcp", size, op), gbps(peer, size, op), target))
    for size in sizes:
        fastest = max(((gbps(s, size, "get") or 0.0, s) for s in ("kvpool-shm", "kvpool-cxl")), default=(0.0, ""))
        out.append(Comparison(f"same-host get {size_label(size)}: {fastest[1] or 'kvpool'} / mooncake-standalone",
                              fastest[0] or None, gbps("mooncake-standalone", size, "get"), 2.0))
    first = min(sizes)
    ours = _get(results, "kvpool-tcp", first)
    theirs = _get(results, "mooncake-tcp", first)
    out.append(Comparison("batched exists (keys/s, k): kvpool-tcp / mooncake-tcp",
                          ours.bexists_rate / 1e3 if ours and ours.bexists_rate else None,
                          theirs.bexists_rate / 1e3 if theirs and theirs.bexists_rate else None, 1.0))
    return out


def plot(path: str, results: Sequence[Result]) -> None:
    """GB/s against value size, one line per system/mode and panel; memcpy dashed in every panel."""
    series = []
    systems = list(dict.fromkeys(r.system for r in results if not r.skipped))
    for op, panel in (("get", "get, 1 key per call"), ("bget", "get, batched"), ("put", "put, 1 key per call")):
        for system in systems:
            # memcpy has no batched variant: its one-value copy is the reference for batches too
            field_name = "get" if system == "memcpy" and op == "bget" else op
            points = [(r.size, getattr(r, field_name).gbps) for r in results
                      if r.system == system and not r.skipped and getattr(r, field_name) is not None]
            if points:  # short labels: three panels share the figure's width
                series.append({"label": system, "sizes": [p[0] for p in points], "values": [p[1] for p in points],
                               "panel": panel, "group": system, "dashed": system == "memcpy"})
    plot_series(path, series, title="kvpool vs peers on 127.0.0.1 (GB/s, higher is better)")


# -- main -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, sizes=DEFAULT_SIZES, iters=5, warmup=1)
    parser.add_argument("--systems", default="all",
                        help=f"comma-separated, or 'all' (default): {', '.join(s for s in SYSTEMS if s not in OPT_IN)}"
                             f"; only when named: {', '.join(sorted(OPT_IN))}")
    parser.add_argument("--total", type=parse_size, default=parse_size("1G"), metavar="BYTES",
                        help="bytes put (and got) per key set for sizes >= 1 MiB (default 1G)")
    parser.add_argument("--total-small", type=parse_size, default=parse_size("256M"), metavar="BYTES",
                        help="the same for sizes below 1 MiB (default 256M)")
    parser.add_argument("--batch", type=int, default=64, help="keys per batched call (default 64)")
    parser.add_argument("--batch-large", type=int, default=4, help="keys per batched call from --large-from up (4)")
    parser.add_argument("--large-from", type=parse_size, default=parse_size("16M"), metavar="BYTES")
    parser.add_argument("--exists-keys", type=int, default=10_000, help="keys asked per exists run (10000)")
    parser.add_argument("--exists-batch", type=int, default=100, help="keys per batched exists call (100)")
    side = parser.add_argument_group("side by side (every system up at once, taking turns; after the tables)")
    side.add_argument("--side-by-side", action=argparse.BooleanOptionalAction, default=True,
                      help="run the side-by-side rounds at every size (default: yes)")
    side.add_argument("--side-rounds", type=int, default=12, help="rounds; each system takes one turn per round (12)")
    side.add_argument("--side-total", type=parse_size, default=parse_size("256M"), metavar="BYTES",
                      help="bytes each system holds per size (256M)")
    side.add_argument("--side-turn", type=parse_size, default=parse_size("16M"), metavar="BYTES",
                      help="bytes got one key per call in a turn, and as much again batched (16M; at least "
                           "two batches)")
    side.add_argument("--side-exists", type=int, default=500, help="one-key exists per turn, smallest size (500)")
    parser.add_argument("--verify-sample", type=int, default=16, help="keys per key set checked byte for byte")
    parser.add_argument("--pin", choices=("split", "none"), default="split",
                        help="split: benchmark client on the first half of the CPUs, servers on the rest "
                             "(default); none: let the scheduler place everything")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 16M per key set (4M below 1 MiB), 2000 exists keys, 2 rounds")
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    parser.add_argument("--work-dir", metavar="DIR", help="keep logs and data here (default: a temp dir, removed)")
    parser.add_argument("--actor-timeout", type=float, default=600.0, help="seconds one request may take")
    peers = parser.add_argument_group("where the peers are (a missing one is a 'skipped' row)")
    peers.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    peers.add_argument("--mooncake-master", default=_venv_tool("mooncake_master"))
    peers.add_argument("--mooncake-client", default=_venv_tool("mooncake_client"))
    peers.add_argument("--lmcache-python", default=os.environ.get("KVPOOL_LMCACHE_PYTHON", DEFAULT_LMCACHE_PYTHON),
                       help="python of LMCache's venv (bench/install_peers.sh lmcache)")
    return parser


def _venv_tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.total, args.total_small = min(args.total, 16 * MiB), min(args.total_small, 4 * MiB)
        args.exists_keys, args.iters, args.verify_sample = min(args.exists_keys, 2000), min(args.iters, 2), 4
        args.side_rounds, args.side_exists = min(args.side_rounds, 2), 100
        args.side_total, args.side_turn = min(args.side_total, 4 * MiB), min(args.side_turn, 2 * MiB)
    systems = ([s for s in SYSTEMS if s not in OPT_IN] if args.systems == "all"
               else [s.strip() for s in args.systems.split(",") if s.strip()])
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    cpus = CpuPlan.make(args.pin)
    if cpus.client is not None:
        os.sched_setaffinity(0, cpus.client)  # the memcpy reference runs where the benchmark client runs

    missing = {s: peer_class(s).missing(vars(args)) for s in systems}
    runnable = [s for s in systems if missing[s] is None]
    print(f"peers benchmark: {os.cpu_count()} CPUs; {cpus.describe()}", flush=True)
    print("sizes " + ", ".join(f"{size_label(s)} ({objects_for(s, args)[0]} values per key set, "
                                f"{objects_for(s, args)[1]} per batch)" for s in args.sizes)
          + f"; exists on {args.exists_keys} keys; {args.iters} rounds", flush=True)
    for s in systems:
        print(f"  {s:20s} {'skipped: ' + missing[s] if missing[s] else 'runs'}", flush=True)

    work_root = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvpool-peers-"))
    work_root.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    progress = Progress(len(args.sizes) * (len(runnable) + 1 + bool(args.side_by_side and runnable)))
    side: list[SideBySide] = []
    try:
        for size in args.sizes:
            results.append(memcpy_reference(size, args))
            progress.advance(f"memcpy {size_label(size)}")
            for system in runnable:
                with_exists = size == min(args.sizes)
                results.append(run_one(system, size, args, cpus, work_root, with_exists, progress))
                progress.advance(f"{system} {size_label(size)}")
        for size in args.sizes if args.side_by_side and runnable else []:
            side += side_by_side(runnable, size, args, cpus, work_root, size == min(args.sizes), progress)
            progress.advance(f"side by side {size_label(size)}")
        progress.done()
    finally:
        if not args.work_dir and not any("failed:" in r.note for r in [*results, *side]):
            shutil.rmtree(work_root, ignore_errors=True)

    for s in systems:
        if missing[s]:
            for size in args.sizes:
                results.append(Result(s, peer_class(s).label, size, note=f"skipped: {missing[s]}", skipped=True))

    for size in args.sizes:
        print(f"\n== {size_label(size)} values ({size} bytes; {objects_for(size, args)[0]} per key set, "
              f"batches of {objects_for(size, args)[1]}) ==")
        print(format_table(HEADERS, table_rows([r for r in results if r.size == size]), align="l" + "r" * 11 + "l"))
    print("\nput/get GB/s: median over rounds of bytes/time, one key per call; bput/bget: batched calls; "
          "p50/p99: per call, one key. exists/s: keys answered per second (half stored, half absent), "
          "measured with the smallest size. server RSS: VmRSS summed over the processes that hold or index "
          "the data, after all puts (arenas that are prefaulted count in full).")
    notes = {peer_class(s).put_note for s in runnable if peer_class(s).put_note}
    for note in sorted(notes):
        print(f"note: {note}")
    infos = [(r.system, size_label(r.size), r.info) for r in results if r.info]
    if infos:
        print("read paths taken (reader's counters): " + "; ".join(
            f"{s} {z}: " + ", ".join(f"{k}={v}" for k, v in i.items()) for s, z, i in infos))
    rss_parts = [(r.system, size_label(r.size), r.rss) for r in results if r.rss]
    if rss_parts:
        print("server RSS by process (MiB): " + "; ".join(
            f"{s} {z}: " + ", ".join(f"{name} {v / MiB:.0f}" for name, v in rss.items()) for s, z, rss in rss_parts))

    print("\nkvpool / peer (GB/s unless said; targets reported, not asserted):")
    for comparison in comparisons(results, args.sizes):
        print(comparison.line())

    if side:
        for size in args.sizes:
            count, batch, per_turn = side_plan(size, args)
            print(f"\n== side by side: {size_label(size)} values, {count} per system; {args.side_rounds} rounds, "
                  f"each system in turn ({per_turn} keys one per call, {per_turn} more in batches of {batch}"
                  + (f", {args.side_exists} exists" if size == min(args.sizes) else "")
                  + "), the order rotated each round ==")
            print(format_table(SIDE_HEADERS, side_rows([r for r in side if r.size == size]), align="lrrrrrrl"))
        print("\nget p50 us, GB/s, exists/s: the median of the rounds (round p50s: lowest-highest). Runs minutes "
              "apart meet different minutes of a host whose speed swings by tens of percent; here every system "
              "meets the same minutes.")
        print("\nkvpool / peer side by side, round by round (median of the rounds' ratios, lowest-highest; "
              "reported, not asserted):")
        for line in side_comparisons(side, args.sizes):
            print(line)

    if args.json:
        records = [_as_record(r) for r in results] + [
            {"system": r.system, "label": r.label, "size": r.size, "skipped": False, "mode": "side-by-side",
             "get_p50_us": [v * 1e6 for v in r.get_p50_s], "get_gbps": r.get_gbps, "bget_gbps": r.bget_gbps,
             "exists_per_s": r.exists_per_s, "note": r.note}
            for r in side]
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.plot:
        plot(args.plot, results)
    failed = [r for r in [*results, *side] if "failed:" in r.note or "WRONG" in r.note or "wrong" in r.note]
    return 1 if failed else 0


def _as_record(r: Result) -> dict[str, Any]:
    def timing(t: Timing | None) -> dict[str, float] | None:
        if t is None or not t.count:
            return None
        return {"gbps": t.gbps, "p50_us": t.p(50) * 1e6, "p99_us": t.p(99) * 1e6, "calls": t.count}

    return {"system": r.system, "label": r.label, "size": r.size, "skipped": r.skipped, "mode": "sequential",
            "note": r.note,
            "put": timing(r.put), "get": timing(r.get), "bput": timing(r.bput), "bget": timing(r.bget),
            "exists_per_s": r.exists_rate, "bexists_per_s": r.bexists_rate, "rss": r.rss,
            "verified": r.verified, "info": r.info}


if __name__ == "__main__":
    sys.exit(main())
