"""The frontend's visual debugger inside a persistent rank: pydevd (debugpy's engine) speaking the
Debug Adapter Protocol over a socketpair, bridged to the notebook's kernel as DEBUG frames on the
rank's control channel. The kernel's half, which shows every rank in one debugger panel, is the
``mpify_nb.debugger`` package::

    kernel (debugger/links.py)                      rank k
    DEBUG {DAP request} ── control channel ──>      control thread: the first one starts the bridge
                                                    (debugpy is imported then, never earlier: not in
                                                    the template, not in a rank nobody debugs);
                                                    mpifyWriteCell (rank/cell_files.py) and
                                                    mpifyDetach answered here; the rest written
                                                    to pydevd's end of the socketpair
                    <── DEBUG {DAP response/event}  bridge thread: what pydevd writes, less the events
                                                    the kernel has no use for (module, process...)
    main thread, before each request that runs user code: arm() traces it while a frontend is
    attached, and stops tracing once it has detached (cells then run at full speed again)
    INTERRUPT (the stop button, a timeout): release() lets go of a thread held at a breakpoint
    first, so the SIGINT lands in the user's code and not inside pydevd

Nothing listens: pydevd believes it connected to a debug adapter, but its socket is one end of a
socketpair made here (``pydevd.start_client`` is handed it for the one call), the other end read by
the bridge. The control thread and the bridge are marked as pydevd's own threads: never traced,
never suspended when a breakpoint stops the rank.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Optional

from ..wire.protocol import NO_REQUEST, claim, pack
from . import cell_files
from . import control as rank_control

#: A DAP message, as JSON, either way (kernel <-> rank), on the rank's control channel.
DEBUG = claim(b"d", "debugger")

#: The events of pydevd's that the kernel's debugger uses; the others stay in the rank.
FORWARDED_EVENTS = frozenset({"stopped", "continued", "thread"})

#: A read of the socketpair, at most.
_CHUNK = 1 << 16

_lock = threading.Lock()
_bridge: Optional[_Bridge] = None
_attached = False  # a frontend is attached now: the main thread is traced while it runs user code
_armed = False  # arm() traces the main thread


def _mark(thread: threading.Thread) -> None:
    """One of pydevd's own threads, as far as pydevd can tell: never traced, never suspended."""
    vars(thread).update(pydev_do_not_trace=True, is_pydev_daemon_thread=True)


class _Bridge:
    """pydevd, on one end of a socketpair; its messages, read from the other, to the caller."""

    def __init__(self, control: socket.socket):
        self.control = control
        self.ours, self.theirs = socket.socketpair()
        self.ready = False  # pydevd is up (or failed to start: failed says why)
        self.failed = ""
        self.queued: list[dict] = []  # requests that came while it started
        self.write_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="mpify_nb-debugger", daemon=True)
        _mark(self.thread)
        self.thread.start()

    def submit(self, message: dict) -> None:
        with _lock:
            if not self.ready:
                self.queued.append(message)
                return
        self._write(message)

    def _run(self) -> None:
        try:
            _start_pydevd(self.theirs)
        except BaseException as e:  # no debugpy here, say: each request gets the reason
            self.failed = f"the debugger could not start on this rank: {type(e).__name__}: {e}"
        with _lock:
            queued, self.queued = self.queued, []
            self.ready = True
        for message in queued:
            self._write(message)
        if not self.failed:
            self._read()

    def _write(self, message: dict) -> None:
        if self.failed:
            _reply(self.control, message, False, self.failed)
            return
        data = json.dumps(message).encode("utf-8")
        try:
            with self.write_lock:
                self.ours.sendall(b"Content-Length: %d\r\n\r\n" % len(data) + data)
        except OSError as e:
            _reply(self.control, message, False, f"the debugger on this rank is gone: {e}")

    def _read(self) -> None:
        """pydevd's messages (``Content-Length: N`` headers, JSON bodies) to the caller."""
        buffer = b""
        while True:
            try:
                data = self.ours.recv(_CHUNK)
            except OSError:
                return
            if not data:
                return
            buffer += data
            while True:
                header, separator, rest = buffer.partition(b"\r\n\r\n")
                if not separator:
                    break
                length = int(header.rpartition(b":")[2])
                if len(rest) < length:
                    break
                body, buffer = rest[:length], rest[length:]
                _forward(self.control, body)


def _forward(control: socket.socket, body: bytes) -> None:
    try:
        message = json.loads(body)
    except ValueError:
        return
    if message.get("type") == "event" and message.get("event") not in FORWARDED_EVENTS:
        return
    rank_control.send(control, pack(DEBUG, NO_REQUEST, body))


def _start_pydevd(sock: socket.socket) -> None:
    """pydevd up in this process, connected to ``sock``, tracing nothing yet (arm() does)."""
    quiet = "PYDEVD_DISABLE_FILE_VALIDATION" not in os.environ
    if quiet:  # else pydevd warns on stderr, into the cell, about frozen modules
        os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    try:
        import debugpy
        import debugpy.server.api  # noqa: F401  (sets pydevd up for DAP, as ipykernel's import does)

        pydevd: Any = importlib.import_module("pydevd")  # on the path debugpy's import just added
    finally:
        if quiet:
            os.environ.pop("PYDEVD_DISABLE_FILE_VALIDATION", None)
    connect = pydevd.start_client
    pydevd.start_client = lambda host, port: sock  # the "adapter" pydevd connects to: our socketpair
    try:
        pydevd.settrace(host="mpify_nb", port=0, suspend=False, trace_only_current_thread=True,
                        patch_multiprocessing=False, block_until_connected=True, wait_for_ready_to_run=False,
                        notify_stdin=False,  # the rank's stdin asks the notebook's user (rank/stdin.py)
                        dont_trace_start_patterns=(os.path.dirname(debugpy.__file__),),
                        dont_trace_end_patterns=("debugpy_launcher.py",))
    finally:
        pydevd.start_client = connect
    pydevd.get_global_debugger().disable_tracing()  # this thread is the bridge, not the user's


