"""Stopping the caller's own rank only where the notebook survives it: never inside an import.

The caller's own rank (launcher/own_rank.py) runs the user's function on a thread of the notebook
itself, and when another rank fails first that thread is stopped with an exception raised into
it (``Aborted``; the stop button's ``KeyboardInterrupt`` for a rank on a worker thread). Python
raises such an exception at the thread's next bytecode, wherever that is. Inside an import it
breaks the notebook until it restarts: the module being run is dropped from ``sys.modules``, the
submodules it had finished stay, and the next import of it binds none of them (``module
'torch._dynamo' has no attribute 'utils'``, ``partially initialized module 'torch' has no
attribute 'jit'``).

So a stop is raised at a *safe point* only: between the thread's frame and the call's own, no
frame of the import system (``importlib._bootstrap``, where every import runs, module top levels
and extension inits included), no module top level being initialized and no finalizer
(``__del__``: an exception there is lost, and its cleanup is cut short), and the import lock not
held. Until then it waits, and is raised as soon as the thread is out::

    call's watch thread: abort()  ──>  SafeStop.request(Aborted)
                                          │  the "mpify_nb-stop" thread, while the rank's code runs:
                                          │  is the thread at a safe point now? (sys._current_frames;
                                          │  else look again in 10 ms)
                 ┌────────────────────────┴────────────────────────┐
      the main thread: one SIGINT (it ends a            another thread (or the main one when the user's
      sleep; none while one is on its way: a rank       code replaced our SIGINT handler): an asynchronous
      blocked in C gets no stream of EINTRs)            exception (PyThreadState_SetAsyncExc), looked at
                                                        again right after, taken back if it went unsafe
                 │
      own rank's handler, on that thread: ``take(frame)``: safe here? raise it : leave it for later

An exception Python cannot propagate where it landed (a weakref or gc callback, which no frame
gives away: it goes to ``sys.unraisablehook``, "Exception ignored in ...") is not lost: it is
raised again at the next safe point. Other Python code that C calls back (a hook, a
``__torch_function__``) may be stopped: C code must handle an exception from a callback anyway
(KeyboardInterrupt, MemoryError), and torch's does. A rank blocked in C (a collective) is still
released: its peers are killed, the C call returns with an error, and the stop follows at its
next bytecode.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, Optional

#: Seconds between two looks at a thread that was not at a safe point.
_POLL = 0.01

_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(__import__("importlib").__file__))

try:
    from _imp import lock_held as _import_lock_held
except ImportError:  # not CPython
    def _import_lock_held() -> bool:
        return False


def _is_unsafe(frame: FrameType) -> bool:
    """The import system, a module's top level being run, a finalizer, or our unraisable hook."""
    code = frame.f_code
    if code.co_name == "__del__" or code is _unraisable.__code__:
        return True
    if code.co_filename.startswith(("<frozen importlib.", "<frozen zipimport")):
        return True
    if os.path.dirname(code.co_filename) == _IMPORTLIB_DIR:  # importlib unfrozen, importlib.util's LazyLoader
        return True
    if code.co_name == "<module>":  # a module's top level run by someone else than importlib (runpy)
        spec = frame.f_globals.get("__spec__")
        return bool(getattr(spec, "_initializing", False))
    return False


def unsafe_frame(frame: Optional[FrameType], base: Optional[FrameType]) -> Optional[FrameType]:
    """The outermost frame from ``frame`` back to ``base`` (exclusive: the call's own, below which
    the notebook's state is not ours to judge) where a raised exception would leave the interpreter
    broken; None when it is a safe point."""
    if _import_lock_held():
        return frame  # the import lock is held (by anyone): an import is under way
    found = None
    while frame is not None and frame is not base:
        if _is_unsafe(frame):
            found = frame
        frame = frame.f_back
    return found


