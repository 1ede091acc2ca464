"""Save and restore a transformers ``DynamicCache`` prefix in kvpool, chunk by chunk.

::

    from kvpool.integrations.hf import load_prefix, save_prefix

    cache, cached = load_prefix(pool, ids, namespace="my-model/bf16")  # the longest prefix kvpool holds
    out = model(torch.tensor([ids[cached:]]), past_key_values=cache, use_cache=True)
    save_prefix(pool, out.past_key_values, ids, namespace="my-model/bf16")  # every full chunk, for next time

Each full chunk of ``chunk_tokens`` tokens is one kvpool object, ``[layers, 2, tokens,
kv_heads, head_dim]``, under the chunk's prefix hash (:func:`kvpool.hashing.prefix_hashes`).
The namespace must name the model (weights and dtype): equal token ids under another model
are another KV. Restoring is exact: the tensors come back bit for bit, so the logits a model
computes from a restored cache equal those from the cache that was saved. Batch size 1;
attention layers of one shape (no sliding-window or hybrid caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvpool import errors
from kvpool.hashing import prefix_hashes


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise errors.InvalidKVError(f"{type(cache).__name__} is not a transformers DynamicCache")
    pairs = [(layer.keys, layer.values) for layer in layers]
    for keys, values in pairs:
        if keys is None or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape != values.shape:
            raise errors.ShapeError("save_prefix needs a batch-1 cache of [1, kv_heads, tokens, head_dim] layers")
    return pairs


def save_prefix(pool: Any, cache: Any, token_ids: Sequence[int], *, chunk_tokens: int = 256,
                namespace: str = "") -> int:
    """Store every full chunk of ``cache`` (the KV of ``token_ids``) not stored yet; returns the
    number of chunks the pool holds for ``token_ids`` afterwards."""
    pairs = _layers(cache)
    length = pairs[0][0].shape[2]
    keys = prefix_hashes(list(token_ids)[:length], chunk_tokens, namespace=namespace)
    held = pool.lookup(keys)
    items = []
    for i in range(held, len(keys)):
        lo, hi = i * chunk_tokens, (i + 1) * chunk_tokens
        # [layers, 2, kv_heads, tokens, head_dim] -> kvpool's [layers, 2, tokens, kv_heads, head_dim]
        chunk = torch.stack([torch.stack([k[0, :, lo:hi], v[0, :, lo:hi]]) for k, v in pairs])
        items.append((keys[i], chunk.permute(0, 1, 3, 2, 4).contiguous().cpu()))
    if items:
        pool.put_many(items)
    return len(keys)


def load_prefix(pool: Any, token_ids: Sequence[int], *, chunk_tokens: int = 256, namespace: str = "",
                device: str | torch.device = "cpu", leave: int = 1) -> tuple[Any, int]:
    """(a DynamicCache of the longest prefix of ``token_ids`` kvpool holds, its length in tokens).

    At most all but ``leave`` tokens are restored (a model needs at least one token to compute
    the next one's logits). A chunk that turns out missing or damaged when read ends the prefix
    there: what is returned is always whole. ``(empty cache, 0)`` on a miss."""
    from transformers import DynamicCache

    ids = list(token_ids)
    usable = max(len(ids) - leave, 0) // chunk_tokens
    keys = prefix_hashes(ids[:usable * chunk_tokens], chunk_tokens, namespace=namespace)
    count = pool.lookup(keys)
    arrays = []
    for array in pool.get_many(keys[:count]) if count else []:
        if array is None:  # evicted or corrupt since the lookup: the prefix ends here
            break
        arrays.append(array)
    cache = DynamicCache()
    if not arrays:
        return cache, 0
    tensors = [_to_torch(a) for a in arrays]
    whole = torch.cat(tensors, dim=2).to(device)  # [layers, 2, tokens, kv_heads, head_dim]
    for layer in range(whole.shape[0]):
        keys_, values = (whole[layer, j].permute(1, 0, 2).unsqueeze(0).contiguous() for j in (0, 1))
        cache.update(keys_, values, layer)
    return cache, len(arrays) * chunk_tokens


def _to_torch(array: np.ndarray) -> torch.Tensor:
    """bfloat16 arrives as ml_dtypes' bfloat16 or as its raw 16-bit storage (uint16)."""
    array = np.ascontiguousarray(array)
    if str(array.dtype) == "bfloat16" or array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
