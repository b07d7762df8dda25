"""A rank's control thread: what its caller says while the main thread runs a request.

Every rank has one (a ``ranch`` rank from the moment it runs its call, on its channel; a
Session's rank from birth, on its control channel)::

    caller ── ANSWER (token, line) ──> deliver to the user's input() / pdb (rank/stdin.py)
           ── INTERRUPT req ─────────> SIGINT to the main thread, only while it runs req (a
                                       thread the debugger holds at a breakpoint is let go first)
           ── <kind> req body ───────> the handler registered for <kind> (on()): a Session's
                                       PEEK / ABORT_GROUP, a capability's frames (which
                                       answers, from any thread, with to_caller())
           <── ASK req RAW ──────────  a read of fd 0 by C code, seen from /proc (rank/stdin.py)
           <── COLLECTIVE req waits ─  with ``watch_stack``: what the main thread waits on
                                       in torch.distributed (torchdist/waits.py), when it changes
     (control channel closes) ───────> the caller is gone: flush, end what we started, die
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import signal
import socket
import threading
import time
from typing import Any, Callable, NoReturn

from ..torchdist import waits
from ..wire import framing
from ..wire.protocol import ANSWER, ASK, COLLECTIVE, INTERRUPT, NO_REQUEST, WATCH, pack, unpack
from . import process, stdin

#: How often the control thread looks at what the main thread is doing while it runs a request.
WATCH_PERIOD = 0.05


class RankState:
    """What the main thread is doing, shared with the control thread."""

    def __init__(self, watch_stack: bool = False) -> None:
        self.lock = threading.Lock()
        self.request = NO_REQUEST  # the request the main thread runs now
        self.in_user_code = False  # SIGINT raises KeyboardInterrupt only then
        self.deferring = False  # the user's code sends a message: an interrupt waits for its end
        self.deferred = False  # an interrupt came meanwhile
        self.main_ident = threading.get_ident()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.watch_stack = watch_stack  # report COLLECTIVE (a Session's rank)
        self.recorder_for = NO_REQUEST  # the request for which the caller asked us to read the recorder

    def begin(self, req_id: int) -> None:
        """The main thread starts request ``req_id`` (NO_REQUEST: it is done)."""
        with self.lock:
            self.request = req_id
        if req_id != NO_REQUEST:
            os.write(self.wake_w, b"w")  # the control thread starts watching


#: kind -> handler(state, control channel, request id, body), run on the control thread.
Handler = Callable[[RankState, socket.socket, int, Any], None]
_handlers: dict[bytes, Handler] = {}


#: kind -> request(channel, state, request id, body, fds) -> (reply, its fds), run on the
#: main thread by rank.loop.serve, one at a time.
Request = Callable[[socket.socket, RankState, int, Any, list], tuple[bytes, list]]


def on(kind: bytes, handler: Handler) -> None:
    """Run ``handler`` on the control thread for each frame of ``kind`` the caller sends."""
    _handlers[kind] = handler


#: Run on the control thread just before an interrupt is sent to the main thread.
_before_interrupt: list[Callable[[], None]] = []


def before_interrupt(hook: Callable[[], None]) -> None:
    """Run ``hook()`` before each interrupt reaches the main thread (the debugger lets go of a
    thread it holds at a breakpoint: an interrupt landing inside the debugger would leave it
    believing the thread still stopped)."""
    if hook not in _before_interrupt:
        _before_interrupt.append(hook)


def send(channel: socket.socket, data: bytes, fds=()) -> None:
    try:
        framing.send(channel, data, fds)  # whole, whichever thread sends (a display, an ASK for input)
    except OSError:
        pass  # the caller is gone; the control thread ends us


#: This rank's channel to its caller and its state, once its loop runs (to_caller()).
_caller: list[tuple[socket.socket, RankState]] = []


def connect(channel: socket.socket, state: RankState) -> None:
    """The rank's loop starts on ``channel``: to_caller() sends there."""
    _caller[:] = [(channel, state)]


def to_caller(kind: bytes, body: bytes = b"", fds=()) -> None:
    """Send a frame to the caller from any thread of the rank (a capability's, say), tagged
    with the request running now; the caller's engine hands it to its handler for ``kind``."""
    if _caller:
        channel, state = _caller[0]
        send(channel, pack(kind, state.request, body), fds)


def install_stdin(channel: socket.socket, state: RankState) -> None:
    """The user's reads of stdin are asked of the caller on ``channel``; breakpoint() works."""
    stdin.install(lambda token: send(channel, pack(ASK, state.request, pickle.dumps(token))))
    stdin.install_breakpointhook()


def start(control: socket.socket, state: RankState) -> None:
    threading.Thread(target=_loop, args=(control, state), name="mpify_nb-control", daemon=True).start()


def _interrupt(state: RankState, control: socket.socket, req_id: int, body: Any) -> None:
    with state.lock:  # the main thread cannot end the request meanwhile (begin() waits)
        if state.request == req_id:
            for hook in list(_before_interrupt):
                try:
                    hook()
                except Exception:
                    pass  # the interrupt itself matters more
            signal.pthread_kill(state.main_ident, signal.SIGINT)


def _watch(state: RankState, control: socket.socket, req_id: int, body: Any) -> None:
    state.recorder_for = req_id


on(ANSWER, lambda state, control, req_id, body: stdin.deliver(*pickle.loads(body)))
on(INTERRUPT, _interrupt)
on(WATCH, _watch)


def _loop(control: socket.socket, state: RankState) -> None:
    """Frames from the caller, and the looks at the main thread while it runs a request; if
    the caller goes away (its end closes), end this rank and everything it started."""
    watched = NO_REQUEST
    reported: list[waits.Wait] = []
    next_raw = next_watch = 0.0
    while True:
        busy = state.request != NO_REQUEST
        wait = max(0.0, min(next_raw, next_watch) - time.monotonic()) if busy else None
        ready = select.select([control, state.wake_r], [], [], wait)[0]
        if state.wake_r in ready:
            try:
                os.read(state.wake_r, 4096)
            except BlockingIOError:
                pass
        if control in ready:
            try:
                message = framing.recv(control)
            except (OSError, EOFError):
                message = None
            if message is None:
                caller_gone()
            kind, req_id, body = unpack(message[0])
            handler = _handlers.get(kind)
            if handler is not None:
                handler(state, control, req_id, body)
        request = state.request
        now = time.monotonic()
        if request != watched:
            # A request has just begun: no look until it has run a while (most end within a
            # millisecond, and a look takes the GIL from them).
            watched, reported = request, []
            next_raw, next_watch = now + stdin.RAW_READ_PERIOD, now + WATCH_PERIOD
            if not state.watch_stack:
                next_watch = float("inf")
        if request == NO_REQUEST:
            continue
        if now >= next_raw:
            next_raw = now + stdin.RAW_READ_PERIOD
            if stdin.raw_read_waiting():  # C code, or /dev/stdin opened again, reads fd 0
                send(control, pack(ASK, request, pickle.dumps(stdin.RAW)))
        if now < next_watch:
            continue
        next_watch = now + WATCH_PERIOD
        found = waits.waits_of(state.main_ident, recorder=state.recorder_for == request)
        # Where it waits is the line it blocks on now (an async collective is issued on one
        # line and waited for on a later one).
        where = waits.user_line(state.main_ident) if found else None
        found = [dataclasses.replace(w, where=where) for w in found]
        if found != reported:
            reported = found
            send(control, pack(COLLECTIVE, request, pickle.dumps(reported)))


def caller_gone() -> NoReturn:
    process.flush_stdio()
    process.kill_descendants()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit  # not reached
