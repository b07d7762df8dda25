"""Which names a cell takes from the notebook: the names it reads before binding them itself,
in order of first use, found in its syntax tree (nothing runs). These travel to the ranks
(``%%ranch``'s ``need=``; a rank cell's names a rank lacks). Nothing here imports IPython:
the ``shell`` arguments are IPython's InteractiveShell, passed in by the magics.

::

    x = 1            # binds x: a later read of x takes nothing from the notebook
    y = x + scale    # reads scale (the notebook's, if it has one)
    def f(): lr      # read when f is called: taken unless the cell binds lr anywhere
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import Any, Optional, Union

# -- which names a cell takes from the notebook ---------------------------------------------

_FUNCTION_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def names_read_from_notebook(module: ast.Module) -> list[str]:
    """Names the cell reads without having bound them itself first, in order of first use.

    Statements are followed in order: a read counts unless an earlier statement
    surely bound the name (``x = 1`` then ``x + 1`` takes nothing from the notebook,
    so a stale or unpicklable ``x`` left there by an earlier run is not shipped).
    Inside a branch, loop or ``with`` block, what the block bound so far counts
    too; after it, only what every path bound. Reads inside function bodies happen
    when the function is called: they count unless the cell binds the name anywhere
    at its top level. Parameters and other local names never count.
    """
    scan = _Scan()
    scan.block(module.body, set())
    bound_anywhere = _local_names(module.body)
    for name in scan.deferred:
        if name not in bound_anywhere:
            scan.found.setdefault(name)
    return list(scan.found)


class _Scan:
    """Follows a cell's statements in order, collecting the names read before being bound."""

    def __init__(self) -> None:
        self.found: dict[str, None] = {}  # read at the cell's level (dicts: ordered sets)
        self.deferred: dict[str, None] = {}  # read in function bodies

    def block(self, stmts: list[ast.stmt], bound: set[str]) -> set[str]:
        """Scan statements in order; return the names surely bound after them."""
        bound = set(bound)
        for stmt in stmts:
            bound = self.statement(stmt, bound)
        return bound

    def reads(self, node: Optional[ast.AST], bound: set[str]) -> None:
        if node is None:
            return
        reads = _Reads()
        reads.visit(node)
        for name in reads.now:
            if name not in bound:
                self.found.setdefault(name)
        for name in reads.later:
            self.deferred.setdefault(name)

    def statement(self, stmt: ast.stmt, bound: set[str]) -> set[str]:
        if isinstance(stmt, ast.If):
            self.reads(stmt.test, bound)
            return self.block(stmt.body, bound) & self.block(stmt.orelse, bound)
        if isinstance(stmt, ast.While):
            self.reads(stmt.test, bound)
            self.block(stmt.body, bound)
            self.block(stmt.orelse, bound)
            return bound  # the body may not run
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            self.reads(stmt.iter, bound)
            self.block(stmt.body, bound | _target_names(stmt.target))
            self.block(stmt.orelse, bound)
            return bound
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            inside = set(bound)
            for item in stmt.items:
                self.reads(item.context_expr, inside)
                if item.optional_vars is not None:
                    self.reads(item.optional_vars, inside)  # e.g. `as self.x` reads self
                    inside |= _target_names(item.optional_vars)
            return self.block(stmt.body, inside)
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":  # TryStar: 3.11+
            try_stmt: Any = stmt
            after_body = self.block(try_stmt.body, bound)
            for handler in try_stmt.handlers:
                self.reads(handler.type, bound)
                self.block(handler.body, bound | ({handler.name} if handler.name else set()))
            self.block(try_stmt.orelse, after_body)
            return self.block(try_stmt.finalbody, bound)
        if type(stmt).__name__ == "Match":  # Python 3.10+
            match: Any = stmt
            self.reads(match.subject, bound)
            for case in match.cases:
                self.reads(case.pattern, bound)  # value patterns like `case Color.RED`
                captured = set(bound)
                for node in ast.walk(case.pattern):
                    name = getattr(node, "name", None) or getattr(node, "rest", None)
                    if isinstance(name, str):
                        captured.add(name)
                self.reads(case.guard, captured)
                self.block(case.body, captured)
            return bound
        self.reads(stmt, bound)  # a simple statement, or a def/class (bodies are deferred)
        return bound | _simple_bindings(stmt)


def _simple_bindings(stmt: ast.stmt) -> set[str]:
    """Names a simple statement (or a def/class) binds."""
    names: set[str] = set()
    if isinstance(stmt, ast.Assign):
        for target in stmt.targets:
            names |= _target_names(target)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and isinstance(stmt.target, ast.Name):
        if not isinstance(stmt, ast.AnnAssign) or stmt.value is not None:
            names.add(stmt.target.id)
    elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
        for alias in stmt.names:
            if alias.name != "*":
                names.add(alias.asname or alias.name.split(".")[0])
    elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(stmt.name)
    return names


