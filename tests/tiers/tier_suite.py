"""Conformance suite every tier passes (subclass ``TierTests``, provide ``make_tier``).

Mirrors zarr's StoreTests: one definition of what a tier must do, run against
each backend.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvpool import errors
from kvpool.objformat import LayerRange, ObjectHeader, byte_view, layer_checksums, spec_of
from tiers.base import Tier

CAPACITY = 4 << 20


def make_object(layers: int = 4, tokens: int = 16, seed: int = 0, dtype: str = "float16"):
    rng = np.random.default_rng(seed)
    arr = rng.standard_normal((layers, 2, tokens, 2, 32)).astype(dtype)
    spec, arr = spec_of(arr)
    payload = byte_view(arr)
    return arr, ObjectHeader.for_key(f"obj-{seed}".encode(), spec, layer_checksums(payload, spec.layer_nbytes)), payload


def store(tier: Tier, header: ObjectHeader, payload) -> object:
    extent = tier.allocate(header.spec.total_nbytes)
    assert extent is not None
    tier.write_object(extent, header, payload)
    return extent


class TierTests:
    """Subclasses set ``make_tier(self, tmp_path, capacity_bytes) -> Tier``."""

    def make_tier(self, tmp_path, capacity_bytes: int) -> Tier:  # pragma: no cover
        raise NotImplementedError

    @pytest.fixture
    def tier(self, tmp_path):
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
        live = []
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

    def test_closed_tier_refuses_work(self, tmp_path) -> None:
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
