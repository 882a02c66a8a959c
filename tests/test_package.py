"""The package's public names, imported on first use (in fresh interpreters: what a
process that imports only the vLLM plugin pays), and the house rules of its layout, read
from the source with :mod:`ast`: the lazy fronts' three lists agree, every module stays
under the size limit, imports run one way with no cycle, nothing outside the package
(tests, benchmarks, examples) imports a private module but the white-box tests of
:data:`WHITE_BOX`, no public module hands out a private name, and every public handle
follows the verb table of docs/api.md."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal, get_origin

import pytest

import trio_dpcoord

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "trio_dpcoord"
ROOT = "trio_dpcoord"


def _fresh(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return result.stdout.strip()


def test_the_vllm_plugin_imports_neither_trio_nor_the_service() -> None:
    loaded = _fresh(
        "import sys, trio_dpcoord.vllm\n"
        "print(sorted(m for m in ('trio', 'zmq', 'msgpack', 'trio_dpcoord.core',"
        " 'trio_dpcoord.protocol', 'trio_dpcoord.routing') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_every_public_name_resolves_to_its_module_object() -> None:
    for name in trio_dpcoord.__all__:
        value = getattr(trio_dpcoord, name)
        if get_origin(value) is Literal:  # a type alias (Routing) has no module of its own
            continue
        assert value.__module__.startswith("trio_dpcoord"), name
        # the lazy export is the defining module's object itself, not a copy
        assert getattr(sys.modules[value.__module__], name) is value, name
    assert set(trio_dpcoord.__all__) <= set(dir(trio_dpcoord))


def test_star_import_and_submodules_work_in_a_fresh_interpreter() -> None:
    out = _fresh(
        "from trio_dpcoord import *\n"
        "import trio_dpcoord\n"
        "print(open_coordinator.__name__, trio_dpcoord.protocol.__name__)"
    )
    assert out == "open_coordinator trio_dpcoord.protocol"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'open_coordinatr'"):
        getattr(trio_dpcoord, "open_coordinatr")  # noqa: B009 -- the lookup is the test


@pytest.mark.parametrize(
    "front", ["trio_dpcoord.protocol", "trio_dpcoord.core", "trio_dpcoord.routing"]
)
def test_every_name_a_front_lists_resolves(front: str) -> None:
    module = importlib.import_module(front)
    assert module.__all__, front
    for name in module.__all__:
        assert hasattr(module, name), f"{front}.{name}"


# --- the house, read from the source --------------------------------------------------

MAX_LINES = 600
"""No module of the package is longer: past it, a module holds more than one room (a
module near it is split at a real seam, never trimmed to fit)."""

INTEGRATIONS = 4
FLOORS: dict[str, int] = {
    # integrations: they may import each other, and everything below
    "cli": INTEGRATIONS,
    "metrics": INTEGRATIONS,
    "testing": INTEGRATIONS,
    "vllm": INTEGRATIONS,
    "sim": INTEGRATIONS,
    "__main__": INTEGRATIONS,
    "engine_protocol": INTEGRATIONS,  # the old path of protocol's engine-core codecs
    "_supervisor": INTEGRATIONS,  # the stdlib-only process supervisor of serve and vLLM
    "_shell": 3,  # the trio tasks and handles
    "trio_zmq": 2,  # the trio shim over pyzmq
    "core": 2,  # sans-IO rooms
    "routing": 1,  # sans-IO engine choice
    "protocol": 0,  # bytes only
}
"""Each room of the package (its top-level module or sub-package) and its floor: a module
imports its own room, the rooms of lower floors and the foundations; integrations also
import each other."""

FOUNDATIONS = frozenset({"_errors", "_heartbeat", "_lazy", "_reject_log", "_compiled"})
"""Modules anyone may import; they import nothing of the package."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def room(module: str) -> str:
    """The room of ``module`` (its top-level module or sub-package under the package:
    ``core`` for any module of ``core/``), ``""`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    nodes: Iterable[ast.AST], type_checking: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement in ``nodes`` (in functions too), and whether it runs only
    for type checkers (under ``if TYPE_CHECKING:``)."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, True)
            yield from _import_nodes(node.orelse, type_checking)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node), type_checking)


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names."""
    if not node.level:
        return node.module or ""
    is_package = package_modules()[module].name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _string_list(node: ast.expr) -> list[str]:
    assert isinstance(node, ast.List | ast.Tuple), ast.dump(node)
    values = [ast.literal_eval(element) for element in node.elts]
    assert all(isinstance(value, str) for value in values)
    return values


