"""kvpool's modules depend one way, in README.md's order ("Code layout"), and no circle of
imports is left in kvpool/, tiers/ or bench/.

The order, lowest first (:data:`ORDER`)::

    core <- tiers/ <- kvpool/transport/ <- kvpool/cluster/wire/ <- cluster/master/ | cluster/node/
         <- the API (kvpool/__init__.py, api.py, pool.py, client.py)
         <- kvpool/cli/ | kvpool/integrations/ | kvpool/testing.py

A module may import its own layer and the layers before it, never one after it; layers side by
side (``|``) never import each other. Where the README groups two steps ("transport and cluster",
"the API and the CLI") the finer order here is the one the packages' docstrings give (the cluster
builds on the transport; the CLI runs the API and the cluster), and kvpool/integrations/ and
kvpool/testing.py, which the README names without a place, sit on top as the library's users.

Every import counts: at module level and inside functions, ``import x`` and ``from x import y``,
relative ones, and those under ``if TYPE_CHECKING:``. A type-only import is exempt from nothing:
the importing module cannot be read without the other, and because annotations cost nothing at
run time it is the easiest place for a back-arrow (or a circle) to hide. What is not counted:
the implicit import of a package's ``__init__`` when one of its modules is imported (each
package's ``__init__`` imports its own modules, so counting it would make every package a
circle), and ``importlib.import_module`` of a name computed at run time (tiers' registry).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO_ROOT

#: The layers, lowest first; each entry of a step is a layer: name -> its modules (a name
#: ending in ``.*`` is that package and everything in it; any other name is one module).
ORDER: tuple[dict[str, tuple[str, ...]], ...] = (
    {"core": ("kvpool.errors", "kvpool.objformat", "kvpool.config", "kvpool.hashing", "kvpool.native",
              "kvpool.metrics",  # imports nothing of kvpool; the API and the CLI serve it
              "kvpool._index", "kvpool._layersum", "kvpool._poll")},  # the C extensions (.pyi)
    {"tiers": ("tiers.*",)},
    {"transport": ("kvpool.transport.*",)},
    {"wire": ("kvpool.cluster", "kvpool.cluster.wire.*")},  # kvpool/cluster/__init__.py: a docstring
    {"master": ("kvpool.cluster.master.*",), "node": ("kvpool.cluster.node.*",)},
    {"api": ("kvpool", "kvpool.api", "kvpool.pool", "kvpool.client")},
    {"cli": ("kvpool.cli.*",), "integrations": ("kvpool.integrations.*",), "testing": ("kvpool.testing",)},
)
LIBRARY = ("kvpool", "tiers")
CIRCLE_FREE = ("kvpool", "tiers", "bench")

#: Where the integrations reach below the API (the pool's public surface) today. The README's
#: order allows it (they sit on top); issue 42 asks for the connector on public pool APIs only.
#: A new entry: use the pool's API instead, or add it here and say why. One gone: delete it here.
INTEGRATIONS_BELOW_API = {
    ("kvpool.integrations.vllm_scheduler", "kvpool.cluster.wire.master_client"),  # the scheduler's own MasterClient
    ("kvpool.integrations.vllm_scheduler", "kvpool.transport.engine"),  # local_host_id, for the worker's placement
    ("kvpool.integrations.vllm_worker", "kvpool.cluster.wire.affinity"),  # process_cpus: the node's I/O threads' CPUs
}


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module
    line: int
    named: str  # as written, absolute: "x.y" for ``import x.y``, "x.y" for ``from x import y``
    module: str | None  # the module of the scanned trees that ``named`` imports; None: another package's
    type_only: bool  # under ``if TYPE_CHECKING:``


def module_files(root: Path, tops: Iterable[str]) -> dict[str, Path]:
    """Module name -> file for every .py (and C extension stub, .pyi) under ``root/top``."""
    found: dict[str, Path] = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py*")):
            if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if path.suffix == ".py" or name not in found:
                found[name] = path
    return found


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """ids of the statements inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    """Every import statement's targets in module ``name`` (file ``path``)."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = _type_checking_blocks(tree)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            named = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for dotted in named:
            target = dotted
            while target and target not in modules:
                target = target.rpartition(".")[0]
            yield Import(name, node.lineno, dotted, target or None, id(node) in type_only)


def all_imports(root: Path, tops: Iterable[str]) -> list[Import]:
    modules = module_files(root, tops)
    return [imp for name, path in modules.items() if path.suffix == ".py" for imp in imports_of(name, path, modules)]


def layer_of(module: str) -> tuple[int, str] | None:
    """(step in ORDER, layer name) of a library module; None when it is in no layer."""
    best: tuple[int, int, str] | None = None  # (length of the match, step, layer)
    for step, layers in enumerate(ORDER):
        for layer, names in layers.items():
            for entry in names:
                package = entry.removesuffix(".*")
                if module == package or (entry.endswith(".*") and module.startswith(package + ".")):
                    if best is None or len(package) > best[0]:
                        best = (len(package), step, layer)
    return None if best is None else (best[1], best[2])


def where(imp: Import) -> str:
    kind = " (TYPE_CHECKING)" if imp.type_only else ""
    return f"{imp.importer}:{imp.line} imports {imp.named}{kind}"


def back_arrows(imports: Iterable[Import]) -> list[str]:
    """Each import of a library module that goes against ORDER."""
    bad = []
    for imp in imports:
        if imp.importer.split(".")[0] not in LIBRARY or imp.module is None or imp.module == imp.importer:
            continue
        mine, theirs = layer_of(imp.importer), layer_of(imp.module)
        if mine is None or theirs is None:
            if mine is not None:  # the library importing bench/ or tests/
                bad.append(f"{where(imp)}: outside the library")
            continue  # a module in no layer fails test_every_library_module_has_a_layer
        if theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1]):
            bad.append(f"{where(imp)}: {mine[1]} may not import {theirs[1]}")
    return bad


def circles(imports: Iterable[Import]) -> list[str]:
    """Each circle of imports (a strongly connected set of modules), shown as one cycle through
    it, ``a:line -> b:line -> a``."""
    edges: dict[str, dict[str, int]] = {}
    for imp in imports:
        if imp.module is not None and imp.module != imp.importer:
            edges.setdefault(imp.importer, {}).setdefault(imp.module, imp.line)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    shown = []
    for component in found:
        start, members = component[0], set(component)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:  # the shortest way from start back to itself, inside the component
            v = queue.popleft()
            for w in sorted(edges.get(v, {})):
                if w in members and w not in came_from:
                    came_from[w] = v
                    queue.append(w)
            if start in came_from:
                break
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came_from[path[-1]])
        path.reverse()
        hops = " -> ".join(f"{a}:{edges[a][b]}" for a, b in zip(path, path[1:]))
        shown.append(f"{hops} -> {start} (circle of {', '.join(component)})")
    return shown


IMPORTS = all_imports(REPO_ROOT, CIRCLE_FREE)


def test_every_import_follows_the_readmes_order() -> None:
    assert back_arrows(IMPORTS) == []


def test_no_circle_of_imports_in_the_library_or_bench() -> None:
    assert circles(IMPORTS) == []


def test_every_library_module_has_a_layer() -> None:
    """A new module is placed in the README's order (and in ORDER) before it is imported."""
    assert [name for name in module_files(REPO_ROOT, LIBRARY) if layer_of(name) is None] == []


