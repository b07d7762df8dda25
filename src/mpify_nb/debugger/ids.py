"""One id space for the frontend: a rank's thread, frame and variable ids renumbered.

Every debugger numbers its threads, frames and variables from 1 (pydevd does), so two ranks
would both call their main thread 1. The frontend must see one debugger: a rank's ids become
global ids from :data:`BASE` up, while the kernel's own pass unchanged (they stay below it: its
debugpy numbers threads and variables from 1 and names frames by address, under 2**47)::

    rank 1's thread 1   <──>  2**52 + 0       kernel's thread 1  <──>  1
    rank 0's thread 1   <──>  2**52 + 1       kernel's frame 0x7f..  <──>  0x7f..
    rank 1's frame 3    <──>  2**52 + 2

Global ids stay below 2**53, the largest integer a JavaScript number (JupyterLab's) holds exactly.
A variable reference 0 means "no children" and stays 0.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional

#: The first global id of a rank's thread, frame or variable.
BASE = 1 << 52

THREAD, FRAME, VARIABLE = "thread", "frame", "variable"
#: DAP's keys that hold an id, and its kind.
ID_KEYS = {"threadId": THREAD, "frameId": FRAME, "srcFrameId": FRAME, "variablesReference": VARIABLE}


class Ids:
    """Global ids of the ranks' ids: ``(kind, link, local id) <-> global id``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = itertools.count(BASE)
        self._global: dict[tuple[str, Any, int], int] = {}
        self._local: dict[int, tuple[str, Any, int]] = {}

    @staticmethod
    def is_rank(value: Any) -> bool:
        """Is ``value`` a rank's id (as the frontend knows it)?"""
        return isinstance(value, int) and not isinstance(value, bool) and value >= BASE

    def to_global(self, kind: str, link: Any, local: Any) -> Any:
        if not isinstance(local, int) or isinstance(local, bool) or (kind == VARIABLE and local == 0):
            return local
        key = (kind, link, local)
        with self._lock:
            found = self._global.get(key)
            if found is None:
                found = self._global[key] = next(self._next)
                self._local[found] = key
            return found

    def to_local(self, kind: str, value: Any) -> Optional[tuple[Any, int]]:
        """``(link, its own id)`` of a rank's global id of ``kind``; None for any other."""
        with self._lock:
            entry = self._local.get(value) if self.is_rank(value) else None
        if entry is None or entry[0] != kind:
            return None
        return entry[1], entry[2]

    def link_of(self, value: Any) -> Any:
        """The link whose id ``value`` is (of whatever kind), or None."""
        with self._lock:
            entry = self._local.get(value) if self.is_rank(value) else None
        return None if entry is None else entry[1]

    def threads_of(self, link: Any) -> list[int]:
        """The global ids of ``link``'s threads the frontend has heard of."""
        with self._lock:
            return [g for (kind, owner, _local), g in self._global.items() if kind == THREAD and owner is link]

    def forget(self, link: Any, kinds: tuple[str, ...] = (THREAD, FRAME, VARIABLE)) -> None:
        """``link``'s ids of ``kinds`` mean nothing any more (it resumed: its frames and
        variables are gone; it died: all of them)."""
        with self._lock:
            for key in [k for k in self._global if k[1] is link and k[0] in kinds]:
                self._local.pop(self._global.pop(key), None)

    def map(self, value: Any, convert) -> Any:
        """``value`` (a DAP message's body or arguments) with every id under ID_KEYS replaced by
        ``convert(kind, id)``, at any depth."""
        if isinstance(value, dict):
            return {k: convert(ID_KEYS[k], v) if k in ID_KEYS and isinstance(v, int)
                    else self.map(v, convert) for k, v in value.items()}
        if isinstance(value, list):
            return [self.map(v, convert) for v in value]
        return value
