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

Preloading (what to preload: preload.py; ``set_preload`` here chooses it and acts on the
template at once). The first message a template gets names
modules to import before it serves forks. After a call, if the ranks or the notebook
imported modules the current template lacks, a *candidate* template is started with
all of them; the current one keeps serving meanwhile::

    refresh()  -- lacks? (HAS names) ------------> current template: [names it holds]
               -- new TemplateClient(wanted) ----> candidate: import one by one
                                                   ("trying" name, ... READY failed)
    get_template(): candidate READY  -> it becomes the template; the old one retires
                                        (ends once its last rank has exited)
                    candidate rejected (CUDA, thread, process) or died -> the module is
                                        remembered as failed; refresh() again
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
from collections.abc import Sequence
from typing import Any, Callable, NoReturn, Optional, Union

from . import preload, process, wire

_FORK, _FORKED, _EXITED, _READY, _HAS = "fork", "forked", "exited", "ready", "has"

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
    from . import rank  # noqa: F401  (imported now so each fork has it for free)

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
        process.kill_descendants(reap=False)  # its ranks, and all they started, go with it
        os._exit(0)

    def reply(*message) -> None:
        try:
            wire.send(control, pickle.dumps(message))
        except OSError:
            caller_gone()

    reply(_READY, os.getpid(), failed)
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
            try:
                message = wire.recv(control)
            except (OSError, EOFError):
                message = None
            if message is None:
                caller_gone()
            data, fds = message
            kind, request_id, *rest = pickle.loads(data)
            if kind == _HAS:  # which of these modules do we hold? (no import: a fork may be next)
                reply(_HAS, request_id, [name for name in rest[0] if name in sys.modules])
                continue
            pid = os.fork()
            if pid == 0:
                _become_rank(fds, control, child_r, child_w)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            reply(_FORKED, request_id, pid)


def _preload(control: socket.socket) -> dict[str, str]:
    """Import the modules the caller asks for (its first message), one by one; return those that
    failed, with why. A module that initializes CUDA, starts a Python thread or leaves a child
    process running would make every fork of us unsafe: we report it and leave, and the caller
    starts over without it."""
    import importlib

    message = wire.recv(control)
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
                process.kill_descendants(reap=False)  # what it started goes with us
                os._exit(0)
    finally:
        for fd, saved_fd in zip((1, 2), saved):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        os.close(devnull)
    return failed


