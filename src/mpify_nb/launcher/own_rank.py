"""The caller's own rank: a ranch call's rank that runs on the calling thread, stopped from
the engine's loop, and what it changes in this process (put back after the call).

The loop (on another thread, or the caller's own between its steps) stops this rank when
another rank failed first: with :class:`Aborted` raised into the user's code only, and there
only at a safe point, never inside an import (launcher/stopping.py): with SIGINT to the main
thread, through a handler that raises it, or an asynchronous exception into the calling thread
when that is not the main one. The stop button reaches a rank on another thread the same way.

A process that ignores SIGINT (``nohup``, ``&`` in a script, some CI runners) keeps ignoring the
user's: a call never turns it into KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any, Callable, Optional

from ..engine import background, interrupts
from ..torchdist import compat, groups, libraries, rendezvous
from .stopping import SafeStop, set_async_exception


class Aborted(BaseException):
    """Raised in the caller's own rank when another rank failed: stop and report that instead."""


#: Held by the one call that plays a rank in this process (it owns os.environ & co meanwhile).
caller_rank_lock = threading.Lock()
caller_rank_owner = ""
caller_rank_work: Optional[background.BackgroundWork] = None  # the owner, when it runs in the background


def claim_process(work: Optional[background.BackgroundWork] = None) -> None:
    """Claim this process for a call that plays a rank in it (``work``: background work that
    will, from its own thread; the claim is released there). Raises RanksBusyError when another
    call has it: two cannot share this process's os.environ, torch.distributed group and streams."""
    global caller_rank_owner, caller_rank_work
    if not caller_rank_lock.acquire(blocking=False):
        holder = caller_rank_work
        if holder is not None:
            owner, wait = f"{holder.label()}, {holder.state()}", ": its .result() waits for it, its .cancel() stops it"
        else:
            owner, wait = f"on thread {caller_rank_owner!r}", ""
        raise background.RanksBusyError(
            f"ranch: another call that plays a rank in this process is running ({owner}{wait}); two "
            "cannot share this process's os.environ, torch.distributed group and streams. Wait for it "
            "to finish, or pass caller_rank=None: calls in which every rank is a new process may run "
            "side by side.", holder)
    caller_rank_owner = threading.current_thread().name
    caller_rank_work = work


@contextlib.contextmanager
def process_claimed(plays_a_rank: bool, claimed: bool = False) -> Iterator[None]:
    """While a call plays a rank in this process, no other call may (``plays_a_rank`` False: a
    call whose every rank is a new process claims nothing). ``claimed``: claim_process() was
    called for it already (background work: by the cell that started it); released here."""
    global caller_rank_work
    if not plays_a_rank:
        yield
        return
    if not claimed:
        claim_process()
    try:
        yield
    finally:
        caller_rank_work = None
        caller_rank_lock.release()


#: Own ranks whose SIGINT handler is installed, for the fork handler below.
_taking_sigint: weakref.WeakSet[OwnRank] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A fork of the caller during a call (DataLoader workers on rank 0) inherits our SIGINT
    handler and wakeup fd, and maybe our locks held by the watch or stop thread. The child is
    not the caller: give it Python's defaults back, so an interrupt there is its own business."""
    for own in list(_taking_sigint):
        own.stop.forget_in_child()
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:
            pass  # forked from another thread than the main one: nothing of ours was there
    _taking_sigint.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class OwnRank:
    """The caller's rank of one call, run on the calling thread."""

    def __init__(self) -> None:
        self.on_main_thread = threading.current_thread() is threading.main_thread()
        self.thread_id = threading.get_ident()
        self.native_id = threading.get_native_id()  # its /proc task (what it is blocked in)
        self.stop = SafeStop(self.thread_id, self.on_main_thread)
        #: the process ignored SIGINT before the call (nohup, a CI runner): the user's stays ignored
        self.ignores_user_sigint = self.on_main_thread and interrupts.process_ignores_sigint()

    @property
    def in_user_code(self) -> bool:
        return self.stop.inside

    @contextlib.contextmanager
    def running(self, env: dict, wake_fd: int) -> Iterator[None]:
        """This thread plays the rank (``env`` its variables): SIGINT is routed through us,
        the loop learns of it at once through ``wake_fd``. The function's own init_process_group
        is a client of the call's store, and every group it makes is held against a deadlock in
        torch (torchdist/rendezvous.py, torchdist/groups.py: keep_groups)."""
        os.environ.update(env)
        libraries.apply_thread_env(env)  # a torchrun rank starts with these threads
        restore_signals = self._take_sigint(wake_fd) if self.on_main_thread else None
        restore_hook = self.stop.watch_unraisable()
        rendezvous.activate()
        try:
            yield
        finally:
            rendezvous.deactivate()
            restore_hook()
            if restore_signals is not None:
                restore_signals()
            if not self.on_main_thread:
                set_async_exception(self.thread_id, None)  # one that came too late to matter

    @contextlib.contextmanager
    def user_code(self, base: FrameType) -> Iterator[None]:
        """While the user's code runs (under frame ``base``): the only time a stop may be raised
        into it, at a safe point of its own."""
        self.stop.enter(base)
        try:
            yield
        finally:
            self.stop.leave()

    def play(self, fn: Callable, args: tuple, kwargs: dict, ctx: Any, imports: str,
             returned: Callable[[], None]) -> Any:
        """Run ``fn`` as this rank, inside ``ctx``, after ``imports`` (run in ``__main__``, as on
        every other rank: the notebook keeps the names they import, as with mpify); call
        ``returned()`` as soon as ``fn`` returns, before ``ctx.__exit__`` tears its group down.
        Raises what the user's code raised, or :class:`Aborted` when another rank failed first."""
        with self.user_code(sys._getframe()):
            if imports:
                exec(compile(imports, "<imports>", "exec"), sys.modules["__main__"].__dict__)
            with libraries.launched_externally():
                if ctx is None:
                    value = fn(*args, **kwargs)
                    returned()
                    return value
                with ctx:
                    value = fn(*args, **kwargs)
                    returned()
                    return value

    def abort(self) -> None:
        """Make the thread running the caller's rank stop and report (another rank failed)."""
        self.stop.request(Aborted)

    def interrupt(self) -> None:
        """The stop button, from the main thread, for a rank running on another one: a
        KeyboardInterrupt at its next safe point (a C call it is blocked in ends first: a
        collective does so as soon as the peers are killed)."""
        self.stop.request(KeyboardInterrupt)

    def _take_sigint(self, wake_fd: int) -> Callable[[], None]:
        """Route SIGINT through us while the caller's rank runs: the loop learns of it at
        once through the wakeup fd, even when the main thread is stuck in C++."""

        def on_sigint(signum: int, frame: Any) -> None:
            stop, ours = self.stop.take(frame)
            if stop is not None:
                raise stop()
            if ours or self.ignores_user_sigint:
                return  # our own (a stop on its way, or one that came late), or the process ignores it
            if not interrupts.presses.take():
                return  # a repeat of the press that is stopping this call
            interrupts.interrupt_other_threads()  # one press stops every call
            raise KeyboardInterrupt

        self.stop.handler = on_sigint
        old_handler = signal.signal(signal.SIGINT, on_sigint)
        old_wakeup = signal.set_wakeup_fd(wake_fd, warn_on_full_buffer=False)
        _taking_sigint.add(self)

        def restore() -> None:
            _taking_sigint.discard(self)
            signal.set_wakeup_fd(old_wakeup, warn_on_full_buffer=False)
            signal.signal(signal.SIGINT, old_handler)

        return restore


