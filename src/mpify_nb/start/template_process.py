"""The template process itself: fork ranks on request, and between forks import, one module at
a time, what the caller asks it to hold (it grows in place).

What the caller holds of it (TemplateClient, the policy of what it grows) is in
start/template_client.py and start/template.py, which start it
(``python -c "from mpify_nb.start.template_process import serve"``)::

    control socket (one frame at a time)        the template's loop
    ("start", names, paths) ─────────────────>  import torch; READY (its sys.modules)
    (GROW, names, paths) ────────────────────>  queue them
    (FORK, id[, "spare"]) + fds ─────────────>  os.fork(): the child becomes a rank (rank.loop.main)
                                                or a spare rank (rank.spare.main); FORKED id, pid
    (RETIRE,) ───────────────────────────────>  drop the queue: it forks no more (the caller's side)
    (COMPILE, files) ────────────────────────>  compile the notebook's own modules' sources, for
                                                its ranks' imports of them (rank/code_cache.py)
                                         loop:  read every frame waiting; then import the next
                                                queued module: (TRYING, name), then
                                                (GREW, name, new names, why it failed or "")
                                                | (REJECTED, name, why): it made forks unsafe
    SIGCHLD ─────────────────────────────────>  EXITED pid, status

A fork never lands inside an import: frames are read only between two modules, and a FORK that
arrives during one waits for its end (the rank would have imported it itself). A module that
initializes CUDA, starts a thread or leaves a process running makes every later fork unsafe:
the template says so (``rejected``), refuses every FORK from then on (REFUSED: the caller asks a
new template) and leaves once the ranks it forked before are gone (they die with it).
"""

from __future__ import annotations

import collections
import gc
import os
import pickle
import selectors
import signal
import socket
import sys
import threading
from typing import NoReturn

from ..rank import code_cache, imports_news, process
from ..wire import framing

#: The messages between the caller and its template (pickled tuples on the control socket).
FORK, FORKED, EXITED, READY, GROW, RETIRE, REFUSED = "fork", "forked", "exited", "ready", "grow", "retire", "refused"
TRYING, GREW, REJECTED = "trying", "grew", "rejected"
COMPILE = "compile"

#: What every template imports before it serves forks (what it grows comes on top).
PRELOAD = ("torch", "torch.distributed", "numpy")


