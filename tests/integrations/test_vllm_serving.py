"""vLLM served the way users serve it: two OpenAI servers (vLLM-CPU, one core each) with the
README's one-line connector config on one ``kvpool-server``, streamed ``/v1/completions``,
requests at once, and kvpool's P/D proxy in front (``kvpool.integrations.vllm_proxy``).

What it holds kvpool to (issue 41): a response means its prompt's blocks are findable — a
request sent the moment another engine's answer ended loads the whole earlier prompt, its
full blocks and the tail of the block it ended inside (vLLM's own count,
``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``), and through the proxy the
decode engine loads every token the prefill engine computed but the last; what
an engine answers from loaded blocks is what the engine that computed them answered.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.cluster.wire.master_client import MasterClient
from tests.conftest import REPO_ROOT, free_tcp_port, server_groups, wait_for
from tests.test_daemon import http_get

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM-CPU's block size


@contextlib.contextmanager
def api_servers(tmp_path: Path, model: Path,
                *engines: tuple[str, int, dict[str, Any] | None, str],
                groups: dict[str, int] | None = None) -> Iterator[list[int]]:
    """vLLM's OpenAI servers on ``model``, one per ``(name, cpu, extra_config, kv_role)``: its
    compute on CPU ``cpu``, kvpool's connector configured by ``extra_config`` (None: no
    connector) in ``kv_role``. All start at once; yields their ports once each /health
    answers (``groups``, if given, gets each one's process group). Their whole process groups
    are killed on the way out."""
    servers = []
    for name, cpu, extra_config, kv_role in engines:
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", "{port}",
                "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "bfloat16",
                "--max-model-len", "4096", "--max-num-seqs", "8", "--disable-uvicorn-access-log"]
        if extra_config is not None:
            args += ["--kv-transfer-config", json.dumps(
                {"kv_connector": "KvpoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
                 "kv_role": kv_role, "kv_connector_extra_config": extra_config})]
        servers.append((name, args, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu)}))

    def healthy(port: int) -> bool:
        try:
            return http_get(port, "/health")[0] == 200
        except OSError:
            return False

    with server_groups(tmp_path, servers, healthy, 400, groups=groups) as ports:
        yield ports


def stream(port: int, model: Path, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], float]:
    """One streamed completion of ``prompt`` (token ids), greedy: (its tokens, seconds to the first)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    started = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
             "return_token_ids": True, "ignore_eos": True}), {"Content-Type": "application/json"})
        answer = conn.getresponse()
        assert answer.status == 200, answer.read()[:2000]
        tokens: list[int] = []
        first = 0.0
        for line in answer:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and not first:
                    first = time.perf_counter() - started
                tokens += ids
        return tokens, first
    finally:
        conn.close()


def external_tokens(port: int) -> int:
    """The prompt tokens this engine loaded through its connector so far (vLLM's own counter)."""
    status, body = http_get(port, "/metrics")
    assert status == 200
    found = re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$',
                       body, re.M)
    return int(sum(float(v) for v in found))


#: the fault tests' engines load whole blocks only ("partial_blocks": false), so an answer from
#: loaded blocks is the recompute's bit for bit: B loads the 3 full blocks of a 3-block +
#: 20-token prompt A answered
WHOLE_BLOCKS = 3 * BLOCK


def at_once(*calls: Any) -> list[Any]:
    """Run the calls on threads, all at once; their results in order (a failure is raised)."""
    results: list[Any] = [None] * len(calls)
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if failures:
        raise failures[0]
    return results


def a_then_b(a: int, b: int, model: Path, text: list[int]) -> tuple[int, float]:
    """``text`` on engine A, then on engine B: B's answer must be A's, loaded or recomputed
    (engines with ``"partial_blocks": false``); (the prompt tokens B loaded, B's seconds)."""
    before = external_tokens(b)
    answer_a, _ = stream(a, model, text)
    started = time.monotonic()
    answer_b, _ = stream(b, model, text)
    took = time.monotonic() - started
    assert answer_b == answer_a
    return external_tokens(b) - before, took


