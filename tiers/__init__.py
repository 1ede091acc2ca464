"""Storage tiers of kvpool, fastest first: hbm, dram, cxl, nvme.

Each tier is one module behind the :class:`tiers.base.Tier` ABC; the
:class:`tiers.manager.TierManager` places objects and moves them between tiers.
Tier classes are looked up lazily by name so that importing kvpool never
imports CuPy or LMDB before a tier needs them.
"""

from __future__ import annotations

import importlib

from tiers.base import Extent, ExtentAllocator, Tier

TIER_ORDER = ("hbm", "dram", "cxl", "nvme")

_REGISTRY = {
    "hbm": ("tiers.hbm", "HbmTier", "pip install 'kvpool[gpu]' (CuPy) to use a real GPU for the hbm tier"),
    "dram": ("tiers.dram", "DramTier", ""),
    "cxl": ("tiers.cxl", "CxlTier", ""),
    "nvme": ("tiers.nvme", "NvmeTier", "pip install lmdb to use the nvme tier"),
}


def tier_class(name: str) -> type[Tier]:
    """The Tier subclass registered under ``name`` (imported on first use)."""
    try:
        module_name, class_name, hint = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; known: {', '.join(TIER_ORDER)}") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{exc}. {hint}".strip()) from exc
    cls: type[Tier] = getattr(module, class_name)
    return cls


__all__ = ["Extent", "ExtentAllocator", "Tier", "TIER_ORDER", "tier_class"]
