from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvpool import errors, prefix_hashes

TOKENS = list(range(1000, 1000 + 4 * 64 + 10))


def test_hashes_are_16_bytes_one_per_full_chunk() -> None:
    hashes = prefix_hashes(TOKENS, chunk_tokens=64)
    assert len(hashes) == 4
    assert all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
    assert len(set(hashes)) == 4


def test_deterministic_across_processes_regardless_of_hash_seed() -> None:
    script = ("from kvpool import prefix_hashes; "
              "print(','.join(h.hex() for h in prefix_hashes(list(range(1000, 1266)), 64, namespace='m')))")
    outs = {
        subprocess.run([sys.executable, "-c", script], env={"PYTHONHASHSEED": seed}, capture_output=True,
                       text=True, check=True).stdout.strip()
        for seed in ("0", "12345")
    }
    assert outs == {",".join(h.hex() for h in prefix_hashes(TOKENS, 64, namespace="m"))}


@pytest.mark.parametrize("chunk", [0, 1, 3])
def test_changing_a_token_in_chunk_i_changes_hashes_from_i_on(chunk: int) -> None:
    base = prefix_hashes(TOKENS, 64)
    changed = list(TOKENS)
    changed[chunk * 64 + 5] += 1
    new = prefix_hashes(changed, 64)
    assert new[:chunk] == base[:chunk]
    assert all(a != b for a, b in zip(new[chunk:], base[chunk:]))


def test_namespace_token_width_and_chunk_size_change_every_hash() -> None:
    base = prefix_hashes(TOKENS, 64)
    for other in (prefix_hashes(TOKENS, 64, namespace="llama-3-8b/tp0"),
                  prefix_hashes(TOKENS, 64, token_dtype="int64")):
        assert all(a != b for a, b in zip(base, other))
    assert prefix_hashes(TOKENS, 32)[1] != base[0]


def test_partial_last_chunk_is_dropped_by_default_or_hashed_distinctly() -> None:
    dropped = prefix_hashes(TOKENS, 64)
    hashed = prefix_hashes(TOKENS, 64, partial="hash")
    assert hashed[:4] == dropped and len(hashed) == 5
    # the tail's length is part of its hash: one more token (even a 0) changes it
    longer = prefix_hashes(TOKENS + [0], 64, partial="hash")
    assert longer[:4] == dropped and longer[4] != hashed[4]


def test_numpy_tokens_equal_list_tokens_and_bad_input_is_typed() -> None:
    assert prefix_hashes(np.array(TOKENS, dtype=np.int64), 64) == prefix_hashes(TOKENS, 64)
    with pytest.raises(errors.InvalidKeyError):
        prefix_hashes(np.zeros((2, 64), dtype=np.int32), 64)
    with pytest.raises(ValueError):
        prefix_hashes([2**40], 1)
    with pytest.raises(errors.ConfigError):
        prefix_hashes(TOKENS, 0)


def test_a_list_of_ints_hashes_as_the_same_tokens_in_an_array() -> None:
    """Engines hand prompts over as lists: those take a faster conversion, same hashes, same errors."""
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 2**31 - 1, 1000)]
    for kwargs in ({}, {"namespace": "m"}, {"token_dtype": "int64"}, {"partial": "hash"}):
        assert prefix_hashes(tokens, 128, **kwargs) == prefix_hashes(np.array(tokens), 128, **kwargs)
    with pytest.raises(ValueError, match="do not fit"):
        prefix_hashes([1, 2**31], 1)
    with pytest.raises(errors.InvalidKeyError):
        prefix_hashes([1.5, 2.0], 1)
    assert prefix_hashes([], 4) == []
