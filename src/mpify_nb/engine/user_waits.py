"""Where ranks wait for the notebook's user, and for how long: a rank that reads its stdin
(``input()``, text pdb: engine/prompts.py's Prompter asks the frontend) or that is held at a
breakpoint of the frontend's debugger (``pause``/``unpause``, told by debugger/threads.py).

While a rank waits for the user, a call's time limit does not run (``time_left``), and a peer
waiting on it in a collective is no mistake (``waiting``: engine/watch.py asks)::

    ASK from rank k ── ask(k, prompt, reply) ──> Prompter ── the frontend's input prompt
    the loop's wake ── take_answers() ──> reply(answer) ──> ANSWER to rank k
    debugger: rank k stopped ── pause(k) ... continued ── unpause(k)
    the call's loop ── time_left(deadline): the deadline moved by the time spent waiting
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from . import prompts


class UserWaits:
    """One engine's ranks waiting for the user: its prompts and its paused ranks, per call."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.prompter: Optional[prompts.Prompter] = None
        #: refusal(rank): why no one can answer this call's prompts (it runs in the background:
        #: engine/background.py); None: they are asked of the user
        self.refusal: Optional[Callable[[int], str]] = None
        self._pause_lock = threading.Lock()
        self._paused: set[int] = set()  # ranks held at a debugger's breakpoint now
        self._paused_since: Optional[float] = None
        self._paused_total = 0.0  # this call's seconds with some rank paused

    # -- a rank reads its stdin --------------------------------------------------------------

    def open_prompts(self) -> None:
        """Make this call's prompter now, on the thread that runs the cell (the frontend is
        found there); else it is made at the first prompt, in the loop."""
        self.prompter = prompts.Prompter(self._wake)

    def ask(self, rank: int, prompt: str, reply: Callable[[Any], None]) -> None:
        """Rank ``rank`` reads its stdin: ask the user; ``reply(answer)`` from the loop."""
        refusal = self.refusal
        if refusal is not None:  # its read raises StdinUnavailableError, saying why
            reply((prompts.UNAVAILABLE, refusal(rank)))
            return
        if self.prompter is None:
            self.open_prompts()
        assert self.prompter is not None
        self.prompter.ask(rank, prompt, reply)

    def take_answers(self) -> list[tuple[Callable[[Any], None], Any]]:
        """The answers the user gave since the last look, each with its reply (on the loop's thread)."""
        return self.prompter.take_answers() if self.prompter is not None else []

    def close_prompts(self) -> None:
        """No one answers this call's prompts any more: the reads still waiting are ended
        (a rank at a prompt reads KeyboardInterrupt, then end of file)."""
        if self.prompter is None:
            return
        for reply, answer in self.prompter.close():
            reply(answer)

    # -- a rank held at a breakpoint ---------------------------------------------------------

    def new_call(self) -> None:
        """A call starts: nothing is paused yet, and no time is given back."""
        with self._pause_lock:
            self._paused.clear()
            self._paused_since, self._paused_total = None, 0.0

    def pause(self, rank: int) -> None:
        """Rank ``rank`` stopped at a breakpoint: it waits for the user (time_left)."""
        with self._pause_lock:
            if not self._paused:
                self._paused_since = time.monotonic()
            self._paused.add(rank)

    def unpause(self, rank: int) -> None:
        with self._pause_lock:
            if rank not in self._paused:
                return
            self._paused.discard(rank)
            if not self._paused and self._paused_since is not None:
                self._paused_total += time.monotonic() - self._paused_since
                self._paused_since = None

    def paused_for(self) -> float:
        """Seconds of this call during which some rank was paused at a breakpoint."""
        with self._pause_lock:
            since = self._paused_since
            return self._paused_total + (time.monotonic() - since if since is not None else 0.0)

    # -- the call's clock --------------------------------------------------------------------

    def time_left(self, deadline: Optional[float]) -> Optional[float]:
        """Seconds until ``deadline``, time spent waiting for the user (a pdb prompt, a rank held
        at a breakpoint) not counted; None without a deadline, or while a rank waits for the user."""
        prompter = self.prompter
        if deadline is None or self.waiting():
            return None
        waited = (prompter.waited() if prompter is not None else 0.0) + self.paused_for()
        return deadline + waited - time.monotonic()

    def waiting(self, rank: Optional[int] = None) -> bool:
        """Does ``rank`` (None: any rank) wait for the user now: at an input prompt (text pdb,
        input()) or held at a breakpoint of the frontend's debugger? Its peers waiting for it
        in a collective are no mistake then, and the call's time does not run."""
        prompter = self.prompter
        if prompter is not None and prompter.waiting and (rank is None or rank in prompter.asking()):
            return True
        with self._pause_lock:
            return bool(self._paused) if rank is None else rank in self._paused
