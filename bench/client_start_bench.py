"""What one kvpool client costs to start: seconds and resident memory, as a user starts it.

Each row is a fresh process run with the defaults (HOME moved to a scratch directory, so
the default data dir, key file and state dir are its own):

* ``python + numpy``: the floor every row stands on (the interpreter, ``import numpy``);
* ``kvpool.Pool()``: an embedded pool (1 GiB dram, 1 GiB cxl, 8 GiB nvme by default);
* ``Pool() prefault``: the same with ``tiers.dram.prefault`` and ``tiers.cxl.prefault``
  (every page touched, locked and allocated at start, as every pool did before);
* ``kvpool.connect()``: a client of a ``kvpool-server`` started here with the defaults;
* ``kvpool get``: the CLI reading one 1 MiB object that a durable put left on that server;
* ``kvpool get (a miss)``: the CLI asking for a key nobody holds (exit status 1);
* ``kvpool-server``: the daemon itself, from exec to "ready".

``start s`` is the process's wall time from exec to exit (p50 over ``--iters`` runs; the
server row: to "ready", one run), ``cpu s`` the CPU time it used (user + system, p50: on a
shared machine less noisy than wall time), ``open s`` the time inside the process from before
``import kvpool`` to an open pool, ``RSS MiB`` its peak resident memory (``ru_maxrss``; the
server row: its resident memory once ready), ``log lines`` what it printed on stderr,
``x floor`` start time over the python + numpy floor.

    python bench/client_start_bench.py [--iters 5] [--json rows.json] [--no-prefault]
"""

from __future__ import annotations

import argparse
import json
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

from bench.common import format_table, percentile  # noqa: E402

FLOOR = "import numpy"
OPEN = """
import json, sys, time
start = time.perf_counter()
import kvpool
pool = {open}
opened = time.perf_counter() - start
{use}
pool.close()
print(json.dumps({{"open_s": opened}}))
"""
POOL = OPEN.format(open="kvpool.Pool()", use="")
POOL_PREFAULT = OPEN.format(
    open='kvpool.Pool({"tiers": {"dram": {"prefault": True}, "cxl": {"prefault": True}}})', use="")
CONNECT = OPEN.format(open="kvpool.connect(sys.argv[1])", use="")
DURABLE_PUT = OPEN.format(
    open="kvpool.connect(sys.argv[1])",
    use="import numpy as np; pool.put(b'client-start-bench', np.ones((4, 2, 64, 8, 128), np.float16), durable=True)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_json(argv: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run ``argv`` to completion: what it printed as JSON on its last line."""
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise SystemExit(f"{' '.join(argv[:4])}... still running after {timeout_s} s") from None
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}... exited {proc.returncode}:\n{err[-3000:]}")
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return json.loads(last) if last.startswith("{") else {}


def measure(argv: list[str], env: dict[str, str], iters: int, timeout_s: float, exit_code: int = 0) -> dict[str, Any]:
    """``iters`` runs of ``argv`` (each must exit with ``exit_code``); peak RSS measured in a fresh
    grandchild so that earlier, larger children do not mask it (RUSAGE_CHILDREN is a running
    maximum)."""
    walls, cpus, opens, rss, lines = [], [], [], [], 0
    for _ in range(iters):
        probe = [sys.executable, "-c", _PROBE, json.dumps(argv), str(timeout_s), str(exit_code)]
        got = run_json(probe, env, timeout_s + 30)
        walls.append(got["wall_s_child"])
        cpus.append(got["cpu_s_child"])
        rss.append(got["maxrss_mib"])
        lines = max(lines, got["stderr_lines"])
        if "open_s" in got:
            opens.append(got["open_s"])
    return {"start_s": percentile(walls, 50), "cpu_s": percentile(cpus, 50),
            "open_s": percentile(opens, 50) if opens else None,
            "rss_mib": max(rss), "stderr_lines": lines}


# Runs one command and reports its wall time, peak RSS and JSON output (a process whose only
# child is the measured one, so RUSAGE_CHILDREN is that child's alone).
_PROBE = """
import json, resource, subprocess, sys, time
argv, timeout_s, exit_code = json.loads(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
wall = time.perf_counter() - start
if done.returncode != exit_code:
    sys.stderr.write(done.stderr[-3000:])
    sys.exit(done.returncode)
last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
printed = json.loads(last) if last.startswith("{") else {}
lines = len([line for line in done.stderr.splitlines() if line.strip()])
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall_s_child": wall, "cpu_s_child": usage.ru_utime + usage.ru_stime,
                  "maxrss_mib": usage.ru_maxrss / 1024,
                  "stderr_lines": lines, **printed}))
"""


def rss_mib(pid: int) -> float | None:
    """Resident memory of a running process (VmRSS), in MiB."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def start_server(env: dict[str, str], master: str, log_path: Path, timeout_s: float) -> tuple[subprocess.Popen[bytes],
                                                                                             float]:
    start = time.perf_counter()
    log = log_path.open("wb")
    server = subprocess.Popen([sys.executable, "-m", "kvpool.cli.server", "--master.listen", master],
                              cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while "ready" not in log_path.read_text(errors="replace"):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            server.wait()
            raise SystemExit(f"kvpool-server did not get ready:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.01)
    return server, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=5, help="runs per row (default 5)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one run may take (default 60)")
    parser.add_argument("--no-prefault", action="store_true", help="leave out the prefault row (it maps 2 GiB)")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvpool-start-") as scratch:
        env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
        env.update(HOME=scratch, PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        py = sys.executable

        def row(what: str, argv: list[str], exit_code: int = 0) -> None:
            got = measure(argv, env, args.iters, args.timeout, exit_code)
            rows.append({"what": what, **got})
            print(f"  {what}: {got['start_s']:.2f} s", file=sys.stderr, flush=True)

        row("python + numpy", [py, "-c", FLOOR])
        row("kvpool.Pool()", [py, "-c", POOL])
        if not args.no_prefault:
            row("Pool() prefault", [py, "-c", POOL_PREFAULT])
        master = f"tcp://127.0.0.1:{free_port()}"
        server, ready_s = start_server(env, master, Path(scratch) / "server.log", args.timeout)
        try:
            rows.append({"what": "kvpool-server", "start_s": ready_s, "cpu_s": None, "open_s": None,
                         "rss_mib": rss_mib(server.pid),
                         "stderr_lines": None})
            row("kvpool.connect()", [py, "-c", CONNECT, master])
            measure([py, "-c", DURABLE_PUT, master], env, 1, args.timeout)  # the object `kvpool get` reads
            row("kvpool get", [py, "-m", "kvpool.cli", "get", "636c69656e742d73746172742d62656e6368",
                               "--master", master, "--out", str(Path(scratch) / "kv.npy")])
            row("kvpool get (a miss)", [py, "-m", "kvpool.cli", "get", "6e6f2073756368206b6579",
                                        "--master", master, "--out", str(Path(scratch) / "miss.npy")], exit_code=1)
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    floor = rows[0]["start_s"]
    table = [[r["what"], r["start_s"], r["cpu_s"], r["open_s"], r["rss_mib"], r["stderr_lines"], r["start_s"] / floor]
             for r in rows]
    print(format_table(["what", "start s", "cpu s", "open s", "RSS MiB", "log lines", "x floor"], table,
                       align="lrrrrrr"))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after: {' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load_before": load_before, "load_after": load_after},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
