"""A Session's live ranks: start them and their group, and hear what they send.

The lowest of the Session's rooms (ranks -> recovery -> calls ->
session): its ranks are an engine's (engine/core.py), persistent, each with a control channel;
here they are started (the group built with every live rank), their frames handled, their
deaths noted (a dead rank stays a member, dead, until restart() replaces it).
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import sys
import time
from typing import Any, Callable, Optional

from ..engine import comms, core, interrupts, members
from ..relay.pipes import OutputRelay
from ..start import placement
from ..torchdist import rendezvous
from ..wire import framing, payload
from ..wire.errors import RankError, RankExitedError, RemoteFailure, merge_rank_errors
from ..wire.protocol import (
    ABORTED,
    COMM_ACK,
    COMM_OUT,
    DISPLAY,
    DONE,
    FAIL,
    GROUP,
    NO_REQUEST,
    READY,
    STORE,
)

#: Pipe capacity for a rank's stdout/stderr: output printed between calls waits there.
_PIPE_SIZE = 1 << 20


class Member(members.Member):
    """The caller's view of one persistent rank."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.state = "starting"  # starting, idle, running, dead
        self.device = "?"
        self.req = NO_REQUEST  # the request it runs for us now
        self.answer: Optional[tuple[bytes, Any, list[int]]] = None  # (kind, body, fds) for self.req
        self.gpu_memory: Optional[int] = None
        self.aborts = 0  # ABORT_GROUP sent and not yet acknowledged
        self.last_cell = ""
        self.exit_error: Optional[RankExitedError] = None
        self.start_failure: Optional[RemoteFailure] = None
        self.control_theirs: Optional[socket.socket] = None  # the rank's end, until sent
        self.died_during = NO_REQUEST  # the call running when it died
        #: its default process group, when not the usual (the Session's with ddp, none without):
        #: "own" (a cell made its own), "none" (a cell destroyed it), "session"
        self.group: Optional[str] = None

    @property
    def alive(self) -> bool:
        return self.state != "dead"


