"""The template: a warm, never-used process that ranks are forked from.

A fresh interpreter that imports torch costs ~1.6 s; a fork of one that already
did costs ~15 ms. The template is that already-warm interpreter. It is started
with spawn semantics (a new ``python``), imports torch and this library, and then
does nothing but fork ranks on request. It never touches CUDA, never runs user
code and never starts threads, so a fork of it is as clean as a spawn: the
notebook may have initialized CUDA, and nothing of one call leaks into the next.

::

    caller (TemplateClient)                  template (serve)                 rank
      | -- FORK id + fds [channel, out, err] -->|
      |                                         | os.fork() --------------------> dup2 out/err to 1/2
      |<------------------- FORKED id, pid -----|                                rank.main(channel)
      |                                         | SIGCHLD: waitpid
      |<---------------- EXITED pid, status ----|
      |  (control socket closes: caller died)   | SIGKILL every rank it forked, exit

The caller's environment, working directory and sys.path are applied by the rank
itself from the call's setup message, so they are those of each call. The
template is restarted when it died or when a variable that matters at import
time (PYTHONPATH, LD_PRELOAD, thread counts...) changed since it started.
"""

from __future__ import annotations

import gc
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NoReturn, Optional

from . import wire

_FORK, _FORKED, _EXITED, _READY = "fork", "forked", "exited", "ready"

#: Environment variables read when torch & co are imported: a change means a new template.
IMPORT_TIME_ENV = (
    "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "OMP_NUM_THREADS",
    "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCH_HOME", "VIRTUAL_ENV",
)

PRELOAD = ("torch", "torch.distributed", "numpy")


# -- the template process -----------------------------------------------------------------

