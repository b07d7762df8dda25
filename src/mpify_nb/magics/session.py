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

The Session (session/session.py, a package beside magics/) owns the processes, the channels, output
relay, interrupts and errors. This module builds the one magics class and holds the default
session; its magics come from two mixins, each with a job: the session's life (lifecycle.py:
%dist_init, %dist_shutdown, %dist_reset, %dist_restart, %dist_debug, %dist_view, %dist_status, %dist_where)
and cells and data (cells_and_data.py: %%distributed, %%rank, %%local, %dist_push, %dist_pull,
%sync, %dist_mode). Running a rank cell is rank_cells.py's job (their common base), where a
cell goes router.py's, the status table status.py's.
"""

from __future__ import annotations

import atexit
import functools
from typing import Any, Callable, Optional

from .cell import name_magic_calls_apart
from .cells_and_data import cells_and_data_class
from .lifecycle import session_lifecycle_class
from .router import CellRouter, parse_ranks
from .status import format_bytes, status_table

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
    from IPython.core.magic import Magics, magics_class

    # The mixins' magics are recorded by IPython's decorators as their classes are built, and
    # taken by the next @magics_class: this one, right after, in this thread.
    lifecycle, cells_and_data = session_lifecycle_class(), cells_and_data_class()

    @magics_class
    class SessionMagics(lifecycle, cells_and_data, Magics):
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
            self._undo_names = name_magic_calls_apart(shell)  # line 1 of a rank cell: the ranks', not the magic's
            atexit.register(self._forget)

        def _router_remove(self) -> None:
            self._undo_names()
            if self._router in self._sh.input_transformers_cleanup:
                self._sh.input_transformers_cleanup.remove(self._router)
            for event, fn in (("pre_execute", self._router.pre_execute),
                              ("pre_run_cell", self._router.pre_run_cell),
                              ("post_execute", self._router.post_execute)):
                try:
                    self._sh.events.unregister(event, fn)
                except ValueError:
                    pass

    return SessionMagics


__all__ = ["session", "parse_ranks", "status_table", "format_bytes", "CellRouter", "load"]
