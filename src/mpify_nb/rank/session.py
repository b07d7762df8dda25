"""A persistent rank: the requests of a rank that lives across calls (see session/session.py).

A rank of a :class:`~mpify_nb.Session` is born like a ``ranch`` rank (forked from the
template, channel and stdout/stderr pipes made by the caller before it exists, see
rank/loop.py), but its setup message says ``session`` and carries the end of a second
socketpair. It then never exits on its own::

    caller (Session)                                  rank k
    ----------------                                  ------
    work channel ── RUN/APPLY/PUSH/PULL/MISSING/GROUP ─> main thread: one request at a time,
                 <── DONE / FAIL / DISPLAY ────────────   in its persistent __main__ namespace
    control      ── INTERRUPT req / ABORT_GROUP ──────> control thread: SIGINT to the main
    channel      <── ABORTED ──────────────────────────  thread (only while it runs req);
                                                          cut the connections to the peers and
                                                          destroy the group (unsticks them);
                 ── LOOK round ────────────────────────> what the main thread waits in, torch's
                 <── SEEN (round, snapshot) ───────────  recorder (torchdist/waits.py)
                 ── PEEK name ─────────────────────────> a thread of its own pickles __main__[name]
                 <── PEEKED value (memfds) ────────────  as it is now, beside the main thread
                 ── DEBUG / <── DEBUG ─────────────────  the frontend's debugger (rank/debugger.py)
                  (control channel closes) ───────────> the caller is gone: kill self

The main thread starts the process group (a TCPStore whose listening socket the caller
made and passed to the store's rank; under Ray, where the caller is on another node, the
store's rank binds it on its own node's address and says which port, STORE, for the caller
to tell the others) and reports READY only once the group is
up, so the caller's first request can never be lost. SIGINT raises KeyboardInterrupt only inside the
user's code: an interrupt that lands between requests is ignored, and the rank, with its
state, lives on. The loop that reads the requests is every rank's (rank.loop.serve); the control
thread too (rank/control.py), with this module's ABORT_GROUP and PEEK; the group itself is
group.py's.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import pickle
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

from ..torchdist import compat, rendezvous
from ..wire import payload
from ..wire.errors import PayloadError, RemoteFailure, safe_str
from ..wire.protocol import (
    ABORT_GROUP,
    ABORTED,
    APPLY,
    CHECKS,
    COMM,
    COMM_ACK,
    COMM_OUT,
    DISPLAY,
    DONE,
    FAIL,
    GROUP,
    MISSING,
    NO_REQUEST,
    PEEK,
    PEEKED,
    PULL,
    PUSH,
    READY,
    RUN,
    pack,
)
from . import checks, comms, group, own_group, process
from . import control as rank_control
from . import debugger as rank_debugger
from . import display as rank_display
from .control import RankState


def start(channel: socket.socket, config: dict, fds: list[int], state: RankState) -> dict[bytes, rank_control.Request]:
    """Start a Session's rank: its control thread, its namespace and group; READY (or FAIL and
    exit) to the caller. Returns the handlers of its requests, for rank.loop.serve."""
    control = socket.socket(fileno=fds[0])
    listen_fd = fds[1] if len(fds) > 1 else None
    session = config["session"]
    checks.persistent()
    namespace = sys.modules["__main__"].__dict__
    signal.signal(signal.SIGINT, lambda signum, frame: _on_sigint(state))
    rank_control.start(control, state)
    ready: dict = {}
    rank_display.install(lambda bundle: _send_display(channel, state, bundle))
    rank_control.install_stdin(channel, state)
    namespace["display"] = rank_display.display
    if session.get("comms"):  # widgets: comms to the caller's kernel, from any thread (engine/comms.py)
        comms.install(lambda frame: _send_display(channel, state, frame, COMM_OUT))
    # A cell's own init_process_group meets the others at the Session's store, its rendezvous
    # counted per cell (torchdist/rendezvous.py), in place of the Session's group (own_group.py).
    rendezvous.activate(scope=lambda: str(state.request))
    # Each init_process_group wraps sys.excepthook in a "[rankN]: " one: unwrapped after the
    # Session's group and after every request, or a cell's own groups stack them (a hook the
    # user sets stays).
    excepthook = sys.excepthook
    try:
        ready = group.start(namespace, config["rank"], session, listen_fd)
        own_group.install()
        reply = pack(READY, NO_REQUEST, pickle.dumps(ready))
    except BaseException as e:
        reply = pack(FAIL, NO_REQUEST, pickle.dumps((_capture(e), False, {})))
    sys.excepthook = compat.without_rank_excepthooks(sys.excepthook, excepthook)
    rank_control.send(channel, reply)
    if not ready:
        process.end(1)

    def handler(kind: bytes) -> rank_control.Request:
        def handle(channel, state, req_id, body, fds) -> tuple[bytes, list[int]]:
            before = sys.excepthook
            try:
                return _handle(kind, req_id, body, fds, namespace, state)
            finally:
                sys.excepthook = compat.without_rank_excepthooks(sys.excepthook, before)
        return handle

    return {kind: handler(kind) for kind in (RUN, APPLY, PUSH, PULL, MISSING, GROUP, COMM, CHECKS)}


def _abort_group(state: RankState, control: socket.socket, req_id: int, body: Any) -> None:
    checks.abort()  # a rank waiting in its collective check raises too
    global _unquiet
    if _unquiet is None:  # each cut store connection prints a C++ stack: echoes of the abort
        _unquiet = compat.quiet_cpp_warnings()
    rendezvous.abort()  # a cell's rendezvous waiting for the store to open (its host never came)
    group.cut_connections(pickle.loads(body))
    group.destroy_group(abort=True)
    rank_control.send(control, pack(ABORTED, req_id))  # the caller rebuilds only after every ack


def _peek(state: RankState, control: socket.socket, req_id: int, body: Any) -> None:
    """PEEK: the caller reads a variable while a call runs here (a live pull). Read and pickled on
    a thread of its own, beside the main thread, which is not stopped (no lock: what that can see is
    in docs/guide/background.md); the control thread stays free for interrupts and looks."""
    threading.Thread(target=_send_peeked, args=(control, req_id, pickle.loads(body)), name="mpify_nb-peek",
                     daemon=True).start()


def _send_peeked(control: socket.socket, req_id: int, name: str) -> None:
    namespace = sys.modules["__main__"].__dict__
    fds: list[int] = []
    try:
        if name not in namespace:
            reply = b"\x00" + pickle.dumps(("name", f"name {name!r} is not defined on rank {namespace.get('rank')}"))
        else:
            data, fds = payload.pack_result(namespace[name])
            reply = b"\x01" + data
    except Exception as e:
        reply = b"\x00" + pickle.dumps(("payload", f"{type(e).__name__}: {safe_str(e)}"))
    rank_control.send(control, pack(PEEKED, req_id, reply), fds)
    payload.close_fds(fds)


rank_control.on(ABORT_GROUP, _abort_group)
rank_control.on(PEEK, _peek)
rank_control.on(COMM_ACK, lambda state, control, req_id, body: comms.acked(pickle.loads(body)))


def _on_sigint(state: RankState) -> None:
    if state.in_user_code:
        raise KeyboardInterrupt


def _send_display(channel: socket.socket, state: RankState, bundle: dict, kind: bytes = DISPLAY) -> None:
    """``display()`` in the user's code, from any thread: one DISPLAY message (or a widget's
    COMM_OUT), sent whole (an interrupt waits for its end: rank_control.send)."""
    rank_control.send(channel, pack(kind, state.request, pickle.dumps(bundle)))


#: Values a push replaced, kept until its answer is sent (see free_replaced).
_replaced: list = []


def free_replaced() -> None:
    """After an answer is sent: what a push replaced goes (unmapping 64 MB takes ~10 ms)."""
    _replaced.clear()


# -- requests ----------------------------------------------------------------------------

#: Puts torch's C++ warnings back after an abort quieted them (at the end of the request it hit).
_unquiet: Optional[Callable[[], None]] = None


def _handle(kind: bytes, req_id: int, body, fds: list[int], namespace: dict,
            state: RankState) -> tuple[bytes, list[int]]:
    global _unquiet
    if _unquiet is not None:
        _unquiet, unquiet = None, _unquiet
        unquiet()
    rank_debugger.arm()  # the frontend's breakpoints stop here while its debugger is on
    issued, started_ns = (checks.collectives_so_far(), time.time_ns()) if kind in (RUN, APPLY) else (0, 0)
    try:
        if kind == RUN:
            source, filename, want_value = pickle.loads(body)
            value = _run_source(source, filename, want_value, namespace, state)
        elif kind == APPLY:
            fn, args, kwargs, _ctx, _needed, _imports = payload.unpack_call(body, fds)
            fds = []
            payload.lend_names(fn, namespace)
            value = _in_user_code(state, fn, *args, **kwargs)
        elif kind == PUSH:
            values = payload.unpack_values(body, fds)
            fds = []
            # What the push replaces is freed after the answer (unmapping 64 MB takes ~10 ms).
            _replaced.extend(namespace[k] for k in values if k in namespace)
            namespace.update(values)
            value = None
        elif kind == PULL:
            name = pickle.loads(body)
            if name not in namespace:
                raise NameError(f"name {name!r} is not defined on rank {namespace.get('rank')}")
            value = namespace[name]
        elif kind == MISSING:
            names = pickle.loads(body)
            value = sorted(n for n in names if n not in namespace and not hasattr(builtins, n))
        elif kind == COMM:  # a frontend's message to a widget here: its handlers are user code
            value = _in_user_code(state, comms.deliver, pickle.loads(body))
        elif kind == CHECKS:  # the notebook's set_collective_checks, before the next cell
            checks.switch(pickle.loads(body))
            value = None
        elif kind == GROUP:
            group.destroy_group()
            group.init_group(pickle.loads(body), fds[0] if fds else None)
            fds = []
            value = None
        else:
            raise RuntimeError(f"unknown request {kind!r}")
        meta = _meta()
        returned = checks.returned_after(issued, started_ns, state.rank) if kind in (RUN, APPLY) else None
        if returned is not None:
            meta["returned"] = returned  # the caller compares the ranks' (a wrong value every rank returned)
        if value is None and meta["gpu_memory"] is None and returned is None and meta["group"] == own_group.usual():
            payload.close_fds(fds)
            return pack(DONE, req_id), []  # the common case, without pickling anything
        # Pickling runs the value's own code (__reduce__, __getstate__), which may block: it is
        # interrupted like the user's code, by the stop button and by timeout=.
        try:
            data, out_fds = _in_user_code(state, payload.pack_result, (value, meta))
        except Exception as e:
            if kind != RUN:  # pull, apply: the real value or an error, never a stand-in
                raise PayloadError(f"rank {namespace.get('rank')} cannot send back "
                                   f"{_what(kind, body)} ({type(value).__name__}): "
                                   f"{type(e).__name__}: {safe_str(e)}") from None
            # A cell's value, to be shown (a generator, an open file...): its repr tells what it is.
            data, out_fds = payload.pack_result((RemoteRepr(_safe_repr(value)), meta))
    except BaseException as e:
        payload.close_fds(fds)
        own_group.explain(e)  # torch's "not initialized" after a cell destroyed the group: what to do
        interrupted = isinstance(e, KeyboardInterrupt)
        # Captured first: once sys.last_value holds it, it would travel as a reference to that name
        # (what a module holds is the rank's own), and the caller's __cause__ would be lost.
        reply = pack(FAIL, req_id, pickle.dumps((_capture(e), interrupted, _meta())))
        if kind in (RUN, APPLY):  # as Python does for an uncaught error: pdb.pm() and Session.debug() find it
            sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
            if sys.version_info >= (3, 12):
                sys.last_exc = e
        return reply, []
    payload.close_fds(fds)
    return pack(DONE, req_id, data), out_fds


def _what(kind: bytes, body) -> str:
    """What a request's value is, for an error: ``'x'`` for a pull of x."""
    if kind == PULL:
        try:
            return repr(pickle.loads(body))
        except Exception:
            pass
    return "the value"


