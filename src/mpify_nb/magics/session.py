"""Persistent ranks from a notebook: nbdistributed's magics driving one default Session.

::

    %dist_init -n 2            # ranks 0 and 1 start, join a gloo group; automatic mode on
    x = torch.ones(2) * rank   # an ordinary cell: runs on every rank, keeps its state there
    dist.all_reduce(x); x      # [rank 0] tensor([1., 1.])  [rank 1] tensor([1., 1.])
    %%rank [0]                 # on rank 0 only
    %%local                    # in the kernel only
    %dist_pull x --all         # every rank's x, as a list, into the notebook
    %dist_view tabs            # from the next cell: one tab per rank (views.py)

Where a cell goes (the kernel is never a rank)::

    cell ──CellRouter (auto.route)──> kernel cell (magics only, %%local, %%bash ...)
                                 └──> %%distributed --auto ──> split_cell: pieces in order
                                                                 │
        kernel: %magic / !shell lines <──────────────────────────┤
        names the piece reads that a rank lacks ── Session.push ─┤ (one-line note)
        ranks: code ── Session.run(source, filename="Cell In[n]", display=view) ┘
                 <── through the cell's view (views.py): live "[rank k] ..." lines, rich
                     display in rank order, values by rank; or a tab per rank. Errors.

The Session (session.py at the package root) owns the processes, the channels, output
relay, interrupts and errors. This module holds the magics themselves; running a rank cell
is rank_cells.py's job, where a cell goes router.py's, the status table status.py's.
"""

from __future__ import annotations

import atexit
import functools
import html
import re
import shlex
import sys
from typing import Any, Callable, Optional

from .cells import cell_number, show_briefly
from .rank_cells import RankCells, _rank_list
from .router import CellRouter, parse_ranks
from .status import format_bytes, status_table
from .views import VIEWS, tabs_unavailable

_INIT_USAGE = "%dist_init -n N [-g IDS] [--backend gloo|nccl] [--timeout S] [--view lines|tabs]"

#: The magics object of the running shell (None before %load_ext): holds the default session.
_current: Optional[Any] = None


def session():
    """The session the magics drive (None before ``%dist_init`` or after ``%dist_reset``).

    Example::

        %dist_init -n 2
        from mpify_nb.magics.session import session
        session().pull("x", rank=None)
    """
    return None if _current is None else _current._session


def _node_of(row) -> str:
    return getattr(row, "node", "127.0.0.1")


def load(ipython) -> None:
    """Register the session magics and automatic mode's input transformer."""
    global _current
    magics = session_magics_class()(ipython)
    ipython.register_magics(magics)
    _current = magics


def unload(ipython) -> None:
    global _current
    if _current is not None:
        _current._forget()
        _current._router_remove()
        _current = None


