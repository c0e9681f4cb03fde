"""The package's layering (issue #30), read from every module's imports with ``ast``.

    daemon -> service -> {federation, bridges, controllers} -> engine -> {hw, isolation, ledger}
           -> {placement, planning} -> config -> {model, topology, errors}

A module imports its own package and the layers below its own; ``api/`` (the wire) stands beside the
stack, imports only ``config`` and the vocabulary, and is imported by the wire-facing parts (service,
daemon, federation, bridges) and the CLI/TUI; ``sim/`` imports only ``placement``/``planning``; the
CLI and the TUI never import the engine, the daemon, the service or the controllers. Nothing outside
``engine/`` touches an engine object's ``_private`` names.

The allowlists hold what was so when the layering was introduced; they only shrink. A pair that no
longer occurs fails too: delete its entry.
"""

from __future__ import annotations

import pytest

from tests.layers import ROOT, aliased_reaches, graph, modules, private_reaches

VOCABULARY = {"model", "topology", "errors", "__init__", "etc", "systemd"}  # etc/systemd: package data
RANK = {
    "config": 1,
    "placement": 2,
    "planning": 2,
    "sim": 2,
    "hw": 3,
    "isolation": 3,
    "ledger": 3,
    "engine": 4,
    "federation": 5,
    "bridges": 5,
    "controllers": 5,
    "jobs": 5,
    "service": 6,
    "daemon": 7,
}
# sideways imports (same rank, other package) that are part of the design
SIDEWAYS = {("isolation", "hw")}  # the isolation backends drive the card through the NVML adapter
API_USERS = {"service", "daemon", "federation", "bridges"}
API_IMPORTS = {"config", "api"}
SIM_IMPORTS = {"placement", "planning", "sim"}
UI_FORBIDDEN = {"engine", "daemon", "service", "controllers"}
MAX_ROOT_MODULES = 8

# (importer, imported) module pairs that break the rules today. Fix one, then delete its entry.
ALLOWED: set[tuple[str, str]] = set()
# (module, attribute): reaches into an engine object's private names from outside engine/
ALLOWED_PRIVATE: set[tuple[str, str]] = set()


def part(module: str) -> str:
    """The layer-bearing part of a module name: xpud.engine.moves -> engine, xpud.model -> model,
    xpu_cli.main -> xpu_cli."""
    bits = module.split(".")
    if bits[0] != "xpud":
        return bits[0]
    return bits[1] if len(bits) > 1 else "__init__"