def serve(control_fd: int) -> None:
    """Main loop of the template process."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    from . import rank  # imported now so each fork has it for free

    rank.set_process_name("mpify_nb-tmpl")
    # A rank killed before it could clean up leaves its children to us, not to init:
    # _reap() then kills them (see rank.kill_descendants).
    rank.become_subreaper()
    # Everything imported so far is shared by every rank: keep the garbage collector off it.
    # Ranks then neither spend CPU scanning it nor copy its pages by touching GC headers.
    gc.collect()
    gc.freeze()

    control = socket.socket(fileno=control_fd)
    child_r, child_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(child_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd to fire
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the caller decides when ranks stop

    children: set[int] = set()

    def caller_gone() -> NoReturn:
        rank.kill_descendants(reap=False)  # its ranks, and all they started, go with it
        os._exit(0)

    def reply(*message) -> None:
        try:
            wire.send(control, pickle.dumps(message))
        except OSError:
            caller_gone()

    reply(_READY, os.getpid())
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
                rank.kill_descendants(spare=children, reap=False)
                _reap(reply, children)
                continue
            try:
                message = wire.recv(control)
            except (OSError, EOFError):
                message = None
            if message is None:
                caller_gone()
            data, fds = message
            kind, request_id = pickle.loads(data)
            pid = os.fork()
            if pid == 0:
                _become_rank(fds, control, child_r, child_w)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            reply(_FORKED, request_id, pid)


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
            reply(_EXITED, pid, os.waitstatus_to_exitcode(status))


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
        from .rank import main

        main(channel, parent)
    finally:
        os._exit(1)


# -- the caller's handle on it ------------------------------------------------------------

class TemplateDied(RuntimeError):
    """The template process is gone, or stopped answering."""


class TemplateUnresponsive(TemplateDied):
    """The template did not answer in time: still starting, starved, or stopped (then replaced)."""


class TemplateClient:
    """Starts a template process and asks it for ranks. Thread-safe."""

    def __init__(self) -> None:
        ours, theirs = wire.socketpair()
        self.env_signature = _env_signature()
        self._control = ours
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from mpify_nb.template import serve; serve(int(sys.argv[1]))",
             str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=bootstrap_env(),
            **own_process_group(),
        )
        theirs.close()
        self.pid = self._proc.pid
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._ready = False
        self._dead = False
        self._next_id = 0
        self._forked: dict[int, int] = {}
        self._held = 0  # live ranks of a Session forked from us: they must outlive a restart
        self._exited: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read_replies, name="mpify_nb-template-reader", daemon=True)
        self._reader.start()

    def hold(self) -> None:
        """A persistent rank (a Session's) forked from this template lives on: when the template
        is replaced (the environment changed), keep this one running until it is released."""
        with self._cond:
            self._held += 1

    def release(self) -> None:
        with self._cond:
            self._held -= 1
            retire = self._held <= 0 and self in _retired
        if retire:
            _retired.remove(self)
            self.close()

    def alive(self) -> bool:
        return not self._dead and self._proc.poll() is None

    def wait_ready(self, timeout: float = 120.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._dead, timeout):
                raise TemplateDied(f"the template process (pid {self.pid}) did not start within {timeout:.0f} s")
            if self._dead:
                raise TemplateDied(f"the template process (pid {self.pid}) died while starting")

    def fork(self, fds: list[int], timeout: float = 30.0) -> int:
        """Fork a rank holding ``fds`` = [channel, stdout, stderr]; return its pid.
        Raises TemplateUnresponsive (and kills the template) if it did not fork within ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            self.wait_ready(timeout)
        except TemplateDied:
            if self._dead:
                raise
            self._give_up(f"is still starting (it imports torch) after {timeout:.3g} s")
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
        try:
            with self._send_lock:
                wire.send(self._control, pickle.dumps((_FORK, request_id)), fds)
        except OSError as e:
            raise TemplateDied(f"the template process (pid {self.pid}) is gone: {e}") from None
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._forked or self._dead, max(0.0, deadline - time.monotonic()))
            if request_id in self._forked:
                return self._forked.pop(request_id)
            if self._dead:
                raise TemplateDied(f"the template process (pid {self.pid}) died ({self._how_it_ended()}) "
                                   "before it could fork a rank")
        self._give_up(f"did not fork a rank within {timeout:.3g} s")

    def _give_up(self, what: str) -> NoReturn:
        if _process_state(self.pid) in ("T", "t"):
            # Stopped (SIGSTOP, a debugger): it would never answer. The next call starts a fresh one.
            self._proc.kill()
            self.close()
            raise TemplateUnresponsive(f"the template process (pid {self.pid}) {what}: it is stopped "
                                       "(SIGSTOP?), so it was replaced")
        # Merely slow (a loaded machine): keep it, a later call will find it ready.
        raise TemplateUnresponsive(f"the template process (pid {self.pid}) {what}")

    def _how_it_ended(self) -> str:
        try:
            code = self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "its control socket closed"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def exit_code(self, pid: int, timeout: float) -> Optional[int]:
        """The exit code of a rank it forked (negative: killed by that signal); None if unknown."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exited or self._dead, timeout)
            return self._exited.pop(pid, None)

    def close(self) -> None:
        """Stop the template; the ranks it still has die with it."""
        self._dead = True
        try:
            # shutdown, not just close: our reader thread is blocked in recv() on this socket,
            # and a close() under it leaves the connection open, so the template would never
            # see its end and we would wait out the grace period below.
            self._control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)
        self._control.close()

    def _read_replies(self) -> None:
        try:
            while True:
                message = wire.recv(self._control)
                if message is None:
                    break
                reply = pickle.loads(message[0])
                with self._cond:
                    if reply[0] == _READY:
                        self._ready = True
                    elif reply[0] == _FORKED:
                        self._forked[reply[1]] = reply[2]
                    elif reply[0] == _EXITED:
                        self._exited[reply[1]] = reply[2]
                    self._cond.notify_all()
        except (OSError, EOFError):
            pass
        with self._cond:
            self._dead = True
            self._cond.notify_all()
        self._proc.poll()  # reap it if it exited


_lock = threading.Lock()
_client: Optional[TemplateClient] = None
_retired: list[TemplateClient] = []  # replaced templates that still hold a Session's ranks


def get_template() -> TemplateClient:
    """The current template, started (or restarted) as needed."""
    global _client
    with _lock:
        if _client is not None and (not _client.alive() or _client.env_signature != _env_signature()):
            if _client._held > 0 and _client.alive():
                _retired.append(_client)  # a Session's ranks still live in it: close it after them
            else:
                _client.close()
            _client = None
        if _client is None:
            _client = TemplateClient()
        return _client


def prewarm() -> None:
    """Start the template now, in the background, so the first call does not wait for torch."""
    try:
        get_template()
    except Exception:
        pass  # the first call will try again and report what is wrong


def current_pid() -> Optional[int]:
    """The pid of the running template, if any (without starting one)."""
    client = _client
    return client.pid if client is not None and client.alive() else None


def shutdown() -> None:
    global _client
    with _lock:
        if _client is not None:
            _client.close()
            _client = None


def _process_state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _env_signature() -> tuple:
    return (sys.executable,) + tuple(os.environ.get(k) for k in IMPORT_TIME_ENV)


def own_process_group() -> dict:
    """Popen arguments that put the child in a process group of its own, in the caller's
    session: the SIGINT a kernel interrupt sends to the caller's group does not reach it
    (the caller alone decides when ranks stop), and the scheduler still treats it as part
    of the caller's session (a new session is a separate autogroup, which cost DDP ranks
    ~15% of their steps under load)."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


def bootstrap_env() -> dict:
    """The environment a new interpreter needs to import this very copy of mpify_nb."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = here + (os.pathsep + paths if paths else "")
    env["MPIFY_NB_CHILD"] = "1"  # no template of its own
    return env
