"""What an engine's hand-off at exit costs (``node.hand_off_s``): how long a closing client takes
to have the storage node on its host keep the objects in its arena.

A ``kvpool-server`` (master + storage node, a cxl arena only) starts here; for each row a client
laid out as the vLLM connector's default pool (no dram tier, every object in its own cxl arena)
puts ``--objects`` objects of ``--size`` with key-derived content, then hands them off
(``ClusterView.hand_off``, timed alone), then closes (timed too: the client's own teardown).
Rows: the client's arena under ``/dev/shm`` (the default), and in a directory the storage node
may not map (``--pull-dir``, default a scratch directory under ``/tmp``). A live client's
objects are pulled over loopback either way (only a rescue reads a dead client's arena);
the two rows show the arena's place costs nothing.

After each row a fresh reader checks every object's bytes from the storage node (``verified``).
Each row runs with the storage node empty of the row's keys (keys carry the row's name).

    python bench/hand_off_bench.py [--objects 1024] [--size 1M]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import format_table, parse_size, size_label  # noqa: E402


def content(row: str, i: int, nbytes: int) -> Any:
    """The object ``i`` of ``row``: bytes any reader can derive again from its key."""
    import numpy as np

    values = np.random.default_rng(hash((row, i)) & 0xFFFFFFFF).integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    return values.view(np.float16).reshape(8, 2, -1, 1, 64)


def run_row(master: str, work: Path, row: str, arena_dir: str | None, objects: int, nbytes: int) -> list[Any]:
    import numpy as np

    import kvpool

    cxl: dict[str, Any] = {"capacity": f"{(objects * (nbytes + 65536)) // (1 << 20) + 64}MiB"}
    if arena_dir is not None:
        cxl["path"] = os.path.join(arena_dir, f"{row.replace(' ', '-')}-cxl")
    config = {"pool": {"data_dir": str(work / row.replace(" ", "-"))},
              "tiers": {"dram": {"capacity": 0}, "cxl": cxl, "nvme": {"capacity": 0}},
              "master": {"listen": master}}
    keys = [f"{row}-{i}".encode() for i in range(objects)]
    client = kvpool.connect(master, config=config)
    try:
        for i, key in enumerate(keys):
            client.put(key, content(row, i, nbytes))
        started = time.perf_counter()
        done = client.cluster.hand_off(60.0)
        hand_off_s = time.perf_counter() - started
    finally:
        started = time.perf_counter()
        client.close()
        close_s = time.perf_counter() - started
    reader = kvpool.connect(master, config={"pool": {"data_dir": str(work / "reader")},
                                            "tiers": {"dram": {"capacity": "64MiB", "mlock": False},
                                                      "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                            "master": {"listen": master}})
    try:
        verified = sum(1 for i, key in enumerate(keys)  # (bits compared: random bits hold NaNs)
                       if (got := reader.get(key)) is not None
                       and np.array_equal(got.view(np.uint16), content(row, i, nbytes).view(np.uint16)))
    finally:
        reader.close()
    moved = done["adopted"] * nbytes
    return [row, f"{done['adopted']} of {objects}", done["failed"], done["left"], f"{hand_off_s:.2f} s",
            f"{moved / hand_off_s / 1e9:.2f}" if hand_off_s else "-", f"{close_s:.2f} s", f"{verified} of {objects}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=1024)
    parser.add_argument("--size", default="1M", help="bytes per object (a multiple of 2 KiB)")
    parser.add_argument("--pull-dir", default="", help="where the pulled row's arena lives (default: under /tmp)")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="kvpool-hand-off-bench-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = f"tcp://127.0.0.1:{port}"
    capacity = f"{2 * args.objects * (nbytes + 65536) // (1 << 20) + 64}MiB"
    log = work / "daemon.log"
    daemon = subprocess.Popen([sys.executable, "-m", "kvpool.cli.server", "--pool.name", "hand-off-bench",
                               "--pool.data_dir", str(work / "storage"), "--tiers.dram.capacity", "0",
                               "--tiers.cxl.capacity", capacity, "--tiers.nvme.capacity", "0",
                               "--master.listen", master], cwd=REPO_ROOT, stdout=log.open("wb"),
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "ready" not in log.read_text(errors="replace"):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text(errors="replace")[-2000:])
            time.sleep(0.1)
        pull_dir = args.pull_dir or str(work / "arenas")
        os.makedirs(pull_dir, exist_ok=True)
        rows = [run_row(master, work, "arena in /dev/shm", None, args.objects, nbytes),
                run_row(master, work, "arena elsewhere", pull_dir, args.objects, nbytes)]
    finally:
        daemon.terminate()
        daemon.wait(30)
    print(f"hand-off of {args.objects} objects of {size_label(nbytes)} to the storage node on this host "
          f"(load average {os.getloadavg()[0]:.2f}, CPUs {sorted(os.sched_getaffinity(0))})")
    print(format_table(["row", "kept", "failed", "left", "hand-off", "GB/s", "client close", "verified"], rows))
    return 0 if all(row[-1] == f"{args.objects} of {args.objects}" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
