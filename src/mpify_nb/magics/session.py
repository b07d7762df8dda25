"""Persistent ranks from a notebook: nbdistributed's magics driving one default Session.

::

    %dist_init -n 2            # ranks 0 and 1 start, join a gloo group; automatic mode on
    x = torch.ones(2) * rank   # an ordinary cell: runs on every rank, keeps its state there
    dist.all_reduce(x); x      # [rank 0] tensor([1., 1.])  [rank 1] tensor([1., 1.])
    %%rank [0]                 # on rank 0 only
    %%local                    # in the kernel only
    %dist_pull x --all         # every rank's x, as a list, into the notebook

Where a cell goes (the kernel is never a rank)::

    cell ──CellRouter (auto.route)──> kernel cell (magics only, %%local, %%bash ...)
                                 └──> %%distributed --auto ──> split_cell: pieces in order
                                                                 │
        kernel: %magic / !shell lines <──────────────────────────┤
        names the piece reads that a rank lacks ── Session.push ─┤ (one-line note)
        ranks: code ── Session.run(source, filename="Cell In[n]") ┘
                 <── live "[rank k] ..." lines, rich display, values by rank, errors

The Session (session.py at the package root) owns the processes, the channels, output
relay, interrupts and errors; this module turns cells into Session calls and shows
what comes back.
"""

from __future__ import annotations

import ast
import atexit
import functools
import html
import re
import shlex
import sys
from typing import Any, Callable, Optional, cast

from ..errors import PayloadError
from .auto import Piece, route, split_cell
from .cells import CellSyntaxError, cell_number, ends_with_semicolon, labelled, notebook_names_for, show_briefly

_INIT_USAGE = "%dist_init -n N [-g IDS] [--backend gloo|nccl] [--timeout S]"
_INTERRUPTED = ("KeyboardInterrupt: the cell was interrupted; every rank stopped what it ran "
                "and keeps its state")

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


