from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool import errors
from kvpool.objformat import LayerRange, byte_view, spec_of
from tiers.cxl import CxlTier
from tiers.dram import DramTier
from tiers.manager import TierManager
from tiers.nvme import NvmeTier
from tiers.policy import LRUPolicy, S3FIFOPolicy

KiB = 1024


def kv(layers: int, tokens: int, seed: int) -> np.ndarray:
    """uint8 KV of layers * tokens * 128 bytes (kv(4, 128, s) is 64 KiB)."""
    return np.random.default_rng(seed).integers(0, 255, (layers, 2, tokens, 2, 32), dtype=np.uint8)


def put(manager: TierManager, key: bytes, arr: np.ndarray) -> str:
    spec, arr = spec_of(arr)
    return manager.put(key, spec, byte_view(arr))


def read(manager: TierManager, key: bytes) -> np.ndarray | None:
    obj = manager.pin(key)
    if obj is None:
        return None
    try:
        out = np.empty(obj.spec.shape, dtype=np.uint8)
        obj.read_layers(LayerRange(0, obj.spec.layers), byte_view(out))
        return out
    finally:
        manager.unpin(obj)


def make_manager(*capacities: int, policy: str = "lru", **kw) -> TierManager:
    return TierManager([DramTier(c, mlock=False) for c in capacities], policy=policy, **kw)


def test_put_lands_in_top_tier_and_pressure_demotes_coldest() -> None:
    manager = make_manager(256 * KiB, 1024 * KiB)
    objs = {b"k%d" % i: kv(4, 128, i) for i in range(6)}  # 64 KiB + header each
    for key, arr in objs.items():
        assert put(manager, key, arr) == "dram"
    top = [k for k in objs if manager._index[k].tier == 0]
    low = [k for k in objs if manager._index[k].tier == 1]
    assert low == [b"k0", b"k1", b"k2"] and len(top) == 3  # the coldest went down
    assert manager.counters["demotions"] == 3
    for key, arr in objs.items():
        np.testing.assert_array_equal(read(manager, key), arr)


def test_bottom_tier_drops_coldest_and_capacity_is_never_exceeded() -> None:
    manager = make_manager(200 * KiB, 200 * KiB)
    for i in range(20):
        put(manager, b"k%d" % i, kv(4, 128, i))
        for tier in manager.tiers:
            assert tier.used_bytes <= tier.capacity_bytes
    assert manager.counters["evictions"] > 0
    assert read(manager, b"k0") is None
    np.testing.assert_array_equal(read(manager, b"k19"), kv(4, 128, 19))


def test_pinned_object_is_not_evicted_under_its_reader() -> None:
    manager = make_manager(140 * KiB)  # room for two objects
    put(manager, b"a", kv(4, 128, 1))
    obj = manager.pin(b"a")
    assert obj is not None
    put(manager, b"b", kv(4, 128, 2))
    put(manager, b"c", kv(4, 128, 3))  # must evict b, not the pinned a
    assert b"a" in manager and b"b" not in manager
    with pytest.raises(errors.PoolFullError):
        pinned_c = manager.pin(b"c")
        try:
            put(manager, b"d", kv(4, 128, 4))
        finally:
            manager.unpin(pinned_c)
    manager.unpin(obj)


def test_delete_while_reading_frees_space_on_last_unpin() -> None:
    manager = make_manager(140 * KiB)
    put(manager, b"a", kv(4, 128, 1))
    used = manager.tiers[0].used_bytes
    obj = manager.pin(b"a")
    manager.delete(b"a")
    assert b"a" not in manager
    assert manager.tiers[0].used_bytes == used  # the reader's bytes stay put
    out = np.empty(obj.spec.shape, dtype=np.uint8)
    obj.read_layers(LayerRange(0, 4), byte_view(out))
    np.testing.assert_array_equal(out, kv(4, 128, 1))
    manager.unpin(obj)
    assert manager.tiers[0].used_bytes == 0
    with pytest.raises(errors.KeyNotFoundError):
        manager.delete(b"a")


def test_promotion_needs_repeated_hits() -> None:
    manager = make_manager(140 * KiB, 1024 * KiB, promote_min_hits=2)
    for i in range(4):
        put(manager, b"k%d" % i, kv(4, 128, i))
    assert manager._index[b"k0"].tier == 1
    read(manager, b"k0")
    assert manager._index[b"k0"].tier == 1  # a one-off read does not churn
    read(manager, b"k0")
    assert manager._index[b"k0"].tier == 0
    assert manager.counters["promotions"] == 1
    np.testing.assert_array_equal(read(manager, b"k0"), kv(4, 128, 0))


