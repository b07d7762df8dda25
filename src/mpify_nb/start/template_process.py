"""The template process itself: import what it is asked to preload, then fork ranks on request.

What the caller holds of it (TemplateClient, the candidate templates, preloading) is in
start/template.py, which starts it (``python -c "from mpify_nb.start.template_process import serve"``).
"""

from __future__ import annotations

import gc
import os
import pickle
import selectors
import signal
import socket
import sys
import threading
from typing import NoReturn

from ..rank import process
from ..wire import framing

#: The messages between the caller and its template (pickled tuples on the control socket).
FORK, FORKED, EXITED, READY, HAS = "fork", "forked", "exited", "ready", "has"

#: What every template imports before it serves forks (the preloading of start/preload.py comes on top).
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
    )

    checks.install()  # the collective check: every name a rank's code takes from torch.distributed is ours

    process.set_process_name("mpify_nb-tmpl")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the caller decides when ranks stop
    control = socket.socket(fileno=control_fd)
    failed = _preload(control)
    # A rank killed before it could clean up leaves its children to us, not to init:
    # _reap() then kills them (see process.kill_descendants).
    process.become_subreaper()
    # Everything imported so far is shared by every rank: keep the garbage collector off it.
    # Ranks then neither spend CPU scanning it nor copy its pages by touching GC headers.
    gc.collect()
    gc.freeze()

    child_r, child_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(child_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd to fire

    children: set[int] = set()

    def caller_gone() -> NoReturn:
        process.kill_descendants()  # its ranks, and all they started, go with it: reaped here, not by PID 1
        os._exit(0)

    def reply(*message) -> None:
        try:
            framing.send(control, pickle.dumps(message))
        except OSError:
            caller_gone()

    reply(READY, os.getpid(), failed, list(sys.modules))  # what its ranks hold: a call need not import it
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(child_r, selectors.EVENT_READ, "child")
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                try:
                    os.read(child_r, 4096)
                except BlockingIOError:
                    pass
                # Any child of ours that is not a rank was adopted from a rank that died: end
                # it and its tree before reporting that rank's exit, so when a call is over
                # nothing its ranks started is left.
                process.kill_descendants(spare=children, reap=False)
                _reap(reply, children)
                continue
            data, fds = framing.recv_or(control, caller_gone)
            kind, request_id, *rest = pickle.loads(data)
            if kind == HAS:  # which of these modules do we hold? (no import: a fork may be next)
                reply(HAS, request_id, [name for name in rest[0] if name in sys.modules])
                continue
            pid = os.fork()
            if pid == 0:
                _become_rank(fds, control, child_r, child_w)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            reply(FORKED, request_id, pid)


def _preload(control: socket.socket) -> dict[str, str]:
    """Import the modules the caller asks for (its first message), one by one; return those that
    failed, with why. A module that initializes CUDA, starts a Python thread or leaves a child
    process running would make every fork of us unsafe: we report it and leave, and the caller
    starts over without it."""
    import importlib

    message = framing.recv(control)
    if message is None:
        os._exit(0)
    _kind, names, paths = pickle.loads(message[0])
    if not names:
        return {}
    sys.path.extend(p for p in paths if p not in sys.path)  # the caller's site-packages
    torch = sys.modules.get("torch")
    failed: dict[str, str] = {}
    # What a module prints or warns at import would land in whichever cell runs now (ipykernel
    # captures fds 1 and 2): a rank that imported it would have shown it in its own call.
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without cuInit
    try:
        for name in names:
            if name in sys.modules:
                continue
            _tell(control, "trying", name)
            try:
                importlib.import_module(name)
            except BaseException as e:  # SystemExit, KeyboardInterrupt too: skip it, go on
                failed[name] = f"{type(e).__name__}: {e}"[:300]
                continue
            why = ""
            if torch is not None and torch.cuda.is_initialized():
                why = "it initializes CUDA at import"
            elif threading.active_count() > 1:
                why = "it starts a thread at import"
            elif process.children_of(os.getpid()):
                # Every rank would hold its Popen, yet it is the template's child: the template's
                # reaper would kill it under them.
                why = "it starts a process at import"
            if why:
                _tell(control, "rejected", name, why)
                process.kill_descendants()  # what it started goes with us
                os._exit(0)
    finally:
        for fd, saved_fd in zip((1, 2), saved):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        os.close(devnull)
    return failed


def _tell(control: socket.socket, *message) -> None:
    try:
        framing.send(control, pickle.dumps(message))
    except OSError:
        os._exit(0)  # the caller no longer wants us (preloading was turned off, or it left)


def _reap(reply, children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in children:  # not an orphan adopted from a rank
            children.discard(pid)
            reply(EXITED, pid, os.waitstatus_to_exitcode(status))


def _become_rank(fds: list[int], control, child_r: int, child_w: int) -> None:
    try:
        parent = os.getppid()
        control.close()
        signal.set_wakeup_fd(-1)
        os.close(child_r)
        os.close(child_w)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        channel, out, err = fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        from ..rank.loop import main

        main(channel, parent)
    finally:
        os._exit(1)
