"""kvpool: a tiered, distributed KV-cache pool for LLM inference."""

from __future__ import annotations

from typing import Any

from kvpool import errors
from kvpool.config import Config
from kvpool.hashing import prefix_hashes
from kvpool.objformat import LayerRange, ObjectSpec

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:  # lazy: importing kvpool must not start tiers or UCX
    if name == "Pool":
        from kvpool.pool import Pool

        return Pool
    if name == "PoolAPI":  # what Pool and kvpool.connect()'s pool both are (for type hints)
        from kvpool.api import PoolAPI

        return PoolAPI
    if name == "connect":
        from kvpool.client import connect

        return connect
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")


__all__ = ["Config", "LayerRange", "ObjectSpec", "Pool", "PoolAPI", "connect", "errors", "prefix_hashes"]
