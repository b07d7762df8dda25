"""Where each rank is, as a user reads it: ``Session.where()``'s and ``BackgroundWork.where()``'s
answer (``Where``: a ``RankWhere`` per rank: what it does, its line, its stack, what it waits in),
made from a round of looks (engine/watch.py) in verdict.py's words.

::

    watch: a LOOK round with stacks ── {rank: Snapshot} ── where_of() ──> Where {rank: RankWhere}
                                                                          str(): each rank's block
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import verdict as verdicts


@dataclass
class RankWhere:
    """One rank in :meth:`Session.where`: what it does (``"waits in all_reduce #5 of float32[4]
    (12 s)"``, ``"running"``, ``"blocked in sleep()"``, ``"idle"``), its line, its Python stack
    (as a traceback shows it) and the collectives it has issued that have not completed."""

    rank: int
    doing: str
    line: Optional[tuple[str, int]]
    stack: list[str]
    pending: list[str]

    def __str__(self) -> str:
        head = f"rank {self.rank}: {self.doing}"
        body = [f"  {line}" for line in self.stack]
        if self.pending:
            body.append(f"  pending: {'; '.join(self.pending)}")
        return "\n".join([head, *body])


class Where(dict):
    """:meth:`Session.where`'s answer: ``{rank: RankWhere}``, shown as each rank's block."""

    def __str__(self) -> str:
        return "\n".join(str(self[r]) for r in sorted(self))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def where_of(snaps: dict[int, Any], at_user: Callable[[int], bool], gone: Optional[dict[int, str]] = None) -> Where:
    """The ranks' snapshots (with their stacks) in words; ``at_user(rank)``: does it wait for the
    user now (a prompt, a breakpoint)? ``gone``: ranks not looked at, and why (``returned from fn``)."""
    now = time.time_ns()
    out = Where()
    for r, why in (gone or {}).items():
        out[r] = RankWhere(r, why, None, [], [])
    for r in sorted(snaps):
        snap = snaps[r]
        out[r] = RankWhere(r, verdicts.doing_text(snap, now, at_user(r)), snap.where,
                           verdicts.stack_lines(snap), [verdicts.op_text(o) for o in snap.pending])
    return out