def test_the_integrations_reach_below_the_api_only_where_listed() -> None:
    api = next(step for step, layers in enumerate(ORDER) if "api" in layers)
    below = set()
    for imp in IMPORTS:
        theirs = layer_of(imp.module) if imp.module is not None else None
        if imp.importer.startswith("kvpool.integrations.") and theirs is not None and 0 < theirs[0] < api:
            below.add((imp.importer, imp.module))  # the core (errors, config, hashing) is the API's too
    assert below == INTEGRATIONS_BELOW_API, "a new one: use the pool's API; one gone: delete it from the list"


def test_the_scan_sees_every_kind_of_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    from pkg.high import thing\n")
    (package / "high.py").write_text("import os\n"
                                     "def f():\n    from . import low\n    import pkg.low as l\n")
    imports = all_imports(tmp_path, ["pkg"])
    assert {(i.importer, i.line, i.module, i.type_only) for i in imports if i.module} == {
        ("pkg.low", 3, "pkg.high", True), ("pkg.high", 3, "pkg.low", False), ("pkg.high", 4, "pkg.low", False)}
    assert {i.named for i in imports if i.module is None} == {"typing.TYPE_CHECKING", "os"}
    assert circles(imports) == ["pkg.high:3 -> pkg.low:3 -> pkg.high (circle of pkg.high, pkg.low)"]


def test_the_order_catches_a_back_arrow_and_a_sibling() -> None:
    def imp(importer: str, module: str) -> Import:
        return Import(importer, 1, module, module, False)

    assert back_arrows([imp("kvpool.config", "kvpool.cluster.wire.etcd"),
                        imp("kvpool.cluster.node.view", "kvpool.api"),
                        imp("kvpool.cluster.master.ops", "kvpool.cluster.node.server"),
                        imp("tiers.dram", "bench.common"),
                        imp("kvpool.pool", "tiers.manager")]) == [
        "kvpool.config:1 imports kvpool.cluster.wire.etcd: core may not import wire",
        "kvpool.cluster.node.view:1 imports kvpool.api: node may not import api",
        "kvpool.cluster.master.ops:1 imports kvpool.cluster.node.server: master may not import node",
        "tiers.dram:1 imports bench.common: outside the library"]


def test_every_cluster_module_is_in_a_package() -> None:
    cluster = REPO_ROOT / "kvpool" / "cluster"
    assert [p.name for p in cluster.glob("*.py") if p.name != "__init__.py"] == []
    assert {p.name for p in cluster.iterdir() if p.is_dir() and p.name != "__pycache__"} == {"wire", "master", "node"}


def test_the_reader_asks_for_bytes_and_never_names_a_transport() -> None:
    """Which client a pull goes over, and the fallback from TCP to UCX, is
    :class:`kvpool.transport.Pulls`' choice alone."""
    transports = ("kvpool.transport.tcp", "kvpool.transport.client", "kvpool.transport.PullClient",
                  "kvpool.transport.TcpPullClient")
    for name in ("reader", "checks", "located", "view"):
        named = [imp.named for imp in IMPORTS if imp.importer == f"kvpool.cluster.node.{name}"
                 and any(imp.named == t or imp.named.startswith(t + ".") for t in transports)]
        assert named == [], name