def set_async_exception(thread_id: int, exc_type: Optional[type]) -> None:
    """Raise ``exc_type`` in another thread at its next bytecode (None: cancel a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else ctypes.c_void_p(None))


class SafeStop:
    """Raises one exception into one thread (the one running the caller's rank), at a safe point,
    while that thread runs the user's code (``enter``/``leave``)."""

    def __init__(self, thread_id: int, on_main_thread: bool) -> None:
        self.thread_id = thread_id
        self.on_main_thread = on_main_thread
        self._cond = threading.Condition()
        self._base: Optional[FrameType] = None  # the frame the user's code runs under
        self._inside = False
        self._begun = False  # enter() was called: a request before it waits for it
        self._wanted: Optional[type] = None  # what to raise
        self._raised = False  # it was raised (as far as we know: see _swallowed())
        self._signal_out = False  # a SIGINT of ours is on its way to the main thread
        self._thread: Optional[threading.Thread] = None
        #: the main thread's SIGINT handler that calls take() (own_rank's); when the user's code
        #: replaced it (accelerate's notebook_launcher does), a signal would not reach us
        self.handler: Any = None

    @property
    def inside(self) -> bool:
        return self._inside

    def enter(self, base: FrameType) -> None:
        """The thread starts the user's code, under ``base``: from now on it may be stopped. A stop
        requested before (a peer died as the call began) is raised here, and no user code runs."""
        with self._cond:
            self._begun = True
            early = self._wanted
            if early is None:
                self._base, self._inside = base, True
        if early is not None:
            raise early()

    def leave(self) -> None:
        """The thread left the user's code: nothing is raised into it any more."""
        with self._cond:
            self._inside = False
            self._base = None
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def request(self, exc_type: type) -> bool:
        """Have ``exc_type`` raised in the thread at its next safe point (a first request wins);
        before the user's code began, as it begins (enter). False once it has left it (nothing
        to stop)."""
        with self._cond:
            if not self._begun:
                if self._wanted is None:
                    self._wanted = exc_type
                return True
            if not self._inside:
                return False
            if self._wanted is None:
                self._wanted = exc_type
                self._thread = threading.Thread(target=self._run, name="mpify_nb-stop", daemon=True)
                self._thread.start()
            return True

    def take(self, frame: Optional[FrameType]) -> tuple[Optional[type], bool]:
        """On the main thread, in its SIGINT handler (``frame``: where it runs): (the exception to
        raise now, or None; whether the signal was one of ours or a stop is pending, so the
        handler must not treat it as the user's)."""
        with self._cond:
            ours = self._signal_out
            self._signal_out = False
            if self._wanted is None or self._raised or not self._inside:
                return None, ours
            if unsafe_frame(frame, self._base) is not None:
                self._cond.notify_all()  # the stop thread looks again, and sends another once safe
                return None, True
            self._raised = True
            return self._wanted, True

    def watch_unraisable(self) -> Callable[[], None]:
        """Until the returned function is called: a stop raised where Python cannot propagate it
        (a weakref callback) reaches ``sys.unraisablehook``, and is raised again at the next safe
        point. (Its report is written first, outside any stop: the hook is not a safe point.)"""
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            _unraisable(self, previous, unraisable)

        sys.unraisablehook = hook

        def restore() -> None:
            if sys.unraisablehook is hook:
                sys.unraisablehook = previous

        return restore

    def _swallowed(self, unraisable: Any) -> None:
        with self._cond:
            if self._wanted is not None and self._raised and isinstance(unraisable.exc_value, self._wanted):
                self._raised = False
                self._cond.notify_all()

    # -- the stop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        with self._cond:
            while self._inside:
                if self._raised or self._signal_out:
                    self._cond.wait()  # raised, or on its way: until swallowed(), take() or leave()
                    continue
                frames = sys._current_frames()  # a look, not a promise: the handler looks again where it lands
                if unsafe_frame(frames.get(self.thread_id), self._base) is not None:
                    del frames
                    self._cond.wait(_POLL)
                    continue
                del frames
                if self.on_main_thread and signal.getsignal(signal.SIGINT) is self.handler:
                    self._signal_out = True
                    signal.pthread_kill(self.thread_id, signal.SIGINT)  # its handler calls take()
                else:  # another thread; or the main one, whose SIGINT handler is not ours any more
                    self._raised = self._raise_async()
                    if not self._raised:
                        self._cond.wait(_POLL)

    def _raise_async(self) -> bool:
        """Raise the exception into the (other) thread, which was at a safe point when looked at;
        look again right after, and take it back if it went into an import meanwhile."""
        assert self._wanted is not None
        set_async_exception(self.thread_id, self._wanted)
        if unsafe_frame(sys._current_frames().get(self.thread_id), self._base) is None:
            return True
        set_async_exception(self.thread_id, None)
        return False

    def forget_in_child(self) -> None:
        """In a fork of the caller: the stop thread does not exist there, and its lock may be held."""
        self._cond = threading.Condition()
        self._thread = None
        self._inside = False


def _unraisable(stop: SafeStop, previous: Callable[[Any], None], unraisable: Any) -> None:
    """sys.unraisablehook while a stop may come: report as before, then let the stop come again.
    Its frame is never a safe point (see _is_unsafe): a stop landing in the report would be lost."""
    try:
        previous(unraisable)
    finally:
        stop._swallowed(unraisable)
