"""A Session's call that is stuck: stop it, find the collective a rank never joins, unstick, rebuild.

A rank blocked in a collective that a peer of its group will never issue (the peer is idle,
finished, failed or dead) would wait forever: the caller sees it from the ranks' control
threads (COLLECTIVE, torchdist/waits.py; PEEK / ISSUED), aborts the group under them (ABORT_GROUP: every
rank cuts its connections to the others, see rank/group.py) and raises CollectiveError; once
every rank is idle again, the group is rebuilt in place (GROUP), Python state kept. The stop
button and timeouts stop a call the same way (``_stop``).
"""

from __future__ import annotations

import pickle
import time

from ..torchdist.waits import Wait
from ..wire import payload
from ..wire.errors import CollectiveError, RankError, RankExitedError, merge_rank_errors, source_location
from ..wire.protocol import ABORT_GROUP, FAIL, INTERRUPT, NO_REQUEST, PEEK, WATCH
from .ranks import Member, SessionRanks, failure_of

#: After an interrupt, how long ranks still running get before their group is destroyed
#: under them (unsticks a gloo collective), and before we stop waiting for them at all.
_ABORT_AFTER = 0.15
_ABORT_ANYWAY = 0.5
_STOP_PATIENCE = 5.0


class SessionRecovery(SessionRanks):
    """What a Session does when a call is stuck, stopped or timed out."""

    def _watch_recorders(self, req: int) -> None:
        """Some rank is not running ``req`` (idle, finished, failed, dead): the ranks that still
        run it read torch's recorder for collectives they wait on (torchdist/waits.py): it sees waits
        that a frame does not (Work.wait(), DTensor, DDP's hooks on autograd threads)."""
        for m in self._members.values():
            if m.alive and m.req == req and m.watched != req:
                m.watched = req
                self._engine.send_control(m, WATCH, req)

    def _stuck(self, req: int) -> tuple[list[Member], list[Member]]:
        """Ranks waiting in a collective for this call, and the ranks of its group that will
        never issue it: dead, or not running ``req`` and never having issued it (asked once
        per call, by PEEK: a rank that ran an async collective and finished has joined)."""
        absent = [m for m in self._members.values() if not m.alive or m.req != req]
        if not absent:
            return [], []
        stuck: list[Member] = []
        missing: dict[int, Member] = {}
        for m in self._members.values():
            if not (m.alive and m.req == req):
                continue
            for wait in m.waits:
                peers = [a for a in absent if wait.ranks is None or a.rank in wait.ranks]
                if wait.any_peer and any(r != m.rank and (wait.ranks is None or r in wait.ranks)
                                         for r, other in self._members.items() if other not in absent):
                    continue  # a rank it may be waiting for still runs
                if wait.seq is not None and wait.group is not None:
                    for a in peers:
                        if a.alive and a.issued_req != req:
                            a.issued_req, a.issued = req, None
                            self._engine.send_control(a, PEEK, req)
                    if any(a.alive and a.issued is None for a in peers):
                        continue  # not known yet whether they joined it
                    peers = [a for a in peers if not a.alive or (a.issued or {}).get(wait.group, 0) < wait.seq]
                if peers:
                    stuck.append(m)
                    missing.update((a.rank, a) for a in peers)
                    break
        if not stuck:
            return [], []
        return stuck, [missing[r] for r in sorted(missing)]

    def _collective_failed(self, members: list[Member], req: int, stuck: list[Member],
                           missing: list[Member]) -> None:
        dead = [m for m in missing if not m.alive]
        waiting = {m.rank: m.waits[0] for m in stuck if m.waits}
        errors = [failure_of(m) for m in missing if m.answer is not None and m.answer[0] == FAIL
                  and m.req == NO_REQUEST and m in members]
        for m in missing:
            if m.answer is not None and m in members:
                payload.close_fds(m.answer[2])
                m.answer = None
        self._abort_group()
        self._settle(members, req)
        if dead:
            raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])
        rebuilt = self._rebuild()
        self._raise_if_died_during(req)
        raise CollectiveError([m.rank for m in stuck], [m.rank for m in missing], _describe(waiting),
                              errors, rebuilt)

    def _raise_if_died_during(self, req: int) -> None:
        """A rank that died during call ``req`` (while its group was aborted or rebuilt, say) is
        the news: its RankExitedError, not a collective error that says the group is broken."""
        died = [m for m in self._members.values() if not m.alive and m.died_during == req]
        if died:
            raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in died])

    def _stop(self, members: list[Member], req: int) -> None:
        """Interrupt every rank still running ``req``; unstick collectives; rebuild the group
        when it was torn down. Bounded in time; a second Ctrl-C does not cut it short."""
        if self._engine.prompter is None:  # a read that comes now is answered end of file at once
            self._engine.open_prompts()
        self._engine.close_prompts()  # a rank at a prompt reads KeyboardInterrupt, then end of file
        for m in members:
            if m.alive and m.req == req:
                self._engine.send_control(m, INTERRUPT, req)
        aborted = False
        start = time.monotonic()
        last_signal = start
        while True:
            try:
                running = [m for m in members if m.alive and m.req == req]
                if not running:
                    break
                now = time.monotonic()
                if now - start > _STOP_PATIENCE:
                    break  # they ignore interrupts: leave them running, their answer is dropped
                # Blocked in a collective (seen on its stack), or in C++ that ignores SIGINT for
                # longer (a DDP backward waiting on its all_reduce): cut the group under it.
                if self.ddp and not aborted and (
                        (now - start > _ABORT_AFTER and any(m.waits for m in running))
                        or now - start > _ABORT_ANYWAY):
                    self._abort_group()
                    aborted = True
                if now - last_signal > 1.0:  # the user's code may have swallowed one
                    for m in running:
                        self._engine.send_control(m, INTERRUPT, req)
                    last_signal = now
                self._engine.pump(0.05)
            except KeyboardInterrupt:
                continue
        for m in members:
            if m.answer is not None:
                payload.close_fds(m.answer[2])
                m.answer = None
        if self._group_broken:
            self._rebuild()

    def _settle(self, members: list[Member], req: int) -> None:
        """After an abort: wait (bounded) for the stuck ranks to come back, interrupting them
        if their code carries on."""
        start = time.monotonic()
        while any(m.alive and m.req == req for m in members) and time.monotonic() - start < 2.0:
            self._engine.pump(0.05)
        if any(m.alive and m.req == req for m in members):
            self._stop(members, req)
        for m in members:
            if m.answer is not None and m.req == NO_REQUEST:
                payload.close_fds(m.answer[2])
                m.answer = None

    def _abort_group(self) -> None:
        """Every live rank cuts its connections to the others and destroys its groups: a rank
    blocked in a gloo collective raises at once (see rank/group.py: cut_connections)."""
        self._group_broken = True
        live = [m for m in self._members.values() if m.alive]
        for m in live:
            peers = pickle.dumps([(p.pid, self._layout.nodes[p.rank]) for p in live if p is not m])
            m.aborts += 1
            self._engine.send_control(m, ABORT_GROUP, NO_REQUEST, peers)

    def _rebuild(self) -> bool:
        """A new group on a new port, in place, on every rank (all must be alive and idle)."""
        if not self.ddp:
            return False
        members = list(self._members.values())
        if len(members) < self.world_size or not all(m.alive and m.req == NO_REQUEST for m in members):
            return False
        try:
            self._start([])
            return True
        except RankError:
            return False



def _describe(waiting: dict[int, Wait]) -> str:
    """"dist.all_reduce (rank 0 at Cell In[7], line 6)": what the ranks were left waiting in."""
    if not waiting:
        return "a collective"
    ops = sorted({w.op for w in waiting.values()})
    places = [f"rank {r} at {source_location(w.where[0])}, line {w.where[1]}"
              for r, w in sorted(waiting.items()) if w.where is not None]
    text = " / ".join(op if "." in op else f"dist.{op}" for op in ops)
    return f"{text} ({'; '.join(places)})" if places else text


