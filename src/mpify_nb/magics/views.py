"""How a persistent cell's output is shown: labelled lines (the default) or one tab per rank.

::

    %dist_view tabs        # from the next cell: a Tab, "rank 0", "rank 1", ... one Output each
    %dist_view lines       # back to labelled lines
    %dist_view             # says which is on
    %dist_init -n 4 --view tabs

A view is made for each cell and handed to ``Session.run(display=view)``::

    rank k  print(...)            ── relay ──> lines: "[rank k] ..." stream lines (relay/pipes.py)
                                               tabs:  view.rank_streams(k, "stdout", text)
            display(obj), figures ── DISPLAY ─> view(k, bundle)
    values of the last expression ───────────> view.values({k: value})
    a RankError                   ───────────> view.error(e), then the cell fails as ever

**Lines**: streams stay live and labelled. Rich outputs (figures, ``display()``) come in rank
order: the first one of the cell opens a *round*, one empty display per rank (0, 1, 2, ...,
each with a ``display_id``), and each rank's n-th output fills its place in round n
(``update_display_data``), whenever it arrives. Values come last, in rank order.

**Tabs**: a standard ipywidgets ``Tab`` with an ``Output`` per rank, shown at the cell's first
output. Streams, displays (widget views too), values and errors go to their rank's Output as
they come: the Session pumps on the kernel's main thread, so each change is a comm message
sent at once. Without ipywidgets, or without a kernel that has comms, tabs fall back to lines.
"""

from __future__ import annotations

import functools
import html
import itertools
import re
import uuid
from typing import Any, Optional

from .cell import labelled
from .state import SessionState, usage

VIEWS = ("lines", "tabs")


def tabs_unavailable(shell: Any) -> Optional[str]:
    """Why tabs cannot be shown here (None: they can): they need ipywidgets and a Jupyter kernel."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "ipywidgets is not installed"
    if getattr(shell, "kernel", None) is None:  # a terminal IPython: no frontend, no comms
        return "this frontend has no Jupyter kernel with comms"
    return None


@functools.cache
def view_magics_class() -> type:
    """Build the Magics class (on first use, not at import)."""
    from IPython.core.magic import Magics, line_magic, magics_class

    @magics_class
    class ViewMagics(Magics):
        """%dist_view: labelled lines or a tab per rank."""

        def __init__(self, shell: Any, state: SessionState):
            super().__init__(shell)
            self.state = state
            self._sh: Any = shell  # IPython's shell (never None once registered)

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
                set_view(self.state, self._sh, arg)
                return
            print(f"View: {self.state.view}" + (" (one tab per rank)" if self.state.view == "tabs" else
                                               " (labelled lines; %dist_view tabs for one tab per rank)"))

    return ViewMagics


def set_view(state: SessionState, shell: Any, kind: str) -> None:
    """Show cells' output as ``kind`` ("lines" or "tabs") from the next cell, and say so."""
    state.view = kind
    why = tabs_unavailable(shell) if kind == "tabs" else None
    if why is not None:
        print(f"View: tabs, shown as lines here ({why})")
    elif kind == "tabs":
        print("View: tabs (one tab per rank, from the next cell)")
    else:
        print("View: lines (each line labelled [rank k])")


def make_view(kind: str, shell: Any, ranks: list[int]):
    """The view for one cell run on ``ranks`` (``kind``: "lines" or "tabs")."""
    if kind == "tabs":
        return TabsView(shell, ranks)
    return LinesView(shell, ranks)


def _split(bundle: Any) -> tuple[dict, dict]:
    """(data, metadata) of what a rank sent: a mimebundle, or {"data": ..., "metadata": ...}."""
    if not isinstance(bundle, dict):
        return {"text/plain": repr(bundle)}, {}
    if "data" in bundle and isinstance(bundle["data"], dict):
        return dict(bundle["data"]), dict(bundle.get("metadata", {}))
    return dict(bundle), {}


