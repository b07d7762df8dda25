"""A matplotlib backend for persistent ranks: ``plt.show()`` on a rank shows its figures in
the notebook cell, labelled by rank, as the inline backend does in a kernel.

``%dist_init`` points every rank's ``MPLBACKEND`` here (before the rank imports
matplotlib); the figures travel as PNG through the rank's ``display``::

    rank k: plt.show() ── display(fig) ── DISPLAY {"image/png": ...} ──> kernel: "[rank k]" + image

Rendering is Agg's. A figure also gets ``_repr_png_``, so ``display(fig)`` and a figure
as a cell's last value show as images too.
"""

from __future__ import annotations

import io
import sys

from matplotlib import _pylab_helpers
from matplotlib.backend_bases import _Backend
from matplotlib.backends.backend_agg import FigureCanvasAgg, _BackendAgg
from matplotlib.figure import Figure


def _figure_png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.canvas.print_figure(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


Figure._repr_png_ = _figure_png  # type: ignore[attr-defined]


@_Backend.export
class _BackendRank(_BackendAgg):
    FigureCanvas = FigureCanvasAgg

    @staticmethod
    def show(*args, **kwargs) -> None:
        """Display every open figure in the running cell, then close them (as the inline backend)."""
        display = getattr(sys.modules.get("__main__"), "display", None)
        managers = _pylab_helpers.Gcf.get_all_fig_managers()
        for manager in managers:
            if display is not None:
                display(manager.canvas.figure)
        _pylab_helpers.Gcf.destroy_all()
