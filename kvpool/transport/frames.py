"""The pull protocol's wire format: tags, request / status / hello frames, peer addresses.

Pure data: packing and parsing, no UCX calls (see the package docstring for the protocol).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvpool import errors
from kvpool.objformat import LayerRange

# -- wire format ---------------------------------------------------------------

PROTOCOL_VERSION = 4  # v2: pull tokens, reply error handling; v3: OK may carry the object's header;
# v4: STATUS_OK_MAY_ABORT (only a payload read while it is sent may be cut short by an abort frame)
# Top bit set: never equal to a reply tag (request ids stay below 2**43).
REQUEST_TAG = 0xC0DE_4B56_5055_4C4C
INDEX_BITS = 20
MAX_REQUEST_ID = (1 << (63 - INDEX_BITS)) - 1
ABORT_INDEX = (1 << INDEX_BITS) - 1  # reply tag of a mid-stream abort
MAX_CHUNKS = ABORT_INDEX - 1
# A client asking for smaller chunks gets chunks of at least this (at most the server's
# max_message): a pull is never a million tiny messages. A client refuses a status frame
# whose chunk is below MIN_CHUNK_FLOOR (the smallest max_message a server may have).
MIN_CHUNK = 64 << 10
MIN_CHUNK_FLOOR = 4096

# magic, version, flags, key_len, addr_len, client_id, conn_id, request_id,
# layer start, layer stop, capacity (bytes), max chunk (bytes), xxh3-64 of the address,
# token_len; then key, token, reply address
REQUEST = struct.Struct("<4sBBHHQQQIIQQQH")
REQUEST_MAGIC = b"KVPR"
_FLAG_REPLY_TO_ADDRESS = 0x1
_FLAG_REPLY_ERROR_HANDLING = 0x2  # reply over an endpoint with UCX peer-failure detection (tcp)
_FLAG_WANT_HEADER = 0x4  # the OK status carries the served object's packed header
MAX_KEY_BYTES = 1024
MAX_ADDRESS_BYTES = 8192
MAX_TOKEN_BYTES = 64
_EMPTY_ADDRESS_SUM = xxhash.xxh3_64_intdigest(b"")
REQUEST_BUFFER_NBYTES = REQUEST.size + MAX_KEY_BYTES + MAX_TOKEN_BYTES + MAX_ADDRESS_BYTES

# magic, version, status, message length, request id, payload bytes, chunk bytes
STATUS = struct.Struct("<4sBBHQQQ")
STATUS_MAGIC = b"KVPS"
MAX_STATUS_TEXT = 1024
MAX_HEADER_NBYTES = 0xFFFF  # the most header bytes an OK status carries (its length is a u16)
STATUS_BUFFER_NBYTES = STATUS.size + MAX_STATUS_TEXT

HELLO = struct.Struct("<4sBxxxQ")
HELLO_MAGIC = b"KVPH"

STATUS_OK = 0  # the payload follows from memory: every chunk comes
STATUS_MISS = 1
STATUS_ERROR = 2
STATUS_BAD_RANGE = 3
STATUS_OUT_TOO_SMALL = 4
STATUS_BAD_REQUEST = 5
STATUS_UNAUTHORIZED = 6  # the request's token was refused: nothing else is sent
# OK, and the payload is read (nvme) while it is sent: an abort frame may replace the chunks not
# yet sent. Only then does the client post a receive for one.
STATUS_OK_MAY_ABORT = 7
OK_STATUSES = (STATUS_OK, STATUS_OK_MAY_ABORT)


def status_error(status: int) -> type[errors.KVPoolError]:
    """The error a client raises for a failed pull's status."""
    return {
        STATUS_MISS: errors.RemoteMissError,
        STATUS_BAD_RANGE: errors.LayerRangeError,
        STATUS_OUT_TOO_SMALL: errors.OutBufferError,
        STATUS_UNAUTHORIZED: errors.AuthenticationError,
    }.get(status, errors.TransferError)

RECEIVES_POSTED = 4  # request receives kept posted on a server's worker


def plausible_worker_address(address: bytes) -> bool:
    """Cheap sanity check of a packed UCX worker address.

    UCX trusts the addresses it is given and aborts the process on some
    malformed ones, so addresses from the network or the master are checked
    first: a sane length and a header version UCX knows (v1 = 0, v2 = 1 in the
    low 4 bits of the first byte). Not a defence against a hostile peer: a UCX
    port belongs on a trusted network.
    """
    return 16 <= len(address) <= MAX_ADDRESS_BYTES and (address[0] & 0x0F) in (0, 1)




@dataclass(frozen=True)
class PeerAddress:
    """Where a node serves pulls: listener ``host``/``port``, plus its worker address.

    ``worker_address`` and ``host_id`` enable the same-host shared-memory path
    of ``transport="auto"``; both may be empty. ``to_wire``/``from_wire`` give a
    msgpack-friendly form for publishing through the master.
    """

    host: str
    port: int
    worker_address: bytes = b""
    host_id: str = ""
    #: where the node serves pulls over plain TCP (:mod:`.tcp`) on ``host``; 0: it does not
    tcp_port: int = 0

    def to_wire(self) -> list[Any]:
        return [self.host, self.port, self.worker_address, self.host_id, self.tcp_port]

    @classmethod
    def from_wire(cls, fields: Sequence[Any]) -> PeerAddress:
        host, port, worker_address, host_id, *rest = fields  # a 4-field address serves no TCP pulls
        return cls(str(host), int(port), bytes(worker_address), str(host_id), int(rest[0]) if rest else 0)



