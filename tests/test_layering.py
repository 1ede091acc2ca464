"""The cluster's packages depend one way: ``master`` and ``node`` on ``wire``, never on each
other, and ``wire`` on neither (every import counts: lazy and TYPE_CHECKING ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpool

CLUSTER = Path(kvpool.__file__).parent / "cluster"
FORBIDDEN = {
    "wire": ("kvpool.cluster.master", "kvpool.cluster.node"),
    "master": ("kvpool.cluster.node",),
    "node": ("kvpool.cluster.master",),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path``; ``from X import Y`` yields X and X.Y."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def violations() -> list[str]:
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((CLUSTER / package).glob("*.py")):
            for line, module in imported_modules(path):
                if any(module == f or module.startswith(f + ".") for f in forbidden):
                    bad.append(f"{path.relative_to(CLUSTER.parent.parent)}:{line} imports {module}")
    return bad


def test_cluster_packages_depend_one_way() -> None:
    assert violations() == []


def test_the_scan_sees_a_forbidden_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kvpool.cluster.master import ops\n")
    assert (2, "kvpool.cluster.master.ops") in imported_modules(probe)


def test_every_cluster_module_is_in_a_package() -> None:
    loose = [p.name for p in CLUSTER.glob("*.py") if p.name != "__init__.py"]
    assert loose == []
    assert {p.name for p in CLUSTER.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FORBIDDEN)


def test_the_reader_asks_for_bytes_and_never_names_a_transport() -> None:
    """Which client a pull goes over, and the fallback from TCP to UCX, is
    :class:`kvpool.transport.Pulls`' choice alone."""
    transports = ("kvpool.transport.tcp", "kvpool.transport.client", "kvpool.transport.PullClient",
                  "kvpool.transport.TcpPullClient")
    for name in ("reader.py", "checks.py", "located.py", "view.py"):
        named = [module for _, module in imported_modules(CLUSTER / "node" / name)
                 if any(module == t or module.startswith(t + ".") for t in transports)]
        assert named == [], name
