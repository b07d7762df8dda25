"""ranch(): run a function on N ranks, the caller playing one of them. Spawn, execute, terminate.

Data flow of one call::

    caller (notebook process)                                   rank r (r != caller_rank)
    ------------------------                                    ---------------------------
    pack_call(fn, args, ctx)  ── PayloadError here, before any rank exists
    placer.reserve(world) ── where each rank lands: LOCAL_RANK, GROUP_RANK, MASTER_ADDR/PORT
    placer.start(r) ─────────────────────────────────────────> born (forked from template, spawned,
                                                                 or forked on a Ray node: ray_ranks/)
    send setup + call ───────── socketpair ─────────────────> load call           (rank.py)
    wait for every READY  <──────────────────────────────────  READY
    send GO to all ─────────────────────────────────────────> (no rendezvous before every rank loaded)
    [caller enters ctx, runs fn]       (watch thread)           enters ctx, runs fn
                                        <─── VALUE / ERROR ───  sends its answer, exits
                                        <─── pidfd readable ─── (or dies: signal, segfault, OOM)
    relay thread  <────────────── stdout/stderr pipes ───────  print(...)          (relay.py)
    gather values; kill stragglers; placer.release(); restore env/cwd/CUDA/torch.distributed

The first failure wins: it is the root cause (the others usually fail because a
peer vanished). The watch thread then kills every rank at once; a caller blocked
in a gloo collective gets an error within ~2 s, a caller blocked in the
rendezvous is freed at once (the TCPStore lives in a spawned rank, not in the
caller), and a caller running Python code is interrupted with a signal. The call
then raises the root cause.
"""

from __future__ import annotations

import os
import pickle
import select
import selectors
import signal
import socket
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional

from . import groups, interrupts, libraries, payload, placement, preload, prompts, template, wire
from . import rank as rank_module
from .errors import PayloadError, RankError, RankExitedError, RemoteFailure, safe_str
from .relay import OutputRelay

# Seconds a finished rank may take to exit after sending its value before it is killed.
_EXIT_GRACE = 5.0


