"""A Session's background work and the live reads beside it.

``Session.run(code, wait=False)`` runs the call a blocking ``run`` makes, on a thread of its own
(engine/background.py), holding every rank: another call is refused meanwhile (RanksBusyError,
session/calls.py), never queued behind it nor interleaved with it. ``pull`` goes on working: while
a call runs, a variable is read by each rank's control thread, beside the main thread that runs
the call, and comes back on the control channel::

    cell In [5]: h = s.run(train, wait=False) ── _in_background: claim (_busy), start the work
    cell In [6]: s.pull("losses")            ── the ranks are busy: _peek
                   PEEK (name) ── control channel ──> rank k, a thread of its own: pickle
                                                      __main__[name] as it is now
                   PEEKED (value, memfds) <──────────  (the main thread goes on: no lock)
                   read by whoever runs the loop: the work's thread (its pump), or this one
                   once no call runs
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable

from ..engine import background
from ..wire import payload
from ..wire.errors import PayloadError, RankExitedError, merge_rank_errors
from ..wire.protocol import PEEK, PEEKED
from .calls import SessionCalls

#: How long a live read waits for a rank's answer (a big value is pickled first).
_PEEK_PATIENCE = 60.0


class SessionBackground(SessionCalls):
    """Background work on a Session's ranks, and reading their variables while a call runs."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._peeks: dict[int, dict[int, tuple[Any, list[int]]]] = {}  # request -> {rank: (body, fds)}
        self._peek_cond = threading.Condition()
        self._engine.on(PEEKED, self._on_peeked)

    def _in_background(self, what: str, targets: list[int], call: Callable[[], Any]) -> background.BackgroundWork:
        """Run ``call()`` (a blocking call of this Session) as background work holding every rank."""
        self._check_open()
        work = background.BackgroundWork(what, targets)
        with self._flag_lock:
            self._refuse_if_busy()
            self._busy = work

        def run() -> Any:
            try:
                return call()
            finally:
                self._busy = None  # free before the handle says it is done: its waiter may call at once

        try:
            return work.start(run)
        except BaseException:
            self._busy = None
            raise

    def _busy_elsewhere(self) -> bool:
        """Does a call hold the ranks on another thread now (background work, or a thread's call)?"""
        if self._busy is not None:
            return True
        if self._call_lock.acquire(blocking=False):
            self._call_lock.release()
            return False
        return True

    # -- live reads ----------------------------------------------------------------------------

    def _peek(self, name: str, targets: list[int]) -> dict[int, Any]:
        """Each of ``targets``' ``name`` as it is now, read beside the call its ranks run."""
        self._check_open()
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be a variable name, not {name!r}")
        req = next(self._ids)
        answers: dict[int, tuple[Any, list[int]]] = {}
        with self._peek_cond:
            self._peeks[req] = answers
        body = pickle.dumps(name)
        try:
            for r in targets:
                m = self._members[r]
                if m.alive:
                    self._engine.send_control(m, PEEK, req, body)
            self._wait_for_peeks(name, targets, answers)
        except BaseException:
            with self._peek_cond:
                self._peeks.pop(req, None)
                for _data, fds in answers.values():
                    payload.close_fds(fds)
            raise
        with self._peek_cond:
            self._peeks.pop(req, None)
            got = dict(answers)
        values: dict[int, Any] = {}
        failures: list[tuple[int, str, str]] = []
        for r, (data, fds) in sorted(got.items()):
            if data[:1] == b"\x01":
                values[r] = payload.unpack_result(data[1:], fds)
            else:
                payload.close_fds(fds)
                why, text = pickle.loads(data[1:])
                failures.append((r, why, text))
        for r, why, text in failures:
            if why == "name":
                raise NameError(text)
            raise PayloadError(f"cannot pull {name!r} from rank {r}: {text}")
        return values

    def _wait_for_peeks(self, name: str, targets: list[int], answers: dict) -> None:
        deadline = time.monotonic() + _PEEK_PATIENCE
        while True:
            with self._peek_cond:
                if len(answers) == len(targets):
                    return
            dead = [self._members[r] for r in targets if not self._members[r].alive]
            if dead:
                raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])
            if time.monotonic() >= deadline:
                slow = [r for r in targets if r not in answers]
                raise TimeoutError(f"rank {slow[0] if len(slow) == 1 else slow} did not send {name!r} "
                                   f"within {_PEEK_PATIENCE:g} s")
            if self._call_lock.acquire(blocking=False):  # no call runs (it just ended): the loop is ours
                try:
                    self._engine.pump(0.02)
                    self._notice_deaths()
                finally:
                    self._call_lock.release()
            else:
                with self._peek_cond:
                    self._peek_cond.wait(0.05)

    def _on_peeked(self, m: Any, req: int, body: Any, fds: list) -> None:
        with self._peek_cond:
            answers = self._peeks.get(req)
            if answers is None:
                payload.close_fds(fds)  # a read given up on
                return
            answers[m.rank] = (bytes(body), fds)
            self._peek_cond.notify_all()