def _forget_figure(value: Any) -> None:
    """A figure a rank returned was unpickled into the kernel's pyplot: close it there, or the
    kernel's inline backend shows it a second time when the cell ends."""
    import sys

    pyplot = sys.modules.get("matplotlib.pyplot")
    figure = sys.modules.get("matplotlib.figure")
    if pyplot is not None and figure is not None and isinstance(value, figure.Figure):
        pyplot.close(value)


class LinesView:
    """Labelled lines: rich outputs of a cell in rank order (rounds of display_id places)."""

    def __init__(self, shell: Any, ranks: list[int]):
        from IPython.display import publish_display_data

        self._shell = shell
        self._publish = publish_display_data
        self._ranks = list(ranks)
        self._shown: dict[int, int] = {}  # rank -> its rich outputs so far
        #: round n: rank -> (its label's display id, or None when the output labels itself; its place)
        self._rounds: list[dict[int, tuple[Optional[str], str]]] = []
        self._prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()

    def __call__(self, rank: int, bundle: Any) -> None:
        """A rich output of ``rank`` (display(obj), a figure), in its rank's place."""
        data, metadata = _split(bundle)
        n = self._shown.get(rank, 0)
        self._shown[rank] = n + 1
        if len(self._ranks) < 2 or rank not in self._ranks:
            self._put(rank, data, metadata, None, None)  # one rank: its order is its own
            return
        if n == len(self._rounds):
            self._rounds.append(self._open_round(_labels_itself(data)))
        label, place = self._rounds[n][rank]
        self._put(rank, data, metadata, label, place)

    def _open_round(self, labels_itself: bool) -> dict[int, tuple[Optional[str], str]]:
        places = {}
        for rank in self._ranks:
            label = None if labels_itself else self._empty()
            places[rank] = (label, self._empty())
        return places

    def _empty(self) -> str:
        display_id = f"mpify-{self._prefix}-{next(self._ids)}"
        self._publish({"text/plain": ""}, {}, transient={"display_id": display_id})
        return display_id

    def _put(self, rank: int, data: dict, metadata: dict, label: Optional[str], place: Optional[str]) -> None:
        plain = str(data.get("text/plain", ""))
        if _labels_itself(data):
            shown = {"text/plain": labelled(rank, plain)}
            if "text/html" in data:
                shown = dict(data, **shown)
                shown["text/html"] = f"<div><code>[rank {rank}]</code></div>{data['text/html']}"
            self._show(shown, metadata, place)
        elif label is not None or place is None:
            self._show({"text/plain": f"[rank {rank}]"}, {}, label)
            self._show(data, metadata, place)
        else:  # its round's places label themselves: label and output in one
            self._show(_with_label(rank, data), metadata, place)

    def _show(self, data: dict, metadata: dict, display_id: Optional[str]) -> None:
        if display_id is None:
            self._publish(data, metadata)
        else:
            self._publish(data, metadata, transient={"display_id": display_id}, update=True)

    def values(self, values: dict) -> None:
        """The last expression's value per rank, labelled, in rank order; rich values under their label."""
        formatter = self._shell.display_formatter
        lines: list[str] = []
        for rank, value in sorted(values.items(), key=lambda kv: -1 if kv[0] == "kernel" else kv[0]):
            if value is None:
                continue
            data, metadata = formatter.format(value)
            _forget_figure(value)
            label = f"[{rank}]" if rank == "kernel" else f"[rank {rank}]"
            if set(data) - {"text/plain"}:
                if lines:
                    self._publish({"text/plain": "\n".join(lines)})
                    lines = []
                self._publish({"text/plain": label})
                self._publish(data, metadata)
            else:
                text = data.get("text/plain", repr(value))
                lines.append(label + " " + text.replace("\n", "\n" + " " * (len(label) + 1)))
        if lines:
            self._publish({"text/plain": "\n".join(lines)})

    def error(self, error: BaseException) -> None:
        """Lines show a failed cell's error once, as the cell's own (nothing to add)."""


