"""Benchmarks run end to end (as a user runs them) and print what they promise.

These check that the scripts work and report every size with its reference
ratio, not how fast anything is: speed on a shared 2-core machine is no test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark's quick mode

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICK_SIZES = ("64K", "256K", "1M", "4M", "16M", "64M")


def run_or_dump(args: list[str], timeout_s: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """Run a benchmark (and whatever it starts, in a session of its own, all killed after); one
    still running after ``timeout_s`` fails the test with every thread's stack (faulthandler,
    on SIGABRT). Each test's own limit is 120 s (pyproject), so ``timeout_s`` stays below it."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, **(env or {}), "PYTHONFAULTHANDLER": "1"})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{args[0]} still running after {timeout_s} s; its output and threads:\n{out[-3000:]}\n"
                    f"{err[-12000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its children (a master) too
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_client_start_bench_runs_and_a_default_client_maps_what_it_uses(tmp_path: Path) -> None:
    rows_json = tmp_path / "rows.json"
    proc = run_or_dump([str(REPO_ROOT / "bench" / "client_start_bench.py"), "--iters", "1", "--no-prefault",
                        "--json", str(rows_json)], timeout_s=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].split() == ["what", "start", "s", "cpu", "s", "open", "s", "RSS", "MiB", "log",
                                                   "lines", "x", "floor"]
    rows = {r["what"]: r for r in json.loads(rows_json.read_text())["rows"]}
    assert set(rows) == {"python + numpy", "kvpool.Pool()", "kvpool-server", "kvpool.connect()", "kvpool get",
                         "kvpool get (a miss)"}
    assert all(r["start_s"] > 0 for r in rows.values())
    # Not speed: memory. A default pool and client (1 GiB dram + 1 GiB cxl configured) hold
    # nothing yet, so they map next to nothing; and neither prints a line.
    for what in ("kvpool.Pool()", "kvpool.connect()", "kvpool get"):
        assert rows[what]["rss_mib"] < 512, rows[what]
        assert rows[what]["stderr_lines"] == 0, rows[what]


def test_hand_off_bench_keeps_and_verifies_every_object_both_ways() -> None:
    proc = run_or_dump([str(REPO_ROOT / "bench" / "hand_off_bench.py"), "--objects", "16", "--size", "256K"],
                       timeout_s=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split("  ")[0]: line for line in proc.stdout.splitlines()
            if line.startswith(("arena in /dev/shm", "arena elsewhere"))}
    assert set(rows) == {"arena in /dev/shm", "arena elsewhere"}, proc.stdout
    for line in rows.values():  # every object kept, none failed or left, every one's bytes checked
        assert re.search(r"16 of 16\s+0\s+0\s+[\d.]+ s\s+[\d.]+\s+[\d.]+ s\s+16 of 16$", line), line


def test_tier_bench_quick_runs(tmp_path: Path) -> None:
    plot = tmp_path / "tiers.png"
    rows_json = tmp_path / "rows.json"
    proc = run_or_dump(
        [str(REPO_ROOT / "bench" / "tier_bench.py"), "--quick", "--tiers", "dram",
         "--data-dir", str(tmp_path), "--plot", str(plot), "--json", str(rows_json)], timeout_s=60)
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


