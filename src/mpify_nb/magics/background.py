"""Rank cells in the background: ``%%distributed --bg``, ``%%rank [k] --bg``, ``--after``,
``%dist_wait``, ``%dist_stop``.

::

    %%distributed --bg        the cell's code goes to the ranks as background work (Session.run,
    for step in ...:          wait=False): this cell returns at once; its ranks' output keeps
        ...                   coming here, live, while other cells run; at the end its values
                              (or its error) show here too
    %dist_pull losses         meanwhile: the ranks' variables as they are now (session/background.py)
    %%local                   meanwhile: the kernel's own cells
    %%distributed --after     a rank cell that waits for the ranks to be free first (a rank cell
                              without it is refused: RanksBusyError, saying which cell holds them)
    %dist_wait                wait for the work (the stop button stops the wait, not the work);
                              its error, if it failed, fails this cell too
    %dist_stop                stop it as the stop button stops a blocking cell: state kept

rank_cells.py runs a rank cell and hands its code here with ``--bg`` (``start``) and waits here
with ``--after`` (``wait_for_the_ranks``); the work a cell started is the SessionState's
``background`` (state.py), which %dist_wait and %dist_stop act on.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Optional

from ..engine.background import BackgroundWork, duration
from ..wire.errors import RankError
from .cell import rank_list, show_briefly
from .state import SessionState, usage

#: What a rank cell refused while background work holds the ranks says to do.
BUSY_HOW = ("%dist_wait waits for it, %dist_stop stops it (the ranks keep their state); a rank cell with "
            "--after runs once it ends (%%distributed --after), and %%local cells run meanwhile")


def wait_for_the_ranks(state: SessionState) -> None:
    """``--after``: wait until no background work holds the ranks (however it ends)."""
    s = state.session
    work = getattr(s, "_busy", None) if s is not None else None
    if work is None:
        return
    print(f"[mpify_nb] waiting for {work.label()} to end ({work.state()})", flush=True)
    try:
        concurrent.futures.wait([work])
    except KeyboardInterrupt as e:
        show_briefly(e, [f"KeyboardInterrupt: stopped waiting; {work.label()} goes on (%dist_stop stops it)"])
        raise


def start(state: SessionState, s: Any, source: str, ranks: Optional[list[int]], filename: str, view: Any,
          what: str, quiet: bool) -> None:
    """``--bg``: the cell's code to the ranks as background work; the cell returns at once."""
    work = state.call(lambda: s.run(source, ranks=ranks, timeout=state.timeout, filename=filename, display=view,
                                    wait=False))
    work.what = what
    state.background = work
    work.add_done_callback(lambda done: _show_outcome(done, view, quiet))
    print(f"[mpify_nb] running in the background on rank{'s' if len(work.ranks) > 1 else ''} "
          f"{rank_list(work.ranks)}: its output comes here; %dist_pull reads its variables meanwhile, "
          "%dist_wait waits for it, %dist_stop stops it")


def _show_outcome(work: BackgroundWork, view: Any, quiet: bool) -> None:
    """On the work's thread, in its cell: the values of its last expression, or its error in the
    view (tabs: in each failing rank's tab; the error itself is shown by engine/background.py)."""
    try:
        error = concurrent.futures.Future.exception(work)
        if error is None:
            values = work.result()
            if values and not quiet:
                view.values(values)
        elif isinstance(error, RankError):
            view.error(error)
    except Exception:
        pass  # the kernel is going away


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


@functools.cache
def background_magics_class() -> type:
    """Build the Magics class (on first use, not at import)."""
    from IPython.core.magic import Magics, line_magic, magics_class

    @magics_class
    class BackgroundMagics(Magics):
        """%dist_wait, %dist_stop: the background work a rank cell started."""

        def __init__(self, shell: Any, state: SessionState):
            super().__init__(shell)
            self.state = state

        @line_magic
        def dist_wait(self, line: str) -> None:
            """Wait until the background work on the ranks (``%%distributed --bg``) ends. Its error,
            if it failed, fails this cell too (its traceback is in the cell that started it). The
            stop button stops the wait; the work goes on (``%dist_stop`` stops it).

            Example::

                %dist_wait
            """
            if line.strip():
                raise usage("dist_wait", f"it takes no arguments, not {line.strip()!r}", "%dist_wait")
            work = self.state.background
            if work is None:
                print("Nothing runs in the background.")
                return
            try:
                work.result()
            except KeyboardInterrupt as e:
                if not work.done():
                    show_briefly(e)
                raise
            except BaseException as e:
                self.state.background = None
                brief = str(e).splitlines()[0] if str(e) else ""
                show_briefly(e, [f"{type(e).__name__}: {work.label()} failed" + (f": {brief}" if brief else "")
                                 + " (its traceback is in that cell)"])
                raise
            self.state.background = None
            print(f"{_sentence(work.label())} finished after {duration((work.ended or work.started) - work.started)}.")

        @line_magic
        def dist_stop(self, line: str) -> None:
            """Stop the background work on the ranks as the stop button stops a cell: every rank
            stops what it runs and keeps its state. Returns once they have stopped.

            Example::

                %dist_stop
            """
            if line.strip():
                raise usage("dist_stop", f"it takes no arguments, not {line.strip()!r}", "%dist_stop")
            work = self.state.background
            if work is None or work.done():
                print("Nothing runs in the background.")
                return
            if work.cancel():
                self.state.background = None
                print(f"Stopped {work.label()}: every rank stopped what it ran and keeps its state.")
            else:
                print(f"{_sentence(work.label())} had ended: {work.state()}.")

    return BackgroundMagics
