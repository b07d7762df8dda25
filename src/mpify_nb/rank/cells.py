"""What a rank runs for a notebook cell: a ``%%ranch`` cell (``run_cell``), ``%time`` and
``%timeit`` measured where the code runs, ``%sync``. The magics (magics/) send these functions to
the ranks, with ``ranch`` or ``Session.apply``; they travel by reference, so a rank imports this
module, which imports neither IPython nor torch (nor anything above the process boundary)::

    kernel (%time / %timeit in a rank cell)           rank k (its __main__ namespace)
    ------------------------------------------        ------------------------------
    apply(time_code, source, filename, cell)  ──────>  run the code, print "Wall time: ..."
                                              <──────  the last expression's value
    apply(timeit_loops, stmt, setup, n, r)    ──────>  r runs of n loops of the statement
                                              <──────  r durations (seconds)

``%timeit`` picks its number of loops in the kernel and sends the same number to every
rank, so a statement holding a collective (``dist.all_reduce(t)``) runs as many times on
every rank and never waits for a peer that stopped early.
"""

from __future__ import annotations

import ast
import builtins
import itertools
import linecache
import os
import sys
import time
from typing import Any, Callable, Optional, cast


def _namespace() -> dict:
    """The rank's persistent namespace (a session rank runs cells in its ``__main__``)."""
    return sys.modules["__main__"].__dict__


def _remember_cell(filename: str, cell_text: str) -> None:
    """Let this rank's tracebacks show the cell's own lines for ``filename``."""
    linecache.cache[filename] = (len(cell_text), None, cell_text.splitlines(True), filename)


def format_time(seconds: float) -> str:
    """``1.23 ms``: three significant digits and a unit, as IPython's timing magics write them."""
    if seconds >= 60:
        minutes, rest = divmod(seconds, 60)
        return f"{int(minutes)}min {rest:.1f}s" if minutes < 60 else f"{seconds / 3600:.1f}h"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"  # not reached


def time_code(source: str, filename: str, cell_text: str) -> Any:
    """``%time``/``%%time`` on a rank: run ``source`` in the rank's namespace, print its CPU
    and wall time, return the last expression's value (None without one)."""
    _remember_cell(filename, cell_text)
    namespace = _namespace()
    module = ast.parse(source, filename)
    last: Optional[ast.Expression] = None
    if module.body and isinstance(module.body[-1], ast.Expr):
        last = ast.Expression(cast(ast.Expr, module.body.pop()).value)
    body = compile(module, filename, "exec", dont_inherit=True)
    tail = compile(last, filename, "eval", dont_inherit=True) if last is not None else None
    cpu0, wall0 = os.times(), time.perf_counter()
    exec(body, namespace)
    value = eval(tail, namespace) if tail is not None else None
    wall, cpu1 = time.perf_counter() - wall0, os.times()
    user, system = cpu1.user - cpu0.user, cpu1.system - cpu0.system
    print(f"CPU times: user {format_time(user)}, sys: {format_time(system)}, "
          f"total: {format_time(user + system)}\nWall time: {format_time(wall)}")
    return value


_TEMPLATE = """
def inner(_it, _timer):
    setup
    _t0 = _timer()
    for _i in _it:
        stmt
    _t1 = _timer()
    return _t1 - _t0
"""

#: (filename, stmt, setup) -> the compiled loop, so the calibration rounds compile once.
_loops: dict[tuple[str, str, str], Callable] = {}


def _loop_function(stmt: str, setup: str, filename: str) -> Callable:
    """IPython's timeit loop around ``stmt``, its line numbers the cell's own."""
    key = (filename, stmt, setup)
    if key not in _loops:
        template = ast.parse(_TEMPLATE)
        function = template.body[0]
        assert isinstance(function, ast.FunctionDef)
        setup_nodes = ast.parse(setup, filename).body or [ast.Pass()]
        stmt_nodes = ast.parse(stmt, filename).body or [ast.Pass()]
        loop = function.body[2]
        assert isinstance(loop, ast.For)
        function.body[0:1] = setup_nodes
        loop.body = stmt_nodes
        ast.fix_missing_locations(template)
        scope: dict = {}
        exec(compile(template, filename, "exec", dont_inherit=True), _namespace(), scope)
        if len(_loops) > 64:
            _loops.clear()
        _loops[key] = scope["inner"]
    return _loops[key]


def timeit_loops(stmt: str, setup: str, filename: str, cell_text: str, number: int, repeat: int) -> list[float]:
    """``%timeit`` on a rank: ``repeat`` runs of ``number`` loops; the seconds each run took."""
    _remember_cell(filename, cell_text)
    inner = _loop_function(stmt, setup, filename)
    return [inner(itertools.repeat(None, number), time.perf_counter) for _ in range(repeat)]


# -- a %%ranch cell, on every rank --------------------------------------------------------------

def run_cell(source: str, filename: str, send_value: bool = True) -> Any:
    """Execute a cell in this process's ``__main__`` and return its last expression's value.

    On rank 0 (the notebook) ``__main__`` is the notebook's namespace; on the other
    ranks it is the fresh module the rank was given, holding the shipped names.
    ``send_value`` False: ranks other than 0 return None (their values are not wanted).
    """
    namespace = sys.modules["__main__"].__dict__
    if not hasattr(builtins, "display"):  # a rank has no IPython: display() prints, as in a terminal
        namespace.setdefault("display", _display_as_text)
    if filename not in linecache.cache:  # a rank: let its own traceback carry the cell's lines
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = ast.parse(source, filename)
    last: Optional[ast.Expression] = None
    tail = module.body[-1] if module.body else None
    if isinstance(tail, ast.Expr):
        module.body.pop()
        last = ast.Expression(tail.value)
    # dont_inherit: this module's `from __future__ import annotations` must not leak into the cell.
    exec(compile(module, filename, "exec", dont_inherit=True), namespace)
    if last is None:
        return None
    value = eval(compile(last, filename, "eval", dont_inherit=True), namespace)
    if not send_value and os.environ.get("RANK") != "0":
        return None
    return value


def _display_as_text(*objs: Any, **kwargs: Any) -> None:
    """IPython's ``display()`` on a rank without IPython: print each object's repr."""
    for obj in objs:
        print(repr(obj))


def group_state() -> str:
    """%sync on a rank, first: which default group it has, "session", "own" (a cell's) or "none"."""
    from . import own_group

    return own_group.state()


def sync() -> None:
    """%sync on a rank: CUDA work finished, then a barrier on the group."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


__all__ = ["run_cell", "time_code", "timeit_loops", "format_time", "sync"]
