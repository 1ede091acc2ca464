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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvpool import errors
from kvpool.cluster.master import bulk
from kvpool.cluster.master import index as index_module
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

    @rule(node=st.sampled_from(NODES),
          keys=st.one_of(st.lists(st.sampled_from(KEYS[:60]), min_size=16, max_size=40, unique=True),
                         st.lists(st.sampled_from(KEYS[:60]), min_size=16, max_size=40)),
          spec=st.sampled_from(SPECS), tier=st.sampled_from(["dram", "nvme"]),
          sums=st.lists(st.integers(1 << 32, (1 << 64) - 1), min_size=40, max_size=40),
          small_sum=st.booleans(), register=st.booleans())
    def publish_one_kind(self, node: str, keys: list[bytes], spec: ObjectSpec, tier: str, sums: list[int],
                         small_sum: bool, register: bool) -> None:
        """A node's dram or nvme puts: records of one kind of object, 16-byte keys (some
        repeated, some held by other nodes), which the master takes as columns; with
        ``small_sum`` one checksum is encoded shorter and the batch goes record by record."""
        if small_sum:
            sums = [7, *sums[1:]]
        items = [(key, {"tier": tier, "spec": spec.to_wire(), "nbytes": spec.total_nbytes, "header_sum": header_sum,
                        "location": {}}) for key, header_sum in zip(keys, sums)]
        body = {"node_id": node, "objects": [self._wire(k, r) for k, r in items]}
        objects = bulk.unpack_bulk(P.pack_request(1, P.PUBLISH, body)).body.objects  # type: ignore[union-attr]
        assert isinstance(objects, bulk.RecordColumns) != small_sum
        if register:
            self.register(node, items, via_bulk=True)
        else:
            self.publish(node, items, via_bulk=True)

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
        # a batch of 16-byte keys only is probed at once (KeyIndex.located_many): the same answers
        sixteen = [i for i, key in enumerate(KEYS) if len(key) == 16]
        assert state.handle(P.LOCATE, {"keys": [KEYS[i] for i in sixteen], "lease": False})["replicas"] == \
            [located[i] for i in sixteen]
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
        for node in NODES:  # what a dead client's rescue is planned from: every record a node holds
            got = sorted((key, _comparable(vars_of(record))) for key, record in state.index.records_of(node))
            want = sorted((key, _comparable(held[node])) for key, held in self.model.items() if node in held)
            assert got == want, node
            assert sorted(k for k, _ in state.index.records_of(node, "cxl")) == \
                sorted(k for k, held in self.model.items() if node in held and held[node]["tier"] == "cxl")
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


def vars_of(record: Any) -> dict[str, Any]:
    """A master Replica as the wire dict the model keeps."""
    return {"tier": record.tier, "spec": record.spec, "nbytes": record.nbytes, "header_sum": record.header_sum,
            "location": record.location}


def _comparable(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record["tier"], tuple(record["spec"]), record["nbytes"], record.get("header_sum"),
            tuple(sorted((record.get("location") or {}).items())))


