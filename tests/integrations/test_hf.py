"""kvpool.integrations.hf: a transformers DynamicCache prefix saved to and restored from kvpool."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM)")

import kvpool  # noqa: E402
from kvpool.hashing import prefix_hashes  # noqa: E402
from kvpool.integrations.hf import load_prefix, save_prefix  # noqa: E402
from tests.pool_configs import small_config  # noqa: E402

CHUNK = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_restored_prefix_gives_bit_identical_logits(tmp_path: Path, model, dtype: str) -> None:
    model = model.to(getattr(torch, dtype))
    ids = torch.randint(1, 500, (1, 2 * CHUNK + 20), generator=torch.Generator().manual_seed(1))
    tokens = ids[0].tolist()
    with kvpool.Pool(small_config(tmp_path, ("dram",), dram=8 << 20)) as pool, torch.no_grad():
        cache = model(ids[:, :2 * CHUNK + 8], use_cache=True).past_key_values
        assert save_prefix(pool, cache, tokens, chunk_tokens=CHUNK, namespace=f"tiny/{dtype}") == 2
        cache.crop(2 * CHUNK)  # what was saved: the KV of the first two chunks
        reference = model(ids[:, 2 * CHUNK:], past_key_values=cache, use_cache=True).logits

        restored, cached = load_prefix(pool, tokens, chunk_tokens=CHUNK, namespace=f"tiny/{dtype}")
        assert cached == 2 * CHUNK
        logits = model(ids[:, cached:], past_key_values=restored, use_cache=True).logits
        assert torch.equal(logits, reference)  # bit for bit

        # Another model's namespace holds nothing; a prefix shorter than one chunk neither.
        assert load_prefix(pool, tokens, chunk_tokens=CHUNK, namespace="another-model")[1] == 0
        assert load_prefix(pool, tokens[:CHUNK], chunk_tokens=CHUNK, namespace=f"tiny/{dtype}")[1] == 0
        # A chunk gone from the pool ends the prefix there; what comes back is whole.
        pool.delete(prefix_hashes(tokens, CHUNK, namespace=f"tiny/{dtype}")[1])
        restored, cached = load_prefix(pool, tokens, chunk_tokens=CHUNK, namespace=f"tiny/{dtype}")
        assert cached == CHUNK and restored.get_seq_length() == CHUNK
        # Saving again stores only what is missing.
        assert save_prefix(pool, model(ids[:, :2 * CHUNK], use_cache=True).past_key_values, tokens,
                           chunk_tokens=CHUNK, namespace=f"tiny/{dtype}") == 2
        assert load_prefix(pool, tokens, chunk_tokens=CHUNK, namespace=f"tiny/{dtype}")[1] == 2 * CHUNK
