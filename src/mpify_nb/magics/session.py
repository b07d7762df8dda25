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

The Session (session/session.py, a package beside magics/) owns the processes, the channels,
output relay, interrupts and errors. This module holds the default session and registers the
session magics: one Magics class per group of them, each given the one SessionState they share
(state.py), none mixed into another::

    SessionState ──┬── LifecycleMagics (lifecycle.py)   %dist_init %dist_shutdown %dist_reset
                   │                                     %dist_restart %dist_debug %dist_status %dist_where
                   ├── RankCellMagics  (rank_cells.py)  %%distributed %%rank %%local
                   ├── DataMagics      (data.py)        %dist_push %dist_pull %sync
                   ├── ViewMagics      (views.py)       %dist_view
                   ├── ModeMagics      (router.py)      %dist_mode
                   └── BackgroundMagics (background.py) %dist_wait %dist_stop (a rank cell's --bg, --after)
"""

from __future__ import annotations

import atexit
from typing import Any, Optional

from .background import background_magics_class
from .cell import name_magic_calls_apart
from .data import data_magics_class
from .lifecycle import lifecycle_magics_class
from .rank_cells import rank_cell_magics_class
from .router import CellRouter, mode_magics_class, parse_ranks
from .state import SessionState
from .status import format_bytes, status_table
from .views import view_magics_class

#: The session magics of the running shell (None before %load_ext): hold the default session.
_current: Optional[Loaded] = None


def session():
    """The session the magics drive (None before ``%dist_init`` or after ``%dist_reset``).

    Example::

        %dist_init -n 2
        from mpify_nb.magics.session import session
        session().pull("x", rank=None)
    """
    return None if _current is None else _current.state.session


def magics_classes() -> tuple[type, ...]:
    """The session magics' classes, one per group (built on first use: they need IPython)."""
    return (lifecycle_magics_class(), rank_cell_magics_class(), data_magics_class(), view_magics_class(),
            mode_magics_class(), background_magics_class())


class Loaded:
    """The session magics in one shell: their shared state, the groups registered with it, and
    automatic mode's router in IPython's input transformers and events."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.state = SessionState(CellRouter())
        self.lifecycle = lifecycle_magics_class()(shell, self.state)  # it forgets the session at unload
        for group in (self.lifecycle, *(cls(shell, self.state) for cls in magics_classes()[1:])):
            shell.register_magics(group)
        router = self.state.router
        shell.input_transformers_cleanup.insert(0, router)
        shell.events.register("pre_execute", router.pre_execute)
        shell.events.register("pre_run_cell", router.pre_run_cell)
        shell.events.register("post_execute", router.post_execute)
        self._undo_names = name_magic_calls_apart(shell)  # line 1 of a rank cell: the ranks', not the magic's
        atexit.register(self.lifecycle.forget)

    def unload(self) -> None:
        """Stop the ranks, take automatic mode's router out of IPython."""
        self.lifecycle.forget()
        self._undo_names()
        router = self.state.router
        if router in self.shell.input_transformers_cleanup:
            self.shell.input_transformers_cleanup.remove(router)
        for event, fn in (("pre_execute", router.pre_execute),
                          ("pre_run_cell", router.pre_run_cell),
                          ("post_execute", router.post_execute)):
            try:
                self.shell.events.unregister(event, fn)
            except ValueError:
                pass


def load(ipython) -> None:
    """Register the session magics and automatic mode's input transformer."""
    global _current
    _current = Loaded(ipython)


def unload(ipython) -> None:
    global _current
    if _current is not None:
        _current.unload()
        _current = None


__all__ = ["session", "parse_ranks", "status_table", "format_bytes", "CellRouter", "load"]
