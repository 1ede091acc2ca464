"""What a soak worker reports and how the soaks read it: the command that starts a worker
(``python -m bench.soak worker ...``), the ``RESULT {json}`` line it prints last, the latency
histogram in it (:class:`Latencies`), and the per-process table with a total row.

Shared by the soak (:mod:`bench.soak`, which is also the worker) and the fault soak
(:mod:`bench.soak_faults`): both import this module, and the fault soak never imports the soak.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import format_table

RESULT_PREFIX = "RESULT "
HIST_BASE = 1.02  # latency histogram bucket ratio


# -- latency histogram ------------------------------------------------------------------------


class Latencies:
    """Count and a log histogram (2% buckets) of seconds; exact max; mergeable through JSON."""

    def __init__(self) -> None:
        self.buckets: Counter[int] = Counter()
        self.max_s = 0.0
        self.count = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.max_s = max(self.max_s, seconds)
        self.buckets[max(0, int(math.log(max(seconds, 1e-7) / 1e-7, HIST_BASE)))] += 1

    def percentile(self, pct: float) -> float:
        """Upper edge of the bucket holding the ``pct``-th percentile (NaN if empty)."""
        if not self.count:
            return math.nan
        rank = math.ceil(self.count * pct / 100.0)
        seen = 0
        for bucket in sorted(self.buckets):
            seen += self.buckets[bucket]
            if seen >= rank:
                return min(1e-7 * HIST_BASE ** (bucket + 1), self.max_s)
        return self.max_s

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "max_s": self.max_s, "buckets": {str(k): v for k, v in self.buckets.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Latencies:
        lat = cls()
        lat.count, lat.max_s = data["count"], data["max_s"]
        lat.buckets.update({int(k): v for k, v in data["buckets"].items()})
        return lat

    def merge(self, other: Latencies) -> None:
        self.count += other.count
        self.max_s = max(self.max_s, other.max_s)
        self.buckets.update(other.buckets)


# -- the worker's command line and its result line ---------------------------------------------


def worker_command(python: str, master: str, name: str, data_dir: Path, **options: Any) -> list[str]:
    """``python -m bench.soak worker ...`` with ``options`` as flags (``seed_share=(0, 8)`` -> ``--seed-share 0/8``)."""
    command = [python, "-m", "bench.soak", "worker", "--master", master, "--name", name, "--data-dir", str(data_dir)]
    for option, value in options.items():
        if value is None or value is False:
            continue
        flag = f"--{option.replace('_', '-')}"
        if value is True:
            command.append(flag)
            continue
        if isinstance(value, tuple):
            value = "/".join(map(str, value))
        command += [flag, str(value)]
    return command


def parse_result(output: str) -> dict[str, Any] | None:
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


# -- report -----------------------------------------------------------------------------------------


def table(results: Sequence[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The per-process table with a total row, and the totals."""
    total: Counter[str] = Counter()
    latency = Latencies()
    rows = []
    for r in results:
        lat = Latencies.from_json(r["get_latency"])
        latency.merge(lat)
        errors = sum(r["errors"].values())
        remote = r.get("remote", {})
        for k in ("ops", "puts", "gets", "hits", "misses", "wrong", "deletes"):
            total[k] += r[k]
        total["errors"] += errors
        total["same_host"] += remote.get("hits_same_host", 0)
        total["located"] += remote.get("hits_remote", 0)
        rows.append([r["name"], r["ops"], r["puts"], r["gets"], r["hits"], r["misses"], r["wrong"], errors,
                     remote.get("hits_same_host", 0), remote.get("hits_remote", 0),
                     lat.percentile(99) * 1e3, lat.max_s * 1e3])
    rows.append(["total", total["ops"], total["puts"], total["gets"], total["hits"], total["misses"], total["wrong"],
                 total["errors"], total["same_host"], total["located"], latency.percentile(99) * 1e3,
                 latency.max_s * 1e3])
    headers = ["process", "ops", "puts", "gets", "hits", "misses", "wrong", "errors", "same-host", "located",
               "get p99 ms", "get max ms"]
    return format_table(headers, rows), {**total, "get_p99_s": latency.percentile(99), "get_max_s": latency.max_s}
