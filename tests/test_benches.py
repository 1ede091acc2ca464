"""Benchmarks run end to end (as a user runs them) and print what they promise.

These check that the scripts work and report every size with its reference
ratio, not how fast anything is: speed on a shared 2-core machine is no test.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICK_SIZES = ("64K", "256K", "1M", "4M", "16M", "64M")


def test_tier_bench_quick_runs(tmp_path: Path) -> None:
    plot = tmp_path / "tiers.png"
    rows_json = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "tier_bench.py"), "--quick", "--tiers", "dram",
         "--data-dir", str(tmp_path), "--plot", str(plot), "--json", str(rows_json)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("tier "))
    assert header.split()[-1] == "ratio" and "ref GB/s" in header

    # One get and one put row per size, each ending in a positive tier/reference ratio.
    table = [line.split() for line in lines if line.startswith("dram ")]
    assert sorted((row[1], row[2]) for row in table) == sorted(
        (op, size) for op in ("get", "put") for size in QUICK_SIZES)
    for row in table:
        assert float(row[-1]) > 0, row
        assert row[7] == "memcpy", row  # the reference measured in the same run
    assert "dram get >= 0.8x memcpy" in proc.stdout  # the targets are reported
    assert "[" in proc.stderr and "/" in proc.stderr  # progress went to stderr, not into the table

    records = json.loads(rows_json.read_text())
    assert len(records) == 2 * len(QUICK_SIZES)
    assert all(r["gbps"] > 0 and r["ref_gbps"] > 0 and r["ratio"] > 0 for r in records)
    assert not any(tmp_path.glob("kvpool-tier-bench-*")), "the bench left its data directory behind"

    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not plot.exists() and "matplotlib is not installed" in proc.stderr
