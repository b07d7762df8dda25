"""A frontend for the debugger tests: a real kernel, and a client that speaks the Jupyter protocol
from the frontend's side as JupyterLab's debugger panel does (jupyter_client).

``debug_request`` goes on the control channel and its ``debug_reply`` comes back there; ``debug_event``
arrives on IOPub. One reader thread takes everything IOPub says, so a cell can run (and stop at a
breakpoint) while the test sends debug requests::

    front = DebugFrontend(cwd)
    front.ok("%load_ext mpify_nb"); front.ok("%dist_init -n 2")
    front.enable()                                   # debugInfo, initialize, attach, configurationDone
    path = front.dap("dumpCell", code=CELL)["body"]["sourcePath"]
    front.dap("setBreakpoints", source={"path": path}, breakpoints=[{"line": 2}])
    cell = front.start(CELL)                         # runs; returns at once
    stop = front.next_event("stopped")               # a rank stopped at line 2
    ...
    front.dap("continue", threadId=stop["body"]["threadId"])
    front.finish(cell)                               # the cell's reply and outputs

The cell's file name is what JupyterLab computes: ``tmpFilePrefix + murmur2(code, hashSeed) +
tmpFileSuffix`` from debugInfo (``cell_path``).
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

import nbutil

ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: How long a test waits for the kernel to answer a debug request, or for an event.
DAP_TIMEOUT = 60.0


def _first(get: Callable[..., Any], wanted: Callable[[Any], bool], timeout: float, why: Callable[[], str]) -> Any:
    """The first item ``get(timeout=...)`` gives that is ``wanted`` (others are skipped), within
    ``timeout`` seconds; else AssertionError(``why()``)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(why())
        try:
            item = get(timeout=left)
        except queue.Empty:
            continue
        if wanted(item):
            return item


@dataclass
class Cell:
    """What one executed cell did, as the frontend saw it."""

    msg_id: str
    number: int = 0
    status: str = ""
    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)
    ename: str = ""
    traceback: str = ""
    idle: bool = False


def take_output(cell: Any, kind: str, content: dict) -> bool:
    """What an IOPub message of the cell adds to ``cell`` (stdout, stderr, results, ename,
    traceback, number); True when it says the kernel went idle."""
    if kind == "stream":
        if content["name"] == "stdout":
            cell.stdout += content["text"]
        else:
            cell.stderr += content["text"]
    elif kind in ("execute_result", "display_data"):
        cell.results.append(content["data"].get("text/plain", ""))
    elif kind == "error":
        cell.ename = content["ename"]
        cell.traceback = ANSI.sub("", "\n".join(content["traceback"]))
    elif kind == "execute_input":
        cell.number = content["execution_count"]
    return kind == "status" and content["execution_state"] == "idle"


def murmur2(data: str, seed: int) -> int:
    """JupyterLab's hash of a cell's code (as ipykernel's compiler.murmur2_x86)."""
    m = 0x5BD1E995
    raw = data.encode("utf8")
    length = len(raw)
    h = seed ^ length
    rounded_end = length & 0xFFFFFFFC
    for i in range(0, rounded_end, 4):
        k = raw[i] | raw[i + 1] << 8 | raw[i + 2] << 16 | raw[i + 3] << 24
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = length & 3
    k = 0
    if tail == 3:
        k = raw[rounded_end + 2] << 16
    if tail in (2, 3):
        k |= raw[rounded_end + 1] << 8
    if tail:
        k |= raw[rounded_end]
        h ^= k
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


