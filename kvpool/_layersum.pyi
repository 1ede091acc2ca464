"""Per-layer xxh3-64 checksums in C, optionally computed while copying (kvpool/_layersum.c)."""

from typing import Any

VARIANT: str  # "avx2" or "portable": what this CPU computes with
MIN_STEP: int  # the shortest layer computed here (shorter ones: xxhash in Python)

def layer_digests(data: Any, step: int, /) -> tuple[int, ...]: ...
def copy_layer_digests(dst: Any, src: Any, step: int, /) -> tuple[int, ...]: ...
def use_variant(name: str, /) -> str: ...
