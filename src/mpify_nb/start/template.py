"""The template: a warm, never-used process that ranks are forked from.

A fresh interpreter that imports torch costs ~1.6 s; a fork of one that already
did costs ~15 ms. The template is that already-warm interpreter. It is started
with spawn semantics (a new ``python``), imports torch and this library, and then
does nothing but fork ranks on request. It never touches CUDA, never runs user
code and never starts threads, so a fork of it is as clean as a spawn: the
notebook may have initialized CUDA, and nothing of one call leaks into the next.

::

    caller (TemplateClient)                  template (template_process.serve) rank
      | -- FORK id + fds [channel, out, err] -->|
      |                                         | os.fork() --------------------> dup2 out/err to 1/2
      |<------------------- FORKED id, pid -----|                                rank.loop.main(channel)
      |                                         | SIGCHLD: waitpid
      |<---------------- EXITED pid, status ----|
      |  (control socket closes: caller died)   | SIGKILL every rank it forked, exit

The caller's environment, working directory and sys.path are applied by the rank
itself from the call's setup message, so they are those of each call. The
template is restarted when it died or when a variable that matters at import
time (PYTHONPATH, LD_PRELOAD, thread counts...) changed since it started.

Preloading (what to preload: start/preload.py; ``set_preload`` here chooses it and acts on the
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

Retiring is race-free: a template counts a rank from the moment a FORK is asked of it, not
from its FORKED answer, so one that retires while it forks a rank lives on for that rank; and
a retiring template forks nothing more (``TemplateRetired``: the placer asks the current one).

No call waits for a preload: a call that must start a template (none yet, it died, or a
variable read at import time changed) stops the candidate being preloaded (it would take half
the machine from the start the call waits for; it is started again after the call), and no
candidate starts while the current template is still starting.

The template is made, and judged, with the notebook's own environment: while a call plays a
rank in this process, ``os.environ`` holds that rank's variables (``OMP_NUM_THREADS=1``,
``RANK``...), and a template made from them would be replaced at the next call
(``set_caller_environ``).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, NoReturn, Optional, Union

from ..wire import framing
from . import preload
from .template_process import EXITED, FORK, FORKED, HAS, READY

#: Environment variables read when torch & co are imported: a change means a new template.
IMPORT_TIME_ENV = (
    "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "OMP_NUM_THREADS",
    "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCH_HOME", "VIRTUAL_ENV",
)


# -- the caller's handle on it ------------------------------------------------------------

class TemplateDied(RuntimeError):
    """The template process is gone, or stopped answering."""


class TemplateUnresponsive(TemplateDied):
    """The template did not answer in time: still starting, starved, or stopped (then replaced)."""


class TemplateRetired(TemplateDied):
    """The template is retiring (replaced): it forks no more ranks; ask the current one."""


class TemplateClient:
    """Starts a template process and asks it for ranks. Thread-safe."""

    def __init__(self, preload: Sequence[str] = (), paths: Sequence[str] = ()) -> None:
        ours, theirs = framing.socketpair()
        self.env_signature = _env_signature()
        self._control = ours
        self._proc = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from mpify_nb.start.template_process import serve; serve(int(sys.argv[1]))",
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
        self._in_flight: set[int] = set()  # FORK requests not answered yet: ranks about to live
        self._closed_why = ""  # why this process closed it ("" while it has not)
        self._closing = False  # a thread is closing it
        self._held: set[str] = set()  # modules it was found to hold besides those it preloaded
        self._has: dict[int, list[str]] = {}
        #: every module it holds (its sys.modules once ready): what a rank forked from it need not import
        self.modules: Optional[frozenset[str]] = None
        self._retiring = False
        try:
            framing.send(self._control, pickle.dumps(("preload", self.preload, list(paths))))
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
                framing.send(self._control, pickle.dumps((HAS, request_id, list(names))))
        except OSError:
            return list(names)
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._has or self._dead, timeout)
            found = self._has.pop(request_id, [])
        self._held.update(found)
        return [n for n in names if n not in self._held]

    def live_count(self) -> int:
        """Its ranks that live, or are being forked."""
        with self._cond:
            return len(self._live) + len(self._in_flight)

    @property
    def retiring(self) -> bool:
        return self._retiring

    def retire(self, wait: bool = True) -> bool:
        """Fork nothing more, and stop once the ranks it forked, or is forking, are gone (they die
        with it). True when it had none: it is stopped now (``wait=False``: in the background)."""
        with self._cond:
            self._retiring = True
            idle = not self._live and not self._in_flight
        if idle and wait:
            self.close("retired")
        elif idle:
            self._close_later("retired")
        return idle

    def abandon(self, why: str) -> None:
        """Kill it now and let go of it in the background: a candidate that can no longer serve
        (it holds no ranks), which may be in the middle of a long import and would not notice a
        closed socket before its end."""
        try:
            self._proc.kill()
        except OSError:
            pass
        self._closed_why = f"this process killed it ({why})"
        self._close_later(why)

    def _close_later(self, why: str) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
        threading.Thread(target=self.close, args=(why,), name="mpify_nb-template-retire", daemon=True).start()

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
            if self._retiring:  # checked where retire() counts what is in flight: never both
                raise TemplateRetired(f"the template process (pid {self.pid}) is retiring: it forks no more ranks")
            request_id = self._next_id
            self._next_id += 1
            self._in_flight.add(request_id)
        try:
            return self._fork(request_id, fds, deadline, timeout)
        finally:
            with self._cond:
                self._in_flight.discard(request_id)
                idle = self._retiring and not self._live and not self._in_flight and not self._dead
            if idle:
                self._close_later("retired")  # it retired meanwhile, and this fork left it nothing

    def _fork(self, request_id: int, fds: list[int], deadline: float, timeout: float) -> int:
        try:
            with self._send_lock:
                framing.send(self._control, pickle.dumps((FORK, request_id)), fds)
        except OSError as e:
            raise TemplateDied(f"the template process (pid {self.pid}) is gone ({self.how_it_ended()}): {e}") from None
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._forked or self._dead, max(0.0, deadline - time.monotonic()))
            if request_id in self._forked:
                return self._forked.pop(request_id)
            if self._dead:
                raise TemplateDied(f"the template process (pid {self.pid}) died ({self.how_it_ended()}) "
                                   "before it could fork a rank")
        self._give_up(f"did not fork a rank within {timeout:.3g} s")

    def _give_up(self, what: str) -> NoReturn:
        if _process_state(self.pid) in ("T", "t"):
            # Stopped (SIGSTOP, a debugger): it would never answer. The next call starts a fresh one.
            self._proc.kill()
            self._closed_why = "this process killed it: it was stopped (SIGSTOP?) and did not answer"
            self.close()
            raise TemplateUnresponsive(f"the template process (pid {self.pid}) {what}: it is stopped "
                                       "(SIGSTOP?), so it was replaced")
        # Merely slow (a loaded machine): keep it, a later call will find it ready.
        raise TemplateUnresponsive(f"the template process (pid {self.pid}) {what}")

    def how_it_ended(self) -> str:
        """How the template process ended, for an error message: the signal that killed it, or
        its exit status, and why, when this process closed it."""
        try:
            code = self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "its control socket closed; it has not exited yet"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"killed by {name}"
            if -code == signal.SIGKILL and not self._closed_why:
                how += " (kill -9, or the kernel's out-of-memory killer: see dmesg)"
        else:
            how = f"exit status {code}"
        return f"{how}: {self._closed_why}" if self._closed_why else how

    def exit_code(self, pid: int, timeout: float) -> Optional[int]:
        """The exit code of a rank it forked (negative: killed by that signal); None if unknown."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exited or self._dead, timeout)
            return self._exited.pop(pid, None)

    def close(self, why: str = "shut down") -> None:
        """Stop the template; the ranks it still has die with it. ``why`` goes into the
        error of a rank that dies with it (see how_it_ended)."""
        if not self._closed_why:
            self._closed_why = f"this process closed it ({why})"
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
                message = framing.recv(self._control)
                if message is None:
                    break
                reply = pickle.loads(message[0])
                with self._cond:
                    if reply[0] == READY:
                        self.failed = reply[2]
                        self.modules = frozenset(reply[3]) if len(reply) > 3 else None
                        self._ready = True
                    elif reply[0] == FORKED:
                        self._forked[reply[1]] = reply[2]
                        self._live.add(reply[2])
                    elif reply[0] == EXITED:
                        self._exited[reply[1]] = reply[2]
                        self._live.discard(reply[1])
                    elif reply[0] == HAS:
                        self._has[reply[1]] = reply[2]
                    elif reply[0] == "trying":
                        self.trying = reply[1]
                    elif reply[0] == "rejected":
                        self.rejected = (reply[1], reply[2])
                    self._cond.notify_all()
                    retire_now = self._retiring and not self._live and not self._in_flight and reply[0] == EXITED
                if retire_now:
                    self._close_later("retired, after its last rank")
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
    global _client, _candidate
    with _lock:
        _settle_candidate()
        if _client is not None and (not _client.alive() or _client.retiring
                                    or _client.env_signature != _env_signature()):
            if _client.alive():
                _client.retire(wait=False)  # a Session's ranks live on in it: it ends when they do
            else:
                _client.close("it had died")
            _client = None
        if _client is None:
            if _candidate is not None:
                # A call waits for the template we start now: a preload beside it would take half the
                # machine. It starts again after the call (refresh), with this environment.
                _candidate.abandon("a call needed a template at once")
                _candidate = None
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
        c.close("a preload failed in it")
        _candidate = None
        return True
    usable = c.env_signature == _env_signature() and preload.enabled()
    if usable and not c.ready:
        return False
    _candidate = None
    if c.ready:
        for name, why in c.failed.items():
            preload.mark_failed(name, why)
    if not usable:  # ready or not: it can never serve
        c.abandon("a variable read at import time changed, or preloading was turned off")
        return True
    old, _client = _client, c
    if old is not None:
        old.retire(wait=False)  # its ranks, and those it is forking now, live on in it
    return True