class KernelFrontend:
    """A kernel (this interpreter, nbutil's kernelspec, tagged for the leftover check) and a
    client to it; ``close()`` shuts it down and checks it left no process behind."""

    def __init__(self, cwd: str):
        self.marker = uuid.uuid4().hex
        env = dict(os.environ, **{nbutil.MARKER_VAR: self.marker, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
        self.km = KernelManager(kernel_name=nbutil.KERNEL_NAME,
                                kernel_spec_manager=KernelSpecManager(kernel_dirs=[nbutil.kernel_dir()]))
        self.km.start_kernel(env=env, cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def close(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
        finally:
            nbutil.assert_no_leftovers(self.marker)


class DebugFrontend(KernelFrontend):
    """A kernel and a frontend with a debugger panel."""

    def __init__(self, cwd: str):
        super().__init__(cwd)
        self.events: queue.Queue = queue.Queue()  # debug_event contents, in order
        self.event_log: list[dict] = []  # every debug_event seen
        self.cells: dict[str, Cell] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._reader = threading.Thread(target=self._read_iopub, daemon=True)
        self._reader.start()
        self._seq = 0
        self.info: dict = {}
        self.paths: set[str] = set()  # cells with breakpoints set
        self.replies: list[tuple[str, float, dict]] = []  # every debug_request: command, seconds, reply

    # -- IOPub ---------------------------------------------------------------------------------

    def _read_iopub(self) -> None:
        while not self._closing:
            try:
                msg = self.kc.iopub_channel.get_msg(timeout=0.05)
            except queue.Empty:
                continue
            except Exception:
                return
            kind, content = msg["msg_type"], msg["content"]
            if kind == "debug_event":
                with self._lock:
                    self.event_log.append(content)
                self.events.put(content)
                continue
            with self._lock:
                cell = self.cells.get(msg["parent_header"].get("msg_id", ""))
                if cell is not None:
                    cell.idle = take_output(cell, kind, content) or cell.idle

    def next_event(self, name: str, timeout: float = DAP_TIMEOUT, **body: Any) -> dict:
        """The next debug_event called ``name`` whose body has ``body``'s items (others before it
        are skipped)."""
        return _first(self.events.get,
                      lambda event: event.get("event") == name
                      and all(event.get("body", {}).get(k) == v for k, v in body.items()),
                      timeout, lambda: f"no {name} event {body} within {timeout} s; seen: {self.event_log[-10:]}")

    def drain_events(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    # -- cells ---------------------------------------------------------------------------------

    def start(self, code: str) -> Cell:
        """Execute ``code``; return at once (the cell may stop at a breakpoint).

        The cell is filed before its request is sent, as JupyterLab's kernel future is: the
        kernel can answer a short cell (busy, its result, idle) before this thread runs again
        on a loaded machine, and the reader drops what no filed cell asked for."""
        msg = self.kc.session.msg("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True})
        cell = Cell(msg["header"]["msg_id"])
        with self._lock:
            self.cells[cell.msg_id] = cell
        self.kc.shell_channel.send(msg)
        return cell

    def finish(self, cell: Cell, timeout: float = 120.0) -> Cell:
        """Wait for ``cell``'s reply and its outputs."""
        deadline = time.monotonic() + timeout
        reply = None
        while reply is None:
            left = deadline - time.monotonic()
            assert left > 0, f"the cell did not finish within {timeout} s: {cell}"
            try:
                msg = self.kc.shell_channel.get_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == cell.msg_id:
                reply = msg
        while not cell.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        cell.status = reply["content"]["status"]
        assert cell.idle, f"the kernel replied to the cell but did not go idle after it within {timeout} s " \
                          f"(its outputs may be missing): {cell}"
        return cell

    def run(self, code: str, timeout: float = 120.0) -> Cell:
        return self.finish(self.start(code), timeout)

    def ok(self, code: str) -> Cell:
        cell = self.run(code)
        assert cell.status == "ok", cell
        return cell

    # -- the debugger ------------------------------------------------------------------------

    def dap(self, command: str, timeout: float = DAP_TIMEOUT, **arguments: Any) -> dict:
        """One debug_request; its debug_reply's content (each noted in ``replies``: the command,
        how long its reply took, the reply)."""
        self._seq += 1
        content = {"type": "request", "seq": self._seq, "command": command, "arguments": arguments}
        msg = self.kc.session.msg("debug_request", content)
        start = time.monotonic()
        self.kc.control_channel.send(msg)
        reply = _first(self.kc.control_channel.get_msg,
                       lambda reply: reply["parent_header"].get("msg_id") == msg["header"]["msg_id"],
                       timeout, lambda: f"no reply to {command} {arguments} within {timeout} s")
        self.replies.append((command, time.monotonic() - start, reply["content"]))
        return reply["content"]

    def enable(self) -> dict:
        """What JupyterLab sends when its debugger is turned on; returns debugInfo's body."""
        self.info = self.dap("debugInfo")["body"]
        assert self.dap("initialize", clientID="jupyterlab", clientName="JupyterLab", adapterID="python",
                        pathFormat="path", linesStartAt1=True, columnsStartAt1=True, supportsVariableType=True,
                        supportsVariablePaging=True, supportsRunInTerminalRequest=True,
                        locale="en")["success"]
        assert self.dap("attach")["success"]
        assert self.dap("configurationDone")["success"]
        return self.info

    def cell_path(self, code: str) -> str:
        """The cell's file, as JupyterLab computes it from debugInfo."""
        info = self.info or self.dap("debugInfo")["body"]
        return f"{info['tmpFilePrefix']}{murmur2(code, info['hashSeed'])}{info['tmpFileSuffix']}"

    def breakpoints(self, code: str, lines: list[int]) -> str:
        """A gutter click: dumpCell, then setBreakpoints for the cell; returns its path."""
        path = self.dap("dumpCell", code=code)["body"]["sourcePath"]
        assert path == self.cell_path(code)
        reply = self.dap("setBreakpoints", source={"path": path}, breakpoints=[{"line": n} for n in lines],
                         lines=lines, sourceModified=False)
        assert reply["success"], reply
        self.paths.add(path)
        return path

    def clear_breakpoints(self) -> None:
        for path in sorted(self.paths):
            self.dap("setBreakpoints", source={"path": path}, breakpoints=[], lines=[], sourceModified=False)
        self.paths.clear()

    def panel(self, thread: int) -> dict:
        """What JupyterLab fetches at a stop of ``thread``: stack, scopes, the top frame's locals
        and globals (``{"frames", "locals", "globals", "frame"}``)."""
        stack = self.dap("stackTrace", threadId=thread)
        assert stack["success"], stack
        frames = stack["body"]["stackFrames"]
        scopes = self.dap("scopes", frameId=frames[0]["id"])
        assert scopes["success"], scopes
        found: dict[str, Any] = {"frames": frames, "frame": frames[0]["id"]}
        for scope in scopes["body"]["scopes"]:
            variables = self.dap("variables", variablesReference=scope["variablesReference"])
            assert variables["success"], variables
            found[scope["name"].lower()] = {v["name"]: v["value"] for v in variables["body"]["variables"]}
        return found

    def thread_names(self) -> dict[int, str]:
        reply = self.dap("threads")
        assert reply["success"], reply
        return {t["id"]: t["name"] for t in reply["body"]["threads"]}

    def close(self) -> None:
        self._closing = True
        super().close()


class LabPanel:
    """JupyterLab 4's debugger panel, as its DebuggerService behaves (read from its source):

    - at ``stopped``: its stopped threads become that one thread; it fetches the stack of its
      current thread (the first stopped one, else 1), the top frame's scopes and their variables;
    - at ``continued``: that thread leaves the set and the panel is cleared;
    - ``continue``: the current thread leaves the set *first*, so the request names thread 1;
      ``next``, ``stepIn``, ``stepOut``: the current thread.
    """

    def __init__(self, front: DebugFrontend):
        self.front = front
        self.stopped: list[int] = []
        self.frames: list[dict] = []
        self.scopes: dict[str, dict[str, str]] = {}

    def current(self) -> int:
        return self.stopped[0] if self.stopped else 1

    def handle(self, event: dict) -> None:
        name, body = event.get("event"), event.get("body", {})
        if name == "stopped":
            self.stopped = [body["threadId"]]
            self.refresh()
        elif name == "continued":
            if body.get("threadId") in self.stopped:
                self.stopped.remove(body["threadId"])
            self.frames, self.scopes = [], {}

    def refresh(self) -> None:
        stack = self.front.dap("stackTrace", threadId=self.current())
        self.frames = stack.get("body", {}).get("stackFrames", []) if stack.get("success") else []
        self.scopes = {}
        if self.frames:
            for scope in self.front.dap("scopes", frameId=self.frames[0]["id"])["body"]["scopes"]:
                variables = self.front.dap("variables", variablesReference=scope["variablesReference"])
                self.scopes[scope["name"]] = {v["name"]: v["value"] for v in variables["body"]["variables"]}

    def take(self, stops: int, timeout: float = DAP_TIMEOUT) -> None:
        """Handle events until ``stops`` stopped events have been handled."""
        while stops > 0:
            event = self._next(timeout)
            self.handle(event)
            stops -= event.get("event") == "stopped"

    def _next(self, timeout: float) -> dict:
        try:
            return self.front.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no event within {timeout} s; seen: {self.front.event_log[-10:]}") from None

    def press(self, command: str) -> dict:
        """A toolbar button: continue, next, stepIn, stepOut."""
        if command == "continue":
            thread = self.current()
            if thread in self.stopped:
                self.stopped.remove(thread)
            self.frames, self.scopes = [], {}
        return self.front.dap(command, threadId=self.current())


class VSCodePanel(LabPanel):
    """VS Code's Jupyter debugger, as it drives the same transport: after every ``stopped`` it
    asks for ``threads`` first, then the stopped thread's stack (the top frame, then the rest),
    scopes and variables; it remembers every thread it saw stop and continues each of them."""

    def __init__(self, front: DebugFrontend):
        super().__init__(front)
        self.threads: dict[int, str] = {}

    def handle(self, event: dict) -> None:
        name, body = event.get("event"), event.get("body", {})
        if name == "stopped":
            reply = self.front.dap("threads")
            assert reply["success"], reply
            self.threads = {t["id"]: t["name"] for t in reply["body"]["threads"]}
            if body["threadId"] not in self.stopped:
                self.stopped.append(body["threadId"])
            self.refresh_thread(body["threadId"])
        elif name == "continued":
            if body.get("allThreadsContinued"):
                self.stopped = []
            elif body.get("threadId") in self.stopped:
                self.stopped.remove(body["threadId"])
            self.frames, self.scopes = [], {}

    def refresh_thread(self, thread: int) -> None:
        top = self.front.dap("stackTrace", threadId=thread, startFrame=0, levels=1)
        if not top.get("success"):
            self.frames = []
            return
        rest = self.front.dap("stackTrace", threadId=thread, startFrame=1, levels=19)
        self.frames = top["body"]["stackFrames"] + (rest["body"]["stackFrames"] if rest.get("success") else [])
        self.scopes = {}
        for scope in self.front.dap("scopes", frameId=self.frames[0]["id"])["body"]["scopes"]:
            variables = self.front.dap("variables", variablesReference=scope["variablesReference"])
            self.scopes[scope["name"]] = {v["name"]: v["value"] for v in variables["body"]["variables"]}