@functools.cache
def session_magics_class() -> type:
    """Build the Magics class (here, not at import: ranks import this package and have no IPython)."""
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
    from IPython.core.magic_arguments import argument, kwds, magic_arguments, parse_argstring
    from IPython.display import publish_display_data

    from ..errors import RankError

    def usage(magic: str, message: str, usage_line: str = "") -> UsageError:
        tail = f"\nusage: {usage_line}" if usage_line else ""
        return UsageError(f"%{magic}: {message}{tail}\n(see %{magic}? for help)")

    @magics_class
    class SessionMagics(RankCells, Magics):
        """Persistent ranks: %dist_init, automatic mode, %%distributed, %%rank, %%local, ..."""

        def __init__(self, shell):
            super().__init__(shell)
            self._session: Any = None
            self._timeout: Optional[float] = None
            self._ipython_debug: Optional[Callable[[str], Any]] = None  # IPython's own %debug
            self._router = CellRouter()
            shell.input_transformers_cleanup.insert(0, self._router)
            shell.events.register("pre_execute", self._router.pre_execute)
            shell.events.register("pre_run_cell", self._router.pre_run_cell)
            shell.events.register("post_execute", self._router.post_execute)
            atexit.register(self._forget)

        def _router_remove(self) -> None:
            if self._router in self._sh.input_transformers_cleanup:
                self._sh.input_transformers_cleanup.remove(self._router)
            for event, fn in (("pre_execute", self._router.pre_execute),
                              ("pre_run_cell", self._router.pre_run_cell),
                              ("post_execute", self._router.post_execute)):
                try:
                    self._sh.events.unregister(event, fn)
                except ValueError:
                    pass

        # -- starting and stopping -------------------------------------------------------

        @magic_arguments()
        @kwds(usage=_INIT_USAGE[1:])
        @argument("-n", "--num-processes", type=int, default=2, metavar="N",
                  help="number of ranks (processes 0..N-1; the kernel is not a rank). Default 2")
        @argument("-g", "--gpu-ids", metavar="IDS",
                  help="GPU ids by rank, e.g. 3,1: rank 0 on GPU 3, rank 1 on GPU 1 "
                       "(default: one GPU each when CUDA is present, else CPU)")
        @argument("--backend", choices=["gloo", "nccl"],
                  help="torch.distributed backend (default: nccl on GPUs, gloo on CPU)")
        @argument("-t", "--timeout", type=float, metavar="S",
                  help="fail a cell that runs longer than S seconds (default: no limit)")
        @argument("-a", "--master-addr", default="localhost", help="only this machine is supported")
        @argument("--view", choices=list(VIEWS), metavar="lines|tabs",
                  help="how cells show the ranks' output: labelled lines (default) or one tab per rank "
                       "(as %%dist_view)")
        @line_magic
        def dist_init(self, line: str) -> None:
            """Start N persistent ranks with a torch.distributed group up, and turn automatic
            mode on: every ordinary cell then runs on all ranks and keeps its state there.

            Each rank's namespace starts with ``rank``, ``world_size``, ``device``, ``dist``
            (torch.distributed) and ``torch``. Returns once every rank has joined the group,
            so the next cell reaches every rank.

            Example::

                %dist_init -n 2
                x = torch.tensor([rank + 1.0])
                dist.all_reduce(x)
                x                      # [rank 0] tensor([3.])  [rank 1] tensor([3.])
            """
            try:
                args = parse_argstring(self.dist_init, line)
            except UsageError as e:
                raise usage("dist_init", str(e), _INIT_USAGE) from None
            if self._session is not None and not self._session.closed:
                raise usage("dist_init", f"{self._session.world_size} ranks are running already; "
                                         "%dist_shutdown (or %dist_reset) stops them")
            if args.num_processes < 1:
                raise usage("dist_init", f"N must be at least 1, not {args.num_processes}", _INIT_USAGE)
            if args.master_addr not in ("localhost", "127.0.0.1"):
                raise usage("dist_init", "--master-addr: the rendezvous address is chosen for you (127.0.0.1 "
                                         "on this machine; a node's address under set_placement('ray'))")
            gpus = None
            if args.gpu_ids is not None:
                if not re.fullmatch(r"\d+(,\d+)*", args.gpu_ids.replace(" ", "").strip("'\"")):
                    raise usage("dist_init", f"-g takes GPU ids separated by commas, like 3,1; "
                                             f"not {args.gpu_ids!r}", _INIT_USAGE)
                gpus = [int(g) for g in args.gpu_ids.replace(" ", "").strip("'\"").split(",")]
            if args.timeout is not None and not args.timeout > 0:
                raise usage("dist_init", "--timeout must be more than 0 seconds", _INIT_USAGE)
            if gpus is not None or args.backend == "nccl":
                import torch

                count = torch.cuda.device_count() if torch.cuda.is_available() else 0
                wanted = gpus if gpus is not None else list(range(args.num_processes))
                if max(wanted) >= count:
                    asked = f"-g {args.gpu_ids}" if gpus is not None else "--backend nccl"
                    raise usage("dist_init", f"{asked} needs CUDA GPUs {wanted}; this machine has {count}",
                                _INIT_USAGE)

            from ..session import Session

            try:
                self._session = Session(args.num_processes, ddp=True, gpus=gpus, backend=args.backend)
                self._session.restart_how = "%dist_restart"
            except (ValueError, RuntimeError) as e:
                if isinstance(e, RankError):
                    raise
                raise usage("dist_init", str(e), _INIT_USAGE) from None
            except KeyboardInterrupt as e:
                show_briefly(e, ["KeyboardInterrupt: %dist_init was interrupted; no rank was kept"])
                raise
            self._timeout = args.timeout
            if args.view is not None:
                self._set_view(args.view)
            self._router.automatic = True
            line_magics = self._sh.magics_manager.magics["line"]
            if line_magics.get("debug") is not self._debug_the_rank:  # %debug after a rank error: that rank
                self._ipython_debug = line_magics.get("debug")
                line_magics["debug"] = self._debug_the_rank
            rows = self._session.status()
            backend = getattr(self._session, "backend", None) or args.backend or ""
            print(f"{args.num_processes} ranks ready{f' ({backend})' if backend else ''}: "
                  + ", ".join(f"rank {r.rank} pid {r.pid} on {r.device}"
                              + (f" at {_node_of(r)}" if _node_of(r) != "127.0.0.1" else "") for r in rows))
            print("Automatic mode on: every cell runs on all ranks (%%local: in the kernel; "
                  "%dist_mode off to stop)")

        @line_magic
        def dist_shutdown(self, line: str) -> None:
            """Stop every rank; they are gone when this returns. Automatic mode goes off.

            Example::

                %dist_shutdown
            """
            if line.strip():
                raise usage("dist_shutdown", "takes no arguments")
            if self._session is None or self._session.closed:
                print("No ranks are running.")
                self._router.automatic = False
                return
            n = self._session.world_size
            self._session.close()
            self._router.automatic = False
            print(f"{n} ranks stopped. Automatic mode off.")

        @magic_arguments()
        @argument("-n", "--nuclear", action="store_true", help="accepted for nbdistributed notebooks; "
                  "never needed (only this session's own processes are ended, by pid)")
        @line_magic
        def dist_reset(self, line: str) -> None:
            """Stop every rank and forget the session (its options and automatic mode), ready
            for a new %dist_init. Ends only this session's own processes, by pid.

            Example::

                %dist_reset
                %dist_init -n 4
            """
            try:
                parse_argstring(self.dist_reset, line)
            except UsageError as e:
                raise usage("dist_reset", str(e)) from None
            self._forget()
            print("Session reset: no ranks running; %dist_init starts new ones.")

        def _forget(self) -> None:
            s, self._session = self._session, None
            self._router.automatic = False
            self.view = "lines"
            self._timeout = None
            line_magics = self._sh.magics_manager.magics["line"]
            if self._ipython_debug is not None and line_magics.get("debug") is self._debug_the_rank:
                line_magics["debug"] = self._ipython_debug
            if s is not None:
                s.close()

        @line_magic
        def dist_restart(self, line: str) -> None:
            """Replace dead ranks (or the ranks named) with fresh ones and rebuild the group;
            the other ranks keep their state.

            Example::

                %dist_restart        # the dead ones
                %dist_restart 1      # rank 1, dead or not
            """
            s = self._require("dist_restart")
            ranks = None
            if line.strip():
                try:
                    ranks = parse_ranks(",".join(line.replace(",", " ").split()), s.world_size)
                except ValueError as e:
                    raise usage("dist_restart", str(e), "%dist_restart [k ...]") from None
            before = {r.rank: r.state for r in s.status()}
            try:
                s.restart(ranks)
            except KeyboardInterrupt as e:
                show_briefly(e, ["KeyboardInterrupt: %dist_restart was interrupted once it was done "
                                 "(%dist_status shows the ranks)"])
                raise
            rows = s.status()
            changed = ranks if ranks is not None else [r for r, state in before.items() if state == "dead"]
            if not changed:
                print("No rank was dead: nothing restarted.")
                return
            print("Restarted " + ", ".join(f"rank {r.rank} (pid {r.pid})" for r in rows if r.rank in changed)
                  + "; the group is rebuilt, the other ranks kept their state.")

        @magic_arguments()
        @argument("-r", "--rank", type=int, metavar="K",
                  help="the rank to debug (default: the root cause of the last failed cell)")
        @line_magic
        def dist_debug(self, line: str) -> None:
            """pdb post mortem on a rank: the frames and locals of the last error a cell raised
            there. Commands are typed into the frontend's input prompt, ``[rank k] (Pdb)``.

            Example::

                %dist_debug            # the rank that caused the last failed cell
                %dist_debug --rank 0
            """
            self._post_mortem(parse_argstring(self.dist_debug, line).rank)

        def _post_mortem(self, rank: Optional[int]) -> None:
            s = self._require("dist_debug")
            if rank is None and s.last_error is None:
                raise UsageError("%dist_debug: no cell on the ranks has failed yet; %dist_debug --rank K "
                                 "debugs the last error of rank K")
            try:
                self._call(lambda: s.debug(rank))
            except ValueError as e:
                raise UsageError(f"%dist_debug: {e}") from None

        def _debug_the_rank(self, line: str) -> Any:
            """IPython's %debug, right after a cell failed on the ranks: post mortem on the rank
            that caused it (its frames are there, not in the kernel); otherwise IPython's own."""
            s = self._session
            last = getattr(sys, "last_value", None)
            if not line.strip() and s is not None and not s.closed and last is not None and last is s.last_error:
                return self._post_mortem(None)
            if self._ipython_debug is None:
                raise UsageError("%debug is not available")
            return self._ipython_debug(line)

        # -- views ------------------------------------------------------------------------

        @line_magic
        def dist_view(self, line: str) -> None:
            """How persistent cells show the ranks' output; without an argument, say which.

            ``lines`` (the default): each line labelled ``[rank k]``, live; figures, displays
            and values in rank order. ``tabs``: one tab per rank (ipywidgets Tab and Output),
            each rank's streams, figures, values, errors and widgets in its own tab, live.
            Where widgets cannot show (no ipywidgets, no Jupyter kernel) tabs fall back to lines.

            Example::

                %dist_view tabs
            """
            arg = line.strip()
            if arg and arg not in VIEWS:
                raise usage("dist_view", f"expected one of {', '.join(VIEWS)}, not {arg!r}",
                            "%dist_view [lines|tabs]")
            if arg:
                self._set_view(arg)
                return
            print(f"View: {self.view}" + (" (one tab per rank)" if self.view == "tabs" else
                                         " (labelled lines; %dist_view tabs for one tab per rank)"))

        def _set_view(self, kind: str) -> None:
            self.view = kind
            why = tabs_unavailable(self._sh) if kind == "tabs" else None
            if why is not None:
                print(f"View: tabs, shown as lines here ({why})")
            elif kind == "tabs":
                print("View: tabs (one tab per rank, from the next cell)")
            else:
                print("View: lines (each line labelled [rank k])")

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

        @line_magic
        def dist_status(self, line: str) -> None:
            """One row per rank: pid, state (idle, running, dead), device, RSS and GPU memory,
            last cell. An HTML table in Jupyter, text elsewhere.

            Example::

                %dist_status
            """
            if self._session is None:
                print("No ranks: %dist_init -n N starts them.")
                return
            if self._session.closed:
                print("The ranks were shut down: %dist_init -n N starts new ones.")
                return
            text, table = status_table(self._session.status())
            mode = f"automatic mode {'on' if self._router.automatic else 'off'}"
            publish_display_data({"text/plain": f"{text}\n({mode})",
                                  "text/html": f"{table}<p>{html.escape(mode)}</p>"})

    return SessionMagics


def _sync_on_rank() -> None:
    """%sync on a rank: CUDA work finished, then a barrier on the group."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


__all__ = ["session", "parse_ranks", "status_table", "format_bytes", "CellRouter", "load"]