def ranch(
    nprocs: int,
    fn: Callable,
    *args: Any,
    caller_rank: Optional[int] = 0,
    gather: bool = True,
    ctx: Any = None,
    need: str = "",
    imports: str = "",
    timeout: Optional[float] = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks and return the results.

    The calling process plays rank ``caller_rank`` itself (``None``: all ranks are
    new processes). Every other rank is a fresh process started for this call and
    gone when it returns. ``fn`` may be defined in the notebook, use its globals,
    classes and imported modules, be a lambda or a closure.

    Args:
        nprocs: number of ranks (the world size).
        fn: the function to run on every rank.
        caller_rank: the rank this process plays, or None.
        gather: True: return the list of every rank's return value, by rank.
            False: return only the caller's own value (None if it plays no rank).
        ctx: a context manager entered around ``fn`` on every rank, e.g. ``in_torchddp()``.
        need: names of ``__main__`` globals to define on every rank (mpify compatibility).
        imports: import statements to run in every rank's ``__main__`` first (mpify compatibility);
            on the caller's rank too, so the notebook keeps the names they import.
        timeout: seconds for the whole call; past it every rank is stopped and
            ``TimeoutError`` is raised.

    In every rank ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (a free port, new for each call) are set.

    Raises:
        RankError: a rank raised (``RankRaisedError``, with its traceback) or died
            (``RankExitedError``, with its exit code or signal).
        PayloadError: ``fn``, an argument or ``ctx`` cannot be pickled (a TypeError).
        TimeoutError, KeyboardInterrupt.

    Example (a notebook cell)::

        import torch
        def square(x):
            return torch.tensor(x) ** 2 + int(os.environ["RANK"])
        ranch(3, square, 4)        # -> [tensor(16), tensor(17), tensor(18)]
    """
    _check_arguments(nprocs, fn, caller_rank, ctx, timeout)
    _check_working_directory()
    _check_capacity(nprocs - (caller_rank is not None))
    prepare = getattr(ctx, "_mpify_prepare", None)
    if prepare is not None:
        prepare(nprocs, caller_rank)  # the ctx validates its options here, before anything starts
    packed = payload.pack_call(fn, args, kwargs, ctx, need, imports)  # PayloadError: nothing started yet
    values = _Call(nprocs, caller_rank, timeout, imports).run(packed, fn, args, kwargs, ctx)
    if gather:
        return values
    return None if caller_rank is None else values[caller_rank]


def _check_arguments(nprocs, fn, caller_rank, ctx, timeout) -> None:
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, not {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    if caller_rank is not None and (
        isinstance(caller_rank, bool) or not isinstance(caller_rank, int) or not 0 <= caller_rank < nprocs
    ):
        raise ValueError(f"caller_rank must be None or an integer in [0, {nprocs}), not {caller_rank!r}")
    if ctx is not None and not (hasattr(ctx, "__enter__") and hasattr(ctx, "__exit__")):
        raise TypeError(
            f"ctx must be a context manager (with __enter__ and __exit__), not {type(ctx).__name__}; "
            "did you pass in_torchddp instead of in_torchddp()?"
        )
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")


def _check_working_directory() -> None:
    # Ranks start in the caller's working directory; a deleted one has no path to give them.
    try:
        os.getcwd()
    except FileNotFoundError:
        raise FileNotFoundError(
            "ranch: this process's working directory no longer exists (deleted or unmounted), so "
            "the ranks cannot start in it; os.chdir() to an existing directory and call again"
        ) from None


#: File descriptors the caller holds per started rank during a call: its channel end, the
#: read ends of its stdout/stderr pipes, its pidfd; plus the one a fork request briefly passes.
_FDS_PER_RANK = 5


def _check_capacity(new_ranks: int) -> None:
    """Fail at once, before starting anything, when this machine cannot hold the ranks asked for."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        try:
            in_use = len(os.listdir("/proc/self/fd"))
        except OSError:
            in_use = 0
        needed = new_ranks * _FDS_PER_RANK
        if in_use + needed > soft:
            raise OSError(
                f"ranch: {new_ranks} new ranks need about {needed} file descriptors in this process, "
                f"and only {max(0, soft - in_use)} of its limit of {soft} are free (ulimit -n); "
                "ask for fewer ranks, or raise the limit with resource.setrlimit(resource.RLIMIT_NOFILE, ...)"
            )
    room = _process_room()
    if room is not None and new_ranks > room:
        raise OSError(f"ranch: {new_ranks} new ranks are more processes than this machine allows now "
                      f"(room for about {room} more: pid_max, threads-max, the cgroup's pids.max)")


def _process_room() -> Optional[int]:
    """How many more processes can start here, by the tightest of the kernel's limits we can read."""
    try:
        running = sum(1 for entry in os.listdir("/proc") if entry.isdigit())
    except OSError:
        return None
    rooms = []
    for path in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
        try:
            with open(path) as f:
                rooms.append(int(f.read()) - running)
        except (OSError, ValueError):
            pass
    try:
        with open("/sys/fs/cgroup/pids.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/pids.current") as f:
            current = int(f.read())
        if limit != "max":
            rooms.append(int(limit) - current)
    except (OSError, ValueError):
        pass
    return min(rooms) if rooms else None


class _Aborted(BaseException):
    """Raised in the caller's own rank when another rank failed: stop and report that instead."""


class _Rank:
    """The caller's view of one spawned rank."""

    def __init__(self, rank: int, channel: socket.socket, process: placement.RankProcess):
        self.rank = rank
        self.channel = channel
        self.process = process
        self.ready = False
        self.channel_open = True
        self.done = False  # sent its value or its error, or died
        self.value: Any = None

    def close(self) -> None:
        self.channel.close()
        self.process.close()


#: Held by the one call that plays a rank in this process (it owns os.environ & co meanwhile).
_caller_rank_lock = threading.Lock()
_caller_rank_owner = ""

#: Calls whose SIGINT handler is installed, for the fork handler below.
_calls_taking_sigint: weakref.WeakSet[_Call] = weakref.WeakSet()


def _set_async_exception(thread_id: int, exc_type: Optional[type]) -> None:
    """Raise ``exc_type`` in another thread at its next bytecode (None: cancel a pending one)."""
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else ctypes.c_void_p(None))


