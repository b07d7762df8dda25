"""A rank's standard input: what code on a rank reads comes from the notebook's user.

A rank has no terminal; its fd 0 was /dev/null, so ``breakpoint()`` quit at once and
``input()`` raised EOFError. Now every read asks the caller, which asks the user through
the frontend's own input prompt (engine/prompts.py), and the answer comes back::

    rank (any thread)                                 rank's control thread
    input() / pdb / sys.stdin.readline()
      RankStdin.readline: flush stdout,
      ASK (token) ── channel ──> caller ── the user answers ── ANSWER (token, line) ──> deliver():
      waits for its token <───────────────────────────────────────────────────────── the waiting
                                                                                        readline
    C code, or a /dev/stdin reopened (torch.distributed.breakpoint), reads fd 0 (a pipe):
      when the caller looks at the rank (engine/watch.py: LOOK, twice a second or less while
      a request runs), its control thread sees the read (raw_read_waiting:
      /proc/self/task/*/syscall), ASKs with token RAW, and deliver() writes the answer into the pipe.

An answer is a line, ``None`` (end of file), or a message: the read raises
``StdinUnavailableError`` with it (a frontend that cannot answer), or KeyboardInterrupt
(the stop button pressed at the prompt).
"""

from __future__ import annotations

import fcntl
import io
import itertools
import os
import struct
import sys
import termios
import threading
from typing import Callable, Optional, Union

from ..wire.errors import StdinUnavailableError
from . import process

#: The token of an ASK for a read of fd 0 itself (not through sys.stdin).
RAW = 0
#: An answer: a line, None for end of file, or (kind, message) to raise at the read.
Answer = Union[str, None, tuple]
INTERRUPTED = "interrupted"
UNAVAILABLE = "unavailable"

_SYSCALL_READ = {"x86_64": b"0", "aarch64": b"63"}.get(os.uname().machine, b"0")


class _State:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.tokens = itertools.count(1)
        self.answers: dict[int, Answer] = {}
        self.out: set[int] = set()  # tokens of sys.stdin reads that wait for their answer
        self.send_ask: Optional[Callable[[int], None]] = None
        self.pipe_w = -1
        self.pipe_inode = ""
        self.raw_asked = False  # an ASK for a raw read is out: not again until it is answered
        self.reader_tid = 0  # the thread that runs the user's code (looked at most often)
        self.reader_syscall = -1  # its /proc syscall file, open


_state = _State()


def install(send_ask: Callable[[int], None]) -> None:
    """Make this process's stdin the notebook's user: ``send_ask(token)`` tells the caller
    that a read waits (from any thread; it must send whole messages). Call on the thread
    that will run the user's code."""
    r, w = os.pipe()
    os.dup2(r, 0)
    os.close(r)
    os.set_inheritable(w, False)
    _state.pipe_w = w
    _state.pipe_inode = os.readlink("/proc/self/fd/0")
    _state.send_ask = send_ask
    _state.reader_tid = threading.get_native_id()
    stdin = RankStdin()
    sys.stdin = sys.__stdin__ = stdin  # type: ignore[misc]
    os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    """A process this rank forks (a DataLoader worker, multiprocessing) reads /dev/null, as
    every child of a rank did before: only the rank itself asks the notebook's user."""
    if _state.send_ask is None:
        return
    _state.send_ask = None
    try:
        if _state.reader_syscall >= 0:
            os.close(_state.reader_syscall)  # the rank's thread, not ours
        os.close(_state.pipe_w)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = sys.__stdin__ = open(os.devnull)  # type: ignore[misc]
    except OSError:
        pass


def deliver(token: int, answer: Answer) -> None:
    """The caller's answer to ASK ``token`` (called on the rank's reader thread)."""
    if token == RAW:
        _state.raw_asked = False
        if isinstance(answer, str):
            os.write(_state.pipe_w, (answer if answer.endswith("\n") else answer + "\n").encode("utf-8", "replace"))
        elif answer is None or isinstance(answer, tuple):
            _end_raw_read()
        return
    with _state.cond:
        if token in _state.out:  # else its read was interrupted after it asked: nobody takes it
            _state.answers[token] = answer
            _state.cond.notify_all()


def asking() -> bool:
    """Does a read through sys.stdin wait for its answer (its prompt is the partial line on stdout)?"""
    return bool(_state.out)


def _end_raw_read() -> None:
    """End of file for a read of fd 0: close the pipe's write end; later reads get a new pipe."""
    r, w = os.pipe()
    os.set_inheritable(w, False)
    old = _state.pipe_w
    _state.pipe_w = w
    os.dup2(r, 0)
    os.close(r)
    _state.pipe_inode = os.readlink("/proc/self/fd/0")
    os.close(old)  # the blocked read, on the old pipe, returns 0


#: A read of fd 0 itself is looked for when the caller looks at the rank: on the user's thread
#: each time (one pread of a /proc file it keeps open), on every thread and every child process
#: at every EVERY_THREAD-th look.
EVERY_THREAD = 3
_looks = itertools.count()


