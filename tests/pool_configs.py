"""Small pool configurations for tests (every tier tiny, files under a tmp dir)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.config import Config

MiB = 1 << 20
ALL_TIERS = ("hbm", "dram", "cxl", "nvme")


def small_config(tmp_path: Path, tiers: tuple[str, ...] = ALL_TIERS, *, name: str | None = None,
                 **capacities: int) -> Config:
    """A Config with only ``tiers`` enabled, each a few MiB, nvme and cxl under ``tmp_path``."""
    sizes = {"hbm": 1 * MiB, "dram": 2 * MiB, "cxl": 4 * MiB, "nvme": 16 * MiB, **capacities}
    data: dict[str, Any] = {
        "pool": {"name": name or f"test-{tmp_path.name}", "data_dir": str(tmp_path / "data")},
        "tiers": {t: {"capacity": sizes[t] if t in tiers else 0} for t in ALL_TIERS},
    }
    if "cxl" in tiers:
        data["tiers"]["cxl"]["path"] = str(tmp_path / "cxl.arena")
    if "nvme" in tiers:
        data["tiers"]["nvme"]["segment_size"] = 8 * MiB
    return Config.load(data)