def format_bytes(n: Optional[int]) -> str:
    """``173.2 MB``; ``-`` for None (a dead rank, no GPU)."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def _short_exit(detail: str) -> str:
    """"rank 1 was killed by SIGKILL (killed by hand, or ...)" -> "killed by SIGKILL"."""
    detail = re.sub(r"^rank \d+ (was |has )?", "", detail.splitlines()[0] if detail else "")
    return re.sub(r"\s*\(.*$", "", detail)[:40]


def status_table(rows: list) -> tuple[str, str]:
    """(text, html) of ``Session.status()`` rows: rank, pid, state, device, RSS, GPU memory, last
    cell; and each rank's node when they are not all on this machine (under Ray)."""
    head = ["rank", "pid", "state", "device", "RSS", "GPU memory", "last cell"]
    elsewhere = any(_node_of(row) != "127.0.0.1" for row in rows)
    if elsewhere:
        head.insert(2, "node")
    cells = []
    for row in rows:
        state = row.state + (f" ({_short_exit(row.exit_detail)})" if getattr(row, "exit_detail", "") else "")
        last = (row.last_cell or "").splitlines()[0] if row.last_cell else ""
        cells.append([str(row.rank), str(row.pid), state, str(row.device), format_bytes(row.rss),
                      format_bytes(row.gpu_memory), last[:60]])
        if elsewhere:
            cells[-1].insert(2, _node_of(row))
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
    text = "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in [head, *cells])
    style = ' style="text-align:left"'
    header = "".join(f"<th{style}>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td{style}>{html.escape(v)}</td>" for v in line) + "</tr>" for line in cells)
    return text, f"<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>"


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
    from . import onrank

    def usage(magic: str, message: str, usage_line: str = "") -> UsageError:
        tail = f"\nusage: {usage_line}" if usage_line else ""
        return UsageError(f"%{magic}: {message}{tail}\n(see %{magic}? for help)")

    @magics_class
    class SessionMagics(Magics):
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

        @property
        def _sh(self) -> Any:
            """IPython's shell (never None once registered)."""
            return self.shell

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

        # -- helpers -----------------------------------------------------------------------------

        def _require(self, magic: str):
            if self._session is None or self._session.closed:
                raise UsageError(f"%{magic}: no ranks are running: %dist_init -n N starts them")
            return self._session

        def _call(self, fn: Callable[[], Any]) -> Any:
            """A session call; an interrupt reads as one, other errors keep their own display."""
            try:
                return fn()
            except KeyboardInterrupt as e:
                show_briefly(e, [_INTERRUPTED])
                raise
            except TimeoutError as e:
                show_briefly(e)
                raise
            except (NameError, PayloadError) as e:  # a pull's: the message says it all
                show_briefly(e)
                raise

        def _run_cell(self, cell: str, header: Optional[str], ranks: Optional[list[int]], both: bool) -> None:
            """Run a rank cell: its pieces in order (kernel lines in the kernel, code on ``ranks``)."""
            shell = self._sh
            s = self._require("distributed" if ranks is None else "rank")
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
            for i, piece in enumerate(plan.pieces):
                last = i == len(plan.pieces) - 1
                if piece.kind == "kernel":
                    if not both:  # with --to both the kernel ran it already
                        self._run_kernel_line(piece, filename)
                    continue
                self._send_missing_names(piece, s, ranks)
                if piece.kind == "ranks":
                    values = self._call(lambda p=piece: s.run(p.source, ranks=ranks, timeout=self._timeout,
                                                              filename=filename, display=self._show_display))
                elif piece.kind == "time":
                    values = self._call(lambda p=piece: s.apply(onrank.time_code, p.source, filename, cell_text,
                                                                ranks=ranks, timeout=self._timeout))
                else:
                    values = self._timeit(s, piece, ranks, filename, cell_text)
                    if piece.target:
                        self._sh.user_ns[piece.target], values = values, None
                if last and not quiet and values:
                    self._show_values(values)

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
            lacking = self._call(lambda: s.missing_names(names, ranks))
            by_names: dict[tuple[str, ...], list[int]] = {}
            for rank, missing in sorted(lacking.items()):
                if missing:
                    by_names.setdefault(tuple(n for n in names if n in missing), []).append(rank)
            for group, group_ranks in by_names.items():
                values = {n: self._sh.user_ns[n] for n in group}
                try:
                    self._call(lambda r=group_ranks, v=values: s.push(r, **v))
                except (KeyboardInterrupt, RankError):
                    raise
                except Exception as e:
                    kinds = ", ".join(f"{n!r} ({type(v).__name__})" for n, v in values.items())
                    show_briefly(e, [f"{type(e).__name__}: the cell uses the notebook's {kinds}, which "
                                     f"rank {_rank_list(group_ranks)} lacks, and it cannot be sent: {e}. "
                                     "Define it in a cell that runs on the ranks."])
                    raise
                print(f"[mpify_nb] sent from the notebook to rank {_rank_list(group_ranks)}: {', '.join(group)}")

        def _run_kernel_line(self, piece: Piece, filename: str) -> None:
            """A %magic / !shell / help line of a rank cell, run in the kernel in its turn."""
            code = self._sh.transform_cell(piece.source)
            exec(compile("\n" * (piece.lineno - 1) + code, filename, "exec"), self._sh.user_ns)

        def _run_in_kernel(self, cell: str, first: int, filename: str, show: bool = True) -> None:
            """``--to both``: the cell in the kernel, its value shown as ``[kernel]``; an error
            shows the cell's frames only and fails the cell."""
            shell = self._sh
            self._router.in_kernel += 1
            try:
                code = shell.transform_cell(cell)
            finally:
                self._router.in_kernel -= 1
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
                return self._call(lambda: s.apply(onrank.timeit_loops, piece.source, piece.setup, filename,
                                                  cell_text, n, r, ranks=ranks, timeout=self._timeout))

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

        def _show_display(self, rank: int, bundle: dict) -> None:
            """Rich display from a rank (display(df), a figure), labelled, in the running cell."""
            data = dict(bundle.get("data", bundle)) if isinstance(bundle, dict) else {"text/plain": repr(bundle)}
            metadata = bundle.get("metadata", {}) if isinstance(bundle, dict) and "data" in bundle else {}
            plain = data.get("text/plain", "")
            if set(data) <= {"text/plain"}:
                publish_display_data({"text/plain": labelled(rank, plain)})
            elif "text/html" in data:
                data["text/html"] = f"<div><code>[rank {rank}]</code></div>{data['text/html']}"
                data["text/plain"] = labelled(rank, plain)
                publish_display_data(data, metadata)
            else:
                publish_display_data({"text/plain": f"[rank {rank}]"})
                publish_display_data(data, metadata)

        def _show_values(self, values: dict) -> None:
            """The last expression's value per rank, labelled; rich values under their label."""
            formatter = self._sh.display_formatter
            lines: list[str] = []
            for rank, value in values.items():
                if value is None:
                    continue
                data, metadata = formatter.format(value)
                _forget_figure(value)
                label = f"[{rank}]" if rank == "kernel" else f"[rank {rank}]"
                if set(data) - {"text/plain"}:
                    if lines:
                        publish_display_data({"text/plain": "\n".join(lines)})
                        lines = []
                    publish_display_data({"text/plain": label})
                    publish_display_data(data, metadata)
                else:
                    text = data.get("text/plain", repr(value))
                    lines.append(label + " " + text.replace("\n", "\n" + " " * (len(label) + 1)))
            if lines:
                publish_display_data({"text/plain": "\n".join(lines)})

    return SessionMagics


def _sync_on_rank() -> None:
    """%sync on a rank: CUDA work finished, then a barrier on the group."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _forget_figure(value: Any) -> None:
    """A figure a rank returned was unpickled into the kernel's pyplot: close it there, or the
    kernel's inline backend shows it a second time when the cell ends."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    figure = sys.modules.get("matplotlib.figure")
    if pyplot is not None and figure is not None and isinstance(value, figure.Figure):
        pyplot.close(value)


def _rank_list(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


__all__ = ["session", "parse_ranks", "status_table", "CellRouter", "load"]
