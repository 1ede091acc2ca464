"""The pulling side's per-pull state (:class:`PullState`), its cached endpoints (:class:`Peer`),
and the checks of a caller's arguments (address, layer range, ``out`` buffer).
"""

from __future__ import annotations

import concurrent.futures
import secrets
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvpool import errors
from kvpool.objformat import LayerRange
from kvpool.transport.engine import Timer
from kvpool.transport.frames import (
    MAX_HEADER_NBYTES,
    MAX_KEY_BYTES,
    MAX_TOKEN_BYTES,
    STATUS_BUFFER_NBYTES,
    PeerAddress,
)


@dataclass(eq=False)
class Peer:
    """A cached endpoint to one server and the pulls using it."""

    key: tuple[Any, ...]
    ep: Any
    error_handling: bool
    label: str
    conn_id: int = field(default_factory=lambda: secrets.randbits(64))
    pulls: set[PullState] = field(default_factory=set)
    #: reached through its worker address (no listener): the server replies to ours
    by_worker_address: bool = False


@dataclass(eq=False)
class PullState:
    address: PeerAddress
    key: bytes
    layer_range: LayerRange
    out: memoryview
    timeout_s: float
    future: concurrent.futures.Future[int]
    request_id: int = 0
    peer: Peer | None = None
    status_buf: bytearray = field(default_factory=lambda: bytearray(STATUS_BUFFER_NBYTES))
    header_out: bytearray | None = None  # receives the header an OK carries (asked for)
    nbytes: int = 0
    chunk: int = 0
    chunks_left: int = 0
    chunks_done: int = 0  # chunks received (the first may arrive before the status is handled)
    receives: list[Any] = field(default_factory=list)  # chunk receives not yet completed
    abort_receive: Any = None
    done: bool = False
    timer: Timer | None = None
    token: bytes = b""


@dataclass(eq=False)
class PullRequest:
    """One pull of :meth:`kvpool.transport.PullClient.pull_many` (the arguments of ``pull_into``)."""

    address: PeerAddress | tuple[str, int]
    key: bytes
    layer_range: LayerRange | tuple[int, int] | range
    out: Any
    token: bytes = b""
    header_out: bytearray | None = None
    alive: Any = None  # Callable[[], bool] | None: asked while the pull waits, as in pull_into
    #: Callable[[int], None] | None: told the payload bytes in ``out`` so far, after
    #: ``header_out`` is filled and between reads (TCP pulls; over UCX it is never called)
    progress: Any = None


class CheckedPull(NamedTuple):
    """A pull's arguments, checked (:func:`checked_pull`)."""

    address: PeerAddress
    key: bytes
    layer_range: LayerRange
    out: memoryview
    token: bytes
    header_room: int  # the most header bytes ``header_out`` takes


def checked_pull(address: PeerAddress | tuple[str, int], key: Any, layer_range: Any, out: Any,
                 token: Any, header_out: Any) -> CheckedPull:
    """The arguments of one pull, checked as every client checks them, or a typed error."""
    peer, key, layers, token = checked_request(address, key, layer_range, token)
    return CheckedPull(peer, key, layers, checked_out(out), token, header_room(header_out))


def checked_request(address: PeerAddress | tuple[str, int], key: Any, layer_range: Any,
                    token: Any) -> tuple[PeerAddress, bytes, LayerRange, bytes]:
    """What a pull asks for (its reply's buffers aside), checked, or a typed error."""
    if type(address) is PeerAddress and type(key) is bytes and type(token) is bytes \
            and type(layer_range) is LayerRange and 0 < len(key) <= MAX_KEY_BYTES \
            and len(token) <= MAX_TOKEN_BYTES and 0 <= layer_range.start < layer_range.stop < 2**32:
        return address, key, layer_range, token  # what the reader passes: used as it is
    peer = _as_peer_address(address)
    if not isinstance(key, (bytes, bytearray, memoryview)) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise errors.InvalidKeyError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {key!r:.80}")
    if not isinstance(token, (bytes, bytearray, memoryview)) or len(token) > MAX_TOKEN_BYTES:
        raise errors.AuthenticationError(f"pull token must be at most {MAX_TOKEN_BYTES} bytes")
    return peer, bytes(key), _as_layer_range(layer_range), bytes(token)


def header_room(header_out: Any) -> int:
    """The most header bytes ``header_out`` takes (0: None, no header asked for)."""
    if header_out is None:
        return 0
    if not isinstance(header_out, bytearray):
        raise TypeError(f"header_out must be a bytearray, got {type(header_out).__name__}")
    return len(header_out) if 0 < len(header_out) <= MAX_HEADER_NBYTES else MAX_HEADER_NBYTES


def _as_peer_address(address: PeerAddress | tuple[str, int]) -> PeerAddress:
    if isinstance(address, PeerAddress):
        return address
    try:
        host, port = address
        return PeerAddress(str(host), int(port))
    except (TypeError, ValueError):
        raise ValueError(f"address must be a PeerAddress or (host, port), got {address!r}") from None


def _as_layer_range(layers: LayerRange | tuple[int, int] | range) -> LayerRange:
    if isinstance(layers, LayerRange):
        if 0 <= layers.start < layers.stop < 2**32:
            return layers  # immutable: used as it is
        start, stop = layers.start, layers.stop
    elif isinstance(layers, range) and layers.step == 1:
        start, stop = layers.start, layers.stop
    elif isinstance(layers, tuple) and len(layers) == 2:
        start, stop = int(layers[0]), int(layers[1])
    else:
        raise errors.LayerRangeError(f"cannot read {layers!r} as a layer range")
    if not 0 <= start < stop < 2**32:
        raise errors.LayerRangeError(f"layer range [{start}, {stop}) is empty or negative")
    return LayerRange(start, stop)


def checked_out(out: Any) -> memoryview:
    """``out`` as a writable, contiguous, non-empty byte view, or OutBufferError."""
    if type(out) is memoryview and out.format == "B" and out.ndim == 1 and out.nbytes and out.c_contiguous \
            and not out.readonly:  # what the reader passes: used as it is
        return out
    try:
        view = memoryview(out)
    except TypeError:
        raise errors.OutBufferError(
            f"out must support the buffer protocol, got {type(out).__name__}") from None
    if view.readonly:
        raise errors.OutBufferError("out buffer is read-only")
    if not view.c_contiguous:
        raise errors.OutBufferError("out buffer must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes == 0:
        raise errors.OutBufferError("out buffer is empty")
    return view
