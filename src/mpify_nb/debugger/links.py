"""The kernel's line to one rank's debugger: DAP requests out, answers back, within a time limit.

A rank's debugger (rank/debugger.py) is reached through its engine, as frames of kind DEBUG on the
rank's control channel. Answers come back on the same channel and are read by whoever runs the
engine's loop: the cell's thread while a cell runs, else the waiting thread itself
(``Engine.pump_idle``). A rank that does not answer in time gets an error reply, never a wedge::

    RankLink.send(command, arguments) ── DEBUG {"seq": n, ...} ──> rank k's control thread
    Waiter.wait([pending...], timeout)
       pump_idle(engine)  or  a cell's loop ── DEBUG {"request_seq": n} ──> RankLink.answer()
       <── the answers; None for a rank that did not answer (it is busy in C code holding the
           GIL, say) or died

Attaching a rank replays what the frontend set up (its breakpoints, the cells' files) before its
first ``configurationDone``, so a rank started or restarted while the panel is on stops where the
others do.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from typing import Any, Callable, Optional, TypeVar

from ..engine.core import Engine
from ..engine.members import Member
from ..rank.debugger import DEBUG
from ..wire.protocol import NO_REQUEST

#: How long a rank gets to answer one request, at most (a request's own time left bounds it first).
ANSWER_TIMEOUT = 5.0
#: Every request of the frontend is answered within this, whatever a rank does or the kernel's
#: own debugger holds stopped (the frontend's panel waits for each reply before the next request).
REPLY_WITHIN = 4.0
#: How long a rank gets to start its debugger and take the frontend's setup (it imports debugpy).
ATTACH_TIMEOUT = 30.0


def untraced_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread (not started) that the kernel's own debugpy never traces nor suspends,
    as ipykernel's control thread: when a breakpoint stops the kernel, debugpy suspends every
    other thread it traces, and a wait for the ranks on such a thread would never end (the
    panel wedged: every later request queues behind it on the control channel)."""
    return untraced(threading.Thread(target=target, name=name, daemon=True))



async def off_the_kernels_threads(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a thread the kernel's debugpy never suspends; the control loop stays
    free meanwhile."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: Optional[BaseException]) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the request's coroutine, which answers with it
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    untraced_thread(work, "mpify_nb-debugger-wait").start()
    return await done


T = TypeVar("T", bound=threading.Thread)


def untraced(thread: T) -> T:
    """``thread``, not started yet, marked as one of debugpy's own: never traced, never suspended."""
    vars(thread).update(pydev_do_not_trace=True, is_pydev_daemon_thread=True)
    return thread


class Pending:
    """A request sent to a rank, until its answer comes (or never does)."""

    def __init__(self, link: RankLink, request: dict):
        self.link = link
        self.request = request
        self.answer: Optional[dict] = None

    @property
    def command(self) -> str:
        return self.request.get("command", "")

    def failure(self) -> str:
        """Why there is no successful answer ('' when there is one)."""
        answer = self.answer
        if answer is None:
            if self.link.gone:
                return f"rank {self.link.rank} is gone (it died or was restarted)"
            return f"rank {self.link.rank} did not answer {self.command!r} in time (busy in C code holding the GIL?)"
        if not answer.get("success", False):
            return f"rank {self.link.rank}: {answer.get('message') or self.command + ' failed'}"
        return ""


class Waiter:
    """Where the threads that wait for ranks' answers sleep; answers wake them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait(self, pendings: list[Pending], timeout: float) -> None:
        """Until every one of ``pendings`` is answered (or its rank gone), at most ``timeout``
        seconds; the engines' control channels are read here when no cell's loop reads them."""
        deadline = time.monotonic() + timeout
        while True:
            with self.cond:
                left = [p for p in pendings if p.answer is None and not p.link.gone]
            remaining = deadline - time.monotonic()
            if not left or remaining <= 0:
                return
            step = min(0.05, remaining)
            pumped = False
            for engine in {id(p.link.engine): p.link.engine for p in left}.values():
                pumped = engine.pump_idle(step) or pumped
            if not pumped:  # a cell's loop reads them: it wakes us
                with self.cond:
                    if any(p.answer is None and not p.link.gone for p in pendings):
                        self.cond.wait(step)


class RankLink:
    """One rank's debugger, from the kernel. ``on_event(link, event)`` gets its DAP events."""

    def __init__(self, engine: Engine, member: Member, waiter: Waiter,
                 on_event: Callable[[RankLink, dict], None]):
        self.engine = engine
        self.member = member
        self.rank = member.rank
        self._waiter = waiter
        self._on_event = on_event
        self._seq = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._lock = threading.Lock()
        self.gone = False
        self.state = "new"  # new -> attaching -> attached (-> detached -> attaching ...); failed
        self.failure = ""  # why it could not attach
        self.attaching = threading.Event()  # set when an attach is over, however it went
        self.attaching.set()

    def __repr__(self) -> str:
        return f"<RankLink rank {self.rank} {self.state}>"

    def send(self, command: str, arguments: Optional[dict] = None) -> Pending:
        """Send a DAP request to the rank; its answer arrives in the returned Pending."""
        request = {"seq": next(self._seq), "type": "request", "command": command, "arguments": arguments or {}}
        pending = Pending(self, request)
        if self.gone:
            return pending
        with self._lock:
            self._pending[request["seq"]] = pending
        if not self.engine.send_control(self.member, DEBUG, NO_REQUEST, json.dumps(request).encode("utf-8")):
            self.lost()
        return pending

    def received(self, message: dict) -> None:
        """A DAP message from the rank (on the thread that runs the engine's loop)."""
        if message.get("type") == "response":
            with self._lock:
                pending = self._pending.pop(message.get("request_seq", -1), None)
            if pending is not None:
                with self._waiter.cond:
                    pending.answer = message
                self._waiter.wake()
        elif message.get("type") == "event":
            self._on_event(self, message)

    def lost(self) -> None:
        """The rank is gone: nothing it owes will come."""
        self.gone = True
        with self._lock:
            self._pending.clear()
        self.attaching.set()
        self._waiter.wake()
