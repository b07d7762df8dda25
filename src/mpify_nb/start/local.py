"""Ranks on this machine: forked from the warm template (``TemplatePlacer``, the default) or
each a brand-new interpreter (``SpawnPlacer``); either way watched and killed through its
pidfd, immune to pid reuse."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from typing import Optional

from . import oom, spares, template, template_client
from .environ import bootstrap_env, own_process_group
from .placer import Layout, RankProcess


class _OnThisMachine:
    ships_environ = True
    _layout: Optional[Layout] = None

    def ready(self, timeout: Optional[float]) -> float:
        return 0.0  # nothing to start first

    def reserve(self, nprocs: int, caller_rank: Optional[int], timeout: Optional[float]) -> Layout:
        self._layout = Layout.on_this_machine(nprocs)
        return self._layout

    def release(self) -> None:
        if self._layout is not None:
            self._layout.let_go_of_store()


class _Pidfd:
    """Kill and watch a process by pidfd, immune to pid reuse."""

    death_latency = 0.0  # a pidfd is readable the moment the process is gone
    shares_clock = True

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.death_fd: Optional[int] = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self.death_fd = None  # already gone (ESRCH), or an old kernel
        self._oom = oom.OomWatch(pid)  # its cgroup's OOM-kill count now, to tell who killed it

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

    def sigkill_cause(self) -> str:
        return self._oom.cause()

    def kill_leftovers(self) -> None:
        # A rank leads its own process group; its id is not reused while a member lives.
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass


class _ForkedRank(_Pidfd):
    def __init__(self, client: template_client.TemplateClient, pid: int):
        super().__init__(pid)
        self._client = client
        self._code: Optional[int] = None
        #: the modules it was born holding (its template's): a call need not ask it to import them
        self.modules_held: Optional[frozenset[str]] = client.born_with(pid)

    def exit_code(self, timeout: float) -> Optional[int]:
        if self._code is None:
            self._code = self._client.exit_code(self.pid, timeout)
        return self._code

    def death_detail(self) -> str:
        if self._client.alive():
            return ""
        return (f"the template process it was forked from (pid {self._client.pid}) died "
                f"({self._client.how_it_ended()}), and its ranks with it")


class TemplatePlacer(_OnThisMachine):
    def __init__(self) -> None:
        self._client: Optional[template_client.TemplateClient] = None

    def ready(self, timeout: Optional[float]) -> float:
        """Wait for the template to start and to hold what the ranks need; return the seconds that
        took (no call's timeout counts them: start/template.py)."""
        self._client, waited = template.ready_for_call()
        return waited

    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        if self._client is None:
            self.ready(timeout)
        fds = [channel_fd, stdout_fd, stderr_fd]
        assert self._client is not None
        spare = spares.pool.take(self._client, rank)  # forked before the call, ready on its GPU
        if spare is not None and spares.pool.adopt(spare, fds):
            return _ForkedRank(self._client, spare.pid)
        limit = _TEMPLATE_PATIENCE if timeout is None else timeout
        try:
            pid = self._fork(fds, limit)
        except template_client.TemplateUnresponsive as e:
            if timeout is None:
                raise
            raise TimeoutError(f"rank {rank} could not be started within the call's timeout: {e}") from None
        assert self._client is not None
        return _ForkedRank(self._client, pid)

    def _fork(self, fds: list[int], limit: float) -> int:
        died = False
        for _ in range(_RETIRED_TRIES):
            assert self._client is not None
            try:
                return self._client.fork(fds, limit)
            except template_client.TemplateUnresponsive:
                raise
            except template_client.TemplateRetired:
                pass  # replaced since this call began (a module made it unsafe): the current one forks it
            except template_client.TemplateDied:
                if died:
                    raise
                died = True  # died since we last used it (killed, OOM): one fresh template, then give up
            self._client = template.get_template()
        assert self._client is not None
        return self._client.fork(fds, limit)


#: Seconds a call without a timeout waits for the template to fork a rank.
_TEMPLATE_PATIENCE = 120.0
#: Templates a call asks for one rank when each retires (is replaced) under it.
_RETIRED_TRIES = 3


class _SpawnedRank(_Pidfd):
    def __init__(self, proc: subprocess.Popen):
        super().__init__(proc.pid)
        self._proc = proc

    def exit_code(self, timeout: float) -> Optional[int]:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class SpawnPlacer(_OnThisMachine):
    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        proc = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from mpify_nb.rank.loop import main; main(int(sys.argv[1]), int(sys.argv[2]))",
             str(channel_fd), str(os.getpid())],
            pass_fds=[channel_fd],
            stdin=subprocess.DEVNULL,
            stdout=stdout_fd,
            stderr=stderr_fd,
            env=bootstrap_env(),
            **own_process_group(),
        )
        return _SpawnedRank(proc)
