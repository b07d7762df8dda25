"""The engine's view of one live rank (``Member``: its channels, its process, its output
pipes, how it died), and what a look at several of them says at once (``stirred``, ``ended``).
The engine (engine/core.py) makes one per rank it spawns; ranch's and a Session's own views
of a rank extend it (launcher/call.py, session/ranks.py)."""

from __future__ import annotations

import select
import socket
from collections.abc import Sequence
from typing import Any, Optional, TypeVar

from ..start import placement
from ..wire.errors import RankExitedError


class Member:
    """The engine's view of one live rank: its channel(s), its process, its output pipes."""

    def __init__(self, rank: int, channel: socket.socket, process: placement.RankProcess,
                 control: Optional[socket.socket] = None, out_fds: tuple[int, ...] = ()):
        self.rank = rank
        self.channel = channel
        self.process = process
        self.control = control  # a Session rank's control channel (a ranch rank's is its channel)
        self.out_fds = out_fds  # its stdout/stderr read ends, when the engine pumps them
        self.channel_open = True
        self.buried = False  # its process is gone and its fds are closed
        self.gone_told = False  # the capabilities heard that it is gone (Engine.gone)

    @property
    def pid(self) -> int:
        return self.process.pid  # on a Ray node, known once the rank has called back

    def death_error(self, when: float, hint: str = "") -> RankExitedError:
        """How it died, once it has (its exit code: waited for a little); ``when``: when its
        death was noticed."""
        self.process.wait_gone(2.0)
        error = RankExitedError(self.rank, self.process.exit_code(timeout=2.0), self.process.death_detail(), hint,
                                killed_by=self.process.sigkill_cause())
        # Before the wait: a peer's echo of this death may be timed within it; and it died up to
        # death_latency before we could see it (a rank on another host: through its link).
        error.when = when - self.process.death_latency
        return error


def stirred(members: Sequence[Member]) -> bool:
    """Has one of ``members`` died, or sent something not yet read?"""
    fds: list[Any] = [m.process.death_fd for m in members if m.process.death_fd is not None]
    fds += [m.channel for m in members if m.channel_open]
    return bool(fds) and bool(select.select(fds, [], [], 0)[0])


M = TypeVar("M", bound=Member)


def ended(members: Sequence[M]) -> list[M]:
    """Those of ``members`` whose pidfd says they are gone (between calls nobody watches)."""
    fds = [m.process.death_fd for m in members if m.process.death_fd is not None]
    gone = set(select.select(fds, [], [], 0)[0]) if fds else set()
    return [m for m in members if m.process.death_fd in gone]
