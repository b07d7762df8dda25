"""Spare ranks: ranks forked before a call and, on a GPU, made ready for it (their CUDA context
made, NCCL's and cuBLAS's libraries loaded: rank/spare.py), each taken by one rank of one later
call. A fresh rank on a GPU spends ~0.5 s on that before its first step; a spare did it while the
notebook was between calls::

    a call ends (launcher/call.py) ── after_call({rank: GPU it used}) ──> the pool's thread:
        wait for the template to hold what it was asked to, then one spare per rank of that
        call that used a GPU (set_spare_ranks(n): per rank, GPU or not), up to the cap;
        a spare that fits no rank of it (another GPU, another template) goes
    the next call: TemplatePlacer.start(r) ── take(client, r) ── a spare of rank r, forked from
        this template, holding all it holds now, made in this environment ── ADOPT + fds ──>
        it is rank r (rank.loop.main); none fits: a fresh fork. A spare is used once.
    no call for ``idle`` seconds (MPIFY_NB_SPARE_IDLE, 300), the template replaced or shut
        down, spares turned off: they are killed

A spare never runs user code before its call. It is the template's child, with the template's
death signal (PDEATHSIG): the notebook's death ends the template (its control socket closes), and
the template's death its spares; a spare whose pool socket closes leaves too. On a GPU each holds
its CUDA context (a few hundred MB of the GPU's memory; docs/performance.md).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from socket import socket as Socket
from typing import Optional, Union

from ..rank.spare import ADOPT, PREPARE, PREPARED
from ..wire import framing
from . import template
from .environ import _environ
from .template_client import TemplateClient, TemplateDied

#: Seconds a spare may take to get ready (its CUDA context) before it is given up.
PREPARE_PATIENCE = 60.0


def _from_environment() -> tuple[Union[str, int], float]:
    value = os.environ.get("MPIFY_NB_SPARE_RANKS", "auto").strip().lower()
    cap: Union[str, int] = "auto"
    if value in ("0", "off", "false", "no"):
        cap = 0
    elif value.isdigit():
        cap = int(value)
    try:
        idle = float(os.environ.get("MPIFY_NB_SPARE_IDLE", "300"))
    except ValueError:
        idle = 300.0
    return cap, idle


_cap, _idle = _from_environment()


def set_spare_ranks(count: Union[str, int, bool] = "auto", *, idle: Optional[float] = None) -> None:
    """Choose how many spare ranks wait for the next call, ready on their GPU.

    ``"auto"`` (the default): after a call whose ranks (those not played by the notebook) used a
    GPU, one spare per such rank is started, its CUDA context made and its libraries loaded, so
    the next call's ranks start their first step at once. On CPU there is nothing to get ready:
    no spares. An integer ``n``: at most ``n`` spares, one per rank of the last call, on CPU too;
    ``0`` or ``False``: none (those waiting are stopped now). ``idle``: seconds spares wait for a
    call before they are stopped (300 by default). Each spare on a GPU holds its CUDA context there
    (a few hundred MB; see the Performance page). ``MPIFY_NB_SPARE_RANKS`` (``auto``, ``0``, ``n``)
    and ``MPIFY_NB_SPARE_IDLE`` set the same.

    Example (a notebook cell):

    ```python
    import mpify_nb
    mpify_nb.set_spare_ranks(0)             # no spare ranks: the GPUs hold nothing between calls
    mpify_nb.set_spare_ranks(2, idle=600)   # at most 2, stopped after 10 idle minutes
    mpify_nb.set_spare_ranks("auto")        # the default
    ```
    """
    global _cap, _idle
    if isinstance(count, bool):
        count = "auto" if count else 0
    if count != "auto" and not (isinstance(count, int) and count >= 0):
        raise ValueError(f"set_spare_ranks takes 'auto', True/False or a number >= 0, not {count!r}")
    if idle is not None and not (isinstance(idle, (int, float)) and idle > 0):
        raise ValueError(f"idle must be a positive number of seconds, not {idle!r}")
    _cap = count
    if idle is not None:
        _idle = float(idle)
    if _cap == 0:
        pool.drop_all("spare ranks were turned off")
    else:
        pool.wake()


@dataclass
class Spare:
    client: TemplateClient
    pid: int
    socket: Socket  # our end of its pool socket
    rank: int
    device: Optional[int]
    env_key: int
    death_fd: Optional[int] = None
    ready: bool = False
    report: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.death_fd is not None and not select.select([self.death_fd], [], [], 0)[0]

    def kill(self) -> None:
        try:
            if self.death_fd is not None:
                signal.pidfd_send_signal(self.death_fd, signal.SIGKILL)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.socket.close()
        except OSError:
            pass
        if self.death_fd is not None:
            os.close(self.death_fd)
            self.death_fd = None


def env_key() -> int:
    """The notebook's own environment, as a spare was made in it (CUDA_VISIBLE_DEVICES & co are
    read once, when CUDA starts: a spare made in another one cannot serve)."""
    return hash(tuple(sorted(_environ().items())))


class Pool:
    """The spare ranks of this process, and the thread that starts and stops them."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.spares: list[Spare] = []
        self.plan: dict[int, Optional[int]] = {}  # rank -> GPU: what the last call's ranks used
        self.last_call = time.monotonic()
        self.thread: Optional[threading.Thread] = None
        self.dirty = False  # the plan changed: the thread looks again

    # -- what a call does --------------------------------------------------------------------

    def take(self, client: TemplateClient, rank: int) -> Optional[Spare]:
        """A ready spare for rank ``rank`` of a call that forks from ``client`` (it leaves the pool),
        or None. One that lacks what ``client`` holds now (it grew since) is no use: it goes."""
        key = env_key()
        with self.lock:
            found = next((s for s in self.spares if s.client is client and s.rank == rank and s.ready), None)
            if found is None:
                return None
            self.spares.remove(found)
        born = client.born_with(found.pid)
        if (found.env_key == key and found.alive() and born is not None
                and len(born) == len(client.modules or ())):
            return found
        self._end([found])
        return None

    def adopt(self, spare: Spare, fds: list[int]) -> bool:
        """Hand ``spare`` its call's channel and output: from now on it is that call's rank."""
        try:
            framing.send(spare.socket, pickle.dumps((ADOPT,)), fds)
        except OSError:
            self._end([spare])
            return False
        spare.close()
        return True

    def after_call(self, used: dict[int, Optional[int]]) -> None:
        """A call ended: ``used`` maps each of its spawned ranks to the GPU it used (None: CPU)."""
        with self.lock:
            self.plan = dict(used)
            self.last_call = time.monotonic()
            self.dirty = True
            needed = bool(self._wanted()) or bool(self.spares)
            self.lock.notify_all()
        if needed:
            self._start_thread()

    def wake(self) -> None:
        with self.lock:
            self.dirty = True
            self.lock.notify_all()

    def drop(self, client: TemplateClient) -> None:
        """``client`` stops serving: its spares go first (a retiring template waits for its ranks)."""
        with self.lock:
            gone = [s for s in self.spares if s.client is client]
            self.spares = [s for s in self.spares if s.client is not client]
        self._end(gone)

    def drop_all(self, why: str = "") -> None:
        with self.lock:
            gone, self.spares = self.spares, []
        self._end(gone)

    def status(self) -> list[dict]:
        """The spares waiting now: pid, rank, GPU, ready, and their PREPARED report."""
        with self.lock:
            return [{"pid": s.pid, "rank": s.rank, "device": s.device, "ready": s.ready, "report": s.report}
                    for s in self.spares]

    # -- the pool's thread -------------------------------------------------------------------

    def _start_thread(self) -> None:
        with self.lock:
            if self.thread is not None and self.thread.is_alive():
                return
            self.thread = threading.Thread(target=self._run, name="mpify_nb-spares", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        """Refill after each call; stop the spares once idle; end when none are left to keep."""
        while True:
            with self.lock:
                while not self.dirty and self.spares and time.monotonic() < self.last_call + _idle:
                    self.lock.wait(self.last_call + _idle - time.monotonic())
                if not self.dirty and not self.spares:
                    self.thread = None  # the next call that wants spares starts another
                    return
                refill, self.dirty = self.dirty, False
            if not refill:  # idle
                self.drop_all("idle")
                continue
            try:
                self._refill()
            except Exception:
                pass  # only a speed-up is lost

    def _wanted(self) -> dict[int, Optional[int]]:
        if _cap == 0:
            return {}
        if _cap == "auto":
            return {r: d for r, d in self.plan.items() if d is not None}
        return dict(list(sorted(self.plan.items()))[:int(_cap)])

    def _refill(self) -> None:
        wanted = self._wanted()
        client = template._client
        if not wanted or client is None or not client.ready:
            self.drop_all()
            return
        # Born after the template took in what this call's ranks imported: nothing left to import.
        try:
            client.wait_grown(PREPARE_PATIENCE, template.STEP_PATIENCE)
        except TemplateDied:
            return
        key = env_key()
        with self.lock:
            keep = [s for s in self.spares if s.client is client and s.env_key == key
                    and wanted.get(s.rank, -1) == s.device and s.alive()]
            gone = [s for s in self.spares if s not in keep]
            self.spares = keep
            have = {s.rank for s in keep}
        self._end(gone)
        for rank, device in wanted.items():
            if rank not in have and not self.dirty:
                spare = self._fork(client, rank, device, key)
                if spare is not None:
                    with self.lock:
                        self.spares.append(spare)
        self._wait_prepared()

    def _fork(self, client: TemplateClient, rank: int, device: Optional[int], key: int) -> Optional[Spare]:
        ours, theirs = framing.socketpair()
        try:
            pid = client.fork([theirs.fileno()], PREPARE_PATIENCE, role="spare")
        except TemplateDied:
            ours.close()
            return None
        finally:
            theirs.close()
        spare = Spare(client, pid, ours, rank, device, key)
        try:
            spare.death_fd = os.pidfd_open(pid)
        except OSError:
            pass
        env = dict(_environ(), RANK=str(rank), LOCAL_RANK=str(rank))
        try:
            framing.send(ours, pickle.dumps((PREPARE, {"env": env, "device": device})))
        except OSError:
            self._end([spare])
            return None
        return spare

    def _wait_prepared(self) -> None:
        deadline = time.monotonic() + PREPARE_PATIENCE
        while True:
            with self.lock:
                waiting = [s for s in self.spares if not s.ready]
            if not waiting or time.monotonic() > deadline:
                break
            readable, _, _ = select.select([s.socket for s in waiting], [], [], 0.5)
            for spare in waiting:
                if spare.socket not in readable:
                    continue
                message = None
                try:
                    message = framing.recv(spare.socket)
                except OSError:
                    pass
                kind, report = pickle.loads(message[0]) if message else (None, {})
                if kind == PREPARED and not report.get("error"):
                    spare.report, spare.ready = report, True
                else:
                    with self.lock:
                        if spare in self.spares:
                            self.spares.remove(spare)
                    self._end([spare])
        with self.lock:
            late = [s for s in self.spares if not s.ready]
            self.spares = [s for s in self.spares if s.ready]
        self._end(late)

    def _end(self, spares: list[Spare]) -> None:
        for spare in spares:
            spare.kill()
        for spare in spares:
            if spare.death_fd is not None:
                select.select([spare.death_fd], [], [], 5.0)  # gone before its template is judged idle
            spare.close()


pool = Pool()
template.on_replaced(pool.drop)
