"""The collective watch: a capability of every engine, for ``ranch`` and ``Session`` alike.

While a call runs, the watch looks at its ranks now and then and asks engine/verdict.py whether
the call can still finish. Time only decides when to look (and, for a wait nothing numbers, when a
rank that returned is surely gone: ``SETTLE``); what the looks say decides::

    the use's loop (ranch's watch thread,                      each rank
    a Session's call thread)
    ───────────────────────────────────                        ─────────
    wait = watch.tick() ─── LOOK round ─────────────────────>  control thread (rank/control.py):
    engine.pump(wait)   <── SEEN round, Snapshot ───────────   torchdist/waits.py's snapshot
                        <── RETURNED Snapshot (ranch) ──────   fn returned, its group still up
    the caller's own rank (ranch's rank 0, the notebook): looked at here, in this process
    round complete: verdict.judge(...) ──> watch.verdict ──> the use ends the call: CollectiveError
                    the live line "waiting 12 s: rank 0 in all_reduce #5 (line 3); rank 1 running line 7"

When: first ``LOOK_AFTER`` into a call, then every ``LOOK_EVERY``; ``LOOK_LEFT`` after a rank
left the call while others run (a peer that may never come), then every ``LOOK_FAST``;
``LOOK_SOON`` after a look that found ranks blocked (the deadlock rule wants two looks alike).
Between looks nothing of ours runs in the ranks: a training loop that does not hang pays one
look a second (~0.3 ms a rank).
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable, Optional

from ..torchdist.waits import Snapshot
from ..wire.protocol import LOOK, RETURNED, SEEN
from . import verdict as verdicts

#: Seconds into a call before its first look; most calls are over by then.
LOOK_AFTER = 0.5
#: Then a look this often.
LOOK_EVERY = 1.0
#: Once a rank has left the call while others still run it: a first look this soon (most ranks
#: finish within a moment of each other), then every LOOK_FAST while it lasts.
LOOK_LEFT = 0.25
LOOK_FAST = 0.05
#: After a look that found ranks blocked in torch.distributed calls: a second look confirms.
LOOK_SOON = 0.2
#: A rank that has not answered a look within this is left out of that round.
ANSWER_WITHIN = 1.0
#: The live line appears once a rank has waited this long in a collective.
LINE_AFTER = 5.0
#: A rank that left the call having done its part (returned from fn, finished the cell) counts as
#: absent from a wait nothing numbers (gloo before torch 2.8; a wait seen by its frame alone) only
#: in looks begun this long after the watch saw it leave: a peer wakes from the collective a moment
#: after the rank that left returned from it, and on a loaded machine (CI's floor) that moment
#: outlasted LOOK_LEFT. Such an absence is told this late; a rank that raised or died, at once.
SETTLE = 2.0


class Watch:
    """One engine's collective watch (installed on every engine: ``engine.watch``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        engine.on(SEEN, self._on_seen)
        engine.on(RETURNED, self._on_returned)
        self.cond = threading.Condition()
        self.active = False
        self.world = 0
        self.members: Callable[[], list] = list  # the live ranks to look at (engine Members)
        self.own: Optional[Callable[[bool], Optional[Snapshot]]] = None  # the caller's own rank, looked at here
        self.own_rank: Optional[int] = None
        self.absent: Callable[[], dict[int, str]] = dict  # {rank: why it left the call}
        self.snaps: dict[int, Snapshot] = {}
        self.previous: dict[int, Snapshot] = {}
        self.last_round: dict[int, Snapshot] = {}  # the latest complete round's looks
        self.latest: dict[int, Snapshot] = {}  # each rank's latest answer in this call, whatever its round
        self.first_round = 1
        self.kept: dict[int, Snapshot] = {}  # snapshots of ranks that left (RETURNED, a last look)
        self.verdict: Optional[verdicts.Verdict] = None
        self.round = 0
        self.asked: set[int] = set()
        self.with_stack = False
        self.round_started = 0.0
        self.next_look = float("inf")
        self.rounds_done = 0
        self.wanted_stack = False  # where() asked for a round with stacks
        self.line_shown = False
        self.first_seen: dict[tuple[int, Any], float] = {}  # (rank, op) -> when first seen waiting
        self.left_at: dict[int, float] = {}  # rank -> when the watch first saw it absent from the call

    # -- a call ---------------------------------------------------------------------------------

    def begin(self, world: int, members: Callable[[], list], absent: Callable[[], dict[int, str]],
              own: Optional[Callable[[bool], Optional[Snapshot]]] = None, own_rank: Optional[int] = None) -> None:
        """A call starts: look at ``members()`` (and ``own``, this process's own rank) from
        ``LOOK_AFTER`` on; ``absent()`` says which ranks have left it, and why."""
        with self.cond:
            self.active = True
            self.world, self.members, self.absent, self.own, self.own_rank = world, members, absent, own, own_rank
            self.snaps, self.previous, self.kept, self.last_round, self.latest = {}, {}, {}, {}, {}
            self.first_round = self.round + 1  # answers to rounds before it are an earlier call's
            self.verdict = None
            self.asked = set()
            self.rounds_done = 0
            self.first_seen = {}
            self.left_at = {}
            self.next_look = time.monotonic() + LOOK_AFTER

    def end(self) -> None:
        """The call is over: no more looks; the live line goes."""
        with self.cond:
            self.active = False
            self.asked = set()
            self.next_look = float("inf")
            self.cond.notify_all()
        if self.line_shown:
            self.line_shown = False
            self.engine.relay.status(None)

    def soon(self) -> None:
        """A rank left the call (returned, finished, raised): look again shortly."""
        self.next_look = min(self.next_look, time.monotonic() + LOOK_LEFT)

    def returned(self, rank: int, snap: Optional[Snapshot]) -> None:
        """Rank ``rank``'s function returned; ``snap``: what it had issued (its groups still up)."""
        if snap is not None:
            self.kept[rank] = snap
        self.soon()

    # -- the use's loop -------------------------------------------------------------------------

    def tick(self) -> Optional[float]:
        """Look when a look is due; judge a round once every rank answered. Returns seconds
        until the watch wants to run again (None: not before something happens)."""
        if not self.active:
            return None
        now = time.monotonic()
        if self.asked and now >= self.round_started + ANSWER_WITHIN:
            self._finish_round(now)
        if not self.asked and (now >= self.next_look or self.wanted_stack):
            self._start_round(now, stack=self.wanted_stack)
            if not self.asked:
                self._finish_round(now)
        due = self.round_started + ANSWER_WITHIN if self.asked else self.next_look
        return max(0.0, due - time.monotonic())

    def look_now(self, pump: Callable[[float], None], stack: bool = False, within: float = 0.5) -> dict[int, Snapshot]:
        """A round now, waited for (at most ``within`` seconds): the ranks' snapshots. For the
        use's own loop (timeouts, the stop button): it pumps the engine with ``pump``. Without
        stacks, a rank that did not answer in time is where its latest answer in this call saw it,
        rather than nowhere (a rank whose main thread spins in Python answers slowly: its control
        thread takes the interpreter's lock once per switch interval, 5 ms, at each of its reads)."""
        now = time.monotonic()
        if self.asked:
            self._finish_round(now)
        self._start_round(now, stack=stack)
        earlier = {r: snap for r, snap in self.latest.items() if r in self.asked} if not stack else {}
        deadline = now + within
        while self.asked and time.monotonic() < deadline:
            pump(max(0.0, min(0.05, deadline - time.monotonic())))
        self._finish_round(time.monotonic())
        return {**earlier, **self.snaps}

    def look_for(self, stack: bool = True, within: float = 1.5) -> dict[int, Snapshot]:
        """From a thread other than the loop's (``BackgroundWork.where()``): a round of looks at the
        loop's next turn, with stacks, waited for at most ``within`` seconds while the call goes on;
        ``{}`` when the call is over or no round completed in time."""
        with self.cond:
            if not self.active:
                return {}
            wanted = self.rounds_done + (2 if self.asked else 1)  # a round under way has no stacks
            self.wanted_stack = stack
        self.engine.wake()
        with self.cond:
            self.cond.wait_for(lambda: self.rounds_done >= wanted or not self.active, timeout=within)
            return dict(self.last_round) if self.rounds_done >= wanted else {}

    def where_text(self, short: bool = False, snaps: Optional[dict[int, Snapshot]] = None) -> str:
        """Where each rank of the call is, from the latest complete round of looks (or ``snaps``):
        verdict.where_text's words; "" before the first look."""
        snaps = dict(self.last_round if snaps is None else snaps)
        if not snaps:
            return ""
        gone: dict[int, str] = {}
        for rank, why in self.absent().items():
            snaps.pop(rank, None)
            gone[rank] = why
        return verdicts.where_text(snaps, time.time_ns(), self.at_user(), short=short, gone=gone)

    def at_user(self) -> frozenset:
        """The ranks that wait for the user now: at a prompt, or held at a debugger's breakpoint."""
        return frozenset(r for r in range(self.world) if self.engine.user_waits.waiting(r))

    # -- rounds ---------------------------------------------------------------------------------

    def _start_round(self, now: float, stack: bool = False) -> None:
        self.round += 1
        self.round_started = now
        self.with_stack = stack
        self.wanted_stack = False
        self.previous, self.snaps = self.snaps, {}
        self._note_left(now)
        body = pickle.dumps({"stack": True}) if stack else b""
        asked = set()
        for m in self.members():
            if self.engine.send_control(m, LOOK, self.round, body):
                asked.add(m.rank)
        with self.cond:
            self.asked = asked
        if self.own is not None and self.own_rank is not None:
            snap = self.own(stack)
            if snap is not None:
                self.snaps[self.own_rank] = snap

    def _on_seen(self, m: Any, req: int, body: Any, fds: list) -> None:
        try:
            snap: Optional[Snapshot] = pickle.loads(body)
        except Exception:
            snap = None
        if snap is not None and self.first_round <= req <= self.round and self.active:
            self.latest[m.rank] = snap  # a late answer still says where the rank was a moment ago
        if req != self.round or m.rank not in self.asked:
            return  # an answer to a round given up on
        if snap is not None:
            self.snaps[m.rank] = snap
        with self.cond:
            self.asked.discard(m.rank)
        if not self.asked:
            self._finish_round(time.monotonic())

    def _on_returned(self, m: Any, req: int, body: Any, fds: list) -> None:
        try:
            snap = pickle.loads(body)
        except Exception:
            snap = None
        self.returned(m.rank, snap)

    def _finish_round(self, now: float) -> None:
        with self.cond:
            self.asked = set()
            self.rounds_done += 1
            self.last_round = dict(self.snaps)
            self.cond.notify_all()
        if not self.active:
            return
        absent = self._note_left(now)
        settled = {r for r, why in absent.items()
                   if why not in verdicts.LEFT_DONE or self.round_started - self.left_at[r] >= SETTLE}
        snaps = dict(self.snaps)
        kept = dict(self.kept)  # the caller's own rank may add to it meanwhile (ranch)
        for rank, snap in kept.items():
            snaps.setdefault(rank, snap)
        for rank in absent:
            if rank in kept:
                snaps[rank] = kept[rank]
        # A rank that waits for the user (a prompt, a debugger's breakpoint) is no hang: its
        # peers wait for it as the cell does, and no verdict is given until it goes on.
        if self.verdict is None and not self.engine.user_waits.waiting():
            self.verdict = verdicts.judge(snaps, self.world, absent, self.previous, settled)
        running = {r: s for r, s in self.snaps.items() if r not in absent}
        blocked = any(s.blocked is not None for s in running.values())
        if any(r in absent for r in range(self.world)) and running:
            wait = LOOK_FAST
        elif blocked:
            wait = LOOK_SOON if self.rounds_done % 4 else LOOK_EVERY  # not forever: a long hang
        else:
            wait = LOOK_EVERY
        self.next_look = now + wait
        self._draw_line(running, now)

    def _note_left(self, now: float) -> dict[int, str]:
        """The ranks absent from the call now; when first seen so is kept in ``left_at``."""
        absent = self.absent()
        for rank in absent:
            self.left_at.setdefault(rank, now)
        return absent

    def waited(self, running: dict[int, Snapshot], now: float) -> float:
        """The longest a running rank has waited in the same collective, as the looks saw it."""
        longest = 0.0
        seen = {}
        for rank, snap in running.items():
            op = snap.blocked or next(iter(snap.pending), None)
            if op is None:
                continue
            key = (rank, op)
            seen[key] = self.first_seen.get(key, now)
            longest = max(longest, now - seen[key])
        self.first_seen = seen
        return longest

    def _draw_line(self, running: dict[int, Snapshot], now: float) -> None:
        waited = self.waited(running, now)
        if waited >= LINE_AFTER and self.verdict is None:
            self.line_shown = True
            self.engine.relay.status(f"waiting {waited:.0f} s: {self.where_text(short=True)}")
        elif self.line_shown:
            self.line_shown = False
            self.engine.relay.status(None)
