"""Automatic mode and the shape of a rank cell: which cells go to the ranks, and which of
their lines stay in the kernel.

Automatic mode (``%dist_init`` turns it on) is an IPython input transformer that runs
first on every cell's raw text::

    raw cell ──CellRouter──> unchanged              kernel: magics-only cell, a kernel
                        │                                   cell magic (%%bash, %%capture...)
                        ├──> "#%%local" + body      kernel: %%local (line numbers kept)
                        └──> "%%distributed --auto\\n" + raw cell
                                                    ranks: through the %%distributed magic

A cell that goes to the ranks is then cut by :func:`split_cell` into pieces, run in
order: plain code runs on the ranks, top-level ``%magic``/``!shell``/``x?`` lines run in
the kernel, and the timing magics (``%time``, ``%timeit``, ``%%time``, ``%%timeit``)
time their code *on the ranks*, where it runs. Code that a kernel magic runs itself
(``%%capture``'s body, ``%prun``'s statement) goes through the transformer again, so in
automatic mode it reaches the ranks too, except inside a ``%%local`` cell.

Nothing here imports IPython: the functions take text and return text or pieces.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field
from typing import Optional

#: Magics whose code is timed where it runs: on the ranks.
TIMING_MAGICS = ("time", "timeit")
#: Cell magics of this package that pick where a cell runs: the router leaves them alone.
ROUTING_CELL_MAGICS = ("distributed", "rank", "local", "ranch")

#: %time / %timeit lines: their code is timed on the ranks.
_TIMING_LINE = re.compile(r"(?:(\w+)\s*=\s*)?%(time|timeit)(?:\s+(.*))?$")
_CELL_MAGIC = re.compile(r"%%(\w+)")
_RANK_NO_SPACE = re.compile(r"%%rank(\[)")  # nbdistributed's spelling: %%rank[0,1]
#: A line IPython runs as a magic, a shell command or a help request (not Python).
_KERNEL_LINE = re.compile(
    r"""\s*(?:[%!]            # %magic, !shell, %%not-here
          |\w+\s*=\s*[%!]     # x = %magic, x = !ls
          |[\w.]*\?\??\s*$    # obj? obj?? ?
          |\?)""",
    re.X,
)


@dataclass
class Piece:
    """One piece of a rank cell, run in order.

    ``kind`` is ``"ranks"`` (``source``: the cell's text with every line outside the
    piece blanked, so line numbers stay the cell's own), ``"kernel"`` (``source``: one
    line for IPython), ``"time"`` (``source`` as for ranks: the code to time on each
    rank) or ``"timeit"`` (``options``: the magic's options, ``setup`` and ``source``:
    code as for ranks).
    """

    kind: str
    source: str
    lineno: int  # the piece's first line in the cell (1-based)
    options: str = ""
    setup: str = ""
    target: str = ""  # `name = %timeit -o ...`: the notebook variable that gets the results


@dataclass
class CellPlan:
    """A rank cell cut into pieces; ``code`` is every Python line (for name analysis)."""

    pieces: list[Piece] = field(default_factory=list)
    code: str = ""


def normalize_header(first_line: str) -> str:
    """``%%rank[0,1]`` (nbdistributed's spelling, which IPython can't parse) -> ``%%rank [0,1]``."""
    return _RANK_NO_SPACE.sub(r"%%rank \1", first_line, count=1)


def cell_magic_name(cell: str) -> Optional[str]:
    """``"time"`` for a cell starting ``%%time``; None for a cell that is not a cell magic."""
    match = _CELL_MAGIC.match(cell)
    return match.group(1) if match else None


def is_kernel_line(line: str) -> bool:
    """A line IPython itself handles (magic, shell command, help), not Python code."""
    return bool(_KERNEL_LINE.match(line)) and not line.lstrip().startswith("%%")


def _is_blank_or_comment(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _complete(code: str) -> bool:
    """Whether ``code`` ends outside any bracket, string or backslash continuation (so a
    following ``%`` at the start of a line is a magic, not a modulo)."""
    if code.rstrip("\n").endswith("\\"):
        return False
    try:
        for _ in tokenize.generate_tokens(io.StringIO(code).readline):
            pass
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return False
    return True


def top_level_kernel_lines(lines: list[str]) -> set[int]:
    """Indexes of the lines that are magics/shell/help lines at the cell's top level: at
    column 0 and not inside a bracket or a multi-line string."""
    found: set[int] = set()
    code_since: list[str] = []
    for i, line in enumerate(lines):
        if line[:1].strip() and is_kernel_line(line) and _complete("".join(code_since)):
            found.add(i)
            code_since = []
        else:
            code_since.append(line if line.endswith("\n") else line + "\n")
    return found


def route(cell: str, automatic: bool) -> tuple[str, str]:
    """Where a raw cell goes: ``("kernel" | "local" | "ranks", the text IPython then runs)``.

    Without automatic mode only ``%%local`` and ``%%rank[...]`` are rewritten.
    """
    first, newline, rest = cell.partition("\n")
    normalized = normalize_header(first)
    if normalized != first:
        return "kernel", normalized + newline + rest
    name = cell_magic_name(cell)
    if name == "local":
        # A comment keeps the body's line numbers (IPython drops leading empty lines).
        return "local", "#" + first + newline + rest
    if not automatic:
        return "kernel", cell
    if name is not None:
        if name in TIMING_MAGICS:
            return "ranks", "%%distributed --auto\n" + cell
        return "kernel", cell  # our routing magics, and kernel cell magics (%%capture runs its body again)
    lines = cell.splitlines(True)
    kernel = {i for i in top_level_kernel_lines(lines) if not _TIMING_LINE.match(lines[i])}
    if all(i in kernel or _is_blank_or_comment(line) for i, line in enumerate(lines)):
        return "kernel", cell  # %dist_status, %pip install, !nvidia-smi, an empty cell
    return "ranks", "%%distributed --auto\n" + cell


def split_cell(cell: str, first_lineno: int = 1) -> CellPlan:
    """Cut a rank cell's body into :class:`Piece` s; ``first_lineno`` is the cell line the
    body starts on (2 below a ``%%distributed`` header, 1 in automatic mode)."""
    lines = cell.splitlines(True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    pad = "\n" * (first_lineno - 1)
    total = len(lines)

    def blanked(keep: range, replace: Optional[dict[int, str]] = None) -> str:
        out = [(replace or {}).get(i, lines[i]) if i in keep else "\n" for i in range(total)]
        return pad + "".join(out)

    plan = CellPlan()
    code_lines = ["\n"] * total
    name = cell_magic_name(cell)
    if name in TIMING_MAGICS:  # %%time / %%timeit [options] [setup]: the whole rest is timed
        header = lines[0][2 + len(name):].strip()
        code_lines[1:] = lines[1:]
        body = blanked(range(1, total))
        if name == "time":
            plan.pieces.append(Piece("time", body, first_lineno + 1))
        else:
            options, setup = _split_timeit_line(header)
            plan.pieces.append(Piece("timeit", body, first_lineno + 1, options=options, setup=pad + setup))
        plan.code = pad + "".join(code_lines)
        return plan

    kernel = top_level_kernel_lines(lines)
    start = 0
    for i in [*sorted(kernel), total]:
        if i > start and any(not _is_blank_or_comment(line) for line in lines[start:i]):
            plan.pieces.append(Piece("ranks", blanked(range(start, i)), first_lineno + start))
            code_lines[start:i] = lines[start:i]
        if i == total:
            break
        line = lines[i]
        timing = _TIMING_LINE.match(line.rstrip("\n"))
        if timing:
            target, magic, arg = timing.group(1), timing.group(2), (timing.group(3) or "")
            if magic == "time":  # `x = %time f()`: x = f() on each rank, timed there
                code = f"{target} = {arg}" if target else arg
                plan.pieces.append(Piece("time", blanked(range(i, i + 1), {i: code + "\n"}), first_lineno + i))
            else:  # `r = %timeit -o f()`: r in the notebook, {rank: TimeitResult}
                options, code = _split_timeit_line(arg)
                plan.pieces.append(Piece("timeit", blanked(range(i, i + 1), {i: code + "\n"}),
                                         first_lineno + i, options=options, target=target or ""))
            code_lines[i] = code + "\n"
        else:
            plan.pieces.append(Piece("kernel", line, first_lineno + i))
        start = i + 1
    plan.code = pad + "".join(code_lines)
    return plan


def _split_timeit_line(arg: str) -> tuple[str, str]:
    """``-n 10 -r 3 x.sum()`` -> (``-n 10 -r 3``, ``x.sum()``): options, then the statement."""
    words = arg.split(" ")
    options: list[str] = []
    takes_value = {"-n", "-r", "-t", "-c", "-p"}
    i = 0
    while i < len(words):
        word = words[i]
        if word == "":
            i += 1
            continue
        if not word.startswith("-") or word == "-":
            break
        options.append(word)
        if word in takes_value and i + 1 < len(words):
            options.append(words[i + 1])
            i += 1
        i += 1
    return " ".join(options), " ".join(words[i:])


__all__ = ["route", "split_cell", "Piece", "CellPlan", "normalize_header", "is_kernel_line", "TIMING_MAGICS"]