def _labels_itself(data: dict) -> bool:
    """Text, or HTML: the label goes inside the output itself."""
    return set(data) <= {"text/plain"} or "text/html" in data


def _with_label(rank: int, data: dict) -> dict:
    """An image (or other output) and its label in one output: HTML that shows both."""
    head = f"<div><code>[rank {rank}]</code></div>"
    for mime in ("image/png", "image/jpeg", "image/gif"):
        if mime in data:
            body = f'<img src="data:{mime};base64,{str(data[mime]).strip()}"/>'
            break
    else:
        body = data["image/svg+xml"] if "image/svg+xml" in data else \
            f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>"
    return dict(data, **{"text/html": head + body, "text/plain": labelled(rank, str(data.get("text/plain", "")))})


_CR = re.compile(r"[^\n]*\r(?=[^\r\n])")  # a line's text that a later \r redraws over


class TabsView:
    """One ipywidgets Tab per cell, an Output per rank (titles "rank k"), filled live."""

    def __init__(self, shell: Any, ranks: list[int]):
        self._shell = shell
        self._ranks = list(ranks)
        self._outputs: Optional[dict[int, Any]] = None
        self.tab: Any = None

    def _output(self, rank: int) -> Any:
        if self._outputs is None:
            import ipywidgets
            from IPython.display import display

            self._outputs = {r: ipywidgets.Output() for r in self._ranks}
            self.tab = ipywidgets.Tab(children=[self._outputs[r] for r in self._ranks],
                                      titles=[f"rank {r}" for r in self._ranks])
            display(self.tab)
        out = self._outputs.get(rank)
        if out is None:  # a rank the cell did not target (it should not happen): a tab of its own
            import ipywidgets

            out = self._outputs[rank] = ipywidgets.Output()
            self.tab.children = (*self.tab.children, out)
            self.tab.titles = (*self.tab.titles, f"rank {rank}")
        return out

    def _append(self, rank: int, item: dict) -> None:
        out = self._output(rank)
        out.outputs = (*out.outputs, item)

    def rank_streams(self, rank: int, name: str, text: str) -> None:
        """What ``rank`` wrote to its stdout/stderr, as it comes: one stream output per run of
        writes, redraws (``\\r``) folded, so its size stays that of what it shows."""
        out = self._output(rank)
        outputs = out.outputs
        if outputs and outputs[-1].get("output_type") == "stream" and outputs[-1].get("name") == name:
            merged = dict(outputs[-1], text=_CR.sub("", outputs[-1]["text"] + text))
            out.outputs = (*outputs[:-1], merged)
        else:
            out.outputs = (*outputs, {"output_type": "stream", "name": name, "text": _CR.sub("", text)})

    def __call__(self, rank: int, bundle: Any) -> None:
        data, metadata = _split(bundle)
        self._append(rank, {"output_type": "display_data", "data": data, "metadata": metadata})

    def values(self, values: dict) -> None:
        formatter = self._shell.display_formatter
        for rank, value in values.items():
            if value is None:
                continue
            data, metadata = formatter.format(value)
            _forget_figure(value)
            if rank == "kernel":
                from IPython.display import publish_display_data

                publish_display_data({"text/plain": "[kernel]"})
                publish_display_data(data, metadata)
                continue
            self._append(rank, {"output_type": "execute_result", "data": data, "metadata": metadata,
                                "execution_count": None})

    def error(self, error: BaseException) -> None:
        """Each failing rank's traceback in its tab too (the cell fails with the error as ever)."""
        for e in [error, *getattr(error, "others", [])]:
            ename = getattr(e, "exc_type", type(e).__name__)
            evalue = getattr(e, "exc_message", str(e).splitlines()[0] if str(e) else "")
            render = getattr(e, "_render_traceback_", None)
            traceback = render() if render is not None else [str(e)]
            for rank in getattr(e, "ranks", [getattr(e, "rank", None)]):
                if rank is not None:
                    self._append(rank, {"output_type": "error", "ename": ename, "evalue": evalue,
                                        "traceback": traceback})
