"""The conformance suite every tier passes: a new tier is one module plus one test class.

Subclass :class:`TierTests` in a pytest module and provide ``make_tier``::

    from kvpool.testing import TierTests

    class TestMyTier(TierTests):
        def make_tier(self, tmp_path, capacity_bytes):
            return MyTier(tmp_path / "my", capacity_bytes)

Every tier runs the core tests (exact capacity, reuse of freed space, headers
stored with objects, refused bad buffers, closed tiers, stats, concurrent use of
distinct extents, the sharing hooks). Tests of optional capabilities run where
the tier declares them: ``persistent`` (objects committed before a close are
recovered bit-exact by a tier made again on the same path, forgotten ones are
not), ``supports_views`` (views are of the stored bytes, without a copy) and
``verifies_reads`` (a flipped stored byte is a ChecksumError, never data).
Mirrors zarr's StoreTests. Needs pytest (a test dependency, not a runtime one).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool import errors
from kvpool.objformat import LayerRange, ObjectHeader, byte_view, layer_checksums, spec_of
from tiers.base import Extent, Tier

CAPACITY = 4 << 20


def make_object(layers: int = 4, tokens: int = 16, seed: int = 0,
                dtype: str = "float16") -> tuple[np.ndarray, ObjectHeader, memoryview]:
    rng = np.random.default_rng(seed)
    arr = rng.standard_normal((layers, 2, tokens, 2, 32)).astype(dtype)
    spec, arr = spec_of(arr)
    payload = byte_view(arr)
    return arr, ObjectHeader.for_key(f"obj-{seed}".encode(), spec, layer_checksums(payload, spec.layer_nbytes)), payload


def store(tier: Tier, header: ObjectHeader, payload: Any) -> Extent:
    extent = tier.allocate(header.spec.total_nbytes)
    assert extent is not None
    tier.write_object(extent, header, payload)
    return extent


class TierTests:
    """Subclasses set ``make_tier(self, tmp_path, capacity_bytes) -> Tier``."""

    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> Tier:  # pragma: no cover
        raise NotImplementedError

    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[Tier]:
        tier = self.make_tier(tmp_path, CAPACITY)
        yield tier
        tier.close()

    def test_round_trip_whole_and_layer_ranges(self, tier: Tier) -> None:
        arr, header, payload = make_object(layers=6)
        extent = store(tier, header, payload)
        for rng in (LayerRange(0, 6), LayerRange(2, 5), LayerRange(5, 6)):
            out = np.empty(header.spec.array_shape(rng), dtype=arr.dtype)
            tier.read_layers(extent, header, rng, byte_view(out))
            np.testing.assert_array_equal(out, arr[rng.start:rng.stop])

    def test_header_is_stored_with_the_object(self, tier: Tier) -> None:
        _, header, payload = make_object()
        extent = store(tier, header, payload)
        buf = bytearray(header.nbytes)
        tier.read_into(extent, 0, memoryview(buf))
        assert ObjectHeader.unpack(buf) == header

    def test_capacity_is_exact(self, tier: Tier) -> None:
        _, header, payload = make_object(tokens=64)
        extents = []
        while (extent := tier.allocate(header.spec.total_nbytes)) is not None:
            tier.write_object(extent, header, payload)
            extents.append(extent)
            assert tier.used_bytes <= tier.capacity_bytes
        assert len(extents) == tier.capacity_bytes // tier.allocated_size(header.spec.total_nbytes)
        assert tier.free_bytes < tier.allocated_size(header.spec.total_nbytes)
        tier.free(extents[0])
        assert tier.allocate(header.spec.total_nbytes) is not None

    def test_freed_space_is_reused_under_mixed_churn(self, tier: Tier) -> None:
        rnd = random.Random(7)
        live: list[Extent] = []
        for _ in range(400):
            if live and (rnd.random() < 0.5 or tier.free_bytes < 600_000):
                tier.free(live.pop(rnd.randrange(len(live))))
                continue
            extent = tier.allocate(rnd.choice([4096, 50_000, 131_072, 300_000, 555_555]))
            if extent is not None:
                live.append(extent)
            assert tier.used_bytes <= tier.capacity_bytes
        for extent in live:
            tier.free(extent)
        assert tier.used_bytes == 0
        # Everything coalesced back into one block: the largest object whose
        # allocated size (per-object overhead included, e.g. nvme's record prefix) is the capacity.
        overhead = tier.allocated_size(1) - tier.alignment
        whole = tier.allocate(tier.capacity_bytes - overhead)
        assert whole is not None

    def test_object_larger_than_tier_never_fits(self, tier: Tier) -> None:
        assert not tier.fits_ever(tier.capacity_bytes + 1)
        assert tier.allocate(tier.capacity_bytes + 1) is None

    def test_out_buffer_of_wrong_size_is_refused(self, tier: Tier) -> None:
        _, header, payload = make_object()
        extent = store(tier, header, payload)
        with pytest.raises(errors.OutBufferError):
            tier.read_layers(extent, header, LayerRange(0, 2), bytearray(10))

    def test_closed_tier_refuses_work(self, tmp_path: Path) -> None:
        tier = self.make_tier(tmp_path, CAPACITY)
        tier.close()
        with pytest.raises(errors.PoolClosedError):
            tier.allocate(100)

    def test_stats_report_usage(self, tier: Tier) -> None:
        _, header, payload = make_object()
        store(tier, header, payload)
        stats = tier.stats()
        assert stats["tier"] == tier.name
        assert stats["capacity_bytes"] == tier.capacity_bytes
        assert stats["used_bytes"] == tier.allocated_size(header.spec.total_nbytes)

    # -- concurrent use ---------------------------------------------------------------

    def test_distinct_extents_are_written_and_read_concurrently(self, tier: Tier) -> None:
        objects = [make_object(layers=3, tokens=32, seed=100 + i) for i in range(8)]
        extents = [store(tier, header, payload) for _, header, payload in objects]
        failures: list[BaseException] = []

        def work(i: int) -> None:
            arr, header, payload = objects[i]
            try:
                for _ in range(20):
                    tier.write_object(extents[i], header, payload)
                    out = np.empty_like(arr)
                    tier.read_layers(extents[i], header, LayerRange(0, header.spec.layers), byte_view(out))
                    np.testing.assert_array_equal(out, arr)
            except BaseException as exc:  # reported below, on the test's thread
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(objects))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures, failures[0]

    def test_sharing_hooks_have_the_declared_shapes(self, tier: Tier) -> None:
        _, header, payload = make_object()
        extent = store(tier, header, payload)
        assert isinstance(tier.location(extent), dict)
        info = tier.arena_info()
        assert info is None or isinstance(info, dict)

    # -- optional capabilities ----------------------------------------------------------

    def test_views_are_the_stored_bytes_without_a_copy(self, tier: Tier) -> None:
        if not tier.supports_views:
            pytest.skip(f"{tier.name} does not expose its bytes in place")
        arr, header, payload = make_object(layers=2)
        extent = store(tier, header, payload)
        view = tier.view(extent, header.nbytes, header.spec.payload_nbytes)
        assert bytes(view) == bytes(payload)
        changed = np.full(16, 0x5A, np.uint8)
        tier.write(extent, header.nbytes, changed.data)  # a later write shows through the same view
        assert bytes(view[:16]) == changed.tobytes()

    def test_a_flipped_stored_byte_is_a_checksum_error(self, tier: Tier) -> None:
        if not tier.verifies_reads:
            pytest.skip(f"{tier.name} does not verify reads (memory that does not rot)")
        arr, header, payload = make_object(layers=4)
        extent = store(tier, header, payload)
        spot = header.spec.layer_bytes(LayerRange(2, 3)).offset + 5
        original = bytearray(1)
        tier.read_into(extent, spot, memoryview(original))
        tier.write(extent, spot, bytes([original[0] ^ 0xFF]))
        out = np.empty(header.spec.array_shape(LayerRange(2, 3)), dtype=arr.dtype)
        with pytest.raises(errors.ChecksumError):
            tier.read_layers(extent, header, LayerRange(2, 3), byte_view(out))
        good = np.empty(header.spec.array_shape(LayerRange(0, 2)), dtype=arr.dtype)
        tier.read_layers(extent, header, LayerRange(0, 2), byte_view(good))  # other layers still read
        np.testing.assert_array_equal(good, arr[0:2])

    def test_committed_objects_survive_a_reopen_and_forgotten_ones_do_not(self, tmp_path: Path) -> None:
        tier = self.make_tier(tmp_path, CAPACITY)
        if not tier.persistent:
            tier.close()
            pytest.skip(f"{tier.name} is not persistent")
        kept = {}
        try:
            for i in range(3):
                arr, header, payload = make_object(layers=2, tokens=16, seed=200 + i)
                key = f"obj-{200 + i}".encode()
                extent = store(tier, header, payload)
                tier.commit(key, extent, header)
                kept[key] = (extent, arr)
            gone_key = b"obj-200"
            gone_extent, _ = kept.pop(gone_key)
            tier.forget(gone_key, gone_extent)
            tier.free(gone_extent)
        finally:
            tier.close()
        reopened = self.make_tier(tmp_path, CAPACITY)
        try:
            found = {key: (extent, header) for key, extent, header in reopened.recover()}
            assert set(found) == set(kept)
            for key, (extent, header) in found.items():
                out = np.empty(header.spec.array_shape(), dtype=kept[key][1].dtype)
                reopened.read_layers(extent, header, LayerRange(0, header.spec.layers), byte_view(out))
                np.testing.assert_array_equal(out, kept[key][1])
        finally:
            reopened.close()
