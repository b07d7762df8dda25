"""%%ranch and friends: run a notebook cell on N ranks (``%load_ext mpify_nb``).

::

    %%ranch 2
    import os
    rank = int(os.environ["RANK"])
    scale * rank + offset(rank)      # the notebook has scale = 10 and def offset(r): return r + 1

    [rank 0] 1
    [rank 1] 12

How a cell runs: the magic parses the cell and finds the names it reads from the
notebook; ``ranch(N, run_cell, ...)`` ships them (``need=``) and runs
the cell's source on every rank. Rank 0 is the notebook process, where
``__main__`` *is* the notebook's namespace, so what the cell assigns stays in the
notebook. The other ranks are fresh processes with a fresh ``__main__``. The cell
is compiled under a name registered with IPython's compiler, so a remote
traceback shows ``Cell In[n], line k`` and the cell's own lines.

What every rank runs, ``run_cell``, lives below the process boundary (rank/cells.py):
ranks never import this package. What the magics share: a cell's names read from the
notebook (names.py), compiling and showing it (cell.py).
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any, Optional

from ..rank.cells import run_cell
from .cell import compile_cell, ends_with_semicolon, has_value, labelled, payload_message, show_briefly
from .names import notebook_names_for

_run_cell_on_rank = run_cell  # its name before it moved below the process boundary: older pickles name it

_USAGE = "%%ranch N [--ddp] [--gpus IDS] [--timeout S] [--no-gather]"

#: Per-rank values of the last %%ranch cell that finished (None: none finished, or it failed).
_last_result: Optional[list] = None


# -- the magics ------------------------------------------------------------------------------

@functools.cache
def ranch_magics_class() -> type:
    """Build the Magics class (here, not at import: ranks import this module, and need no IPython)."""
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
    from IPython.core.magic_arguments import argument, kwds, magic_arguments, parse_argstring
    from IPython.display import publish_display_data

    from ..ddp import in_torchddp
    from ..launcher.ranch import ranch
    from ..wire.errors import PayloadError, RankError

    @magics_class
    class RanchMagics(Magics):
        """%%ranch N: run a cell on N ranks; %ranch_result: their values."""

        @magic_arguments()
        # IPython puts a '%' before the usage, and argparse %-formats it: "%%ranch" shows as %%ranch.
        @kwds(usage=_USAGE[1:].replace("%", "%%"))
        @argument("nprocs", metavar="N", help="number of ranks; the notebook itself is rank 0")
        @argument("--ddp", action="store_true",
                  help="run the cell inside in_torchddp(): a torch.distributed process group "
                       "(gloo on CPU, nccl on GPUs) is up on every rank")
        @argument("--gpus", metavar="IDS",
                  help="with --ddp: GPU ids by rank, e.g. 3,1 puts rank 0 on GPU 3 and rank 1 on GPU 1")
        @argument("--timeout", metavar="S",
                  help="stop every rank and fail the cell if it runs longer than S seconds")
        @argument("--no-gather", action="store_true",
                  help="keep and show only rank 0's value (the other ranks' values are not sent back)")
        @cell_magic
        def ranch(self, line: str, cell: str) -> None:
            """Run this cell on N ranks: the notebook is rank 0, N-1 fresh processes are the others.

            Every rank runs the whole cell, with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
            and MASTER_PORT set. The notebook's variables, functions, classes and imported
            modules that the cell uses are shipped to the other ranks automatically. Rank 0
            runs the cell in the notebook's own namespace: what it assigns stays in the
            notebook afterwards. The ranks are started for this cell and are gone when it
            ends (spawn, execute, terminate).

            Output of every rank appears live, each line of rank k prefixed "[rank k]".
            The value of the cell's last expression is shown for each rank, labelled by
            rank (rich display for rank 0); a trailing ';' hides it. %ranch_result gives
            the list of per-rank values of the last %%ranch cell.

            A rank that raises or dies fails the cell, showing the rank and its traceback.
            The stop button stops every rank.

            Example::

                %%ranch 2 --ddp
                import torch, torch.distributed as dist
                t = torch.tensor([dist.get_rank() + 1.0])
                dist.all_reduce(t)
                t.item()
            """
            global _last_result
            args = self._parse(line)
            shell = self.shell
            assert shell is not None  # registered by load_ipython_extension
            if sys.modules.get("__main__") is not shell.user_module:
                raise UsageError("%%ranch needs the notebook's namespace to be __main__ "
                                 "(IPython's user module), and it is not in this shell")
            # The cell's first line is "%%ranch ...": compile its body as from line 2, under
            # a name IPython's tracebacks know as "Cell In[n]", holding the cell's lines.
            filename, source, module = compile_cell(shell, f"%%ranch {line}".rstrip(), cell)
            need = " ".join(notebook_names_for(module, shell))

            _last_result = None
            try:
                values = ranch(args.nprocs, run_cell, source, filename, not args.no_gather,
                               ctx=args.ctx, need=need, timeout=args.timeout, gather=not args.no_gather)
            except RankError:
                raise  # shows the failing rank and its remote traceback (RankError._render_traceback_)
            except KeyboardInterrupt as e:
                show_briefly(e, ["KeyboardInterrupt: the cell was interrupted; every rank was stopped"])
                raise
            except PayloadError as e:
                show_briefly(e, [f"PayloadError: {payload_message(e, shell)}"])
                raise
            except TimeoutError as e:
                show_briefly(e)
                raise
            if args.no_gather:
                values = [values]
            _last_result = values
            if has_value(module) and not ends_with_semicolon(cell) and any(v is not None for v in values):
                self._show(values)

        @line_magic
        def ranch_result(self, line: str) -> list:
            """The list of per-rank values of the last %%ranch cell: element k is the value of
            the cell's last expression on rank k (None where the cell ends with no expression).
            With --no-gather, a list holding rank 0's value only.

            Example::

                %%ranch 3
                import os
                int(os.environ["RANK"]) ** 2

                values = %ranch_result      # -> [0, 1, 4]
            """
            if line.strip():
                raise UsageError("%ranch_result takes no arguments")
            if _last_result is None:
                raise UsageError("no %%ranch cell has finished yet (or the last one failed)")
            return _last_result

        # -- helpers ---------------------------------------------------------------------

        def _parse(self, line: str):
            try:
                args = parse_argstring(self.ranch, line)
            except UsageError as e:
                raise UsageError(f"%%ranch: {e}\nusage: {_USAGE}\n(see %%ranch? for help)") from None

            def bad(message: str) -> UsageError:
                return UsageError(f"%%ranch: {message}\nusage: {_USAGE}\n(see %%ranch? for help)")

            try:
                args.nprocs = int(args.nprocs)
            except ValueError:
                raise bad(f"N must be a whole number of ranks, not {args.nprocs!r}") from None
            if args.nprocs < 1:
                raise bad(f"N must be at least 1, not {args.nprocs}")
            if args.timeout is not None:
                try:
                    args.timeout = float(args.timeout)
                except ValueError:
                    raise bad(f"--timeout must be a number of seconds, not {args.timeout!r}") from None
                if not args.timeout > 0:  # also rejects nan
                    raise bad(f"--timeout must be more than 0 seconds, not {args.timeout:g}")
            args.ctx = None
            if args.gpus is not None:
                if not args.ddp:
                    raise bad("--gpus places the ranks of a --ddp cell: add --ddp")
                if not re.fullmatch(r"\d+(,\d+)*", args.gpus.replace(" ", "")):
                    raise bad(f"--gpus takes GPU ids separated by commas, like 3,1; not {args.gpus!r}")
            if args.ddp:
                try:
                    args.ctx = in_torchddp(gpus=args.gpus)
                    # ranch checks the options again; asking now turns a bad choice into a usage message.
                    args.ctx._mpify_prepare(args.nprocs, 0)
                except (ValueError, RuntimeError) as e:
                    raise bad(str(e)) from None
            return args

        def _show(self, values: list) -> None:
            assert self.shell is not None
            formatter: Any = self.shell.display_formatter
            as_text = formatter.formatters["text/plain"]
            lines: list[str] = []
            data, metadata = formatter.format(values[0])
            if set(data) - {"text/plain"}:  # rich: label, then the value as a normal cell shows it
                publish_display_data({"text/plain": "[rank 0]"})
                publish_display_data(data, metadata)
            else:
                lines.append(labelled(0, data.get("text/plain", repr(values[0]))))
            lines += [labelled(r, as_text(v)) for r, v in enumerate(values) if r > 0]
            if lines:
                publish_display_data({"text/plain": "\n".join(lines)})

    return RanchMagics
