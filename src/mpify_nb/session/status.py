"""What a look at a Session's ranks answers: ``Session.status()``'s rows (``RankStatus``: pid,
state, device, memory, last cell; ``%dist_status`` shows them as a table) and
``Session.where()``'s (``RankWhere``: what each rank does, its line, its stack, what it waits in)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..engine.where import RankWhere, Where


@dataclass
class RankStatus:
    """One rank's row of :meth:`Session.status` (``%dist_status`` shows the same as a table).

    Attributes:
        rank: the rank.
        pid: its process id (on its node).
        state: ``"idle"``, ``"running"`` or ``"dead"``.
        device: ``"cpu"`` or its GPU, ``"cuda:k"``.
        rss: resident memory in bytes (None once dead, or on another host).
        gpu_memory: bytes allocated by torch on its GPU; None without CUDA.
        last_cell: the first line of the last thing it ran.
        exit_detail: how it died ("" while it lives).
        node: the address of the host it runs on (a Ray node's, under Ray).
        group: its default process group: ``"session"`` (the Session's own, made by ``ddp=True``),
            ``"own"`` (one a cell made with ``init_process_group``), ``"none"``.

    Example (a notebook cell):

    ```python
    from mpify_nb import Session

    with Session(2) as s:
        s.run("x = rank * 10")
        for row in s.status():
            print(row.rank, row.state, row.last_cell, row.rss > 0)
    ```

    ```output
    0 idle x = rank * 10 True
    1 idle x = rank * 10 True
    ```
    """

    rank: int
    pid: int
    state: str
    device: str
    rss: Optional[int]
    gpu_memory: Optional[int]
    last_cell: str
    exit_detail: str = ""
    node: str = "127.0.0.1"
    group: str = "none"


def _rss(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


__all__ = ["RankStatus", "RankWhere", "Where"]
