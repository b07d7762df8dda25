"""Where ranks are placed: the one seam between "run rank r" and a process somewhere.

A placer turns (rank, channel end, stdout/stderr write ends) into a running
process and hands back a ``RankProcess``: its pid, a way to kill it, a file
descriptor that becomes readable when it dies, and its exit code. The launcher
knows nothing else about where ranks live.

Two placers today, both on this machine:

* ``TemplatePlacer`` (default): ranks are forked from the warm template process
  (see template.py): tens of milliseconds per call.
* ``SpawnPlacer``: each rank is a brand-new interpreter (``python -c``): seconds
  per call, since each imports torch, but it shares nothing with anything.

Choose with ``mpify_nb.set_start_method("template" | "spawn")`` or the
environment variable ``MPIFY_NB_START_METHOD``. A placer for other hosts (Ray
actors) fits the same seam.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from typing import Optional, Protocol

from . import template

START_METHODS = ("template", "spawn")
_start_method = os.environ.get("MPIFY_NB_START_METHOD", "template")


def set_start_method(method: str) -> None:
    """Choose how ranks start: ``"template"`` (fork from a warm process, fast) or ``"spawn"``.

    >>> import mpify_nb
    >>> mpify_nb.set_start_method("spawn")   # every rank a fresh interpreter
    """
    global _start_method
    if method not in START_METHODS:
        raise ValueError(f"start method must be one of {START_METHODS}, not {method!r}")
    _start_method = method


def get_start_method() -> str:
    return _start_method


class RankProcess(Protocol):
    pid: int
    death_fd: Optional[int]  # readable once the process has ended (a pidfd); None if unavailable

    def kill(self) -> None: ...
    def wait_gone(self, timeout: float) -> bool: ...
    def exit_code(self, timeout: float) -> Optional[int]: ...
    def death_detail(self) -> str: ...  # why it died, when its placer knows ("" otherwise)
    def close(self) -> None: ...


class Placer(Protocol):
    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        """Start ``rank``; raise TimeoutError if it cannot be started within ``timeout`` s."""
        ...


def get_placer() -> Placer:
    if _start_method not in START_METHODS:
        raise ValueError(f"MPIFY_NB_START_METHOD must be one of {START_METHODS}, not {_start_method!r}")
    return TemplatePlacer() if _start_method == "template" else SpawnPlacer()


class _Pidfd:
    """Kill and watch a process by pidfd, immune to pid reuse."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.death_fd: Optional[int] = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self.death_fd = None  # already gone (ESRCH), or an old kernel

    def kill(self) -> None:
        try:
            if self.death_fd is not None:
                signal.pidfd_send_signal(self.death_fd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass

    def wait_gone(self, timeout: float) -> bool:
        """Wait until the process has ended; True if it has."""
        if self.death_fd is None:
            return True
        return bool(select.select([self.death_fd], [], [], timeout)[0])

    def close(self) -> None:
        if self.death_fd is not None:
            os.close(self.death_fd)
            self.death_fd = None

    def death_detail(self) -> str:
        return ""


class _ForkedRank(_Pidfd):
    def __init__(self, client: template.TemplateClient, pid: int):
        super().__init__(pid)
        self._client = client
        self._code: Optional[int] = None

    def exit_code(self, timeout: float) -> Optional[int]:
        if self._code is None:
            self._code = self._client.exit_code(self.pid, timeout)
        return self._code

    def death_detail(self) -> str:
        if self._client.alive():
            return ""
        return f"the template process it was forked from (pid {self._client.pid}) died, and its ranks with it"


class TemplatePlacer:
    def __init__(self) -> None:
        self._client = template.get_template()

    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        fds = [channel_fd, stdout_fd, stderr_fd]
        limit = _TEMPLATE_PATIENCE if timeout is None else timeout
        try:
            try:
                pid = self._client.fork(fds, limit)
            except template.TemplateUnresponsive:
                raise
            except template.TemplateDied:
                # Died since we last used it (killed, OOM): one fresh template, then give up.
                self._client = template.get_template()
                pid = self._client.fork(fds, limit)
        except template.TemplateUnresponsive as e:
            if timeout is None:
                raise
            raise TimeoutError(f"rank {rank} could not be started within the call's timeout: {e}") from None
        return _ForkedRank(self._client, pid)


#: Seconds a call without a timeout waits for the template to start (it imports torch) and fork.
_TEMPLATE_PATIENCE = 120.0


class _SpawnedRank(_Pidfd):
    def __init__(self, proc: subprocess.Popen):
        super().__init__(proc.pid)
        self._proc = proc

    def exit_code(self, timeout: float) -> Optional[int]:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class SpawnPlacer:
    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        proc = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from mpify_nb.rank import main; main(int(sys.argv[1]), int(sys.argv[2]))",
             str(channel_fd), str(os.getpid())],
            pass_fds=[channel_fd],
            stdin=subprocess.DEVNULL,
            stdout=stdout_fd,
            stderr=stderr_fd,
            env=template.bootstrap_env(),
            **template.own_process_group(),
        )
        return _SpawnedRank(proc)
