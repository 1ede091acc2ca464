"""kvpool-server as operators run it: roles, flags, metrics/health, SIGTERM, restart, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool.config import Config
from tests.conftest import REPO_ROOT, ChildProcess, communicate_all, free_tcp_port, wait_for

pytestmark = pytest.mark.timeout(120)
SHAPE = (4, 2, 16, 4, 64)


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Daemon:
    def __init__(self, tmp_path: Path, spawn) -> None:
        self.tmp_path = tmp_path
        self.spawn = spawn
        self.master = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.metrics_port = free_tcp_port()
        self.starts = 0

    def start(self) -> ChildProcess:
        """A one-machine pool (role all): dram and cxl in front of nvme, as by default (a durable
        copy is then a memory copy backed by nvme), so what it holds on nvme survives restarts."""
        self.starts += 1
        log = self.tmp_path / f"daemon-{self.starts}.log"
        return self.spawn(
            ["-m", "kvpool.cli.server", "--pool.name", "daemon-test", "--pool.data_dir", str(self.tmp_path / "data"),
             "--tiers.dram.capacity", "8MiB", "--tiers.dram.mlock", "false", "--tiers.cxl.capacity", "8MiB",
             "--tiers.nvme.capacity", "32MiB",
             "--tiers.nvme.segment_size", "16MiB", "--master.listen", self.master, "--master.heartbeat_ms", "200",
             "--metrics.port", str(self.metrics_port)],
            log_path=log, ready=lambda: http_get(self.metrics_port, "/health")[0] == 200, timeout_s=40)

    def client(self) -> kvpool.Pool:
        config = Config.load({
            "pool": {"name": "daemon-client", "data_dir": str(self.tmp_path / "client")},
            "tiers": {"dram": {"capacity": "4MiB", "mlock": False}, "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
            "master": {"listen": self.master, "heartbeat_ms": 200},
        })
        return kvpool.connect(self.master, config=config)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvpool.cli", "--master", self.master, *args],
                              capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)


def content(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(SHAPE).astype(np.float16)


@pytest.mark.slow
def test_sigterm_flushes_and_a_restart_finds_durable_objects_again(tmp_path: Path, spawn_python) -> None:
    daemon = Daemon(tmp_path, spawn_python)
    first = daemon.start()
    health = json.loads(http_get(daemon.metrics_port, "/health")[1])
    assert health["role"] == "all" and health["ready"] is True

    writer = daemon.client()
    try:
        for i in range(3):
            writer.put(b"durable-%d" % i, content(i), durable=True, replicas=1)  # copy on the daemon's nvme
    finally:
        writer.close()

    status, metrics = http_get(daemon.metrics_port, "/metrics")
    assert status == 200
    assert 'kvpool_tier_objects{tier="nvme"} 3.0' in metrics
    assert "kvpool_master_nodes_alive" in metrics and "kvpool_misses_total" in metrics

    assert first.stop() == 0  # SIGTERM: clean exit
    log = first.output()
    assert "3 objects on disk will be found again" in log

    daemon.start()
    reader = daemon.client()
    try:
        keys = [b"durable-%d" % i for i in range(3)]
        wait_for(lambda: reader.lookup(keys) == 3, 10, "re-registered objects to be found")
        for i, key in enumerate(keys):
            np.testing.assert_array_equal(reader.get(key, layers=range(1, 3)), content(i)[1:3])
    finally:
        reader.close()

    listing = daemon.cli("ls", "--prefix", "durable-", "--text")
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.count("'durable-") == 3 and "/nvme" in listing.stdout
    stats = daemon.cli("stats")
    assert stats.returncode == 0, stats.stderr
    assert "alive" in stats.stdout and "nvme" in stats.stdout
    out = tmp_path / "one.npy"
    got = daemon.cli("get", "durable-1", "--text", "--layers", "0:2", "--out", str(out))
    assert got.returncode == 0, got.stderr
    np.testing.assert_array_equal(np.load(out), content(1)[0:2])
    removed = daemon.cli("rm", "--text", "durable-1", "nope")
    assert removed.returncode == 1 and "deleted 'durable-1'" in removed.stdout and "no such key" in removed.stderr
    missed = daemon.cli("get", "durable-1", "--text")
    assert missed.returncode == 1  # a miss: the documented status, and one line in words
    assert missed.stderr == "kvpool: 'durable-1': miss (not cached anywhere in the pool)\n", missed.stderr


@pytest.mark.parametrize("argv, nearest", [
    (["-m", "kvpool.cli.server", "--tiers.dram.capacty", "1GiB"], "--tiers.dram.capacity"),
    (["-m", "kvpool.cli.server", "--tiers.dram.capacty=1GiB"], "--tiers.dram.capacity"),
    (["-m", "kvpool.cli", "stats", "--mastr", "tcp://127.0.0.1:1"], "--master"),
])
def test_a_mistyped_flag_is_one_line_naming_the_nearest_setting(argv: list[str], nearest: str) -> None:
    result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"did you mean {nearest}?" in result.stderr, result.stderr
    assert result.stdout == ""


def test_print_defaults_is_a_toml_of_every_setting_that_loads_back_as_the_defaults(tmp_path: Path) -> None:
    """An installed package has no conf/default.toml: --help points at --print-defaults instead."""
    helped = subprocess.run([sys.executable, "-m", "kvpool.cli.server", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert "conf/" not in helped.stdout and "--print-defaults" in helped.stdout
    printed = subprocess.run([sys.executable, "-m", "kvpool.cli.server", "--print-defaults"], capture_output=True,
                             text=True, timeout=60, cwd=REPO_ROOT)
    assert printed.returncode == 0, printed.stderr
    (tmp_path / "defaults.toml").write_text(printed.stdout)
    from kvpool.config import iter_settings

    assert Config.load(tmp_path / "defaults.toml") == Config()
    for dotted, _field, _default in iter_settings():
        assert f"\n{dotted.rpartition('.')[2]} = " in printed.stdout


def test_bad_flag_value_is_a_clear_error() -> None:
    result = subprocess.run([sys.executable, "-m", "kvpool.cli.server", "--tiers.dram.capacity", "lots"],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert "tiers.dram.capacity" in result.stderr and "Traceback" not in result.stderr


def test_cli_reports_an_unreachable_master() -> None:
    result = subprocess.run([sys.executable, "-m", "kvpool.cli", "--master", f"tcp://127.0.0.1:{free_tcp_port()}",
                             "--timeout", "0.5", "stats"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 2 and "unreachable" in result.stderr


@pytest.mark.slow
def test_cli_options_work_before_or_after_the_command() -> None:
    port = free_tcp_port()
    for argv in (["--master", f"tcp://127.0.0.1:{port}", "--timeout", "0.5", "stats"],
                 ["stats", "--master", f"tcp://127.0.0.1:{port}", "--timeout", "0.5"],
                 ["--timeout", "0.5", "ls", "--master", f"tcp://127.0.0.1:{port}"]):
        result = subprocess.run([sys.executable, "-m", "kvpool.cli", *argv], capture_output=True, text=True,
                                timeout=60, cwd=REPO_ROOT)
        assert result.returncode == 2, (argv, result.stderr)
        assert f"tcp://127.0.0.1:{port} unreachable" in result.stderr and "within 0.5 s" in result.stderr, argv


def test_every_setting_has_a_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "kvpool.cli.server", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=REPO_ROOT)
    from kvpool.config import iter_settings

    for dotted, _field, _default in iter_settings():
        assert f"--{dotted}" in result.stdout


def test_cli_with_a_malformed_master_address_prints_one_line_and_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "--master", "127.0.0.1:7700", "stats"],
                          capture_output=True, text=True, timeout=30, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "tcp://" in lines[0] and "Traceback" not in done.stderr


CLIENT_WITH_DEFAULTS = """
import sys, time, pathlib, numpy as np, kvpool
pool = kvpool.connect(sys.argv[1])  # no settings at all, as the README's example
me, other, flags = int(sys.argv[2]), 3 - int(sys.argv[2]), pathlib.Path(sys.argv[3])
pool.put(b"defaults-%d" % me, np.full((2, 2, 16, 2, 32), me, np.float16))
deadline = time.monotonic() + 30
while (got := pool.get(b"defaults-%d" % other)) is None and time.monotonic() < deadline:
    time.sleep(0.1)
