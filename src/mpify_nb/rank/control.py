"""A rank's control thread: what its caller says while the main thread runs a request.

Every rank has one (a ``ranch`` rank from the moment it runs its call, on its channel; a
Session's rank from birth, on its control channel). It only answers: between the caller's
frames it sleeps in ``recv``, so it costs a training loop nothing::

    caller ── ANSWER (token, line) ──> deliver to the user's input() / pdb (rank/stdin.py)
           ── INTERRUPT req ─────────> SIGINT to the main thread, only while it runs req (a
                                       thread the debugger holds at a breakpoint is let go first)
           ── LOOK round ────────────> look at the main thread and torch's recorder
           <── SEEN round snapshot ──  (torchdist/waits.py: what it waits in, where it is),
           <── ASK req RAW ──────────  and at a read of fd 0 by C code (rank/stdin.py)
           ── PEEK_STDIN ────────────> its stdout holds a partial line: a read of fd 0 after
           <── ASK req RAW ──────────  it (pdb's prompt on a /dev/stdin opened again)?
           ── <kind> req body ───────> the handler registered for <kind> (on()): a Session's
                                       ABORT_GROUP, a capability's frames (which answers,
                                       from any thread, with to_caller())
     (control channel closes) ───────> the caller is gone: flush, end what we started, die
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
from typing import Any, Callable, NoReturn, Optional

from ..torchdist import waits
from ..wire import framing
from ..wire.protocol import ANSWER, ASK, INTERRUPT, LOOK, NO_REQUEST, PEEK_STDIN, SEEN, pack, unpack
from . import process, stdin


class RankState:
    """What the main thread is doing, shared with the control thread."""

    def __init__(self, rank: int = -1) -> None:
        self.lock = threading.Lock()
        self.rank = rank
        self.request = NO_REQUEST  # the request the main thread runs now
        self.in_user_code = False  # SIGINT raises KeyboardInterrupt only then
        self.main_ident = threading.get_ident()
        self.main_native: Optional[int] = threading.get_native_id()

    def begin(self, req_id: int) -> None:
        """The main thread starts request ``req_id`` (NO_REQUEST: it is done)."""
        with self.lock:
            self.request = req_id

    def snapshot(self, stack: bool = False) -> waits.Snapshot:
        """A look at this rank now (torchdist/waits.py)."""
        return waits.snapshot(self.rank, self.main_ident, self.main_native, stack=stack)


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


_SIGINT = {signal.SIGINT}


def send(channel: socket.socket, data: bytes, fds=()) -> None:
    """One frame to the caller, whole, whichever thread sends (a display, an ASK for input).
    On the main thread an interrupt (INTERRUPT: SIGINT to it) waits until the frame is out: one
    that cut it between its header and its body would leave the caller a corrupt channel, and the
    rank lost with its state (pdb's next prompt goes out just as the stop button's interrupt
    lands). SIGINT is blocked meanwhile; a handler already due runs at framing.send's first
    line, before a byte is written; KeyboardInterrupt comes right after the frame."""
    main = threading.current_thread() is threading.main_thread()
    before = None
    try:
        if main:
            before = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGINT)
        framing.send(channel, data, fds)
    except OSError:
        pass  # the caller is gone; the control thread ends us
    finally:
        if main and (before is None or signal.SIGINT not in before):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)


#: This rank's channel to its caller and its state, once its loop runs (to_caller()).
_caller: list[tuple[socket.socket, RankState]] = []


def connect(channel: socket.socket, state: RankState) -> None:
    """The rank's loop starts on ``channel``: to_caller() sends there."""
    _caller[:] = [(channel, state)]


def in_a_rank() -> bool:
    """Is this process a rank (its loop runs), not the caller?"""
    return bool(_caller)


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


def _look(state: RankState, control: socket.socket, req_id: int, body: Any) -> None:
    """The caller looks (engine/watch.py): a read of fd 0 that waits is asked of the user, and
    what the main thread waits in goes back, with the round's number."""
    request = state.request
    if request != NO_REQUEST and stdin.raw_read_waiting():  # C code, or /dev/stdin opened again, reads fd 0
        send(control, pack(ASK, request, pickle.dumps(stdin.RAW)))
    asked = pickle.loads(body) if len(body) else {}
    send(control, pack(SEEN, req_id, pickle.dumps(state.snapshot(stack=bool(asked.get("stack"))))))


#: After a partial line on stdout, a read of fd 0 is looked for this long after (it follows
#: the prompt by microseconds, or by a few milliseconds on a loaded machine).
PEEK_DELAYS = (0.0, 0.01, 0.05, 0.15)


def _peek_stdin(state: RankState, control: socket.socket, req_id: int, body: Any) -> None:
    """Its stdout holds a line without its end (the caller saw it): a prompt before a read of fd 0
    (pdb on a /dev/stdin opened again, C code)? Asked of the user before the caller shows it."""
    for delay in PEEK_DELAYS:
        if delay:
            time.sleep(delay)
        request = state.request
        if request == NO_REQUEST or stdin.asking():
            return  # a read through sys.stdin asks for itself: the control thread must not sleep past its ANSWER
        if stdin.raw_read_waiting(quick=True):
            send(control, pack(ASK, request, pickle.dumps(stdin.RAW)))
            return


on(ANSWER, lambda state, control, req_id, body: stdin.deliver(*pickle.loads(body)))
on(INTERRUPT, _interrupt)
on(LOOK, _look)
on(PEEK_STDIN, _peek_stdin)


def _loop(control: socket.socket, state: RankState) -> None:
    """Frames from the caller, each to its handler; if the caller goes away (its end closes),
    end this rank and everything it started."""
    while True:
        kind, req_id, body = unpack(framing.recv_or(control, caller_gone)[0])
        handler = _handlers.get(kind)
        if handler is not None:
            handler(state, control, req_id, body)


def caller_gone() -> NoReturn:
    process.flush_stdio()
    process.kill_descendants()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit  # not reached
