"""What a mismatch raises: the ranks' calls that cannot be one, and the exception made of them.

Every rank of a group raises the same one (groups.py judges alike on each): ``raise_as`` makes
it, the caller's ``CollectiveError`` in a process that plays a rank (rank/checks.py), carrying
the :class:`Mismatch`; elsewhere :class:`CollectivesApart`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..recorder import Op

#: A rank that outlives its call (a Session's): the stop button while it waits in its check is
#: held until the check is over (a peer may be entering gloo on its word; one that never comes is
#: unstuck by the group's abort, as a wait in gloo is). A ranch call's ranks end with the call.
HOLD_INTERRUPTS = [False]  # (groups.py and deferred.py read it)


class CheckAborted(RuntimeError):
    """The group was aborted under a rank waiting in its check (a Session unsticking it)."""


@dataclass
class Mismatch:
    """Ranks' calls that cannot be one: ``why``, and each rank's (global rank, call, line)."""

    why: str
    calls: list[tuple[int, Op, Optional[tuple[str, int]]]] = field(default_factory=list)
    p2p: bool = False

    def text(self, location: Callable[[tuple[str, int]], str] = lambda w: f'File "{w[0]}", line {w[1]}') -> str:
        """"the ranks called collectives that cannot match (different dtypes): rank 0 at File "x",
        line 3: all_reduce #1 of float32[4]; rank 1 at line 3: all_reduce #1 of float64[4]"."""
        from ..recorder import op_text

        parts = []
        last = None
        for rank, op, where in self.calls:
            at = ""
            if where is not None:
                at = f" at line {where[1]}" if where[0] == last else f" at {location(where)}"
                last = where[0]
            parts.append(f"rank {rank}{at}: {op_text(op)}")
        head = "a send and its recv cannot match" if self.p2p else "the ranks called collectives that cannot match"
        return f"{head} ({self.why}): " + "; ".join(parts)


class CollectivesApart(RuntimeError):
    """What a rank raises where nothing better was installed (rank/checks.py installs CollectiveError)."""

    def __init__(self, mismatch: Mismatch) -> None:
        super().__init__(mismatch.text())
        self.mismatch = mismatch


#: Makes the exception a mismatch raises (rank/checks.py: the caller's CollectiveError).
raise_as: list[Callable[[Mismatch], BaseException]] = []


def error_for(mismatch: Mismatch) -> BaseException:
    return raise_as[0](mismatch) if raise_as else CollectivesApart(mismatch)