print(pool.config.pool.name, pool.config.tiers.nvme.capacity, None if got is None else float(got.flat[0]), flush=True)
(flags / f"read-{me}").touch()
while not (flags / f"read-{other}").exists() and time.monotonic() < deadline:  # the other still reads from me
    time.sleep(0.05)
pool.close()
"""


@pytest.mark.slow
def test_clients_with_default_settings_run_side_by_side_with_a_daemon(tmp_path: Path, spawn_python) -> None:
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    log = tmp_path / "daemon.log"
    spawn_python(["-m", "kvpool.cli.server", "--master.listen", master, "--pool.name", f"daemon-{tmp_path.name}",
                  "--pool.data_dir", str(tmp_path / "d"), "--tiers.dram.mlock", "false",
                  "--tiers.cxl.capacity", "16MiB", "--tiers.nvme.capacity", "16MiB"],
                 log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=60)
    clients = [subprocess.Popen([sys.executable, "-c", CLIENT_WITH_DEFAULTS, master, str(i), str(tmp_path)],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in (1, 2)]
    outs = communicate_all(clients, 120)
    for i, (client, (out, err)) in enumerate(zip(clients, outs), start=1):
        assert client.returncode == 0, err[-3000:]
        name, nvme, seen = out.split()
        assert name == f"client-{client.pid}" and nvme == "0"  # its own pool, never the daemon's
        assert float(seen) == 3 - i  # and it reads the other client's put


def readme_python_example(heading: str) -> str:
    """The first ``python`` block after ``heading`` in README.md, as written there."""
    text = (REPO_ROOT / "README.md").read_text()
    after = text[text.index(heading):]
    start = after.index("```python\n") + len("```python\n")
    return after[start:after.index("```", start)]


@pytest.mark.slow
def test_the_readme_embedded_example_runs_next_to_a_default_daemon(tmp_path: Path, spawn_python) -> None:
    """README's kvpool.Pool() example, verbatim, while a kvpool-server runs with the default pool
    name and paths (HOME moved to tmp_path; the daemon's tiers made small by flags). Its cxl arena's
    name hashes that data dir, so a real kvpool-server on this host is never in the way."""
    import os

    env = {"HOME": str(tmp_path)}
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    log = tmp_path / "daemon.log"
    spawn_python(["-m", "kvpool.cli.server", "--master.listen", master, "--tiers.dram.capacity", "8MiB",
                  "--tiers.dram.mlock", "false", "--tiers.cxl.capacity", "16MiB", "--tiers.nvme.capacity", "128MiB",
                  "--tiers.nvme.segment_size", "64MiB"],
                 log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=60, env=env)
    example = readme_python_example("## Use it from Python")
    assert "kvpool.Pool()" in example
    done = subprocess.run([sys.executable, "-c", example + "\nprint('pool', pool.config.pool.name)\npool.close()"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pool embedded" in done.stdout
    # the two pools' files do not meet: the daemon's nvme in <data_dir>/nvme, the example's beside it
    data = tmp_path / ".local" / "share" / "kvpool"
    assert (data / "nvme").is_dir() and (data / "nvme-embedded").is_dir()

    # The cluster example against that daemon (its address instead of the default port's).
    example = readme_python_example("## Cluster")
    assert 'kvpool.connect("tcp://127.0.0.1:7700")' in example and "durable=True" in example
    done = subprocess.run([sys.executable, "-c", example.replace("tcp://127.0.0.1:7700", master)
                           + "\nprint('read', float(buf.flat[0]))"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "read 1.0" in done.stdout


def test_a_tier_larger_than_the_host_can_map_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    # 512 TiB is beyond any x86-64 address space: refused whatever the overcommit policy.
    result = subprocess.run([sys.executable, "-m", "kvpool.cli.server", "--role", "node", "--tiers.dram.capacity",
                             "512TiB", "--pool.name", "too-big", "--pool.data_dir", str(tmp_path),
                             "--master.listen", f"tcp://127.0.0.1:{free_tcp_port()}"],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr
    assert "tiers.dram.capacity = 512.0 TiB: cannot map that much memory" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_cli_option_has_help() -> None:
    from kvpool.cli import tool
    from kvpool.cli.server import build_parser

    missing = []

    def walk(parser: Any, name: str) -> None:
        for action in parser._actions:
            if not action.help and action.dest != "help":
                missing.append(f"{name} {action.option_strings or action.dest}")
            if isinstance(getattr(action, "choices", None), dict):
                for command, subparser in action.choices.items():
                    walk(subparser, f"{name} {command}")

    walk(build_parser(), "kvpool-server")
    walk(tool.build_parser(), "kvpool")
    assert missing == []


@pytest.mark.parametrize(("text", "parsed"), [("5", 5), ("2:6", slice(2, 6)), ("2:", slice(2, None)),
                                              (":3", slice(None, 3))])
def test_cli_layer_specs(text: str, parsed: object) -> None:
    from kvpool.cli.tool import layer_arg

    assert layer_arg(text) == parsed


@pytest.mark.parametrize("text", ["a:b", "6:2", "1:2:3", "-1", ""])
def test_bad_cli_layer_specs_are_refused_before_anything_is_asked(text: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kvpool.cli", "get", "00", f"--layers={text}",
                             "--master", f"tcp://127.0.0.1:{free_tcp_port()}", "--timeout", "0.3"],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 2 and "--layers" in result.stderr and "Traceback" not in result.stderr
