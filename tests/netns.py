"""The emulated-hosts lab (bench/netlab.py) for tests: skip with the reason where it cannot be built."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from bench.netlab import Host, Lab, unavailable

__all__ = ["Host", "Lab", "lab_or_skip"]


def lab_or_skip(hosts: int, **kwargs: Any) -> Lab:
    why = unavailable()
    if why:
        pytest.skip(why)
    try:
        return Lab(hosts, **kwargs)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot build network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