def test_served_engines_find_every_block_an_answer_came_from_and_the_pd_proxy_loads_them_all(
        tmp_path: Path, spawn_python) -> None:
    model = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "tests.vllm_engine", "make-model", str(model)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    metrics = free_tcp_port()
    spawn_python(["-m", "kvpool.cli.server", "--pool.name", "serving-test", "--pool.data_dir", str(tmp_path / "data"),
                  "--master.listen", master, "--metrics.port", str(metrics)],
                 ready=lambda: http_get(metrics, "/health")[0] == 200, timeout_s=60)
    # The README's one line, and "plan": false: this tiny model recomputes a block faster than
    # anything loads it, which the planner (rightly) would choose once it measured both.
    readme_config = {"master": master, "plan": False}
    rng = random.Random(41)

    def prompt(blocks: int, extra: int = 20) -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(blocks * BLOCK + extra)]

    # A as the README sets it up (kv_both); B a kv_consumer (the decode side of a P/D split),
    # which loads and never saves: every block B loads is one A computed.
    with api_servers(tmp_path, model, ("engine-a", 0, readme_config, "kv_both"),
                     ("engine-b", 1, readme_config, "kv_consumer")) as (a, b):
        # 1. One request on A, then the same prompt on B the moment A's answer ended: B loads
        #    every token A computed but the last (the full blocks and A's tail of the prompt).
        #    (B then computes from inside a block, whose rounding differs from A's prefill: this
        #    random-weight model's nearly flat greedy answers may differ; the fault tests below
        #    compare answers with whole-block loads, test_vllm.py the bytes of a tail.)
        first = prompt(3)
        stream(a, model, first)
        stream(b, model, first)
        assert external_tokens(b) == len(first) - 1

        # 2. Several conversations at once, each next turn sent to the other engine as soon as
        #    the previous answer ended: the whole previous prompt is loaded (blocks and tail).
        before = external_tokens(b)
        turns = [prompt(2 + u) for u in range(3)]

        def conversation(turn0: list[int]) -> int:
            answer, _ = stream(a, model, turn0)
            stream(b, model, turn0 + answer + [rng.randrange(1, 1000) for _ in range(60)])
            return len(turn0)

        expected = sum(at_once(*[lambda t=t: conversation(t) for t in turns]))
        loaded = external_tokens(b) - before
        assert loaded >= 0.99 * expected, (loaded, expected)

        # 3. Through the P/D proxy: prefill on A, decode on B, two requests at a time. B loads
        #    every token of each prompt that A computed but the last.
        proxy = free_tcp_port()
        spawn_python(["-m", "kvpool.integrations.vllm_proxy", "--port", str(proxy), "--prefill",
                      f"http://127.0.0.1:{a}", "--decode", f"http://127.0.0.1:{b}"],
                     ready=lambda: http_get(proxy, "/health")[0] == 200, timeout_s=60)
        before = external_tokens(b)
        prompts = [prompt(4, 30) for _ in range(4)]
        answers = []
        for pair in (prompts[:2], prompts[2:]):
            answers += at_once(*[lambda p=p: stream(proxy, model, p) for p in pair])
        loaded = external_tokens(b) - before
        assert loaded >= 0.99 * sum(len(p) - 1 for p in prompts), loaded
        assert all(len(tokens) == 8 for tokens, _ in answers)
        assert external_tokens(a) == 0  # (every prompt was new to A)
        # A stored each full block once and each prompt's tail; B, the consumer, stored nothing:
        # one node holds them all.
        with MasterClient(master, request_timeout_s=10) as client:
            stats = client.stats()
        stored = 3 + 1 + sum(2 + u + 1 for u in range(3)) + 4 * (4 + 1)
        held = sorted(node["objects"] for node in stats["nodes"].values() if node["objects"])
        assert (stats["keys"], held) == (stored, [stored])

        # 4. A long answer: its full blocks are saved as A generates them ("save_answers"), so
        #    the next turn on B loads the previous prompt and the previous answer, every full
        #    block of them, and computes only the rest.
        turn0 = prompt(2)
        answer, _ = stream(a, model, turn0, max_tokens=2 * BLOCK)
        before = external_tokens(b)
        stream(b, model, turn0 + answer + [rng.randrange(1, 1000) for _ in range(40)])
        whole = (len(turn0) + len(answer) - 1) // BLOCK * BLOCK  # (A never computes its last token)
        assert external_tokens(b) - before == whole
        with MasterClient(master, request_timeout_s=10) as client:
            assert client.stats()["keys"] == stored + whole // BLOCK + 1  # (and turn0's tail)

        for name in ("engine-a", "engine-b"):  # kvpool said nothing went wrong
            assert not re.search(r"(ERROR|WARNING).*kvpool", (tmp_path / f"{name}.log").read_text())


def test_an_engine_killed_mid_run_leaves_its_blocks_to_the_kvpool_server_on_its_host(
        tmp_path: Path, spawn_python) -> None:
    """The README's set-up: engine A's blocks live in its own shared-memory arena. ``kill -9`` of
    A's whole process tree (no shutdown, no hand-off); once the master declares A's worker dead,
    it has the kvpool-server on the host rescue them from the arena A left. B then loads every
    full block of A's prompts in place, and answers as A did; each block's bytes were checked
    against the header checksum the master indexed."""
    model = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "tests.vllm_engine", "make-model", str(model)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    metrics = free_tcp_port()
    spawn_python(["-m", "kvpool.cli.server", "--pool.name", "serving-rescue", "--pool.data_dir",
                  str(tmp_path / "data"), "--master.listen", master, "--metrics.port", str(metrics)],
                 ready=lambda: http_get(metrics, "/health")[0] == 200, timeout_s=60)
    settings = {"master": master, "plan": False, "partial_blocks": False}  # answers compared bit for bit
    rng = random.Random(43)
    prompts = [[rng.randrange(1, 1000) for _ in range(3 * BLOCK + 20)] for _ in range(2)]
    groups: dict[str, int] = {}
    with api_servers(tmp_path, model, ("engine-a", 0, settings, "kv_both"), ("engine-b", 1, settings, "kv_both"),
                     groups=groups) as (a, b):
        answers = [stream(a, model, p)[0] for p in prompts]
        os.killpg(groups["engine-a"], signal.SIGKILL)
        with MasterClient(master, request_timeout_s=10) as client:
            wait_for(lambda: client.stats()["counters"]["rescues_done"] >= 1, 60, "the rescue of A's arena",
                     interval_s=0.5)
            assert client.stats()["counters"]["rescued_objects"] == 2 * 3  # every full block A saved
        before = external_tokens(b)
        assert [stream(b, model, p)[0] for p in prompts] == answers
        assert external_tokens(b) - before == 2 * WHOLE_BLOCKS
        assert "in place from a same-host arena" in (tmp_path / "engine-b.log").read_text()


