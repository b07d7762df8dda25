"""A ranch call's half of the collective watch (engine/watch.py, engine/verdict.py), mixed into
launcher/call.py's ``Call``: what the call tells the watch, and what it does with a verdict::

    GO ── _begin_watch: look at the ranks not done, and the caller's own rank here (in-process)
    a rank's RETURNED / DONE ── _absent: it left the call (its fn returned)
    the caller's own fn returns ── _own_rank_returned: what it issued, before ctx.__exit__
    every rank returned ── _judge_returned: a collective completed with tensors that cannot
        match (a broadcast into a bigger buffer) is a wrong value, not a result
    verdict ── _collective_failed: cut the own rank's connections, CollectiveError, stop every rank
    a rank's error raised inside a collective (held a moment) ── _explain: a peer that returned
        without joining it, or holds another collective under its number, is the news
    timeout= ── _time_out: where each rank was;  the stop button ── _where_they_were
    the caller's own rank raised the collective check's refusal ── _refused: the call's error at
        once (engine/checked.py; a rank's is turned into it as the call records it)
"""

from __future__ import annotations

from typing import Any, Optional

from ..engine import checked, core
from ..engine import verdict as verdicts
from ..engine.watch import Watch
from ..engine.where import Where, where_of
from ..start import placement
from ..torchdist import waits
from ..wire.errors import CollectiveError, RankError
from . import own_rank
from .outcome import Outcome


