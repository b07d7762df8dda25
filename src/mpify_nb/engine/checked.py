"""Calls the ranks' collective check refused (torchdist/checks/): the CollectiveError a call raises.

Every rank of a group compares its call with its peers' before any enters gloo; calls that cannot
be one make every rank raise the same ``CollectiveError`` (rank/checks.py), carrying each rank's
call and line (``.mismatch``). The caller, for ``ranch`` and a Session alike, takes that
error from whichever rank's failure holds it (the caller's own rank's exception, or a rank's
``RankRaisedError.__cause__``) and words it again, its cells named as the notebook shows them::

    CollectiveError: the ranks called collectives that cannot match (different dtypes): rank 0 at
    Cell In[4], line 3: all_reduce #2 of float32[4]; rank 1 at line 3: all_reduce #2 of
    float64[4]; no rank entered it: the process group is as it was (Python state kept)
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..rank import control as rank_control
from ..torchdist.checks import wrappers
from ..wire.errors import CollectiveError, source_location

#: What became of a Session's ranks when the check refused a collective: nothing was sent.
KEPT = "no rank entered it: the process group is as it was (Python state kept)"


def mismatch_of(error: Any) -> Any:
    """The ranks' calls a check refused, from ``error`` or what it carries (its cause, the
    errors of ranks it merged); None when no check refused anything."""
    seen = 0
    todo = [error]
    while todo and seen < 64:
        e = todo.pop(0)
        seen += 1
        found = getattr(e, "mismatch", None)
        if found is not None:
            return found
        todo += [x for x in (getattr(e, "__cause__", None),) if x is not None]
        todo += list(getattr(e, "errors", None) or ()) + list(getattr(e, "others", None) or ())
    return None


def refused(error: Any, after: Optional[str] = None, rebuilt: Optional[bool] = None) -> Optional[CollectiveError]:
    """The call's CollectiveError for a check's refusal that ``error`` holds (None: it holds none).
    ``after``/``rebuilt`` say what became of the ranks (ranch: every rank was stopped)."""
    mismatch = mismatch_of(error)
    if mismatch is None:
        return None
    what = mismatch.text(lambda where: f"{source_location(where[0])}, line {where[1]}")
    ranks = sorted({rank for rank, _op, _line in mismatch.calls})
    explained = CollectiveError(ranks, [], what=what, kind="mismatch", rebuilt=rebuilt, after=after)
    explained.mismatch = mismatch
    when = getattr(error, "when", None)
    if isinstance(when, float):
        explained.when = when
    return explained


def set_collective_checks(enabled: bool) -> bool:
    """Turn the collective check on (the default) or off, for every rank of the calls and cells
    that follow; returns the previous setting. ``MPIFY_NB_COLLECTIVE_CHECKS=0`` in the
    environment starts with it off.

    On, each rank compares every ``torch.distributed`` call it makes (``all_reduce``,
    ``broadcast``, ``send``...) with its peers' before any of them enters it: calls that cannot
    be one (another op, src or dst, reduce op, dtypes or sizes) end the cell with
    ``CollectiveError``, every rank keeping its state, where gloo would abort a rank (the
    notebook itself under ``ranch``) or hand back a wrong value. Off, nothing of it runs, and
    those mistakes do what torch does with them (docs: "When things go wrong").

    Call it in the notebook, not in a rank's code: the ranks of a group must agree. An open
    Session's ranks learn of it before its next cell.

    Example (a notebook cell):

    ```python
    from mpify_nb import ranch, in_torchddp, set_collective_checks
    import torch, torch.distributed as dist

    def average_rank():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()

    was = set_collective_checks(False)   # a loop of tiny collectives, timed without the check
    print(was, ranch(2, average_rank, ctx=in_torchddp()))
    _ = set_collective_checks(was)       # back as it was
    ```

    ```output
    True [0.5, 0.5]
    ```
    """
    if rank_control.in_a_rank():
        raise RuntimeError("set_collective_checks() is the notebook's to call: the ranks of a group must "
                           "agree on it (a rank that checks waits for peers that publish)")
    previous = wrappers.enabled()
    wrappers.set_enabled(bool(enabled), install=False)  # the notebook's own rank installs it per call
    os.environ[wrappers.VARIABLE] = "1" if enabled else "0"  # ranks started from now on
    return previous
