"""Cells to the ranks: %%distributed, %%rank, %%local, and running a rank cell.

A rank cell (%%distributed, %%rank [k], or an ordinary cell in automatic mode) becomes Session
calls, its pieces in order::

    %%rank [0]                          RankCellMagics._run_cell
    %time y = f(x)      ── pieces ──>     kernel lines in the kernel, in their turn
    y                                     code: Session.run(..., display=the cell's view)
                                          %time / %timeit: rank/cells.py's, on the ranks
    %%local ──> the kernel only (also while automatic mode is on)

Names a piece reads that a rank lacks and the notebook has go to that rank first (names.py
finds them). What the ranks show goes through the cell's view (views.py: labelled lines or tabs).
With ``--bg`` the cell's code goes as background work, with ``--after`` the cell first waits for
the ranks (background.py).
The session magics' state is session.py's SessionState, shared with the other groups.
"""

from __future__ import annotations

import ast
import functools
from typing import Any, Optional, cast

from ..rank import cells as on_ranks
from ..wire.errors import RankError
from . import background
from .auto import Piece, split_cell
from .cell import CellSyntaxError, cell_number, ends_with_semicolon, labelled, rank_list, show_briefly
from .names import notebook_names_for
from .router import parse_ranks
from .state import SessionState, usage
from .views import make_view, tabs_unavailable

_RANK_USAGE = "%%rank [0,1] | [0-2] [--bg] [--after]"


