"""The package as `pip install .` builds it (the README's first command): a wheel built from
this checkout holds every package of the source tree, their typing markers, and the C
extension where it can be compiled here."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_the_extension(tmp_path: Path) -> None:
    # Built from a copy without build outputs: a stale build/ in the checkout would hide a
    # package the configuration leaves out.
    source = tmp_path / "src"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".venv-*", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".pytest_cache",
        ".hypothesis", ".mypy_cache", ".ruff_cache", ".whl"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=110)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("kvpool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(str(init.parent.relative_to(REPO_ROOT)) for top in ("kvpool", "tiers")
                      for init in (REPO_ROOT / top).rglob("__init__.py"))
    assert "kvpool/transport/tcp" in packages
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"packages not in the wheel: {missing}"
    modules = {str(path.relative_to(REPO_ROOT)) for top in ("kvpool", "tiers")
               for path in (REPO_ROOT / top).rglob("*.py") if "__pycache__" not in path.parts}
    assert not modules - names, f"modules not in the wheel: {sorted(modules - names)}"
    assert {"kvpool/py.typed", "tiers/py.typed", "kvpool/_layersum.pyi"} <= names
    if importlib.util.find_spec("kvpool._layersum") is not None:  # it compiles here: so in the wheel
        assert any(n.startswith("kvpool/_layersum.") and n.endswith((".so", ".pyd")) for n in names), sorted(names)
