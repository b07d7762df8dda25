"""A group's table kept in its store, for ranks that share no host (Ray placement across nodes).

The same calls as table.py's shared memory, through the group's own ``PrefixStore`` (the
rendezvous store torch keeps for it): each collective's description is one key, written by
its rank and read by the others; each rank deletes its key of ``RING`` collectives back, which
every peer has read by then (table.py says why). A round trip to the store per
key makes this slower than a collective on one host, but not than one between hosts; calls
that would cost more than they guard are left unchecked: point-to-point calls
(groups.py publishes them only to shared memory).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from .table import RING, Ring

_NAMESPACE = "mpify_nb.check/"
#: A waiting rank asks the store again after this, then twice as long each time, up to its slice
#: (the store's own wait would print a C++ warning at each timeout).
_FIRST_PAUSE = 1e-4


class StoreTable:
    """A group's table in its store."""

    def __init__(self, store: Any, size: int) -> None:
        self.store = store
        self.size = size
        self.pause = _FIRST_PAUSE

    @staticmethod
    def key(ring: Ring, index: int) -> str:
        return f"{_NAMESPACE}{'/'.join(str(part) for part in ring)}/{index}"

    def room(self, ring: Ring) -> int:
        return 1 << 20

    def put(self, ring: Ring, index: int, data: bytes, salt: int = 0) -> None:
        self.store.set(self.key(ring, index), data)
        if ring[0] == "c" and index >= RING:
            try:
                self.store.delete_key(self.key(ring, index - RING))
            except Exception:
                pass  # a store without deletes keeps it: a few bytes a collective

    def get(self, ring: Ring, index: int, salt: int = 0) -> Optional[bytes]:
        key = self.key(ring, index)
        if not self.store.check([key]):
            return None
        self.pause = _FIRST_PAUSE
        return bytes(self.store.get(key))

    def token(self) -> int:
        return 0

    def sleep(self, token: int, wanted: list, timeout: float, first: bool = False) -> None:
        time.sleep(min(self.pause, timeout))
        self.pause = min(self.pause * 2, timeout)

    def wake(self) -> None:
        pass  # a sleeper looks again within its slice

    def mark_attached(self, rank: int) -> None:
        pass

    def opened(self) -> None:
        pass

    def close(self) -> None:
        pass
