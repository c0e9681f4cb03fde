"""One exception tree (issue #30): every exception class in xpud, the CLI and the TUI derives from
``xpud.errors.XpudError``, or is private to its module (a leading underscore: raised and caught there).

Read with ``ast`` (tests/layers.py's module list), so nothing is imported: a class is an exception when one
of its bases is a builtin exception or, followed through the module's imports, another exception class of
these trees. ``ALLOWED`` holds those that were outside the tree when the test came; each is caught by an
``except XpudError`` (or sits beside one) somewhere, so moving it under ``XpudError`` changes what that
handler does: decide there first, then delete its entry. It only shrinks.
"""

from __future__ import annotations

import ast
import builtins

from tests.layers import modules

BUILTIN_EXCEPTIONS = {
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
}
ROOT_ERROR = ("xpud.errors", "XpudError")

ALLOWED: set[tuple[str, str]] = set()


def _classes() -> dict[tuple[str, str], list[tuple[str, str] | str]]:
    """Every class of the trees, ``(module, name)`` -> its bases, each ``(module, name)`` where it is a class
    of these trees (defined in the module or imported into it), else the base's bare name."""
    known = modules()
    found: dict[tuple[str, str], list] = {}
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        names: dict[str, tuple[str, str]] = {}  # a name in this module -> (module, name) it stands for
        aliases: dict[str, str] = {}  # `from xpud import errors`, `import xpud.errors as e` -> the module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in known:
                        aliases[a.asname or a.name] = sub
                    else:
                        names[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
        local = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for b in node.bases:
                if isinstance(b, ast.Name):
                    bases.append((mod, b.id) if b.id in local else names.get(b.id, b.id))
                elif isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name) and b.value.id in aliases:
                    bases.append((aliases[b.value.id], b.attr))
                else:
                    bases.append(ast.unparse(b))
            found[(mod, node.name)] = bases
    return found


def _verdicts(classes) -> dict[tuple[str, str], str]:
    """``"tree"`` (under XpudError), ``"outside"`` (an exception, not under it) for every exception class."""
    memo: dict = {}

    def kind(key, seen=()) -> str | None:
        if key == ROOT_ERROR:
            return "tree"
        if isinstance(key, str):
            return "outside" if key in BUILTIN_EXCEPTIONS else None
        if key in memo:
            return memo[key]
        if key not in classes or key in seen:
            return None
        kinds = {kind(b, (*seen, key)) for b in classes[key]}
        memo[key] = "tree" if "tree" in kinds else "outside" if "outside" in kinds else None
        return memo[key]

    return {k: v for k in classes if (v := kind(k))}


def outside_the_tree() -> set[tuple[str, str]]:
    """The public exceptions outside the tree, but for the subclasses of an ``ALLOWED`` one (one entry
    stands for its family: ``NvmlError``'s ``NvmlNotFound``...)."""
    classes = _classes()

    def in_allowed_family(key, seen=()) -> bool:
        if key in ALLOWED:
            return True
        if not isinstance(key, tuple) or key not in classes or key in seen:
            return False
        return any(in_allowed_family(b, (*seen, key)) for b in classes[key])

    return {
        k
        for k, v in _verdicts(classes).items()
        if v == "outside" and not k[1].startswith("_") and (k in ALLOWED or not in_allowed_family(k))
    }


def test_every_public_exception_is_an_xpud_error():
    found = outside_the_tree()
    new = sorted(found - ALLOWED)
    assert not new, (
        "derive these from xpud.errors.XpudError (or a subclass), or make them private to their module:\n"
        + "\n".join(f"{m}.{n}" for m, n in new)
    )
    gone = sorted(ALLOWED - found)
    assert not gone, "under XpudError now, so delete from ALLOWED in tests/test_errors_tree.py: " + str(gone)


def test_the_walk_sees_exceptions_through_imports_and_subclasses():
    verdicts = _verdicts(_classes())
    assert verdicts[("xpud.errors", "Conflict")] == "tree"
    assert verdicts[("xpud.isolation.runner", "ToolError")] == "tree"  # Conflict, imported
    assert verdicts[("xpud.hw.simstate", "SimStateError")] == "tree"
    assert verdicts[("xpud.hw.types", "NvmlError")] == "tree"  # XpudError, and a RuntimeError still
    assert verdicts[("xpud.hw.types", "NvmlNotFound")] == "tree"  # through NvmlError
    assert ("xpud.isolation.faketools", "_Refused") in verdicts  # private: seen, allowed
    assert ("xpud.isolation.faketools", "_Refused") not in outside_the_tree()
    assert ("xpud.model", "Card") not in verdicts  # not an exception at all
    made_up = {("m", "E"): ["ValueError"], ("m", "F"): [("m", "E")], ("m", "G"): [ROOT_ERROR, "OSError"]}
    assert _verdicts(made_up) == {("m", "E"): "outside", ("m", "F"): "outside", ("m", "G"): "tree"}


def test_the_classes_moved_under_xpud_error_keep_what_their_handlers_and_callers_saw():
    """Moved under XpudError (issue #30) without changing what catches them or what a gRPC caller gets:
    the builtin base each had stays (the OSError/ValueError/RuntimeError handlers still take them), and one
    that leaves a service method keeps the status an unexpected exception got (INTERNAL), or the one its
    kind of error gets (a bad machine description: a bad configuration, INVALID_ARGUMENT)."""
    import grpc

    from xpud.api.server import _status
    from xpud.errors import ConfigError, XpudError
    from xpud.federation import rankproc
    from xpud.hw.devnodes import DevNodeError
    from xpud.hw.machines import MachineError
    from xpud.hw.types import NvmlError, NvmlGpuLost

    lost = NvmlGpuLost("card 0: lost (fallen off the bus)", 15)
    assert isinstance(lost, XpudError) and isinstance(lost, RuntimeError) and lost.nvml_code == 15
    assert _status(lost) is _status(NvmlError("x")) is grpc.StatusCode.INTERNAL
    refused = rankproc.Refused("a: command not found on h", 127)
    assert refused.exit_code == 127 and _status(refused) is grpc.StatusCode.INTERNAL
    assert isinstance(MachineError("m"), ConfigError) and isinstance(MachineError("m"), ValueError)
    assert _status(MachineError("m")) is grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(DevNodeError("d"), OSError)
