from __future__ import annotations

import logging

import pytest

from kvpool.testing import TierTests
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


def test_the_memlock_warning_says_how_to_raise_the_limit_once_per_process(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import tiers.dram as dram

    monkeypatch.setattr(dram, "_memlock_warned", False)
    monkeypatch.setattr(dram, "mlock_region", lambda address, nbytes: (4096, "RLIMIT_MEMLOCK allows 4096 bytes"))
    with caplog.at_level(logging.DEBUG, logger="tiers.dram"):
        tiers_made = [dram.DramTier(1 << 20, mlock=True, prefault=False) for _ in range(2)]
    for tier in tiers_made:
        tier.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "ulimit -l unlimited" in warnings[0].getMessage() and "LimitMEMLOCK" in warnings[0].getMessage()
