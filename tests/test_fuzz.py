"""Fuzzing (Hypothesis) of every decoder a stray peer can reach.

* the master's request path (``MasterServer.serve_frames``, in process, on a state with
  nodes, keys, reservations and leases),
* a node's control socket (``Node.serve_control``, in process, on a node whose tiers,
  puller and master client are stand-ins),
* the pull frame parsers of :mod:`kvpool.transport.frames` (request and status frames).

Random bytes, random msgpack values and mutations of valid frames must never crash,
never hang (each example runs under a 2 s alarm), and always give a valid reply or a
typed error (a :mod:`kvpool.errors` class).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import errors
from kvpool.cluster.master.server import MasterServer
from kvpool.cluster.node.server import Node
from kvpool.cluster.wire import protocol as P
from kvpool.config import Config, MasterSection
from kvpool.objformat import LayerRange, ObjectSpec
from kvpool.transport import frames as T
from tests.conftest import bounded, default_cluster_key

SPEC = ObjectSpec("float16", layers=4, tokens=16, kv_heads=2, head_dim=8)
TIERS = {"dram": {"capacity": 1 << 30, "free": 1 << 30}}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def is_typed(name: Any) -> bool:
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    return isinstance(cls, type) and issubclass(cls, errors.KVPoolError)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


def mutate(frame: bytes, data: st.DataObject) -> bytes:
    """A few byte flips, a truncation or an insertion of ``frame``."""
    buf = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        if not buf:
            break
        at = data.draw(st.integers(0, len(buf) - 1))
        if kind == "flip":
            buf[at] = data.draw(st.integers(0, 255))
        elif kind == "truncate":
            del buf[at:]
        elif kind == "insert":
            buf[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del buf[at:at + data.draw(st.integers(1, 8))]
    return bytes(buf)


# -- the master ----------------------------------------------------------------------------


def record(key: bytes | None = None) -> P.ReplicaRecord:
    return P.replica_record("dram", SPEC, SPEC.total_nbytes, key=key, header_sum=1234)


@pytest.fixture(scope="module")
def master() -> Iterator[MasterServer]:
    srv = MasterServer(MasterSection(max_batch=64), cluster_key=default_cluster_key())  # nothing bound
    for node_id in ("n1", "n2"):
        body = {"node_id": node_id, "address": f"tcp://127.0.0.1:{len(node_id)}", "host_id": "h",
                "tiers": TIERS, "objects": [record(b"k%d" % i) for i in range(8)], "role": P.ROLE_STORAGE,
                "persistent_tiers": ["dram"]}
        srv.state.handle(P.REGISTER, body)
    srv.state.handle(P.RESERVE, {"items": [{"key": b"r", "nbytes": 1, "node_id": "n1"}]})
    srv.state.handle(P.LOCATE, {"keys": [b"k1"]})
    try:
        yield srv
    finally:
        srv.close()


VALID_MASTER_REQUESTS = [
    (P.PING, {}), (P.STATS, {}), (P.LIST, {"prefix": b"k", "limit": 3}),
    (P.LOOKUP, {"keys": [b"k0", b"k1", b"zz"]}), (P.EXISTS, {"keys": [b"k2"]}),
    (P.LOCATE, {"keys": [b"k3"], "lease": True}), (P.RELEASE, {"leases": [1, 2]}),
    (P.RESERVE, {"items": [{"key": b"x", "nbytes": 10, "node_id": "n1"}]}),
    (P.COMMIT, {"items": [{"reservation": 1, "replica": record()}]}), (P.REVOKE, {"reservations": [3]}),
    (P.PUBLISH, {"node_id": "n2", "objects": [record(b"p")]}),
    (P.EVICT_REQUEST, {"node_id": "n1", "keys": [b"k4"]}), (P.REMOVED, {"node_id": "n2", "keys": [b"k5"]}),
    (P.DELETE, {"keys": [b"k6"]}), (P.PLACE, {"nbytes": 10, "replicas": 1, "key": b"d"}),
    (P.HEARTBEAT, {"node_id": "n1", "tiers": TIERS, "delete_ack": 0}),
    (P.REGISTER, {"node_id": "n3", "address": "a", "host_id": "h", "tiers": TIERS, "objects": [record(b"q")]}),
]


def check_master_reply(master: MasterServer, payload: bytes) -> None:
    with bounded(2.0):
        out = master.serve_frames([b"peer", payload])
    assert out[0] == b"peer" and len(out) == 2
    _, ok, body = P.unpack_reply(out[1])
    if not ok:
        assert is_typed(body["type"]), body
        assert len(body["message"]) < 4096


@FUZZ
@given(payload=st.binary(max_size=200))
def test_master_random_bytes(master: MasterServer, payload: bytes) -> None:
    check_master_reply(master, payload)


@FUZZ
@given(op=st.sampled_from(sorted(P.OPS)) | st.text(max_size=10), body=msgpack_values,
       version=st.sampled_from([P.PROTOCOL_VERSION, 0, 2]) | msgpack_values, rid=msgpack_values)
def test_master_random_msgpack(master: MasterServer, op: Any, body: Any, version: Any, rid: Any) -> None:
    check_master_reply(master, msgspec.msgpack.encode([version, rid, op, body]))


@FUZZ
@given(data=st.data(), which=st.integers(0, len(VALID_MASTER_REQUESTS) - 1))
def test_master_mutated_valid_requests(master: MasterServer, data: st.DataObject, which: int) -> None:
    op, body = VALID_MASTER_REQUESTS[which]
    check_master_reply(master, mutate(P.pack_request(7, op, body), data))


@FUZZ
@given(data=st.data(), which=st.integers(0, len(VALID_MASTER_REQUESTS) - 1))
def test_master_valid_requests_with_a_field_replaced(master: MasterServer, data: st.DataObject, which: int) -> None:
    op, body = VALID_MASTER_REQUESTS[which]
    body = dict(body)
    name = data.draw(st.sampled_from(sorted(body) + ["extra"]))
    body[name] = data.draw(msgpack_values)
    check_master_reply(master, P.pack_request(8, op, body))


# -- a node's control socket -----------------------------------------------------------------


class _Manager:
    tiers = [SimpleNamespace(name="nvme", persistent=True, capacity_bytes=1 << 20, free_bytes=1 << 20)]
    counters: dict[str, int] = {}

    def __len__(self) -> int:
        return 0

    def tier_stats(self) -> dict[str, Any]:
        return {}


class _Puller:
    def pull_into(self, *args: Any, **kwargs: Any) -> None:
        raise errors.TransferError("no peer in this test")


@pytest.fixture(scope="module")
def node() -> Node:
    n = Node(Config(), _Manager(), "tcp://127.0.0.1:1")  # nothing bound or started: serve_control only
    n.node_id = "fuzz-node"
    n.host_id = "h"
    n.server = SimpleNamespace(stats=lambda: {})
    n._puller = lambda: _Puller()
    return n


def _valid_replicate() -> bytes:
    body = {"key": b"key", "spec": SPEC.to_wire(), "header_sum": 12345,
            "source": '{"ucx":["127.0.0.1",1],"worker":"AAAA","host_id":"h","control":"tcp://x:1"}',
            "reservation": 1, "replicas": 1, "persistent": True}
    return P.pack_control_request(9, P.CONTROL_REPLICATE, body)


VALID_CONTROL = [P.pack_control_request(1, P.CONTROL_PING, {}), P.pack_control_request(2, P.CONTROL_STATS, {}),
                 _valid_replicate()]


def check_control_reply(node: Node, payload: bytes) -> None:
    with bounded(2.0):
        reply = node.serve_control(payload)
    version, _, status, body = msgspec.msgpack.decode(reply)
    assert version == P.CONTROL_PROTOCOL_VERSION and status in (P.OK, P.ERROR)
    if status == P.ERROR:
        assert is_typed(body["type"]), body


@FUZZ
@given(payload=st.binary(max_size=200))
def test_control_random_bytes(node: Node, payload: bytes) -> None:
    check_control_reply(node, payload)


@FUZZ
@given(op=st.sampled_from(sorted(P.CONTROL_OPS)) | st.text(max_size=10), body=msgpack_values,
       version=st.sampled_from([P.CONTROL_PROTOCOL_VERSION, 1]) | msgpack_values, rid=msgpack_values)
def test_control_random_msgpack(node: Node, op: Any, body: Any, version: Any, rid: Any) -> None:
    check_control_reply(node, msgspec.msgpack.encode([version, rid, op, body]))
    check_control_reply(node, msgspec.msgpack.encode([op, body]))  # the unversioned protocol 1


@FUZZ
@given(data=st.data(), which=st.integers(0, len(VALID_CONTROL) - 1))
def test_control_mutated_valid_requests(node: Node, data: st.DataObject, which: int) -> None:
    check_control_reply(node, mutate(VALID_CONTROL[which], data))


@FUZZ
@given(field=st.sampled_from(["key", "spec", "header_sum", "source", "reservation", "replicas", "persistent"]),
       value=msgpack_values)
def test_control_replicate_with_a_field_replaced(node: Node, field: str, value: Any) -> None:
    body = msgspec.msgpack.decode(VALID_CONTROL[2])[3]
    body[field] = value
    check_control_reply(node, P.pack_control_request(3, P.CONTROL_REPLICATE, body))


def test_control_reply_errors_map_to_kvpool_types() -> None:
    def reply(status: str, body: Any, rid: int = 1) -> bytes:
        return msgspec.msgpack.encode([P.CONTROL_PROTOCOL_VERSION, rid, status, body])

    assert P.unpack_control_reply(reply("ok", {"a": 1}), 1) == {"a": 1}
    with pytest.raises(errors.ObjectTooLargeError):
        P.unpack_control_reply(reply("error", {"type": "ObjectTooLargeError", "message": "m"}), 1)
    with pytest.raises(errors.TransferError):
        P.unpack_control_reply(reply("error", {"type": "ExtraData", "message": "m"}), 1)
    with pytest.raises(errors.ProtocolError):
        P.unpack_control_reply(b"\xc1", 1)
    with pytest.raises(errors.ProtocolError):
        P.unpack_control_reply(reply("ok", {}, rid=2), 1)
    with pytest.raises(errors.ProtocolError):
        P.unpack_control_reply(msgspec.msgpack.encode(["ok", {}]), 1)


# -- the pull frame parsers ------------------------------------------------------------------


def _valid_request_frame(key: bytes = b"some-key", with_address: bool = False,
                         header_out: bytearray | None = None) -> bytearray:
    address = bytes([0x01]) + b"\x05" * 40 if with_address else b""
    frame = T.pack_request(key, b"t" * 48, LayerRange(0, 4), 1 << 20, want_header=header_out is not None,
                            max_chunk=1 << 20, request_id=5, client_id=1, conn_id=2, reply_address=address)
    buf = bytearray(T.REQUEST_BUFFER_NBYTES)  # what the server receives into: a fixed-size buffer
    buf[:len(frame)] = frame[:T.REQUEST_BUFFER_NBYTES]
    return buf


def check_request_frame(frame: bytes) -> None:
    buf = bytearray(T.REQUEST_BUFFER_NBYTES)
    buf[:len(frame)] = frame[:len(buf)]
    with bounded(2.0):
        try:
            request = T.parse_request(buf)
        except errors.KVPoolError:
            return
    assert 0 < len(request.key) <= T.MAX_KEY_BYTES
    assert len(request.reply_address) <= T.MAX_ADDRESS_BYTES
    assert len(request.token) <= T.MAX_TOKEN_BYTES
    assert request.max_chunk > 0 and request.layer_range.start < request.layer_range.stop


def check_status_frame(frame: bytes) -> None:
    buf = bytearray(T.STATUS_BUFFER_NBYTES)
    buf[:len(frame)] = frame[:len(buf)]
    with bounded(2.0):
        parsed = T.parse_status(buf, 5)
    if parsed is not None:
        status, nbytes, chunk, body = parsed
        assert len(body) <= (T.MAX_HEADER_NBYTES if status in T.OK_STATUSES else T.MAX_STATUS_TEXT)


def test_valid_frames_parse() -> None:
    request = T.parse_request(_valid_request_frame())
    assert (request.key, request.token, request.want_header) == (b"some-key", b"t" * 48, False)
    assert T.parse_request(_valid_request_frame(header_out=bytearray())).want_header
    assert T.parse_status(T.pack_status(5, T.STATUS_OK, 100, 64, "fine"), 5) == (T.STATUS_OK, 100, 64, b"fine")
    header = bytes(range(256)) * 8  # an OK carries a (binary) header longer than any failure text
    assert T.parse_status(T.pack_status(5, T.STATUS_OK, 100, 64, "", header), 5) == (T.STATUS_OK, 100, 64, header)
    assert T.parse_status(T.pack_status(5, T.STATUS_MISS, 0, 0, "", header), 5) is None
    buf = bytearray(T.STATUS_BUFFER_NBYTES)
    frame = T.pack_status(5, T.STATUS_OK, 100, 64, "x")
    struct.pack_into("<H", frame, 6, 60000)  # text length far beyond the buffer
    buf[:len(frame)] = frame
    assert T.parse_status(buf, 5) is None


@FUZZ
@given(frame=st.binary(max_size=T.REQUEST.size + 64))
def test_request_frame_random_bytes(frame: bytes) -> None:
    check_request_frame(T.REQUEST_MAGIC + bytes([T.PROTOCOL_VERSION]) + frame)
    check_request_frame(frame)


@FUZZ
@given(data=st.data(), with_address=st.booleans())
def test_request_frame_mutations(data: st.DataObject, with_address: bool) -> None:
    frame = bytes(_valid_request_frame(with_address=with_address))
    check_request_frame(mutate(frame[:T.REQUEST.size + 64], data))


@FUZZ
@given(frame=st.binary(max_size=T.STATUS.size + 32), data=st.data())
def test_status_frame_random_and_mutated(frame: bytes, data: st.DataObject) -> None:
    check_status_frame(T.STATUS_MAGIC + bytes([T.PROTOCOL_VERSION]) + frame)
    check_status_frame(mutate(bytes(T.pack_status(5, T.STATUS_OK, 1 << 20, 1 << 16, "ok")), data))
