"""A real vLLM (CPU) engine on a tiny local Llama: used by tests/integrations/test_vllm.py and bench/vllm_bench.py.

    python -m tests.vllm_engine make-model DIR
    python -m tests.vllm_engine run DIR PROMPTS.json OUT.json [--connector none|kvpool|example|offloading|lmcache]
                                [--master ADDR] [--config TOML] [--durable] [--store DIR] [--max-tokens N]
                                [--lmcache-port P]
    python -m tests.vllm_engine save-blocks MASTER OUT.npy KEY_HEX...

``run`` generates greedily for every prompt (a JSON list of token-id lists), one
request at a time or all at once (``--batch``), and writes ``{"outputs": [{"tokens",
"cached", "ttft_s"}], "namespace", "startup_s", "total_s"}``. There is no model
hub here: ``make-model`` builds a 4-layer Llama (2 KV heads of 64) with random
weights (std 0.15, so greedy output depends on the prompt) and saves it. ``save-blocks``
is the worker half of an engine with the connector's default settings (only ``master``), in
a process of its own: it saves one block of random KV per key, writes their bytes to OUT.npy
([blocks, layers, kv_heads, block, 2 * head_dim] bfloat16 as uint16) once they are stored,
and keeps its pool open until SIGTERM. ``--connector lmcache`` (vLLM's ``LMCacheMPConnector`` to
an ``lmcache server`` at ``--lmcache-port``) runs in a venv with LMCache (.venv-lmcache).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
# One compute thread on core 0 in every configuration: vLLM-CPU binds its threads to 1 core
# without a connector and to 2 with any connector (its own ExampleConnector too) on this
# 2-core machine, and a sum split over threads rounds differently, which flips near-tied
# greedy tokens of this random model. Same threads, same arithmetic, so outputs must match.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
BLOCK_SIZE = 128  # vLLM's CPU attention block size


def make_model(path: str, layers: int = 4, hidden: int = 256, kv_heads: int = 2) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=kv_heads, head_dim=64,
                         max_position_embeddings=16384)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.to(torch.bfloat16).save_pretrained(path)


def make_gemma3(path: str, layers: int = 4, hidden: int = 256, kv_heads: int = 2, sliding_window: int = 128) -> None:
    """A tiny Gemma-3-style model: sliding-window layers (``sliding_window`` tokens) with a
    full-attention layer every second one, random weights, saved as ``make_model`` saves."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=kv_heads,
                              head_dim=64, max_position_embeddings=4096, sliding_window=sliding_window,
                              tie_word_embeddings=False,  # tied, greedy output repeats the last token
                              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(layers)])
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.to(torch.bfloat16).save_pretrained(path)


