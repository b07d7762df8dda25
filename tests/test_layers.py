"""The modules of mpify_nb import each other in layers: imports only go down, and none go round.

The graph is read from the source with ``ast``, never by importing anything. Its nodes are the
modules of ``src/mpify_nb``, named from the package down (``launcher``, ``ray_ranks.placer``; a
package's ``__init__.py`` is the package's own name, ``ray_ranks``, and the top one is
``mpify_nb``). Its edges are *every* import statement anywhere in a module: at the top, inside
functions and methods, under ``if TYPE_CHECKING:`` and in ``try`` blocks alike. An import made
late, in a function, still means the lower module knows the higher one, and an import for types
only still names it; so neither is let off.

How an import statement reads:

* ``from . import x`` / ``from mpify_nb import x``: module ``x`` when ``x`` is one (a file or
  a package next to it), else the package itself (``x`` is a name it defines);
* ``from .x import y`` / ``from mpify_nb.x import y``: module ``x.y`` when ``x`` is a package
  and ``y`` one of its modules, else module ``x`` (``y`` is a name it defines);
* ``import mpify_nb.x.y``: module ``x.y``; ``import mpify_nb``: the top package;
* a package's ``__init__`` that re-exports names of its modules imports those modules, like
  any other module.

Importing ``x.y`` runs package ``x``'s ``__init__`` first, but the graph does not add that edge:
a package's own modules import each other while it is being imported, and an outside module
names the module it means. Strings that Python runs elsewhere (``python -c "from mpify_nb.rank.loop
import main"``) are not imports of the module that holds them.

Two checks: no cycle (each is named, ``a -> b -> c -> a``), and the declared layer order below:
no module imports one of a higher layer. A module may import others of its own layer (that is
what the cycle check is for).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "mpify_nb"
SRC = Path(__file__).resolve().parent.parent / "src" / PACKAGE

#: package (or top-level module) -> layer: a module imports only modules of its own layer or lower
#: ones; inside a package, its modules import each other without cycles. From the bottom:
LAYERS: dict[str, int] = {
    # 0: what both sides use: the wire format (errors, framing, protocol, payload, shared memory);
    #    what we know of torch.distributed and the training libraries on it
    "wire": 0,
    "torchdist": 0,
    # 1: what runs inside a rank process; the ranks' output relayed into the cell (caller's side)
    "rank": 1,
    "relay": 1,
    # 2: where a rank starts: placement, the template (its process runs rank.loop in each fork), Ray
    "start": 2,
    # 3: the engine: the one owner of live ranks, and the caller's half of each capability
    "engine": 3,
    # 4: its two uses: ranch() and Session
    "launcher": 4,
    "session": 4,
    # 5: what is built on them: in_torchddp, @distributed, import_star
    "ddp": 5,
    "decorator": 5,
    "imports": 5,
    # 5: the frontend's debugger panel across a Session's ranks (the kernel's half; the rank's is rank/)
    "debugger": 5,
    # 6: the magics
    "magics": 6,
    # 7: the package's front door (re-exports, %load_ext, the "ray" placement's provider)
    PACKAGE: 7,
}

#: package -> the packages its modules may import from besides its own: the process boundary.
#: A rank process runs nothing of the caller's side (engine, relay, start, launcher, session ...).
MAY_ONLY_IMPORT: dict[str, set[str]] = {
    "rank": {"wire", "torchdist"},
    "wire": set(),
    "torchdist": set(),
    "relay": set(),
}


def layer_of(module: str) -> int:
    return LAYERS[package_of(module)]


def package_of(module: str) -> str:
    """``rank.loop`` -> ``rank``; the top package is itself."""
    return module.split(".")[0] if module != PACKAGE else PACKAGE


def _modules() -> dict[str, Path]:
    """Every module of the package, by its name from the package down."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts) or PACKAGE] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _targets(module: str, node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that one import statement in ``module`` imports."""

    def named(dotted: str) -> str | None:
        """``x.y`` (from the package down, "" for the package) as a module of the graph."""
        return (dotted or PACKAGE) if (dotted or PACKAGE) in modules else None

    def inner(dotted: str) -> str | None:
        """``mpify_nb.x.y`` -> ``x.y``; None for a module outside the package."""
        if dotted == PACKAGE:
            return ""
        if dotted.startswith(PACKAGE + "."):
            return dotted[len(PACKAGE) + 1:]
        return None

    out: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = inner(alias.name)
            target = named(name) if name is not None else None
            if target is not None:
                out.add(target)
        return out
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        # Relative: from the package that holds ``module`` (a package's __init__ is that package).
        parts = [] if module == PACKAGE else module.split(".")
        package = parts if module == PACKAGE or _is_package(module, modules) else parts[:-1]
        package = package[: len(package) - (node.level - 1)]
        source = ".".join(package + ([node.module] if node.module else []))
    else:
        source = inner(node.module or "")
        if source is None:
            return out
    source_module = named(source)
    assert source_module is not None, f"{module}: {ast.unparse(node)} names no module of {PACKAGE}"
    for alias in node.names:
        sub = f"{source}.{alias.name}" if source else alias.name
        if sub in modules:
            out.add(sub)  # ``from . import x``: module x
        else:
            out.add(source_module)  # a name defined by ``source``
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in it), itself left out."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(name, node, modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(components)


