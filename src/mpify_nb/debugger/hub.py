"""The frontend's debug requests, each routed to the kernel's own debugger or to ranks, and answered.

``Hub.handle`` stands in for ipykernel's ``do_debug_request`` (the control thread's loop awaits
it). A request for a rank's thread, frame or variable goes to that rank, its ids renumbered both
ways (ids.py); one about every thread (threads, setBreakpoints, ...) goes to the kernel and to
every rank, the answers merged; anything else is the kernel's, as before::

    frontend request           kernel's debugger (ipykernel)        ranks (links.py)
    debugInfo                  its reply, + the ranks' stopped threads
    initialize / attach        first                                 attach every live rank
    dumpCell                   writes the cell's file                the file on each rank's host
    setBreakpoints ...         first (its reply is the answer)       the same, remembered for new ranks
    threads                    "kernel / MainThread"                 "rank k / MainThread"
    stackTrace / scopes /      when the id is the kernel's           when the id is rank k's
      variables / evaluate ...
    continue / next / step*    every stopped thread (one, with singleThread); one continued
                               event (threads.py). Nothing stopped, or a step of a running
                               thread: answered here, never forwarded (debugpy would never answer;
                               JupyterLab's continue names thread 1 whichever thread stopped)
    disconnect                 last                                  breakpoints cleared, let go

Waits for ranks run on a thread of their own that the kernel's own debugpy never suspends (the
control loop stays free for the kernel's debugpy meanwhile; a pool's worker would be stopped with
the kernel at a breakpoint, and the panel with it), and share one deadline per request
(links.REPLY_WITHIN): a rank that does not answer in time gets an error, a rank still starting its
debugger is attached on in the background.
"""

from __future__ import annotations

import ast
import contextvars
import json
import os
import time
from typing import Any, Optional

from .ids import FRAME, THREAD, VARIABLE
from .links import ANSWER_TIMEOUT, REPLY_WITHIN, RankLink, off_the_kernels_threads
from .ranks import RankSide

#: Requests that resume a thread.
RESUMING = ("continue", "next", "stepIn", "stepOut")
#: Names the variables panel never shows (ipykernel's list, for the ranks' namespaces too).
_HIDDEN = frozenset({"__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__",
                     "__builtins__", "__builtin__", "__display__", "get_ipython", "debugpy", "exit", "quit",
                     "In", "Out", "_oh", "_dh", "_", "__", "___"})
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: When the request being answered must be answered by (time.monotonic()).
_reply_by: contextvars.ContextVar[float] = contextvars.ContextVar("mpify_nb_debug_reply_by")


def visible(name: str) -> bool:
    """Does the variables panel show ``name`` (as ipykernel decides for the kernel's own)?"""
    return name not in _HIDDEN and not (name[:2] == "_i" or (name[:1] == "_" and name[1:2].isdigit()))


def _users_frames(frames: list[dict]) -> list[dict]:
    """A rank's stack as the user knows it: never this library's frames (pydevd's rules hide them
    already; a rank on another host has the library elsewhere), nor the process's own first frame
    below them (``python -c``'s ``<string>``, which started the rank)."""
    def path(frame: dict) -> str:
        return str((frame.get("source") or {}).get("path", ""))

    frames = [f for f in frames if not path(f).startswith(_PACKAGE + os.sep)]
    while frames and path(frames[-1]).startswith("<"):
        frames.pop()
    return frames


def reply(request: dict, success: bool = True, body: Optional[dict] = None, message: str = "") -> dict:
    """A DAP response to the frontend's ``request``."""
    out: dict = {"type": "response", "seq": request.get("seq", 0), "request_seq": request.get("seq", 0),
                 "command": request.get("command", ""), "success": success}
    if body is not None:
        out["body"] = body
    if message:
        out["message"] = message
    return out

