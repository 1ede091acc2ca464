"""What a holder answers to one pull request, whichever transport carries it.

:func:`provide` asks the node (``authorize``, then the provider) for what a request names;
:func:`decide` turns that outcome into an :class:`Answer`: a status frame's fields, and for an
OK the :class:`ServeSource` the payload comes from. Both servers (UCX: :mod:`.server`, TCP:
:mod:`.tcp.server`) use the two and then only move bytes, count and release.

Pure apart from :func:`provide`: :func:`decide` reads the request and the source it is given,
sends nothing, releases nothing and counts nothing. Releasing a source the provider returned
stays the server's job whatever the answer (a refused OK still pinned the object).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool import errors
from kvpool.transport.engine import describe
from kvpool.transport.frames import (
    MAX_CHUNKS,
    MAX_HEADER_NBYTES,
    MIN_CHUNK,
    OK_STATUSES,
    STATUS_BAD_RANGE,
    STATUS_ERROR,
    STATUS_MISS,
    STATUS_OK,
    STATUS_OK_MAY_ABORT,
    STATUS_OUT_TOO_SMALL,
    STATUS_UNAUTHORIZED,
    Request,
    pack_status,
)
from kvpool.transport.source import Provider, ServeSource

# The failures a server counts as its errors (a miss, a refused token and a client buffer too
# small are the client's business, counted apart or not at all).
_ERROR_STATUSES = (STATUS_ERROR, STATUS_BAD_RANGE)


@dataclass(slots=True)  # not frozen: a frozen one's __init__ goes through object.__setattr__, per pull
class Answer:
    """One request's answer: its status frame's fields, and for an OK where the payload comes from.
    Not changed once :func:`decide` returned it.

    ``status``: one of :mod:`.frames`' ``STATUS_*``. ``text``: a failure's text (empty for an
    OK). ``source``: set exactly when the answer is an OK. ``nbytes``, ``chunk``: the payload
    bytes and the bytes per message (``chunk == nbytes`` on a byte stream). ``chunks``: how
    many payload messages follow the status. ``header``: the object's packed header an OK
    carries, when the request asked for it.
    """

    status: int
    text: str = ""
    source: ServeSource | None = None
    nbytes: int = 0
    chunk: int = 0
    chunks: int = 0
    header: bytes = b""

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    @property
    def is_error(self) -> bool:
        """Whether the server counts this answer among its errors (a failure of the holder's
        own or a provider that raised), not a miss, a refusal or a client's small buffer."""
        return self.status in _ERROR_STATUSES

    def frame(self, request_id: int) -> bytearray:
        """The status frame that carries this answer (the header follows an OK's head)."""
        return pack_status(request_id, self.status, self.nbytes, self.chunk, self.text, self.header)


def provide(request: Request, provider: Provider,
            authorize: Callable[[bytes, bytes], None] | None) -> object:
    """What the node has for ``request``: ``authorize(key, token)`` first (None: not checked),
    then ``provider(key, layer range)``. Returns what the provider returned (a
    :class:`ServeSource`, None for a miss, or anything else it wrongly returned), or the
    exception either raised (never raises an :class:`Exception` itself); :func:`decide` turns
    each into an answer."""
    try:
        if authorize is not None:
            authorize(request.key, request.token)
        return provider(request.key, request.layer_range)
    except Exception as exc:
        return exc


def decide(request: Request, outcome: object, max_message: int | None = None) -> Answer:
    """The answer to ``request``, given what :func:`provide` (or the server's own call of the
    provider) returned for it.

    In order: None is a miss; ``AuthenticationError`` unauthorized; ``LayerRangeError`` a bad
    range; any other exception, or anything but a :class:`ServeSource`, an error; a payload
    larger than the request's ``capacity`` out-too-small; a request for the header when the
    source has none (or one too large for a frame) an error; else OK.

    ``max_message``: the largest message the transport sends (UCX): the payload goes in chunks
    of the request's ``max_chunk`` within [min(MIN_CHUNK, max_message), max_message], at most
    MAX_CHUNKS of them, and a payload read while it is sent (``read_into``) is answered
    ``STATUS_OK_MAY_ABORT`` (an abort frame may replace its later chunks). None: a byte stream
    (TCP): one piece of ``nbytes``, always ``STATUS_OK`` (a failed read cuts the stream).
    """
    if not isinstance(outcome, ServeSource):
        return _refusal(request, outcome)
    source = outcome
    if source.nbytes > request.capacity:
        return Answer(STATUS_OUT_TOO_SMALL,
                      f"payload is {source.nbytes} bytes, out buffer holds {request.capacity}")
    if max_message is None:
        status, chunk, chunks = STATUS_OK, source.nbytes, 1 if source.nbytes else 0
    else:
        status = STATUS_OK if source.read_into is None else STATUS_OK_MAY_ABORT
        chunk = max(min(MIN_CHUNK, max_message), min(request.max_chunk, max_message))
        chunks = -(-source.nbytes // chunk)
        if chunks > MAX_CHUNKS:
            return Answer(STATUS_ERROR, "payload needs too many messages")
    header = b""
    if request.want_header:
        header = source.header
        if not 0 < len(header) <= MAX_HEADER_NBYTES:
            return Answer(STATUS_ERROR, f"no header to send ({len(header)} bytes)")
    return Answer(status, source=source, nbytes=source.nbytes, chunk=chunk, chunks=chunks, header=header)


def _refusal(request: Request, outcome: object) -> Answer:
    """The answer when the provider gave no :class:`ServeSource` (see :func:`decide`)."""
    if outcome is None:
        return Answer(STATUS_MISS, f"key {request.key.hex()} not held here")
    if isinstance(outcome, errors.AuthenticationError):
        return Answer(STATUS_UNAUTHORIZED, str(outcome))
    if isinstance(outcome, BaseException):
        status = STATUS_BAD_RANGE if isinstance(outcome, errors.LayerRangeError) else STATUS_ERROR
        return Answer(status, describe(outcome))
    return Answer(STATUS_ERROR, f"provider returned {type(outcome).__name__}")
