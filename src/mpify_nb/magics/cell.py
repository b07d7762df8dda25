"""A notebook cell as the magics handle it in IPython: its file name (``Cell In[n]``), its body
compiled with the cell's own line numbers, whether it shows a value; and how its results and
errors are shown (``[rank k]`` labels, an error as its message alone). Nothing here imports
IPython (ranks never import magics/, but the magics load only when asked); the ``shell``
arguments are IPython's InteractiveShell, passed in by the magics.

::

    cell text --compile_cell()--> (filename "Cell In[n]", source, ast.Module)
                    |
                    +--has_value() / ends_with_semicolon()--> show the value or not
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from typing import Callable, Optional


def ends_with_semicolon(cell: str) -> bool:
    """Like IPython: a cell whose last token is ';' shows no value."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(cell).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    for token in reversed(tokens):
        if token.type in (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT,
                          tokenize.DEDENT, tokenize.INDENT):
            continue
        return token.type == tokenize.OP and token.string == ";"
    return False


def labelled(rank: int, text: str) -> str:
    """``[rank 1] value``; a multi-line value continues under its first line."""
    label = f"[rank {rank}] "
    return label + text.replace("\n", "\n" + " " * len(label))


def rank_list(ranks) -> str:
    """``0, 2, 3``: ranks as a message names them."""
    return ", ".join(str(r) for r in ranks)


def show_briefly(error: BaseException, lines: Optional[list[str]] = None) -> None:
    """Make IPython show ``error`` as its message alone: the frames that raised it are the
    library's, and the user's code is not among them."""
    if lines is None:
        message = str(error)
        lines = [f"{type(error).__name__}: {message}" if message else type(error).__name__]
    error._render_traceback_ = lambda: lines  # type: ignore[attr-defined]


def payload_message(error: Exception, shell) -> str:
    """Say which notebook variable could not be shipped, in the terms of the cell (the core
    speaks of need= globals, which the user of the magic never wrote)."""
    message = str(error)
    match = re.match(r"cannot send need= global '(\w+)' to the ranks: (.*)", message, re.S)
    if match is None:
        return message
    name, reason = match.groups()
    kind = type(shell.user_ns.get(name)).__name__
    return (f"the cell uses the notebook's {name!r} ({kind}), which cannot be sent to the other ranks: "
            f"{reason}. Create it in the cell instead (assigned before it is used, it is not sent).")


class CellSyntaxError(Exception):
    """A syntax error in a %%ranch cell, shown as IPython shows one in a normal cell.

    Not a SyntaxError subclass on purpose: for those IPython prints the stack of the
    code that raised it, here the library's, instead of the cell's line.
    """

    def __init__(self, error: SyntaxError, shown: list[str]):
        super().__init__(f"{error.msg} (line {error.lineno})")
        self.error = error
        self._shown = shown

    def _render_traceback_(self) -> list[str]:
        return self._shown


def cell_number(shell) -> int:
    """The number of the cell running now, as its prompt shows it (``In [7]``), for its
    ``Cell In[7]`` in tracebacks.

    ``shell.execution_count`` is not it on every IPython: 8.x adds one after running the cell,
    9.x (9.18 at least) before, so a cell reading it gets its own number on 8.x and the next one
    on 9.x. The ExecutionResult that IPython hands the display hook for the running cell holds
    the cell's own number on both (None for a silent cell, which has no number of its own).
    """
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(running, "execution_count", None)
    return number if isinstance(number, int) else shell.execution_count


def compile_cell(shell, header: str, cell: str) -> tuple[str, str, ast.Module]:
    """Register a magic cell with IPython's compiler and parse its body.

    ``header`` is the cell's first line (``%%ranch 2``). Returns ``(filename, source,
    module)``: ``filename`` is what IPython's tracebacks show as ``Cell In[n]`` (its
    lines are the whole cell), ``source`` is the body preceded by one empty line, so
    that line numbers in the body are the cell's own. A syntax error raises
    :class:`CellSyntaxError`, shown as IPython shows one in a normal cell.
    """
    filename = shell.compile.cache(f"{header}\n{cell}", cell_number(shell))
    source = "\n" * (header.count("\n") + 1) + cell
    try:
        module = ast.parse(source, filename)
    except SyntaxError as e:
        e.filename = filename
        raise CellSyntaxError(e, shell.SyntaxTB.structured_traceback(SyntaxError, e, [])) from None
    return filename, source, module


#: The line IPython compiles for a rank cell: the call of its magic.
_RANK_CELL_CALL = re.compile(r"\s*get_ipython\(\)\.run_cell_magic\('(distributed|rank)',")


def name_magic_calls_apart(shell) -> Callable[[], None]:
    """Have IPython compile a rank cell's one line, the call of its magic, under a file name of
    its own, not the cell's: a breakpoint the frontend sets on line 1 of a rank cell then stops
    the ranks that run that line, never the kernel inside the magic's call. (Code the cell runs
    in the kernel, a ``--to both`` cell's, keeps the cell's file name.) Returns what undoes it."""
    compiler = shell.compile
    original = compiler.get_code_name

    def get_code_name(raw_code: str, transformed_code: str, number: int) -> str:
        name = original(raw_code, transformed_code, number)
        if not _RANK_CELL_CALL.match(transformed_code):
            return name
        return name[:-3] + "-magic.py" if name.endswith(".py") else name + "-magic"

    compiler.get_code_name = get_code_name

    def undo() -> None:
        if compiler.__dict__.get("get_code_name") is get_code_name:
            del compiler.get_code_name

    return undo


def has_value(module: ast.Module) -> bool:
    """True when the cell ends with an expression (whose value a notebook shows)."""
    return bool(module.body) and isinstance(module.body[-1], ast.Expr)