class Hub(RankSide):
    """The one debugger the frontend sees: its requests (the ranks' side is RankSide's)."""

    # -- requests -----------------------------------------------------------------------------------

    async def handle(self, request: dict) -> dict:
        """Answer one debug_request from the frontend (ipykernel's ``do_debug_request``)."""
        command = request.get("command", "")
        special = getattr(self, "_on_" + command, None)
        token = _reply_by.set(time.monotonic() + REPLY_WITHIN)
        try:
            return await special(request) if special is not None else await self._by_ids(request)
        finally:
            _reply_by.reset(token)

    @staticmethod
    def _left() -> float:
        """Seconds the ranks may still take for the request being answered."""
        return min(ANSWER_TIMEOUT, max(0.0, _reply_by.get(time.monotonic() + REPLY_WITHIN) - time.monotonic()))

    async def _kernel(self, request: dict) -> dict:
        """The kernel's own debugger's answer. Where it raises (ipykernel's ``variables`` with a
        reference its debugpy no longer knows, say), the failure is the answer: ipykernel would
        send no reply at all, and the frontend's panel would wait for one forever."""
        try:
            return await self.kernel_debugger.process_request(request)
        except Exception as e:
            return reply(request, False, message=f"the kernel's debugger could not answer "
                                                 f"{request.get('command', '')!r}: {type(e).__name__}: {e}")

    async def _ask(self, link: RankLink, request: dict, command: Optional[str] = None,
                   arguments: Optional[dict] = None) -> dict:
        """``request`` (the frontend's; or ``command``/``arguments`` on its behalf) on rank
        ``link``, ids renumbered both ways; the answer as the frontend's reply."""
        if command is None:
            command = str(request.get("command", ""))
            arguments = self._localize(link, request.get("arguments") or {})
            if arguments is None:
                return reply(request, False, message="this id is stale: the rank ran on since")
        pending = link.send(command, arguments)
        await off_the_kernels_threads(self.waiter.wait, [pending], self._left())
        why = pending.failure()
        if why:
            return reply(request, False, message=why)
        assert pending.answer is not None
        body = self.ids.map(pending.answer.get("body") or {}, lambda kind, v: self.ids.to_global(kind, link, v))
        return reply(request, True, body)

    def _localize(self, link: RankLink, arguments: dict) -> Optional[dict]:
        """The frontend's arguments with ``link``'s global ids made its own; None if an id is
        another's (or stale)."""
        wrong: list[Any] = []

        def local(kind: str, value: Any) -> Any:
            if not self.ids.is_rank(value):
                return value
            found = self.ids.to_local(kind, value)
            if found is None or found[0] is not link:
                wrong.append(value)
                return value
            return found[1]

        out = self.ids.map(arguments, local)
        return None if wrong else out

    def _rank_of(self, arguments: dict) -> Optional[RankLink]:
        """The rank whose id ``arguments`` name (None: the kernel's, or none)."""
        for key in ("threadId", "frameId", "srcFrameId", "variablesReference"):
            link = self.ids.link_of(arguments.get(key))
            if link is not None:
                return link
        return None

    async def _by_ids(self, request: dict) -> dict:
        """The kernel's request, or a rank's when an id in it is a rank's."""
        arguments = request.get("arguments") or {}
        link = self._rank_of(arguments)
        if link is None:
            if self.ids.is_rank(arguments.get("threadId")) or self.ids.is_rank(arguments.get("frameId")) \
                    or self.ids.is_rank(arguments.get("variablesReference")):
                return reply(request, False, message="this id is stale: the rank ran on, or is gone")
            return await self._kernel(request)
        if link.gone:
            return reply(request, False, message=f"rank {link.rank} is gone")
        return await self._ask(link, request)

    # -- requests that every debugger takes ---------------------------------------------------------------

    async def _on_debugInfo(self, request: dict) -> dict:
        answer = await self._kernel(request)
        body = answer.get("body")
        if isinstance(body, dict):
            body["stoppedThreads"] = sorted(set(body.get("stoppedThreads") or []) | set(self.threads.stopped()))
        return answer

    async def _on_attach(self, request: dict) -> dict:
        answer = await self._kernel(request)
        if answer.get("success"):
            self.attached = True
            failures = await off_the_kernels_threads(self.attach_all, self._left())
            if failures:
                answer = dict(answer, message="; ".join(failures))
        return answer

    async def _on_disconnect(self, request: dict) -> dict:
        if self.attached:
            self.attached = False
            await off_the_kernels_threads(self.detach_all, self._left())
        with self._lock:
            self._breakpoints.clear()
            self._other_setup.clear()
        answer = await self._kernel(request)
        # the kernel's debugpy lets its threads go without a continued event: none is stopped now
        # (a continue sent to a thread it believes stopped would never be answered)
        self.threads.resume(self.threads.stopped(None))
        return answer

    async def _on_dumpCell(self, request: dict) -> dict:
        answer = await self._kernel(request)
        path = (answer.get("body") or {}).get("sourcePath")
        code = (request.get("arguments") or {}).get("code")
        if answer.get("success") and isinstance(path, str) and isinstance(code, str):
            with self._lock:
                self._cells[path] = code
            await self._everywhere("mpifyWriteCell", {"path": path, "code": code})
        return answer

    async def _on_setBreakpoints(self, request: dict) -> dict:
        arguments = request.get("arguments") or {}
        path = (arguments.get("source") or {}).get("path")
        answer = await self._kernel(request)
        if isinstance(path, str):
            with self._lock:
                if arguments.get("breakpoints"):
                    self._breakpoints[path] = arguments
                else:
                    self._breakpoints.pop(path, None)
        failures = await self._everywhere("setBreakpoints", arguments)
        if not answer:  # the kernel's debugger is not started: the ranks' setup stands
            answer = reply(request, True, {"breakpoints": [dict(b, verified=True) for b in
                                                           arguments.get("breakpoints") or []]})
        return dict(answer, message="; ".join(failures)) if failures else answer

    async def _on_setExceptionBreakpoints(self, request: dict) -> dict:
        return await self._setup_everywhere(request)

    async def _on_setFunctionBreakpoints(self, request: dict) -> dict:
        return await self._setup_everywhere(request)

    async def _setup_everywhere(self, request: dict) -> dict:
        arguments = request.get("arguments") or {}
        with self._lock:
            self._other_setup[request.get("command", "")] = arguments
        answer = await self._kernel(request)
        failures = await self._everywhere(request.get("command", ""), arguments)
        return dict(answer, message="; ".join(failures)) if failures and answer else answer

    async def _everywhere(self, command: str, arguments: dict) -> list[str]:
        """``command`` on every attached rank; why some failed."""
        pendings = [link.send(command, arguments) for link in self.links()]
        if pendings:
            await off_the_kernels_threads(self.waiter.wait, pendings, self._left())
        return [p.failure() for p in pendings if p.failure()]

    async def _on_threads(self, request: dict) -> dict:
        if self.attached:
            # ranks started since the frontend attached
            await off_the_kernels_threads(self.attach_all, self._left() / 2)
        links = self.links()
        pendings = [link.send("threads") for link in links]
        kernel = await self._kernel(request)
        if pendings:
            await off_the_kernels_threads(self.waiter.wait, pendings, self._left())
        threads: list[dict] = []
        for pending in pendings:
            if pending.answer is None or not pending.answer.get("success"):
                continue
            link = pending.link
            for thread in (pending.answer.get("body") or {}).get("threads") or []:
                threads.append({"id": self.ids.to_global(THREAD, link, thread.get("id")),
                                "name": f"rank {link.rank} / {thread.get('name', '?')}"})
        for thread in (kernel.get("body") or {}).get("threads") or []:
            name = str(thread.get("name", "?"))
            if not name.startswith("mpify_nb"):  # this library's own threads in the kernel
                threads.append(dict(thread, name=f"kernel / {name}"))
        return reply(request, True, {"threads": threads})

    # -- requests about one thread ----------------------------------------------------------------

    async def _on_stackTrace(self, request: dict) -> dict:
        thread = (request.get("arguments") or {}).get("threadId")
        if self.ids.is_rank(thread) and not self.threads.is_stopped(thread):
            return reply(request, False, message=f"thread {thread} is running: it has no stack to show")
        answer = await self._by_ids(request)
        body = answer.get("body")
        link = self.ids.link_of(thread)
        if link is not None and isinstance(body, dict):
            body["stackFrames"] = [dict(f, id=self.ids.to_global(FRAME, link, f.get("id")))
                                   for f in _users_frames(body.get("stackFrames") or [])]
            body["totalFrames"] = len(body["stackFrames"])
        return answer

    async def _on_variables(self, request: dict) -> dict:
        answer = await self._by_ids(request)
        body = answer.get("body")
        if self.ids.is_rank((request.get("arguments") or {}).get("variablesReference")) and isinstance(body, dict):
            body["variables"] = [v for v in body.get("variables") or [] if visible(str(v.get("name", "")))]
        return answer

    async def _on_continue(self, request: dict) -> dict:
        return await self._resume(request)

    async def _on_next(self, request: dict) -> dict:
        return await self._resume(request)

    async def _on_stepIn(self, request: dict) -> dict:
        return await self._resume(request)

    async def _on_stepOut(self, request: dict) -> dict:
        return await self._resume(request)

    async def _resume(self, request: dict) -> dict:
        """continue / next / stepIn / stepOut: on every stopped thread, or on one with
        ``singleThread``; a thread that runs is answered here (debugpy would never answer)."""
        command = request.get("command", "")
        arguments = request.get("arguments") or {}
        thread: Any = arguments.get("threadId")
        single = bool(arguments.get("singleThread"))
        everything = command == "continue" and not single  # DAP: continue resumes every thread
        stopped = self.threads.stopped()
        if everything and stopped:
            # JupyterLab asks with thread 1 whatever stopped (it forgets the thread before asking)
            thread = thread if thread in stopped else stopped[-1]
        elif not self._stopped(thread):
            if command == "continue":
                return reply(request, True, {"allThreadsContinued": False})
            return reply(request, False, message=f"thread {thread} is not stopped: only a stopped thread steps")
        targets = [thread] if single else stopped + ([thread] if thread not in stopped else [])
        # one request per debugger: the kernel's own, or a rank's (each with its own thread id)
        kernel_threads = [t for t in targets if not self.ids.is_rank(t) and self._kernel_stopped(t)]
        by_link: dict[int, tuple[RankLink, int]] = {}
        for t in targets:
            found = self.ids.to_local(THREAD, t)
            if found is not None and id(found[0]) not in by_link:
                by_link[id(found[0])] = (found[0], found[1])
        self.threads.resume(targets, requested=thread)  # one continued, now: before any new stop
        self.threads.focus(thread)
        pendings = []
        for link, local in by_link.values():
            extra = {"singleThread": True} if single else {}
            pendings.append(link.send(command, dict(arguments, threadId=local, **extra)))
            self.ids.forget(link, (FRAME, VARIABLE))
        failures: list[str] = []
        if kernel_threads:
            answer = await self._kernel(dict(request, arguments=dict(arguments, threadId=kernel_threads[0])))
            if not answer.get("success"):
                failures.append(f"kernel: {answer.get('message') or command + ' failed'}")
        if pendings:
            await off_the_kernels_threads(self.waiter.wait, pendings, self._left())
            failures += [p.failure() for p in pendings if p.failure()]
        if single:
            self.threads.republish_latest()
        body = {"allThreadsContinued": not single} if command == "continue" else None
        if failures:
            return reply(request, False, body, "; ".join(failures))
        return reply(request, True, body)

    def _kernel_stopped(self, thread: Any) -> bool:
        """Does the kernel's own debugger hold ``thread`` (its debugpy answers a resume of a
        thread that runs never, and every request after it would wait)?"""
        known = getattr(self.kernel_debugger, "stopped_threads", None)
        return thread in known if known is not None else self.threads.is_stopped(thread)

    def _stopped(self, thread: Any) -> bool:
        """Is ``thread`` stopped? A kernel's thread also when its own debugger says so (debugpy
        stops all the kernel's threads at once, and says so for one)."""
        return self.threads.is_stopped(thread) or (
            not self.ids.is_rank(thread) and thread in getattr(self.kernel_debugger, "stopped_threads", ()))

    async def _on_richInspectVariables(self, request: dict) -> dict:
        arguments = request.get("arguments") or {}
        found = self.ids.to_local(FRAME, arguments.get("frameId"))
        name = str(arguments.get("variableName", ""))
        if found is None or not name.isidentifier():
            return await self._kernel(request)
        link, frame = found
        expression = f"__import__('mpify_nb.rank.debugger', fromlist=['rich']).rich({name})"
        answer = await self._ask(link, request, "evaluate",
                                 {"expression": expression, "frameId": frame, "context": "clipboard"})
        if not answer.get("success"):
            return answer
        result = (answer.get("body") or {}).get("result", "")
        try:
            text = ast.literal_eval(result)
        except (ValueError, SyntaxError):
            text = result
        try:
            rich = json.loads(text)
        except (TypeError, ValueError):
            return reply(request, False, message=f"rank {link.rank} could not show {name}: {result[:200]}")
        return reply(request, True, {"data": rich.get("data", {}), "metadata": rich.get("metadata", {})})

    async def _on_copyToGlobals(self, request: dict) -> dict:
        arguments = request.get("arguments") or {}
        found = self.ids.to_local(FRAME, arguments.get("srcFrameId"))
        if found is None:
            return await self._kernel(request)
        destination, source = str(arguments.get("dstVariableName", "")), str(arguments.get("srcVariableName", ""))
        if not destination.isidentifier() or not source.isidentifier():
            return reply(request, False, message="dstVariableName and srcVariableName must be valid identifiers")
        link, frame = found
        return await self._ask(link, request, "setExpression",
                               {"expression": f"globals()['{destination}']", "value": source, "frameId": frame})