def test_promotion_can_be_disabled() -> None:
    manager = make_manager(140 * KiB, 1024 * KiB, promote=False)
    for i in range(4):
        put(manager, b"k%d" % i, kv(4, 128, i))
    for _ in range(5):
        read(manager, b"k0")
    assert manager._index[b"k0"].tier == 1


def test_overwrite_replaces_content_and_space() -> None:
    manager = make_manager(1024 * KiB)
    put(manager, b"a", kv(4, 128, 1))
    put(manager, b"a", kv(2, 128, 2))
    np.testing.assert_array_equal(read(manager, b"a"), kv(2, 128, 2))
    assert manager.tiers[0].used_bytes == manager.tiers[0].allocated_size(manager.header(b"a").spec.total_nbytes)


def test_lru_order() -> None:
    policy = LRUPolicy(100)
    for key in (b"a", b"b", b"c"):
        policy.insert(key, 10)
    policy.touch(b"a")
    assert policy.victim(lambda k: False) == b"b"
    assert policy.victim(lambda k: k == b"c") == b"a"


def test_s3fifo_resists_a_scan() -> None:
    """A hot set read twice survives a long one-pass scan; under LRU it would not."""
    for cls, survives in ((S3FIFOPolicy, True), (LRUPolicy, False)):
        policy = cls(100 * 10)
        resident: set[bytes] = set()

        def admit(key: bytes) -> None:
            while len(resident) >= 100:
                resident.discard(policy.victim(lambda k: False))
            policy.insert(key, 10)
            resident.add(key)

        hot = [b"hot%d" % i for i in range(20)]
        for key in hot:
            admit(key)
        for key in hot:
            policy.touch(key)
        for i in range(500):
            admit(b"scan%d" % i)
        assert all(k in resident for k in hot) is survives, cls.__name__


class ManagerMachine(RuleBasedStateMachine):
    """Random puts/gets/deletes/pins over three small tiers: capacity is never
    exceeded, accounting is exact, and every get is bit-exact or a miss."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(160 * KiB, 240 * KiB, 320 * KiB, policy=self.policy)
        self.expected: dict[bytes, np.ndarray] = {}
        self.pinned: list = []

    policy = "lru"

    @rule(key=st.sampled_from([b"k%d" % i for i in range(12)]), layers=st.integers(1, 6),
          tokens=st.sampled_from([16, 64, 128]), seed=st.integers(0, 1000))
    def put(self, key: bytes, layers: int, tokens: int, seed: int) -> None:
        arr = kv(layers, tokens, seed)
        try:
            put(self.manager, key, arr)
        except errors.PoolFullError:
            return
        self.expected[key] = arr

    @rule(key=st.sampled_from([b"k%d" % i for i in range(12)]))
    def get(self, key: bytes) -> None:
        got = read(self.manager, key)
        if got is not None:
            np.testing.assert_array_equal(got, self.expected[key])

    @rule(key=st.sampled_from([b"k%d" % i for i in range(12)]))
    def delete(self, key: bytes) -> None:
        if key in self.manager:
            self.manager.delete(key)
            del self.expected[key]
        else:
            with pytest.raises(errors.KeyNotFoundError):
                self.manager.delete(key)

    @precondition(lambda self: len(self.pinned) < 2)
    @rule(key=st.sampled_from([b"k%d" % i for i in range(12)]))
    def pin(self, key: bytes) -> None:
        obj = self.manager.pin(key)
        if obj is not None:
            self.pinned.append((obj, self.expected[key]))

    @precondition(lambda self: self.pinned)
    @rule()
    def unpin(self) -> None:
        obj, arr = self.pinned.pop(0)
        out = np.empty(obj.spec.shape, dtype=np.uint8)
        obj.read_layers(LayerRange(0, obj.spec.layers), byte_view(out))
        np.testing.assert_array_equal(out, arr)  # never changed under its reader
        self.manager.unpin(obj)

    @invariant()
    def capacity_and_accounting_are_exact(self) -> None:
        pinned_doomed = {id(o._entry): o._entry for o, _ in self.pinned if o._entry.doomed}
        for index, tier in enumerate(self.manager.tiers):
            assert tier.used_bytes <= tier.capacity_bytes
            live = sum(tier.allocated_size(e.header.spec.total_nbytes)
                       for e in self.manager._index.values()
                       if e.tier == index or (e.backing is not None and e.backing[0] == index))
            doomed = sum(tier.allocated_size(e.header.spec.total_nbytes)
                         for e in pinned_doomed.values() if e.tier == index)
            assert tier.used_bytes == live + doomed
        assert set(self.manager.keys()) <= set(self.expected)

    def teardown(self) -> None:
        for obj, _ in self.pinned:
            self.manager.unpin(obj)
        self.manager.close()


class S3FIFOMachine(ManagerMachine):
    policy = "s3fifo"


class RealTiersMachine(ManagerMachine):
    """The same rules over dram -> cxl (shared-memory file) -> nvme (O_DIRECT files + LMDB)."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.dir = tempfile.TemporaryDirectory(prefix="kvpool-machine-", dir="/var/tmp")
        root = Path(self.dir.name)
        self.manager = TierManager([
            DramTier(160 * KiB, mlock=False),
            CxlTier(root / "cxl", 240 * KiB),
            NvmeTier(root / "nvme", 512 * KiB, segment_size=256 * KiB, io_chunk=64 * KiB),
        ], policy="s3fifo")
        self.expected = {}
        self.pinned = []

    def teardown(self) -> None:
        super().teardown()
        self.dir.cleanup()


_settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestManagerLRU = ManagerMachine.TestCase
TestManagerLRU.settings = _settings
TestManagerS3FIFO = S3FIFOMachine.TestCase
TestManagerS3FIFO.settings = _settings
TestManagerRealTiers = RealTiersMachine.TestCase
TestManagerRealTiers.settings = settings(max_examples=25, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


# -- promotion keeps the persistent copy; eviction asks outside the lock ------------------------


def _dram_over_nvme(tmp_path: Path, dram_bytes: int = 512 * KiB, nvme_bytes: int = 8 << 20, **kw) -> TierManager:
    return TierManager([DramTier(dram_bytes, mlock=False),
                        NvmeTier(tmp_path / "nvme", nvme_bytes, segment_size=min(8 << 20, nvme_bytes))],
                       promote_min_hits=2, **kw)


def put_durable(manager: TierManager, key: bytes, arr: np.ndarray) -> str:
    spec, arr = spec_of(arr)
    return manager.put(key, spec, byte_view(arr), persistent=True)


def test_promotion_out_of_nvme_copies_and_the_object_survives_a_restart(tmp_path: Path) -> None:
    manager = _dram_over_nvme(tmp_path)
    objs = {b"hot-%d" % i: kv(4, 64, i) for i in range(4)}
    for key, arr in objs.items():
        assert put_durable(manager, key, arr) == "nvme"
    for _ in range(3):  # hits promote them to dram
        for key, arr in objs.items():
            np.testing.assert_array_equal(read(manager, key), arr)
    assert manager.counters["promotions"] == 4
    assert all(manager._index[k].tier == 0 and manager._index[k].backing is not None for k in objs)
    manager.close()  # a restart: dram is gone, the nvme copies are not
    manager = _dram_over_nvme(tmp_path)
    try:
        for key, arr in objs.items():
            np.testing.assert_array_equal(read(manager, key), arr)
    finally:
        manager.close()


def test_demoting_a_promoted_object_frees_only_the_upper_copy(tmp_path: Path) -> None:
    manager = _dram_over_nvme(tmp_path, dram_bytes=160 * KiB)
    try:
        objs = {b"k%d" % i: kv(4, 64, i) for i in range(4)}  # ~32 KiB each: 4 fit in dram
        for key, arr in objs.items():
            put_durable(manager, key, arr)
            for _ in range(3):
                read(manager, key)
        nvme_used = manager.tiers[1].used_bytes
        more = {b"m%d" % i: kv(4, 64, 10 + i) for i in range(4)}
        for key, arr in more.items():
            put_durable(manager, key, arr)
            for _ in range(3):
                read(manager, key)  # promoted, pushing the older ones out of dram
        assert manager.counters["demotions"] >= 1
        assert manager.tiers[1].used_bytes == nvme_used + sum(
            manager.tiers[1].allocated_size(manager._index[k].header.spec.total_nbytes) for k in more)
        for key, arr in {**objs, **more}.items():
            np.testing.assert_array_equal(read(manager, key), arr)
        manager.delete(b"k0")  # both copies go
        assert read(manager, b"k0") is None
    finally:
        manager.close()


def test_bottom_tier_asks_for_its_victims_in_one_batch_outside_the_lock() -> None:
    manager = make_manager(512 * KiB)
    calls: list[list[bytes]] = []
    leased = {b"k1"}

    def may_drop_many(keys: list[bytes]) -> set[bytes]:
        assert not manager._lock._is_owned()  # type: ignore[attr-defined]
        calls.append(list(keys))
        return {k for k in keys if k not in leased}

    manager.may_drop_many = may_drop_many
    objs = {b"k%d" % i: kv(4, 128, i) for i in range(7)}  # 64 KiB + header each: 7 fit
    for key, arr in objs.items():
        put(manager, key, arr)
    assert calls == []
    big = kv(4, 128 * 3, 99)  # needs three victims' room
    put(manager, b"big", big)
    assert calls and len(calls[0]) >= 3  # one batch
    assert b"k1" in manager and b"k0" not in manager  # the leased one stayed, the coldest went
    np.testing.assert_array_equal(read(manager, b"big"), big)
    np.testing.assert_array_equal(read(manager, b"k1"), objs[b"k1"])


def test_a_victim_pinned_while_the_master_was_asked_stays_and_is_republished() -> None:
    manager = make_manager(512 * KiB)
    republished: list[bytes] = []

    class Listener:
        def stored(self, *a) -> None: ...
        def moved(self, key, *a) -> None: republished.append(key)
        def removed(self, key, reason) -> None: ...

    manager.listener = Listener()  # type: ignore[assignment]
    pinned = []

    def may_drop_many(keys: list[bytes]) -> set[bytes]:
        if not pinned:
            pinned.append(manager.pin(keys[0]))  # a reader arrives while the master answers
        return set(keys)

    manager.may_drop_many = may_drop_many
    objs = {b"k%d" % i: kv(4, 128, i) for i in range(7)}
    for key, arr in objs.items():
        put(manager, key, arr)
    put(manager, b"new", kv(4, 128, 50))
    first = pinned[0]
    assert first is not None and first.key in manager  # it stayed under its reader
    assert first.key in republished  # and the master was told it is still here
    out = np.empty(first.spec.shape, dtype=np.uint8)
    first.read_layers(LayerRange(0, first.spec.layers), byte_view(out))
    np.testing.assert_array_equal(out, objs[first.key])
    manager.unpin(first)


def test_durable_copies_are_never_evicted_for_room_and_a_full_tier_refuses_new_ones(tmp_path: Path) -> None:
    """nvme holds durable copies and plain objects: making room drops only plain ones (also
    backing copies of promoted durable objects stay); once it is all durable copies a new put
    is PoolFullError, and every durable copy reads back exact. After a restart protect() (what a
    node does with its durable.log) restores the rule; a corrupt durable copy is counted."""
    manager = _dram_over_nvme(tmp_path, dram_bytes=64 * KiB, nvme_bytes=1024 * KiB)
    durable = {b"d%d" % i: kv(4, 64, i) for i in range(6)}  # ~33 KiB each with its header
    try:
        for key, arr in durable.items():
            assert put_durable(manager, key, arr) == "nvme"
        for _ in range(3):  # promote two: their nvme copies become backing copies
            for key in (b"d0", b"d1"):
                read(manager, key)
        plain = {b"p%d" % i: kv(4, 64, 100 + i) for i in range(40)}  # far more than fits
        for key, arr in plain.items():
            put(manager, key, arr)  # demoted into nvme, then dropped from it
        assert manager.counters["evictions"] > 0
        for key, arr in durable.items():
            np.testing.assert_array_equal(read(manager, key), arr)
        with pytest.raises(errors.PoolFullError):
            for i in range(40):
                put_durable(manager, b"more-%d" % i, kv(4, 64, 200 + i))
        for key, arr in durable.items():
            np.testing.assert_array_equal(read(manager, key), arr)
        assert manager.counters["durable_dropped"] == 0
    finally:
        manager.close()
    manager = _dram_over_nvme(tmp_path, dram_bytes=64 * KiB, nvme_bytes=1024 * KiB)
    try:
        assert manager.protect(list(durable)) == len(durable)
        for i in range(40):
            put(manager, b"plain-again-%d" % i, kv(4, 64, 300 + i))
        for key, arr in durable.items():
            np.testing.assert_array_equal(read(manager, key), arr)
        obj = manager.pin(b"d3")
        assert obj is not None
        manager.unpin(obj)
        manager.discard_corrupt(obj)  # as a reader that found its checksum wrong
        assert manager.counters["durable_dropped"] == 1 and read(manager, b"d3") is None
    finally:
        manager.close()