def _reply(control: socket.socket, request: dict, success: bool, message: str = "", body: Any = None) -> None:
    """A response to ``request`` made here (not by pydevd)."""
    response = {"type": "response", "seq": 0, "request_seq": request.get("seq", 0),
                "command": request.get("command", ""), "success": success}
    if message:
        response["message"] = message
    if body is not None:
        response["body"] = body
    rank_control.send(control, pack(DEBUG, NO_REQUEST, json.dumps(response).encode("utf-8")))


def _rules() -> list[dict]:
    """This library's frames are never shown or stepped into: the cell's are the user's."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [{"path": os.path.join(package, "**"), "include": False}, {"module": "mpify_nb", "include": False}]


def _on_debug(state: Any, control: socket.socket, req_id: int, body: Any) -> None:
    """A DAP request from the kernel (on the control thread)."""
    global _bridge, _attached
    try:
        message = json.loads(bytes(body))
    except ValueError:
        return
    command = message.get("command")
    arguments = message.get("arguments") or {}
    if command == "mpifyWriteCell":
        ok, why = cell_files.write_cell(str(arguments.get("path", "")), str(arguments.get("code", "")))
        _reply(control, message, ok, why)
        return
    if command == "mpifyDetach":  # the frontend turned its debugger off: cells run untraced again
        _attached = False
        _reply(control, message, True)
        return
    with _lock:
        if _bridge is None:
            _mark(threading.current_thread())  # the control thread: a breakpoint never suspends it
            _bridge = _Bridge(control)
        bridge = _bridge
    if command == "attach":
        message["arguments"] = dict(arguments, rules=_rules() + list(arguments.get("rules") or []))
        _attached = True
    bridge.submit(message)


def arm() -> None:
    """On the main thread, before a request that runs user code: traced while a frontend is
    attached (so its breakpoints stop here), untraced once it has detached."""
    global _armed
    bridge = _bridge
    if bridge is None:
        return  # the common case: no frontend ever turned its debugger on
    pydevd = sys.modules.get("pydevd")
    if pydevd is None or not bridge.ready or bridge.failed:
        return
    if _attached:
        if sys.gettrace() is None:  # first time, or an interrupt ended the trace (a trace that raises is unset)
            pydevd.get_global_debugger().enable_tracing()
            _armed = True
    elif _armed:
        pydevd.get_global_debugger().disable_tracing()
        _armed = False


def _held() -> list[threading.Thread]:
    """The threads pydevd holds at a breakpoint now."""
    try:
        suspend = importlib.import_module("_pydevd_bundle.pydevd_constants").STATE_SUSPEND
    except ImportError:
        return []
    return [t for t in threading.enumerate()
            if getattr(getattr(t, "additional_info", None), "pydev_state", None) == suspend]


def release(patience: float = 1.0) -> None:
    """Let go of the threads pydevd holds at a breakpoint, and wait (a little) until they run:
    before an interrupt, which would otherwise land inside pydevd's wait and leave it believing
    the thread stopped (the next breakpoint would then never stop it)."""
    bridge = _bridge
    if bridge is None or not bridge.ready or bridge.failed or not _held():
        return
    api = importlib.import_module("_pydevd_bundle.pydevd_api").PyDevdAPI()
    api.request_resume_thread("*")  # pydevd sends its "continued" to the kernel
    deadline = time.monotonic() + patience
    # a held thread is marked running at once, but leaves pydevd's wait (and sends its
    # continued) only when it next looks: an interrupt before that lands inside pydevd
    while (_held() or _in_pydevd_wait()) and time.monotonic() < deadline:
        time.sleep(0.002)


def _in_pydevd_wait() -> bool:
    """Is a thread of this process inside pydevd's wait at a breakpoint (do_wait_suspend)?"""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "do_wait_suspend" and "pydevd" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
    return False


def rich(obj: Any) -> str:
    """``richInspectVariables`` on a rank: ``obj``'s rich forms as JSON (evaluated in the stopped
    frame by the kernel's debugger; IPython's formatter, as ``display()`` on a rank)."""
    from .display import _bundle

    return json.dumps({"data": _bundle(obj), "metadata": {}}, default=str)


def _forked() -> None:
    """A process this rank forks (a DataLoader worker) is not debugged: nothing would answer
    its stops, so it would hang at the first breakpoint."""
    global _bridge, _attached, _armed
    bridge = _bridge
    if bridge is None:
        return
    _bridge, _attached, _armed = None, False, False
    tracing = sys.modules.get("pydevd_tracing")
    try:
        if tracing is not None:
            tracing.SetTrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    except Exception:
        pass
    for s in (bridge.ours, bridge.theirs):
        try:
            s.close()
        except OSError:
            pass


rank_control.on(DEBUG, _on_debug)
rank_control.before_interrupt(release)
os.register_at_fork(after_in_child=_forked)
