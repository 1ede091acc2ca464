"""The timed fault soak (``python bench/soak.py --duration 30m``): the soak's checking workers
run for the whole time while every fault the tests know is applied in turn, again and again.

The cluster, all on 127.0.0.1:

* masters: two behind a real etcd (``master.etcd``; a leader and a standby) where an ``etcd``
  binary exists, else one;
* two storage nodes (``kvpool-server --role node``, nvme only), the first with its nvme on a
  small tmpfs of its own (root only; otherwise a plain directory and the disk-full fault is
  skipped);
* ``--processes`` checkers: soak workers (:class:`bench.soak.Worker`) that put (also durable
  puts, which land on the storage nodes), get, get_many and delete the shared keys and check
  every value they receive, for the whole duration;
* ``--victims`` victims: soak workers that mostly put, so they hold many of the keys the
  checkers read, and that the faults hit.

Faults, one every ``--fault-every`` seconds, in this order, cycling:

``kill9``         a victim is killed (SIGKILL) and started again (same data dir, arena path);
``sigstop``       a victim is stopped (SIGSTOP) past the master's dead-node timeout, then resumed;
``master``        the master leader is killed (SIGKILL): with etcd the standby takes over and
                  the killed one comes back as the standby; without, it restarts at its address;
``disk_full``     the first storage node's tmpfs is filled to the last byte for a while;
``small_arena``   a victim is stopped (SIGTERM) and restarted with a cxl arena half (or back
                  to the full) size;
``corrupt``       a storage node is killed (SIGKILL), bytes of its nvme segment files, its
                  LMDB index and its durable.log are overwritten with random (non-ASCII) bytes,
                  and it is started again;
``freeze_leader`` the master leader is frozen (SIGSTOP) past its etcd lease, so the standby takes
                  over, then resumed (it finds itself deposed and follows); etcd only;
``etcd``          etcd is killed (SIGKILL) for ``--stop-s``, then started again on its data; etcd
                  only.

Beside the checkers, the ledger (:mod:`bench.soak_ledger`) makes durable puts (2 copies) from a
new short-lived client every batch (client churn), reads every acknowledged one back after its
client left, and counts the lost ones: the bar is 0. The storage nodes' descriptors are counted
at the start and the end (a node must not keep a socket per departed client).

Reports the soak's per-process table, wrong values (the bar is 0), errors by type, the worst
get, the longest any op was blocked (an op still in flight counts: a watchdog samples it), the
pull deadline they compare with, and every fault with how long its recovery took.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.peer_backends.base import PeerError, ServerProcess, free_port
from bench.soak_report import Latencies, parse_result, table, worker_command

FAULTS = ("kill9", "sigstop", "master", "disk_full", "small_arena", "corrupt", "freeze_leader", "etcd")
PULL_TIMEOUT_S = 5.0  # node.pull_timeout_s of the workers (bench.soak.worker_config)
DEAD_AFTER_MISSED = 4
CLOCK_SKEW_S = 5.0  # the checkers start their clocks before the run's clock starts (each says READY first)


def parse_duration(text: str) -> float:
    """``90s``, ``3m``, ``1.5h`` or plain seconds, as seconds."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smh]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 1h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


