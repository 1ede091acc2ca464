from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from kvpool.testing import TierTests
from tiers.dram import DramTier
from tiers.hbm import cuda_unavailable_reason

# With a CUDA device the arena is CuPy pinned memory, allocated and locked whole at start
# (tiers/dram.py): what these tests check is the host path's lazy mapping and mlock.
host_arena = pytest.mark.skipif(cuda_unavailable_reason() is None,
                                reason="with CUDA the dram arena is pinned whole at start")


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


@host_arena
def test_the_memlock_advice_is_one_line_once_per_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Every pool of every process hits the same limit: the first says how to raise it (one line),
    a marker in the user's state dir keeps the others (in this and later processes) quiet."""
    import tiers.dram as dram

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(dram, "_memlock_warned", False)
    monkeypatch.setattr(dram, "mlock_region", lambda address, nbytes: (4096, "RLIMIT_MEMLOCK allows 4096 bytes"))
    with caplog.at_level(logging.DEBUG, logger="tiers.dram"):
        for _ in range(2):
            tier = dram.DramTier(1 << 20, mlock=True)
            assert tier.locked_bytes == 0  # nothing is locked (or faulted) before it is used
            assert tier.allocate(4096) is not None
            assert tier.locked_bytes == 4096 and "RLIMIT_MEMLOCK" in tier.stats()["lock_note"]
            tier.close()
        monkeypatch.setattr(dram, "_memlock_warned", False)  # as a new process on this host
        tier = dram.DramTier(1 << 20, mlock=True)
        tier.allocate(4096)
        tier.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "ulimit -l unlimited" in warnings[0] and "LimitMEMLOCK" in warnings[0]
    assert "once on this host" in warnings[0]
    assert dram.advice_marker().parent == tmp_path / "kvpool"


@host_arena
def test_a_pool_maps_what_it_uses(tmp_path: Path) -> None:
    """A 256 MiB dram tier costs nothing at start; its pages come with the objects."""
    def rss_bytes() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss_bytes()
    tier = DramTier(256 << 20, mlock=False)
    try:
        assert rss_bytes() - before < 32 << 20
        extent = tier.allocate(64 << 20)
        assert extent is not None
        tier.write(extent, 0, np.ones(64 << 20, np.uint8))
        assert rss_bytes() - before >= 60 << 20
    finally:
        tier.close()


def test_prefault_readies_the_whole_arena_at_start() -> None:
    tier = DramTier(8 << 20, mlock=False, prefault=True)
    try:
        assert tier.ready_bytes == tier.capacity_bytes
    finally:
        tier.close()