@functools.cache
def rank_cell_magics_class() -> type:
    """Build the Magics class (on first use, not at import)."""
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, cell_magic, magics_class
    from IPython.core.magic_arguments import argument, kwds, magic_arguments, parse_argstring

    @magics_class
    class RankCellMagics(Magics):
        """%%distributed, %%rank, %%local: cells to the ranks (or kept in the kernel)."""

        def __init__(self, shell: Any, state: SessionState):
            super().__init__(shell)
            self.state = state
            self._sh: Any = shell  # IPython's shell (never None once registered)

        @magic_arguments()
        @kwds(usage="%%distributed [--to ranks|both] [--bg] [--after]")
        @argument("--to", choices=["ranks", "both"], default="ranks",
                  help="ranks: every rank (default); both: the kernel first, then every rank")
        @argument("--bg", action="store_true",
                  help="run it in the background: the cell returns at once, the ranks' output keeps "
                       "coming to it while other cells run (%%dist_wait, %%dist_stop, %%dist_pull)")
        @argument("--after", action="store_true",
                  help="first wait until no background work holds the ranks (else such a cell is refused)")
        @argument("--auto", action="store_true", help="(used by automatic mode)")
        @cell_magic
        def distributed(self, line: str, cell: str) -> None:
            """Run this cell on every rank (``--to both``: in the kernel too, first).

            Names the cell reads that a rank lacks but the notebook has are sent to that
            rank first (one line says which). Output appears live, each line ``[rank k]``;
            the last expression's value is shown per rank. A rank that raises fails the
            cell with its traceback; the other ranks keep their state.

            ``--bg`` runs it in the background: the cell returns at once and the notebook stays
            free; the ranks' output, values and errors keep coming to this cell. Meanwhile
            ``%dist_pull`` reads the ranks' variables as they are, ``%dist_wait`` waits for it,
            ``%dist_stop`` stops it, and another rank cell is refused unless it says ``--after``.

            Example::

                %%distributed --to both
                def loss_fn(out, y):
                    return ((out - y) ** 2).mean()
            """
            try:
                args = parse_argstring(self.distributed, line)
            except UsageError as e:
                raise usage("distributed", str(e), "%%distributed [--to ranks|both] [--bg] [--after]") from None
            if args.auto and self.state.router.in_silent_cell():
                self._run_in_kernel(cell, 1, self._sh.compile.cache(cell, cell_number(self._sh)), show=False)
                return
            header = None if args.auto else f"%%distributed {line}".rstrip()
            self._run_cell(cell, header, ranks=None, both=args.to == "both", bg=args.bg, after=args.after)

        @cell_magic
        def rank(self, line: str, cell: str) -> None:
            """Run this cell on the ranks listed: ``%%rank [0]``, ``%%rank [0,2]``, ``%%rank [0-2]``
            (``%%rank[0]`` works too). ``--bg`` and ``--after`` as for ``%%distributed``.

            Example::

                %%rank [0]
                model = torch.nn.Linear(4, 2)
            """
            s = self.state.require("rank")
            words = line.split()
            options = {w for w in words if w.startswith("--")}
            unknown = options - {"--bg", "--after"}
            if unknown:
                raise usage("rank", f"unknown option {sorted(unknown)[0]}", _RANK_USAGE)
            try:
                ranks = parse_ranks(" ".join(w for w in words if w not in options), s.world_size)
            except ValueError as e:
                raise usage("rank", str(e), _RANK_USAGE) from None
            self._run_cell(cell, f"%%rank {line}".rstrip(), ranks=ranks, both=False, bg="--bg" in options,
                           after="--after" in options)

        @cell_magic
        def local(self, line: str, cell: str) -> None:
            """Run this cell in the kernel only, also while automatic mode is on.

            Example::

                %%local
                import matplotlib.pyplot as plt
            """
            # A %%local cell the user runs never gets here: the router turns its first line
            # into a comment and IPython runs it natively. This is run_cell_magic("local", ...).
            self.state.router.in_kernel += 1
            try:
                result = self._sh.run_cell(cell, store_history=False)
            finally:
                self.state.router.in_kernel -= 1
            if result.error_in_exec is not None or result.error_before_exec is not None:
                error = result.error_in_exec or result.error_before_exec
                show_briefly(error, [])  # shown above already
                raise error

        # -- running a rank cell -----------------------------------------------------------

        def _run_cell(self, cell: str, header: Optional[str], ranks: Optional[list[int]], both: bool,
                      bg: bool = False, after: bool = False) -> None:
            """Run a rank cell: its pieces in order (kernel lines in the kernel, code on ``ranks``);
            ``bg``: its code as background work; ``after``: once no background work holds the
            ranks (background.py)."""
            shell = self._sh
            s = self.state.require("distributed" if ranks is None else "rank")
            if after:
                background.wait_for_the_ranks(self.state)
            view = self._cell_view(ranks)
            # The ranks compile the cell under the file name the frontend gives it (the hash of the text
            # it sent), so a breakpoint set in the cell's gutter stops them at that line.
            cell_text = self.state.router.raw_cell_of(cell, header)
            if cell_text is None:
                cell_text = cell if header is None else f"{header}\n{cell}"
            first = 1 if header is None else 2
            filename = shell.compile.cache(cell_text, cell_number(shell))
            plan = split_cell(cell, first)
            for piece in plan.pieces:  # nothing runs when any part can't compile
                if piece.kind != "kernel":
                    self._parse(piece.source + ("\n" + piece.setup if piece.setup else ""), filename)
            if both:
                self._run_in_kernel(cell, first, filename)
            quiet = ends_with_semicolon(cell)
            if bg:
                self._start_in_background(s, plan.pieces, ranks, filename, view, header, quiet)
                return
            for i, piece in enumerate(plan.pieces):
                last = i == len(plan.pieces) - 1
                if piece.kind == "kernel":
                    if not both:  # with --to both the kernel ran it already
                        self._run_kernel_line(piece, filename)
                    continue
                self._send_missing_names(piece, s, ranks)
                try:
                    if piece.kind == "ranks":
                        values = self.state.call(lambda p=piece: s.run(
                            p.source, ranks=ranks, timeout=self.state.timeout, filename=filename, display=view))
                    elif piece.kind == "time":
                        values = self.state.call(lambda p=piece: s.apply(
                            on_ranks.time_code, p.source, filename, cell_text, ranks=ranks, timeout=self.state.timeout))
                    else:
                        values = self._timeit(s, piece, ranks, filename, cell_text)
                        if piece.target:
                            self._sh.user_ns[piece.target], values = values, None
                except RankError as e:
                    view.error(e)  # tabs: in the failing rank's tab too; the cell fails as ever
                    raise
                if last and not quiet and values:
                    view.values(values)

        def _start_in_background(self, s: Any, pieces: list[Piece], ranks: Optional[list[int]], filename: str,
                                 view: Any, header: Optional[str], quiet: bool) -> None:
            """``--bg``: the cell's code, the names it needs sent first, to the ranks as background work."""
            what = header.split(" --")[0] if header else "%%distributed"
            others = [p for p in pieces if p.kind != "ranks"]
            if others:
                raise usage(what.split()[0].lstrip("%"), "--bg sends the cell's code to the ranks in the background; "
                            f"its line {others[0].lineno} is not code for the ranks (a %magic, !shell or %time "
                            "line, which would run at the wrong time): run it in a cell of its own")
            if pieces:
                self._send_missing_names(pieces[0], s, ranks)
                background.start(self.state, s, pieces[0].source, ranks, filename, view, what, quiet)

        def _parse(self, source: str, filename: str) -> ast.Module:
            try:
                return ast.parse(source, filename)
            except SyntaxError as e:
                e.filename = filename
                raise CellSyntaxError(e, self._sh.SyntaxTB.structured_traceback(SyntaxError, e, [])) from None

        def _send_missing_names(self, piece: Piece, s, ranks: Optional[list[int]]) -> None:
            """Names the piece reads that a rank lacks and the notebook has: to that rank, with a note."""
            module = self._parse(piece.setup + "\n" + piece.source if piece.setup else piece.source, "<cell>")
            names = notebook_names_for(module, self.shell)
            if not names:
                return
            lacking = self.state.call(lambda: s.missing_names(names, ranks))
            by_names: dict[tuple[str, ...], list[int]] = {}
            for rank, missing in sorted(lacking.items()):
                if missing:
                    by_names.setdefault(tuple(n for n in names if n in missing), []).append(rank)
            for group, group_ranks in by_names.items():
                values = {n: self._sh.user_ns[n] for n in group}
                try:
                    self.state.call(lambda r=group_ranks, v=values: s.push(r, **v))
                except (KeyboardInterrupt, RankError):
                    raise
                except Exception as e:
                    kinds = ", ".join(f"{n!r} ({type(v).__name__})" for n, v in values.items())
                    show_briefly(e, [f"{type(e).__name__}: the cell uses the notebook's {kinds}, which "
                                     f"rank {rank_list(group_ranks)} lacks, and it cannot be sent: {e}. "
                                     "Define it in a cell that runs on the ranks."])
                    raise
                print(f"[mpify_nb] sent from the notebook to rank {rank_list(group_ranks)}: {', '.join(group)}")

        def _run_kernel_line(self, piece: Piece, filename: str) -> None:
            """A %magic / !shell / help line of a rank cell, run in the kernel in its turn."""
            code = self._sh.transform_cell(piece.source)
            exec(compile("\n" * (piece.lineno - 1) + code, filename, "exec"), self._sh.user_ns)

        def _run_in_kernel(self, cell: str, first: int, filename: str, show: bool = True) -> None:
            """``--to both``: the cell in the kernel, its value shown as ``[kernel]``; an error
            shows the cell's frames only and fails the cell."""
            shell = self._sh
            self.state.router.in_kernel += 1
            try:
                code = shell.transform_cell(cell)
            finally:
                self.state.router.in_kernel -= 1
            module = self._parse("\n" * (first - 1) + code, filename)
            tail = None
            if module.body and isinstance(module.body[-1], ast.Expr):
                tail = ast.Expression(cast(ast.Expr, module.body.pop()).value)
            try:
                exec(compile(module, filename, "exec"), shell.user_ns)
                value = eval(compile(tail, filename, "eval"), shell.user_ns) if tail is not None else None
            except BaseException as e:
                tb = e.__traceback__
                while tb is not None and tb.tb_frame.f_code.co_filename != filename:
                    tb = tb.tb_next
                if tb is not None and not isinstance(e, KeyboardInterrupt):
                    stb = shell.InteractiveTB.structured_traceback(type(e), e, tb)
                    show_briefly(e, ["[kernel]", *stb] if isinstance(stb, list) else None)
                raise
            if show and value is not None and not ends_with_semicolon(cell):
                self._show_values({"kernel": value})

        def _timeit(self, s, piece: Piece, ranks: Optional[list[int]], filename: str, cell_text: str):
            """%timeit on the ranks: the kernel picks the loop count, so every rank loops as often."""
            from IPython.core.magics.execution import TimeitResult

            opts, _ = self.parse_options(piece.options + " _", "n:r:qop:t:c", posix=False, strict=False)
            number = int(opts.get("n", 0)) or None
            repeat = int(opts.get("r", 7))
            precision = int(opts.get("p", 3))

            def loops(n: int, r: int) -> dict:
                return self.state.call(lambda: s.apply(on_ranks.timeit_loops, piece.source, piece.setup, filename,
                                                       cell_text, n, r, ranks=ranks, timeout=self.state.timeout))

            if number is None:  # IPython's autorange, agreed by all ranks: the slowest one decides
                number = 1
                for power in range(10):
                    number = 10 ** power
                    if max(t[0] for t in loops(number, 1).values()) >= 0.2:
                        break
            results = {rank: TimeitResult(number, repeat, min(t) / number, max(t) / number, t, 0, precision)
                       for rank, t in sorted(loops(number, repeat).items())}
            if "q" not in opts:
                print("\n".join(labelled(rank, str(result)) for rank, result in results.items()))
            return results if "o" in opts or piece.target else None

        def _cell_view(self, ranks: Optional[list[int]]):
            """The view of the cell starting now (tabs fall back to lines where widgets cannot show)."""
            s = self.state.session
            targets = list(range(s.world_size)) if ranks is None else list(ranks)
            kind = self.state.view if self.state.view != "tabs" or tabs_unavailable(self._sh) is None else "lines"
            return make_view(kind, self._sh, targets)

        def _show_values(self, values: dict) -> None:
            make_view("lines", self._sh, []).values(values)

    return RankCellMagics