def refresh(cwd: Optional[str] = None) -> None:
    """Start, in the background, a template that holds every module the ranks are known to
    need (see start/preload.py), unless the current one holds them all. Never waits for it."""
    global _candidate
    if not preload.enabled():
        return
    want = preload.wanted(cwd)
    with _lock:
        _settle_candidate()
        if _candidate is not None or not want:
            return  # one is on its way; once it is in, the next refresh adds what it lacks
        current = _client
        if current is None or not current.ready:
            # None or dead: the next call starts one (with the named modules); then we add the rest.
            # Still starting: a call may be waiting for it, and a preload would slow it down.
            return
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
            _candidate.abandon("preloading was turned off")
            _candidate = None
        if _client is not None and _client.holds():
            _client.retire(wait=False)
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

    Example (a notebook cell; with ``["transformers.trainer", "lightning"]`` a warm call of a
    Hugging Face or Lightning training function does not import them again):

    ```python
    import mpify_nb
    mpify_nb.set_preload(["sklearn.linear_model"])   # preloaded from now on, ready before the first call
    mpify_nb.set_preload(True)                       # the default: learn from what the calls import
    mpify_nb.set_preload(False)                      # every call imports afresh
    ```
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
            _candidate.abandon("preloading was stopped by shutdown()")
            _candidate = None
        client, _client = _client, None
    if client is None or client.retire():
        return True
    import warnings

    warnings.warn(f"mpify_nb.template.shutdown(): the template (pid {client.pid}) still has {client.live_count()} "
                  "live ranks (an open Session's, or a call's): it ends when they do, so close the Session to "
                  "free its memory", RuntimeWarning, stacklevel=2)
    return False


def _process_state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


#: The notebook's own environment while a call plays a rank in this process (see set_caller_environ).
_caller_environ: Optional[dict[str, str]] = None


def set_caller_environ(environ: Optional[dict[str, str]]) -> None:
    """While a call plays a rank here, ``os.environ`` holds that rank's variables: templates are
    made, and judged, with ``environ`` (this process's own, from before the call) instead.
    None: the call is over, os.environ is the process's own again."""
    global _caller_environ
    _caller_environ = None if environ is None else dict(environ)


def _environ() -> dict[str, str]:
    """This process's own environment (a copy)."""
    environ = _caller_environ
    return dict(os.environ if environ is None else environ)


def _env_signature() -> tuple:
    environ = _environ()
    return (sys.executable,) + tuple(environ.get(k) for k in IMPORT_TIME_ENV)


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
    env = _environ()
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # src/, above mpify_nb/start/
    paths = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = here + (os.pathsep + paths if paths else "")
    env["MPIFY_NB_CHILD"] = "1"  # no template of its own
    return env