def _target_names(target: ast.expr) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_target_names(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return set()  # attributes and subscripts bind no name


def _local_names(body: list[ast.stmt]) -> set[str]:
    """Names assigned in a function or class body (its locals), not looking into nested scopes."""
    names: set[str] = set()
    declared_global: set[str] = set()
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            declared_global.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            todo.extend(node.decorator_list)  # evaluated in this scope; the body is not
            continue
        if isinstance(node, (ast.Lambda, *_COMPREHENSIONS)):
            continue
        todo.extend(ast.iter_child_nodes(node))
    return names - declared_global


def _parameters(args: ast.arguments) -> set[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    every += [a for a in (args.vararg, args.kwarg) if a is not None]
    return {a.arg for a in every}


class _Reads(ast.NodeVisitor):
    """Global names read by one top-level statement: ``now`` (as it runs) and ``later``
    (inside function bodies, when they are called)."""

    def __init__(self) -> None:
        self.now: list[str] = []
        self.later: list[str] = []
        self._scopes: list[tuple[set[str], bool]] = []  # (local names, is a class body)
        self._in_function = 0

    def _is_local(self, name: str) -> bool:
        for depth, (names, is_class) in enumerate(reversed(self._scopes)):
            # A class body's names are visible in the body itself, not in its methods.
            if is_class and depth > 0:
                continue
            if name in names:
                return True
        return False

    def _read(self, name: str) -> None:
        if not self._is_local(name):
            (self.later if self._in_function else self.now).append(name)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._read(node.id)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):
            self._read(node.target.id)  # x += 1 reads x first
        self.generic_visit(node)

    def _visit_function(self, node, body: Sequence[ast.AST], locals_: set[str]) -> None:
        args = node.args
        for default in [*args.defaults, *args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self._scopes.append((locals_, False))
        self._in_function += 1
        for child in body:
            self.visit(child)
        self._in_function -= 1
        self._scopes.pop()

    def visit_FunctionDef(self, node: Union[ast.FunctionDef, ast.AsyncFunctionDef]) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                    node.args.vararg, node.args.kwarg]:
            if arg is not None and arg.annotation is not None:
                self.visit(arg.annotation)
        if node.returns is not None:
            self.visit(node.returns)
        self._visit_function(node, node.body, _parameters(node.args) | _local_names(node.body))

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self.visit_FunctionDef(node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._visit_function(node, [node.body], _parameters(node.args))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for child in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(child)
        self._scopes.append((_local_names(node.body), True))
        for child in node.body:
            self.visit(child)
        self._scopes.pop()

    def _visit_comprehension(self, node, parts: list[ast.AST]) -> None:
        generators = node.generators
        self.visit(generators[0].iter)  # evaluated in the enclosing scope
        targets: set[str] = set()
        for gen in generators:
            targets |= _target_names(gen.target)
        self._scopes.append((targets, False))
        for i, gen in enumerate(generators):
            if i > 0:
                self.visit(gen.iter)
            for condition in gen.ifs:
                self.visit(condition)
        for part in parts:
            self.visit(part)
        self._scopes.pop()

    def visit_ListComp(self, node: ast.ListComp) -> None:
        self._visit_comprehension(node, [node.elt])

    def visit_SetComp(self, node: ast.SetComp) -> None:
        self._visit_comprehension(node, [node.elt])

    def visit_GeneratorExp(self, node: ast.GeneratorExp) -> None:
        self._visit_comprehension(node, [node.elt])

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._visit_comprehension(node, [node.key, node.value])


# Names IPython keeps in the user namespace for itself: In/Out history, _, __, _i3, _5...
_IPYTHON_NAME = re.compile(r"_|__|___|_i+|_i?\d+|_[oid]h")


def is_ipython_name(name: str, shell) -> bool:
    hidden = getattr(shell, "user_ns_hidden", {})
    if name in hidden and shell.user_ns.get(name) is hidden[name]:
        return True  # still IPython's own object, not something the user assigned
    return bool(_IPYTHON_NAME.fullmatch(name))


def notebook_names_for(module: ast.Module, shell) -> list[str]:
    """The names the cell reads that the notebook defines: these travel to every rank."""
    user_ns = shell.user_ns
    return [
        name for name in names_read_from_notebook(module)
        if name in user_ns
        and not (name.startswith("__") and name.endswith("__"))
        and not is_ipython_name(name, shell)
    ]
