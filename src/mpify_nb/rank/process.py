"""This process and those it starts: its name, the orphans it adopts, killing what it started, leaving.

What every process of ours does for itself, whatever it is: a rank of a ``ranch`` call
(rank/loop.py), a persistent rank of a Session (rank/session.py), the template they are forked
from (start/template.py). Linux only: ``prctl`` and ``/proc``.

* ``set_process_name``: the name ps and top show (``mpify_nb-rank1``, ``mpify_nb-tmpl``);
* ``become_subreaper``: orphans below this process are re-parented to it, not to init, so
  ``kill_descendants`` finds everything it started, at any depth;
* ``die_with_parent``: Linux kills this process when its parent dies;
* ``end``: flush stdout/stderr, kill every descendant, ``os._exit``.
"""

from __future__ import annotations

import ctypes
import fcntl
import io
import os
import signal
import sys
import time
from collections.abc import Collection
from typing import NoReturn, Optional


def become_subreaper() -> None:
    """Orphans below this process are re-parented to it, not to init (PR_SET_CHILD_SUBREAPER)."""
    _prctl(36, 1)


def children_of(pid: int) -> list[int]:
    """The live children of ``pid`` (zombies excluded: they hold nothing)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(int(k) for k in f.read().split())
        except OSError:
            continue
    return [k for k in kids if _state(k) not in (b"Z", b"X", None)]


def _state(pid: int) -> Optional[bytes]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split(b" ", 1)[0]


def kill_descendants(pid: Optional[int] = None, spare: Collection[int] = (), reap: bool = True) -> list[int]:
    """SIGKILL every live process below ``pid`` (default: this one), at any depth, except
    the subtrees rooted at ``spare``; return the pids killed. Looks again until nothing is
    left, since a process may fork while we look. ``reap``: also reap this process's
    zombie children (only where no one else waits for them: a rank about to exit)."""
    root = os.getpid() if pid is None else pid
    killed: list[int] = []
    for _ in range(50):
        found, stack = [], [k for k in children_of(root) if k not in spare]
        while stack:
            p = stack.pop()
            found.append(p)
            stack.extend(children_of(p))
        if not found:
            break
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed.extend(p for p in found if p not in killed)
        time.sleep(0.001)  # let the kills land before looking again
    if reap:
        _reap_children()
    return killed


def _reap_children(patience: float = 2.0) -> None:
    """Reap this process's children (those killed, and orphans re-parented to us: we are a
    subreaper), waiting up to ``patience`` seconds for a SIGKILL to land: a process about to
    exit must not leave them to whoever adopts them next (PID 1, which in a container may never
    reap them: ``<defunct>`` for ever)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.001)


def _prctl(option: int, arg) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_parent: int) -> None:
    """Ask Linux to SIGKILL us when our parent (caller or template) dies; leave at once if it
    already has (it is no longer ``expected_parent``)."""
    if _prctl(1, signal.SIGKILL) and os.getppid() != expected_parent:  # PR_SET_PDEATHSIG
        os._exit(1)  # it died before prctl took effect


def set_process_name(name: str) -> None:
    """Name this process in ps/top (comm, 15 bytes), so ranks are easy to tell apart."""
    _prctl(15, ctypes.c_char_p(name.encode()[:15]))  # PR_SET_NAME


#: (fd, a copy of it, what it was: (st_dev, st_ino)) for fds 1 and 2: the caller's pipes.
_stdio_kept: list[tuple[int, int, tuple[int, int]]] = []


def line_buffered_stdio() -> None:
    """``sys.stdout``/``sys.stderr`` written straight to fds 1 and 2: each write goes to the pipe,
    so output is live and partial lines (``print(..., end="")``) are not held back until exit."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def keep_stdio() -> None:
    """Remember where fds 1 and 2 go (the caller's pipes), for ``restore_stdio``."""
    for fd in (1, 2):
        try:
            found = os.fstat(fd)
            copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        except OSError:
            continue
        _stdio_kept.append((fd, copy, (found.st_dev, found.st_ino)))


def restore_stdio() -> None:
    """Before a request: fds 1 and 2 go to the caller's pipes again, and ``sys.stdout`` and
    ``sys.stderr`` write there, if the last request's code closed them (``os.close(1)``,
    ``sys.stdout.close()``) or pointed fd 1 or 2 elsewhere: else every later ``print`` on this
    rank would fail, or vanish, until it restarts."""
    for fd, copy, was in _stdio_kept:
        try:
            found = os.fstat(fd)
            if (found.st_dev, found.st_ino) == was:
                continue
        except OSError:
            pass  # closed
        try:
            os.dup2(copy, fd, inheritable=True)
        except OSError:
            pass
    if any(getattr(sys, name, None) is None or getattr(sys, name).closed for name in ("stdout", "stderr")) \
            or any(getattr(sys, f"__{name}__", None) is None or getattr(sys, f"__{name}__").closed
                   for name in ("stdout", "stderr")):
        line_buffered_stdio()


def _forget_stdio_after_fork() -> None:
    for _fd, copy, _was in _stdio_kept:  # CLOEXEC: gone at exec; a fork (a DataLoader worker) closes them
        try:
            os.close(copy)
        except OSError:
            pass
    _stdio_kept.clear()


os.register_at_fork(after_in_child=_forget_stdio_after_fork)


def flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def end(code: int) -> NoReturn:
    """Leave now with ``code``: what was printed reaches the caller, and nothing this process
    started outlives it."""
    flush_stdio()
    kill_descendants()
    os._exit(code)
