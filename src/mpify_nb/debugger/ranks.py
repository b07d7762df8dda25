"""The ranks the debugger panel reaches: a Session's engines adopted, their ranks attached (the
frontend's setup replayed to each, before its first cell), detached, gone; the events they send.

::

    Session's engine (engine.add_capability) ──> RankSide.install_engine: DEBUG frames, before_call,
                                                 after_call, when_gone
    frontend attaches / a call starts / threads ──> attach(rank): initialize, attach, the cells'
                                                 files, breakpoints, configurationDone
    a call ends ──> its ranks' continued read (the stop button let them go as it ended)
    a rank's event (stopped, continued, thread) ──> threads.py, its ids renumbered (ids.py)
    a rank dies or is buried ──> its threads continue (if stopped) and exit

The requests themselves are hub.py's (Hub is a RankSide).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import weakref
from typing import Any, Callable

from ..engine.core import Engine
from ..engine.members import Member
from ..wire import payload
from ..wire.protocol import NO_REQUEST
from .ids import FRAME, THREAD, VARIABLE, Ids
from .links import ANSWER_TIMEOUT, ATTACH_TIMEOUT, Pending, RankLink, Waiter, untraced_thread
from .threads import Threads

#: After a call, how long a rank that ended it gets to say it left its breakpoint.
CONTINUED_WAIT = 2.0


class RankSide:
    """The ranks of every Session this kernel made, as the debugger sees them. ``kernel_debugger`` is
    ipykernel's ``Debugger``; ``send_event`` publishes a DAP event on IOPub."""

    def __init__(self, kernel_debugger: Any, send_event: Callable[[dict], None]):
        self.kernel_debugger = kernel_debugger
        self.ids = Ids()
        self.threads = Threads(send_event)
        self.waiter = Waiter()
        self.attached = False  # the frontend attached (and has not disconnected since)
        self._lock = threading.Lock()
        self._engines: weakref.WeakSet[Engine] = weakref.WeakSet()
        self._links: dict[int, RankLink] = {}  # id(member) -> its link
        self._breakpoints: dict[str, dict] = {}  # source path -> the frontend's setBreakpoints arguments
        self._other_setup: dict[str, dict] = {}  # setExceptionBreakpoints / setFunctionBreakpoints
        self._cells: dict[str, str] = {}  # a cell's file (dumpCell) -> its code

    # -- engines and their ranks ---------------------------------------------------------------

    def install_engine(self, engine: Engine) -> None:
        """A new engine (engine.add_capability): a Session's ranks can be debugged."""
        if not engine.persistent or engine in self._engines:
            return
        from ..rank.debugger import DEBUG

        self._engines.add(engine)
        engine.on(DEBUG, lambda m, req, body, fds: self._from_rank(m, body, fds))
        engine.before_call(self._before_call)
        engine.after_call(self._after_call)
        engine.when_gone(self._member_gone)

    def _from_rank(self, m: Member, body: Any, fds: list) -> None:
        payload.close_fds(fds)
        link = self._links.get(id(m))
        if link is None or link.member is not m:
            return
        try:
            message = json.loads(bytes(body))
        except ValueError:
            return
        link.received(message)

    def _member_gone(self, engine: Engine, m: Member) -> None:
        with self._lock:
            link = self._links.pop(id(m), None)
        if link is None or link.member is not m:
            return
        link.lost()
        self.threads.exited(link, self.ids.threads_of(link))
        self.ids.forget(link)

    def _live_members(self) -> list[tuple[Engine, Member]]:
        return [(engine, m) for engine in list(self._engines) if not engine.closed
                for m in list(engine.members.values()) if not m.buried and not m.gone_told]

    def _link(self, engine: Engine, m: Member) -> RankLink:
        with self._lock:
            link = self._links.get(id(m))
            if link is None or link.member is not m:
                link = self._links[id(m)] = RankLink(engine, m, self.waiter, self._rank_event)
            return link

    def links(self) -> list[RankLink]:
        """The attached ranks, by rank."""
        with self._lock:
            found = [link for link in self._links.values() if link.state == "attached" and not link.gone]
        return sorted(found, key=lambda link: link.rank)

    # -- attaching ranks (blocking: a worker thread, or the owner's before a call) --------------------

    def attach(self, engine: Engine, m: Member) -> str:
        """Start rank ``m``'s debugger with the frontend's setup; '' or why it could not."""
        link = self._link(engine, m)
        if not self._claim(link):
            if link.state != "attached":
                link.attaching.wait(ATTACH_TIMEOUT)
            return link.failure
        return self._attach(link)

    def _claim(self, link: RankLink) -> bool:
        """Is ``link``'s attach ours to do (it was neither attached nor attaching)?"""
        with self._lock:
            if link.state in ("attached", "attaching"):
                return False
            link.state = "attaching"
            link.attaching.clear()
            return True

    def _attach(self, link: RankLink) -> str:
        pendings = [link.send("initialize", {"clientID": "mpify_nb", "adapterID": "python", "pathFormat": "path",
                                             "linesStartAt1": True, "columnsStartAt1": True,
                                             "supportsVariableType": True, "supportsVariablePaging": True}),
                    link.send("attach", {"justMyCode": True, "redirectOutput": False})]
        pendings += self._replay(link)
        pendings.append(link.send("configurationDone"))
        self.waiter.wait(pendings, ATTACH_TIMEOUT)
        failures = [p.failure() for p in pendings if p.failure()]
        with self._lock:
            link.failure = failures[0] if failures else ""
            link.state = "failed" if failures else "attached"
        link.attaching.set()
        return link.failure

    def _replay(self, link: RankLink) -> list[Pending]:
        """What the frontend set up so far, for a rank that comes late."""
        with self._lock:
            cells, breakpoints, other = dict(self._cells), dict(self._breakpoints), dict(self._other_setup)
        pendings = [link.send("mpifyWriteCell", {"path": path, "code": code}) for path, code in cells.items()]
        pendings += [link.send("setBreakpoints", arguments) for arguments in breakpoints.values()]
        pendings += [link.send(command, arguments) for command, arguments in other.items()]
        return pendings

    def attach_all(self, within: float = ATTACH_TIMEOUT) -> list[str]:
        """Every live rank of every Session attached, all at once; why some could not. A rank
        still starting its debugger after ``within`` seconds goes on attaching in the background
        (a call waits for it first: before_call), and is named."""
        started: list[RankLink] = []
        for engine, m in self._live_members():
            link = self._link(engine, m)
            if self._claim(link):
                untraced_thread(lambda link=link: self._attach(link), f"mpify_nb-debugger-attach-{m.rank}").start()
            if link.state != "attached":
                started.append(link)
        deadline = time.monotonic() + within
        failures = []
        for link in started:
            if not link.attaching.wait(max(0.0, deadline - time.monotonic())) or link.state == "attaching":
                failures.append(f"rank {link.rank} is still starting its debugger")
            elif link.failure:
                failures.append(link.failure)
        return failures

    def _before_call(self, engine: Engine, members: list) -> None:
        """A call is about to start (on its thread): ranks that came since (restarted, new)
        take the frontend's breakpoints first, or the cell would run past them."""
        self.threads.unfocus()
        if not self.attached:
            return
        for m in members:
            link = self._links.get(id(m))
            if not m.buried and (link is None or link.member is not m or link.state != "attached"):
                why = self.attach(engine, m)
                if why:  # the cell runs on, without the panel's breakpoints on that rank
                    print(f"[mpify_nb] the debugger could not attach to rank {m.rank}: {why}", file=sys.stderr)

    def _after_call(self, engine: Engine, members: list) -> None:
        """A call is over (on its thread): a rank that ended it holds no thread at a breakpoint,
        but the panel may still show one stopped. The stop button (or a timeout) let it go, and
        its continued event left the rank as the call ended, on a channel nobody reads between
        calls: read it now, or say continued for it after CONTINUED_WAIT (else the panel showed
        the rank stopped until the next request or cell)."""
        links = [self._links.get(id(m)) for m in members if m.req == NO_REQUEST]
        held = [link for link in links if link is not None and not link.gone and self.threads.stopped(link)]
        if not held:
            return
        deadline = time.monotonic() + CONTINUED_WAIT
        while any(self.threads.stopped(link) for link in held) and time.monotonic() < deadline:
            engine.pump_idle(0.05)  # the owner's loop lock is this thread's: it reads here
        late = [link for link in held if self.threads.stopped(link)]  # (a continued read did the rest)
        self.threads.resume([g for link in late for g in self.threads.stopped(link)])
        for link in late:
            self.ids.forget(link, (FRAME, VARIABLE))  # its frames and variables are gone

    def detach_all(self, within: float = ANSWER_TIMEOUT) -> None:
        """The frontend turned its debugger off: ranks drop their breakpoints and run on."""
        links = self.links()
        with self._lock:
            sources = list(self._breakpoints.values())
        pendings: list[Pending] = []
        for link in links:
            pendings += [link.send("setBreakpoints", dict(arguments, breakpoints=[], lines=[]))
                         for arguments in sources]
            pendings.append(link.send("setExceptionBreakpoints", {"filters": []}))
            stopped = self.threads.stopped(link)
            if stopped:
                local = self.ids.to_local(THREAD, stopped[0])
                if local is not None:
                    pendings.append(link.send("continue", {"threadId": local[1]}))
            pendings.append(link.send("mpifyDetach"))
            link.state = "detached"
        self.threads.resume([g for link in links for g in self.threads.stopped(link)])
        self.waiter.wait(pendings, within)

    # -- events -----------------------------------------------------------------------------------

    def _rank_event(self, link: RankLink, event: dict) -> None:
        """A DAP event from a rank (on the thread that runs its engine's loop)."""
        name = event.get("event")
        body = self.ids.map(dict(event.get("body") or {}), lambda kind, v: self.ids.to_global(kind, link, v))
        thread = body.get("threadId")
        if name == "stopped" and thread is not None:
            self.threads.on_stopped(link, thread, dict(body, allThreadsStopped=False))
        elif name == "continued":
            mine = self.threads.stopped(link)
            self.threads.resume(mine if body.get("allThreadsContinued") else [t for t in mine if t == thread])
            self.ids.forget(link, (FRAME, VARIABLE))  # its frames and variables are gone
        elif name == "thread":
            self.threads.event("thread", body)

    def kernel_event(self, event: dict) -> None:
        """A DAP event from the kernel's own debugpy (ipykernel's event_callback)."""
        name = event.get("event")
        body = dict(event.get("body") or {})
        thread = body.get("threadId")
        if name == "stopped" and thread is not None:
            if self._links:
                body["allThreadsStopped"] = False  # the ranks still run
            self.threads.on_stopped(None, thread, body)
        elif name == "continued":
            mine = self.threads.stopped(None)
            self.threads.resume(mine if body.get("allThreadsContinued") else [t for t in mine if t == thread])
        else:
            self.threads.event(str(name), body)

