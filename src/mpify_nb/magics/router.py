"""Automatic mode: ``%dist_mode`` turns it on or off, and where a cell goes while it is on; which
ranks a ``%%rank`` line names.

``CellRouter`` is IPython's input transformer while the magics are loaded: in automatic mode
it turns an ordinary cell into ``%%distributed --auto`` (auto.route decides), and it knows
whether the cell running now must stay in the kernel (``%%local``, a frontend's silent
request, code the magics run there themselves)::

    %dist_init -n 2
    x = rank          # the router made this cell "%%distributed --auto\nx = rank"
    %%rank [0-1]      # parse_ranks("[0-1]", 2) == [0, 1]
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

from .auto import normalize_header, route
from .state import SessionState, usage


class CellRouter:
    """The input transformer of automatic mode, with what it must know about the cell
    running now: a ``%%local`` cell, or code the magics run in the kernel, stays there
    even when a kernel magic inside it (``%time``, ``%%capture``) transforms code again."""

    def __init__(self) -> None:
        self.automatic = False
        self.running = 0  # cells executing now (pre_execute ... post_execute; nested ones count)
        self.silent: list[bool] = []  # per running cell: silent (a frontend's own request, no pre_run_cell)
        self.local_cell = False  # the cell executing now is a %%local cell
        self.in_kernel = 0  # >0 while the magics run a cell's code in the kernel (--to both)
        self.raw_cell: Optional[str] = None  # the frontend's text of the last cell that began

    def __call__(self, lines: list[str]) -> list[str]:
        try:
            cell = "".join(lines)
            if not self.running:  # a cell about to run (not code that a running cell transforms)
                where, text = route(cell, self.automatic)
                self.local_cell = where == "local"
            else:
                automatic = self.automatic and not self.local_cell and not self.in_kernel
                where, text = route(cell, automatic)
            return text.splitlines(True) if text != cell else lines
        except Exception:  # never break the kernel's input handling
            return lines

    def pre_execute(self) -> None:
        self.running += 1
        self.silent.append(True)  # until pre_run_cell says otherwise (IPython skips it for silent ones)

    def pre_run_cell(self, info: Any = None) -> None:
        if self.silent:
            self.silent[-1] = False
        raw = getattr(info, "raw_cell", None)
        self.raw_cell = raw if isinstance(raw, str) else None

    def raw_cell_of(self, body: str, header: Optional[str]) -> Optional[str]:
        """The frontend's own text of the rank cell running now, whose body (below ``header``,
        its magic line, if it has one) IPython gave the magic as ``body``; None when the cell that
        began last is another (a magic run from code). The cell's file name is the hash of that
        text, as the frontend computes it for its debugger's breakpoints."""
        raw = self.raw_cell
        if raw is None:
            return None
        text = raw
        if header is not None:
            first, newline, text = raw.partition("\n")
            if not newline or normalize_header(first).split(None, 1)[:1] != header.split(None, 1)[:1]:
                return None
        return raw if body in (text, text + "\n") else None  # IPython ends a cell with a newline

    def in_silent_cell(self) -> bool:
        """The running cell is a frontend's silent request (variable explorers, completions):
        it stays in the kernel even in automatic mode."""
        return bool(self.silent) and self.silent[-1]

    def post_execute(self) -> None:
        self.running = max(0, self.running - 1)
        if self.silent:
            self.silent.pop()
        if not self.running:
            self.local_cell = False


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """``[0,1]``, ``[0-2]``, ``0,2``, ``1`` -> sorted rank list; ValueError when malformed or out of range."""
    text = spec.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text.strip():
        raise ValueError("no rank given")
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)\s*-\s*(\d+)|(\d+)", part)
        if not match:
            raise ValueError(f"{part!r} is not a rank or a range like 0-2")
        if match.group(3) is not None:
            ranks.add(int(match.group(3)))
        else:
            low, high = int(match.group(1)), int(match.group(2))
            if low > high:
                raise ValueError(f"the range {part} is empty")
            ranks.update(range(low, high + 1))
    wrong = sorted(r for r in ranks if r >= world_size)
    if wrong:
        raise ValueError(f"rank {', '.join(map(str, wrong))} does not exist (ranks are 0..{world_size - 1})")
    return sorted(ranks)


@functools.cache
def mode_magics_class() -> type:
    """Build the Magics class (on first use, not at import)."""
    from IPython.core.magic import Magics, line_magic, magics_class

    @magics_class
    class ModeMagics(Magics):
        """%dist_mode: automatic mode on or off."""

        def __init__(self, shell: Any, state: SessionState):
            super().__init__(shell)
            self.state = state

        @line_magic
        def dist_mode(self, line: str) -> None:
            """Automatic mode on or off; without an argument, show it.

            On: every ordinary cell runs on all ranks. Off: cells run in the kernel, and
            %%distributed / %%rank send one to the ranks. (nbdistributed's --enable/-e and
            --disable/-d work too.)

            Example::

                %dist_mode off
            """
            arg = line.strip()
            if arg in ("on", "--enable", "-e"):
                self.state.require("dist_mode")
                self.state.router.automatic = True
            elif arg in ("off", "--disable", "-d"):
                self.state.router.automatic = False
            elif arg:
                raise usage("dist_mode", f"expected on or off, not {arg!r}", "%dist_mode [on|off]")
            print(f"Automatic mode is {'on' if self.state.router.automatic else 'off'}"
                  + (": every cell runs on all ranks" if self.state.router.automatic else ": cells run in the kernel"))

    return ModeMagics