def serve(control_fd: int) -> None:
    """Main loop of the template process."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    from ..rank import (
        checks,
        loop,  # noqa: F401  (imported now so each fork has it for free)
        spare,  # noqa: F401
    )

    checks.install()  # the collective check: every name a rank's code takes from torch.distributed is ours
    code_cache.install()  # a rank's import of the notebook's own modules takes the code compiled here

    process.set_process_name("mpify_nb-tmpl")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the caller decides when ranks stop
    control = socket.socket(fileno=control_fd)
    first = framing.recv(control)
    if first is None:
        os._exit(0)
    _kind, names, paths = pickle.loads(first[0])
    sys.path.extend(p for p in paths if p not in sys.path)  # the caller's site-packages
    # A rank killed before it could clean up leaves its children to us, not to init:
    # _reap() then kills them (see process.kill_descendants).
    process.become_subreaper()
    _freeze()
    Template(control).run(names)


class Template:
    """The template's state: the ranks it forked, the modules it is asked to grow."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.children: set[int] = set()
        self.queue: collections.deque[str] = collections.deque()
        self.unsafe = ""  # why forks are no longer safe here ("" while they are)
        self.child_r, self.child_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.child_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd to fire
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, "control")
        self.selector.register(self.child_r, selectors.EVENT_READ, "child")

    def caller_gone(self) -> NoReturn:
        process.kill_descendants()  # its ranks, and all they started, go with it: reaped here, not by PID 1
        os._exit(0)

    def reply(self, *message) -> None:
        try:
            framing.send(self.control, pickle.dumps(message))
        except OSError:
            self.caller_gone()

    def run(self, names: list[str]) -> NoReturn:
        self.reply(READY, os.getpid(), {}, list(sys.modules))  # what its ranks hold: a call need not import it
        self.queue.extend(names)
        while True:
            # Between two imports: every frame waiting first (a FORK, above all), then one module.
            for key, _ in self.selector.select(0 if self.queue else None):
                if key.data == "child":
                    self.on_child_exit()
                else:
                    self.on_frame()
            if self.queue and not self.unsafe:
                self.grow(self.queue.popleft())
                if not self.queue:
                    gc.freeze()  # what it imported joins the rest (no collect: a fork may be waiting)
            elif self.unsafe and not self.children:
                self.caller_gone()  # nothing of ours lives on: leave

    def on_child_exit(self) -> None:
        try:
            os.read(self.child_r, 4096)
        except BlockingIOError:
            pass
        # Any child of ours that is not a rank was adopted from a rank that died (or started by
        # a module that made us unsafe): end it and its tree before reporting that rank's exit,
        # so when a call is over nothing its ranks started is left.
        process.kill_descendants(spare=self.children, reap=False)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.children:  # not an orphan adopted from a rank
                self.children.discard(pid)
                self.reply(EXITED, pid, os.waitstatus_to_exitcode(status))

    def on_frame(self) -> None:
        data, fds = framing.recv_or(self.control, self.caller_gone)
        kind, *rest = pickle.loads(data)
        if kind == GROW:
            sys.path.extend(p for p in rest[1] if p not in sys.path)  # the caller's site-packages, now
            self.queue.extend(rest[0])  # the caller asks each name once
        elif kind == RETIRE:
            self.queue.clear()
        elif kind == COMPILE:
            try:
                code_cache.hold(rest[0])  # before the FORK that follows it on this socket
            except Exception:
                pass  # only a speed-up is lost
        elif kind == FORK:
            request_id = rest[0]
            if self.unsafe:
                for fd in fds:
                    os.close(fd)
                self.reply(REFUSED, request_id, self.unsafe)
                return
            role = rest[1] if len(rest) > 1 else "rank"
            imports_news.hold_current()  # what the rank is born holding, read here once, not per rank
            pid = os.fork()
            if pid == 0:
                _become(role, fds, self.control, self.child_r, self.child_w)
            for fd in fds:
                os.close(fd)
            self.children.add(pid)
            self.reply(FORKED, request_id, pid)

    def grow(self, name: str) -> None:
        """Import ``name`` (quietly); tell the caller what it added, or why it could not."""
        if name in sys.modules:  # a module before it imported it
            self.reply(GREW, name, [], "")
            return
        self.reply(TRYING, name)
        before = set(sys.modules)
        failure, unsafe = _import_quietly(name, self.children)
        if unsafe:
            self.unsafe = f"{name} {unsafe}"
            self.queue.clear()
            # What it started is no rank of ours: it goes (a thread cannot be stopped, but nothing
            # is forked from here any more).
            process.kill_descendants(spare=self.children, reap=False)
            self.reply(REJECTED, name, unsafe)
            return
        # Its forks inherit the look at what it bound (a rank's check then looks at nothing at its start).
        from ..torchdist.checks import wrappers

        wrappers.look_for_bound_names()
        # Failed or not, what it imported stays (a module imported before the failing line).
        self.reply(GREW, name, [n for n in sys.modules if n not in before], failure)


def _import_quietly(name: str, ranks: set[int]) -> tuple[str, str]:
    """Import ``name`` with fds 1 and 2 silenced; return (why it failed, why it made forks unsafe)."""
    import importlib

    # What a module prints or warns at import would land in whichever cell runs now (ipykernel
    # captures fds 1 and 2): a rank that imported it would have shown it in its own call.
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without cuInit
    try:
        importlib.import_module(name)
    except BaseException as e:  # SystemExit, KeyboardInterrupt too: skip it, go on
        return f"{type(e).__name__}: {e}"[:300], ""
    finally:
        for fd, saved_fd in zip((1, 2), saved):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        os.close(devnull)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "", "initializes CUDA at import"
    if threading.active_count() > 1:
        return "", "starts a thread at import"
    # Every rank would hold its Popen, yet it is the template's child: the template's reaper would
    # kill it under them.
    if any(pid not in ranks for pid in process.children_of(os.getpid())):
        return "", "starts a process at import"
    return "", ""


def _freeze() -> None:
    # Everything imported so far is shared by every rank: keep the garbage collector off it.
    # Ranks then neither spend CPU scanning it nor copy its pages by touching GC headers.
    gc.collect()
    gc.freeze()


def _become(role: str, fds: list[int], control, child_r: int, child_w: int) -> NoReturn:
    try:
        parent = os.getppid()
        control.close()
        signal.set_wakeup_fd(-1)
        os.close(child_r)
        os.close(child_w)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if role == "spare":
            from ..rank import spare

            spare.main(fds[0], parent)
        channel, out, err = fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        from ..rank.loop import main

        main(channel, parent)
    finally:
        os._exit(1)