class WatchedCall:
    """The collective watch's part of one ranch call (see the module's docstring)."""

    nprocs: int
    caller_rank: Optional[int]
    timeout: Optional[float]
    ranks: dict[int, Any]
    engine: core.Engine
    watch: Watch
    own: own_rank.OwnRank
    outcome: Outcome
    layout: Optional[placement.Layout]
    finished: bool
    own_returned: bool

    def _time_out(self) -> None:
        running = sorted(r.rank for r in self.ranks.values() if not r.done)
        if self.caller_rank is not None and not self.finished:
            running = sorted(running + [self.caller_rank])
        where = ""
        if self.watch.active:
            snaps = self.watch.look_now(self.engine.pump, within=0.3)
            where = self.watch.where_text(snaps=snaps)
        where = f"; where they were: {where}" if where else ""
        self.outcome.fail(TimeoutError(f"ranch: the call did not finish within {self.timeout:g} s "
                                f"(ranks still running: {running}{where}); every rank was stopped"))

    def _begin_watch(self) -> None:
        self.watch.begin(self.nprocs, lambda: [r for r in self.ranks.values() if not r.done],
                         self._absent, self._look_at_own_rank if self.caller_rank is not None else None,
                         self.caller_rank)

    def _look_at_own_rank(self, stack: bool) -> Optional[waits.Snapshot]:
        """The caller's own rank, looked at here (the watch thread looks at the calling thread)."""
        if self.finished or self.own_returned or self.caller_rank is None:
            return None
        return waits.snapshot(self.caller_rank, self.own.thread_id, self.own.native_id, stack=stack)

    def _absent(self) -> dict[int, str]:
        """The ranks that left the call: their fn returned."""
        gone = {r.rank: verdicts.RETURNED for r in self.ranks.values()
                if r.done and r.rank not in self.outcome.failed_ranks or r.rank in self.watch.kept}
        if self.caller_rank is not None and self.own_returned:
            gone[self.caller_rank] = verdicts.RETURNED
        return gone

    def _collective_failed(self, verdict: verdicts.Verdict) -> None:
        """Ranks wait in collectives that can never finish: stop every rank and say why. The
        caller's own rank, blocked in C++, is unstuck by cutting its connections to the others."""
        error = CollectiveError(verdict.waiting, verdict.missing, verdict.label, rebuilt=None, what=verdict.what,
                                kind=verdict.kind, culprit=verdict.culprit)
        if self.caller_rank is not None and not self.finished:
            self._unstick_own_rank()
        self.outcome.fail(error)

    def _unstick_own_rank(self) -> None:
        from ..rank import group

        peers = [(r.pid, self.layout.nodes[r.rank] if self.layout is not None else "127.0.0.1")
                 for r in self.ranks.values() if not r.buried]
        try:
            group.cut_connections(peers)
            group.abort_nccl()
        except Exception:
            pass  # the ranks' deaths end its collective too, in about 2 s

    def _held_answered(self) -> bool:
        """A held error's group: has every other rank of it answered (returned, done, failed)?"""
        held = self.outcome.held
        error = held[0] if held is not None else None
        context = getattr(error, "context", None)
        if not isinstance(error, RankError) or context is None or context.blocked is None:
            return False
        members = context.blocked.members(self.nprocs)
        absent = self._absent()
        return all(r == error.rank or r in absent or (r in self.ranks and self.ranks[r].done)
                   for r in members)

    def _explain(self, error: BaseException) -> BaseException:
        """A rank's error raised inside a collective: a peer that returned without joining it, or
        that issued another one under its number, is the news, not gloo's "Connection closed"."""
        context = getattr(error, "context", None)
        if not isinstance(error, RankError) or context is None:
            return error
        snaps = {error.rank: context}
        absent = self._absent()
        absent.pop(error.rank, None)
        kept = dict(self.watch.kept)
        for rank in absent:
            if rank in kept:
                snaps[rank] = kept[rank]
        for rank, snap in dict(self.watch.snaps).items():
            if rank != error.rank and rank not in absent:
                snaps[rank] = snap
        verdict = verdicts.judge(snaps, self.nprocs, absent)
        if verdict is None or verdict.kind == "deadlock" or error.rank not in verdict.waiting + [verdict.culprit]:
            return error
        explained = CollectiveError(verdict.waiting, verdict.missing, verdict.label, rebuilt=None,
                                    what=verdict.what, kind=verdict.kind, culprit=verdict.culprit)
        explained.__cause__ = error
        explained.when = error.when
        return explained

    def _refused(self, error: BaseException) -> bool:
        """The caller's own rank raised the collective check's refusal: the call's error at once
        (its peers raised the same, none entered the collective: no echo of a peer to wait for)."""
        explained = checked.refused(error)
        if explained is None:
            return False
        self.outcome.fail(explained)
        return True

    def _as_refusal(self, error: RankError) -> RankError:
        """A rank's error that is the collective check's refusal, as the call's CollectiveError.
        A send the check refused on the peer's side leaves this side in gloo: the caller's own
        rank, if it is there, is unstuck at once (not when the peer's death reaches gloo)."""
        explained = checked.refused(error)
        if explained is None:
            return error
        if explained.mismatch.p2p and self.caller_rank is not None and not self.finished \
                and getattr(error, "rank", None) != self.caller_rank:
            self._unstick_own_rank()
        return explained

    def _judge_returned(self) -> None:
        """Every rank returned: two that completed the same collective with tensors that cannot be
        one (gloo lets a broadcast into a bigger buffer pass) got a wrong value. Say so, naming
        the rank, rather than hand it back as a result."""
        kept = dict(self.watch.kept)
        verdict = verdicts.judge_returned(kept) if len(kept) > 1 else None
        if verdict is not None:
            raise CollectiveError([], [], rebuilt=None, what=verdict.what, kind=verdict.kind,
                                  culprit=verdict.culprit, after="the call's results were not returned")

    def where_now(self, timeout: float) -> Where:
        """Where each rank is now, its stack included, from any thread (``BackgroundWork.where()``):
        a round of looks at the loop's next turn, the call going on."""
        snaps = self.watch.look_for(stack=True, within=min(timeout, 1.5))
        gone = {r: why for r, why in self._absent().items() if r not in snaps}
        return where_of(snaps, self.engine.user_waits.waiting, gone)

    def _where_they_were(self) -> str:
        """Where the ranks were at the last look (for the stop button's KeyboardInterrupt)."""
        try:
            return self.watch.where_text()
        except Exception:
            return ""

    def _own_rank_returned(self, rank: int) -> None:
        """The caller's own fn returned: what it issued goes to the watch before its group is
        torn down (a peer still waiting in a collective it never joined is told so)."""
        try:
            snap = waits.snapshot_of_return(rank)
        except Exception:
            snap = None
        # What it issued is kept before it is absent: the watch thread reads absent() first, then
        # what is kept, and an absent rank without its kept snapshot reads as one that never joined
        # the collective its peer still finishes (a false "rank 0 never joined" under load).
        if snap is not None:
            self.watch.returned(rank, snap)
        self.own_returned = True
        if snap is not None:
            self.engine.wake()
