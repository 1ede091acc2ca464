from __future__ import annotations

from tests.tiers.tier_suite import TierTests
from tiers.dram import DramTier


class TestDramTier(TierTests):
    def make_tier(self, tmp_path, capacity_bytes):
        return DramTier(capacity_bytes)


def test_dram_reports_locked_bytes_without_failing() -> None:
    tier = DramTier(64 << 20)
    try:
        stats = tier.stats()
        assert 0 <= stats["locked_bytes"] <= tier.capacity_bytes
        assert stats["lock_note"]
    finally:
        tier.close()
