"""Two real SGLang engines (``sglang.launch_server``, CUDA) with kvpool as HiCache's L3 storage,
launched with the README's flags on one kvpool master and storage node (issue 43, item 1).

SGLang's engine runs only on CUDA (its CPU path needs sgl_kernel ops no wheel here has), so
this is marked ``gpu`` and skips unless SGLang, its kernels and a CUDA device are all there:
``pip install -e '.[sglang]'`` with SGLang's CUDA wheels, then ``pytest -m gpu
tests/integrations/test_sglang_engine.py``. What it holds kvpool to:

* engine A's prompt pages reach kvpool (SGLang's write-through backs them up to L3);
* engine A, its device and host caches flushed, answers the same prompt again from kvpool's
  pages, and engine B, which never saw the prompt, prefetches them from kvpool: both report
  the prompt's full pages as cached and answer exactly as A first did (greedy).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import server_groups, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1200)]

PAGE = 16  # tokens a page
PROMPT_TOKENS = 1024


def _missing() -> str:
    """Why SGLang's engine cannot run here ("" where it can)."""
    for module in ("sglang", "sgl_kernel", "torch"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (SGLang's engine needs one)"
    return ""


@pytest.fixture(scope="module")
def cuda_sglang() -> None:
    reason = _missing()
    if reason:
        pytest.skip(reason)


def post(port: int, path: str, body: dict[str, Any] | None = None, timeout_s: float = 300) -> dict[str, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        text = answer.read().decode()
    return json.loads(text) if text.startswith("{") else {"text": text}


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def sglang_servers(tmp_path: Path, model: Path, master: str, *names: str) -> Iterator[list[int]]:
    """SGLang servers on ``model`` with the README's HiCache flags and kvpool on ``master``; yields
    their ports once each answers /health; their process groups are killed on the way out."""
    extra = {"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
             "class_name": "KvpoolHiCacheStorage", "interface_v1": 1, "master": master}
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", "{port}", "--skip-tokenizer-init", "--page-size", str(PAGE),
            "--mem-fraction-static", "0.3", "--max-total-tokens", "65536", "--disable-cuda-graph",
            "--enable-hierarchical-cache", "--hicache-mem-layout", "page_first", "--hicache-size", "1",
            "--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", "wait_complete",
            "--enable-cache-report", "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]
    with server_groups(tmp_path, [(name, args, {}) for name in names], healthy, 600, interval_s=1.0,
                       grace_s=30.0) as ports:
        yield ports


def generate(port: int, prompt: list[int]) -> tuple[list[int], int]:
    """A greedy answer of 8 tokens to ``prompt``: (its token ids, the prompt tokens SGLang had cached)."""
    answer = post(port, "/generate", {"input_ids": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
    return list(answer["output_ids"]), int(answer["meta_info"].get("cached_tokens", 0))


def test_two_sglang_engines_share_prompt_pages_through_kvpool(cuda_sglang: None, cluster: Any,
                                                              tmp_path: Path) -> None:
    from tests.vllm_engine import make_model

    cluster.start_master()
    cluster.start_node("store-a")
    model = tmp_path / "model"
    make_model(str(model))
    prompt = [random.Random(43).randrange(3, 999) for _ in range(PROMPT_TOKENS)]
    full_pages = (PROMPT_TOKENS - 1) // PAGE  # SGLang computes at least the last token

    with sglang_servers(tmp_path, model, cluster.master_address, "engine-a", "engine-b") as (a, b):
        first, cached = generate(a, prompt)
        assert cached == 0
        # write-through backs the prompt's pages up to kvpool in the background
        wait_for(lambda: cluster.client.stats()["keys"] >= full_pages, 120, "A's pages in kvpool")

        post(a, "/flush_cache", timeout_s=60)  # A's device and host caches: now only kvpool has them
        again, cached = generate(a, prompt)
        assert cached >= full_pages * PAGE and again == first

        from_b, cached = generate(b, prompt)
        assert cached >= full_pages * PAGE and from_b == first