def raw_read_waiting(quick: bool = False) -> bool:
    """Is a thread of this process blocked reading our stdin pipe itself (fd 0, or a
    /dev/stdin opened again), not through sys.stdin? Then send it an ASK (once).
    ``quick``: the user's thread only (one pread)."""
    if _state.send_ask is None or _state.raw_asked or _unread(_state.pipe_w):
        return False  # asked already, or the last answer is not read yet
    every_thread = not quick and next(_looks) % EVERY_THREAD == 0
    try:
        tasks = os.listdir("/proc/self/task") if every_thread else []
    except OSError:
        return False
    if _reader_reads_our_pipe() or any(_reads_our_pipe("self", tid) for tid in tasks):
        _state.raw_asked = True
        return True
    if every_thread and _a_child_reads_our_pipe():
        # A program it started (subprocess, os.system) inherited fd 0: end of file for it, as
        # /dev/null gave every child of a rank before; the user answers only the rank itself.
        _end_raw_read()
    return False


def _reader_reads_our_pipe() -> bool:
    """The user's thread, looked at most often: its syscall file stays open (one pread a look)."""
    try:
        if _state.reader_syscall < 0:
            _state.reader_syscall = os.open(f"/proc/self/task/{_state.reader_tid}/syscall", os.O_RDONLY | os.O_CLOEXEC)
        return _read_of_our_pipe("self", os.pread(_state.reader_syscall, 256, 0).split())
    except OSError:
        return False


def _reads_our_pipe(pid: str, tid: str) -> bool:
    """Is thread ``tid`` of ``pid`` blocked in read() on our stdin pipe?"""
    try:
        with open(f"/proc/{pid}/task/{tid}/syscall", "rb") as f:
            return _read_of_our_pipe(pid, f.read().split())
    except OSError:
        return False


def _read_of_our_pipe(pid: str, syscall: list) -> bool:
    """``syscall`` (a /proc syscall file's fields) is a read() of our stdin pipe."""
    if len(syscall) < 2 or syscall[0] != _SYSCALL_READ:
        return False
    try:
        return os.readlink(f"/proc/{pid}/fd/{int(syscall[1], 16)}") == _state.pipe_inode
    except (OSError, ValueError):
        return False


def _a_child_reads_our_pipe() -> bool:
    """Does a process below this one (at any depth) block reading our stdin pipe?"""
    stack, seen = process.children_of(os.getpid()), set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            if any(_reads_our_pipe(str(pid), tid) for tid in os.listdir(f"/proc/{pid}/task")):
                return True
        except OSError:
            continue
        stack.extend(process.children_of(pid))
    return False


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe of ``fd``."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class RankStdin(io.TextIOBase):
    """``sys.stdin`` of a rank: each line read is asked of the notebook's user."""

    encoding = "utf-8"
    errors = "strict"

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 0

    def readline(self, size: Optional[int] = -1) -> str:  # type: ignore[override]
        send_ask = _state.send_ask
        if send_ask is None:
            process.flush_stdio()
            return ""
        with _state.cond:
            token = next(_state.tokens)
            _state.out.add(token)  # before the prompt goes out: its partial line needs no peek (asking())
        try:
            process.flush_stdio()  # the prompt ("(Pdb) ", input()'s) reaches the caller first
            send_ask(token)
            with _state.cond:
                while token not in _state.answers:
                    _state.cond.wait()
                answer = _state.answers.pop(token)
        finally:
            with _state.cond:
                _state.out.discard(token)
        if isinstance(answer, tuple):
            kind, message = answer
            if kind == INTERRUPTED:
                raise KeyboardInterrupt
            raise StdinUnavailableError(message)
        if answer is None:
            return ""
        return answer if answer.endswith("\n") else answer + "\n"

    def read(self, size: Optional[int] = -1) -> str:
        return self.readline(size)  # a line at a time, as a terminal gives it

    def readlines(self, hint: int = -1) -> list[str]:
        lines = []
        while True:
            line = self.readline()
            if not line:
                return lines
            lines.append(line)


def install_breakpointhook() -> None:
    """``breakpoint()`` on a rank: pdb that skips this library's frames (stepping past the
    end of a cell goes back to the user's code, not into ours)."""

    def hook(*args, **kwargs) -> None:
        if os.environ.get("PYTHONBREAKPOINT") not in (None, "", "pdb.set_trace"):
            return sys.__breakpointhook__(*args, **kwargs)
        import pdb

        pdb.Pdb(skip=["mpify_nb", "mpify_nb.*"]).set_trace(sys._getframe(1))

    sys.breakpointhook = hook


def post_mortem() -> bool:
    """pdb on the traceback of the last error a cell raised on this rank (run there by
    ``Session.debug``); False when none has."""
    import pdb

    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return False
    debugger = pdb.Pdb(skip=["mpify_nb", "mpify_nb.*"])
    debugger.reset()
    debugger.interaction(None, tb)
    return True