def run(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict = {}
    if args.connector == "kvpool":
        extra = {"master": args.master, "transport": args.transport, "plan": not args.no_plan}
        if args.load != "default":
            extra["load_async"] = args.load == "async"
        if args.durable:  # else the --config TOML's node.durable decides (kvpool.client.durable_copies)
            extra["durable"] = True
        if args.config:
            extra["config"] = args.config
        if args.whole_blocks:  # loads end on block boundaries and no tails are saved (answers bit for bit)
            extra["partial_blocks"] = False
        if args.layers_per_pull:
            extra["layers_per_pull"] = args.layers_per_pull
        if args.cpus:
            extra["cpus"] = args.cpus if args.cpus in ("auto", "inherit") else [int(c) for c in args.cpus.split(",")]
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.integrations.vllm",
            kv_role=args.kv_role, kv_connector_extra_config=extra)
    elif args.connector == "example":  # vLLM's own reference connector: safetensors files on disk
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": args.store})
    elif args.connector == "lmcache":  # an LMCache server's (lmcache server ... --supported-transfer-mode auto)
        kwargs["kv_transfer_config"] = KVTransferConfig(  # (as tests/lmcache_engine.py; needs LMCache installed)
            kv_connector="LMCacheMPConnector", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": args.lmcache_host, "lmcache.mp.port": args.lmcache_port})
    elif args.connector == "offloading":  # vLLM's native CPU offloading (its own process's CPU memory)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30})
    with open(args.prompts) as fh:
        prompts = json.load(fh)
    started = time.perf_counter()
    # A whole prompt prefills in one step (no chunks): vLLM's ExampleConnector stores only the
    # chunk of a step under the request's hash, and an 8k prompt in 4k chunks fails its load.
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=args.max_model_len, block_size=BLOCK_SIZE, seed=0,
              max_num_batched_tokens=max(args.max_model_len, 2048), **kwargs)
    startup_s = time.perf_counter() - started
    namespace = None
    if args.connector == "kvpool":
        from kvpool.integrations.vllm import namespace_of

        namespace = namespace_of(llm.llm_engine.vllm_config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=args.logprobs or None)
    outputs = []
    started = time.perf_counter()
    batches = [prompts] if args.batch else [[p] for p in prompts]
    for batch in batches:
        t = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        took = time.perf_counter() - t
        for result in results:
            metrics = getattr(result, "metrics", None)
            ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
            outputs.append({"tokens": list(result.outputs[0].token_ids), "cached": result.num_cached_tokens,
                            "ttft_s": ttft if ttft else took})
            if args.logprobs:  # the first token's top logprobs: {token: logprob}
                first = (result.outputs[0].logprobs or [{}])[0]
                outputs[-1]["logprobs"] = {str(t): lp.logprob for t, lp in first.items()}
    total_s = time.perf_counter() - started
    with open(args.out, "w") as fh:
        json.dump({"outputs": outputs, "namespace": namespace, "startup_s": startup_s, "total_s": total_s}, fh)


def save_blocks(args: argparse.Namespace) -> None:
    import signal
    import threading

    import numpy as np
    import torch

    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings, Transfer, open_pool

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    settings = Settings.from_extra({"master": args.master})  # the defaults: no "config"
    keys = [bytes.fromhex(k) for k in args.keys]
    caches = {f"layer.{i}": torch.zeros(len(keys) + 1, args.kv_heads, BLOCK_SIZE, 2 * args.head_dim,
                                        dtype=torch.bfloat16) for i in range(args.layers)}
    connector = worker_connector(settings, open_pool(settings), caches, args.kv_heads)
    try:
        rng = torch.Generator().manual_seed(args.seed)
        for cache in caches.values():
            cache.copy_(torch.randn(cache.shape, generator=rng).to(torch.bfloat16))
        block_ids = list(range(1, len(keys) + 1))  # (block 0 is vLLM's null block)
        connector.bind_connector_metadata(KvpoolConnectorMetadata(saves=[Transfer("w", keys, block_ids)],
                                                                  num_tokens=len(keys) * BLOCK_SIZE))
        for name in caches:
            connector.save_kv_layer(name)
        connector.wait_for_save()
        connector.wait_saved(60)
        assert connector.stats["blocks_saved"] == len(keys), connector.stats
        saved = torch.stack([torch.stack([cache[b] for cache in caches.values()]) for b in block_ids])
        np.save(args.out + ".tmp.npy", saved.view(torch.int16).numpy().view(np.uint16))
        os.replace(args.out + ".tmp.npy", args.out)  # (whole, once every block is stored)
        stop.wait()
    finally:
        connector.shutdown()  # closes the pool: its arena goes with it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-model", help="build and save the tiny Llama")
    make.add_argument("path")
    make.add_argument("--layers", type=int, default=4)
    make.add_argument("--hidden", type=int, default=256, help="hidden size (64 per attention head)")
    make.add_argument("--kv-heads", type=int, default=2)
    make.add_argument("--kind", choices=["llama", "gemma3"], default="llama",
                      help="gemma3: sliding-window (128 tokens) and full-attention layers in turn")
    go = sub.add_parser("run", help="generate for every prompt")
    go.add_argument("model")
    go.add_argument("prompts", help="JSON list of token-id lists")
    go.add_argument("out", help="where the JSON result goes")
    go.add_argument("--connector", choices=["none", "kvpool", "example", "offloading", "lmcache"], default="none")
    go.add_argument("--master", default="tcp://127.0.0.1:7700", help="kvpool master")
    go.add_argument("--config", default="", help="kvpool TOML for the engine's own pool")
    go.add_argument("--durable", action="store_true", help="kvpool: keep copies on storage nodes")
    go.add_argument("--transport", choices=["auto", "tcp"], default="auto", help="kvpool: how pulls travel")
    go.add_argument("--load", choices=["default", "async", "sync"], default="default",
                    help="kvpool: requests wait for their blocks outside the model's steps (async) or "
                         "the model waits in its step, layer by layer (sync, the connector's default)")
    go.add_argument("--kv-role", choices=["kv_both", "kv_producer", "kv_consumer"], default="kv_both",
                    help="kvpool: vLLM's kv_role (a producer saves, a consumer loads)")
    go.add_argument("--no-plan", action="store_true", help="kvpool: load every held block (no load-or-recompute plan)")
    go.add_argument("--whole-blocks", action="store_true", help="kvpool: partial_blocks false")
    go.add_argument("--layers-per-pull", type=int, default=0, help="kvpool: layers per pull (0: auto)")
    go.add_argument("--cpus", default="", help="kvpool: where the worker's kvpool threads run (auto, inherit, 0,1,...)")
    go.add_argument("--store", default="/tmp/kvpool-example-connector", help="ExampleConnector's directory")
    go.add_argument("--lmcache-port", type=int, default=0, help="lmcache: the LMCache server's port")
    go.add_argument("--lmcache-host", default="tcp://localhost", help="lmcache: the LMCache server's host")
    go.add_argument("--max-tokens", type=int, default=8)
    go.add_argument("--logprobs", type=int, default=0, help="record the first token's top N logprobs")
    go.add_argument("--max-model-len", type=int, default=4096)
    go.add_argument("--batch", action="store_true", help="all prompts in one generate call")
    keep = sub.add_parser("save-blocks", help="a worker with the default connector settings saves blocks, "
                                              "then keeps them until SIGTERM")
    keep.add_argument("master")
    keep.add_argument("out", help="where the saved blocks' bytes go (.npy)")
    keep.add_argument("keys", nargs="+", help="one key (hex) per block")
    keep.add_argument("--layers", type=int, default=4)
    keep.add_argument("--kv-heads", type=int, default=2)
    keep.add_argument("--head-dim", type=int, default=16)
    keep.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "save-blocks":
        save_blocks(args)
    elif args.command == "make-model":
        if args.kind == "gemma3":
            make_gemma3(args.path, args.layers, args.hidden, args.kv_heads)
        else:
            make_model(args.path, args.layers, args.hidden, args.kv_heads)
    else:
        run(args)


