"""The master's key index probed for a batch of keys in C (kvpool/_index.c)."""

from typing import Any

def find(k0: Any, k1: Any, nd: Any, lo: Any, hi: Any, out: Any, stop_at_miss: bool, /) -> int: ...
