"""Cells and data to the ranks: %%distributed, %%rank, %%local, %dist_push, %dist_pull, %sync, %dist_mode.

The part of the session magics (session.py) that moves work and values::

    %%distributed / %%rank [k] / automatic mode's cells ──> RankCells._run_cell (rank_cells.py)
    %%local ──> the kernel only            %dist_mode on|off ──> the router's automatic mode
    %dist_push a b ──> Session.push        %dist_pull x [--rank k | --all] <── Session.pull
    %sync ──> every rank idle, CUDA synchronized, a barrier on the group

Like rank_cells.py's RankCells, its class is mixed into SessionMagics, which registers it.
"""

from __future__ import annotations

import shlex

from ..rank.cells import _sync_on_rank
from .cell import cell_number, show_briefly
from .rank_cells import RankCells, _rank_list, usage
from .router import parse_ranks


def cells_and_data_class() -> type:
    """Build the mixin (here, not at import: ranks import this package and have no IPython).
    Its magics are recorded by IPython's decorators for the ``@magics_class`` of the class
    it is mixed into, which must be built right after (session.py's session_magics_class)."""
    from IPython.core.error import UsageError
    from IPython.core.magic import cell_magic, line_magic
    from IPython.core.magic_arguments import argument, kwds, magic_arguments, parse_argstring

    class CellsAndData(RankCells):
        """%%distributed, %%rank, %%local, %dist_push, %dist_pull, %sync, %dist_mode."""

        # -- automatic mode ----------------------------------------------------------------

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
                self._require("dist_mode")
                self._router.automatic = True
            elif arg in ("off", "--disable", "-d"):
                self._router.automatic = False
            elif arg:
                raise usage("dist_mode", f"expected on or off, not {arg!r}", "%dist_mode [on|off]")
            print(f"Automatic mode is {'on' if self._router.automatic else 'off'}"
                  + (": every cell runs on all ranks" if self._router.automatic else ": cells run in the kernel"))

        # -- running cells ---------------------------------------------------------------------

        @magic_arguments()
        @kwds(usage="%%distributed [--to ranks|both]")
        @argument("--to", choices=["ranks", "both"], default="ranks",
                  help="ranks: every rank (default); both: the kernel first, then every rank")
        @argument("--auto", action="store_true", help="(used by automatic mode)")
        @cell_magic
        def distributed(self, line: str, cell: str) -> None:
            """Run this cell on every rank (``--to both``: in the kernel too, first).

            Names the cell reads that a rank lacks but the notebook has are sent to that
            rank first (one line says which). Output appears live, each line ``[rank k]``;
            the last expression's value is shown per rank. A rank that raises fails the
            cell with its traceback; the other ranks keep their state.

            Example::

                %%distributed --to both
                def loss_fn(out, y):
                    return ((out - y) ** 2).mean()
            """
            try:
                args = parse_argstring(self.distributed, line)
            except UsageError as e:
                raise usage("distributed", str(e), "%%distributed [--to ranks|both]") from None
            if args.auto and self._router.in_silent_cell():
                self._run_in_kernel(cell, 1, self._sh.compile.cache(cell, cell_number(self._sh)), show=False)
                return
            header = None if args.auto else f"%%distributed {line}".rstrip()
            self._run_cell(cell, header, ranks=None, both=args.to == "both")

        @cell_magic
        def rank(self, line: str, cell: str) -> None:
            """Run this cell on the ranks listed: ``%%rank [0]``, ``%%rank [0,2]``, ``%%rank [0-2]``
            (``%%rank[0]`` works too).

            Example::

                %%rank [0]
                model = torch.nn.Linear(4, 2)
            """
            s = self._require("rank")
            try:
                ranks = parse_ranks(line, s.world_size)
            except ValueError as e:
                raise usage("rank", str(e), "%%rank [0,1] | [0-2]") from None
            self._run_cell(cell, f"%%rank {line}".rstrip(), ranks=ranks, both=False)

        @cell_magic
        def local(self, line: str, cell: str) -> None:
            """Run this cell in the kernel only, also while automatic mode is on.

            Example::

                %%local
                import matplotlib.pyplot as plt
            """
            # A %%local cell the user runs never gets here: the router turns its first line
            # into a comment and IPython runs it natively. This is run_cell_magic("local", ...).
            self._router.in_kernel += 1
            try:
                result = self._sh.run_cell(cell, store_history=False)
            finally:
                self._router.in_kernel -= 1
            if result.error_in_exec is not None or result.error_before_exec is not None:
                error = result.error_in_exec or result.error_before_exec
                show_briefly(error, [])  # shown above already
                raise error

        # -- data movement -----------------------------------------------------------------

        @line_magic
        def dist_push(self, line: str) -> None:
            """Copy notebook variables to every rank (replacing what a rank had under those names).
            Big tensors and arrays travel through shared memory.

            Example::

                %dist_push weights config
            """
            s = self._require("dist_push")
            names = line.split()
            if not names:
                raise usage("dist_push", "name at least one notebook variable", "%dist_push a [b ...]")
            missing = [n for n in names if n not in self._sh.user_ns]
            if missing:
                raise usage("dist_push", f"the notebook has no {', '.join(map(repr, missing))}")
            self._call(lambda: s.push(None, **{n: self._sh.user_ns[n] for n in names}))
            print(f"Sent {', '.join(names)} to ranks {_rank_list(range(s.world_size))}.")

        @line_magic
        def dist_pull(self, line: str) -> None:
            """Bring a rank's variable into the notebook (``--rank k``, default 0), or every
            rank's as a list by rank (``--all``).

            Example::

                %dist_pull loss --all      # loss == [loss on rank 0, loss on rank 1]
            """
            s = self._require("dist_pull")
            try:
                words = shlex.split(line)
            except ValueError as e:
                raise usage("dist_pull", str(e)) from None
            names, rank, every = [], 0, False
            i = 0
            while i < len(words):
                word = words[i]
                if word in ("--all", "-a"):
                    every = True
                elif word in ("--rank", "-r") or word.startswith("--rank="):
                    value = word.split("=", 1)[1] if "=" in word else (words[i + 1] if i + 1 < len(words) else "")
                    i += 0 if "=" in word else 1
                    if not value.isdigit() or int(value) >= s.world_size:
                        raise usage("dist_pull", f"--rank takes a rank 0..{s.world_size - 1}, not {value!r}",
                                    "%dist_pull x [--rank k | --all]")
                    rank = int(value)
                elif word.startswith("-"):
                    raise usage("dist_pull", f"unknown option {word}", "%dist_pull x [--rank k | --all]")
                else:
                    names.append(word)
                i += 1
            if not names:
                raise usage("dist_pull", "name a variable of the ranks", "%dist_pull x [--rank k | --all]")
            for name in names:
                value = self._call(lambda name=name: s.pull(name, rank=None if every else rank))
                self._sh.user_ns[name] = value
            print(f"{', '.join(names)} <- " + ("every rank (a list by rank)" if every else f"rank {rank}"))

        @line_magic
        def sync(self, line: str) -> None:
            """Wait until every rank is idle, then a barrier on the group (and CUDA work done).

            Example::

                %sync
            """
            s = self._require("sync")
            self._call(lambda: s.apply(_sync_on_rank, timeout=self._timeout))
            print(f"ranks {_rank_list(range(s.world_size))} in sync")

    return CellsAndData
