"""No module imports another module's underscore name: a name used across modules is an
interface and says so by being public. A private *module* (``kvpool/_layersum``) may be
imported from inside the package that holds it (``kvpool.*``), as httpcore does.

Counted: ``from M import _x``, and ``alias._x`` where ``alias`` names an imported kvpool,
tiers, bench or tests module or one of their names (``frames._HELLO``, ``Pool._out_view``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

SCANNED = ("kvpool", "tiers", "bench", "tests")


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def shown(path: Path) -> Path:
    return path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path


def module_of(path: Path) -> str:
    parts = list(shown(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def may_use(importer: str, owner: str, name: str) -> bool:
    """``owner.name`` is private to ``owner``: usable only inside it. A private module of a
    package (``kvpool._poll``) is usable anywhere inside that package."""
    return importer == owner or importer.startswith(owner + ".")


def crossings(path: Path) -> list[str]:
    """Every use in ``path`` of another module's underscore name, as ``path:line: what``."""
    me = module_of(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    imported: dict[str, str] = {}  # local name -> the dotted name it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            if module.split(".")[0] not in SCANNED:
                continue
            for alias in node.names:
                if private(alias.name) and not may_use(me, module, alias.name):
                    found.append(f"{shown(path)}:{node.lineno}: from {module} import {alias.name}")
                imported[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in SCANNED:
                    local = alias.asname or alias.name.split(".")[0]
                    imported[local] = alias.name if alias.asname else local
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and private(node.attr)):
            continue
        chain, root = [], node.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if isinstance(root, ast.Name) and root.id in imported:
            owner = ".".join([imported[root.id], *reversed(chain)])
            if not may_use(me, owner, node.attr):
                found.append(f"{shown(path)}:{node.lineno}: {owner}.{node.attr}")
    return found


def scan() -> list[str]:
    return [hit for top in SCANNED for path in sorted((REPO_ROOT / top).rglob("*.py")) for hit in crossings(path)]


def test_no_module_imports_another_modules_underscore_name() -> None:
    assert scan() == []


def test_the_scan_finds_each_kind_of_crossing(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from kvpool.transport.frames import _X\n"
                     "from kvpool.transport import frames as T\n"
                     "from kvpool.pool import Pool\n"
                     "import kvpool.objformat\n"
                     "T._Y, Pool._z, kvpool.objformat._w, T.__doc__\n")
    hits = crossings(probe)
    assert [hit.split(": ", 1)[1] for hit in hits] == [
        "from kvpool.transport.frames import _X", "kvpool.transport.frames._Y", "kvpool.pool.Pool._z",
        "kvpool.objformat._w"]


def test_a_private_module_is_usable_inside_its_package() -> None:
    assert may_use("kvpool.objformat", "kvpool", "_layersum")
    assert may_use("kvpool.transport.tcp.stream", "kvpool", "_poll")
    assert not may_use("tests.test_layersum", "kvpool.objformat", "_layersum")