def test_compact_index_answers_as_the_dict_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "BULK_MIN_BYTES", 0)  # every publish/register may take the bulk path
    run_state_machine_as_test(IndexMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("probe", ["C", "numpy"])
def test_batches_and_single_keys_probe_alike(probe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch probe (in C, and with numpy where the extension is not built) and the Python
    one-key probe find the same slots, through growth and deletions; a prefix counts up to the
    first missing key."""
    if probe == "C":
        pytest.importorskip("kvpool._index", reason="the C extension is not built here")
    else:
        monkeypatch.setattr(index_module, "_native", None)
    index = KeyIndex()
    keys = [i.to_bytes(16, "little") for i in range(5000)]
    keys[1::7] = [(i << 64).to_bytes(16, "little") for i in range(1, 5000, 7)]  # low halves 0, as empty slots'
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
    assert index.contains_many(keys[:300]) == want[:300]  # both ways of a probe step (SPARSE_PROBE)
    assert index.contains_many(keys[:200]) == want[:200]
    assert index.prefix(keys) == want.index(False) == 0
    held = [k for k, w in zip(keys, want) if w]
    assert index.prefix(held) == len(held)
    assert index.prefix(held[:700] + keys[:1] + held[700:]) == 700
    assert index.prefix([*held[:20], b"odd", *held[20:]]) == 20  # a key of another length: the slow way


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


# -- publishes decoded as columns (kvpool.cluster.master.bulk) --------------------------------------

_CHANGES: dict[str, Any] = {
    "tier": lambda r: {**r, "tier": "nvme"},                    # same width, another byte
    "nbytes": lambda r: {**r, "nbytes": r["nbytes"] + 1},
    "small checksum": lambda r: {**r, "header_sum": 7},          # msgpack encodes it shorter
    "no checksum": lambda r: {k: v for k, v in r.items() if k != "header_sum"},
    "short key": lambda r: {**r, "key": r["key"][:15]},
    "long key": lambda r: {**r, "key": r["key"] + b"x"},
    "durable": lambda r: {**r, "durable": 2},
    "location": lambda r: {**r, "location": {"offset": 5}},
    "order": lambda r: {"key": r["key"], **{k: v for k, v in r.items() if k != "key"}},
}


def _one_kind(n: int, sums: list[int], durable: int | None = None) -> list[dict[str, Any]]:
    spec = SPECS[1]
    records = [P.replica_record("dram", spec, spec.total_nbytes, key=i.to_bytes(16, "little"), header_sum=sums[i],
                                location={}, durable=durable) for i in range(n)]
    return records  # type: ignore[return-value]


@settings(max_examples=150, deadline=None, derandomize=True)
@pytest.mark.parametrize("op", [P.PUBLISH, P.REGISTER])
@given(n=st.integers(16, 40), sums=st.lists(st.integers(1 << 32, (1 << 64) - 1), min_size=40, max_size=40),
       changed=st.lists(st.tuples(st.integers(0, 39), st.sampled_from(sorted(_CHANGES))), max_size=2),
       durable=st.sampled_from([None, 3]), node_id=st.sampled_from(["n", "objects"]), objects_first=st.booleans())
def test_columns_decode_exactly_as_record_by_record(op: str, n: int, sums: list[int],
                                                    changed: list[tuple[int, str]], durable: int | None,
                                                    node_id: str, objects_first: bool) -> None:
    """A batch is taken as columns only when every record is the first one's but for key and
    checksum, and then it decodes to what the general decoder gives; one record changed in any
    field (or encoded in another order) sends the batch the general way."""
    records = _one_kind(n, sums, durable)
    changed = [(i, how) for i, how in changed if i < n]
    for i, how in changed:
        records[i] = _CHANGES[how](records[i])
    body: dict[str, Any] = {"node_id": node_id, "objects": records}
    if op == P.REGISTER:
        body.update(address="tcp://127.0.0.1:1", host_id="h", tiers=TIERS)
    if objects_first:  # not as MasterClient sends it: decoded the longer way
        body = {"objects": records, **{k: v for k, v in body.items() if k != "objects"}}
    frame = P.pack_request(7, op, body)
    general = P.unpack_request(frame)
    fast = bulk.unpack_columns(frame)
    assert (fast is not None) == (not changed)
    if fast is not None:
        columns = fast.body.objects
        assert isinstance(columns, bulk.RecordColumns) and len(columns) == n
        assert (fast.request_id, fast.op) == (general.request_id, general.op)
        assert [msgspec.structs.asdict(r) for r in columns.records()] == \
            [msgspec.structs.asdict(r) for r in general.body.objects]
        assert columns.durable_pairs() == [(r.key, r.durable) for r in general.body.objects if r.durable]
        rest = {f: getattr(fast.body, f) for f in fast.body.__struct_fields__ if f != "objects"}
        assert rest == {f: getattr(general.body, f) for f in general.body.__struct_fields__ if f != "objects"}


def test_columns_and_records_index_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same large batches, as columns and record by record, give the same index: new keys,
    keys this node re-publishes (new checksums), keys another node holds, repeats in a batch,
    durable copies; and the change stream replays the columns on a standby."""
    states = {}
    for way in ("columns", "records"):
        monkeypatch.setattr(bulk, "BULK_MIN_BYTES", 0 if way == "columns" else 1 << 60)
        state = MasterState(MasterSection())
        state.record_changes(ChangeLog())
        for node in ("a", "b"):
            body = {"node_id": node, "address": "tcp://127.0.0.1:1", "host_id": "h", "tiers": TIERS,
                    "role": "storage", "persistent_tiers": ["dram"]}
            state.handle(P.REGISTER, body)
        spec = SPECS[1]

        def publish(node: str, keys: range, salt: int, durable: int | None = None, *,
                    state: MasterState = state, spec: ObjectSpec = spec) -> None:
            objects = [P.replica_record("dram", spec, spec.total_nbytes, key=i.to_bytes(16, "little"),
                                        header_sum=(1 << 40) + i * 7 + salt, location={}, durable=durable)
                       for i in keys]
            frame = P.pack_request(1, P.PUBLISH, {"node_id": node, "objects": objects})
            request = bulk.unpack_bulk(frame) or P.unpack_request(frame)
            assert isinstance(request.body.objects, bulk.RecordColumns) == (way == "columns")
            state.handle(request.op, request.body)

        publish("a", range(0, 3000), 1)
        publish("a", range(1000, 4000), 2)          # re-published with new checksums, 1000 new
        publish("b", range(3500, 4500), 3, 2)       # 500 held by a: extra replicas; durable
        publish("a", list(range(4400, 4450)) * 2, 4)  # type: ignore[arg-type]  # repeats
        keys = [i.to_bytes(16, "little") for i in range(4600)]
        located = state.handle(P.LOCATE, {"keys": keys, "lease": False})["replicas"]
        states[way] = ([None if r is None else sorted((x["node_id"], _comparable(x)) for x in r) for r in located],
                       state.handle(P.STATS, {})["replicas"], dict(state.durable))
        standby = MasterState(MasterSection())
        reply = answer_follow(state, S.Follow(stream="", since=0))
        assert "snapshot" in reply  # a new follower starts from a snapshot ...
        reply = answer_follow(state, S.Follow(stream=reply["stream"], since=0))
        assert "changes" in reply  # ... but the log from change 0 still holds everything: replay it
        kinds = set()
        for change in reply["changes"]:
            decoded = msgspec.msgpack.decode(change)
            kinds.add(decoded[0])
            apply_change(standby, decoded)
        assert ("addc" in kinds) == (way == "columns")

        def everything(state: MasterState, keys: list[bytes] = keys) -> Any:
            located = state.handle(P.LOCATE, {"keys": keys, "lease": False})["replicas"]
            return ([None if r is None else sorted((x["node_id"], _comparable(x)) for x in r) for r in located],
                    state.handle(P.STATS, {})["replicas"], dict(state.durable))

        assert everything(standby) == everything(state) == states[way]
    assert states["columns"] == states["records"]
    # 4500 keys; b's copies of 500 of a's keys, and a's of 50 of b's
    assert states["columns"][1] == 4500 + 500 + 50 and len(states["columns"][2]) == 1000


def test_the_scale_bench_sends_a_real_nodes_bytes() -> None:
    """bench/scale_bench.py builds its nodes' publishes with numpy; every record must be byte
    for byte what a real node's MasterClient sends for that key and checksum."""
    from bench.scale_bench import RecordFrames, bench_key

    spec = SPECS[1]
    frames = RecordFrames(spec)
    raw = bytes(frames.batch(100, 120))
    columns = bulk.record_columns(msgspec.Raw(raw))
    assert columns is not None
    sums = columns.sums.tolist()
    real = [P.replica_record("dram", spec, spec.total_nbytes, key=bench_key(i), header_sum=sums[i - 100],
                             location={}) for i in range(100, 120)]
    assert raw == msgspec.msgpack.encode(real)
    assert len(set(sums)) == 20 and min(sums) >= 1 << 32


@settings(max_examples=60, deadline=None, derandomize=True)
@given(capacity_bits=st.integers(4, 12), fill=st.floats(0.05, 0.97), removed=st.floats(0, 0.5),
       seed=st.integers(0, 2**32 - 1), chunk_bits=st.integers(2, 18))
def test_a_doubling_rebuild_keeps_every_key_findable(capacity_bits: int, fill: float, removed: float, seed: int,
                                                     chunk_bits: int) -> None:
    """The rebuild into a table twice the size places keys without probing (sorted runs); every
    key stays findable by both probes, each one's slots from its home on are all taken (linear
    probing's rule), and the records travel with their keys."""
    import numpy as np

    from kvpool.cluster.master import index as ix

    rng = np.random.default_rng(seed)
    capacity = 1 << capacity_bits
    index = KeyIndex(capacity=capacity)
    n = int(capacity * fill)
    keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(n)]
    keys = list(dict.fromkeys(keys))
    sid = index.encode("dram", SPECS[0].to_wire(), SPECS[0].total_nbytes, 1, None)[0]
    nodes = [index.node_index(f"n{i}") for i in range(3)]
    for i in range(0, len(keys), 7):  # fuller than MAX_LOAD lets it: long runs, probes past the end
        lo, hi = split_keys(keys[i:i + 7])
        ids = np.arange(i, i + lo.size)
        index._place(lo, hi, np.array(nodes, np.uint16)[ids % 3], np.full(lo.size, sid, np.uint32),
                     (ids + 1).astype(np.uint64), None)
        index.replicas += lo.size
        for j in ids.tolist():
            index._node_counts[nodes[j % 3]] += 1
    gone = set(keys[:int(len(keys) * removed)])
    for key in gone:
        index.pop(key)
    old_chunk, ix.REBUILD_CHUNK = ix.REBUILD_CHUNK, 1 << chunk_bits
    try:
        index._rebuild(index.capacity * 2)
    finally:
        ix.REBUILD_CHUNK = old_chunk
    live = [k for k in keys if k not in gone]
    assert len(index) == len(live) and index._tombs == 0
    if keys:
        assert index.contains_many(keys) == [k not in gone for k in keys] == [k in index for k in keys]
    for i, key in enumerate(keys):
        if key not in gone:
            s = index._find(key)[0]
            assert (index.node_ids[index._nd[s]], index._hs[s]) == (f"n{i % 3}", i + 1)
    nd = index.nd
    for s in np.flatnonzero((nd != ix.EMPTY) & (nd != ix.TOMB)).tolist():
        home = ix.slot_hash(index._k0[s], index._k1[s]) & index._mask
        assert all(nd[(home + d) & index._mask] != ix.EMPTY for d in range(((s - home) & index._mask) + 1))