def worker_connector(settings: Any, pool: Any, caches: dict[str, Any], kv_heads: int, block_size: int = BLOCK_SIZE,
                     kv_cache_config: Any = None, kv_role: str = "kv_both", parallel_config: Any = None,
                     tp_rank: int = 0, pp_rank: int = 0):
    """The worker half of the connector (KvpoolWorker) without an engine (tests, bench/vllm_bench.py's load
    rows): its kvpool client ``pool`` and paged ``caches`` ({layer name: tensor}, shaped as
    vLLM-CPU's [blocks, kv_heads, block, 2 * head_dim]); ``kv_cache_config``: vLLM's
    ``KVCacheConfig`` naming each layer's KV cache group (None: one group); ``kv_role``: vLLM's;
    ``parallel_config``: vLLM's ParallelConfig (None: one rank), of which this worker is
    rank ``tp_rank`` / ``pp_rank``."""
    from vllm.config import KVTransferConfig

    from kvpool.integrations.vllm import KvpoolWorker, rank_tag, worker_cpus

    config = KVTransferConfig(kv_connector="KvpoolConnector", kv_role=kv_role)
    connector = KvpoolWorker(settings, pool, block_size=block_size, kv_heads=kv_heads,
                             loads=bool(config.is_kv_consumer), saves=bool(config.is_kv_producer),
                             cpus=worker_cpus(settings.cpus), tag=rank_tag(parallel_config, tp_rank, pp_rank),
                             kv_cache_config=kv_cache_config)
    connector.register_kv_caches(caches)
    return connector


if __name__ == "__main__":  # vLLM on CPU spawns its engine processes: this guard is required
    sys.exit(main())
