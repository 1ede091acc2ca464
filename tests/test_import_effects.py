"""Importing kvpool changes nothing outside it: no environment variable is set or removed by
importing any module of kvpool/ or tiers/ (UCX's settings are passed to the UCX context it
creates, at first use)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT

SKIPPED = {"kvpool.cluster.master.__main__", "kvpool.cli.__main__",  # they run a program
           # they import vLLM, whose own imports set variables
           "kvpool.integrations.vllm", "kvpool.integrations.vllm_messages", "kvpool.integrations.vllm_scheduler",
           "kvpool.integrations.vllm_worker"}

PROBE = """
import importlib, json, os, pkgutil, sys
import kvpool, tiers
skipped = set(json.loads(sys.argv[1]))
before = dict(os.environ)
names = []
for package in (kvpool, tiers):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name not in skipped:
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional extra (cupy, transformers) not installed here
                continue
            names.append(info.name)
after = dict(os.environ)
print(json.dumps({"imported": names, "changed": sorted(k for k in before.keys() | after.keys()
                                                       if before.get(k) != after.get(k))}))
"""


def test_importing_every_module_leaves_the_environment_alone() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(sorted(SKIPPED))], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "kvpool.transport.engine" in report["imported"] and "kvpool.cluster.node.server" in report["imported"]
    assert report["changed"] == []