def _shortest_path(graph: dict[str, set[str]], start: str, goal: str, within: set[str]) -> list[str]:
    """Breadth first, from ``start`` to ``goal`` through ``within`` only (a path is known to exist)."""
    previous: dict[str, str] = {start: start}
    frontier = [start]
    while goal not in previous:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & within):
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    path = [goal]
    while path[-1] != start:
        path.append(previous[path[-1]])
    return path[::-1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles that tie the modules together, each as a path that ends where it starts
    (``["a", "b", "a"]``): for every import inside a knot, the shortest cycle through it, so each
    import that would have to go is named in at least one. Each cycle starts at its first
    module in alphabetical order; none is named twice."""
    found: set[tuple[str, ...]] = set()
    for knot in knots(graph):
        members = set(knot)
        for a in knot:
            for b in sorted(graph[a] & members):
                loop = [a] + _shortest_path(graph, b, a, members)[:-1]
                first = loop.index(min(loop))
                rotated = loop[first:] + loop[:first]
                found.add(tuple(rotated + rotated[:1]))
    return sorted((list(c) for c in found), key=lambda c: (len(c), c))


def test_graph_reads_imports_as_described() -> None:
    """The reader itself: a few edges that are known to be there, of each kind of statement."""
    graph = import_graph()
    assert "wire.framing" in graph["launcher.call"]  # from ..wire import ..., framing (module-level)
    assert "start.ray_ranks.link" in graph["start.ray_ranks.placer"]  # from .link import ...
    assert "wire.payload" in graph["start.ray_ranks.link"]  # from ...wire import framing, payload, shm
    assert "start.ray_ranks.placer" in graph["start.ray_ranks"]  # a package's __init__ re-exports
    assert "magics.ranch" in graph["magics"]
    assert "launcher.ranch" in graph[PACKAGE]  # from .launcher.ranch import ranch
    assert "rank.loop" in graph["start.template_process"]  # inside a function


def test_reader_on_small_sources() -> None:
    """Imports in functions and under TYPE_CHECKING count; relative and absolute forms agree."""
    modules = {PACKAGE: SRC / "__init__.py", "a": SRC / "a.py", "pkg": SRC / "pkg" / "__init__.py",
               "pkg.b": SRC / "pkg" / "b.py", "pkg.c": SRC / "pkg" / "c.py"}

    def edges(module: str, source: str) -> set[str]:
        out: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out |= _targets(module, node, modules)
        return out

    assert edges("a", "def f():\n    from . import pkg\n") == {"pkg"}
    assert edges("a", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pkg.b import X\n") == {"pkg.b"}
    assert edges("a", "import mpify_nb.pkg.c\nimport mpify_nb\nimport os\n") == {"pkg.c", PACKAGE}
    assert edges("a", "from mpify_nb import a, pkg, __version__\n") == {"a", "pkg", PACKAGE}
    assert edges("a", "from .pkg import b, name\n") == {"pkg.b", "pkg"}
    assert edges("pkg.b", "from .. import a\nfrom .c import f\nfrom . import c\n") == {"a", "pkg.c"}
    assert edges("pkg", "from .b import f\nfrom ..a import g\n") == {"pkg.b", "a"}


def test_cycles_are_named() -> None:
    """The cycle finder on a made-up graph: each knot named once, as a path back to its start."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": set()}
    assert knots(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles(graph) == [["e", "f", "e"], ["a", "b", "c", "a"]]
    graph = {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}  # two cycles in one knot: both named
    assert cycles(graph) == [["a", "b", "a"], ["a", "c", "a"]]


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    if found:
        pytest.fail(f"{len(found)} import cycle(s) in {PACKAGE}, among "
                    + "; ".join(", ".join(knot) for knot in knots(graph)) + ":\n"
                    + "\n".join("  " + " -> ".join(path) for path in found))


def test_every_module_has_a_layer() -> None:
    graph = import_graph()
    missing = sorted(module for module in graph if package_of(module) not in LAYERS)
    gone = sorted(set(LAYERS) - {package_of(module) for module in graph})
    assert not missing, f"modules with no layer in tests/test_layers.py LAYERS: {missing}"
    assert not gone, f"LAYERS names packages or modules that are not there: {gone}"


def test_imports_only_go_down() -> None:
    graph = import_graph()
    upward = sorted(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
                    for module, targets in graph.items() for target in targets
                    if layer_of(target) > layer_of(module))
    if upward:
        pytest.fail(f"{len(upward)} import(s) going up a layer:\n" + "\n".join("  " + line for line in upward))


def test_a_rank_process_runs_nothing_of_the_callers_side() -> None:
    """rank/ imports only rank/, wire/ and torchdist/ (and those two only themselves): what runs in a
    rank process is visible in the folders, and a rank never loads the engine, the relay or a Session."""
    graph = import_graph()
    crossing = sorted(f"{module} imports {target}"
                      for module, targets in graph.items() if package_of(module) in MAY_ONLY_IMPORT
                      for target in targets
                      if package_of(target) != package_of(module)
                      and package_of(target) not in MAY_ONLY_IMPORT[package_of(module)])
    assert not crossing, "imports across the process boundary:\n" + "\n".join("  " + line for line in crossing)


#: Where a function handed to ranks by reference may live: the rank unpickles it by importing its
#: module, so that module must lie below the process boundary (MAY_ONLY_IMPORT["rank"] and rank/).
SHIPPABLE = {"rank", *MAY_ONLY_IMPORT["rank"]}


def _shipped(module: str, tree: ast.AST, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(the function as written, the module it comes from) for each function of the package that
    ``module`` hands to ranks: ``ranch(n, fn, ...)`` and ``<session>.apply(fn, ...)``. A name the
    module defines itself comes from ``module``; one it imports, from that module; others (a
    parameter, the user's function) are not the package's and are left out."""
    imported: dict[str, str] = {}  # name bound by an import -> the module it names or comes from
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                targets = _targets(module, ast.ImportFrom(node.module, [alias], node.level), modules)
                if targets:
                    imported[alias.asname or alias.name] = targets.pop()
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
    top_level = {n.name for n in getattr(tree, "body", []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func
        if isinstance(callee, ast.Name) and callee.id == "ranch" and len(node.args) >= 2:
            fn = node.args[1]
        elif isinstance(callee, ast.Attribute) and callee.attr == "apply" and node.args:
            fn = node.args[0]
        else:
            continue
        if isinstance(fn, ast.Name) and fn.id in top_level:
            out.append((fn.id, module))
        elif isinstance(fn, ast.Name) and fn.id in imported:
            out.append((fn.id, imported[fn.id]))
        elif isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id in imported:
            out.append((ast.unparse(fn), imported[fn.value.id]))
    return out


def test_what_ranks_run_lives_below_the_process_boundary() -> None:
    """A function the package hands to ranks (``ranch``, ``Session.apply``) travels by reference: a
    rank imports its module to unpickle it. Living in magics/ (or anywhere above rank/), it would
    load the caller's side into every rank: the one arrow from inside a rank up to the top floor."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        for fn, where in _shipped(name, ast.parse(path.read_text()), modules):
            if package_of(where) not in SHIPPABLE:
                found.append(f"{name} hands {fn} (of {where}) to the ranks; move it into rank/")
    assert not found, "functions the ranks import from above the process boundary:\n" + "\n".join(
        "  " + line for line in found)


def test_the_shipped_functions_reader_on_small_sources() -> None:
    modules = {PACKAGE: SRC / "__init__.py", "magics": SRC / "magics" / "__init__.py",
               "magics.m": SRC / "magics" / "m.py", "rank": SRC / "rank" / "__init__.py",
               "rank.cells": SRC / "rank" / "cells.py"}

    def shipped(source: str) -> list[tuple[str, str]]:
        return _shipped("magics.m", ast.parse(source), modules)

    assert shipped("def here(): pass\ndef f(n):\n    ranch(n, here, 1)\n") == [("here", "magics.m")]
    assert shipped("from ..rank.cells import run\ndef f(s):\n    s.apply(run, ranks=[0])\n") == [("run", "rank.cells")]
    assert shipped("from ..rank import cells as on\ndef f(s):\n    s.apply(on.time_code, 1)\n") == [
        ("on.time_code", "rank.cells")]
    assert shipped("def f(s, fn):\n    s.apply(fn)\n    ranch(2, lambda: 1)\n") == []  # the user's: not ours


#: The largest a class or a module of the package may grow (issue 34): a class a reader holds in
#: their head, a module whose pieces are found by their concept. Past either, split it by job.
MAX_CLASS_LINES = 330
MAX_MODULE_LINES = 500


def too_big(source: str, where: str) -> list[str]:
    """The module (``where``) and the classes in ``source`` over the limits, each with its size."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"module {where}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > MAX_CLASS_LINES:
                found.append(f"class {node.name} in {where}, line {node.lineno}: {size} lines "
                             f"(at most {MAX_CLASS_LINES})")
    return found


def test_no_class_or_module_too_big_to_hold() -> None:
    found = [line for path in sorted(SRC.rglob("*.py"))
             for line in too_big(path.read_text(), str(path.relative_to(SRC.parent)))]
    assert not found, "split these by job (pure moves first, then collaborators with one job each):\n" + \
        "\n".join("  " + line for line in found)


def test_the_size_check_on_small_sources() -> None:
    small = "class A:\n    x = 1\n"
    assert too_big(small, "a.py") == []
    big_class = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES
    assert too_big(big_class, "b.py") == [f"class Big in b.py, line 1: {MAX_CLASS_LINES + 1} lines "
                                          f"(at most {MAX_CLASS_LINES})"]
    long_module = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert too_big(long_module, "c.py") == [f"module c.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"]


def test_moved_modules_keep_their_documented_names() -> None:
    """``mpify_nb.template``, ``mpify_nb.placement`` and ``mpify_nb.errors`` moved into packages; the
    documented names still import the same modules."""
    import importlib

    import mpify_nb

    for old, new in {"template": "start.template", "placement": "start.placement", "errors": "wire.errors"}.items():
        moved = importlib.import_module(f"mpify_nb.{new}")
        assert importlib.import_module(f"mpify_nb.{old}") is moved
        assert getattr(mpify_nb, old) is moved
    from mpify_nb.errors import CollectiveError, RankError

    assert RankError is mpify_nb.RankError and CollectiveError.__module__ == "mpify_nb.wire.errors"


def test_a_new_interpreter_finds_this_copy_of_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """The template and spawned ranks start with ``bootstrap_env()``: its PYTHONPATH leads to this
    very copy of mpify_nb (checked with site off and no PYTHONPATH of ours, so no installed copy
    can stand in for it)."""
    import subprocess
    import sys

    from mpify_nb.start.environ import bootstrap_env

    monkeypatch.delenv("PYTHONPATH", raising=False)

    found = subprocess.run([sys.executable, "-S", "-c",
                            "import importlib.util; print(importlib.util.find_spec('mpify_nb').origin)"],
                           env=bootstrap_env(), capture_output=True, text=True, check=True, cwd="/")
    assert found.stdout.strip() == str(SRC / "__init__.py")
