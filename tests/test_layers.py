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

from tests.layers import ROOT, graph, modules, private_reaches

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
ALLOWED = {
    ("xpu_cli.configure", "xpud.daemon.reload"),
    ("xpu_cli.main", "xpud.controllers.provisioner"),
    ("xpud.api.convert", "xpud.ledger.ledger"),
    ("xpud.api.validate", "xpud.federation.membership"),
    ("xpud.config.schema", "xpud.planning.windows"),
    ("xpud.controllers.health", "xpud.api.v1"),
    ("xpud.controllers.rightsizer", "xpud.api.v1"),
    ("xpud.engine.engine", "xpud.controllers.rightsizer"),
    ("xpud.federation.node", "xpud.service.node"),
    ("xpud.federation.peer_service", "xpud.service.node"),
    ("xpud.hw.check", "xpud.isolation.mig_map"),
}
# (module, attribute): reaches into an engine object's private names from outside engine/
ALLOWED_PRIVATE = {
    ("xpud.controllers.defragmenter", "_reserved"),
    ("xpud.controllers.health", "_reserved"),
    ("xpud.controllers.rightsizer", "_hw"),
    ("xpud.controllers.rightsizer", "_notify"),
    ("xpud.federation.hostjobs", "_why_not"),
}


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
        for attr, line in private_reaches(path):
            found.setdefault((name, attr), f"{name}:{line} reads engine.{attr}")
    new = [line for pair, line in sorted(found.items()) if pair not in ALLOWED_PRIVATE]
    gone = sorted(ALLOWED_PRIVATE - set(found))
    assert not new, (
        "private engine names used outside engine/ (give the engine a public method):\n" + "\n".join(new)
    )
    assert not gone, "fixed, so delete from ALLOWED_PRIVATE in tests/test_layers.py:\n" + "\n".join(
        map(str, gone)
    )


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
