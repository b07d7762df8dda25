"""The collective check (torchdist/checks/) in the processes that play ranks.

::

    template, before it forks           install(): every name torch.distributed gives out is ours
    a rank, once its environment is     starting(): on or off as the caller said
      applied (rank/loop.py)              (MPIFY_NB_COLLECTIVE_CHECKS, in the call's environment)
    a Session's CHECKS request          switch(on): the notebook's set_collective_checks, sent
                                          before the next cell to every rank alike
    ABORT_GROUP (rank/session.py)       abort(): a rank waiting in its check raises, as one
                                          blocked in gloo does when its connections are cut
    the notebook's own rank (ranch)     in_the_notebook(): installed for the call, names the
                                          notebook bound to torch's own calls swapped meanwhile

A mismatch raises the caller's own ``CollectiveError`` in the rank (a user's ``except`` there
catches it), carrying the ranks' calls (``.mismatch``): the caller words it again with its
cells' names (engine/checked.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from ..torchdist.checks import groups, mismatch, wrappers
from ..wire.errors import CollectiveError

#: What a rank's CollectiveError says became of the ranks (the caller's own words replace it).
NONE_ENTERED = "none of them entered it"


def _error(found: mismatch.Mismatch) -> BaseException:
    ranks = sorted({rank for rank, _op, _line in found.calls})
    error = CollectiveError(ranks, [], what=found.text(), kind="mismatch", rebuilt=False, after=NONE_ENTERED)
    error.mismatch = found
    return error


def install() -> None:
    """Wrap torch.distributed's calls in this process (torch.distributed imported already)."""
    mismatch.raise_as[:] = [_error]
    wrappers.install()


def starting() -> None:
    """A rank's environment is the caller's now: checks on or off as it says; off, torch's own
    calls are put back (nothing of the user's has bound a name yet)."""
    mismatch.raise_as[:] = [_error]
    switch(wrappers.from_environment())


def switch(on: bool) -> None:
    """The caller turned the checks on or off (between a Session's cells, on every rank): off,
    torch's own calls are put back (a name the user's code bound meanwhile passes straight on)."""
    mismatch.raise_as[:] = [_error]
    wrappers.set_enabled(on)
    if not on:
        wrappers.uninstall()


def abort() -> None:
    groups.abort_all()


def sweep() -> None:
    """Close the check's tables of the groups torch no longer holds."""
    groups.sweep()


def persistent() -> None:
    """This rank outlives its calls (a Session's): the stop button is held while it waits in its
    check (groups.HOLD_INTERRUPTS), and the group's abort ends that wait."""
    groups.HOLD_INTERRUPTS[0] = True


def collectives_so_far() -> int:
    """How many calls this rank's live groups took so far (torch's own count, which every call
    adds to, C++'s too; 0 without a group): a cell that changed it issued some."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return 0
    total = 0
    try:
        for pg in list(c10d._world.pg_names):
            total += pg._get_sequence_number_for_group()
    except Exception:
        return 0
    return total


def returned_after(before: int, since_ns: int, rank: int) -> Any:
    """With the check off, a persistent cell that issued collectives: what they were, as the
    recorder kept them (a Snapshot of those issued since ``since_ns``), for the caller to compare
    across ranks (a broadcast into a bigger buffer, which gloo lets pass); None otherwise."""
    if wrappers.enabled() or collectives_so_far() == before:
        return None  # on, the check compared every call before it ran
    from dataclasses import replace

    from ..torchdist import waits

    snap = waits.snapshot_of_return(rank, settle=False)  # not a cell's worth of waiting for gloo to retire them
    if snap is None:
        return None
    # What the cell issued; it returned from each (gloo retires the last a moment after wait() returns).
    ops = tuple(replace(o, done=True) for o in snap.ops if o.issued_ns >= since_ns)
    return replace(snap, ops=ops) if ops else None


@contextlib.contextmanager
def in_the_notebook() -> Iterator[None]:
    """The caller's own rank of a ranch call: the check installed for the call (when on), and
    the names of ``__main__`` bound to torch's own calls (``from torch.distributed import
    all_reduce`` in an earlier cell) pointed at ours meanwhile; all put back after."""
    if not wrappers.enabled() or "torch.distributed" not in sys.modules:
        yield
        return
    mismatch.raise_as[:] = [_error]
    installed_here = not wrappers.installed()
    wrappers.install()
    swapped = _swap(sys.modules["__main__"].__dict__, wrappers.replacements())
    try:
        yield
    finally:
        namespace = sys.modules["__main__"].__dict__
        for name, (ours, theirs) in swapped.items():
            if namespace.get(name) is ours:
                namespace[name] = theirs
        if installed_here:
            wrappers.uninstall()
        wrappers.forget()
        groups.sweep()  # the call's groups are gone: their tables too


def _swap(namespace: dict, replacements: dict[int, Any]) -> dict[str, tuple[Any, Any]]:
    swapped = {}
    for name, value in list(namespace.items()):
        ours = replacements.get(id(value))
        if ours is not None:
            namespace[name] = ours
            swapped[name] = (ours, value)
    return swapped
