"""Exact bytes or a miss, under concurrency, across real processes.

A master and several ``kvpool.connect`` client processes on 127.0.0.1 put,
overwrite, get and delete one shared key set at once. Every value is derived
from (key, version) and every layer carries a (key, version, layer) tag
(:func:`bench.soak.content`), so each process checks every value it receives
against the key it asked for: one version of that key's value, exactly the
layers asked for. Anything else is *wrong*; each worker reports its counts
(and samples of wrong values: whose bytes came back) as one JSON line.

Puts land in each process's shared-memory ``cxl`` arena (dram capacity 0) and
the tiers are small, so extents are freed and reused, objects demoted and
dropped, while other processes on the host read them in place.

Duration per test: ``KVPOOL_STRESS_SECONDS`` (default 15 s of workload, plus
start-up). Every process is stopped at the end, also on failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.soak import parse_result, table, worker_command
from kvpool.cluster.wire.master_client import MasterClient
from tests.conftest import ChildProcess, WaitAborted, free_tcp_port, wait_for

SECONDS = float(os.environ.get("KVPOOL_STRESS_SECONDS", "15"))
HEARTBEAT_MS = 500
# Errors a get/put may raise on a loaded 2-core machine without breaking the contract.
TOLERATED_ERRORS = ("MasterUnreachableError", "KVTimeoutError")
# A put into a tiny tier whose every object other processes hold leased (reading them) fails
# typed after its rounds of asking the master (tiers/manager.py): the put is a future miss, the
# contract holds. Seen once in 2,624 puts of one worker (a full suite run, 2026-12-05); tolerated
# while rare, so puts that fail as a rule still fail the test.
RARE_ERRORS = ("put:PoolFullError",)
RARE_SHARE = 0.002  # of a worker's puts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(120, 60 + 3 * SECONDS))]


def start_master(tmp_path: Path, spawn: Callable[..., ChildProcess]) -> str:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    client = MasterClient(address, request_timeout_s=1.0)
    try:
        spawn(["-m", "kvpool.cli.server", "--role", "master", "--master.listen", address,
               "--master.heartbeat_ms", str(HEARTBEAT_MS), "--master.dead_after_missed", "6",
               "--log-level", "WARNING"],
              log_path=tmp_path / "master.log", ready=lambda: client.ping(timeout_s=0.5), timeout_s=30)
    finally:
        client.close()
    return address


def start_all(spawn: Callable[..., ChildProcess], tmp_path: Path,
              commands: Sequence[tuple[str, list[str]]]) -> list[ChildProcess]:
    """Start every process at once (start-up overlaps), then wait until each printed READY."""
    children = [spawn(command[1:], log_path=tmp_path / f"{name}.log") for name, command in commands]
    for child in children:
        def ready(child: ChildProcess = child) -> bool:
            if child.popen.poll() is not None:
                raise WaitAborted(f"exited with {child.popen.returncode}:\n{child.output()}")
            return "READY" in child.output()
        wait_for(ready, 60, f"{child.log_path.name} to be ready", interval_s=0.1)
    return children


def collect(children: Sequence[ChildProcess], timeout_s: float) -> list[dict[str, Any]]:
    """Each child's RESULT line, waiting (bounded) for the children to exit."""
    results = []
    for child in children:
        wait_for(lambda: child.popen.poll() is not None, timeout_s, f"{child.log_path.name} to finish",
                 interval_s=0.1)
        result = parse_result(child.output())
        assert result is not None, f"{child.log_path.name} (exit {child.popen.returncode}) reported nothing:\n" \
                                   f"{child.output()[-4000:]}"
        results.append(result)
    return results