def _in_user_code(state: RankState, fn, *args, **kwargs):
    state.in_user_code = True
    try:
        return fn(*args, **kwargs)
    finally:
        state.in_user_code = False


def _run_source(source: str, filename: str, want_value: bool, namespace: dict, state: RankState) -> Any:
    """Run a cell as IPython does: every statement, then the last one's value if it is an
    expression. Its source goes to linecache, so tracebacks show the cell's own lines."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename, "exec")
    last = None
    if want_value and tree.body and isinstance(tree.body[-1], ast.Expr):
        expr = tree.body.pop()
        assert isinstance(expr, ast.Expr)
        last = ast.Expression(expr.value)
    body = compile(tree, filename, "exec")
    tail = compile(last, filename, "eval") if last is not None else None
    state.in_user_code = True
    try:
        exec(body, namespace)
        value = eval(tail, namespace) if tail is not None else None
        rank_display.flush_figures()  # as the inline backend: what the cell drew, shown at its end
        return value
    finally:
        state.in_user_code = False


class RemoteRepr:
    """Stands for a value that could not be sent back from a rank: shows the rank's repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as e:
        return f"<{type(value).__name__} (repr failed: {safe_str(e)})>"


def _capture(exc: BaseException) -> RemoteFailure:
    return RemoteFailure.capture(exc, lambda e: payload.dumps(e)[0])


def _meta() -> dict:
    """What the caller's status() shows and only the rank knows."""
    torch = sys.modules.get("torch")
    gpu = None
    try:
        if torch is not None and torch.cuda.is_initialized():
            gpu = int(torch.cuda.memory_allocated())
    except Exception:
        pass
    return {"gpu_memory": gpu, "group": own_group.state()}

