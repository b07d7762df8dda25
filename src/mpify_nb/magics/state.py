"""What the session magics share: the one Session they drive and how its cells run, held in one
object that every group of magics is given (session.py makes it and registers the groups)::

    SessionState ── session      the Session of %dist_init (None before it, after %dist_reset)
                 ── timeout      %dist_init --timeout: each cell's time limit
                 ── view         "lines" or "tabs" (%dist_view)
                 ── router       automatic mode's input transformer (router.py)
                 ── ipython_debug  IPython's own %debug, while the failed rank's stands in for it
                 ── background   the background work a rank cell started (--bg), for %dist_wait
                                 and %dist_stop (background.py)

It also says how a session magic fails: ``require`` (no ranks running), ``usage`` (a bad line),
``call`` (a Session call whose error reads as the user's, not as the library's frames).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..engine.background import RanksBusyError
from ..wire.errors import PayloadError
from .cell import show_briefly

_INTERRUPTED = ("KeyboardInterrupt: the cell was interrupted; every rank stopped what it ran "
                "and keeps its state")


def usage(magic: str, message: str, usage_line: str = ""):
    """A session magic's usage error (IPython shows it without a traceback)."""
    from IPython.core.error import UsageError

    tail = f"\nusage: {usage_line}" if usage_line else ""
    return UsageError(f"%{magic}: {message}{tail}\n(see %{magic}? for help)")


class SessionState:
    """The session magics' shared state (see the module's docstring)."""

    def __init__(self, router: Any) -> None:
        self.session: Any = None
        self.timeout: Optional[float] = None
        #: how persistent cells show their output: "lines" or "tabs" (%dist_view)
        self.view = "lines"
        self.router = router  # router.py's CellRouter
        self.ipython_debug: Optional[Callable[[str], Any]] = None  # IPython's own %debug
        self.background: Any = None  # the BackgroundWork a rank cell started, until %dist_wait told its end

    def require(self, magic: str):
        """The running Session; a usage error for ``%magic`` when no ranks run."""
        if self.session is None or self.session.closed:
            from IPython.core.error import UsageError

            raise UsageError(f"%{magic}: no ranks are running: %dist_init -n N starts them")
        return self.session

    def call(self, fn: Callable[[], Any]) -> Any:
        """A session call; an interrupt reads as one, other errors keep their own display."""
        try:
            return fn()
        except KeyboardInterrupt as e:
            show_briefly(e, [_INTERRUPTED])
            raise
        except TimeoutError as e:
            show_briefly(e)
            raise
        except (NameError, PayloadError, RanksBusyError) as e:  # the message says it all
            show_briefly(e)
            raise