def why_not(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported``; None where it may."""
    a, b = part(importer), part(imported)
    if not imported.startswith("xpud") or a == b or b in VOCABULARY:
        return None
    if a in ("xpu_cli", "xpu_tui"):
        return f"the CLI and the TUI never import {b}" if b in UI_FORBIDDEN else None
    if a in VOCABULARY:
        return f"the vocabulary ({a}) imports only the vocabulary, not {b}"
    if a == "api":
        return None if b in API_IMPORTS else f"api/ imports only config and the vocabulary, not {b}"
    if b == "api":
        return None if a in API_USERS else f"{a} does not import the wire (api/): only {sorted(API_USERS)} do"
    if a == "sim":
        return None if b in SIM_IMPORTS else f"sim/ imports only placement and planning, not {b}"
    if a not in RANK or b not in RANK:
        return f"{a if a not in RANK else b} has no layer: add the package to tests/test_layers.py's RANK"
    if RANK[b] > RANK[a]:
        return f"{a} (layer {RANK[a]}) imports {b}, a layer above it ({RANK[b]})"
    if RANK[b] == RANK[a] and (a, b) not in SIDEWAYS:
        return f"{a} imports {b} sideways (same layer {RANK[a]})"
    return None


@pytest.fixture(scope="module")
def edges():
    return graph()


def test_every_import_goes_down_the_stack(edges):
    found = {}
    for e in edges:
        why = why_not(e.importer, e.imported)
        if why:
            found.setdefault((e.importer, e.imported), f"{e.importer}:{e.line} imports {e.imported}: {why}")
    new = [line for pair, line in sorted(found.items()) if pair not in ALLOWED]
    gone = sorted(ALLOWED - set(found))
    assert not new, "imports against the layering (move the code down, or pass it in):\n" + "\n".join(new)
    assert not gone, "fixed, so delete from ALLOWED in tests/test_layers.py:\n" + "\n".join(map(str, gone))


def test_no_private_reach_into_the_engine():
    found = {}
    for name, path in modules().items():
        if part(name) == "engine":
            continue
        for attr, line in private_reaches(path) + aliased_reaches(path):
            found.setdefault((name, attr), f"{name}:{line} reads engine.{attr}")
    new = [line for pair, line in sorted(found.items()) if pair not in ALLOWED_PRIVATE]
    gone = sorted(ALLOWED_PRIVATE - set(found))
    assert not new, (
        "private engine names used outside engine/ (give the engine a public method):\n" + "\n".join(new)
    )
    assert not gone, "fixed, so delete from ALLOWED_PRIVATE in tests/test_layers.py:\n" + "\n".join(
        map(str, gone)
    )


# import circles among the modules of xpud, the CLI and the TUI that are known and owned elsewhere (each as
# its sorted members).
# Fix one, then delete its entry.
ALLOWED_CYCLES: set[tuple[str, ...]] = set()


def cycles(adj: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``adj`` (module -> modules it imports): each strongly connected component of
    more than one module, as one circle through it (a path that comes back to its start). Tarjan's
    algorithm, iterative (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(sorted(adj.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adj.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(_circle(adj, comp))
    return found


def _circle(adj: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One circle through the component ``comp``: the shortest way from its first module back to it."""
    start = min(comp)
    came = {start: ""}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(adj.get(v, set()) & comp):
            if w == start:
                path = [v]
                while came[path[-1]]:
                    path.append(came[path[-1]])
                return [*reversed(path), start]
            if w not in came:
                came[w] = v
                todo.append(w)
    raise AssertionError(f"no circle through {sorted(comp)}")  # a component always has one


def import_graph(edges) -> dict[str, set[str]]:
    """module -> the modules of the three trees (xpud, xpu_cli, xpu_tui) it imports, itself left out."""
    known = set(modules())
    adj: dict[str, set[str]] = {}
    for e in edges:
        if e.importer in known and e.imported in known and e.importer != e.imported:
            adj.setdefault(e.importer, set()).add(e.imported)
    return adj


def test_no_import_circle(edges):
    """No circle among the modules of xpud, the CLI and the TUI (``if TYPE_CHECKING:`` imports and
    imports inside functions count: a circle hidden there is still a circle in the design). Break one by
    moving the shared part down (as ``xpu_cli.session``, ``xpu_cli.runopts``), or by a Protocol (as
    ``xpud.engine.hooks``)."""
    adj = import_graph(edges)
    found = {tuple(sorted(set(c))): c for c in cycles(adj)}
    new = [" -> ".join(c) for key, c in sorted(found.items()) if key not in ALLOWED_CYCLES]
    gone = sorted(ALLOWED_CYCLES - set(found))
    assert not new, "import circles (move the shared part down, or call out through a Protocol):\n" + (
        "\n".join(new)
    )
    assert not gone, "fixed, so delete from ALLOWED_CYCLES in tests/test_layers.py:\n" + "\n".join(
        map(str, gone)
    )


def test_the_circle_test_reads_the_cli_and_the_tui(edges):
    """The CLI's and the TUI's modules are in the graph, lazy imports (inside functions) included."""
    adj = import_graph(edges)
    assert "xpu_cli.runopts" in adj["xpu_cli.entry"]  # at the top
    assert "xpu_cli.main" in adj["xpu_cli.entry"]  # inside main(): the hand-over to Typer
    assert "xpu_tui.app" in adj["xpu_cli.top"]  # inside the command: Textual stays optional
    assert cycles({**adj, "xpu_tui.app": adj["xpu_tui.app"] | {"xpu_cli.top"}}) == [
        ["xpu_cli.top", "xpu_tui.app", "xpu_cli.top"]
    ]


def test_the_circle_finder_finds_circles():
    """A circle is found and shown as a path back to its start; a graph without one gives none."""
    adj = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"e", "a"}}
    assert cycles(adj) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"x": {"y"}, "y": {"x"}}) == [["x", "y", "x"]]


def test_few_modules_at_the_root():
    root = sorted(p.name for p in (ROOT / "xpud").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, (
        f"{len(root)} modules at xpud/'s root (at most {MAX_ROOT_MODULES}): {root}"
    )


def test_placement_is_pure(edges):
    bad = [
        f"{e.importer}:{e.line} imports {e.imported}"
        for e in edges
        if part(e.importer) == "placement" and part(e.imported) in {"hw", "engine", "ledger", "isolation"}
    ]
    assert not bad, "placement/ decides where from plain values, never from the hardware or the engine:\n" + (
        "\n".join(bad)
    )


def test_every_package_has_a_layer():
    parts = {part(n) for n in modules()} - {"xpu_cli", "xpu_tui"}
    assert parts - VOCABULARY - set(RANK) - {"api"} == set()


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """Function-level, TYPE_CHECKING and relative imports count; a violation and a gone entry are seen."""
    from tests import layers

    p = tmp_path / "m.py"
    p.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from xpud.engine.engine import Engine\n"
        "def f():\n    import xpud.daemon.cli\n    from . import model\n"
        "def g(engine):\n    return engine._secret, self.engine.public\n"
    )
    known = {"xpud.placement.model": p}
    got = {e.imported for e in layers.imports("xpud.placement.m", p, known)}
    assert {"xpud.engine.engine", "xpud.daemon.cli", "xpud.placement.model"} <= got
    assert why_not("xpud.placement.m", "xpud.engine.engine")
    assert why_not("xpud.engine.engine", "xpud.placement.host") is None
    assert why_not("xpud.ledger.ledger", "xpud.hw.nvml")  # sideways
    assert why_not("xpu_cli.main", "xpud.engine.engine")
    assert why_not("xpud.api.client", "xpud.config.schema") is None
    assert layers.private_reaches(p) == [("_secret", 8)]
    q = tmp_path / "alias.py"
    q.write_text("def h(self):\n    e = self.engine\n    return e._fit, e.fit, e.__class__\n")
    assert layers.aliased_reaches(q) == [("_fit", 3)]