class CallerState:
    """What a call may change in the calling process, and puts back. Only a call in which the
    caller plays a rank changes anything (it runs the user's function here)."""

    def __init__(self) -> None:
        self.environ: Optional[dict[str, str]] = None  # None: nothing to put back
        self.cwd: Optional[str] = None
        self.cuda_device: Optional[int] = None
        self.dist_was_up = False
        self.group_count: Optional[int] = None
        self.groups_made = 0  # groups.made when the call began
        self.libraries: Optional[libraries.LibraryState] = None

    @classmethod
    def snapshot(cls, caller_plays_a_rank: bool = True) -> CallerState:
        self = cls()
        if not caller_plays_a_rank:
            return self
        self.environ = dict(os.environ)
        try:
            self.cwd = os.getcwd()
        except OSError:
            self.cwd = None
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                if torch.cuda.is_initialized():
                    self.cuda_device = torch.cuda.current_device()
            except Exception:
                pass
            try:
                self.dist_was_up = torch.distributed.is_available() and torch.distributed.is_initialized()
            except Exception:
                pass
        # torch not imported yet: the function may import it and fail in a rendezvous; the count
        # it leaves must still go back (a fresh process's is 0), or the next group's keys differ.
        self.group_count = groups.group_count() if torch is not None else 0
        self.groups_made = groups.made
        self.libraries = libraries.LibraryState.snapshot()
        return self

    def disarm_ended_ddp(self, values: list) -> None:
        """A DDP or FSDP model, DTensor or DeviceMesh made on the group this call ended, left in the
        notebook (a %%ranch --ddp cell's variable, or the caller's return value), must say so when
        used (see torchdist/groups.py). Before :meth:`restore`: a group the function left up ends
        there, and a model lets go of its group while the group is still kept (groups.py)."""
        if self.environ is None or self.dist_was_up:
            return  # a group the notebook had before the call stays up: its models still work
        torch = sys.modules.get("torch")
        try:
            if torch is None:
                return
            main = sys.modules.get("__main__")
            groups.disarm_ended_ddp([values, *(vars(main).values() if main is not None else ())])
        except Exception:
            pass  # only a clearer error is lost

    def restore(self) -> None:
        if self.environ is None:
            return
        torch = sys.modules.get("torch")
        try:
            if self.libraries is not None:
                self.libraries.restore()  # before the group goes: nothing of it is left to use it
        except Exception:
            pass
        if torch is not None:
            try:
                dist = torch.distributed
                if not self.dist_was_up and dist.is_available() and dist.is_initialized():
                    compat.destroy_process_group()  # the function left its group up
            except Exception:
                pass  # a group whose peers are gone may fail to say goodbye
            if not self.dist_was_up:
                # Even when the destroy failed (a peer gone): torch names the next group's keys by it.
                groups.set_group_count(self.group_count)
            if groups.made != self.groups_made:  # the call made groups (a scan costs ms: only then)
                try:
                    groups.forget_ended_groups()  # those torch keeps alive: their sockets close
                    groups.release_ended_groups()  # ours, held against a deadlock in torch (groups.py)
                except Exception:
                    pass  # only sockets are left open
            if self.cuda_device is not None:
                try:
                    torch.cuda.set_device(self.cuda_device)
                except Exception:
                    pass
        if os.environ != self.environ:
            for key in [k for k in os.environ if k not in self.environ]:
                del os.environ[key]
            for key, value in self.environ.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value
        if self.cwd is not None:
            try:
                if os.getcwd() != self.cwd:
                    os.chdir(self.cwd)
            except OSError:
                os.chdir(self.cwd)