def report(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Print the table (shown with -s or on failure) and return the totals."""
    text, total = table(results)
    print("\n" + text)
    for r in results:
        for sample in r["wrong_samples"]:
            print(f"WRONG {r['name']}: {sample}")
        for name, n in sorted(r["errors"].items()):
            print(f"error {r['name']}: {name} x{n}")
    return total


def assert_exact(results: Sequence[dict[str, Any]], total: dict[str, Any]) -> None:
    wrong = {r["name"]: r["wrong_samples"] for r in results if r["wrong"]}
    assert total["wrong"] == 0, f"{total['wrong']} wrong values in {total['gets']} gets; samples: {wrong}"

    def expected(r: dict[str, Any], name: str, count: int) -> bool:
        return name.endswith(TOLERATED_ERRORS) or (name in RARE_ERRORS and count <= RARE_SHARE * r["puts"])

    unexpected = {r["name"]: (r["errors"], r["error_samples"]) for r in results
                  if not all(expected(r, name, count) for name, count in r["errors"].items())}
    assert not unexpected, f"unexpected errors: {unexpected}"


def test_mixed_workload_processes(tmp_path: Path, spawn_python: Callable[..., ChildProcess]) -> None:
    processes, keys = 8, 64
    address = start_master(tmp_path, spawn_python)
    go = tmp_path / "go"
    commands = [(f"w{n}", worker_command(
        sys.executable, address, f"stress-w{n}", tmp_path / f"w{n}", seconds=SECONDS, keys=keys, seed=100 + n,
        seed_share=(n, processes), versions=4, cxl="1MiB", nvme="2MiB", heartbeat_ms=HEARTBEAT_MS,
        go_file=str(go), mix="put=3,get=5,get_many=1,delete=1")) for n in range(processes)]
    children = start_all(spawn_python, tmp_path, commands)
    go.touch()
    results = collect(children, SECONDS + 60)
    total = report(results)
    assert_exact(results, total)
    assert total["hits"] > 0 and total["gets"] > 0
    assert total["same_host"] > 0, "no get was served in place from another process's arena"
    assert total["located"] > 0, "no get was served from a replica located through the master"


def owner_vs_readers(tmp_path: Path, spawn: Callable[..., ChildProcess], owner_tiers: dict[str, str],
                     seed: int, reader_seed: int) -> list[dict[str, Any]]:
    """One owner putting, overwriting and deleting 8 keys of one size (tiers ``owner_tiers``),
    3 reader processes getting them (one-key and batched), for SECONDS: every value checked.
    Returns the readers' results."""
    keys, shapes, readers = 8, 1, 3
    address = start_master(tmp_path, spawn)
    go = tmp_path / "go"

    def command(role: str, name: str, **options: Any) -> list[str]:
        base = worker_command(sys.executable, address, name, tmp_path / name, seconds=SECONDS, keys=keys,
                              shapes=shapes, versions=8, heartbeat_ms=HEARTBEAT_MS, go_file=str(go), **options)
        return [base[0], "-m", "tests.stress_actor", role, *base[4:]]

    commands = [("owner", command("owner", "stress-owner", seed=seed, **owner_tiers))]
    commands += [(f"reader{n}", command("reader", f"stress-reader{n}", seed=reader_seed + n, dram="1MiB", cxl="0",
                                        nvme="0", mix="get=4,get_many=1"))
                 for n in range(readers)]
    children = start_all(spawn, tmp_path, commands)
    go.touch()
    results = collect(children, SECONDS + 60)
    total = report(results)
    assert_exact(results, total)
    owner = next(r for r in results if r["name"] == "stress-owner")
    assert owner["puts"] > 100 and owner["deletes"] > 10, "the owner did not churn"
    readers_results = [r for r in results if r["name"].startswith("stress-reader")]
    assert sum(r["hits"] for r in readers_results) > 0, "the readers never got a value"
    return readers_results


def test_owner_churn_vs_readers(tmp_path: Path, spawn_python: Callable[..., ChildProcess]) -> None:
    # One size for every key: an extent freed by a delete or an overwrite is refilled by another key at
    # the same offset, so a reader that trusts a header it did not check against its key gets that key's
    # bytes. (24 keys of 3 sizes reproduced nothing in 15 s on 2 cores; 8 keys of one size did.)
    readers = owner_vs_readers(tmp_path, spawn_python, {"cxl": "384KiB", "nvme": "1MiB"}, seed=7,
                                  reader_seed=200)
    assert sum(r["remote"].get("hits_same_host", 0) for r in readers) > 0, "no read through the same-host index"


def test_owner_churn_vs_readers_pulling_over_tcp(tmp_path: Path, spawn_python: Callable[..., ChildProcess]) -> None:
    """The same churn with the owner's objects in dram and nvme (no cxl arena, so no same-host
    index): every reader get is a pull over TCP, most of them a speculative pull from the owner
    used as the owner answered, without the master (node.confirm_speculative = false), while
    the owner overwrites, deletes and demotes those keys to nvme."""
    readers = owner_vs_readers(tmp_path, spawn_python, {"dram": "384KiB", "cxl": "0", "nvme": "1MiB"},
                                  seed=9, reader_seed=300)
    assert sum(r["remote"].get("speculative_unconfirmed", 0) for r in readers) > 0, \
        "no get used a speculative pull without the master"
