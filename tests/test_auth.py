"""Authenticated by default: a process without the cluster key is refused everything.

A default-config ``kvpool-server`` (master + storage node) runs with key file A; a victim
client with key A puts objects; attackers in separate processes (key B, no key at all, and
another Unix user) try every operation. Each is refused with AuthenticationError well within
its request timeout, and afterwards the victim's objects are intact and bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool import errors
from kvpool.cluster.node.server import NodeAddress
from kvpool.cluster.wire.master_client import MasterClient
from kvpool.cluster.wire.security import ClusterKey, keygen
from kvpool.config import Config
from tests.conftest import REPO_ROOT, as_nobody, free_tcp_port, nobody_python, wait_for
from tests.test_daemon import http_get

pytestmark = pytest.mark.timeout(240)

SHAPE = (4, 2, 16, 4, 64)
TIMEOUT_S = 2.0
ATTACKS = ["ping", "stats", "ls", "exists", "lookup", "locate", "register+publish", "publish", "reserve",
           "heartbeat", "delete", "control stats", "control replicate", "get"]


def content(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal(SHAPE).astype(np.float16)


class Secured:
    """The victim's cluster: key files A and B, a kvpool-server with A, a victim client with A."""

    def __init__(self, root: Path, spawn) -> None:
        self.root = root
        self.key_a, self.key_b = keygen(root / "a.key"), keygen(root / "b.key")
        self.master = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.metrics_port = free_tcp_port()
        self.pool_name = f"auth-{os.getpid()}-{free_tcp_port()}"
        self.data_dir = root / "server-data"
        self.server = spawn(
            ["-m", "kvpool.cli.server", "--pool.name", self.pool_name, "--pool.data_dir", str(self.data_dir),
             "--tiers.dram.capacity", "0", "--tiers.cxl.capacity", "8MiB", "--tiers.nvme.capacity", "32MiB",
             "--tiers.nvme.segment_size", "16MiB", "--master.listen", self.master, "--master.heartbeat_ms", "200",
             "--metrics.port", str(self.metrics_port), "--security.key_file", str(self.key_a)],
            log_path=root / "server.log", ready=lambda: http_get(self.metrics_port, "/health")[0] == 200,
            timeout_s=60)
        self.victim = kvpool.connect(self.master, config=self.config(self.key_a, "victim"))
        self.keys = [b"victim-%d" % i for i in range(4)]
        for i, key in enumerate(self.keys):
            self.victim.put(key, content(i), durable=i % 2 == 0, replicas=1)  # some on the server's nvme
        self.admin = MasterClient(self.master, config=self.config(self.key_a, "admin"), request_timeout_s=5)
        wait_for(lambda: all(self.admin.exists_many(self.keys)), 10, "victim keys indexed")

    def config(self, key_file: Path | None, name: str, **security: Any) -> dict[str, Any]:
        return {
            "pool": {"name": f"{self.pool_name}-{name}", "data_dir": str(self.root / name)},
            "tiers": {"dram": {"capacity": "4MiB", "mlock": False}, "cxl": {"capacity": 0},
                      "nvme": {"capacity": 0}},
            "master": {"listen": self.master, "heartbeat_ms": 200},
            "security": {"key_file": str(key_file) if key_file else "", **security},
        }

    def control(self) -> str:
        nodes = self.admin.stats()["nodes"]
        return next(NodeAddress.decode(n["address"]).control for n in nodes.values()
                    if n["alive"] and n["role"] == "storage")

    def assert_intact(self) -> None:
        """Every victim object is there, bit-exact, and the master serves the victim as before."""
        for i, key in enumerate(self.keys):
            got = self.victim.get(key)
            assert got is not None, key
            assert got.tobytes() == content(i).tobytes(), key
        assert self.admin.exists_many(self.keys) == [True] * len(self.keys)
        listed = {item["key"] for item in self.admin.list_keys(b"victim-", 100)[0]}
        assert listed == set(self.keys)
        assert "attacker-node" not in self.admin.stats()["nodes"]
        self.victim.put(b"victim-after", content(99))
        assert self.victim.get(b"victim-after").tobytes() == content(99).tobytes()

    def close(self) -> None:
        self.admin.close()
        self.victim.close()


@pytest.fixture
def secured(tmp_path: Path, spawn_python) -> Iterator[Secured]:
    cluster = Secured(tmp_path, spawn_python)
    try:
        yield cluster
    finally:
        cluster.close()


