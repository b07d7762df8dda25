"""How one ranch call ends: the first failure wins, and it is the root cause.

Ranks usually fail together: one raises or dies, and its peers fail because it left (gloo's
"Connection closed by peer"). Of several rank failures the earliest, by the machine-wide
monotonic clock, is the root cause; the others go to its ``.others``. The first failure
recorded stops the call: every rank is killed, the caller's own rank stopped. An error that may
be the echo of something not heard yet (a death seen late, through a link to another host; a
peer that returned without joining the collective it was raised in) is held a moment first::

    FAIL, a death, the own rank's error ── fail(error) ──> the root cause (the first: stop all)
    an error that may be an echo ── hold(error, patience) ... the call's loop, when it is due
        or every peer answered ── release(explain) ──> fail(explain(error))  (launcher/watched.py)
    the stop button ── stopped_by_user()
    the call's end ── raise_if_failed(): KeyboardInterrupt, or the root cause
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from ..wire.errors import RankError


class Outcome:
    """One call's failures and the user's stop, under the call's one lock (``cond``)."""

    def __init__(self, stop_everything: Callable[[], None], wake: Callable[[], None]) -> None:
        self.cond = threading.Condition()
        self.root: Optional[BaseException] = None  # the root cause so far
        self.failed_ranks: set[int] = set()  # ranks that sent an error
        # A rank's error held while a rank whose death is seen late (on another host) may have died
        # first: the error may be its echo ("Connection closed by peer"). (error, held until when)
        self.held: Optional[tuple[BaseException, float]] = None
        self.interrupted = False  # the user pressed stop (SIGINT)
        self._stop_everything = stop_everything  # at the first failure: kill every rank, stop our own
        self._wake = wake  # the call's loop, to release what is held

    @property
    def over(self) -> bool:
        """The call failed, or the user stopped it."""
        return self.root is not None or self.interrupted

    def fail(self, error: BaseException) -> None:
        """Record a failure. The first one stops the call; of several rank failures the
        earliest (by the machine-wide monotonic clock) is the root cause, the others
        (usually peers that lost it) go to its ``.others``."""
        with self.cond:
            first = self.root is None
            if first:
                self.root = error
            elif isinstance(self.root, RankError) and isinstance(error, RankError):
                if error.when < self.root.when:
                    error.others = [self.root, *self.root.others]
                    self.root.others = []
                    self.root = error
                else:
                    self.root.others.append(error)
            self.cond.notify_all()
        if first:
            self._stop_everything()

    def hold(self, error: BaseException, patience: float) -> bool:
        """Hold a rank's error ``patience`` seconds (the call's loop releases it); False when
        another is held already, or the call has failed."""
        with self.cond:
            if self.root is not None or self.held is not None:
                return False
            self.held = (error, time.monotonic() + patience)
        self._wake()
        return True

    def release(self, explain: Callable[[BaseException], BaseException]) -> None:
        """The held error, if any, is recorded now, as ``explain`` tells it."""
        if self.held is not None:
            error, self.held = self.held[0], None
            self.fail(explain(error))

    def wait_for_news(self, patience: float) -> None:
        """Wait up to ``patience`` seconds for a failure, or the stop button."""
        with self.cond:
            self.cond.wait_for(lambda: self.over, timeout=patience)

    def stopped_by_user(self) -> None:
        with self.cond:
            self.interrupted = True
            self.cond.notify_all()

    def raise_if_failed(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        if self.root is not None:
            raise self.root
