"""A Session's calls: send one request to the ranks, wait for every answer, stop it when asked.

One call at a time (a lock); its wait loop is the engine's pump, with the timeout (time a rank
waits for the user not counted), the stop button and the collective watch (engine/watch.py;
what the Session does about a verdict: session/recovery.py) between its turns. The public calls
that use it are session/session.py's.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

from ..engine import background, checked, interrupts
from ..engine import verdict as verdicts
from ..torchdist.checks import wrappers
from ..wire import payload, shm
from ..wire.errors import CollectiveError, RankError, RankExitedError, SessionClosedError, merge_rank_errors
from ..wire.protocol import APPLY, CHECKS, COMM, DONE, NO_REQUEST, RUN
from .ranks import Member, failure_of
from .recovery import SessionRecovery

Ranks = Union[int, Iterable[int], None]


class SessionCalls(SessionRecovery):
    """A Session's one call at a time."""

    interrupt: Callable[[], None]  # session.py's public calls: what stops a call, where its ranks are
    where: Callable[[float], Any]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # The engine's loop is this call's: a capability's thread (the debugger's) pumps it
        # between calls only, through engine.pump_idle().
        self._call_lock = self._engine.loop_lock
        self._flag_lock = threading.Lock()
        self.timeout: Optional[float] = None  # the default time limit of a call
        #: the error the last failed call raised (debug() starts at its root-cause rank)
        self.last_error: Optional[RankError] = None
        # where() from another thread while a call runs: the call's loop looks, and says when done
        self._where_asked = threading.Event()
        self._where_done = threading.Event()
        self._where_seen: dict[int, Any] = {}
        self._checks_sent = wrappers.enabled()  # the collective check, as the ranks start with it
        #: the background work that holds the ranks (session/background.py): other calls are refused
        self._busy: Optional[background.BackgroundWork] = None

    #: What a call refused while background work holds the ranks says to do (the magics say
    #: %dist_wait and %dist_stop).
    busy_how = "its .result() waits for it, its .cancel() stops it (the ranks keep their state)"

    def _refuse_if_busy(self) -> None:
        """Background work holds the ranks (and this is not its thread): RanksBusyError, which
        says which work, since when, and how to wait for it or stop it."""
        work = self._busy
        if work is not None and work is not background.current():
            ranks = work.ranks
            who = f"rank {ranks[0]} runs" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} run"
            raise background.RanksBusyError(
                f"{who} {work.label()} ({work.state()}): this call would wait for it or interleave with "
                f"it, so it was not sent; {self.busy_how}", work)

    def _targets(self, ranks: Ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        out = sorted(set(int(r) for r in ranks))  # type: ignore[union-attr]
        bad = [r for r in out if not 0 <= r < self.world_size]
        if bad or not out:
            raise ValueError(f"ranks must be in 0..{self.world_size - 1}, not {bad or 'none'}")
        return out

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("this Session is closed; start a new one")


    def _call(self, kind: bytes, body: bytes, fds: list[int], ranks: Ranks, timeout: Optional[float],
              display: Optional[Callable[[int, dict], None]], label: Optional[str]) -> dict[int, Any]:
        if kind in (RUN, APPLY) and self._checks_sent != wrappers.enabled():
            self._send_checks()
        if timeout is None:
            timeout = self.timeout
        check_timeout(timeout)
        targets = self._targets(ranks)
        self._check_open()
        self._refuse_if_busy()
        with self._call_lock, interrupts.presses.during_call():
            self._check_open()
            self._notice_deaths()
            dead = [self._members[r] for r in targets if not self._members[r].alive]
            if dead:
                raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])
            self._await_aborts()  # an earlier cell's abort, done before this cell's group can be made
            if self._group_broken:
                self._rebuild()  # an earlier rebuild failed (or waited for a rank): try again now
            req = next(self._ids)
            members = [self._members[r] for r in targets]
            self._display = display
            with self._flag_lock:
                self._current, self._interrupt_asked = req, False
            work = background.current()
            if work is None:
                restore = interrupts.take_sigint(self._on_sigint, self)
            else:  # background work: its handle stops it (interrupt()), the stop button the cell's
                restore = _nothing
                work.attach(self._engine, self.interrupt, self.where)
            garbage = shm.garbage_mark()
            # a per-rank view takes the ranks' streams (magics/views.py)
            self._engine.relay.retarget(sys.stdout, sys.stderr, getattr(display, "rank_streams", None))
            self._engine.user_waits.prompter = None  # made at the first prompt: most calls have none
            try:
                self._engine.starting_call(members)  # capabilities first (the debugger attaches new ranks)
                for m in members:
                    self._send_request(m, kind, req, body, fds, label)
                self._begin_watch(req, members)
                if len(members) < len(self._members):
                    self._engine.watch.soon()  # ranks outside the call: a collective may wait for them
                values = self._wait(members, req, timeout)
                shm.drop_import_garbage(garbage)
                return values
            except RankError as e:
                self.last_error = e
                raise
            finally:
                if work is not None:
                    work.detach()  # before the ranks are free: the next call's prompts are its own
                self._engine.watch.end()
                self._engine.ended_call(members)  # capabilities: what the ranks sent as it ended
                self._engine.user_waits.close_prompts()
                with self._flag_lock:
                    self._current = NO_REQUEST
                restore()
                self._engine.relay.end_call([fd for m in self._members.values() for fd in m.out_fds])
                self._display = None

    def _send_checks(self) -> None:
        """set_collective_checks() changed since the last cell: every live rank learns it first
        (the ranks of a group must agree; a rank restarted later reads it from its environment)."""
        on = wrappers.enabled()
        live = [m.rank for m in self._members.values() if m.alive]
        if live:
            self._call(CHECKS, pickle.dumps(on), [], live, None, None, None)
        self._checks_sent = on

    def _comm_to_rank(self, rank: int, frame: dict) -> None:
        """A frontend's message to a widget of ``rank``: handled there like a tiny cell (output
        relayed, the stop button reaches it). While a call runs on another thread, it is only
        queued: the rank handles it after that call, and its answer is dropped."""
        m = self._members.get(rank)
        if self.closed or m is None or not m.alive:
            return
        body = pickle.dumps(frame)
        if not self._call_lock.acquire(blocking=False):
            self._engine.send(m, COMM, next(self._ids), body)
            return
        self._call_lock.release()
        self._call(COMM, body, [], [rank], None, self._comms.show, None)

    def _wait(self, members: list[Member], req: int, timeout: Optional[float]) -> dict[int, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = self._engine.watch
        running = len(members)
        try:
            while True:
                dead = [m for m in members if not m.alive]
                if dead and self.closed:
                    raise SessionClosedError("the Session was closed while this call ran")
                if dead:
                    self._stop(members, req, peer_died=True)
                    raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])
                still = sum(m.req == req for m in members)
                if not still:
                    break
                if still < running:
                    running = still
                    watch.soon()  # a rank finished: one still running may wait for it in a collective
                if self._interrupt_asked:
                    raise KeyboardInterrupt
                wait = self._engine.user_waits.time_left(deadline)  # time a rank waits for the user is not the call's
                if wait is not None and wait <= 0:
                    assert timeout is not None  # a deadline comes from it
                    running_ranks = [m.rank for m in members if m.req == req]
                    where = self._where(req)
                    self._stop(members, req)
                    raise TimeoutError(_timed_out(timeout, running_ranks, [m.rank for m in members if m.req == req],
                                                  where))
                if self._where_asked.is_set():
                    self._answer_where()
                looks = watch.tick()
                if watch.verdict is not None:  # the Session's group, or one a cell made
                    self._collective_failed(members, req, watch.verdict)
                if looks is not None:
                    wait = looks if wait is None else min(wait, looks)
                self._engine.pump(wait)
        except KeyboardInterrupt as e:
            where = watch.where_text() if not e.args else ""  # the last look (the button: no new one)
            self._stop(members, req)
            if where:
                raise KeyboardInterrupt(f"interrupted; where the ranks were: {where}") from None
            raise
        return self._results(members)

    def _answer_where(self) -> None:
        """where() asked from another thread: look at every rank (with stacks), on this thread."""
        self._where_asked.clear()
        try:
            self._where_seen = self._engine.watch.look_now(self._engine.pump, stack=True, within=1.0)
        finally:
            self._where_done.set()

    def _look_at_ranks(self, timeout: float) -> dict[int, Any]:
        """Every live rank's snapshot, with its stack: from the running call's loop when one runs
        (on another thread), else from here."""
        self._where_done.clear()
        self._where_asked.set()
        self._engine.wake()
        deadline = time.monotonic() + timeout
        while not self._where_done.wait(0.05):
            if self._call_lock.acquire(blocking=False):  # no call runs (or it just ended): look from here
                try:
                    self._where_asked.clear()
                    self._check_open()
                    return self._look_between_calls(timeout)
                finally:
                    self._call_lock.release()
            if time.monotonic() >= deadline:
                self._where_asked.clear()
                return {}
        return dict(self._where_seen)

    def _look_between_calls(self, timeout: float) -> dict[int, Any]:
        watch = self._engine.watch
        watch.begin(self.world_size, lambda: [m for m in self._members.values() if m.alive], dict)
        try:
            return watch.look_now(self._engine.pump, stack=True, within=min(timeout, 1.0))
        finally:
            watch.end()

    def _results(self, members: list[Member]) -> dict[int, Any]:
        values: dict[int, Any] = {}
        errors: list[RankError] = []
        returned: dict[int, Any] = {}  # what each rank's collectives were, with the check off
        for m in members:
            assert m.answer is not None
            kind, body, fds = m.answer
            m.answer = None
            if kind == DONE:
                if len(body):
                    value, meta = payload.unpack_result(body, fds)
                    m.gpu_memory = meta.get("gpu_memory")
                    if meta.get("returned") is not None:
                        returned[m.rank] = meta["returned"]
                    m.group = meta.get("group")
                    values[m.rank] = value
                else:
                    values[m.rank] = None
                    m.group = None  # the usual group (rank/own_group.py)
            else:
                errors.append(failure_of(m, body, fds))
        if errors:
            merged = merge_rank_errors(errors)
            # the collective check refused a call: every rank raised it, none entered the collective
            raise checked.refused(merged, checked.KEPT, rebuilt=False) or merged
        wrong = verdicts.judge_returned(returned) if len(returned) > 1 else None
        if wrong is not None:  # gloo let a collective pass whose tensors differed (a broadcast into more)
            raise CollectiveError([], [], rebuilt=False, what=wrong.what, kind=wrong.kind, culprit=wrong.culprit,
                                  after=f"every rank keeps its state, rank {wrong.culprit}'s with the wrong value")
        return values



def _nothing() -> None:
    pass


def check_timeout(timeout: Optional[float]) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")


def _timed_out(timeout: float, running: list[int], still: list[int], where: str = "") -> str:
    """What a call that ran out of time did to the ranks that were still running it, and where they were."""
    where = f"; where they were: {where}" if where else ""
    message = f"the call did not finish within {timeout:g} s (ranks still running: {running}{where}); "
    if not still:
        return message + "they were interrupted, their state is kept"
    return message + (f"they were interrupted, but ranks {still} did not stop (C code that ignores "
                      f"interrupts?): they still run it, later calls wait for them, and "
                      f"restart({still}) replaces them")
