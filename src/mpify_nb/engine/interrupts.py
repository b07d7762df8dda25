"""The stop button for calls that run on a thread other than the main one.

Python runs signal handlers on the main thread only, so a SIGINT (Ctrl-C, or the
notebook's stop button, which is a SIGINT to the kernel) never reaches a ``ranch()``
that a worker thread is running: its ranks would go on until they finish.

We put one handler in front of the process's own SIGINT handler (from the main
thread, the only one allowed to)::

    SIGINT ──> on_sigint (main thread) ──> call.interrupt_from_signal()  for every
                   │                        call running on another thread
                   └──> the handler that was there before (KeyboardInterrupt,
                        ipykernel's idle SIG_IGN, the user's own handler ...)

In a Jupyter kernel the handler that counts is the one the kernel restores between
cells (ipykernel ignores SIGINT while idle and swaps in ``default_int_handler``
while a cell runs), so we also chain in front of that one: the stop button then
stops a background call while the notebook is idle, and a cell's own
KeyboardInterrupt is unchanged.

A process that ignores SIGINT (started with it ignored: ``nohup``, ``cmd &`` in a script, some
CI runners) keeps ignoring it: nothing is chained in front of its ``SIG_IGN``, so the user's
SIGINT stops no call (ipykernel's idle ``SIG_IGN`` is the kernel's, not the process's, and
is chained as above).

A call running on the main thread takes SIGINT itself while it runs (own_rank's
``_take_sigint``, ``take_sigint`` below) and calls ``interrupt_other_threads()`` from there, so one
press stops every call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Protocol


class Interruptible(Protocol):
    def interrupt_from_signal(self) -> None: ...


#: Calls running on threads other than the main one. No lock: the signal handler runs
#: on the main thread between bytecodes, and must never wait for one.
_running: weakref.WeakSet[Any] = weakref.WeakSet()


#: Presses within this long after a call finished stopping repeat the press that stopped it.
PRESS_REPEAT = 0.5


class Presses:
    """The stop button's presses, as the main thread's SIGINT handlers see them: the first one
    during a call stops it; the others while it stops (its ranks killed, where they were looked
    at, the KeyboardInterrupt that says so raised) and within PRESS_REPEAT after it change
    nothing. Pressed five times within 50 ms, a call stops once and says so once: a repeat
    raised in the middle of its stop cut the message, its cleanup, or IPython's own traceback
    printing (an AssertionError in ultratb) short. Main thread only: handlers run there."""

    def __init__(self) -> None:
        self.calls = 0  # calls running on the main thread now
        self.acted = False  # a press stopped the one running
        self.quiet_until = 0.0

    def take(self) -> bool:
        """In a SIGINT handler: does this press act (False: it repeats one that did)?"""
        if self.calls:
            repeat, self.acted = self.acted, True
            return not repeat
        return time.monotonic() >= self.quiet_until

    def new_cell(self) -> None:
        """A cell starts (IPython's pre_execute): a press from now on is its own, never a repeat of
        the one that stopped the cell before. (A press 0.46 s after a stop, in the next cell, was
        dropped: a restart loop went on, CI's every run.)"""
        if not self.calls:
            self.quiet_until = 0.0

    @contextlib.contextmanager
    def during_call(self) -> Iterator[None]:
        """A call runs on the main thread meanwhile (elsewhere: nothing to do)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1
            if not self.calls:
                if self.acted:
                    self.quiet_until = time.monotonic() + PRESS_REPEAT
                self.acted = False


presses = Presses()


class _ChainedHandler:
    """Stops our background calls, then does what ``previous`` did."""

    def __init__(self, previous: Any):
        self.previous = previous

    def __call__(self, signum: int, frame: Any) -> None:
        if not presses.take():
            return  # the same press as the one a call is stopping for (or just stopped for)
        interrupt_other_threads()
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt
        # SIG_IGN (ipykernel while idle): nothing more to do


def install() -> None:
    """Chain our handler in front of the current SIGINT handler(s). Main thread only;
    does nothing elsewhere or when already installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    if process_ignores_sigint():
        return  # its choice: keep it
    try:
        current = signal.getsignal(signal.SIGINT)
        if not isinstance(current, _ChainedHandler) and current is not None:
            signal.signal(signal.SIGINT, _ChainedHandler(current))
    except ValueError:  # not the main interpreter
        return
    kernel = _running_ipykernel()
    saved = getattr(kernel, "saved_sigint_handler", None)
    if saved is not None and not isinstance(saved, _ChainedHandler):
        # The handler the kernel puts back when this cell ends (SIG_IGN: idle).
        kernel.saved_sigint_handler = _ChainedHandler(saved)  # type: ignore[union-attr]
    _presses_per_cell()


_cells_told: list[Any] = []  # the IPython shell that tells presses each new cell


def _presses_per_cell() -> None:
    """In an IPython shell, each cell starts with no quiet window (Presses.new_cell)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or any(told is shell for told in _cells_told):
        return
    shell.events.register("pre_execute", presses.new_cell)
    _cells_told.append(shell)


def process_ignores_sigint() -> bool:
    """This process ignores SIGINT (``SIG_IGN``, and not as a Jupyter kernel does while idle)."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN and _running_ipykernel() is None


def _running_ipykernel() -> Any:
    if "ipykernel.kernelbase" not in sys.modules:
        return None
    kernel_class = sys.modules["ipykernel.kernelbase"].Kernel
    try:
        return kernel_class.instance() if kernel_class.initialized() else None
    except Exception:
        return None


def register(call: Interruptible) -> None:
    _running.add(call)


def unregister(call: Interruptible) -> None:
    _running.discard(call)


def interrupt_other_threads() -> None:
    """Stop every registered call (those running on a thread other than the main one)."""
    while True:
        try:
            calls = list(_running)
            break
        except RuntimeError:  # another thread registered meanwhile
            continue
    for call in calls:
        call.interrupt_from_signal()




def take_sigint(on_sigint: Callable[[], None], call: Interruptible) -> Callable[[], None]:
    """While a call waits: SIGINT (the stop button) calls ``on_sigint`` (a flag and a wake,
    never raising anywhere, so it never cuts a message in half), unless the process ignores it.
    On another thread, the main thread's handler reaches ``call`` through engine/interrupts.py.
    Returns what puts it back."""
    if threading.current_thread() is not threading.main_thread():
        install()
        register(call)
        return lambda: unregister(call)
    if process_ignores_sigint():
        return lambda: None  # the process ignores SIGINT (nohup, a CI runner): it keeps ignoring it
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: on_sigint() if presses.take() else None)
    except ValueError:
        return lambda: None

    def restore() -> None:
        signal.signal(signal.SIGINT, old)

    return restore



def _forget_after_fork() -> None:
    # A fork (a DataLoader worker) runs none of its parent's calls: its Ctrl-C must not
    # write to their wake pipes, which it inherited.
    _running.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