class SessionRanks:
    """A Session's ranks: started, restarted, heard, buried."""

    #: How the error of a dead rank says to replace it (the magics say ``%dist_restart``).
    restart_how = "Session.restart()"
    _comm_to_rank: Callable[[int, dict], None]  # a frontend's message to a rank's widget (session/calls.py)

    def __init__(self, n: int, ddp: bool, gpus: Optional[list[int]], backend: Optional[str]):
        self.world_size = n
        self.ddp = ddp
        self._gpus = gpus
        self._local = placement.get_placement() == "local"
        self._backend = backend
        self.closed = False
        self._ids = itertools.count(1)
        self._current = NO_REQUEST  # the request of the call running now
        self._interrupt_asked = False
        self._group_broken = False
        self._display: Optional[Callable[[int, dict], None]] = None
        # Output is relayed on the call's thread, into the cell running now.
        self._engine = core.Engine(OutputRelay(sys.stdout, sys.stderr), pump_output=True, persistent=True)
        self._members: dict[int, Member] = self._engine.members
        for kind, handler in ((READY, self._on_ready), (STORE, self._on_store), (DISPLAY, self._on_display),
                              (DONE, self._on_done), (FAIL, self._on_fail), (ABORTED, self._on_aborted),
                              (COMM_OUT, self._on_comm)):
            self._engine.on(kind, handler)
        self._engine.on_death = self._on_death
        # widgets: ranks' comms twinned in the kernel; a frontend's message to one is a call on its
        # rank (session/calls.py)
        self._comms = comms.CommBridge(lambda rank, frame: self._comm_to_rank(rank, frame))
        self._placer: Optional[placement.Placer] = None
        self._layout = placement.Layout.on_this_machine(n, reserve_store=False)
        self._base_env: dict[str, str] = {}
        self._store_port = 0  # the port the store's host bound on its Ray node (STORE), while ranks start

    # -- starting ranks ----------------------------------------------------------------

    def _session_config(self, rank: int, rendezvous: tuple[str, int, bool]) -> dict:
        gpu: Any = "auto" if self._backend in (None, "nccl") else None
        if self._gpus is not None:
            gpu = self._gpus[rank]
        return {"world_size": self.world_size, "ddp": self.ddp, "backend": self._backend, "gpu": gpu,
                "rendezvous": rendezvous, "comms": self._comms.available()}

    def _await_aborts(self, within: float = 5.0) -> None:
        """Wait (bounded) until every live rank has acknowledged the ABORT_GROUPs sent to it: one
        a rank's control thread carried out late would destroy the group of a later cell."""
        deadline = time.monotonic() + within
        while any(m.alive and m.aborts > 0 for m in self._members.values()) and time.monotonic() < deadline:
            self._engine.pump(0.05)

    def _start(self, ranks: list[int]) -> None:
        """Start ``ranks`` (fresh processes) and, with ddp, (re)build the group with every
        live member; return once all have joined."""
        self._await_aborts()  # no rank may still be cutting connections when the new group's are made
        self._raise_if_others_dead(ranks)
        live_old = [m for m in self._members.values() if m.alive and m.rank not in ranks]
        host = min([m.rank for m in live_old] + ranks)  # the rank that hosts the store
        placer = self._placer
        assert placer is not None
        # The store lives in the host rank, on its node's address (127.0.0.1 on this machine); a
        # cell's own init_process_group meets the others there too (torchdist/rendezvous.py).
        listener: Optional[socket.socket] = None
        port = 0  # on a Ray node the host binds one itself and says which (STORE): then the others are told
        if self._local:  # bound here, handed to the host: no one can take the port meanwhile
            address = self._layout.nodes[host]
            bound = rendezvous.bind_session_store(address, self.world_size, self.ddp)
            listener, port = bound, bound.getsockname()[1]
        old = {m.rank: m for m in live_old}
        new: list[Member] = []
        told: list[Member] = []  # the old ranks sent GROUP
        req = next(self._ids)
        self._store_port = 0
        try:
            common = {"cwd": os.getcwd(), "sys_path": list(sys.path), "argv": list(sys.argv)}
            # The host first: its node is known once it is placed (again), and on Ray its port.
            for r in [host] + [r for r in ranks + list(old) if r != host]:
                if port == 0 and r != host:
                    port = self._port_from_host(new[0] if host in ranks else old[host])
                    if port == 0:
                        break  # the host failed first: the wait below says how
                store = [listener.fileno()] if listener is not None and r == host else []
                if r in old:  # the new group (with ddp) and, either way, where the store is now
                    body = pickle.dumps((self._layout.nodes[host], port, r == host))
                    self._send_request(old[r], GROUP, req, body, store, None)
                    old[r].group = None
                    told.append(old[r])
                    continue
                m = self._spawn(placer, r)
                new.append(m)
                address = self._layout.nodes[host]
                env = dict(self._base_env, MASTER_ADDR=address, MASTER_PORT=str(port), **self._layout.env_of(r))
                setup = dict(common, rank=r, env=env,
                             session=self._session_config(r, (address, port, r == host)))
                assert m.control_theirs is not None
                try:
                    framing.send(m.channel, pickle.dumps(setup), [m.control_theirs.fileno()] + store)
                except OSError:
                    pass  # died at birth; the wait below says how
                m.control_theirs.close()
                m.control_theirs = None
        except BaseException:
            for m in new:  # a rank that could not be started: a dead member, never a missing one
                self._bury(m)
            raise
        finally:
            if listener is not None:
                listener.close()  # the host rank holds it now
        self._wait_started(new, told, req)

    def _port_from_host(self, m: Member) -> int:
        """(On Ray) the port the store's host ``m`` bound on its node, once it says (STORE); 0
        when it failed or died first."""
        self._engine.relay.retarget(sys.stdout, sys.stderr)
        while self._store_port == 0:
            if not m.alive or m.start_failure is not None or (m.answer is not None and m.answer[0] == FAIL):
                return 0
            self._engine.pump(None)
        return self._store_port

    def _raise_if_others_dead(self, ranks: list[int]) -> None:
        """With ddp, a group of every rank cannot form while a rank other than ``ranks`` (those
        being started) is dead: its survivors would wait in the rendezvous until it times out."""
        dead = [m for m in self._members.values() if not m.alive and m.rank not in ranks]
        if self.ddp and dead:
            raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])

    def _spawn(self, placer: placement.Placer, r: int) -> Member:
        m, control_theirs = self._engine.spawn(placer, r, None, member=Member, control=True, pipe_size=_PIPE_SIZE)
        m.control_theirs = control_theirs  # sent with the setup
        return m

    def _wait_started(self, new: list[Member], old: list[Member], req: int) -> None:
        self._engine.relay.retarget(sys.stdout, sys.stderr)
        try:
            while True:
                failed = [m for m in new + old if not m.alive or m.start_failure is not None
                          or (m.answer is not None and m.answer[0] == FAIL)]
                if failed:
                    break
                if all(m.state == "idle" for m in new) and all(m.req == NO_REQUEST for m in old):
                    self._group_broken = False
                    return
                self._engine.pump(None)
        finally:
            self._engine.relay.end_call([fd for m in new + old for fd in m.out_fds])
        # Some rank could not start or join: nothing half-built stays behind.
        errors: list[RankError] = []
        for m in failed:
            error: Optional[RankError] = None
            if m.exit_error is not None:
                error = m.exit_error
            elif m.start_failure is not None:
                error = m.start_failure.to_error(m.rank, payload.loads)
            elif m.answer is not None:
                error = failure_of(m)
            if error is not None:
                errors.append(error)
                if m in new and m.exit_error is None:
                    m.exit_error = RankExitedError(m.rank, None, f"it could not start: {error}")
        for m in new:  # dead members, each with why: restart() tries them again
            m.process.kill()
            self._bury(m)
        self._group_broken = True
        raise merge_rank_errors(errors)


    def _bury(self, m: Member) -> None:
        """Make sure ``m``'s process is gone, then let go of everything that was its (once)."""
        if m.buried:
            return
        self._comms.close_rank(m.rank)  # widgets: its models close in the frontend
        self._engine.bury(m)
        if m.answer is not None:
            payload.close_fds(m.answer[2])
        m.state = "dead"

    def _send_request(self, m: Member, kind: bytes, req: int, body: bytes, fds: list[int],
                      label: Optional[str]) -> None:
        m.req, m.answer = req, None
        if label is not None:
            m.last_cell = label
            m.state = "running"
        self._engine.send(m, kind, req, body, fds)  # one that died: the wait sees its pidfd


    # -- what the ranks send -----------------------------------------------------------

    def _on_ready(self, m: Member, req: int, body: Any, fds: list) -> None:
        info = pickle.loads(body)
        m.device, m.state = info["device"], "idle"

    def _on_store(self, m: Member, req: int, body: Any, fds: list) -> None:
        self._store_port = pickle.loads(body)

    def _on_display(self, m: Member, req: int, body: Any, fds: list) -> None:
        bundle = pickle.loads(body)
        self._engine.relay.catch_up(m.out_fds)  # what it printed before shows first
        if self._display is not None:
            self._display(m.rank, bundle)
            return
        text = bundle.get("text/plain", "")
        for line in str(text).splitlines() or [""]:
            print(f"[rank {m.rank}] {line}")

    def _on_done(self, m: Member, req: int, body: Any, fds: list) -> None:
        self._on_answer(m, DONE, req, body, fds)

    def _on_fail(self, m: Member, req: int, body: Any, fds: list) -> None:
        if req == NO_REQUEST:
            m.start_failure = pickle.loads(body)[0]  # it could not start
            return
        self._on_answer(m, FAIL, req, body, fds)

    def _on_answer(self, m: Member, kind: bytes, req: int, body: Any, fds: list) -> None:
        if req != m.req or req == NO_REQUEST:
            payload.close_fds(fds)  # the answer to a call that gave up on it
            return
        m.answer = (kind, bytes(body) if len(body) < (1 << 20) else body, fds)
        m.req = NO_REQUEST
        if m.state == "running":
            m.state = "idle"

    def _on_aborted(self, m: Member, req: int, body: Any, fds: list) -> None:
        m.aborts -= 1

    def _on_comm(self, m: Member, req: int, body: Any, fds: list) -> None:
        """A rank's widget frame (rank/comms.py) to its twin comm in the kernel (engine/comms.py)."""
        frame = pickle.loads(body)
        self._engine.relay.catch_up(m.out_fds)  # what it printed before goes first (an Output widget captures by time)
        self._comms.from_rank(m.rank, frame)
        if "sync" in frame:  # it waits for this before it prints on (rank/comms.py: _emit)
            self._engine.send_control(m, COMM_ACK, NO_REQUEST, pickle.dumps(frame["sync"]))

    def _on_death(self, m: Member) -> None:
        if not m.alive:
            return
        noticed = time.monotonic()
        # It may have answered just before it died.
        self._engine.read_sent(m, lambda: m.req != NO_REQUEST, (DONE, FAIL))
        self._engine.unregister(m.channel, m.control, m.process.death_fd)
        # Every later call fails with this until the rank is replaced: say how.
        m.exit_error = m.death_error(
            noticed, f"Its Python state is lost; {self.restart_how} starts a fresh rank {m.rank} "
                     "and rebuilds the group (the other ranks keep their state).")
        m.state = "dead"
        self._comms.close_rank(m.rank)  # widgets: its models close in the frontend
        self._engine.gone(m)  # a capability's (the debugger's threads of it exit)
        m.died_during = self._current
        if m.answer is None:
            m.req = NO_REQUEST
        self._group_broken = self.ddp

    def _notice_deaths(self) -> None:
        """Between calls nobody watches: look now at the pidfds of ranks thought alive."""
        for m in members.ended([m for m in self._members.values() if m.alive]):
            self._on_death(m)

    def _on_sigint(self) -> None:
        # A signal handler: no lock (the main thread may hold it), a flag and a byte.
        self._interrupt_asked = True
        self._engine.wake()
        interrupts.interrupt_other_threads()  # one press stops every call, ranch's included

    def interrupt_from_signal(self) -> None:
        """The stop button, while this session's call runs on a thread other than the main one
        (engine/interrupts.py calls this from the main thread's SIGINT handler)."""
        if self._current != NO_REQUEST:
            self._interrupt_asked = True
            self._engine.wake()


def failure_of(m: Member, body: Any = None, fds: Optional[list[int]] = None) -> RankError:
    if body is None:
        assert m.answer is not None
        _kind, body, fds = m.answer
        m.answer = None
    payload.close_fds(fds or [])
    failure, _interrupted, meta = pickle.loads(body)
    if meta:
        m.gpu_memory = meta.get("gpu_memory")
        m.group = meta.get("group", m.group)
    return failure.to_error(m.rank, payload.loads)