def test_peers_bench_quick_kvpool_tcp_and_skipped_peers(tmp_path: Path) -> None:
    """kvpool over TCP for real; every peer pointed at a path where it is not installed,
    so the rows say "skipped: not installed" here as on a machine without any peer."""
    rows_json, plot = tmp_path / "peers.json", tmp_path / "peers.png"
    nowhere = str(tmp_path / "not-installed")
    peers = ("redis", "mooncake-tcp", "mooncake-standalone", "lmcache")
    proc = run_or_dump(
        [str(REPO_ROOT / "bench" / "peers.py"), "--quick", "--sizes", "64K,1M",
         "--total", "8M", "--total-small", "2M", "--exists-keys", "400",
         "--systems", ",".join(("kvpool-tcp",) + peers), "--redis-server", nowhere,
         "--mooncake-master", nowhere, "--mooncake-client", nowhere, "--lmcache-python", nowhere,
         "--json", str(rows_json), "--plot", str(plot)], timeout_s=90, env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    out, *sides = out.split("\n== side by side: ")
    tables = out.split("\n== ")[1:]
    assert [t.split()[0] for t in tables] == ["64K", "1M"]
    for table in tables:
        lines = table.splitlines()
        assert lines[1].startswith("system / mode") and "bexists/s" in lines[1] and "server RSS MiB" in lines[1]
        kvpool = next(line for line in lines if line.startswith("kvpool  TCP (UCX > 16 MiB)"))
        numbers = kvpool.split("cross-process", 1)[1].split()
        assert all(float(v) > 0 for v in numbers[:8]), kvpool  # put/get/bput/bget GB/s, p50/p99 us
        assert "exact" in kvpool and "/" in kvpool and "WRONG" not in kvpool and "failed" not in kvpool
        skipped = [line for line in lines if "skipped: not installed" in line]
        assert len(skipped) == len(peers), table
        assert any(line.startswith("memcpy") for line in lines)  # the reference, measured in the same run
    assert "kvpool / peer" in out and "n/a (not measured)" in out
    assert "[" in proc.stderr and "/" in proc.stderr  # progress on stderr, not in the tables

    # The side-by-side rounds, at each size: kvpool took its turns; the skipped peers are not in them.
    assert [side.split()[0] for side in sides] == ["64K", "1M"] and all("2 rounds" in side for side in sides)
    for side in sides:
        row = next(line for line in side.splitlines() if line.startswith("kvpool  TCP"))
        p50, spread, gbps, bgbps, exists, rounds = row.split("cross-process", 1)[1].split()[:6]
        assert float(p50) > 0 and "-" in spread and float(gbps) > 0 and float(bgbps) > 0 and rounds == "2", row
        assert exists.endswith("k") if side.startswith("64K") else exists == "-", row
    assert "one-key get p50 64K: kvpool-tcp / redis" in sides[-1] and "n/a (not measured)" in sides[-1]

    records = json.loads(rows_json.read_text())
    sides = [r for r in records if r["mode"] == "side-by-side"]
    assert [(r["system"], r["size"]) for r in sides] == [("kvpool-tcp", 65536), ("kvpool-tcp", 1 << 20)]
    for r in sides:
        assert len(r["get_p50_us"]) == len(r["get_gbps"]) == len(r["bget_gbps"]) == 2
        assert all(v > 0 for v in r["get_p50_us"] + r["get_gbps"] + r["bget_gbps"] + r["exists_per_s"])
    assert len(sides[0]["exists_per_s"]) == 2 and not sides[1]["exists_per_s"]
    records = [r for r in records if r["mode"] == "sequential"]
    ours = [r for r in records if r["system"] == "kvpool-tcp"]
    assert sorted(r["size"] for r in ours) == [65536, 1 << 20]
    for r in ours:
        assert all(r[op]["gbps"] > 0 for op in ("put", "get", "bput", "bget")), r
        assert r["rss"] and all(v > 0 for v in r["rss"].values())
    small = next(r for r in ours if r["size"] == 65536)
    assert small["exists_per_s"] > 0 and small["bexists_per_s"] > 0
    assert {r["system"] for r in records if r["skipped"]} == set(peers)
    assert not any(tmp_path.glob("kvpool-peers-*")), "the bench left its work directory behind"
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scale_bench_small_run_reports_every_step_and_the_checks() -> None:
    proc = run_or_dump(
        [str(REPO_ROOT / "bench" / "scale_bench.py"), "--keys", "2000,6000", "--layers", "4",
         "--nodes-with-keys", "2", "--lookup-seconds", "0.3", "--heartbeat-nodes", "5", "--heartbeat-seconds", "2"],
        timeout_s=90)  # ~8 s here; the test's own limit is 120 s
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line[:1].isdigit() and "," in line.split()[0]]
    assert [row[0] for row in rows] == ["2,000", "6,000"]
    assert "5 alive, 0 declared dead" in proc.stdout
    assert "6,000 found" in proc.stdout  # every key indexed again after the master restart


def test_network_bench_one_link_one_size() -> None:
    from bench.netlab import unavailable

    if unavailable():
        pytest.skip(unavailable())
    proc = run_or_dump(
        [str(REPO_ROOT / "bench" / "network_bench.py"), "--rates", "1gbit", "--sizes", "1M", "--iters", "2"],
        timeout_s=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("1gbit"))
    assert row[1] == "1M" and row[6] == "8/32" and float(row[3]) > 0  # whole GB/s measured


