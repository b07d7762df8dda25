"""The caller's handle on one rank placed by Ray: the bridge between the launcher's channel
and the rank's link, and what the launcher asks of any rank (kill, exit code, why it died)."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
from typing import Any, Callable, Optional, Protocol

from ...wire import framing, payload
from .link import deliver, frames, send_frame, send_message, write_all

#: Seconds a killed rank's worker has to confirm it is gone before Ray kills the worker.
KILL_GRACE = 3.0


class Host(Protocol):
    """What a rank's handle, and the hub's Tunnel (client.py), need of the ``RayPlacer`` that
    made them (placer.py, which imports them, is the one that does all this)."""

    ray: Any  # the ray module
    token: bytes  # the call's secret: the first bytes on every link
    lock: threading.Lock  # held while ``ranks`` changes
    ranks: dict[int, RayRank]  # the call's ranks placed by Ray, by rank

    def spawn(self, target: Callable[..., Any], name: str, *args: Any) -> None:
        """Run ``target(*args)`` on a daemon thread called ``name``."""
        ...

    def submit(self, handle: RayRank, setup: bytes | bytearray, call: bytes | bytearray, fds: list[int]) -> Any:
        """Start ``handle``'s rank on its bundle; return the Ray task's ObjectRef."""
        ...


class RayRank:
    """The caller's handle on one rank placed by Ray (a ``placement.RankProcess``)."""

    #: Its link reports the death of its worker or node within this (a peer's collective may fail sooner).
    death_latency = 1.0
    shares_clock = False  # its errors' timestamps come from another host's clock

    def __init__(self, placer: Host, rank: int, node: str, channel_fd: int, stdout_fd: int, stderr_fd: int):
        self.placer = placer
        self.rank = rank
        self.node = node
        self.pid = 0  # the rank's pid on its node, once it called back
        self._channel = socket.socket(fileno=os.dup(channel_fd))
        self._out, self._err = os.dup(stdout_fd), os.dup(stderr_fd)
        self._death_r, self._death_w = os.pipe2(os.O_CLOEXEC)
        self.death_fd: Optional[int] = self._death_r
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self._link: Optional[socket.socket] = None
        self._send_lock = threading.Lock()  # the link has two writers with a Session's control channel
        self._control: Optional[socket.socket] = None  # a Session rank's second channel
        self._lent: list[int] = []  # the call's memfds
        self._task: Any = None
        self._killed = False
        self._death_signalled = False
        self._code: Optional[int] = None
        self._detail = ""

    # -- the bridge ------------------------------------------------------------------------

    def bridge(self) -> None:
        """Take the setup and the call, start the task, then carry the channel both ways."""
        try:
            setup = framing.recv(self._channel)
            if setup is None:
                return  # the launcher gave up before sending it
            if pickle.loads(setup[0]).get("session"):
                # A Session's rank: no call follows, and its setup brings the end of a second
                # channel (interrupts, collective watch), carried over the link as "c" frames.
                self._control = socket.socket(fileno=setup[1][0])
                payload.close_fds(setup[1][1:])
                call: Optional[tuple[Any, list[int]]] = (b"", [])
            else:
                payload.close_fds(setup[1])
                call = framing.recv(self._channel)
            if call is None:
                return  # the launcher gave up before sending the call
            self._lent = call[1]  # open until the rank ends: its worker may map them (see submit)
            self._task = self.placer.submit(self, setup[0], call[0], call[1])
            self.placer.spawn(self._watch_task, f"mpify_nb-ray-task{self.rank}")
            with self._cond:
                self._cond.wait_for(lambda: self._link is not None or self._killed or self.ended.is_set())
                link = self._link
            if link is None:
                return
            self.placer.spawn(self._from_rank, f"mpify_nb-ray-from{self.rank}", link)
            if self._control is not None:
                self.placer.spawn(self._control_to_rank, f"mpify_nb-ray-control{self.rank}", link, self._control)
            while True:  # launcher -> rank
                message = framing.recv(self._channel)
                if message is None:
                    break
                with self._send_lock:
                    send_message(link, *message)
        except Exception as e:
            if not self._killed:
                self._end(f"its link to the caller broke: {type(e).__name__}: {e}")
        finally:
            if self._link is None and self._task is None:
                self._end("")

    def _control_to_rank(self, link: socket.socket, control: socket.socket) -> None:
        try:
            while True:
                message = framing.recv(control)
                if message is None:
                    return  # the Session let go of it: the rank is being buried
                with self._send_lock:
                    send_frame(link, b"c", [message[0]])
        except (OSError, EOFError):
            pass

    def attach(self, link: socket.socket, pid: int) -> bool:
        with self._cond:
            if self._link is not None or self._killed or self.ended.is_set():
                return False
            self._link, self.pid = link, pid
            self._cond.notify_all()
        return True

    def _from_rank(self, link: socket.socket) -> None:
        """Rank -> caller: output into the relay's pipes, messages into the launcher's channel."""
        try:
            for kind, parts in frames(link):
                if kind == b"o":
                    write_all(self._out, parts[0])
                elif kind == b"e":
                    write_all(self._err, parts[0])
                elif kind == b"m":
                    deliver(self._channel, parts)
                elif kind == b"c" and self._control is not None:
                    framing.send(self._control, parts[0])
                elif kind == b"x":  # the last frame: the rank has exited
                    self._code = struct.unpack("!i", parts[0])[0]
                    break
        except (OSError, EOFError, ConnectionError):
            pass
        detail = ""
        if self._code is None and not self._killed and self._task is not None:
            self._signal_death()  # the launcher learns now; exit_code() and death_detail() wait for Ray
            detail = "its link to the caller broke: its Ray worker or its node died"
            try:  # Ray may already know which (it learns of a dead node later: not worth waiting for)
                self.placer.ray.get(self._task, timeout=0.5)
            except Exception as e:
                if type(e).__name__ != "GetTimeoutError":
                    detail = _explain(e, self.node)
        self._end(detail)

    def _watch_task(self) -> None:
        """The task's own end: how a worker or node that died, or a task that never started, is seen."""
        ray = self.placer.ray
        detail = ""
        try:
            ray.get(self._task)
        except Exception as e:
            if not self._killed:
                detail = _explain(e, self.node)
        with self._cond:
            linked = self._link is not None
        if detail or not linked:
            self._end(detail)

    def _end(self, detail: str) -> None:
        """The rank is gone: the launcher sees its channel close and its death fd turn readable."""
        with self._cond:
            if self.ended.is_set():
                return
            if detail:
                self._detail = detail
            self.ended.set()
            self._cond.notify_all()
            link = self._link
        if link is not None:
            try:
                link.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            link.close()
        closes = [self._channel.close, lambda: os.close(self._out), lambda: os.close(self._err),
                  lambda: payload.close_fds(self._lent)]
        if self._control is not None:
            closes.append(self._control.close)
        for close in closes:
            try:
                close()
            except OSError:
                pass
        self._signal_death()

    def _signal_death(self) -> None:
        with self._cond:
            if self.death_fd is not None and not self._death_signalled:
                self._death_signalled = True
                os.write(self._death_w, b"x")

    def node_left(self) -> None:
        self._end(f"its node {self.node} left the Ray cluster")  # before kill(), whose own end says less
        self.kill()

    # -- placement.RankProcess -------------------------------------------------------------

    def kill(self) -> None:
        with self._cond:
            if self._killed:
                return
            self._killed = True
            self._cond.notify_all()
            link, task = self._link, self._task
        if link is not None:
            try:
                link.shutdown(socket.SHUT_RDWR)  # the worker kills the rank and its group at once
            except OSError:
                pass
        if task is not None:
            threading.Thread(target=self._make_sure, args=(task,), name="mpify_nb-ray-kill", daemon=True).start()
        else:
            self._end("")

    def _make_sure(self, task: Any) -> None:
        ray = self.placer.ray
        done, _ = ray.wait([task], timeout=KILL_GRACE)
        if not done:  # a worker that does not answer: Ray kills the worker process
            try:
                ray.cancel(task, force=True)
            except Exception:
                pass
            ray.wait([task], timeout=KILL_GRACE)
        self._end("")

    def wait_gone(self, timeout: float) -> bool:
        return self.ended.wait(timeout)

    def exit_code(self, timeout: float) -> Optional[int]:
        self.ended.wait(timeout)
        return self._code

    def death_detail(self) -> str:
        where = f"on node {self.node}" + (f" (pid {self.pid})" if self.pid else "")
        return f"{where}: {self._detail}" if self._detail else where

    def sigkill_cause(self) -> str:
        return ""  # its cgroup is on its node: not read from here

    def kill_leftovers(self) -> None:
        pass  # its worker killed the rank's process group (on its node) before answering

    def close(self) -> None:
        with self._cond:
            if self.death_fd is None:
                return
            self.death_fd = None
            os.close(self._death_r)
            os.close(self._death_w)


def _explain(error: BaseException, node: str) -> str:
    name = type(error).__name__
    text = str(error).strip().splitlines()
    first = next((line for line in text if line.strip()), "")
    if "NodeDied" in name or "node" in first.lower() and "died" in first.lower():
        return f"its node {node} left the Ray cluster ({name})"
    if "WorkerCrashed" in name or "ActorDied" in name:
        return f"the Ray worker process hosting it on {node} died ({name}: {first[:200]})"
    # A RayTaskError's first line names only the task and worker; what went wrong is its last.
    last = next((line.strip() for line in reversed(text) if line.strip()), "")
    return f"its Ray task failed: {name}: {first[:300]}" + (f" ... {last[:300]}" if last != first.strip() else "")
