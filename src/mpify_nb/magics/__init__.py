"""IPython magics (``%load_ext mpify_nb``), one module per thing the user types or group of them:

==================  ===============================================================
ranch.py            %%ranch N: fresh ranks for one cell; %ranch_result
session.py          the persistent ranks' magics: their groups registered, sharing one
                    SessionState (state.py); the default Session (``session()``)
lifecycle.py        the session's life: %dist_init, %dist_shutdown, %dist_reset,
                    %dist_restart, %dist_debug, %dist_status (status.py's table),
                    %dist_where
rank_cells.py       cells to the ranks: %%distributed, %%rank, %%local; a rank cell
                    run piece by piece, the names the ranks lack sent first
data.py             data to and from the ranks: %dist_push, %dist_pull, %sync
background.py       background work: a rank cell's --bg and --after, %dist_wait, %dist_stop
views.py            %dist_view: labelled lines (figures in rank order) or a tab per rank
router.py, auto.py  automatic mode: %dist_mode, the input transformer, which cells go
                    to the ranks and which lines stay; the ranks a %%rank line names
names.py            the names a cell reads from the notebook (sent to the ranks)
cell.py             a cell in IPython: compiled as ``Cell In[n]``, its values and
                    errors shown
==================  ===============================================================

What a rank runs for a cell lives below the process boundary (rank/cells.py): ranks never
import this package. Each magics class is built on first use, not at import.
"""

from __future__ import annotations

from .cell import CellSyntaxError
from .names import names_read_from_notebook, notebook_names_for
from .ranch import _run_cell_on_rank  # noqa: F401  (where pickles of older cells look for it)


def load_ipython_extension(ipython) -> None:
    """``%load_ext mpify_nb``: register every magic of the package."""
    from ..debugger.kernel import install
    from .ranch import ranch_magics_class
    from .session import load

    ipython.register_magics(ranch_magics_class()(ipython))
    load(ipython)
    install()  # the frontend's debugger panel reaches the ranks (a no-op outside a Jupyter kernel)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext mpify_nb``: stop the ranks of the session and automatic mode."""
    from .session import unload

    unload(ipython)


__all__ = ["load_ipython_extension", "unload_ipython_extension", "names_read_from_notebook", "notebook_names_for",
           "CellSyntaxError"]