def _assigned(tree: ast.Module, name: str) -> ast.expr | None:
    """The value assigned to ``name`` at the top of a module (plain or annotated)."""
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == name for target in statement.targets
        ):
            return statement.value
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and statement.target.id == name
        ):
            return statement.value
    return None


@cache
def lazy_exports(package: str) -> dict[str, str]:
    """A lazy front's ``_EXPORTS`` table (name -> relative module), empty if it has none."""
    path = package_modules().get(package)
    if path is None or path.name != "__init__.py":
        return {}
    table = _assigned(parsed(path), "_EXPORTS")
    if table is None:
        return {}
    assert isinstance(table, ast.Dict)
    exports = ast.literal_eval(table)
    assert isinstance(exports, dict)
    return exports


def _resolve_relative(package: str, relative: str) -> str:
    """The absolute name of a module named relative to ``package`` (``..x`` is a sibling
    of ``package``'s own package)."""
    level = len(relative) - len(relative.lstrip("."))
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*base, relative.lstrip(".")])


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_checking: bool

    def __str__(self) -> str:
        path = package_modules()[self.source].relative_to(REPO)
        return f"{path}:{self.line}: {self.source} imports {self.target}"


@cache
def import_edges() -> tuple[Edge, ...]:
    """Every import of a package module by another, resolved: ``from . import x`` of a
    submodule is that submodule; a name a lazy front exports (``from trio_dpcoord import
    open_coordinator``) is the front and the module that defines the name, both imported
    when the statement runs."""
    modules = package_modules()
    edges = []
    for source, path in modules.items():
        for node, type_checking in _import_nodes(parsed(path).body):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(source, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        targets.append(submodule)
                        continue
                    targets.append(base)
                    relative = lazy_exports(base).get(alias.name)
                    if relative is not None:
                        targets.append(_resolve_relative(base, relative))
            for target in targets:
                if target.split(".")[0] == ROOT and target != source:
                    edges.append(Edge(source, target, node.lineno, type_checking))
    return tuple(edges)


def _allowed(source: str, target: str) -> bool:
    """Whether ``source`` may import ``target`` (at run time) by the house's floors."""
    here, there = room(source), room(target)
    if there in FOUNDATIONS or target == ROOT:
        return here not in FOUNDATIONS or there in FOUNDATIONS
    if here not in FLOORS or there not in FLOORS:  # the lazy package, the foundations
        return False
    if here == there:
        return True
    return FLOORS[there] < FLOORS[here] or FLOORS[here] == FLOORS[there] == INTEGRATIONS


def find_cycle(edges: list[tuple[str, str]]) -> list[str] | None:
    """A cycle of the directed graph ``edges`` (its modules in order, the first repeated
    last), or None."""
    graph: dict[str, list[str]] = {}
    for source, target in edges:
        graph.setdefault(source, []).append(target)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found is not None:
                return found
    return None


@pytest.mark.parametrize("front", ["__init__.py", "routing/__init__.py"])
def test_a_lazy_fronts_all_table_and_type_checking_imports_agree(front: str) -> None:
    """``__all__``, the ``_EXPORTS`` table and the ``TYPE_CHECKING`` imports (what type
    checkers read) name the same names, each from the same module."""
    path = PACKAGE / front
    tree = parsed(path)
    listed = _assigned(tree, "__all__")
    assert listed is not None, f"{front} has no __all__"
    names = _string_list(listed)
    assert len(names) == len(set(names)), f"{front}: a name twice in __all__"
    table = lazy_exports(module_name(path))
    assert table, f"{front} has no _EXPORTS table"
    typed: dict[str, str] = {}
    for node, type_checking in _import_nodes(tree.body):
        if not (type_checking and isinstance(node, ast.ImportFrom)):
            continue
        for alias in node.names:
            # ``X as X``: the explicit re-export type checkers want
            where = f"{front}:{node.lineno}: {alias.name}"
            assert alias.asname == alias.name, f"{where} as {alias.asname}"
            assert alias.name not in typed, f"{where} imported twice"
            typed[alias.name] = "." * node.level + (node.module or "")
    assert set(names) == set(table), f"{front}: __all__ and _EXPORTS differ"
    assert typed == table, f"{front}: the TYPE_CHECKING imports and _EXPORTS differ"


def test_no_module_is_over_the_size_limit() -> None:
    too_long = {
        str(path.relative_to(REPO)): lines
        for path in package_modules().values()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"over {MAX_LINES} lines: {too_long}"


def test_every_module_lives_in_a_known_room() -> None:
    rooms = {room(module) for module in package_modules()} - {""}
    assert rooms <= set(FLOORS) | FOUNDATIONS, f"put on a floor: {rooms - set(FLOORS)}"


def test_imports_run_downward() -> None:
    """Integrations -> ``_shell`` -> ``trio_zmq``/``core`` -> ``routing`` -> ``protocol``,
    the foundations (``_errors``, ``_lazy``) below them all; imports inside functions count,
    imports for type checkers only do not."""
    upward = [
        str(edge)
        for edge in import_edges()
        if not edge.type_checking and not _allowed(edge.source, edge.target)
    ]
    assert not upward, "imports against the house's floors:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    edges = [(e.source, e.target) for e in import_edges() if not e.type_checking]
    assert edges, "no imports found: the scan is broken"
    cycle = find_cycle(edges)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or [])


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The checks above can fail: the cycle finder finds a cycle, the floors refuse."""
    assert find_cycle([("a", "b"), ("b", "c"), ("c", "a")]) == ["a", "b", "c", "a"]
    assert find_cycle([("a", "b"), ("a", "c"), ("b", "c")]) is None
    assert not _allowed(f"{ROOT}.protocol._codec", f"{ROOT}.core")
    assert not _allowed(f"{ROOT}.core._wave", f"{ROOT}.trio_zmq")
    assert _allowed(f"{ROOT}.sim.cluster", f"{ROOT}.cli")
    assert any(e.target == f"{ROOT}._shell.coordinator" for e in import_edges())


# --- outside the package: public names only ---------------------------------------------

OUTSIDE = ("tests", "benchmarks", "examples")
_DOTTED = re.compile(r"\btrio_dpcoord(?:\.\w+)*")


def _private_path(dotted: str) -> bool:
    """Whether a dotted path of the package has a private part (``_x``, not ``__x__``)."""
    return any(part.startswith("_") and not part.endswith("__") for part in dotted.split("."))


WHITE_BOX: dict[str, str] = {
    # module: why a test must see inside it
    f"{ROOT}._shell.pumps": "tests/test_service.py drives the coordinator's pumps by hand",
    f"{ROOT}.vllm._routing": "the vLLM plugin's routing rules and per-client state",
    f"{ROOT}.vllm._peers": "the vLLM plugin's routes shared between API servers",
    f"{ROOT}._compiled": "the compiled twins' switch: the differential tests load the pure twin",
    f"{ROOT}._supervisor": "the supervisor's sans-IO rules on a fake clock (tests/shell)",
    f"{ROOT}._heartbeat": "the worker's heartbeat record beside the wave (tests/shell)",
}
"""The private modules tests may import (white-box tests of exactly that module, its
private names included); nothing else outside the package names a private module."""


def _white_box(dotted: str, path: Path) -> bool:
    """Whether ``dotted`` (a module, or a name in one) is in a white-box module that
    ``path`` (a file outside the package) may import."""
    if path.relative_to(REPO).parts[0] != "tests":
        return False
    return any(dotted == module or dotted.startswith(module + ".") for module in WHITE_BOX)


def private_uses(path: Path) -> Iterator[str]:
    """Where ``path`` names a private module or name of the package: imports, dotted
    attribute chains from ``trio_dpcoord``, and module paths in strings (scripts run in
    subprocesses, logger names); the white-box modules of :data:`WHITE_BOX` are allowed
    in tests."""
    for node in ast.walk(parsed(path)):
        found: list[str] = []
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == ROOT:
                found += [node.module] if _private_path(node.module) else []
                found += [f"{node.module}.{a.name}" for a in node.names if _private_path(a.name)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == ROOT]
            found = [name for name in found if _private_path(name)]
        elif isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if dotted.split(".")[0] == ROOT and _private_path(dotted):
                found.append(dotted)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [m for m in _DOTTED.findall(node.value) if _private_path(m)]
        for name in dict.fromkeys(found):
            if not _white_box(name, path):
                yield f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}: {name}"


def test_nothing_outside_the_package_imports_a_private_module() -> None:
    """Tests, benchmarks and examples use the public fronts (``trio_dpcoord``, its
    ``protocol``, ``core``, ``routing``, ``trio_zmq``, ``testing``, ``sim``); a white-box
    test imports the private module it tests, from :data:`WHITE_BOX` only."""
    files = [path for top in OUTSIDE for path in sorted((REPO / top).rglob("*.py"))]
    assert len(files) > 20, "the scan found too few files"
    uses = [use for path in files for use in private_uses(path)]
    assert not uses, "private names of the package used outside it:\n" + "\n".join(uses)


def test_the_white_box_list_is_short_and_used() -> None:
    """Every white-box module is a module of the package some test imports (a stale entry
    would let a new test in unseen)."""
    assert len(WHITE_BOX) <= 6, "the white-box list is not short: make names public"
    tests = sorted((REPO / "tests").rglob("*.py"))
    imported = {
        node.module
        for path in tests
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    for module in WHITE_BOX:
        assert module in package_modules(), f"{module}: no such module"
        assert module in imported, f"{module}: no test imports it; drop it from WHITE_BOX"


# --- public modules: public names only --------------------------------------------------


def public_modules() -> list[str]:
    """Every module of the package with no private part in its path (``__main__`` aside:
    importing it runs the command line)."""
    return [m for m in package_modules() if not _private_path(m) and not m.endswith("__main__")]


def exported(module: object) -> list[str]:
    """What a module offers: its ``__all__``, else its public globals that are not modules."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    ]


def front_of(module: str) -> str:
    """The public module that fronts ``module``: itself when public, else its nearest
    ancestor without a private part (the package itself for a module of ``_shell``)."""
    parts = module.split(".")
    while _private_path(".".join(parts)):
        parts.pop()
    return ".".join(parts)


def private_passages(module_name: str) -> Iterator[str]:
    """Where public module ``module_name`` hands out a private name: a private name in its
    exports, an alias of a private name (``from ._x import _Y as Y``), or an object of a
    private module that the module's own front does not export (a room's inside reached
    through another room's public module)."""
    path = package_modules()[module_name]
    for node, _ in _import_nodes(parsed(path).body):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private_path(alias.name) and alias.asname and not _private_path(alias.asname):
                    yield f"{module_name}: imports {alias.name} as the public {alias.asname}"
    module = importlib.import_module(module_name)
    for name in exported(module):
        if _private_path(name):
            yield f"{module_name}: exports the private name {name}"
            continue
        value = getattr(module, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        home = value.__module__
        if not home.startswith(ROOT):
            continue
        if _private_path(value.__name__):
            yield f"{module_name}.{name} is the private {home}.{value.__name__}"
            continue
        front = front_of(home)
        if front == module_name or not _private_path(home):
            continue
        offered = importlib.import_module(front)
        if not any(getattr(offered, other, None) is value for other in exported(offered)):
            yield f"{module_name}.{name} is {home}.{value.__name__}, which {front} does not export"


def test_no_private_name_passes_through_a_public_module() -> None:
    modules = public_modules()
    assert {f"{ROOT}.testing", f"{ROOT}.routing", f"{ROOT}.sim"} <= set(modules)
    passages = [passage for module in modules for passage in private_passages(module)]
    assert not passages, "private names handed out by public modules:\n" + "\n".join(passages)


# --- one verb per act (docs/api.md) -----------------------------------------------------

PUBLIC_FRONTS = (
    ROOT,
    f"{ROOT}.protocol",
    f"{ROOT}.core",
    f"{ROOT}.routing",
    f"{ROOT}.trio_zmq",
    f"{ROOT}.testing",
    f"{ROOT}.sim",
    f"{ROOT}.vllm",
    f"{ROOT}.metrics",
    f"{ROOT}.cli",
)
"""The public sub-packages (and modules) whose exported classes are the public handles."""

NOUN_EXEMPT = (f"{ROOT}.protocol", f"{ROOT}.sim")
"""Where an engine keeps vLLM's name, its DP rank: the wire's fields, a simulated engine
process (docs/api.md)."""

STEMS = {
    "choose": {"choose", "route", "pick", "select"},
    "observe": {"observe", "note", "pin", "pinned"},
    "resize": {"resize", "scale"},
}
"""The words that say an act: a public name holding one is that act's verb, nothing else."""


@dataclass(frozen=True)
class Act:
    description: str
    verbs: tuple[str, ...]
    handles: tuple[str, ...]
    synonyms: tuple[str, ...]


def _codes(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


@cache
def verb_table() -> tuple[Act, ...]:
    """The acts of docs/api.md's table (between its ``verb-table`` markers)."""
    text = (REPO / "docs" / "api.md").read_text()
    table = text.split("<!-- verb-table -->")[1].split("<!-- /verb-table -->")[0]
    rows = [line for line in table.strip().splitlines() if line.startswith("|")][2:]
    acts = []
    for row in rows:
        act, verbs, handles, synonyms = (cell.strip() for cell in row.strip("|").split("|"))
        listed = ("every handle",) if handles == "every handle" else _codes(handles)
        acts.append(Act(act, _codes(verbs), listed, _codes(synonyms)))
    return tuple(acts)


@cache
def public_handles() -> dict[str, tuple[str, type]]:
    """Every class exported from a public front, by name: (the front, the class)."""
    handles: dict[str, tuple[str, type]] = {}
    for front in PUBLIC_FRONTS:
        module = importlib.import_module(front)
        for name in exported(module):
            value = getattr(module, name)
            if inspect.isclass(value) and value.__module__.startswith(ROOT):
                handles.setdefault(name, (front, value))
    return handles


def own_names(cls: type) -> Iterator[str]:
    """The public attributes, fields and method parameters ``cls`` defines itself or
    inherits from the package (not from builtins: ``Exception.add_note``)."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith(ROOT):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            if name != "__init__":
                yield name
            function = value.__func__ if isinstance(value, classmethod | staticmethod) else value
            if inspect.isfunction(function):
                parameters = inspect.signature(function).parameters
                yield from (p for p in parameters if p not in ("self", "cls"))
        yield from getattr(klass, "__dataclass_fields__", {})
        yield from getattr(klass, "_fields", ())
        yield from (n for n in getattr(klass, "__slots__", ()) if not n.startswith("_"))


def test_the_verb_table_names_every_act_once() -> None:
    acts = verb_table()
    assert {act.verbs[0] for act in acts} >= {"choose", "observe", "resize", "engine_index"}
    handles = public_handles()
    for act in acts:
        if act.handles == ("every handle",):
            continue
        assert act.handles, act.description
        for handle in act.handles:
            assert handle in handles, f"{handle} ({act.description}) is not a public handle"


def test_every_handle_that_does_an_act_uses_its_verb() -> None:
    handles = public_handles()
    missing = [
        f"{handle}.{act.verbs[0]} ({act.description})"
        for act in verb_table()
        for handle in act.handles
        if handle in handles and not hasattr(handles[handle][1], act.verbs[0])
    ]
    assert not missing, "handles without their act's verb:\n" + "\n".join(missing)


def test_no_public_handle_has_a_synonym() -> None:
    """No synonym of the table, no other name made of an act's word, and no engine called
    a rank outside :data:`NOUN_EXEMPT`."""
    synonyms = {synonym for act in verb_table() for synonym in act.synonyms}
    nouns = {"rank", "ranks"}
    found = []
    for name, (front, cls) in sorted(public_handles().items()):
        for attribute in sorted(set(own_names(cls))):
            words = set(attribute.split("_"))
            if attribute in synonyms - nouns:
                found.append(f"{front}.{name}.{attribute}: a synonym")
            for verb, stems in STEMS.items():
                if words & stems and attribute != verb:
                    found.append(f"{front}.{name}.{attribute}: say {verb!r}")
            if words & nouns and front not in NOUN_EXEMPT:
                found.append(f"{front}.{name}.{attribute}: an engine is engine_index")
    assert not found, "names against docs/api.md:\n" + "\n".join(found)


def test_the_walk_sees_a_handles_methods_fields_and_parameters() -> None:
    """The checks above can fail: the walk finds what they look for."""
    from trio_dpcoord.routing import PrefixRouter, RouteDecision

    assert {"choose", "observe", "resize", "engine_index"} <= set(own_names(PrefixRouter))
    assert "cached_tokens" in set(own_names(RouteDecision))
    assert "add_note" not in set(own_names(trio_dpcoord.EngineDeadError))


def test_statistics_types_are_named_statistics() -> None:
    counters = sorted(name for name in public_handles() if name.endswith("Counters"))
    assert not counters, f"name them ...Statistics: {counters}"
    assert "RestartStatistics" in trio_dpcoord.__all__
