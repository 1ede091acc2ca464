"""kvpool.connect() as a user meets it first: what its failure to reach a master costs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import kvpool
from kvpool import errors
from tests.conftest import REPO_ROOT, free_tcp_port

pytestmark = pytest.mark.timeout(60)


def test_connect_to_a_dead_master_takes_the_timeout_it_names(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Nobody listens: one ping, MasterUnreachableError naming request_timeout_s, and no second
    wait to deregister a node the master never registered."""
    settings = {"pool": {"data_dir": str(tmp_path)}, "master": {"request_timeout_s": 1.5},
                "tiers": {"dram": {"capacity": "4MiB", "mlock": False}, "cxl": {"capacity": "4MiB"}},
                "security": {"key_file": str(tmp_path / "cluster.key")}}
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="kvpool"):
        with pytest.raises(errors.MasterUnreachableError, match="within 1.5 s"):
            kvpool.connect(f"tcp://127.0.0.1:{free_tcp_port()}", config=settings)
    elapsed = time.monotonic() - started
    assert "deregister" not in caplog.text and "leave" not in caplog.text
    assert elapsed < 1.5 + 2.5, elapsed  # the named timeout plus opening the local pool, not 2-3 of them


_BOUND_CLIENT = """
import os, sys
import numpy as np
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # as vLLM-CPU binds the model's thread
import kvpool
pool = kvpool.connect(sys.argv[1], config={"pool": {"data_dir": sys.argv[2]}, "tiers": {"dram": {"capacity": "4MiB",
                      "mlock": False}, "cxl": {"capacity": "4MiB"}}})
pool.put(b"k" * 16, np.zeros((1, 2, 16, 1, 64), np.float16))
for task in sorted(os.listdir("/proc/self/task")):
    name = open(f"/proc/self/task/{task}/comm").read().strip()
    cpus = [line.split()[1] for line in open(f"/proc/self/task/{task}/status") if line.startswith("Cpus_allowed_list")]
    print("THREAD", name, cpus[0])
pool.close()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two CPUs and thread affinity")
def test_a_client_opened_on_one_core_talks_to_the_master_from_every_core(tmp_path: Path, cluster: Any) -> None:
    """A process whose opening thread is bound to one core (vLLM-CPU's model thread) still gets
    its master link's ZeroMQ I/O thread on every CPU: bound with the opener, a publish the model
    waits for queued behind whatever else runs on that core (docs/benchmarks.md)."""
    cluster.start_master()
    done = subprocess.run([sys.executable, "-c", _BOUND_CLIENT, cluster.master_address, str(tmp_path / "client")],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    threads = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("THREAD ")]

    def cpu_set(listed: str) -> set[int]:  # "0-3,6" -> {0, 1, 2, 3, 6}
        ends = [part.split("-") for part in listed.split(",")]
        return {cpu for end in ends for cpu in range(int(end[0]), int(end[-1]) + 1)}

    every = os.sched_getaffinity(0)
    assert cpu_set(threads[0][1]) == {min(every)}  # the opener (its main thread) stayed where it was bound
    io = [cpu_set(cpus) for name, cpus in threads if name.startswith("ZMQbg/IO")]
    assert io and all(cpus == every for cpus in io), threads
