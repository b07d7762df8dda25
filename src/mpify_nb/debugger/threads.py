"""Which threads are stopped, across the kernel and the ranks, and the events that tell the frontend.

JupyterLab clears its call stack and variables at any ``continued`` event and shows the thread of
the last ``stopped`` one. So the frontend gets one event per change, in an order that keeps the
panel on the thread the user works with::

    a stop (kernel or rank)          -> stopped {threadId: global}; the rank's engine is paused
                                        (its peers waiting for it are no error, timeout= stops)
    the user resumes (continue/next)  -> one continued, at once, for every thread resumed; the
                                        ranks' own continued events that follow are dropped
    a thread resumes on its own       -> continued (the stop button let a rank go, say)
    a rank dies or is restarted       -> continued (if it was stopped), then thread exited
    after "next" on rank 1 with rank 0 stopped too: rank 0's new stop is held back (at most
                                        FOCUS_WAIT) until rank 1's, or rank 1's is shown again after
                                        it, so the panel stays on rank 1

A rank's messages travel in order on its channel, so its continued always arrives before its
next stop: a late continued can never wipe the panel after a stop.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Optional

from .links import untraced

#: How long stops of other threads wait for the thread the user stepped or continued.
FOCUS_WAIT = 1.0


class Threads:
    """Stopped threads by global id, each with its source (None: the kernel; else a RankLink)."""

    def __init__(self, send_event: Callable[[dict], None]):
        self._send_event = send_event
        self._seq = itertools.count(1)
        self._lock = threading.RLock()
        self._stopped: dict[int, tuple[Any, dict]] = {}  # in the order they stopped
        self._focus: Optional[int] = None
        self._focus_until = 0.0
        self._held: list[int] = []  # stops held back for the focus
        self._timer: Optional[threading.Timer] = None

    # -- what is stopped ---------------------------------------------------------------------

    def is_stopped(self, thread: Any) -> bool:
        with self._lock:
            return thread in self._stopped

    def stopped(self, source: Any = ...) -> list[int]:
        """Global ids of the stopped threads (of ``source`` only, when given), oldest first."""
        with self._lock:
            return [g for g, (s, _body) in self._stopped.items() if source is ... or s is source]

    # -- changes -------------------------------------------------------------------------------

    def on_stopped(self, source: Any, thread: int, body: dict) -> None:
        """``thread`` (a global id) stopped; ``body`` is its stopped event's, renumbered."""
        body = dict(body, threadId=thread)
        after = None
        with self._lock:
            self._stopped.pop(thread, None)
            self._stopped[thread] = (source, body)
            if source is not None:
                source.engine.user_waits.pause(source.rank)
            focus = self._focus if time.monotonic() < self._focus_until else None
            if focus is not None and thread != focus:
                if focus not in self._stopped:  # shown once the focus stops (or its time is up)
                    self._held.append(thread)
                    return
                after = focus  # the focus stopped first: shown again, last, so the panel stays there
            release = self._take_held() if thread == focus else []
        for held in release:
            self._publish_stop(held)
        self.event("stopped", body)
        if after is not None:
            self._publish_stop(after)

    def _announce_continued(self, resumed: list[int], requested: Optional[int], remaining: bool) -> list[int]:
        if resumed:
            thread = requested if requested in resumed else resumed[0]
            self.event("continued", {"threadId": thread, "allThreadsContinued": not remaining})
        return resumed

    def resume(self, threads: list[int], requested: Optional[int] = None) -> list[int]:
        """``threads`` are let go (by the user, the stop button, a death): unpause their ranks,
        one continued event. Returns those that were stopped."""
        resumed: list[int] = []
        with self._lock:
            for g in threads:
                entry = self._stopped.pop(g, None)
                if entry is None:
                    continue
                resumed.append(g)
                source = entry[0]
                if source is not None and not any(s is source for s, _b in self._stopped.values()):
                    source.engine.user_waits.unpause(source.rank)
            remaining = bool(self._stopped)
        return self._announce_continued(resumed, requested, remaining)

    def focus(self, thread: int) -> None:
        """The user resumed ``thread``: other threads' stops wait a little for its next one."""
        with self._lock:
            self._focus, self._focus_until = thread, time.monotonic() + FOCUS_WAIT
            if self._timer is not None:
                self._timer.cancel()
            self._timer = untraced(threading.Timer(FOCUS_WAIT, self._focus_over))  # the kernel may be stopped
            self._timer.daemon = True
            self._timer.start()

    def unfocus(self) -> None:
        """A new call starts: the last one's focus means nothing to its stops (held ones are shown)."""
        with self._lock:
            self._focus = None
            release = self._take_held()
        for held in release:
            self._publish_stop(held)

    def republish_latest(self) -> None:
        """Some threads stay stopped after others resumed: show the latest (JupyterLab shows the
        thread of the last stop, and cleared its panel at the continued)."""
        with self._lock:
            latest = next(reversed(self._stopped), None) if self._stopped else None
        if latest is not None:
            self._publish_stop(latest)

    def exited(self, source: Any, threads: list[int]) -> None:
        """``source`` is gone: its stopped threads continue, then every thread of it exits."""
        self.resume([g for g in threads if self.is_stopped(g)])
        with self._lock:
            self._held = [g for g in self._held if g not in threads]
            release = self._take_held() if self._focus in threads else []
        for held in release:
            self._publish_stop(held)
        for g in threads:
            self.event("thread", {"reason": "exited", "threadId": g})

    def clear(self) -> None:
        with self._lock:
            self._stopped.clear()
            self._held = []
            self._focus = None

    def event(self, name: str, body: dict) -> None:
        self._send_event({"type": "event", "event": name, "body": body, "seq": next(self._seq)})

    # -- inside ----------------------------------------------------------------------------------

    def _take_held(self) -> list[int]:
        held, self._held = self._held, []
        return held

    def _focus_over(self) -> None:
        with self._lock:
            if time.monotonic() < self._focus_until - 0.01:
                return  # a newer focus has its own timer
            self._focus = None
            release = self._take_held()
        for held in release:
            self._publish_stop(held)

    def _publish_stop(self, thread: int) -> None:
        with self._lock:
            entry = self._stopped.get(thread)
        if entry is not None:
            self.event("stopped", entry[1])
