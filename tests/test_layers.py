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
names the module it means. Strings that Python runs elsewhere (``python -c "from mpify_nb.rank
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

#: module -> layer: a module imports only modules of its own layer or lower ones. From the bottom:
LAYERS: dict[str, int] = {
    # 0: what anything may use: framing, errors, this process and what it started, torch's
    #    process groups, what training libraries expect, the stop button, a rank's displays
    "errors": 0,
    "wire": 0,
    "process": 0,
    "groups": 0,
    "libraries": 0,
    "interrupts": 0,
    "rank_display": 0,
    "rank_mpl_backend": 0,
    "rank_stdin": 0,  # a rank's stdin, asked of the notebook's user
    "rank_comms": 0,  # a rank's widget comms, sent to the caller
    "waits": 0,  # what a rank waits on in torch.distributed (its recorder, its stack)
    "protocol": 0,  # the frames a caller and its ranks exchange (kinds, request ids)
    # 1: what a call is made of: its payload, its relayed output; what the template preloads;
    #    a rank's control thread and a Session rank's process group
    "payload": 1,
    "shm": 1,  # the shared memory big tensors and arrays travel in (memfds)
    "relay": 1,  # the ranks' pipes: made or adopted, read (a thread or a pump), closed
    "relay_output": 1,  # what a rank's bytes become in the cell: labelled lines, bars, a view's feed
    "comms": 1,  # the caller's side of the ranks' widget comms: twins in the kernel
    "relay_lines": 1,  # the relay's lines: cut, live display lines, the caller's streams
    "prompts": 1,  # the caller's side of a rank's stdin: the frontend's input prompts
    "preload": 1,
    "rank_control": 1,
    "rank_group": 1,
    # 2, 3: a rank's process: a Session's rank serves its requests (session_rank) in the one
    #    loop of every rank, rank.serve, which runs a ranch rank's one CALL too
    "session_rank": 2,
    "rank": 3,
    # 4: the warm process ranks are forked from (it runs rank.main in each fork)
    "template_process": 4,
    "template": 4,
    # 5: where a rank starts: the seam, and the Ray placement that registers itself with it
    "placement": 5,
    "ray_ranks": 5,
    "ray_ranks.link": 5,
    "ray_ranks.worker": 5,
    "ray_ranks.handle": 5,
    "ray_ranks.client": 5,
    "ray_ranks.placer": 5,
    # 6: the engine: a set of live ranks (start, frames, output, deaths, stdin, stop); the
    #    caller's own rank where it plays one
    "engine": 6,
    "own_rank": 6,
    # 7: its two uses: ranch() (launcher) and Session (its rooms, from the bottom up)
    "launcher": 7,
    "session_ranks": 7,
    "session_recovery": 7,
    "session_calls": 7,
    "session": 7,
    # 8: what is built on them: in_torchddp, @distributed, import_star
    "ddp": 8,
    "decorator": 8,
    "imports": 8,
    # 9: the magics
    "magics": 9,
    "magics.cells": 9,
    "magics.auto": 9,
    "magics.onrank": 9,
    "magics.ranch": 9,
    "magics.session": 9,
    "magics.router": 9,  # where a cell goes (automatic mode), which ranks %%rank names
    "magics.status": 9,  # %dist_status's table
    "magics.views": 9,  # lines or tabs: how a persistent cell shows its ranks' output
    "magics.rank_cells": 9,  # a rank cell's pieces run in order, through the cell's view
    "magics.lifecycle": 9,  # the session's life: %dist_init ... %dist_status (a mixin)
    "magics.cells_and_data": 9,  # %%distributed, %%rank, %%local, %dist_push/%dist_pull, %sync (a mixin)
    # 10: the package's front door (re-exports, %load_ext, the "ray" placement's provider)
    PACKAGE: 10,
}


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
    assert "wire" in graph["launcher"]  # from . import ..., wire (module-level)
    assert "ray_ranks.link" in graph["ray_ranks.placer"]  # from .link import ...
    assert "payload" in graph["ray_ranks.link"]  # from .. import payload, wire
    assert "ray_ranks.placer" in graph["ray_ranks"]  # a package's __init__ re-exports
    assert "magics.ranch" in graph["magics"]
    assert "launcher" in graph[PACKAGE]  # from .launcher import ranch


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
    missing = sorted(set(graph) - set(LAYERS))
    gone = sorted(set(LAYERS) - set(graph))
    assert not missing, f"modules with no layer in tests/test_layers.py LAYERS: {missing}"
    assert not gone, f"LAYERS names modules that are not there: {gone}"


def test_imports_only_go_down() -> None:
    graph = import_graph()
    upward = sorted(f"{module} (layer {LAYERS[module]}) imports {target} (layer {LAYERS[target]})"
                    for module, targets in graph.items() if module in LAYERS
                    for target in targets if target in LAYERS and LAYERS[target] > LAYERS[module])
    if upward:
        pytest.fail(f"{len(upward)} import(s) going up a layer:\n" + "\n".join("  " + line for line in upward))