def _tell(control: socket.socket, *message) -> None:
    try:
        wire.send(control, pickle.dumps(message))
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

    def __init__(self, preload: Sequence[str] = (), paths: Sequence[str] = ()) -> None:
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
        self._exited: dict[int, int] = {}
        self.preload = list(preload)  # asked for; those that failed are in self.failed once ready
        self.failed: dict[str, str] = {}
        self.rejected: Optional[tuple[str, str]] = None  # (module, why) that made it unusable
        self.trying: Optional[str] = None  # the module it was importing last
        self._live: set[int] = set()  # ranks forked and not yet exited
        self._held: set[str] = set()  # modules it was found to hold besides those it preloaded
        self._has: dict[int, list[str]] = {}
        self._retiring = False
        try:
            wire.send(self._control, pickle.dumps(("preload", self.preload, list(paths))))
        except OSError:
            pass  # it died at once: the reader sees it, and wait_ready() says so
        self._reader = threading.Thread(target=self._read_replies, name="mpify_nb-template-reader", daemon=True)
        self._reader.start()

    @property
    def ready(self) -> bool:
        return self._ready and self.alive()

    def holds(self) -> set[str]:
        """The modules it is known to hold (once ready)."""
        return (set(self.preload) - set(self.failed)) | self._held

    def lacks(self, names: Sequence[str], timeout: float = 5.0) -> list[str]:
        """Those of ``names`` it has not imported (all of them if it does not answer)."""
        if not self.ready:
            return list(names)
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
        try:
            with self._send_lock:
                wire.send(self._control, pickle.dumps((_HAS, request_id, list(names))))
        except OSError:
            return list(names)
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._has or self._dead, timeout)
            found = self._has.pop(request_id, [])
        self._held.update(found)
        return [n for n in names if n not in self._held]

    def live_ranks(self) -> list[int]:
        """The pids of the ranks it forked that have not exited."""
        with self._cond:
            return sorted(self._live)

    def retire(self) -> None:
        """Stop it once the ranks it forked are gone (they die with it): now if there are none."""
        with self._cond:
            self._retiring = True
            idle = not self._live
        if idle:
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
                        self.failed = reply[2]
                        self._ready = True
                    elif reply[0] == _FORKED:
                        self._forked[reply[1]] = reply[2]
                        self._live.add(reply[2])
                    elif reply[0] == _EXITED:
                        self._exited[reply[1]] = reply[2]
                        self._live.discard(reply[1])
                    elif reply[0] == _HAS:
                        self._has[reply[1]] = reply[2]
                    elif reply[0] == "trying":
                        self.trying = reply[1]
                    elif reply[0] == "rejected":
                        self.rejected = (reply[1], reply[2])
                    self._cond.notify_all()
                    retire_now = self._retiring and not self._live and reply[0] == _EXITED
                if retire_now:
                    threading.Thread(target=self.close, name="mpify_nb-template-retire", daemon=True).start()
        except (OSError, EOFError):
            pass
        with self._cond:
            self._dead = True
            self._cond.notify_all()
        self._proc.poll()  # reap it if it exited


_lock = threading.Lock()
_client: Optional[TemplateClient] = None
_candidate: Optional[TemplateClient] = None  # a fresh template preloading in the background


def get_template() -> TemplateClient:
    """The current template, started (or restarted) as needed. A preloading template that
    is ready by now takes over; one still importing is not waited for."""
    global _client
    with _lock:
        _settle_candidate()
        if _client is not None and (not _client.alive() or _client.env_signature != _env_signature()):
            if _client.alive():
                _client.retire()  # a Session's ranks live on in it: it ends when they do
            else:
                _client.close()
            _client = None
        if _client is None:
            # Only what the user named: nothing learned is worth a wait. The rest comes in the background.
            _client = TemplateClient(preload.named() if preload.enabled() else (), preload.site_paths())
        return _client


def _settle_candidate() -> bool:
    """With _lock held: swap in the candidate if it is ready; forget it (remembering the
    module it failed on) if it died. True when it is settled (or there is none)."""
    global _client, _candidate
    c = _candidate
    if c is None:
        return True
    if c.rejected is not None or (not c.alive() and not c._ready):
        if c.rejected is not None:
            preload.mark_failed(*c.rejected)
        elif c.trying is not None:
            preload.mark_failed(c.trying, "the template process died while importing it")
        c.close()
        _candidate = None
        return True
    if not c.ready:
        return False
    _candidate = None
    for name, why in c.failed.items():
        preload.mark_failed(name, why)
    if c.env_signature != _env_signature() or not preload.enabled():
        c.close()
        return True
    old, _client = _client, c
    if old is not None:
        old.retire()
    return True


def refresh(cwd: Optional[str] = None) -> None:
    """Start, in the background, a template that holds every module the ranks are known to
    need (see preload.py), unless the current one holds them all. Never waits for it."""
    global _candidate
    if not preload.enabled():
        return
    want = preload.wanted(cwd)
    with _lock:
        _settle_candidate()
        if _candidate is not None or not want:
            return  # one is on its way; once it is in, the next refresh adds what it lacks
        current = _client
        if current is None or not current.alive():
            return  # the next call starts one (with the named modules); then we add the rest
    held = current.holds()
    missing = [n for n in want if n not in held]
    if not missing or not current.lacks(missing):  # asked without _lock: a call may want a fork now
        return
    with _lock:
        if _candidate is not None or current is not _client:
            return  # someone else got there first
        _candidate = TemplateClient(want, preload.site_paths())
        candidate = _candidate
    in_background(_watch_candidate, candidate, cwd)