def test_served_engines_answer_through_a_kvpool_server_killed_and_restarted_and_hits_come_back(
        tmp_path: Path, spawn_python) -> None:
    """kill -9 of the kvpool-server (the master, and the storage node of the engines' durable
    copies) while two served engines take requests, then its restart on the same port and
    data directory: every request answers, each answer on B equals A's for the same prompt
    (loaded or recomputed), none waits much past load_timeout_s, and once the server is
    back B loads A's blocks again."""
    model = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "tests.vllm_engine", "make-model", str(model)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    master = f"tcp://127.0.0.1:{free_tcp_port()}"
    metrics = free_tcp_port()

    def kvpool_server() -> Any:
        return spawn_python(["-m", "kvpool.cli.server", "--pool.name", "serving-faults", "--pool.data_dir",
                             str(tmp_path / "data"), "--master.listen", master, "--metrics.port", str(metrics),
                             "--tiers.nvme.capacity", "256MiB"],
                            ready=lambda: http_get(metrics, "/health")[0] == 200, timeout_s=60)

    server = kvpool_server()
    settings = {"master": master, "plan": False, "durable": True, "load_timeout_s": 5, "partial_blocks": False}
    rng = random.Random(6)

    def prompt() -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(3 * BLOCK + 20)]

    with api_servers(tmp_path, model, ("engine-a", 0, settings, "kv_both"),
                     ("engine-b", 1, settings, "kv_both")) as (a, b):
        def round_trip(text: list[int]) -> tuple[int, float]:
            return a_then_b(a, b, model, text)

        assert round_trip(prompt())[0] == WHOLE_BLOCKS  # healthy: B loads every full block A computed

        server.kill()  # kill -9: the master and the storage node at once
        during = [round_trip(prompt()) for _ in range(3)]
        assert all(took < 5 + 20 for _, took in during), during  # load_timeout_s, plus compute here

        server = kvpool_server()  # same port, same data directory
        deadline = time.monotonic() + 60
        while True:  # the engines' nodes register again with their heartbeats; then hits return
            loaded, _ = round_trip(prompt())
            if loaded == WHOLE_BLOCKS:
                break
            assert time.monotonic() < deadline, "B never loaded A's blocks again after the restart"
            time.sleep(1)


def test_served_engines_answer_through_an_etcd_master_failover_and_hits_come_back(
        tmp_path: Path, spawn_python, etcd) -> None:
    """Two masters on etcd; the leader is killed -9 while two served engines take requests:
    every request answers, B's answer equals A's for each prompt (loaded or recomputed), none
    waits much past load_timeout_s, and under the new leader B loads A's blocks again."""
    from tests.test_ha import HA

    model = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "tests.vllm_engine", "make-model", str(model)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    ha = HA(tmp_path, spawn_python, etcd)
    ha.start_master()
    ha.start_master()
    leader = ha.leader()
    # The engines follow the leader in etcd (the TOML's [master] etcd; no "master" address, which
    # would not follow it). Their blocks stay in their own pools (kvpool's default tiers).
    settings = {"config": str(ha.write_config()), "plan": False, "load_timeout_s": 5, "partial_blocks": False}
    rng = random.Random(9)

    def prompt() -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(3 * BLOCK + 20)]

    with api_servers(tmp_path, model, ("engine-a", 0, settings, "kv_both"),
                     ("engine-b", 1, settings, "kv_both")) as (a, b):
        def round_trip(text: list[int]) -> tuple[int, float]:
            return a_then_b(a, b, model, text)

        assert round_trip(prompt())[0] == WHOLE_BLOCKS
        ha.masters[leader].kill()  # kill -9 of the leading master
        during = [round_trip(prompt()) for _ in range(3)]
        assert all(took < 5 + 20 for _, took in during), during
        ha.leader(other_than=leader)
        deadline = time.monotonic() + 60
        while round_trip(prompt())[0] != WHOLE_BLOCKS:  # the new leader knows A's blocks again
            assert time.monotonic() < deadline, "B never loaded A's blocks again under the new leader"
            time.sleep(1)
