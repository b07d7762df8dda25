"""The session's life: %dist_init, %dist_shutdown, %dist_reset, %dist_restart, %dist_debug,
%dist_status, %dist_where.

The group of session magics that starts, stops, restarts and inspects the ranks::

    %dist_init -n 2 ──> Session(2, ddp=True): ranks up, group joined; automatic mode on;
                        IPython's %debug becomes the failed rank's post mortem
    %dist_restart [k]   dead (or named) ranks replaced, group rebuilt
    %dist_shutdown / %dist_reset ──> Session.close() (reset: options forgotten too)
    %dist_debug / %debug ──> Session.debug(rank): pdb on the rank, through the frontend's prompt
    %dist_status ──> Session.status(), as status.py's table
    %dist_where ──> Session.where(): each rank's stack and the collectives it waits in

Its Magics class is registered with the other groups' by session.py; they share its
SessionState (state.py): the Session, the cells' time limit, the view, the router.
"""

from __future__ import annotations

import functools
import html
import re
import sys
from typing import Any, Optional

from ..engine.background import RanksBusyError
from .background import BUSY_HOW
from .cell import show_briefly
from .router import parse_ranks
from .state import SessionState, usage
from .status import status_table
from .views import VIEWS, set_view

_INIT_USAGE = "%dist_init -n N [-g IDS] [--backend gloo|nccl] [--timeout S] [--view lines|tabs]"


def _node_of(row) -> str:
    return getattr(row, "node", "127.0.0.1")


