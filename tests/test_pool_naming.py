"""Which pool a process opens: one rule for settings that name no pool, whatever their form
(none, a TOML file, a mapping, a Config), and shared-memory names that never collide for two
pools with different data directories. Real processes, real arenas."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from kvpool import errors
from kvpool.config import Config, settings_for
from tests.conftest import REPO_ROOT, communicate_all, free_tcp_port

pytestmark = pytest.mark.timeout(120)

SMALL = {"dram": {"capacity": "4MiB", "mlock": False}, "cxl": {"capacity": "4MiB"}}


def write_toml(path: Path, data_dir: Path, *, name: str | None = None) -> Path:
    """A client's TOML that sets tiers and a data_dir (and maybe a pool name)."""
    lines = ["[pool]", f'data_dir = "{data_dir}"']
    if name is not None:
        lines.append(f'name = "{name}"')
    lines += ["[tiers.dram]", 'capacity = "4MiB"', "mlock = false", "[tiers.cxl]", 'capacity = "4MiB"']
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("form", ["none", "toml", "mapping", "config"])
def test_a_client_naming_no_pool_gets_its_own_whatever_form_its_settings_take(tmp_path: Path, form: str) -> None:
    toml = write_toml(tmp_path / "client.toml", tmp_path / "d")
    source = {"none": None, "toml": str(toml), "mapping": {"pool": {"data_dir": str(tmp_path / "d")}, "tiers": SMALL},
              "config": Config.load(toml)}[form]
    first, second = settings_for(source, process="client"), settings_for(source, process="client")
    assert first.pool.name.startswith("client-") and first.pool.name != second.pool.name
    assert first.tiers.nvme.capacity == 0  # no nvme tier unless asked for
    if isinstance(source, Config):
        assert source.pool.name == "default"  # a Config given is copied, never changed
    embedded = settings_for(source, process="embedded")
    assert embedded.pool.name == "embedded" and embedded.tiers.nvme.capacity == Config().tiers.nvme.capacity
    assert settings_for(source, process="server").pool.name == "default"  # a daemon keeps pool "default"


def test_settings_that_name_the_pool_or_nvme_keep_them(tmp_path: Path) -> None:
    toml = write_toml(tmp_path / "named.toml", tmp_path / "d", name="mine")
    for source in (str(toml), {"pool": {"name": "mine"}}, Config.load(toml)):
        assert settings_for(source, process="client").pool.name == "mine"
        assert settings_for(source, process="embedded").pool.name == "mine"
    given = settings_for({"tiers": {"nvme": {"capacity": "64MiB"}}}, process="client")
    assert given.tiers.nvme.capacity == 64 << 20
    built = Config()
    built.pool.name = "built-in-code"  # a Config changed in code counts as given too
    assert settings_for(built, process="client").pool.name == "built-in-code"


CLIENT = """
import sys, time, pathlib, numpy as np, kvpool
master, me, toml, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3], pathlib.Path(sys.argv[4])
pool = kvpool.connect(master, config=toml)  # a TOML with tiers and data_dir, no pool.name
other = 3 - me
pool.put(b"toml-%d" % me, np.full((2, 2, 16, 2, 32), me, np.float16))
deadline = time.monotonic() + 30
while (got := pool.get(b"toml-%d" % other)) is None and time.monotonic() < deadline:
    time.sleep(0.05)
print(pool.config.pool.name, pool.stats()["tiers"]["cxl"]["path"], None if got is None else float(got.flat[0]),
      flush=True)
(flags / f"read-{me}").touch()
while not (flags / f"read-{other}").exists() and time.monotonic() < deadline:  # the other still reads from me
    time.sleep(0.05)
pool.close()
"""


@pytest.mark.slow
def test_two_clients_with_one_toml_and_no_pool_name_run_side_by_side(tmp_path: Path, spawn_python) -> None:
    """The issue's case: the second such client used to fail with PoolLockedError."""
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    log = tmp_path / "daemon.log"
    spawn_python(["-m", "kvpool.cli.server", "--master.listen", master, "--pool.name", f"daemon-{tmp_path.name}",
                  "--pool.data_dir", str(tmp_path / "daemon"), "--tiers.dram.capacity", "4MiB",
                  "--tiers.cxl.capacity", "4MiB", "--tiers.nvme.capacity", "16MiB",
                  "--tiers.nvme.segment_size", "16MiB"],
                 log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=60)
    toml = write_toml(tmp_path / "client.toml", tmp_path / "clients")
    clients = [subprocess.Popen([sys.executable, "-c", CLIENT, master, str(i), str(toml), str(tmp_path)],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in (1, 2)]
    outs = communicate_all(clients, 90)
    arenas = set()
    for i, (client, (out, err)) in enumerate(zip(clients, outs), start=1):
        assert client.returncode == 0, err[-3000:]
        name, arena, seen = out.split()
        assert name == f"client-{client.pid}"
        assert float(seen) == 3 - i  # and each reads the other's put
        arenas.add(arena)
    assert len(arenas) == 2
    # The daemon's log names the ports it really serves pulls on (it said "127.0.0.1:0").
    served = re.search(r"serving pulls on 127\.0\.0\.1 \(TCP port (\d+), UCX by worker address\)", log.read_text())
    assert served and int(served.group(1)) > 0, log.read_text()[-2000:]
    assert "127.0.0.1:0)" not in log.read_text() and "127.0.0.1:0 " not in log.read_text()


POOL = """
import sys, numpy as np, kvpool
pool = kvpool.Pool({"pool": {"name": "same", "data_dir": sys.argv[1]},
                    "tiers": {"dram": {"capacity": "4MiB", "mlock": False}, "cxl": {"capacity": "4MiB"},
                              "nvme": {"capacity": "8MiB", "segment_size": "8MiB"}}})
pool.put(b"k", np.full((1, 2, 4, 1, 8), float(sys.argv[2]), np.float32))
print(pool.stats()["tiers"]["cxl"]["path"], flush=True)
sys.stdin.readline()  # both pools stay open until the test has seen both
print(float(pool.get(b"k").flat[0]), flush=True)
pool.close()
"""


def test_two_pools_of_one_name_with_different_data_dirs_never_share_memory(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", POOL, str(tmp_path / f"d{i}"), str(i)], cwd=REPO_ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (1, 2)]
    try:
        assert all(p.stdout is not None and p.stdin is not None for p in procs)
        paths = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
        assert all(paths), [p.stderr.read() for p in procs]  # type: ignore[union-attr]
        assert paths[0] != paths[1] and all(Path(p).exists() for p in paths)
        for p in procs:
            p.stdin.write("\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        outs = communicate_all(procs, 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [float(out.strip()) for out, _ in outs] == [1.0, 2.0], [err for _, err in outs]


def test_one_pool_opened_twice_is_still_locked(tmp_path: Path) -> None:
    settings = {"pool": {"name": "twice", "data_dir": str(tmp_path)}, "tiers": {**SMALL, "nvme": {"capacity": 0}}}
    with kvpool.Pool(settings):
        with pytest.raises(errors.PoolLockedError):
            kvpool.Pool(settings)
