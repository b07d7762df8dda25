"""Point-to-point work's peer and tag, for the collective watch (torchdist/waits.py).

gloo's flight recorder keeps no point-to-point entries, and a ``Work`` from ``isend``/``irecv``
says neither its peer nor its tag. A rank blocked in ``w.wait()`` could then only be judged as
"waits for any rank": an ``isend`` and an ``irecv`` with different tags looked as if they
could still meet. So ``dist.isend`` and ``dist.irecv`` are wrapped (once, in each process that
plays a rank): each call notes its arguments beside the ``Work`` it returns, in a weak
dictionary (nothing is kept once the work is gone)::

    user: w = dist.isend(x, 1, tag=3) ──> original isend ──> Work
                                          _notes[Work] = ("send", x, (1,), {"tag": 3})
    control thread, at a look: w.wait() blocks ──> noted(w) ──> Op("send", root=1, tag=3, ...)

Each send and recv is also counted per peer (blocking ``send``/``recv`` too, wrapped the same
way): a rank that returned having sent its peer as many messages as the peer waits for sent the
one the peer still waits in (on its way), rather than never sending it (engine/verdict.py's
"absent" rule)::

    isend/send to 1 returned ──> counts[("send", 1)] += 1      (a send that raised is not counted)
    irecv/recv from 0 called ──> counts[("recv", 0)] += 1, its Op's ``nth`` (the wait's number)

The note and the count cost about a microsecond a call beside gloo's tens; the arguments are
read only at a look. The wrappers replace both names torch resolves
(``torch.distributed.isend`` and ``distributed_c10d.isend``, which ``P2POp`` and
``batch_isend_irecv`` compare by identity), so pipelining's ``P2POp(dist.isend, ...)`` keeps
working. It imports nothing of mpify_nb.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from collections import Counter
from typing import Any, Callable, Optional

#: {Work: (kind, tensor, args, kwargs, its count)} of this process's isend/irecv calls still alive.
_notes: weakref.WeakKeyDictionary[Any, tuple[str, Any, tuple, dict, int]] = weakref.WeakKeyDictionary()
_originals: dict[str, Callable] = {}
#: {(kind, global peer rank or None): the sends to (recvs from) it} since :func:`reset`.
_counts: Counter[tuple[str, Optional[int]]] = Counter()
_inside = threading.local()
#: The wrapped calls: (name, kind, whether it returns a Work to note).
_WRAPPED = (("isend", "send", True), ("irecv", "recv", True), ("send", "send", False), ("recv", "recv", False))


def install() -> None:
    """Wrap ``isend``/``irecv`` so their works can be told apart at a look (idempotent; does
    nothing until torch.distributed is imported: never imports torch for it)."""
    if _originals or "torch.distributed.distributed_c10d" not in sys.modules:
        return
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:
        return
    for name, kind, returns_work in _WRAPPED:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_mpify_nb_notes", False):
            continue  # already ours (a module reloaded: _originals was reset)
        _originals[name] = original
        wrapper = _noting(original, kind, returns_work)
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)


def _noting(original: Callable, kind: str, returns_work: bool) -> Callable:
    @functools.wraps(original)
    def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "call", False):  # torch's send() made of its isend(): counted once
            return original(tensor, *args, **kwargs)
        peer = _peer(kind, args, kwargs)
        nth = 0
        if kind == "recv":  # counted as it is posted: a look at its wait knows its number
            _counts[(kind, peer)] += 1
            nth = _counts[(kind, peer)]
        _inside.call = True
        try:
            result = original(tensor, *args, **kwargs)
        except BaseException:
            if kind == "recv":
                _counts[(kind, peer)] -= 1  # it never waited for that message
            raise
        finally:
            _inside.call = False
        if kind == "send":  # counted once made (isend: issued; send: done)
            _counts[(kind, peer)] += 1
            nth = _counts[(kind, peer)]
        if returns_work and result is not None:
            try:
                _notes[result] = (kind, tensor, args, kwargs, nth)
            except TypeError:
                pass  # a Work that takes no weak reference: seen as before, peer unknown
        return result

    call._mpify_nb_notes = True  # type: ignore[attr-defined]
    return call


def _peer(kind: str, args: tuple, kwargs: dict) -> Optional[int]:
    """The global rank a send goes to (a recv comes from), from the call's arguments."""
    name = "dst" if kind == "send" else "src"
    return global_rank_of(args[0] if args else kwargs.get(name), kwargs.get(f"group_{name}"),
                          args[1] if len(args) > 1 else kwargs.get("group"))


def global_rank_of(global_rank: Any, group_rank: Any, group: Any) -> Optional[int]:
    """A call's peer or root as a global rank: its ``dst``/``src`` (``global_rank``), else its
    ``group_dst``/``group_src`` in ``group`` (None: the default group); None: any (a recv), or not said."""
    if isinstance(global_rank, int) and not isinstance(global_rank, bool):
        return global_rank
    if not isinstance(group_rank, int) or isinstance(group_rank, bool):
        return None
    if group is None:
        return group_rank
    try:
        import torch.distributed as dist

        return dist.get_global_rank(group, group_rank)
    except Exception:
        return None  # not a rank of that group


def counts() -> tuple[tuple[str, Optional[int], int], ...]:
    """This process's sends and recvs per peer since :func:`reset`: ((kind, peer, count), ...)."""
    return tuple((kind, peer, n) for (kind, peer), n in list(_counts.items()))


def count(kind: str, peer: Optional[int]) -> int:
    return _counts.get((kind, peer), 0)


def reset() -> None:
    """Its groups begin again (a call's, a Session's rebuilt group): the peers count from 0 too."""
    _counts.clear()


def noted(work: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """(``"send"``/``"recv"``, its arguments by name: tensor, dst/src, group, tag, group_dst/
    group_src) of the isend/irecv that returned ``work``, or None."""
    try:
        note = _notes.get(work)
    except TypeError:
        return None
    if note is None:
        return None
    kind, tensor, args, kwargs, nth = note
    original = _originals.get("isend" if kind == "send" else "irecv")
    if original is None:
        return None
    try:
        bound = inspect.signature(original).bind(tensor, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return kind, dict(bound.arguments, _nth=nth)