class FaultSoak:
    """The cluster, its processes and the faults (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.seconds = args.duration
        self.rng = random.Random(args.seed)
        self.started = time.monotonic()
        self.processes: list[ServerProcess] = []
        self.fault_log: list[str] = []
        self.fault_counts: Counter[str] = Counter()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.etcd_url = ""
        self.prefix = f"/soak-{os.getpid()}"
        self.masters: dict[str, ServerProcess] = {}  # address -> process
        self.master_address = ""
        self.stores: list[ServerProcess | None] = [None, None]
        self.tmpfs: Path | None = None
        self.victims: dict[int, ServerProcess] = {}
        self.victim_lives: Counter[int] = Counter()
        self.victim_small: dict[int, bool] = {}
        self.results: list[dict[str, Any]] = []
        self.ledger: ServerProcess | None = None
        self.ledger_result: dict[str, Any] | None = None
        self.store_fds: dict[int, list[int]] = {}  # storage node -> descriptors at the start, at the end
        self.etcd_command: list[str] = []
        self.failures: list[str] = []
        self.faults = [f for f in args.faults.split(",") if f] if args.faults else list(FAULTS)
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise SystemExit(f"--faults: unknown {sorted(unknown)}; known: {', '.join(FAULTS)}")

    # -- time and logging --------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.started

    def note(self, text: str) -> None:
        line = f"[{self.now():7.1f} s] {text}"
        self.fault_log.append(line)
        print(line, file=sys.stderr, flush=True)

    def spawn(self, name: str, command: list[str]) -> ServerProcess:
        log, life = self.work / f"{name}.log", 1
        while log.exists():  # a restarted process keeps its earlier lives' logs
            life += 1
            log = self.work / f"{name}.{life}.log"
        process = ServerProcess(name, command, log, None)
        self.processes.append(process)
        return process

    # -- the cluster -------------------------------------------------------------------------

    def master_flags(self) -> list[str]:
        return (["--master.etcd", self.etcd_url, "--master.etcd_prefix", self.prefix] if self.etcd_url
                else ["--master.listen", self.master_address])

    def start_etcd(self) -> None:
        binary = shutil.which("etcd")
        if binary is None or self.args.no_etcd:
            return
        port, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{port}"
        self.etcd_command = [binary, "--name", "soak", "--data-dir", str(self.work / "etcd-data"),
                             "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"soak=http://127.0.0.1:{peer}"]
        self.run_etcd()

    def run_etcd(self) -> None:
        """(Re)start etcd on its data directory and wait until it serves."""
        with (self.work / "etcd.log").open("ab") as log:
            self.etcd = subprocess.Popen(self.etcd_command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        from kvpool.cluster.wire.etcd import EtcdClient

        client = EtcdClient(self.etcd_url, timeout_s=1.0)
        try:
            self._wait(lambda: client.get(b"/probe") is None, 30, "etcd to serve")
        finally:
            client.close()

    def start_master(self, address: str) -> ServerProcess:
        name = f"master-{address.rsplit(':', 1)[1]}"
        command = [sys.executable, "-m", "kvpool.cli.server", "--role", "master", "--master.listen", address,
                   "--master.heartbeat_ms", str(self.args.heartbeat_ms),
                   "--master.dead_after_missed", str(DEAD_AFTER_MISSED), "--log-level", "WARNING",
                   *(["--master.etcd", self.etcd_url, "--master.etcd_prefix", self.prefix] if self.etcd_url else [])]
        process = self.spawn(name, command)
        self.masters[address] = process
        return process

    def leader(self) -> str | None:
        if not self.etcd_url:
            return self.master_address
        from kvpool.cluster.wire.etcd import masters

        try:
            return masters(self.etcd_url, self.prefix)[0]
        except Exception:  # etcd busy: not known now
            return None

    def wait_master(self, timeout_s: float) -> float:
        """Seconds until a master answers a ping (through etcd's leader where there is one)."""
        from kvpool.cluster.wire.master_client import MasterClient
        from kvpool.config import Config

        started = time.monotonic()
        config = Config.load({"master": {"etcd": self.etcd_url, "etcd_prefix": self.prefix}} if self.etcd_url
                             else {"master": {"listen": self.master_address}})
        client = MasterClient(None if self.etcd_url else self.master_address, config=config, request_timeout_s=1.0)
        try:
            self._wait(lambda: client.ping(timeout_s=0.5), timeout_s, "a master to answer")
        finally:
            client.close()
        return time.monotonic() - started

    def store_command(self, n: int) -> list[str]:
        data = self.work / f"store-{n}"
        nvme = self.tmpfs if (n == 0 and self.tmpfs is not None) else data / "nvme"
        return [sys.executable, "-m", "kvpool.cli.server", "--role", "node", *self.master_flags(),
                "--pool.name", f"soak-store-{n}", "--pool.data_dir", str(data),
                "--tiers.dram.capacity", "0", "--tiers.cxl.capacity", "0",
                "--tiers.nvme.capacity", self.args.store_nvme, "--tiers.nvme.segment_size", "2MiB",
                "--tiers.nvme.path", str(nvme),
                "--master.heartbeat_ms", str(self.args.heartbeat_ms), "--log-level", "INFO"]

    def start_store(self, n: int) -> ServerProcess:
        process = self.spawn(f"store-{n}", self.store_command(n))
        process.wait_ready(lambda: "ready" in process.output(1 << 16), 60)
        self.stores[n] = process
        return process

    def mount_tmpfs(self) -> None:
        path = self.work / "store-0-tmpfs"
        path.mkdir(parents=True, exist_ok=True)
        size = self.args.store_disk
        if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                                capture_output=True).returncode == 0:
            self.tmpfs = path
            self.note(f"store-0's nvme on a {size} tmpfs at {path}")
        else:
            self.note("no tmpfs for store-0 (needs root): the disk_full fault is skipped")

    def victim_command(self, n: int) -> list[str]:
        name = f"victim-{n}"
        cxl = self.args.cxl
        if self.victim_small.get(n):
            cxl = f"{max(1, _bytes(cxl) // 2 // 1024)}KiB"
        return worker_command(
            sys.executable, self.master_address or "tcp://127.0.0.1:1", name, self.work / name,
            seconds=max(1.0, self.seconds - self.now()), keys=self.args.keys, seed=self.args.seed + 1000 + n
            + 100 * self.victim_lives[n], seed_share=(n, self.args.victims), versions=self.args.versions,
            cxl=cxl, nvme=self.args.nvme, heartbeat_ms=self.args.heartbeat_ms, mix=self.args.victim_mix,
            etcd=self.etcd_url or None, etcd_prefix=self.prefix if self.etcd_url else None,
            think_ms=self.args.think_ms or None)

    def start_victim(self, n: int) -> ServerProcess:
        self.victim_lives[n] += 1
        process = self.spawn(f"victim-{n}.{self.victim_lives[n]}", self.victim_command(n))
        process.wait_ready(lambda: "READY" in process.output(), 120)
        self.victims[n] = process
        return process

    def start(self) -> list[ServerProcess]:
        """Everything; returns the checkers (started, waiting for nothing: they run at once)."""
        self.start_etcd()
        self.master_address = f"tcp://127.0.0.1:{free_port()}"
        self.start_master(self.master_address)
        if self.etcd_url:
            self.start_master(f"tcp://127.0.0.1:{free_port()}")
        self.wait_master(60)
        self.note(f"masters {sorted(self.masters)} ({'etcd ' + self.etcd_url if self.etcd_url else 'no etcd'})")
        if "disk_full" in self.faults:
            self.mount_tmpfs()
        for n in range(2):
            self.start_store(n)
        for n in range(self.args.victims):
            self.start_victim(n)
        self.start_ledger()
        for n, store in enumerate(self.stores):
            if store is not None:
                self.store_fds[n] = [_descriptors(store)]
        checkers = []
        for n in range(self.args.processes):
            name = f"checker-{n}"
            command = worker_command(
                sys.executable, self.master_address, name, self.work / name, seconds=self.seconds,
                keys=self.args.keys, seed=self.args.seed + n, versions=self.args.versions, cxl=self.args.cxl,
                nvme=self.args.nvme, heartbeat_ms=self.args.heartbeat_ms, mix=self.args.mix,
                etcd=self.etcd_url or None, etcd_prefix=self.prefix if self.etcd_url else None,
                think_ms=self.args.think_ms or None)
            checkers.append(self.spawn(name, command))
        for checker in checkers:
            checker.wait_ready(lambda c=checker: "READY" in c.output(), 120)
        self.started = time.monotonic()  # the checkers' clocks start about now
        return checkers

    def start_ledger(self) -> None:
        command = [sys.executable, "-m", "bench.soak_ledger", "--master", self.master_address,
                   "--data-dir", str(self.work / "ledger"), "--seconds", str(self.seconds),
                   "--heartbeat-ms", str(self.args.heartbeat_ms)]
        if self.etcd_url:
            command += ["--etcd", self.etcd_url, "--etcd-prefix", self.prefix]
        self.ledger = self.spawn("ledger", command)
        self.ledger.wait_ready(lambda: "READY" in self.ledger.output() if self.ledger else False, 120)

    # -- faults ----------------------------------------------------------------------------

    def fault(self, kind: str) -> None:
        started = time.monotonic()
        try:
            text = getattr(self, f"fault_{kind}")()
        except (PeerError, OSError, AssertionError, TimeoutError) as exc:
            text = f"FAILED to recover: {type(exc).__name__}: {str(exc)[:300]}"
            self.failures.append(f"{kind}: {text}")
        self.fault_counts[kind] += 1
        self.note(f"{kind}: {text} ({time.monotonic() - started:.1f} s)")

    def _victim(self) -> int:
        return self.rng.randrange(self.args.victims)

    def fault_kill9(self) -> str:
        n = self._victim()
        old = self.victims[n]
        old.kill()
        began = time.monotonic()
        self.start_victim(n)
        return f"victim-{n} killed (SIGKILL), restarted and ready in {time.monotonic() - began:.1f} s"

    def fault_sigstop(self) -> str:
        n = self._victim()
        process = self.victims[n]
        hold = self.args.stop_s
        process.popen.send_signal(signal.SIGSTOP)
        time.sleep(hold)
        process.popen.send_signal(signal.SIGCONT)
        return f"victim-{n} stopped (SIGSTOP) for {hold:g} s, then resumed"

    def fault_master(self) -> str:
        leader = self.leader()
        if leader is None or leader not in self.masters:
            return f"no leader known (etcd says {leader!r}): skipped"
        self.masters[leader].kill()
        began = time.monotonic()
        if self.etcd_url:
            self._wait(lambda: self.leader() not in (None, leader), 30, "a new leader")
            took = self.wait_master(30)
            self.start_master(leader)  # back, as the standby
            return (f"leader {leader} killed (SIGKILL); {self.leader()} leads, answering "
                    f"{time.monotonic() - began:.1f} s after (ping {took:.1f} s); the old one restarted as standby")
        time.sleep(1.0)
        self.start_master(leader)
        self.wait_master(60)
        return f"master killed (SIGKILL), restarted at its address, answering after {time.monotonic() - began:.1f} s"

    def fault_disk_full(self) -> str:
        if self.tmpfs is None:
            return "skipped (no tmpfs)"
        filler = self.tmpfs / "filler"
        fs = os.statvfs(self.tmpfs)
        free = fs.f_bavail * fs.f_frsize
        try:  # every step may meet a disk already full to the last byte: the fault is on then
            with open(filler, "wb") as fh:
                with contextlib.suppress(OSError):
                    os.posix_fallocate(fh.fileno(), 0, max(4096, free))
                block = b"\0" * (1 << 16)
                with contextlib.suppress(OSError):
                    while True:  # the last bytes too
                        fh.write(block)
                        fh.flush()
        except OSError:  # closing flushes what is left: no room for it
            pass
        left = os.statvfs(self.tmpfs).f_bavail * os.statvfs(self.tmpfs).f_frsize
        time.sleep(self.args.stop_s)
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()
        return f"store-0's tmpfs filled ({free} bytes, {left} left) for {self.args.stop_s:g} s, then freed"

    def fault_small_arena(self) -> str:
        n = self._victim()
        self.victims[n].stop()
        self.victim_small[n] = not self.victim_small.get(n, False)
        began = time.monotonic()
        self.start_victim(n)
        size = "half" if self.victim_small[n] else "full"
        return (f"victim-{n} stopped (SIGTERM), restarted with a {size}-size cxl arena in "
                f"{time.monotonic() - began:.1f} s")

    def _corrupt(self, n: int) -> str:
        process = self.stores[n]
        assert process is not None
        process.kill()
        nvme = self.tmpfs if (n == 0 and self.tmpfs is not None) else self.work / f"store-{n}" / "nvme"
        assert nvme is not None
        done: list[str] = []
        segments = sorted(nvme.glob("seg-*.kvs"))
        flips = 0
        for segment in segments:
            size = segment.stat().st_size
            if not size:
                continue
            with open(segment, "r+b") as fh:
                for _ in range(16):
                    at = self.rng.randrange(size)
                    fh.seek(at)
                    fh.write(bytes([self.rng.randrange(0x80, 0x100)]))
                    flips += 1
        done.append(f"{flips} bytes in {len(segments)} segment files")
        index = nvme / "index" / "data.mdb"
        if index.exists() and self.fault_counts["corrupt"] % 4 < 2:  # every other time on each node
            size = index.stat().st_size
            with open(index, "r+b") as fh:
                for _ in range(8):
                    fh.seek(self.rng.randrange(size))
                    fh.write(bytes([self.rng.randrange(256)]))
            done.append("8 bytes of index/data.mdb")
        with open(nvme / "durable.log", "ab") as fh:
            fh.write(b"\xc3\x28 not a line \xff\xfe\n" + os.urandom(64) + b"\n")
        done.append("garbage appended to durable.log")
        began = time.monotonic()
        self.start_store(n)
        return f"store-{n} killed (SIGKILL), {', '.join(done)}; restarted and ready in {time.monotonic() - began:.1f} s"

    def fault_corrupt(self) -> str:
        """:meth:`_corrupt`, and the storage node is started again whatever the corruption met
        (a disk full to the last byte refuses the garbage appended to durable.log)."""
        n = self.fault_counts["corrupt"] % 2
        try:
            return self._corrupt(n)
        except OSError as exc:
            if self.stores[n] is not None and not self.stores[n].alive():  # type: ignore[union-attr]
                self.start_store(n)
            return f"store-{n} killed (SIGKILL), corruption cut short ({exc.strerror}); restarted"

    def fault_freeze_leader(self) -> str:
        if not self.etcd_url:
            return "skipped (no etcd)"
        leader = self.leader()
        if leader is None or leader not in self.masters:
            return f"no leader known (etcd says {leader!r}): skipped"
        process = self.masters[leader]
        process.popen.send_signal(signal.SIGSTOP)
        began = time.monotonic()
        try:
            self._wait(lambda: self.leader() not in (None, leader), 30, "a new leader")
            took = self.wait_master(30)
        finally:
            process.popen.send_signal(signal.SIGCONT)
        return (f"leader {leader} frozen (SIGSTOP) past its lease; {self.leader()} leads, answering "
                f"{time.monotonic() - began:.1f} s after (ping {took:.1f} s); the old one resumed as standby")

    def fault_etcd(self) -> str:
        if self.etcd is None:
            return "skipped (no etcd)"
        self.etcd.kill()
        self.etcd.wait(10)
        time.sleep(self.args.stop_s)
        began = time.monotonic()
        self.run_etcd()
        took = self.wait_master(60)
        return (f"etcd killed (SIGKILL) for {self.args.stop_s:g} s, restarted; a master answers "
                f"{time.monotonic() - began:.1f} s after (ping {took:.1f} s)")

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> int:
        faults = self.faults
        checkers: list[ServerProcess] = []
        try:
            checkers = self.start()
            self.note(f"running {self.seconds:g} s: {self.args.processes} checkers, {self.args.victims} victims, "
                      f"2 storage nodes; a fault every {self.args.fault_every:g} s: {', '.join(faults)}")
            turn = 0
            next_fault = self.args.fault_every
            while self.now() < self.seconds - self.args.fault_every / 2:
                if self.now() >= next_fault:
                    self.fault(faults[turn % len(faults)])
                    turn += 1
                    next_fault = self.now() + self.args.fault_every
                dead = [c for c in checkers if not c.alive()]
                if dead:
                    # A fault that recovers slowly (etcd's took 10 s) can end after the checkers'
                    # own clocks ran out; a checker that finished its time and exit 0 is not early.
                    early = [c.name for c in dead
                             if c.popen.poll() != 0 or self.now() < self.seconds - CLOCK_SKEW_S]
                    if early:
                        self.failures.append(f"checkers exited early: {early}")
                    break
                time.sleep(0.2)
            deadline = time.monotonic() + max(0.0, self.seconds - self.now()) + 120
            if self.ledger is not None:
                self.ledger.popen.send_signal(signal.SIGTERM)  # stop putting; verify what is left
            for n, store in enumerate(self.stores):
                if store is not None and n in self.store_fds:
                    self.store_fds[n].append(_descriptors(store))
            for process in [*checkers, *self.victims.values()]:
                while process.alive() and time.monotonic() < deadline:
                    time.sleep(0.2)
                result = parse_result(process.output(tail_chars=1 << 22))
                if result is None:
                    self.failures.append(f"{process.name} reported nothing (exit {process.popen.poll()}):\n"
                                         f"{process.output()[-2000:]}")
                else:
                    self.results.append(result)
            if self.ledger is not None:
                while self.ledger.alive() and time.monotonic() < deadline + 60:
                    time.sleep(0.2)
                from bench.soak_ledger import parse_ledger

                self.ledger_result = parse_ledger(self.ledger.output(tail_chars=1 << 20))
                if self.ledger_result is None:
                    self.failures.append(f"the ledger reported nothing:\n{self.ledger.output()[-2000:]}")
        except PeerError as exc:
            self.failures.append(str(exc))
        finally:
            for process in reversed(self.processes):
                if process.alive():
                    process.popen.send_signal(signal.SIGCONT)
                process.stop()
            if self.etcd is not None:
                self.etcd.kill()
                self.etcd.wait(10)
            if self.tmpfs is not None:
                subprocess.run(["umount", "-l", str(self.tmpfs)], capture_output=True)
        return self.report()

    def report(self) -> int:
        wrong = sum(r["wrong"] for r in self.results)
        if self.results:
            text, total = table(self.results)
            print(text)
            errors: Counter[str] = Counter()
            for r in self.results:
                errors.update(r["errors"])
                for sample in r["wrong_samples"]:
                    print(f"WRONG {r['name']}: {sample}")
            checkers = [r for r in self.results if r["name"].startswith("checker")]
            latency = Latencies()
            for r in checkers:
                latency.merge(Latencies.from_json(r["get_latency"]))
            blocked: dict[str, tuple[float, str]] = {}  # op -> (longest in flight, which checker)
            for r in checkers:
                for op, seconds in r.get("longest_blocked_s", {}).items():
                    if seconds > blocked.get(op, (0.0, ""))[0]:
                        blocked[op] = (seconds, r["name"])
            print("\nerrors by type (op:error count, all processes):")
            for name, count in sorted(errors.items(), key=lambda item: -item[1]):
                print(f"  {name:45s} {count}")
            if not errors:
                print("  none")
            print(f"\nfaults applied: {dict(self.fault_counts)}")
            for line in self.fault_log:
                print(f"  {line}")
            print(f"\n{wrong} wrong values in {total['gets']} gets ({total['hits']} hits, {total['misses']} misses) "
                  f"over {self.seconds:g} s with {sum(self.fault_counts.values())} faults")
            print(f"worst get (checkers): {latency.max_s * 1e3:.1f} ms, p99 {latency.percentile(99) * 1e3:.1f} ms; "
                  f"all processes: {total['get_max_s'] * 1e3:.1f} ms (pull deadline {PULL_TIMEOUT_S:g} s)")
            gets = [blocked[op] for op in ("get", "get_many") if op in blocked]
            worst = max(gets) if gets else (0.0, "")
            print(f"longest any get was blocked (checkers, in flight or done): {worst[0]:.2f} s ({worst[1]})")
            print("longest blocked, by op (checkers): " + ", ".join(
                f"{op} {seconds:.2f} s" for op, (seconds, _) in sorted(blocked.items())))
        lost = 0
        ledger = self.ledger_result
        if ledger is not None:
            lost = ledger["lost"] + ledger["wrong"]
            print(f"\ndurable puts (ledger, 2 copies each): {ledger['acknowledged']} acknowledged, "
                  f"{ledger['verified']} read back exact, {ledger['lost']} lost, {ledger['wrong']} wrong; "
                  f"refused (typed): {ledger['refused'] or 'none'}; {ledger['clients']} short-lived clients"
                  + (f"; lost keys {ledger['lost_keys']}" if ledger["lost"] else ""))
        for n, fds in sorted(self.store_fds.items()):
            print(f"store-{n} descriptors: {' -> '.join(map(str, fds))} (start -> end)")
        for failure in self.failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        return 1 if (self.failures or not self.results or wrong or lost) else 0

    @staticmethod
    def _wait(condition: Callable[[], Any], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if condition():
                    return
            except Exception:  # not yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:g} s")
            time.sleep(0.05)


def _descriptors(process: ServerProcess) -> int:
    """Open descriptors of a running process (-1 if it cannot be read)."""
    try:
        return len(os.listdir(f"/proc/{process.popen.pid}/fd"))
    except OSError:
        return -1


def _bytes(text: str) -> int:
    from kvpool.config import parse_size

    return parse_size(text)


def run_fault_soak(args: argparse.Namespace) -> int:
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvpool-fault-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"fault soak for {args.duration:g} s (logs in {work})", file=sys.stderr, flush=True)
    status = FaultSoak(args, work).run()
    if status == 0 and not args.work_dir and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept in {work}", file=sys.stderr)
    return status
