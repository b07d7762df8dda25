"""A Session's call that is stuck: stop it, unstick a collective that can never finish, rebuild.

A rank blocked in a collective that can never finish (a peer of its group is idle, finished,
failed or dead and never issued it; or the ranks' collectives cannot match) would wait forever:
the engine's collective watch sees it (engine/watch.py, engine/verdict.py), the Session aborts
the group under the ranks (ABORT_GROUP: every rank cuts its connections to the others, see
rank/group.py) and raises CollectiveError; once every rank is idle again, the group is rebuilt
in place (GROUP), Python state kept. The stop button and timeouts stop a call the same way
(``_stop``), saying where each rank was.
"""

from __future__ import annotations

import pickle
import time

from ..engine import checked
from ..engine.verdict import FINISHED, Verdict
from ..wire import payload
from ..wire.errors import CollectiveError, RankError, RankExitedError, merge_rank_errors
from ..wire.protocol import ABORT_GROUP, FAIL, INTERRUPT, NO_REQUEST
from .ranks import Member, SessionRanks, failure_of

#: After an interrupt, how long ranks still running get before their group is destroyed
#: under them (unsticks a gloo collective), and before we stop waiting for them at all.
#: (A rank of the call died: no grace, see _stop's ``peer_died``.)
_ABORT_AFTER = 0.15
_ABORT_ANYWAY = 0.5
_STOP_PATIENCE = 5.0


class SessionRecovery(SessionRanks):
    """What a Session does when a call is stuck, stopped or timed out."""

    def _begin_watch(self, req: int, members: list[Member]) -> None:
        """The collective watch looks at every live rank during call ``req`` (engine/watch.py)."""
        def absent() -> dict[int, str]:
            gone = {}
            for m in self._members.values():
                if not m.alive:
                    gone[m.rank] = "died"
                elif m.req != req:
                    gone[m.rank] = ("raised" if m.answer is not None and m.answer[0] == FAIL else FINISHED) \
                        if m in members else "idle"
            return gone

        self._engine.watch.begin(self.world_size, lambda: [m for m in self._members.values() if m.alive], absent)

    def _collective_failed(self, members: list[Member], req: int, verdict: Verdict) -> None:
        missing = [self._members[r] for r in verdict.missing if r in self._members]
        dead = [m for m in missing if not m.alive]
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
        error = CollectiveError(verdict.waiting, verdict.missing, verdict.label or "a collective", errors, rebuilt,
                                what=verdict.what, kind=verdict.kind, culprit=verdict.culprit)
        # A send and its recv the check refused on one side: the other side waited in gloo.
        raise checked.refused(error, rebuilt=rebuilt) or error

    def _raise_if_died_during(self, req: int) -> None:
        """A rank that died during call ``req`` (while its group was aborted or rebuilt, say) is
        the news: its RankExitedError, not a collective error that says the group is broken."""
        died = [m for m in self._members.values() if not m.alive and m.died_during == req]
        if died:
            raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in died])

    def _where(self, req: int) -> str:
        """Where each rank running ``req`` is now (a look, waited for at most 0.3 s), in words."""
        watch = self._engine.watch
        if not watch.active:
            return ""
        try:
            while True:
                try:
                    snaps = watch.look_now(self._engine.pump, within=0.3)
                    return watch.where_text(snaps=snaps)
                except KeyboardInterrupt:
                    continue  # a second press: the look is short, finish it
        except Exception:
            return ""

    def _stop(self, members: list[Member], req: int, peer_died: bool = False) -> None:
        """Interrupt every rank still running ``req``; unstick collectives; rebuild the group
        when it was torn down. Bounded in time; a second Ctrl-C does not cut it short.
        ``peer_died``: a rank of the call is dead, so the group is broken whatever the others do
        and a rank waiting for it in C++ (a rendezvous, a collective) never sees the SIGINT: the
        group is cut at once, not after the grace an interrupt gets (_ABORT_ANYWAY was 0.5 s of
        every such cell's end)."""
        if self._engine.user_waits.prompter is None:  # a read that comes now is answered end of file at once
            self._engine.user_waits.open_prompts()
        self._engine.user_waits.close_prompts()  # a rank at a prompt reads KeyboardInterrupt, then end of file
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
                if not aborted and (
                        peer_died
                        or (now - start > _ABORT_AFTER and any(self._waits_in_dist(m) for m in running))
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

    def _waits_in_dist(self, m: Member) -> bool:
        """Did the last look see ``m`` waiting in torch.distributed?"""
        snap = self._engine.watch.snaps.get(m.rank)
        return snap is not None and (snap.blocked is not None or bool(snap.label) or bool(snap.pending))

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


