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

The note costs one dictionary insert per call (about a microsecond beside gloo's tens); the
arguments are read only at a look. The wrappers replace both names torch resolves
(``torch.distributed.isend`` and ``distributed_c10d.isend``, which ``P2POp`` and
``batch_isend_irecv`` compare by identity), so pipelining's ``P2POp(dist.isend, ...)`` keeps
working. It imports nothing of mpify_nb.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any, Callable, Optional

#: {Work: (kind, tensor, args, kwargs)} of this process's isend/irecv calls still alive.
_notes: weakref.WeakKeyDictionary[Any, tuple[str, Any, tuple, dict]] = weakref.WeakKeyDictionary()
_originals: dict[str, Callable] = {}


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
    for name, kind in (("isend", "send"), ("irecv", "recv")):
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_mpify_nb_notes", False):
            continue  # already ours (a module reloaded: _originals was reset)
        _originals[name] = original
        wrapper = _noting(original, kind)
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)


def _noting(original: Callable, kind: str) -> Callable:
    @functools.wraps(original)
    def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        work = original(tensor, *args, **kwargs)
        if work is not None:
            try:
                _notes[work] = (kind, tensor, args, kwargs)
            except TypeError:
                pass  # a Work that takes no weak reference: seen as before, peer unknown
        return work

    call._mpify_nb_notes = True  # type: ignore[attr-defined]
    return call


def noted(work: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """(``"send"``/``"recv"``, its arguments by name: tensor, dst/src, group, tag, group_dst/
    group_src) of the isend/irecv that returned ``work``, or None."""
    try:
        note = _notes.get(work)
    except TypeError:
        return None
    if note is None:
        return None
    kind, tensor, args, kwargs = note
    original = _originals.get("isend" if kind == "send" else "irecv")
    if original is None:
        return None
    try:
        bound = inspect.signature(original).bind(tensor, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return kind, dict(bound.arguments)
