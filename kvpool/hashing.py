"""Prefix hashing: chained xxh3-128 over fixed token chunks.

``h_0 = xxh3_128(seed || tokens[0:C])`` and
``h_i = xxh3_128(h_{i-1} || tokens[iC:(i+1)C])``, tokens encoded as
little-endian int32 (or int64). A hash therefore names a whole prefix, so the
longest cached prefix is the longest run of leading hashes that are cached.

The seed is ``xxh3_128("kvpool-prefix-v1" || token width || chunk_tokens ||
namespace)``: the namespace (model id, dtype, tensor-parallel rank, ...) keeps
two models from sharing entries, and the token width and chunk size are part of
a hash's identity, so changing either can never alias old entries.

Partial last chunk: by default (``partial="drop"``) a trailing chunk shorter
than ``chunk_tokens`` is left out, like vLLM's block hashing: its KV is not a
whole object and is recomputed. With ``partial="hash"`` it is hashed too, and
its token count is mixed in (``h = xxh3_128(h_prev || b"partial" || n ||
tokens)``) so a partial chunk can never collide with a full one.

This depends on nothing process-specific (no ``hash()``, no PYTHONHASHSEED).
"""

from __future__ import annotations

import array
import struct
import sys
from typing import Any, Literal

import numpy as np
import xxhash

from kvpool import errors

HASH_NBYTES = 16
_SEED_TAG = b"kvpool-prefix-v1"
_TOKEN_DTYPES = {"int32": "<i4", "int64": "<i8"}


def namespace_seed(namespace: str | bytes = b"", *, chunk_tokens: int = 256,
                   token_dtype: str = "int32") -> bytes:
    """The 16-byte seed that starts every chain for this namespace and chunking."""
    if isinstance(namespace, str):
        namespace = namespace.encode()
    width = np.dtype(_token_dtype(token_dtype)).itemsize
    return xxhash.xxh3_128_digest(_SEED_TAG + struct.pack("<BI", width, chunk_tokens) + namespace)


def _token_dtype(name: str) -> str:
    try:
        return _TOKEN_DTYPES[name]
    except KeyError:
        raise errors.ConfigError(f"token_dtype must be one of {sorted(_TOKEN_DTYPES)}, got {name!r}") from None


_ARRAY_CODES = {np.dtype("int32"): "i", np.dtype("int64"): "q"}


def _list_bytes(token_ids: list[Any], np_dtype: np.dtype[Any]) -> memoryview | None:
    """A list of Python ints as little-endian bytes of ``np_dtype``, the fast way (a long
    prompt is a list in an engine: ``array`` converts it in one C loop, where numpy first
    walks the list to find its shape and then converts); None where the list holds anything
    but ints (numpy's checks then apply)."""
    code = _ARRAY_CODES.get(np_dtype)
    if code is None or array.array(code).itemsize != np_dtype.itemsize:
        return None
    try:
        packed = array.array(code, token_ids)
    except OverflowError:
        raise ValueError(f"token ids do not fit {np_dtype.name}") from None
    except TypeError:  # floats, bools-as-objects, nested lists...: numpy decides
        return None
    if sys.byteorder != "little":
        packed.byteswap()
    return memoryview(packed).cast("B")


def prefix_hashes(
    token_ids: Any,
    chunk_tokens: int = 256,
    *,
    namespace: str | bytes = b"",
    token_dtype: str = "int32",
    partial: Literal["drop", "hash"] = "drop",
) -> list[bytes]:
    """16-byte chained hashes, one per chunk of ``chunk_tokens`` tokens.

    ``token_ids``: any 1-D sequence or array of integer token ids. Token ids
    that do not fit ``token_dtype`` raise ValueError rather than wrap.
    """
    if chunk_tokens <= 0:
        raise errors.ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if partial not in ("drop", "hash"):
        raise errors.ConfigError(f"partial must be 'drop' or 'hash', got {partial!r}")
    np_dtype = np.dtype(_token_dtype(token_dtype))
    data = _list_bytes(token_ids, np_dtype) if type(token_ids) is list else None
    count = len(token_ids) if data is not None else 0
    if data is None:
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise errors.InvalidKeyError(f"token_ids must be 1-D, got shape {tokens.shape}")
        if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
            raise errors.InvalidKeyError(f"token_ids must be integers, got {tokens.dtype}")
        info = np.iinfo(np_dtype)
        if tokens.size and (tokens.min() < info.min or tokens.max() > info.max):
            raise ValueError(f"token ids do not fit {token_dtype}")
        data = np.ascontiguousarray(tokens, dtype=np_dtype).data.cast("B")
        count = tokens.size
    chunk_nbytes = chunk_tokens * np_dtype.itemsize

    prev = namespace_seed(namespace, chunk_tokens=chunk_tokens, token_dtype=token_dtype)
    hashes: list[bytes] = []
    full = count // chunk_tokens
    for i in range(full):
        hasher = xxhash.xxh3_128(prev)
        hasher.update(data[i * chunk_nbytes:(i + 1) * chunk_nbytes])
        prev = hasher.digest()
        hashes.append(prev)
    tail = count - full * chunk_tokens
    if tail and partial == "hash":
        hasher = xxhash.xxh3_128(prev)
        hasher.update(b"partial" + struct.pack("<I", tail))
        hasher.update(data[full * chunk_nbytes:])
        hashes.append(hasher.digest())
    return hashes
