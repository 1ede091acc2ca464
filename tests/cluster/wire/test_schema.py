"""The control plane's typed schema: what decodes, what is refused, and with which error."""

from __future__ import annotations

import msgspec
import pytest

from kvpool import errors
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire import schema as S
from kvpool.objformat import ObjectSpec

SPEC = ObjectSpec(layers=2, tokens=4, kv_heads=2, head_dim=8, dtype="float16").to_wire()


def request(op: str, body: object, rid: int = 7) -> bytes:
    return msgspec.msgpack.encode([P.PROTOCOL_VERSION, rid, op, body])


def test_every_op_has_a_request_and_reply_struct() -> None:
    assert set(P.SCHEMA) == P.OPS
    for op, (req, reply) in P.SCHEMA.items():
        assert issubclass(req, S.Body), op
        assert reply is None or issubclass(reply, S.Body), op
    assert set(P.CONTROL_SCHEMA) == P.CONTROL_OPS


def test_a_request_decodes_into_its_struct_and_ignores_unknown_fields() -> None:
    parsed = P.unpack_request(request(P.LOCATE, {"keys": [b"a", b"b"], "lease": False, "added_later": 1}))
    assert (parsed.request_id, parsed.op) == (7, P.LOCATE)
    assert parsed.body == S.Locate(keys=[b"a", b"b"], lease=False)
    assert P.unpack_request(request(P.LOCATE, {"keys": []})).body.lease is True  # the default


@pytest.mark.parametrize(("op", "body", "says"), [
    (P.EXISTS, {"keys": ["text, not bytes"]}, "$.keys[0]"),
    (P.EXISTS, {}, "missing required field `keys`"),
    (P.RESERVE, {"items": [{"key": b"k", "nbytes": -1, "node_id": "n"}]}, "nbytes must be >= 0"),
    (P.PUBLISH, {"node_id": "n", "objects": [{"tier": "dram", "spec": SPEC, "nbytes": 1, "durable": 0}]},
     "durable must be an int >= 1"),
    (P.REGISTER, {"node_id": "", "address": "a", "host_id": "h", "tiers": {}}, "node_id must not be empty"),
    (P.REGISTER, {"node_id": "n", "address": "a", "host_id": "h", "tiers": {}, "role": "king"}, "role must be"),
    (P.HEARTBEAT, {"node_id": "n", "tiers": {"dram": {"capacity": 1, "free": 2}}}, "free <= capacity"),
    (P.LIST, {"limit": -5}, "limit must be >= 0"),
    (P.PLACE, {"nbytes": True}, "Expected `int`, got `bool`"),
])
def test_a_body_that_does_not_fit_is_a_protocol_error_naming_the_field(op: str, body: object, says: str) -> None:
    with pytest.raises(P.MalformedRequest) as info:
        P.unpack_request(request(op, body))
    assert says in str(info.value) and info.value.request_id == 7
    assert isinstance(info.value, errors.ProtocolError)


def test_fixed_limits_are_request_too_large() -> None:
    location = {f"k{i}": i for i in range(S.MAX_LOCATION_ENTRIES + 1)}
    with pytest.raises(errors.RequestTooLargeError):
        P.unpack_request(request(P.PUBLISH, {"node_id": "n", "objects": [
            {"key": b"k", "tier": "dram", "spec": SPEC, "nbytes": 1, "location": location}]}))
    with pytest.raises(errors.RequestTooLargeError):
        P.unpack_request(request(P.REGISTER, {"node_id": "n" * (S.MAX_ID_BYTES + 1), "address": "a",
                                              "host_id": "h", "tiers": {}}))


def test_a_reply_that_does_not_fit_its_struct_is_a_protocol_error() -> None:
    good = P.pack_reply(3, {"prefix": 2})
    assert P.unpack_reply(good, P.LOOKUP) == (3, True, S.LookupReply(prefix=2))
    with pytest.raises(errors.ProtocolError, match="malformed lookup reply"):
        P.unpack_reply(P.pack_reply(3, {"prefix": "two"}), P.LOOKUP)
    # an error reply stays a map, whatever the op
    rid, ok, body = P.unpack_reply(P.pack_error(4, "NotLeaderError", "m"), P.LOOKUP)
    assert (rid, ok, body) == (4, False, {"type": "NotLeaderError", "message": "m"})
    # stats is free-form
    assert P.unpack_reply(P.pack_reply(5, {"nodes": {}}), P.STATS)[2] == {"nodes": {}}
    # an OK reply that fits the struct but speaks another protocol version is refused, naming it
    with pytest.raises(errors.ProtocolError, match="protocol version 1"):
        P.unpack_reply(msgspec.msgpack.encode([1, 6, P.OK, {"prefix": 2}]), P.LOOKUP)


def test_control_requests_decode_into_their_structs() -> None:
    body = {"key": b"k", "spec": SPEC, "header_sum": 9, "source": "{}", "reservation": 3}
    parsed = P.unpack_control_request(P.pack_control_request(1, P.CONTROL_REPLICATE, body))
    assert parsed.body == S.Replicate(key=b"k", spec=SPEC, header_sum=9, source="{}", reservation=3)
    with pytest.raises(P.MalformedRequest, match="header_sum must be a u64"):
        P.unpack_control_request(P.pack_control_request(1, P.CONTROL_REPLICATE, {**body, "header_sum": -1}))


def test_structs_encode_as_the_maps_the_wire_carries() -> None:
    encoded = P.pack_request(1, P.DELETE, S.Delete(keys=[b"k"], node_id="n"))
    assert msgspec.msgpack.decode(encoded) == [P.PROTOCOL_VERSION, 1, "delete", {"keys": [b"k"], "node_id": "n"}]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(S.Delete(keys=[b"k"])), type=dict) == {"keys": [b"k"]}
