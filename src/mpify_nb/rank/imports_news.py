"""What a ``ranch`` rank imports, told to its caller as it goes (IMPORTED frames), so the
template imports it too, beside the call, and the next call's ranks are born holding it
(start/template.py, start/preload.py)::

    rank: born()            the modules it was born with (its template's): no news
    reporter thread         every 0.1 s while sys.modules grows (backing off to 2 s when it
                            does not): the new names, with their files ── IMPORTED ──> caller
    report(channel, req)    the rest, before the rank's answer; and the GPU it used, if any
                            (GPU_USED: a spare rank gets it ready for the next call)

A training loop pays nothing for it: the thread compares one length most of the time.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from typing import Callable, Optional

from ..wire.protocol import GPU_USED, IMPORTED, pack
from . import control

_born_with: set[str] = set()
_told: set[str] = set()
_lock = threading.Lock()
#: len(sys.modules) when _born_with last took in all of it (a template: before its forks)
_held_len = -1

#: Seconds between two looks at sys.modules: the first, and the most when nothing changes.
FIRST_LOOK, SLOWEST_LOOK = 0.1, 2.0
#: Names held since birth, read in a row from the end of sys.modules, past which nothing is news.
_PAST_BIRTH = 32


def hold_current() -> None:
    """``_born_with`` takes in every module held now (a template, before it forks). A rank forked
    then need not read all their names at birth: each read writes the name's reference count,
    and copies its page from the template (~2 ms for a rank born holding torch)."""
    global _held_len
    if len(sys.modules) != _held_len:
        _born_with.update(sys.modules)
        _held_len = len(sys.modules)


def born() -> None:
    """This rank was just born: what it holds now is its template's, not news."""
    hold_current()  # nothing to read when its template did, just before the fork


def news() -> list[tuple[str, Optional[str]]]:
    """The modules imported here since birth and not told yet, as (name, file), in import order."""
    with _lock:
        found = _newest()
        _told.update(name for name, _ in found)
    return found


def _newest() -> list[tuple[str, Optional[str]]]:
    # sys.modules keeps import order, and what a rank imports after its birth comes after what it
    # was born holding: read from the end, until a run of names held since birth (reading them all
    # would copy every page they sit on from the template). A module deleted and imported again
    # may hide one imported before it: only a speed-up is lost (the template would hold it).
    for _ in range(3):
        try:
            found, held_in_a_row = [], 0
            for name in reversed(sys.modules):
                if name in _born_with:
                    held_in_a_row += 1
                    if held_in_a_row >= _PAST_BIRTH:
                        break
                    continue
                held_in_a_row = 0
                module = sys.modules.get(name)
                if name not in _told and module is not None:
                    found.append((name, getattr(module, "__file__", None)))
            found.reverse()
            return found
        except RuntimeError:  # another thread imported meanwhile: read again
            continue
    return [(name, getattr(module, "__file__", None)) for name, module in list(sys.modules.items())
            if name not in _born_with and name not in _told and module is not None]


def watch(send: Callable[[bytes], None]) -> None:
    """Tell ``send`` (a frame to the caller) what this rank imports, as it goes, on a daemon thread."""
    threading.Thread(target=_watch, args=(send,), name="mpify_nb-imports", daemon=True).start()


def _watch(send: Callable[[bytes], None]) -> None:
    seen, wait = len(sys.modules), FIRST_LOOK
    while True:
        time.sleep(wait)
        count = len(sys.modules)
        if count == seen:
            wait = min(wait * 2, SLOWEST_LOOK)
            continue
        seen, wait = count, FIRST_LOOK
        try:
            found = news()
            if found:
                send(pickle.dumps(found))
        except Exception:
            return  # only a speed-up is lost


def report(channel, req: int) -> None:
    """Before the rank's answer: tell the caller what is left to tell, and which GPU it used (a
    spare rank gets it ready for the next call: start/spares.py)."""
    try:
        found = news()
        if found:
            control.send(channel, pack(IMPORTED, req, pickle.dumps(found)))
        device = gpu_used()
        if device is not None:
            control.send(channel, pack(GPU_USED, req, pickle.dumps(device)))
    except Exception:
        pass  # only a speed-up is lost


def gpu_used() -> Optional[int]:
    """The CUDA device this rank used, if it made a CUDA context (never makes one)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:
        pass
    return None
