"""IPython magics (``%load_ext mpify_nb``), by job:

==================  ===============================================================
ranch.py            %%ranch N: fresh ranks for one cell; %ranch_result
session.py          persistent ranks: the magics class driving one Session, built from
lifecycle.py        %dist_init, %dist_shutdown, %dist_reset, %dist_restart, %dist_debug,
                    %dist_view, %dist_status, %dist_where: the session's life, and
cells_and_data.py   %%distributed, %%rank, %%local, %dist_push/%dist_pull, %sync,
                    %dist_mode: cells and data to the ranks
rank_cells.py       a rank cell run on the ranks: its pieces in order, names sent
views.py            %dist_view: labelled lines (figures in rank order) or a tab per rank
router.py           automatic mode's input transformer; the ranks a %%rank line names
status.py           %dist_status's table
auto.py             automatic mode: which cells go to the ranks, which lines stay
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
