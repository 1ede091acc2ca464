"""A socket polled for bytes with the GIL released (kvpool/_poll.c)."""

from collections.abc import Sequence
from typing import Any

def recv_poll(fd: int, buffers: Sequence[Any], timeout_ns: int, /) -> int: ...
