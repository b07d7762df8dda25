"""A Session rank whose cell makes its own process group (a torchrun script pasted into a cell).

The Session steps aside: a cell's ``init_process_group`` while the Session's own group is the
default one destroys the Session's first (quietly), then makes the cell's, which meets the other
ranks at the Session's store (torchdist/rendezvous.py). A cell that destroys the default group,
the Session's or its own, leaves the ranks without one; the next cell that needs it is told how
to get the Session's back (``%dist_restart``, or ``Session.restart()``), and ``%sync`` says so::

    cell: dist.init_process_group("gloo")  ── the Session's group is up ──> destroyed, then the cell's
    cell: dist.destroy_process_group()     ── no group ──> state() "none": %sync, %dist_status say it
    cell: dist.all_reduce(t)               ── torch: "Default process group has not been initialized"
                                              + how to get the Session's group back (a note)
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from ..torchdist import compat, groups
from ..wire.notes import add_note
from . import group

_original: list[Callable] = []

#: Added to torch's error when a cell uses the default group after one destroyed it.
NO_GROUP_HINT = ("These ranks have no process group now: a cell destroyed it (dist.destroy_process_group()). "
                 "%dist_restart (Session.restart()) brings the Session's group back, their state kept; or make "
                 "your own in the cell (dist.init_process_group(...)).")


def install() -> None:
    """Wrap ``init_process_group`` so that a cell's own replaces the Session's (idempotent)."""
    if _original or "torch.distributed.distributed_c10d" not in sys.modules:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.init_process_group
    _original.append(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        ours = group._group.get("pg")
        if ours is not None and c10d.is_initialized() and c10d.GroupMember.WORLD is ours:
            compat.destroy_process_group()  # the Session's own: the cell's takes its place
        group._group["pg"] = None
        if not c10d.is_initialized():
            groups.set_group_count(0)  # an earlier cell's failed rendezvous counted one here, not on the peers
        return original(*args, **kwargs)

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def state() -> str:
    """Which default group these ranks have: "session" (the Session's own), "own" (a cell's), or
    "none"."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or not c10d.is_initialized():
        return "none"
    pg = group._group.get("pg")
    return "session" if pg is not None and c10d.GroupMember.WORLD is pg else "own"


def usual() -> str:
    """The group a Session's rank has unless a cell changed it: the Session's with ddp, else none."""
    return "session" if group._group.get("ddp") else "none"


def explain(exc: BaseException) -> None:
    """Add what to do to torch's error when a cell uses a default group that a cell destroyed."""
    if group._group.get("ddp") and state() == "none" and "Default process group has not been initialized" in str(exc):
        add_note(exc, NO_GROUP_HINT)