def test_checksum_bench_reports_every_way_at_each_size() -> None:
    result = run_or_dump(["bench/checksum_bench.py", "--sizes", "64K,1M", "--iters", "2", "--warmup", "0"], 100)
    assert result.returncode == 0, result.stderr
    ways = ["memcpy", "copy, then hash", "copy+hash per layer", "hash only (xxhash)"]
    if importlib.util.find_spec("kvpool._layersum") is not None:
        ways += ["one pass (C)", "hash only (C)"]
    for size in ("64K", "1M"):
        for way in ways:
            assert any(line.startswith(size) and f" {way} " in line for line in result.stdout.splitlines()), \
                (size, way, result.stdout)
    assert "time / memcpy" in result.stdout


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="the poll bench pins to CPUs 0 and 1")
def test_poll_bench_quick_runs(tmp_path: Path) -> None:
    rows_json = tmp_path / "poll.json"
    proc = run_or_dump([str(REPO_ROOT / "bench" / "poll_bench.py"), "--rounds", "2", "--per-round", "4",
                        "--placements", "split,shared", "--json", str(rows_json)], timeout_s=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "socket floor" in proc.stdout and "polls / blocks" in proc.stdout
    records = json.loads(rows_json.read_text())
    assert [(r["placement"], r["reader"]) for r in records["rows"]] == [
        ("split", "polls"), ("split", "blocks"), ("shared", "polls"), ("shared", "blocks")]
    for row in records["rows"]:  # every get returned the bytes put (else the bench fails), and took time
        assert row["get_p50_us"] > 0 and row["exists_p50_us"] > 0
        polled = row["polls_caught"] + row["polls_ran_out"]
        if row["reader"] == "blocks":
            assert polled == 0, row
        elif row["placement"] == "split":  # its first gets (on one CPU, polling may have turned itself off)
            assert polled > 0, row
    for placement in ("split", "shared"):  # the side-by-side ratios are reported
        assert re.search(rf"{placement}\s+get\s+[0-9.]+x", proc.stdout), proc.stdout


@pytest.mark.timeout(900)  # four vLLM servers, two at a time, a minute or more each to start here
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (pip install 'kvpool[vllm]')")
def test_serving_bench_smallest_prefix_and_kvpool(tmp_path: Path) -> None:
    """The serving bench at its smallest (2 users x 2 turns, 2 P/D prompts, a 2-layer model):
    every row and workload reported, kvpool's rows without an error; not how fast."""
    rows_json = tmp_path / "serving.json"
    proc = run_or_dump(
        [str(REPO_ROOT / "bench" / "serving_bench.py"), "--rows", "prefix,kvpool", "--users", "2", "--turns", "2",
         "--doc-tokens", "256", "--pd-prompts", "2", "--pd-tokens", "256", "--layers", "2", "--hidden", "128",
         "--max-tokens", "8", "--reference-runs", "1", "--json", str(rows_json)],
        timeout_s=840, env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    for label in ("prefix caching only", "kvpool", "one engine recomputing", "kvpool P/D"):
        assert any(line.startswith(label + " ") for line in proc.stdout.splitlines()), (label, proc.stdout)
    assert "ratios (issue 41's targets)" in proc.stdout
    rows = {(r["row"], r["workload"]): r for r in json.loads(rows_json.read_text())["rows"]}
    assert set(rows) == {("prefix", "multiturn"), ("prefix", "pd"), ("kvpool", "multiturn"), ("kvpool", "pd")}
    for (row, workload), r in rows.items():
        assert r["requests"] == (4 if workload == "multiturn" else 2), r
        assert r["ttft_p50_ms"] > 0 and r["wall_s"] > 0, r
        if row == "kvpool":
            assert r["status"] == "ok" and r["errors"] == 0, (r["status"], r["error_samples"], proc.stderr[-5000:])
            assert r["equal_to_reference"] is not None
    assert not any(tmp_path.glob("kvpool-serving-bench-*")), "the bench left its work directory behind"


SGLANG_PYTHON = REPO_ROOT / ".venv-sglang" / "bin" / "python"


@pytest.mark.timeout(300)  # SGLang's import alone takes 10-30 s on a busy 2-vCPU machine
@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=".venv-sglang is missing (.ci/run builds it)")
def test_hicache_bench_quick_through_sglang_venv(tmp_path: Path) -> None:
    """bench/hicache_bench.py --quick in .venv-sglang: every backend row at both page sizes,
    every page read back exact, kvpool's rows by the path they name; not how fast."""
    rows_json = tmp_path / "hicache.json"
    proc = subprocess.Popen([str(SGLANG_PYTHON), str(REPO_ROOT / "bench" / "hicache_bench.py"), "--quick",
                             "--disk-dir", str(tmp_path), "--json", str(rows_json)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1", "TMPDIR": str(tmp_path)})
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"hicache_bench still running after 240 s:\n{out[-3000:]}\n{err[-12000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the master and writers it started, if any were left
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, out + err[-5000:]
    assert "kvpool / peer" in out and "target >= 1.5x" in out
    rows = {(r["row"], r["page_size"]): r for r in json.loads(rows_json.read_text())["rows"]}
    assert set(rows) == {(name, page) for name in ("kvpool-shm", "kvpool-tcp", "kvpool-own", "file-tmpfs",
                                                   "file-disk", "mooncake-remote", "mooncake")
                         for page in (16, 64)}
    for (name, _page), r in rows.items():
        if name.startswith("mooncake") and r["status"] != "ok":
            # where mooncake.store does not import in .venv-sglang the row says so; where the peer
            # itself fails (its warm-up put, SGLang's host-memory check) the row says that
            assert r["status"].startswith(("not installed", "failed: RuntimeError")), r
            continue
        assert r["status"] == "ok", r
        assert r["verified_pages"] == 3 * 128 and len(r["set_s"]) == len(r["get_s"]) == 2, r
        assert r["set_gbps"] > 0 and r["get_gbps"] > 0 and r["set_p50_ms"] > 0 and r["get_p50_ms"] > 0, r
    for page in (16, 64):  # same host: read in place from the writer's arena; TCP: every object pulled
        assert rows[("kvpool-shm", page)]["reads"].get("pulls", 0) == 0, rows[("kvpool-shm", page)]
        assert rows[("kvpool-tcp", page)]["reads"].get("pulls", 0) == 3 * 128 * 2, rows[("kvpool-tcp", page)]
    assert not any(tmp_path.glob("kvpool-hicache-bench-*")), "the bench left its directories behind"


@pytest.mark.timeout(900)  # seven vLLM engines one at a time (warm-ups included), half a minute or more each here
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (pip install 'kvpool[vllm]')")
def test_vllm_bench_ttft_rows_with_lmcache(tmp_path: Path) -> None:
    """bench/vllm_bench.py's TTFT rows at their smallest (one 256-token document, a 2-layer
    model): no connector, ExampleConnector, LMCache server mode (from .venv-lmcache, "not
    installed" without it) and kvpool same host, every row's tokens equal to the first's, and
    the ratios to LMCache's TTFT; not how fast."""
    venv = REPO_ROOT / ".venv-lmcache"
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('lmcache') and u.find_spec('vllm') else 1)"
    has_lmcache = (venv / "bin" / "lmcache").exists() and subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True).returncode == 0
    proc = run_or_dump(
        [str(REPO_ROOT / "bench" / "vllm_bench.py"), "--only", "ttft", "--docs", "1", "--prefix", "256",
         "--layers", "2", "--hidden", "128", "--kv-heads", "2", "--lmcache-l1-gb", "0.25",
         "--configs", "recompute,example,lmcache,same-host"],
        timeout_s=840, env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    lines = proc.stdout.splitlines()
    assert any("vs LMCache" in line for line in lines), proc.stdout
    for label in ("no connector (recompute)", "vLLM ExampleConnector", "kvpool, same host"):
        (row,) = [line for line in lines if line.startswith(label)]
        assert row.split()[-1] == "yes", (label, proc.stdout)
    (row,) = [line for line in lines if line.startswith("LMCache server mode")]
    if has_lmcache:
        assert row.split()[-1] == "yes" and re.search(r"\s1\.00x\s", row), proc.stdout  # (its own ratio)
        assert re.search(r"kvpool's TTFT p50 / LMCache's .*same host .*[0-9.]+x", proc.stdout), proc.stdout
    else:
        assert "not installed" in row, proc.stdout
    assert not any(tmp_path.glob("kvpool-vllm-bench-*")), "the bench left its work directory behind"
