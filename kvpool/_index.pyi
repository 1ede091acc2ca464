"""Key indexes probed for a batch of keys in C (kvpool/_index.c): the master's and an arena
owner's shared one."""

from typing import Any

def find(k0: Any, k1: Any, nd: Any, lo: Any, hi: Any, out: Any, stop_at_miss: bool, /) -> int: ...
def find_shared(words: Any, arena: Any, digests: bytes, max_header: int, retries: int,
                /) -> list[tuple[int, bytes, int, int] | None]: ...
