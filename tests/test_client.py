"""kvpool.connect() as a user meets it first: what its failure to reach a master costs."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

import kvpool
from kvpool import errors
from tests.conftest import free_tcp_port

pytestmark = pytest.mark.timeout(60)


def test_connect_to_a_dead_master_takes_the_timeout_it_names(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Nobody listens: one ping, MasterUnreachableError naming request_timeout_s, and no second
    wait to deregister a node the master never registered."""
    settings = {"pool": {"data_dir": str(tmp_path)}, "master": {"request_timeout_s": 1.5},
                "tiers": {"dram": {"capacity": "4MiB", "mlock": False}, "cxl": {"capacity": "4MiB"}},
                "security": {"key_file": str(tmp_path / "cluster.key")}}
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="kvpool"):
        with pytest.raises(errors.MasterUnreachableError, match="within 1.5 s"):
            kvpool.connect(f"tcp://127.0.0.1:{free_tcp_port()}", config=settings)
    elapsed = time.monotonic() - started
    assert "deregister" not in caplog.text and "leave" not in caplog.text
    assert elapsed < 1.5 + 2.5, elapsed  # the named timeout plus opening the local pool, not 2-3 of them