def attack(spec: dict[str, Any], *, python: str = sys.executable, env: dict[str, str] | None = None,
           preexec_fn: Any = None) -> dict[str, dict[str, Any]]:
    """Run tests/auth_attacker.py in a process of its own; its outcome per operation."""
    proc = subprocess.run([python, str(REPO_ROOT / "tests" / "auth_attacker.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env,
                          preexec_fn=preexec_fn)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            results[item["op"]] = item
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return results


def assert_all_refused(results: dict[str, dict[str, Any]], ops: list[str] = ATTACKS) -> None:
    for op in ops:
        assert op in results, (op, results)
        outcome = results[op]
        assert outcome["error"] == "AuthenticationError", outcome
        assert outcome["elapsed_s"] < TIMEOUT_S + 1.0, outcome  # refused, not a hang
        assert "\n" not in outcome["message"] and "authentication failed" in outcome["message"], outcome


@pytest.mark.slow
def test_another_key_is_refused_everything_and_the_victim_is_intact(secured: Secured) -> None:
    spec = {"master": secured.master, "control": secured.control(), "keys": [k.hex() for k in secured.keys],
            "config": secured.config(secured.key_b, "attacker-b"), "timeout_s": TIMEOUT_S}
    results = attack(spec)
    assert results["load key"]["ok"], results["load key"]
    assert_all_refused(results)
    # Refused fast: a wrong key never completes the handshake, seen at once (not at the timeout).
    assert results["stats"]["elapsed_s"] < TIMEOUT_S / 2, results["stats"]
    secured.assert_intact()


@pytest.mark.slow
def test_no_key_is_refused_everything(secured: Secured) -> None:
    spec = {"master": secured.master, "control": secured.control(), "keys": [k.hex() for k in secured.keys],
            "config": secured.config(None, "attacker-nokey", auth=False), "timeout_s": TIMEOUT_S}
    assert_all_refused(attack(spec))
    secured.assert_intact()


@pytest.mark.slow
def test_the_cli_refuses_in_one_line_and_the_server_logs_its_key_file(secured: Secured) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvpool.cli", "--master", secured.master, "--timeout",
                               str(TIMEOUT_S), *args], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)

    key_hex = secured.keys[0].hex()
    for command in (["ls"], ["stats"], ["rm", key_hex], ["get", key_hex, "--out", str(secured.root / "x.npy")]):
        done = cli("--key-file", str(secured.key_b), *command)
        assert done.returncode == 3, (command, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "authentication failed" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    ok = cli("--key-file", str(secured.key_a), "ls", "--text", "--prefix", "victim-")
    assert ok.returncode == 0 and "victim-0" in ok.stdout, ok.stderr
    log = (secured.root / "server.log").read_text()
    assert f"authenticating with cluster key file {secured.key_a}" in log
    assert secured.key_a.read_text().strip() not in log  # the path, never the key
    secured.assert_intact()


def test_keygen_writes_0600_and_refuses_to_overwrite(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True,
                              timeout=60, cwd=REPO_ROOT)

    path = tmp_path / "new" / "cluster.key"
    assert cli("keygen", str(path)).returncode == 0
    assert path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    again = cli("keygen", str(path))
    assert again.returncode != 0 and "--force" in again.stderr and path.read_text() == first
    assert cli("keygen", "--force", str(path)).returncode == 0
    assert path.read_text() != first and path.stat().st_mode & 0o777 == 0o600
    assert ClusterKey.from_config(Config.load({"security": {"key_file": str(path)}})).enabled


def test_a_master_client_with_another_key_gets_authentication_error_not_unreachable(secured: Secured) -> None:
    config = Config.load(secured.config(secured.key_b, "in-process"))
    with MasterClient(secured.master, config=config, request_timeout_s=TIMEOUT_S) as client:
        with pytest.raises(errors.AuthenticationError):
            client.stats()
    with MasterClient(f"tcp://127.0.0.1:{free_tcp_port()}", config=config, request_timeout_s=0.3) as client:
        with pytest.raises(errors.MasterUnreachableError):  # nobody listening is not an auth failure
            client.ping()


# -- another Unix user ---------------------------------------------------------------------------


@pytest.mark.slow
def test_another_unix_user_cannot_read_the_key_or_the_tiers(secured: Secured) -> None:
    python, env = nobody_python()
    from tiers.cxl import default_arena_path

    arena = default_arena_path(secured.pool_name, secured.data_dir)  # in /dev/shm/kvpool-<uid>/, a 0700 directory
    segments = sorted(p for p in secured.data_dir.rglob("*") if p.is_file() and "nvme" in p.parent.name)
    assert arena.exists() and segments, (arena, list(secured.data_dir.rglob("*")))
    for path in [secured.key_a, arena, *segments]:
        assert path.stat().st_mode & 0o077 == 0, path  # 0600: nobody but the owner
    shared = Path(tempfile.mkdtemp(prefix="kvpool-auth-nobody-"))
    try:
        os.chmod(shared, 0o777)
        env = {**env, "XDG_CONFIG_HOME": str(shared / "config")}  # nobody gets a key of its own there
        files = [str(secured.key_a), str(arena), str(segments[0])]
        # 1. The files themselves: the key, the cxl arena, an nvme segment.
        results = attack({"files": files, "master": ""}, python=python, env=env, preexec_fn=as_nobody)
        for path in files:
            assert results[f"open {path}"]["error"] == "PermissionError", results[f"open {path}"]
        # 2. With security.key_file = A: the key cannot be loaded (one line, no traceback).
        config = secured.config(secured.key_a, "nobody")
        config["pool"]["data_dir"] = str(shared / "data")
        results = attack({"master": secured.master, "control": secured.control(), "keys": [secured.keys[0].hex()],
                          "config": config, "timeout_s": TIMEOUT_S}, python=python, env=env, preexec_fn=as_nobody)
        assert results["load key"]["error"] == "ConfigError", results["load key"]
        assert "Permission denied" in results["load key"]["message"]
        # 3. With its own (default) key: every operation refused.
        config["security"]["key_file"] = ""
        results = attack({"master": secured.master, "control": secured.control(), "keys": [secured.keys[0].hex()],
                          "config": config, "timeout_s": TIMEOUT_S}, python=python, env=env, preexec_fn=as_nobody)
        assert results["load key"]["ok"], results["load key"]
        assert_all_refused(results)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    secured.assert_intact()