@dataclass(eq=False, slots=True)
class Request:
    client_id: int
    conn_id: int
    request_id: int
    key: bytes
    layer_range: LayerRange
    capacity: int
    max_chunk: int
    reply_address: bytes
    token: bytes = b""
    reply_error_handling: bool = False
    want_header: bool = False


def parse_request(buf: bytearray, at: int = 0) -> Request:
    """The request frame at ``buf[at:]`` (ProtocolError if malformed)."""
    try:
        (magic, version, flags, key_len, addr_len, client_id, conn_id, request_id, start, stop,
         capacity, max_chunk, address_sum, token_len) = REQUEST.unpack_from(buf, at)
    except struct.error as exc:
        raise errors.ProtocolError(f"request too short: {exc}") from None
    if magic != REQUEST_MAGIC:
        raise errors.ProtocolError(f"bad request magic {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise errors.ProtocolError(
            f"request protocol version {version}, this build speaks {PROTOCOL_VERSION}")
    if not 0 < key_len <= MAX_KEY_BYTES or addr_len > MAX_ADDRESS_BYTES or token_len > MAX_TOKEN_BYTES:
        raise errors.ProtocolError("request key empty, or key, token or address too long")
    if not start < stop or request_id > MAX_REQUEST_ID or max_chunk <= 0:
        raise errors.ProtocolError("request fields out of range")
    key_end = at + REQUEST.size + key_len
    token_end = key_end + token_len
    if token_end + addr_len > len(buf):
        raise errors.ProtocolError("request shorter than its key, token and address")
    address = bytes(buf[token_end:token_end + addr_len]) if flags & _FLAG_REPLY_TO_ADDRESS else b""
    # UCX aborts the process on a malformed worker address: check before use.
    if address and (xxhash.xxh3_64_intdigest(address) != address_sum
                    or not plausible_worker_address(address)):
        raise errors.ProtocolError("request carries a corrupt reply address")
    return Request(client_id, conn_id, request_id, bytes(buf[at + REQUEST.size:key_end]),
                    LayerRange(start, stop), capacity, max_chunk, address, bytes(buf[key_end:token_end]),
                    bool(flags & _FLAG_REPLY_ERROR_HANDLING), bool(flags & _FLAG_WANT_HEADER))


def parse_status_head(buf: bytearray, request_id: int) -> tuple[int, int, int, int] | None:
    """(status, body bytes, payload bytes, chunk bytes) from the head of the status frame at the
    start of ``buf``, or None if it is not one for ``request_id`` (short, wrong magic, version or
    id, or a failure whose text would pass MAX_STATUS_TEXT). The body (the text of a failure, or
    the header an OK carries) follows the head; where it lands is the caller's. The one check of
    a status frame: :func:`parse_status` and the TCP client's reads both use it."""
    try:
        magic, version, status, body_len, frame_request_id, nbytes, chunk = STATUS.unpack_from(buf)
    except struct.error:
        return None
    if magic != STATUS_MAGIC or version != PROTOCOL_VERSION or frame_request_id != request_id \
            or status not in OK_STATUSES and body_len > MAX_STATUS_TEXT:
        return None
    return status, body_len, nbytes, chunk


def parse_status(buf: bytearray, request_id: int) -> tuple[int, int, int, bytes] | None:
    """(status, payload bytes, chunk bytes, body) of the status frame filling ``buf``, or None if
    malformed (see :func:`parse_status_head`; the body must be in ``buf`` too). The body is the
    text of a failure, or the header an OK carries."""
    head = parse_status_head(buf, request_id)
    if head is None or STATUS.size + head[1] > len(buf):
        return None
    status, body_len, nbytes, chunk = head
    return status, nbytes, chunk, bytes(buf[STATUS.size:STATUS.size + body_len])


def pack_status(request_id: int, status: int, nbytes: int, chunk: int, text: str,
                 body: bytes = b"") -> bytearray:
    encoded = body or text.encode("utf-8", "replace")[:MAX_STATUS_TEXT]
    frame = bytearray(STATUS.size + len(encoded))
    STATUS.pack_into(frame, 0, STATUS_MAGIC, PROTOCOL_VERSION, status, len(encoded),
                      request_id, nbytes, chunk)
    frame[STATUS.size:] = encoded
    return frame



def pack_request(
    key: bytes, token: bytes, layer_range: LayerRange, capacity: int, *, want_header: bool, max_chunk: int,
    request_id: int, client_id: int = 0, conn_id: int = 0, reply_address: bytes = b"",
    reply_error_handling: bool = False,
) -> bytearray:
    """A request frame: ``layer_range`` of ``key`` into a buffer of ``capacity`` bytes."""
    head = REQUEST.pack(
        REQUEST_MAGIC, PROTOCOL_VERSION,
        (_FLAG_REPLY_TO_ADDRESS if reply_address else 0)
        | (_FLAG_REPLY_ERROR_HANDLING if reply_address and reply_error_handling else 0)
        | (_FLAG_WANT_HEADER if want_header else 0),
        len(key), len(reply_address), client_id, conn_id, request_id,
        layer_range.start, layer_range.stop, capacity, max_chunk,
        xxhash.xxh3_64_intdigest(reply_address) if reply_address else _EMPTY_ADDRESS_SUM, len(token),
    )
    return bytearray(b"".join((head, key, token, reply_address)))


