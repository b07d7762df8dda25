"""Background work: a call on the ranks that runs while the notebook goes on, behind a handle,
:class:`BackgroundWork` (a ``concurrent.futures.Future``).

``ranch(..., wait=False)``, ``Session.run(..., wait=False)`` and ``%%distributed --bg`` make the
call a blocking one makes, with the same loop (output, deaths, stdin, ``timeout=``, the
collective watch), on a thread of its own started in a copy of the starting cell's context.
ipykernel keeps a cell's parent header in a contextvar, so everything that thread shows, the
ranks' lines, bars and figures, the live status line, its error, goes to the cell that started
the work while other cells run::

    cell In [5]: s.run(code, wait=False)
      │ the use claims its ranks first: a second call is refused (RanksBusyError)
      │ BackgroundWork(what, ranks).start(run) ─── thread "mpify_nb-background", In [5]'s context:
      v                                              run(): the call, as a blocking one runs it
    handle ◄── value or error ─────────────────────   attach(engine, stop, look): it can be stopped
      done(), result(timeout), exception(),         an error is shown in In [5] as well
      add_done_callback(fn), await handle
      cancel() ── stop(): what the stop button does to a blocking call (a Session's ranks are
                  interrupted and keep their state; ranch's are ended); result() raises CancelledError
      where() ── look(): each rank's stack now;  repr: which ranks, for how long, where

The stop button stops the cell that runs now, never background work: a press that ends a slow
``%%local`` cell leaves the training alone (``cancel()``, ``%dist_stop`` stop it). Nobody is at the
starting cell to answer a prompt: a rank's ``input()`` (and pdb's) raises StdinUnavailableError
saying so (``refusal``). At exit, work still running is cancelled (bounded), so nothing outlives
the kernel.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

from .where import Where

#: How long cancel() waits for the work to stop (a Session's stop is bounded by ~5 s of patience
#: with ranks that ignore interrupts, then a group rebuild); it asks again this often meanwhile.
_CANCEL_PATIENCE = 30.0
_ASK_AGAIN = 0.25
#: At exit, how long each work still running gets to stop.
_EXIT_PATIENCE = 5.0

_local = threading.local()
_running: set[BackgroundWork] = set()
_running_lock = threading.Lock()


class RanksBusyError(RuntimeError):
    """A call was refused because background work holds the ranks it needs: it would either
    wait an unknown time or interleave with that work. The message says which work holds them,
    since when, and how to wait for it or stop it.

    Attributes:
        work: the :class:`BackgroundWork` that holds the ranks.

    Example (a notebook cell):

    ```python
    from mpify_nb import RanksBusyError, Session

    s = Session(2)
    h = s.run("import time; time.sleep(30)", wait=False)
    try:
        s.run("1 + 1")
    except RanksBusyError as e:
        print(type(e).__name__, e.work is h)
    h.cancel()
    s.close()
    ```

    ```output
    RanksBusyError True
    ```
    """

    def __init__(self, message: str, work: Optional[BackgroundWork] = None) -> None:
        super().__init__(message)
        self.work = work


def current() -> Optional[BackgroundWork]:
    """The background work this thread runs (None: none; a cell's own thread)."""
    return getattr(_local, "work", None)


class BackgroundWork(concurrent.futures.Future):
    """A call running on ranks in the background, started by ``ranch(..., wait=False)``,
    ``Session.run(..., wait=False)`` or ``%%distributed --bg``. It is a
    ``concurrent.futures.Future``: ``done()``, ``result(timeout)``, ``exception()``,
    ``add_done_callback(fn)`` (run on the work's thread when it ends), ``concurrent.futures.wait``
    work with it, and a cell may ``await`` it.

    Its ranks' output goes to the cell that started it, live, while other cells run; an error
    shows there too, and ``result()`` raises it (the errors a blocking call raises). ``cancel()``
    stops it as the stop button stops a blocking call; the stop button itself stops only the
    cell running now.

    Attributes:
        what: what runs (``"Session.run"``, ``"ranch(train)"``, ``"%%distributed"``).
        cell: the cell that started it (``"In [5]"``; ``""`` outside IPython).
        ranks: the ranks it runs on.

    Example (a notebook cell):

    ```python
    import time
    from mpify_nb import Session

    s = Session(2)
    h = s.run("import time\\nfor step in range(20):\\n    time.sleep(0.05)\\nstep", wait=False)
    print(h.done())          # it runs; this cell is free
    print(h.result())        # wait for it: each rank's value
    s.close()
    ```

    ```output
    False
    {0: 19, 1: 19}
    ```
    """

    def __init__(self, what: str, ranks: Sequence[int]) -> None:
        super().__init__()
        self.what = what
        self.cell = starting_cell()
        self.ranks = sorted(ranks)
        self.started = time.monotonic()
        self.ended: Optional[float] = None
        self._stop: Optional[Callable[[], None]] = None
        self._look: Optional[Callable[[float], Where]] = None
        self._engine: Any = None
        self._cancel_asked = False
        self._was_cancelled = False
        self._thread: Optional[threading.Thread] = None

    # -- the use's side --------------------------------------------------------------------------

    def start(self, run: Callable[[], Any]) -> BackgroundWork:
        """Run ``run()`` on a thread of its own, in a copy of this (the starting cell's) context;
        its value or error becomes this handle's. Returns self."""
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run, run), name="mpify_nb-background",
                                        daemon=True)  # a kernel shutting down does not wait for it: it is cancelled
        with _running_lock:
            _running.add(self)
        self._thread.start()
        return self

    def attach(self, engine: Any, stop: Callable[[], None], look: Callable[[float], Where]) -> None:
        """From ``run()``, once its call can be stopped: ``stop()`` stops it (from any thread),
        ``look(timeout)`` says where its ranks are; ``engine``'s prompts are refused meanwhile."""
        self._engine, self._stop, self._look = engine, stop, look
        engine.user_waits.refusal = self.refusal
        if self._cancel_asked:
            stop()

    def refusal(self, rank: int) -> str:
        """Why rank ``rank``'s read of its stdin gets no answer (StdinUnavailableError's message)."""
        started = f", started in {self.cell}" if self.cell else ""
        return (f"rank {rank} read its stdin (input(), pdb) in background work ({self.what}{started}), where "
                "nobody can answer: run it in the foreground (without wait=False or --bg) to answer "
                "prompts and debug with breakpoint()")

    def _run(self, run: Callable[[], Any]) -> None:
        _local.work = self
        self.set_running_or_notify_cancel()
        try:
            value = run()
        except BaseException as e:
            error = self._settled(e)
            self._end()
            _show_in_cell(error)
            self.set_exception(error)
        else:
            self._end()
            self.set_result(value)
        finally:
            _local.work = None

    def _settled(self, error: BaseException) -> BaseException:
        """What ``result()`` raises: the work's error; a CancelledError when cancel() stopped it."""
        if not (self._cancel_asked and isinstance(error, KeyboardInterrupt)):
            return error
        self._was_cancelled = True
        where = str(error) if error.args else ""
        cancelled = concurrent.futures.CancelledError(
            f"{self.label()} was cancelled" + (f" ({where})" if where else ""))
        cancelled.__cause__ = error
        return cancelled

    def detach(self) -> None:
        """From ``run()``, when its call is over: the engine's prompts are the next call's again
        (a Session's engine outlives the work), and nothing of the call is kept past its end (a
        ranch call's engine, ranks, relay), however long the handle lives in the notebook."""
        engine, self._engine, self._stop, self._look = self._engine, None, None, None
        if engine is not None:
            engine.user_waits.refusal = None

    def _end(self) -> None:
        self.ended = time.monotonic()
        self.detach()
        with _running_lock:
            _running.discard(self)

    # -- the user's side -------------------------------------------------------------------------

    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait for the work to end (at most ``timeout`` seconds) and return its value: what the
        blocking call returns. Raises what the blocking call raises (a RankError, a
        CollectiveError, ``timeout=``'s TimeoutError ...), ``CancelledError`` after ``cancel()``,
        and ``TimeoutError`` when it still runs after ``timeout`` (it goes on). The stop button
        stops the wait, not the work."""
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            if self.done():
                raise  # the work's own (timeout= of its call)
            raise TimeoutError(f"{self.label()} still runs after {timeout:g} s; it goes on "
                               "(cancel() stops it)") from None
        except KeyboardInterrupt:
            if self.done():
                raise
            raise KeyboardInterrupt(f"stopped waiting; {self.label()} goes on (cancel() stops it)") from None

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The work's error (None when it returned), waiting as :meth:`result` does."""
        error = super().exception(timeout)
        if self._was_cancelled and error is not None:
            raise error
        return error

    def cancel(self) -> bool:
        """Stop the work as the stop button stops a blocking call: a Session's ranks stop what
        they run and keep their state, a ranch's ranks are ended. Returns once it has stopped:
        True when this stopped it, False when it had ended already (its result stands)."""
        return self._cancel(_CANCEL_PATIENCE)

    def _cancel(self, patience: float) -> bool:
        if self.done():
            return self._was_cancelled
        self._cancel_asked = True
        deadline = time.monotonic() + patience
        while not self.done() and time.monotonic() < deadline:
            stop = self._stop
            if stop is not None:
                try:
                    stop()  # again while it lasts: a stop asked before the call began is a no-op
                except Exception:
                    pass
            concurrent.futures.wait([self], timeout=_ASK_AGAIN)
        return self._was_cancelled

    def cancelled(self) -> bool:
        """Did :meth:`cancel` stop it?"""
        return self._was_cancelled

    def running(self) -> bool:
        return not self.done()

    def where(self, timeout: float = 5.0) -> Where:
        """Where each rank is now: its stack and the collectives it waits in (``Session.where()``'s
        answer); empty once the work has ended. The work goes on."""
        look = self._look
        if look is None or self.done():
            return Where()
        return look(timeout)

    def __await__(self):
        # A mirror, so that a cell's task cancelled while it awaits never cancels the work.
        mirror: concurrent.futures.Future = concurrent.futures.Future()

        def copy(work: concurrent.futures.Future) -> None:
            if mirror.cancelled():
                return
            error = concurrent.futures.Future.exception(work)
            if error is None:
                mirror.set_result(work.result())
            else:
                mirror.set_exception(error)

        self.add_done_callback(copy)
        return asyncio.wrap_future(mirror).__await__()

    # -- what it says of itself ------------------------------------------------------------------

    def label(self) -> str:
        """``the background work %%distributed of In [5]``: which work, started where."""
        cell = f" started in {self.cell}" if self.cell else ""
        return f"the background work {self.what}{cell}"

    def state(self) -> str:
        """``running for 1 min 3 s``, ``finished after 2.1 s``, ``failed after ...: error``, ``cancelled``."""
        if not self.done():
            return f"running for {duration(time.monotonic() - self.started)}"
        took = duration((self.ended or time.monotonic()) - self.started)
        if self._was_cancelled:
            return f"cancelled after {took}"
        error = concurrent.futures.Future.exception(self)
        if error is None:
            return f"finished after {took}"
        first = str(error).splitlines()[0] if str(error) else ""
        return f"failed after {took}: {type(error).__name__}" + (f": {first}" if first else "")

    def __repr__(self) -> str:
        where = ""
        if not self.done() and self._engine is not None:
            try:
                where = self._engine.watch.where_text(short=True)
            except Exception:
                where = ""
        cell = f" from {self.cell}" if self.cell else ""
        return (f"<BackgroundWork {self.what}{cell} on ranks {self.ranks}: {self.state()}"
                + (f"; {where}" if where else "") + ">")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def duration(seconds: float) -> str:
    """``3.2 s``, ``1 min 3 s``, ``2 h 5 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _shell() -> Any:
    if "IPython" not in sys.modules:
        return None
    try:
        from IPython import get_ipython

        return get_ipython()
    except Exception:
        return None


def starting_cell() -> str:
    """``In [5]``: the cell running now, by its prompt's number (``""`` outside IPython). IPython
    9 adds one to ``execution_count`` before a cell runs: the display hook's result holds the
    cell's own number (magics/cell.py's cell_number says more)."""
    shell = _shell()
    if shell is None:
        return ""
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(running, "execution_count", None)
    if not isinstance(number, int):
        number = getattr(shell, "execution_count", None)
    return f"In [{number}]" if isinstance(number, int) else ""


def _show_in_cell(error: BaseException) -> None:
    """In a Jupyter kernel, on the work's thread (its cell's context): the error where the work
    started, as a cell shows one (a rank's traceback; other errors by their message: their frames
    are this library's). A cancel is a line on stderr. Elsewhere only result() tells."""
    shell = _shell()
    if shell is None or getattr(shell, "kernel", None) is None:
        return
    try:
        if isinstance(error, concurrent.futures.CancelledError):
            print(f"[mpify_nb] {error}", file=sys.stderr, flush=True)
            return
        if getattr(error, "_render_traceback_", None) is None:
            message = str(error)
            lines = [f"{type(error).__name__}: {message}" if message else type(error).__name__]
            error._render_traceback_ = lambda: lines  # type: ignore[attr-defined]
        shell.showtraceback((type(error), error, error.__traceback__))
    except Exception:
        pass  # the kernel is shutting down: result() still raises it


def _cancel_at_exit() -> None:
    with _running_lock:
        works = list(_running)
    for work in works:
        try:
            work._cancel(_EXIT_PATIENCE)
        except BaseException:
            pass


def _forget_after_fork() -> None:
    # A fork of the notebook (a DataLoader worker) runs none of its works: at its exit it must not
    # stop them through the channels it inherited.
    global _running_lock
    _running.clear()
    _running_lock = threading.Lock()


atexit.register(_cancel_at_exit)
os.register_at_fork(after_in_child=_forget_after_fork)
