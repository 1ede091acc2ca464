"""What a provider hands the pull server: :class:`ServeSource`, and the rules for providers
run inline on the progress thread. Also the per-pull state the server keeps (:class:`ServeJob`).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.objformat import LayerRange
from kvpool.transport.engine import (
    Timer,
)
from kvpool.transport.frames import (
    Request,
)


class ProviderWouldBlock(Exception):
    """Raised by a provider called inline on the progress thread that would have to wait
    (e.g. for a lock): the server calls it again on a worker thread."""


class _Inline(threading.local):
    active = False  # each thread's default: not inline (no AttributeError raised and caught per call)


INLINE = _Inline()


def in_inline_provider() -> bool:
    """Whether the calling provider runs inline on a progress thread (must not block)."""
    return INLINE.active


@dataclass(slots=True)
class ServeSource:
    """What a provider hands the server for one pull.

    Exactly one of:

    * ``buffers``: memoryviews whose concatenation is the payload, sent in
      place (memory tiers). They must stay valid until ``release`` is called.
    * ``read_into(offset, out)``: fills ``out`` with payload bytes
      ``[offset, offset + len(out))`` (nvme); the server calls it from a
      worker thread with a reusable page-aligned staging buffer. It may
      return the number of bytes read; a short read fails the pull.

    ``release`` (optional) runs exactly once, after the last byte was sent or
    the pull failed: the node unpins the object there. It runs on a worker
    thread, or on the progress thread itself when ``release_nonblocking`` says
    it never waits (no lock it could block on, no I/O): one hand-off less.

    ``header``: the served object's packed header, sent with the OK status
    to clients that ask for it (at most :data:`MAX_HEADER_NBYTES`).
    """

    nbytes: int
    buffers: Sequence[memoryview] = ()
    read_into: Callable[[int, memoryview], int | None] | None = None
    release: Callable[[], None] | None = None
    header: bytes = b""
    release_nonblocking: bool = False

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {self.nbytes}")
        if self.read_into is None:
            buffers = self.buffers
            if len(buffers) == 1 and type(buffers[0]) is memoryview and buffers[0].format == "B" \
                    and buffers[0].ndim == 1 and buffers[0].c_contiguous:  # a memory tier's view: cheaply
                if buffers[0].nbytes != self.nbytes:
                    raise ValueError(f"buffers hold {buffers[0].nbytes} bytes, nbytes says {self.nbytes}")
                return
            views = []
            for buf in self.buffers:
                view = memoryview(buf)
                if not view.c_contiguous:
                    raise ValueError("ServeSource buffers must be C-contiguous")
                views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
            total = sum(v.nbytes for v in views)
            if total != self.nbytes:
                raise ValueError(f"buffers hold {total} bytes, nbytes says {self.nbytes}")
            self.buffers = views
        elif self.buffers:
            raise ValueError("give either buffers or read_into, not both")


Provider = Callable[[bytes, LayerRange], "ServeSource | None"]





@dataclass(eq=False)
class ServeJob:
    request: Request
    ep: Any
    source: ServeSource | None = None
    chunk: int = 0
    chunks_total: int = 0
    chunks_started: int = 0
    chunks_done: int = 0
    reads_in_flight: int = 0
    finished: bool = False
    abort_text: str = ""  # a read failed: stop, then tell the client this
    timer: Timer | None = None
    staging: list[mmap.mmap] = field(default_factory=list)