@functools.cache
def lifecycle_magics_class() -> type:
    """Build the Magics class (on first use, not at import)."""
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, line_magic, magics_class
    from IPython.core.magic_arguments import argument, kwds, magic_arguments, parse_argstring
    from IPython.display import publish_display_data

    from ..wire.errors import RankError

    @magics_class
    class LifecycleMagics(Magics):
        """%dist_init, %dist_shutdown, %dist_reset, %dist_restart, %dist_debug, %dist_status, %dist_where."""

        def __init__(self, shell: Any, state: SessionState):
            super().__init__(shell)
            self.state = state
            self._sh: Any = shell  # IPython's shell (never None once registered)

        # -- starting and stopping -------------------------------------------------------

        @magic_arguments()
        @kwds(usage=_INIT_USAGE[1:])
        @argument("-n", "--num-processes", "--num-ranks", type=int, default=2, metavar="N",
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
            if self.state.session is not None and not self.state.session.closed:
                raise usage("dist_init", f"{self.state.session.world_size} ranks are running already; "
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

            from ..session.session import Session

            try:
                self.state.session = Session(args.num_processes, ddp=True, gpus=gpus, backend=args.backend)
                self.state.session.restart_how = "%dist_restart"
                self.state.session.busy_how = BUSY_HOW
            except (ValueError, RuntimeError) as e:
                if isinstance(e, RankError):
                    raise
                raise usage("dist_init", str(e), _INIT_USAGE) from None
            except KeyboardInterrupt as e:
                show_briefly(e, ["KeyboardInterrupt: %dist_init was interrupted; no rank was kept"])
                raise
            self.state.timeout = args.timeout
            if args.view is not None:
                set_view(self.state, self._sh, args.view)
            self.state.router.automatic = True
            line_magics = self._sh.magics_manager.magics["line"]
            # (==, not is: each self._debug_the_rank is a new bound method, equal to the one installed)
            if line_magics.get("debug") != self._debug_the_rank:  # %debug after a rank error: that rank
                self.state.ipython_debug = line_magics.get("debug")
                line_magics["debug"] = self._debug_the_rank
            rows = self.state.session.status()
            backend = getattr(self.state.session, "backend", None) or args.backend or ""
            print(f"{args.num_processes} ranks ready{f' ({backend})' if backend else ''}: "
                  + ", ".join(f"rank {r.rank} pid {r.pid} on {r.device}"
                              + (f" at {_node_of(r)}" if _node_of(r) != "127.0.0.1" else "") for r in rows))
            print("Automatic mode on: every cell runs on all ranks (%%local: in the kernel; "
                  "%dist_mode off to stop)")

        @line_magic
        def dist_shutdown(self, line: str) -> None:
            """Stop every rank; they are gone when this returns. Automatic mode goes off.
            ``--force`` (``-f``, nbdistributed's) is accepted and means the same: every rank is
            ended, by its pid, whatever it was doing.

            Example::

                %dist_shutdown
            """
            if line.split() not in ([], ["--force"], ["-f"]):
                raise usage("dist_shutdown", f"takes no arguments (or --force, the same), not {line.strip()!r}",
                            "%dist_shutdown [--force]")
            if self.state.session is None or self.state.session.closed:
                print("No ranks are running.")
                self.state.router.automatic = False
                return
            n = self.state.session.world_size
            work = self.state.session._busy
            self.state.session.close()
            self.state.router.automatic = False
            print(f"{n} ranks stopped" + (f", and with them {work.label()}" if work is not None else "")
                  + ". Automatic mode off.")

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
            self.forget()
            print("Session reset: no ranks running; %dist_init starts new ones.")

        def forget(self) -> None:
            """Stop the ranks and forget the session: options, automatic mode, %debug back to IPython's."""
            s, self.state.session = self.state.session, None
            self.state.background = None
            self.state.router.automatic = False
            self.state.view = "lines"
            self.state.timeout = None
            line_magics = self._sh.magics_manager.magics["line"]
            if self.state.ipython_debug is not None and line_magics.get("debug") == self._debug_the_rank:
                line_magics["debug"] = self.state.ipython_debug
            if s is not None:
                s.close()

        @line_magic
        def dist_restart(self, line: str) -> None:
            """Replace dead ranks (or the ranks named) with fresh ones and rebuild the group;
            the other ranks keep their state. With no rank dead, the Session's group comes back
            where a cell destroyed it (or made its own instead).

            Example::

                %dist_restart        # the dead ones
                %dist_restart 1      # rank 1, dead or not
            """
            s = self.state.require("dist_restart")
            ranks = None
            if line.strip():
                try:
                    ranks = parse_ranks(",".join(line.replace(",", " ").split()), s.world_size)
                except ValueError as e:
                    raise usage("dist_restart", str(e), "%dist_restart [k ...]") from None
            before = {r.rank: (r.state, r.group) for r in s.status()}
            try:
                s.restart(ranks)
            except RanksBusyError as e:
                show_briefly(e)
                raise
            except KeyboardInterrupt as e:
                show_briefly(e, ["KeyboardInterrupt: %dist_restart was interrupted once it was done "
                                 "(%dist_status shows the ranks)"])
                raise
            rows = s.status()
            changed = ranks if ranks is not None else [r for r, (state, _) in before.items() if state == "dead"]
            if not changed:
                if s.ddp and any(group != "session" for _, group in before.values()):
                    print("No rank was dead: the Session's process group is rebuilt on every rank "
                          "(a cell had destroyed it, or made its own); their state is kept.")
                else:
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

            Not nbdistributed's ``%dist_debug``, which printed its workers' state: that is
            ``%dist_status`` here. With no error to debug, this says so and shows that state.

            Example::

                %dist_debug            # the rank that caused the last failed cell
                %dist_debug --rank 0
            """
            rank = parse_argstring(self.dist_debug, line).rank
            s = self.state.session
            if rank is None and (s is None or s.closed or s.last_error is None):
                print("%dist_debug debugs the last error a cell raised on a rank (pdb post mortem), and no "
                      "cell has failed on the ranks. (nbdistributed's %dist_debug showed the workers' state: "
                      "%dist_status, below.)")
                self._show_status()
                return
            self._post_mortem(rank)

        def _post_mortem(self, rank: Optional[int]) -> None:
            s = self.state.require("dist_debug")
            if rank is None and s.last_error is None:
                raise UsageError("%dist_debug: no cell on the ranks has failed yet; %dist_debug --rank K "
                                 "debugs the last error of rank K")
            try:
                self.state.call(lambda: s.debug(rank))
            except ValueError as e:
                raise UsageError(f"%dist_debug: {e}") from None

        def _debug_the_rank(self, line: str) -> Any:
            """IPython's %debug, right after a cell failed on the ranks: post mortem on the rank
            that caused it (its frames are there, not in the kernel); otherwise IPython's own."""
            s = self.state.session
            last = getattr(sys, "last_value", None)
            if not line.strip() and s is not None and not s.closed and last is not None and last is s.last_error:
                return self._post_mortem(None)
            if self.state.ipython_debug is None:
                raise UsageError("%debug is not available")
            return self.state.ipython_debug(line)

        @line_magic
        def dist_status(self, line: str) -> None:
            """One row per rank: pid, state (idle, running, dead), device, RSS and GPU memory,
            last cell. An HTML table in Jupyter, text elsewhere.

            Example::

                %dist_status
            """
            self._show_status()

        def _show_status(self) -> None:
            if self.state.session is None:
                print("No ranks: %dist_init -n N starts them.")
                return
            if self.state.session.closed:
                print("The ranks were shut down: %dist_init -n N starts new ones.")
                return
            text, table = status_table(self.state.session.status())
            mode = f"automatic mode {'on' if self.state.router.automatic else 'off'}"
            work = self.state.session._busy
            if work is not None:
                mode += f"; background: {work.what} started in {work.cell or 'a cell'}, {work.state()}"
            publish_display_data({"text/plain": f"{text}\n({mode})",
                                  "text/html": f"{table}<p>{html.escape(mode)}</p>"})

        @line_magic
        def dist_where(self, line: str) -> None:
            """Where each rank is: its Python stack (the cell's lines included) and the collectives it
            waits in. Between cells a rank is idle; background work (``%%distributed --bg``), a cell
            left running on another thread, or a rank still in one shows where it is.

            Example::

                %dist_where
            """
            if line.strip():
                raise usage("dist_where", f"it takes no arguments, not {line.strip()!r}", "%dist_where")
            if self.state.session is None or self.state.session.closed:
                print("No ranks: %dist_init -n N starts them.")
                return
            print(self.state.session.where())

    return LifecycleMagics