def _after_fork_in_child() -> None:
    """A fork of the caller during a call (DataLoader workers on rank 0) inherits our SIGINT
    handler and wakeup fd, and maybe our lock held by the watch thread. The child is not
    the caller: give it Python's defaults back, so an interrupt there is its own business."""
    for call in list(_calls_taking_sigint):
        call.cond = threading.Condition()
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:
            pass  # forked from another thread than the main one: nothing of ours was there
    _calls_taking_sigint.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Call:
    def __init__(self, nprocs: int, caller_rank: Optional[int], timeout: Optional[float], imports: str = ""):
        self.nprocs = nprocs
        self.imports = imports
        self.caller_rank = caller_rank
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.ranks: dict[int, _Rank] = {}
        self.imported: list[tuple[str, Optional[str]]] = []  # modules the ranks imported (preload.py)
        self.failure: Optional[BaseException] = None
        self.cond = threading.Condition()
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        self.interrupted = False  # the user pressed stop (SIGINT)
        self.aborting = False  # we are stopping the ranks: their deaths are no news
        self.finished = False  # the caller's own rank is done; the watch may end
        self.in_user_code = False
        self.signals_sent = 0  # SIGINTs we sent ourselves to the main thread
        self.abort_signal_pending = False
        self.main_thread: int = threading.main_thread().ident or 0
        self.on_main_thread = threading.current_thread() is threading.main_thread()
        self.thread_id = threading.get_ident()
        self.wake_closed = False
        self.prompter = prompts.Prompter(self._wake)  # ranks' reads of stdin, asked of the user
        self.relay: Optional[OutputRelay] = None

    # -- the whole call ------------------------------------------------------------------

    def run(self, packed: payload.PackedCall, fn, args, kwargs, ctx) -> list:
        if self.caller_rank is not None and not _caller_rank_lock.acquire(blocking=False):
            raise RuntimeError(
                f"ranch: another call that plays a rank in this process is running (on thread "
                f"{_caller_rank_owner!r}); two cannot share this process's os.environ, torch.distributed "
                "group and streams. Wait for it to finish, or pass caller_rank=None: calls in which "
                "every rank is a new process may run side by side."
            )
        if self.on_main_thread:
            interrupts.install()
        else:
            interrupts.register(self)  # the stop button reaches us through the main thread
        try:
            return self._run(packed, fn, args, kwargs, ctx)
        finally:
            interrupts.unregister(self)
            if self.caller_rank is not None:
                _caller_rank_lock.release()

    def _run(self, packed: payload.PackedCall, fn, args, kwargs, ctx) -> list:
        global _caller_rank_owner
        if self.caller_rank is not None:
            _caller_rank_owner = threading.current_thread().name
        state = _CallerState.snapshot(self.caller_rank is not None)
        relay = self.relay = OutputRelay(sys.stdout, sys.stderr)
        values: list = [None] * self.nprocs
        watcher: Optional[threading.Thread] = None
        placer = placement.get_placer()
        try:
            layout = placer.reserve(self.nprocs, self.caller_rank, self._time_left())
            env = self._world_env(layout)
            self._start_ranks(placer, layout, packed, env, relay)
            relay.start()
            self._watch(until=lambda: all(r.ready or r.done for r in self.ranks.values()))
            if self.failure is None and not self.interrupted:
                for handle in self.ranks.values():
                    try:
                        wire.send(handle.channel, rank_module.GO)
                    except OSError:
                        pass  # it just died; the watch reports how
                if self.caller_rank is None:
                    self._watch(until=self._all_done)
                else:
                    watcher = threading.Thread(target=self._watch, args=(self._all_done,),
                                               name="mpify_nb-watch", daemon=True)
                    watcher.start()
                    try:
                        own_env = dict(env, **layout.env_of(self.caller_rank))
                        values[self.caller_rank] = self._run_own_rank(fn, args, kwargs, ctx, own_env)
                    finally:
                        self.finished = True
                        self._wake()
                        watcher.join()
            self._drain()
            self._raise_failure()
            for r in self.ranks.values():
                values[r.rank] = r.value
            return values
        except KeyboardInterrupt:
            self.interrupted = True
            raise
        finally:
            self.finished = True
            self.prompter.close()  # the ranks are done or stopped: no one reads the answers
            self._stop_all()
            self._reap()
            placer.release()
            packed.close_later()
            relay.close()
            self.selector.close()
            with self.cond:
                self.wake_closed = True
                os.close(self.wake_r)
                os.close(self.wake_w)
            state.restore()
            state.disarm_ended_ddp(values)
            self._learn_imports()

    def _world_env(self, layout: placement.Layout) -> dict:
        """The variables every rank gets alike; layout.env_of(rank) adds each one's own."""
        store_rank = next((r for r in range(self.nprocs) if r != self.caller_rank), 0)
        # The rendezvous store lives in a spawned rank: killing the ranks then
        # frees a caller blocked in the rendezvous (see ddp.py).
        return dict(layout.world_env(self.nprocs), MPIFY_NB_STORE_RANK=str(store_rank))

    # -- starting ranks ------------------------------------------------------------------

    def _start_ranks(self, placer: placement.Placer, layout: placement.Layout, packed: payload.PackedCall,
                     env: dict, relay: OutputRelay) -> None:
        base = dict(os.environ) if placer.ships_environ else {}
        base.update(env)
        common = {"cwd": os.getcwd(), "sys_path": list(sys.path), "argv": list(sys.argv)}
        for r in range(self.nprocs):
            if r == self.caller_rank:
                continue
            ours, theirs = wire.socketpair()
            out_w, err_w = relay.add(r)
            try:
                process = placer.start(r, theirs.fileno(), out_w, err_w, self._time_left())
            except TimeoutError as e:
                ours.close()
                raise TimeoutError(f"ranch: the call did not finish within {self.timeout:g} s: {e}") from None
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
                os.close(out_w)
                os.close(err_w)
            self.ranks[r] = _Rank(r, ours, process)
            self.selector.register(ours, selectors.EVENT_READ, ("channel", r))
            if process.death_fd is not None:
                self.selector.register(process.death_fd, selectors.EVENT_READ, ("death", r))
        for r, handle in self.ranks.items():
            rank_env = dict(base, **layout.env_of(r))
            setup = pickle.dumps(dict(common, rank=r, env=rank_env))
            try:
                wire.send(handle.channel, setup)
                wire.send(handle.channel, packed.data, packed.fds)
            except OSError:
                pass  # it died at birth; the watch reports how

    def _time_left(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    # -- watching ranks ------------------------------------------------------------------

    def _all_done(self) -> bool:
        return all(r.done for r in self.ranks.values()) and (self.caller_rank is None or self.finished)

    def _watch(self, until: Callable[[], bool]) -> None:
        """Handle rank events until ``until()`` holds or a failure was recorded."""
        while not until() and self.failure is None and not self.interrupted:
            wait = None
            if self.deadline is not None and not self.prompter.waiting:
                # Time a rank waits for the user (a pdb prompt) is not the call's.
                wait = self.deadline + self.prompter.waited() - time.monotonic()
                if wait <= 0:
                    running = sorted(r.rank for r in self.ranks.values() if not r.done)
                    if self.caller_rank is not None and not self.finished:
                        running = sorted(running + [self.caller_rank])
                    self._fail(TimeoutError(
                        f"ranch: the call did not finish within {self.timeout:g} s "
                        f"(ranks still running: {running}); every rank was stopped"))
                    return
            for key, _ in self.selector.select(wait):
                kind, r = key.data
                if kind == "wake":
                    self._on_wake()
                elif kind == "channel":
                    self._on_message(self.ranks[r])
                elif kind == "death":
                    self._on_death(self.ranks[r])

    def _on_wake(self) -> None:
        try:
            data = os.read(self.wake_r, 4096)
        except BlockingIOError:
            return
        for reply, answer in self.prompter.take_answers():
            reply(answer)
        for signum in data:
            if signum == signal.SIGINT:
                if self.signals_sent:
                    self.signals_sent -= 1
                else:  # the user interrupted: stop every rank so the main thread can return
                    with self.cond:
                        self.interrupted = True
                        self.cond.notify_all()
                    self._kill_all()

    def _on_message(self, handle: _Rank) -> None:
        try:
            message = wire.recv(handle.channel)
        except (OSError, EOFError):
            message = None
        if message is None:
            handle.channel_open = False
            self.selector.unregister(handle.channel)
            if not handle.done:
                self._on_death(handle)
            return
        data, fds = message
        kind, body = data[:1], data[1:]
        if kind == rank_module.READY:
            handle.ready = True
        elif kind == rank_module.IMPORTED:
            try:
                self.imported.extend(pickle.loads(body))
            except Exception:
                pass
        elif kind == rank_module.ASK:
            self._ask(handle, pickle.loads(body))
        elif kind == rank_module.VALUE:
            handle.done = True
            try:
                handle.value = payload.unpack_result(body, fds)
            except Exception as e:
                self._fail(RankError(handle.rank, f"the value returned by rank {handle.rank} could not be "
                                                  f"unpickled here: {type(e).__name__}: {safe_str(e)}"))
        elif kind == rank_module.ERROR:
            handle.done = True
            payload.close_fds(fds)
            failure: RemoteFailure = pickle.loads(body)
            error = failure.to_error(handle.rank, payload.loads)
            if not handle.process.shares_clock:
                error.when = time.monotonic()  # another host's clock: order by when we heard
            self._fail(error)

    def _ask(self, handle: _Rank, token: int) -> None:
        """Rank ``handle`` reads its stdin: ask the user (prompts.py), its open line the prompt."""
        prompt = self.relay.take_prompt(handle.rank) if self.relay is not None else ""

        def reply(answer: Any) -> None:
            try:
                wire.send(handle.channel, rank_module.ANSWER + pickle.dumps((token, answer)))
            except OSError:
                pass  # it is gone; the watch reports how

        self.prompter.ask(handle.rank, prompt, reply)

    def _on_death(self, handle: _Rank) -> None:
        noticed = time.monotonic()
        if handle.process.death_fd is not None:
            try:
                self.selector.unregister(handle.process.death_fd)
            except (KeyError, ValueError):
                pass
        self._read_sent(handle)  # it may have answered just before dying
        if handle.done:
            return
        handle.done = True
        if not self.aborting:  # not one of the ranks we killed ourselves
            code = handle.process.exit_code(timeout=2.0)
            error = RankExitedError(handle.rank, code, handle.process.death_detail())
            error.when = noticed  # before the wait: a peer's echo of this death may be timed within it
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        """Record a failure. The first one stops the call; of several rank failures the
        earliest (by the machine-wide monotonic clock) is the root cause, the others
        (usually peers that lost it) go to its ``.others``."""
        with self.cond:
            first = self.failure is None
            if first:
                self.failure = error
            elif isinstance(self.failure, RankError) and isinstance(error, RankError):
                if error.when < self.failure.when:
                    error.others = [self.failure, *self.failure.others]
                    self.failure.others = []
                    self.failure = error
                else:
                    self.failure.others.append(error)
            self.cond.notify_all()
        if first:
            self._kill_all()
            self._interrupt_own_rank()

    def _drain(self) -> None:
        """After the ranks ran (or were stopped): read the answers already sent. An error a
        rank sent before a peer's echo of it must not be lost."""
        self.aborting = self.failure is not None or self.interrupted
        for handle in self.ranks.values():
            self._read_sent(handle)

    def _read_sent(self, handle: _Rank) -> None:
        """Handle the messages ``handle`` has already sent, without waiting for more."""
        handle.channel.settimeout(1.0)  # a message cut short by a kill must not stall us
        while handle.channel_open and not handle.done:
            if not select.select([handle.channel], [], [], 0)[0]:
                break
            self._on_message(handle)

    def _kill_all(self) -> None:
        for handle in self.ranks.values():
            handle.process.kill()

    def _interrupt_own_rank(self) -> None:
        """Make the thread running the caller's rank stop and report."""
        if not self.on_main_thread:
            with self.cond:
                if self.in_user_code:
                    _set_async_exception(self.thread_id, _Aborted)  # at its next bytecode
            return
        with self.cond:
            if not self.in_user_code:
                return
            self.abort_signal_pending = True
            self.signals_sent += 1
        signal.pthread_kill(self.main_thread, signal.SIGINT)

    # -- the caller's own rank -----------------------------------------------------------

    def _run_own_rank(self, fn, args, kwargs, ctx, env) -> Any:
        """Run the caller's rank on this thread. A failure is recorded, not raised:
        run() raises the root cause once it has heard from every rank."""
        rank = self.caller_rank
        assert rank is not None
        os.environ.update(env)
        libraries.apply_thread_env(env)  # a torchrun rank starts with these threads
        restore_signals = self._take_sigint() if self.on_main_thread else None
        try:
            try:
                with self.cond:
                    self.in_user_code = True
                if self.imports:
                    # As on every other rank, in __main__: the notebook keeps these names (as with mpify).
                    exec(compile(self.imports, "<imports>", "exec"), sys.modules["__main__"].__dict__)
                with libraries.launched_externally():
                    if ctx is None:
                        return fn(*args, **kwargs)
                    with ctx:
                        return fn(*args, **kwargs)
            finally:
                with self.cond:
                    self.in_user_code = False
        except _Aborted:
            return None  # another rank failed first; run() reports it
        except KeyboardInterrupt:
            if self.failure is not None and not self.interrupted:
                return None  # our own SIGINT, landed after the user code: same as _Aborted
            self.interrupted = True
            self._kill_all()
            raise
        except BaseException as e:
            # Is this the echo of a peer's failure (e.g. "Connection closed by peer")?
            # Then the peer's own report is on its way: give it a moment.
            if self.failure is None:
                # A rank on another host is seen to die only once its link says so: wait that long.
                patience = 2.0 if self._some_rank_stirred() else max(
                    (r.process.death_latency for r in self.ranks.values() if not r.done), default=0.0)
                with self.cond:
                    self.cond.wait_for(lambda: self.failure is not None or self.interrupted, timeout=patience)
            failure = RemoteFailure.capture(e, lambda exc: None).to_error(rank, payload.loads)
            failure.__cause__ = e
            self._fail(failure)
            return None
        finally:
            if restore_signals is not None:
                restore_signals()
            if not self.on_main_thread:
                _set_async_exception(self.thread_id, None)  # one that came too late to matter

    def interrupt_from_signal(self) -> None:
        """The user pressed stop while this call runs on a thread other than the main one
        (called by interrupts.py on the main thread): stop it as the main thread's SIGINT would."""
        with self.cond:
            if self.wake_closed:
                return
            try:
                os.write(self.wake_w, bytes([signal.SIGINT]))  # the watch stops every rank
            except OSError:
                pass
            if self.in_user_code:
                # The caller's rank runs on our thread: KeyboardInterrupt there at its next
                # bytecode (a C call it is blocked in ends first: a collective does so as
                # soon as the peers are killed).
                _set_async_exception(self.thread_id, KeyboardInterrupt)

    def _some_rank_stirred(self) -> bool:
        """Has a rank that is still running died, or sent something not yet read?"""
        running = [r for r in self.ranks.values() if not r.done]
        fds = [r.process.death_fd for r in running if r.process.death_fd is not None]
        fds += [r.channel for r in running if r.channel_open]
        return bool(fds) and bool(select.select(fds, [], [], 0)[0])

    def _take_sigint(self) -> Callable[[], None]:
        """Route SIGINT through us while the caller's rank runs: the watch thread learns of
        it at once through the wakeup fd, even when the main thread is stuck in C++."""

        def on_sigint(signum, frame):
            with self.cond:
                ours = self.abort_signal_pending
                self.abort_signal_pending = False
                inside = self.in_user_code
            if ours:
                if inside:
                    raise _Aborted()
                return
            interrupts.interrupt_other_threads()  # one press stops every call
            raise KeyboardInterrupt

        old_handler = signal.signal(signal.SIGINT, on_sigint)
        old_wakeup = signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        _calls_taking_sigint.add(self)

        def restore() -> None:
            _calls_taking_sigint.discard(self)
            signal.set_wakeup_fd(old_wakeup, warn_on_full_buffer=False)
            signal.signal(signal.SIGINT, old_handler)

        return restore

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass

    # -- ending --------------------------------------------------------------------------

    def _learn_imports(self) -> None:
        """Let the template come to hold what the ranks imported (in the background; see preload.py)."""
        if not self.ranks or placement.get_start_method() != "template":
            return
        try:
            cwd = os.getcwd()
        except OSError:
            return
        template.in_background(_learn, self.imported, cwd)

    def _raise_failure(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        if self.failure is not None:
            raise self.failure

    def _stop_all(self) -> None:
        """Finished ranks get a moment to exit on their own; everything else is killed now."""
        failed = self.failure is not None or self.interrupted
        deadline = time.monotonic() + (0 if failed else _EXIT_GRACE)
        for handle in self.ranks.values():
            if failed or not handle.done:
                handle.process.kill()
            else:
                remaining = max(0.0, deadline - time.monotonic())
                if handle.process.exit_code(remaining) is None:
                    handle.process.kill()

    def _reap(self) -> None:
        for handle in self.ranks.values():
            if handle.process.exit_code(timeout=5.0) is None:
                handle.process.wait_gone(timeout=5.0)  # e.g. its template died: no exit code
            handle.process.kill_leftovers()  # a rank that was killed could not end what it started
            handle.close()


def _learn(imported: list, cwd: str) -> None:
    """In the background: the call has returned, and this never makes it wait."""
    try:
        preload.learn(imported, cwd)
        template.refresh(cwd)
    except Exception:
        pass  # only a speed-up is lost


class _CallerState:
    """What a call may change in the calling process, and puts back. Only a call in which the
    caller plays a rank changes anything (it runs the user's function here)."""

    def __init__(self) -> None:
        self.environ: Optional[dict[str, str]] = None  # None: nothing to put back
        self.cwd: Optional[str] = None
        self.cuda_device: Optional[int] = None
        self.dist_was_up = False
        self.group_count: Optional[int] = None
        self.libraries: Optional[libraries.LibraryState] = None

    @classmethod
    def snapshot(cls, caller_plays_a_rank: bool = True) -> _CallerState:
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
        self.group_count = groups.group_count() if torch is not None else None
        self.libraries = libraries.LibraryState.snapshot()
        return self

    def disarm_ended_ddp(self, values: list) -> None:
        """A DDP or FSDP model, DTensor or DeviceMesh made on the group this call ended, left in the
        notebook (a %%ranch --ddp cell's variable, or the caller's return value), must say so when
        used (see groups.py)."""
        if self.environ is None or self.dist_was_up:
            return
        torch = sys.modules.get("torch")
        try:
            if torch is None or torch.distributed.is_initialized():
                return  # the function left a group up: its models still work
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
                if not self.dist_was_up and dist.is_available():
                    if dist.is_initialized():
                        dist.destroy_process_group()  # the function left its group up
                    if self.group_count is not None:
                        groups.set_group_count(self.group_count)  # e.g. after a failed rendezvous
            except Exception:
                pass
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


__all__ = ["ranch", "PayloadError", "RankError"]
