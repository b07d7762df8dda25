"""Before a ranch call starts anything: its arguments, the working directory its ranks start
in, and room on this machine for the ranks asked for (file descriptors, processes). Each
check fails at once with an error that names the problem; nothing is left to undo."""

from __future__ import annotations

import os
from typing import Optional


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
