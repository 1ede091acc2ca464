"""Several emulated hosts on one machine: network namespaces on a private bridge.

:class:`Lab` makes ``hosts`` namespaces, each with one veth interface and its own
address on a /24 that exists only inside them, joined by a bridge that lives in a
namespace of its own (the machine's own network is not touched). Optionally each
host's link is shaped with ``tc ... tbf`` (rate only: this kernel has no netem).
Every process runs through ``ip netns exec`` and ``unshare --uts`` with its own
hostname, so kvpool sees different hosts (its host id is hostname + boot id) and
never takes the same-host paths between them.

Needs root and iproute2 (:func:`unavailable` says why not). Everything made is
removed by :meth:`Lab.close` (processes first, then namespaces). Used by
``tests/test_netns.py`` and ``bench/network_bench.py``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import Child  # noqa: E402


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _bits_per_s(rate: str) -> int:
    """``"10gbit"`` -> 10**10 (tc's decimal units: kbit, mbit, gbit)."""
    text = rate.strip().lower()
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: use e.g. 100mbit, 1gbit, 25gbit")


@dataclass(frozen=True)
class Host:
    name: str       # also its hostname
    netns: str
    address: str
    device: str     # its interface, inside netns


class Lab:
    def __init__(self, hosts: int, *, rate: str | None = None) -> None:
        tag = secrets.token_hex(3)
        self.switch = f"kvp{tag}-sw"
        # A random private /24 per lab: concurrent labs never share addresses.
        net = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
        self.hosts: list[Host] = []
        self.children: list[Child] = []
        self._made: list[str] = []
        try:
            self._add_netns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(hosts):
                host = Host(f"h{i + 1}-{tag}", f"kvp{tag}-h{i + 1}", f"{net}.{i + 1}", "eth0")
                self._add_netns(host.netns)
                outer = f"v{tag}h{i + 1}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                _ip("link", "set", outer, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", outer, "master", "br0", "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
                if rate:
                    # A bucket of 2 ms of traffic (at least 32 KiB): a larger one lets whole small
                    # transfers through at memory speed, a smaller one cannot reach the rate.
                    burst = max(32 << 10, _bits_per_s(rate) // 8 // 500)
                    subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", "eth0", "root",
                                    "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"],
                                   capture_output=True, text=True, timeout=20, check=True)
                self.hosts.append(host)
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def command(self, host: Host, args: Sequence[str]) -> list[str]:
        """``args`` run on ``host``: in its namespace, under its own hostname."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', host.name, *args]

    def spawn(self, host: Host, args: Sequence[str], log_path: Path, *, ready: Callable[[], Any] | None = None,
              timeout_s: float = 40.0) -> Child:
        """``python args`` on ``host``, output to ``log_path``; waits for ``ready()`` when given."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
        with log_path.open("wb") as log:
            popen = subprocess.Popen(self.command(host, [sys.executable, *args]), stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env)
        child = Child(popen, log_path)
        self.children.append(child)
        if ready is not None:
            def ready_or_dead() -> Any:
                if popen.poll() is not None:
                    raise AssertionError(f"exited with {popen.returncode}:\n{child.output()}")
                return ready()
            wait_for(ready_or_dead, timeout_s, f"{args[:3]} on {host.name}")
        return child

    def run(self, host: Host, args: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``args`` (any program) on ``host`` to completion."""
        return subprocess.run(self.command(host, args), capture_output=True, text=True, timeout=timeout_s,
                              cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})

    def listeners(self, host: Host) -> list[tuple[str, str]]:
        """(local address:port, process) of every TCP listener in ``host``'s namespace."""
        out = self.run(host, ["ss", "-Hltnp"]).stdout
        return [(line.split()[3], line.split()[-1]) for line in out.splitlines() if line.strip()]

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()


def unavailable() -> str | None:
    """Why a lab cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "ss"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    return None
