"""Reading the package's import graph with ``ast`` (for tests/test_layers.py): every ``import`` and
``from ... import`` of every module, at any depth (function bodies, ``if TYPE_CHECKING:`` blocks), and
reaches into an engine object's ``_private`` names."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the three trees that ship, as the names they are imported by
TREES = {"xpud": ROOT / "xpud", "xpu_cli": ROOT / "cli", "xpu_tui": ROOT / "tui"}


@dataclass(frozen=True)
class Edge:
    importer: str  # module name, e.g. xpud.engine.engine
    imported: str  # module name, e.g. xpud.ledger.ledger
    line: int


def modules() -> dict[str, Path]:
    """Every module of the three trees by its import name (generated protobuf code left out)."""
    out = {}
    for top, base in TREES.items():
        for p in sorted(base.rglob("*.py")):
            if "_pb2" in p.name:
                continue
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([top, *parts])] = p
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    """The modules ``name`` imports: for ``from P import n`` the module P.n where that is a module, else P."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if _is_package(path) else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges += [Edge(name, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                parent = ".".join(base + ([node.module] if node.module else []))
            else:
                parent = node.module or ""
            for a in node.names:
                sub = f"{parent}.{a.name}"
                edges.append(Edge(name, sub if sub in known else parent, node.lineno))
    return edges


def graph() -> list[Edge]:
    known = modules()
    return [e for name, path in known.items() for e in imports(name, path, known)]


ENGINE_NAMES = {"engine", "_engine", "eng"}


def private_reaches(path: Path) -> list[tuple[str, int]]:
    """``engine._x``, ``self.engine._x``, ``self._engine._x``...: a ``_private`` (not dunder) attribute read
    or written on a name or attribute called engine/_engine/eng."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        v = node.value
        holder = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
        if holder in ENGINE_NAMES:
            out.append((node.attr, node.lineno))
    return out


def aliased_reaches(path: Path) -> list[tuple[str, int]]:
    """``e = self.engine`` (any name bound to an engine holder: engine, _engine, eng), then ``e._x``: the
    reaches ``private_reaches`` does not see, since it knows the engine only by those names."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            v = node.value
            holder = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
            if holder in ENGINE_NAMES:
                aliases.add(node.targets[0].id)
    return [
        (node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases - ENGINE_NAMES
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]
