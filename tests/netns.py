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
        lab = Lab(hosts, **kwargs)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot build network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    probe = lab.run(lab.hosts[0], ["hostname"], timeout_s=20)  # ip netns exec + unshare --uts work?
    if probe.returncode != 0 or probe.stdout.strip() != lab.hosts[0].name:
        lab.close()
        pytest.skip(f"cannot run a process as an emulated host here: {probe.stderr.strip()[:300]}")
    return lab