def _watch_candidate(candidate: TemplateClient, cwd: Optional[str]) -> None:
    try:
        candidate.wait_ready(timeout=_PRELOAD_PATIENCE)
    except TemplateDied:
        pass
    global _candidate
    with _lock:
        if _candidate is candidate and not _settle_candidate():
            candidate.close()  # stuck importing something (a network wait?): give up on it
            if candidate.trying is not None:
                preload.mark_failed(candidate.trying, f"its import took over {_PRELOAD_PATIENCE:.0f} s")
            _candidate = None
    refresh(cwd)  # what it failed on is left out now, and more may be wanted by now


_busy = 0  # background work under way that may start or swap in a template (wait_preloaded waits for it)


def in_background(work: Callable[..., None], *args: Any) -> None:
    """Run ``work(*args)`` on a daemon thread; wait_preloaded() waits for it to end."""
    global _busy

    def run() -> None:
        global _busy
        try:
            work(*args)
        finally:
            with _lock:
                _busy -= 1

    with _lock:
        _busy += 1
    threading.Thread(target=run, name="mpify_nb-preload", daemon=True).start()


#: Seconds a preloading template may take before it is given up.
_PRELOAD_PATIENCE = 600.0


def wait_preloaded(timeout: Optional[float] = None) -> bool:
    """Wait until no preloading template is on its way (it took over, or failed); True if so."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _lock:
            settled = _settle_candidate() and not _busy
        if settled:
            return True
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def drop_preloaded() -> None:
    """Preloading was turned off: stop a candidate, and retire a template that holds more than torch."""
    global _client, _candidate
    with _lock:
        if _candidate is not None:
            _candidate.close()
            _candidate = None
        if _client is not None and _client.holds():
            _client.retire()
            _client = None


def set_preload(modules: Union[bool, Sequence[str]] = True) -> None:
    """Choose what the template that ranks are forked from holds, besides torch and numpy.

    ``True`` (the default): the installed modules ranks imported in earlier calls are
    preloaded by a fresh template, started in the background and used from the first call
    after it is ready (what only the notebook imported is not: its import-time side effects
    would run once more). A list of module names: those too, from now
    on. ``False``: nothing more than torch and numpy (ranks import the rest on every call);
    the next call starts from a template without anything preloaded.

    Preloading never imports a module from the notebook's working directory or from outside
    ``site-packages``/the standard library, and leaves out a module that fails to import, that
    initializes CUDA, or that starts a thread or a process at import.

    Example (a notebook cell)::

        import mpify_nb
        mpify_nb.set_preload(["transformers.trainer", "lightning"])  # ready before the first call
        mpify_nb.set_preload(False)                                  # every call imports afresh
    """
    if preload.choose(modules):
        refresh()  # named modules: start on them now
    else:
        drop_preloaded()


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


def shutdown() -> bool:
    """Stop the template to free its memory (about 220 MB); the next call starts a new one.

    Ranks forked from it die with it, so while some live (an open Session's, a call running on
    another thread) it is not stopped: it ends once they have exited, and a RuntimeWarning says
    so. Returns True when it is gone now."""
    global _client, _candidate
    with _lock:
        if _candidate is not None:
            _candidate.close()
            _candidate = None
        client, _client = _client, None
    if client is None:
        return True
    live = client.live_ranks()
    if not live:
        client.close()
        return True
    client.retire()
    import warnings

    warnings.warn(f"mpify_nb.template.shutdown(): the template (pid {client.pid}) still has {len(live)} live "
                  "ranks (an open Session's, or a call's): it ends when they do, so close the Session to free "
                  "its memory", RuntimeWarning, stacklevel=2)
    return False


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
