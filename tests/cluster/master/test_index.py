"""The master's compact key index (kvpool.cluster.master.index), against a plain dict model.

A Hypothesis state machine drives a real MasterState (the compact index inside it) and a
model that keeps what the old master kept, key -> {node: record} in dicts, through random
sequences of publish, register (authoritative re-registration), delete, removed, node death
and departure, and checks every answer (exists, lookup, locate, list, stats) against the
model after each step. The table starts tiny, so sequences grow it and fill it with deleted
slots; keys of other lengths, several replicas per key, located records and records that
cannot be interned all take part, and so does master.max_keys.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvpool import errors
from kvpool.cluster.master import bulk
from kvpool.cluster.master.follow import ChangeLog, answer_follow, apply_change, load_snapshot
from kvpool.cluster.master.index import KeyIndex, split_keys
from kvpool.cluster.master.ops import MasterState
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire import schema as S
from kvpool.config import MasterSection
from kvpool.objformat import ObjectSpec

SPECS = [ObjectSpec("float16", 4, 16, 2, 8), ObjectSpec("bfloat16", 32, 256, 8, 128)]
NODES = ["n0", "n1", "n2"]
# 16-byte keys (prefix hashes) and a few of other lengths; more keys than max_keys.
KEYS = [i.to_bytes(2, "big") * 8 for i in range(60)] + [b"odd-%d" % i for i in range(6)]
MAX_KEYS = 48
TIERS = {"dram": {"capacity": 1 << 30, "free": 1 << 30}}

Model = dict[bytes, dict[str, dict[str, Any]]]


def record_strategy() -> st.SearchStrategy[dict[str, Any]]:
    location = st.one_of(
        st.just({}),
        st.builds(lambda off: {"path": "/dev/shm/arena", "instance": "i1", "offset": off, "nbytes": 64},
                  st.integers(1, 1 << 40)),
        st.just({"nested": [1, 2]}),  # not internable: kept whole
    )
    return st.builds(
        lambda spec, tier, header_sum, loc: {"tier": tier, "spec": spec.to_wire(), "nbytes": spec.total_nbytes,
                                             "header_sum": header_sum, "location": loc},
        st.sampled_from(SPECS), st.sampled_from(["dram", "cxl", "nvme"]),
        st.one_of(st.none(), st.integers(0, (1 << 64) - 1)), location)


class IndexMachine(RuleBasedStateMachine):
    """MasterState with the compact index against the dict model."""

    @initialize()
    def start(self) -> None:
        config = MasterSection(max_keys=MAX_KEYS)
        self.state = MasterState(config)
        self.state.record_changes(ChangeLog())
        # A standby following the state's change stream (kvpool.cluster.master.follow).
        self.standby = MasterState(config)
        self.stream, self.since = "", 0
        self.model: Model = {}
        self.alive: dict[str, bool] = {}
        self.pending: dict[str, set[bytes]] = {}  # deletes a node has not carried out
        self.known: set[str] = set()

    # -- helpers -----------------------------------------------------------------------

    def _wire(self, key: bytes, rec: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in rec.items() if v is not None}
        return {**out, "key": key}

    def _new_keys(self, keys: list[bytes]) -> int:
        return len({k for k in keys if k not in self.model})

    def _handle(self, op: str, body: dict[str, Any], via_bulk: bool = False) -> Any:
        if via_bulk:
            frame = P.pack_request(1, op, body)
            request = bulk.unpack_bulk(frame) or P.unpack_request(frame)
            return self.state.handle(request.op, request.body)
        return self.state.handle(op, body)

    # -- rules ---------------------------------------------------------------------------

    @rule(node=st.sampled_from(NODES), items=st.lists(st.tuples(st.sampled_from(KEYS), record_strategy()),
                                                      max_size=24), via_bulk=st.booleans())
    def publish(self, node: str, items: list[tuple[bytes, dict[str, Any]]], via_bulk: bool) -> None:
        body = {"node_id": node, "objects": [self._wire(k, r) for k, r in items]}
        if not self.alive.get(node):
            with pytest.raises(errors.UnknownNodeError):
                self._handle(P.PUBLISH, body, via_bulk)
            return
        if len(self.model) + self._new_keys([k for k, _ in items]) > MAX_KEYS:
            before = self.snapshot()
            with pytest.raises(errors.PoolFullError):
                self._handle(P.PUBLISH, body, via_bulk)
            assert self.snapshot() == before  # refused whole
            return
        assert self._handle(P.PUBLISH, body, via_bulk)["indexed"] == len(items)
        for key, rec in items:
            self.model.setdefault(key, {})[node] = rec
            self.pending[node].discard(key)

    @rule(node=st.sampled_from(NODES), items=st.lists(st.tuples(st.sampled_from(KEYS), record_strategy()),
                                                      max_size=30), via_bulk=st.booleans())
    def register(self, node: str, items: list[tuple[bytes, dict[str, Any]]], via_bulk: bool) -> None:
        body = {"node_id": node, "address": f"tcp://127.0.0.1:{NODES.index(node) + 1}", "host_id": "h",
                "tiers": TIERS, "objects": [self._wire(k, r) for k, r in items]}
        pending = self.pending.setdefault(node, set())
        if len(self.model) + self._new_keys([k for k, _ in items]) > MAX_KEYS:
            before = self.snapshot()
            with pytest.raises(errors.PoolFullError):
                self._handle(P.REGISTER, body, via_bulk)
            assert self.snapshot() == before
            return
        self._handle(P.REGISTER, body, via_bulk)
        self.known.add(node)
        self.alive[node] = True
        self._drop_node(node)
        for key, rec in items:
            if key not in pending:
                self.model.setdefault(key, {})[node] = rec

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=8), caller=st.sampled_from(["", *NODES]))
    def delete(self, keys: list[bytes], caller: str) -> None:
        reply = self.state.handle(P.DELETE, {"keys": keys, "node_id": caller})
        expected = []
        for key in keys:
            holders = self.model.pop(key, None)
            expected.append(holders is not None)
            for node in holders or ():
                if node != caller:
                    self.pending[node].add(key)
        assert reply["deleted"] == expected

    @rule(node=st.sampled_from(NODES), keys=st.lists(st.sampled_from(KEYS), max_size=8))
    def removed(self, node: str, keys: list[bytes]) -> None:
        reply = self.state.handle(P.REMOVED, {"node_id": node, "keys": keys})
        if node not in self.known:
            assert reply["removed"] == 0
            return
        count = 0
        for key in keys:
            holders = self.model.get(key)
            if holders is not None and holders.pop(node, None) is not None:
                count += 1
                if not holders:
                    del self.model[key]
            self.pending[node].discard(key)
        assert reply["removed"] == count

    @rule(node=st.sampled_from(NODES), cleanly=st.booleans())
    def node_goes(self, node: str, cleanly: bool) -> None:
        if not self.alive.get(node):
            return
        if cleanly:
            self.state.handle(P.LEAVE, {"node_id": node})
        else:
            self.state._declare_dead(self.state.nodes[node], self.state.clock())
        self.alive[node] = False
        self._drop_node(node)

    def _drop_node(self, node: str) -> None:
        for key in list(self.model):
            self.model[key].pop(node, None)
            if not self.model[key]:
                del self.model[key]

    @rule()
    def standby_starts_over(self) -> None:
        """A standby restarted: it loads a snapshot and follows on from it."""
        self.standby = MasterState(self.standby.config)
        self.stream, self.since = "", 0

    def _follow(self) -> None:
        while True:
            reply = answer_follow(self.state, S.Follow(stream=self.stream, since=self.since))
            if "snapshot" in reply:
                parts = [reply["data"]] + [
                    answer_follow(self.state, S.Follow(snapshot=reply["snapshot"], part=i))["data"]
                    for i in range(1, reply["parts"])]
                self.standby = MasterState(self.standby.config)
                load_snapshot(self.standby, parts)
                self.stream, self.since = reply["stream"], reply["seq"]
                continue
            for change in reply["changes"]:
                apply_change(self.standby, msgspec.msgpack.decode(change))
            self.since = reply["last"]
            if self.since == reply["head"]:
                return

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=20))
    def lookup(self, keys: list[bytes]) -> None:
        prefix = 0
        for key in keys:
            if key not in self.model:
                break
            prefix += 1
        assert self.state.handle(P.LOOKUP, {"keys": keys})["prefix"] == prefix

    # -- what must always hold -----------------------------------------------------------------

    def snapshot(self) -> dict[bytes, dict[str, Any]]:
        reply = self.state.handle(P.LOCATE, {"keys": KEYS, "lease": False})["replicas"]
        return {key: {r["node_id"]: _comparable(r) for r in located}
                for key, located in zip(KEYS, reply) if located is not None} if reply else {}

    @invariant()
    def answers_match_the_model(self) -> None:
        if not hasattr(self, "state"):
            return
        state = self.state
        assert state.handle(P.EXISTS, {"keys": KEYS})["exists"] == [k in self.model for k in KEYS]
        assert [k in state.index for k in KEYS] == [k in self.model for k in KEYS]
        located = state.handle(P.LOCATE, {"keys": KEYS, "lease": False})["replicas"]
        for key, replicas in zip(KEYS, located):
            if key not in self.model:
                assert replicas is None
                continue
            assert replicas is not None
            got = {r["node_id"]: _comparable(r) for r in replicas}
            want = {node: _comparable(rec) for node, rec in self.model[key].items()}
            assert got == want, key
        stats = state.handle(P.STATS, {})
        assert stats["keys"] == len(self.model)
        assert stats["replicas"] == sum(len(h) for h in self.model.values())
        for node, info in stats["nodes"].items():
            assert info["objects"] == sum(node in h for h in self.model.values())
        listed = state.handle(P.LIST, {"prefix": b"", "limit": 1000})["keys"]
        assert sorted(item["key"] for item in listed) == sorted(self.model)
        # The standby, once it has followed, answers as the leader does.
        self._follow()
        standby = self.standby
        mine, theirs = _everything(standby), _everything(state)
        if mine != theirs:
            raise AssertionError(f"the standby differs from the leader: {mine} != {theirs}")
        assert dict(standby.durable) == dict(state.durable)
        assert {n: (i.alive, i.state, i.address) for n, i in standby.nodes.items()} == \
            {n: (i.alive, i.state, i.address) for n, i in state.nodes.items()}


def _everything(state: MasterState) -> Any:
    located = state.handle(P.LOCATE, {"keys": KEYS, "lease": False})["replicas"]
    stats = state.handle(P.STATS, {})
    return ([None if r is None else sorted((x["node_id"], _comparable(x)) for x in r) for r in located],
            stats["keys"], stats["replicas"], {n: i["objects"] for n, i in stats["nodes"].items()})


def _comparable(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record["tier"], tuple(record["spec"]), record["nbytes"], record.get("header_sum"),
            tuple(sorted((record.get("location") or {}).items())))


def test_compact_index_answers_as_the_dict_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "BULK_MIN_BYTES", 0)  # every publish/register may take the bulk path
    run_state_machine_as_test(IndexMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


def test_batches_and_single_keys_probe_alike() -> None:
    """The numpy batch probe and the Python one-key probe find the same slots, through growth
    and deletions."""
    index = KeyIndex()
    keys = [i.to_bytes(16, "little") for i in range(5000)]
    spec = SPECS[0]
    sid = index.encode("dram", spec.to_wire(), spec.total_nbytes, 1, None)[0]
    assert index.add_many("n", keys[:3000], [sid] * 3000, [7] * 3000, [0] * 3000) == (3000, 3000 * spec.total_nbytes)
    for key in keys[:3000:3]:
        assert index.remove(key, "n")
    for key in keys[3000:4000]:
        index.add_encoded(key, index.node_index("n"), sid, 9, 0)
    want = [k in set(keys[:4000]) - set(keys[:3000:3]) for k in keys]
    assert index.contains_many(keys) == want == [k in index for k in keys]
    assert len(index) == sum(want) and index.node_count("n") == sum(want)
    assert (index._find_many(*split_keys(keys)) >= 0).tolist() == want


def test_max_keys_refuses_a_publish_whole_and_says_why() -> None:
    state = MasterState(MasterSection(max_keys=10))
    state.handle(P.REGISTER, {"node_id": "a", "address": "tcp://127.0.0.1:1", "host_id": "h", "tiers": TIERS})
    spec = SPECS[0]

    def records(first: int, stop: int) -> list[dict[str, Any]]:
        return [{"key": i.to_bytes(16, "big"), "tier": "dram", "spec": spec.to_wire(), "nbytes": spec.total_nbytes}
                for i in range(first, stop)]

    assert state.handle(P.PUBLISH, {"node_id": "a", "objects": records(0, 8)})["indexed"] == 8
    with pytest.raises(errors.PoolFullError, match=r"master.max_keys = 10 \(nothing of this request was indexed\)"):
        state.handle(P.PUBLISH, {"node_id": "a", "objects": records(4, 12)})
    assert len(state.index) == 8 and not any(state.handle(P.EXISTS, {"keys": [r["key"] for r in records(8, 12)]})
                                             ["exists"])
    # keys already indexed do not count: re-publishing them (and two new) fits exactly
    assert state.handle(P.PUBLISH, {"node_id": "a", "objects": records(0, 10)})["indexed"] == 10
    # deleting makes room again
    state.handle(P.DELETE, {"keys": [r["key"] for r in records(0, 5)]})
    assert state.handle(P.PUBLISH, {"node_id": "a", "objects": records(10, 15)})["indexed"] == 5
    assert len(state.index) == 10 and state.handle(P.STATS, {})["index"]["max_keys"] == 10


def test_max_keys_refuses_a_commit_whole_and_keeps_its_reservations() -> None:
    state = MasterState(MasterSection(max_keys=2))
    state.handle(P.REGISTER, {"node_id": "a", "address": "tcp://127.0.0.1:1", "host_id": "h", "tiers": TIERS})
    spec = SPECS[0]
    keys = [i.to_bytes(16, "big") for i in range(3)]
    rids = state.handle(P.RESERVE, {"items": [{"key": k, "nbytes": 10, "node_id": "a"} for k in keys]})["reservations"]
    replica = {"tier": "dram", "spec": spec.to_wire(), "nbytes": spec.total_nbytes}
    with pytest.raises(errors.PoolFullError):
        state.handle(P.COMMIT, {"items": [{"reservation": r, "replica": replica} for r in rids]})
    assert len(state.index) == 0 and len(state.reservations) == 3  # nothing used up
    assert state.handle(P.COMMIT, {"items": [{"reservation": r, "replica": replica} for r in rids[:2]]}) == \
        {"committed": [True, True]}
