"""``ranch(nprocs, fn, *args)``: run a function on N ranks, the caller playing one of them.
Spawn, execute, terminate; the call itself is launcher/call.py's.

Before anything starts, the call is checked here: its arguments, the working directory its
ranks start in, room on this machine for the ranks asked for (file descriptors, processes),
and ``fn``, its arguments and ``ctx`` pickled (``PayloadError``). Each check fails at once with
an error that names the problem; nothing is left to undo.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from ..engine import background
from ..wire import payload
from ..wire.errors import PayloadError, RankError
from . import own_rank
from .call import Call


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
    wait: bool = True,
    pass_rank: bool = False,
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
            ``TimeoutError`` is raised. Counted from when the template is ready: its one-time
            preparation (importing torch at a kernel's first call, then what the ranks need) is
            not the call's time, and has limits of its own (120 s to start, 60 s a module).
        wait: False: return a :class:`BackgroundWork` at once, and run the call in the
            background, the caller's rank on a thread of this process; its ``result()`` is
            what the call returns. Its output goes to the cell that started it; the
            notebook stays free meanwhile (the Background work guide).
        pass_rank: call ``fn(rank, *args, **kwargs)``, the rank first, as ``mp.spawn`` calls
            ``fn(i, *args)``: a function written for ``mp.spawn`` runs as it is.

    In every rank ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (a free port, new for each call) are set. A function that
    makes its own group (``init_process_group``, env:// or tcp://, on any ``MASTER_PORT`` it sets)
    meets the other ranks at the call's own store, which lives in a spawned rank: a rank that
    fails before, during or after that rendezvous ends the call at once (docs: Bring your script).

    Raises:
        RankError: a rank raised (``RankRaisedError``, with its traceback) or died
            (``RankExitedError``, with its exit code or signal).
        PayloadError: ``fn``, an argument or ``ctx`` cannot be pickled (a TypeError).
        TimeoutError: ``timeout`` ran out; every rank was stopped.
        KeyboardInterrupt: the stop button (a kernel interrupt); every rank was stopped.
        RanksBusyError: the caller would play a rank while another call (background work)
            plays one in this process.

    Example (a notebook cell):

    ```python
    import os, torch
    from mpify_nb import ranch

    def square(x):
        return torch.tensor(x) ** 2 + int(os.environ["RANK"])

    ranch(3, square, 4)
    ```

    ```output
    [tensor(16), tensor(17), tensor(18)]
    ```
    """
    check_arguments(nprocs, fn, caller_rank, ctx, timeout)
    if pass_rank:
        fn = payload.RankFirst(fn)
    check_working_directory()
    check_capacity(nprocs - (caller_rank is not None))
    prepare = getattr(ctx, "_mpify_prepare", None)
    if prepare is not None:
        prepare(nprocs, caller_rank)  # the ctx validates its options here, before anything starts
    packed = payload.pack_call(fn, args, kwargs, ctx, need, imports)  # PayloadError: nothing started yet
    if not wait:
        return _in_background(nprocs, fn, args, kwargs, packed, caller_rank, gather, ctx, imports, timeout)
    values = Call(nprocs, caller_rank, timeout, imports).run(packed, fn, args, kwargs, ctx)
    return _gathered(values, gather, caller_rank)


def _gathered(values: list, gather: bool, caller_rank: Optional[int]) -> Any:
    if gather:
        return values
    return None if caller_rank is None else values[caller_rank]


def _in_background(nprocs: int, fn: Callable, args: tuple, kwargs: dict, packed: payload.PackedCall,
                   caller_rank: Optional[int], gather: bool, ctx: Any, imports: str,
                   timeout: Optional[float]) -> background.BackgroundWork:
    """``ranch(..., wait=False)``: the same call on a thread of its own (engine/background.py). A
    call that would play a rank here while another does is refused now, not on that thread."""
    work = background.BackgroundWork(f"ranch({getattr(fn, '__qualname__', type(fn).__name__)})", range(nprocs))
    plays = caller_rank is not None
    if plays:
        own_rank.claim_process(work)

    def run() -> Any:
        with own_rank.process_claimed(plays, claimed=True):  # released when the call is over
            call = Call(nprocs, caller_rank, timeout, imports)
            return _gathered(call.run(packed, fn, args, kwargs, ctx, claimed=True), gather, caller_rank)

    try:
        return work.start(run)
    except BaseException:
        if plays:
            own_rank.caller_rank_lock.release()
        packed.close_later()
        raise


def check_arguments(nprocs, fn, caller_rank, ctx, timeout) -> None:
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


def check_working_directory() -> None:
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


def check_capacity(new_ranks: int) -> None:
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


__all__ = ["ranch", "PayloadError", "RankError"]
