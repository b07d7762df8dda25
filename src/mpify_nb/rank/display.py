"""Rich display from a persistent rank: ``display(obj)`` and matplotlib figures reach the cell.

A rank has no Jupyter kernel of its own, so IPython's ``display()`` would only print a
repr and ``plt.show()`` would show nothing. On a Session rank (see rank/session.py)::

    rank: display(df) / IPython.display.display(df)   -> mimebundle (IPython's formatter)
          plt.plot(...) ; plt.show()  or end of cell  -> {"image/png": ..., "text/plain": ...}
            │  DISPLAY message on the work channel, tagged with the running request
            ▼
    caller: Session.run(..., display=callback)  -> callback(rank, bundle)   (the magics: labelled
                                                   output in the cell; default: text printed)

The ranks' matplotlib backend (``MPLBACKEND=module://mpify_nb.rank.mpl_backend``) draws with Agg
and shows with :func:`show` here: like the notebook's inline backend, the figures a cell drew
are shown and closed when it ends.
"""

from __future__ import annotations

import base64
import importlib.abc
import importlib.util
import io
import os
import sys
from typing import Any, Callable, Optional

#: Sends one mimebundle to the caller; set by the rank's serve loop.
_send: Optional[Callable[[dict], None]] = None

BACKEND = "module://mpify_nb.rank.mpl_backend"


def install(send: Callable[[dict], None]) -> None:
    """Route this rank's rich display to ``send``."""
    global _send
    _send = send
    # The notebook's kernel exports its inline backend, which needs a kernel: use ours.
    current = os.environ.get("MPLBACKEND", "")
    if not current or "inline" in current:
        os.environ["MPLBACKEND"] = BACKEND
        matplotlib = sys.modules.get("matplotlib")
        if matplotlib is not None:  # preloaded by the template: it read MPLBACKEND already
            try:
                matplotlib.use(BACKEND)
            except Exception:
                pass  # figures then go wherever that backend sends them
    if "IPython.core.display_functions" in sys.modules:
        _patch(sys.modules["IPython.core.display_functions"])
    else:
        sys.meta_path.insert(0, AfterImport("IPython.core.display_functions", _patch))


def display(*objs: Any, **_options: Any) -> None:
    """``IPython.display.display`` on a rank: each object's rich forms go to the cell."""
    for obj in objs:
        _publish(_bundle(obj))


def _bundle(obj: Any) -> dict:
    try:
        from IPython.core.formatters import DisplayFormatter

        data, _metadata = DisplayFormatter().format(obj)
        if data:
            return data
    except Exception:
        pass
    try:
        return {"text/plain": repr(obj)}
    except Exception as e:
        return {"text/plain": f"<{type(obj).__name__} (repr failed: {e})>"}


def _publish(bundle: dict) -> None:
    if _send is None:
        print(bundle.get("text/plain", ""))
    else:
        _send(bundle)


def _patch(module: Any) -> None:
    module.display = display


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once ``name`` is imported, before anything binds its names (as
    ``from IPython.display import display`` would bind IPython's own ``display``)."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module
        then = self.then

        def exec_module(module):
            run(module)
            then(module)

        loader.exec_module = exec_module
        return spec


# -- matplotlib backend ---------------------------------------------------------------------

def show(*_args: Any, **_kwargs: Any) -> None:
    """``plt.show()``: every open figure to the cell as PNG, then closed (as the inline backend)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    from matplotlib._pylab_helpers import Gcf

    managers = Gcf.get_all_fig_managers()
    try:
        for manager in managers:
            figure = manager.canvas.figure
            buf = io.BytesIO()
            figure.savefig(buf, format="png", bbox_inches="tight")
            _publish({"image/png": base64.b64encode(buf.getvalue()).decode("ascii"), "text/plain": repr(figure)})
    finally:
        if managers:
            pyplot.close("all")


def flush_figures() -> None:
    """At the end of each cell: show what it drew, when our backend is the one in use."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    try:
        import matplotlib

        if matplotlib.get_backend() != BACKEND:
            return
    except Exception:
        return
    show()
