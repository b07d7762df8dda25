"""The caller's handle on one template process (start/template.py keeps the current one and
chooses what it grows): start it, make it grow, ask it for ranks, hear their exits, retire it,
close it.

::

    caller (TemplateClient)                   template (template_process.Template)
      | -- ("start", names, paths) ---------->| import torch; READY, its sys.modules
      | -- GROW names, paths ----------------->| queued; imported one by one, between frames:
      |<------------------ TRYING name --------|
      |<-- GREW name, new modules, failure ----|  (or REJECTED name, why: it forks no more)
      | -- FORK id [role] + fds --------------->| os.fork(): a rank (or a spare rank)
      |<------------------- FORKED id, pid -----|  (or REFUSED id, why)
      |<---------------- EXITED pid, status ----|
      | -- RETIRE ----------------------------->| (drops its queue)
      | -- COMPILE files ---------------------->| the notebook's own modules compiled, for its ranks
      |  (control socket closes: caller died)   | SIGKILL every rank it forked, exit

What a rank holds when it is born is what its template held when it forked it: the GREW
answers before its FORKED (one socket, in order), so ``born_with(pid)`` is exact.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Callable, NoReturn, Optional

from ..wire import framing
from .environ import _env_signature, bootstrap_env, own_process_group
from .template_process import COMPILE, EXITED, FORK, FORKED, GREW, GROW, READY, REFUSED, REJECTED, RETIRE, TRYING

#: Exit codes kept for ranks nobody asked about (a call asks only about a rank that failed).
_EXITS_KEPT = 256


class TemplateDied(RuntimeError):
    """The template process is gone, or stopped answering."""


class TemplateUnresponsive(TemplateDied):
    """The template did not answer in time: still starting, starved, or stopped (then replaced)."""


class TemplateRetired(TemplateDied):
    """The template is retiring (replaced): it forks no more ranks; ask the current one."""


#: Every template this process started and has not closed: closed (and reaped) when it exits.
_open: set[TemplateClient] = set()


def _until_exit(client: TemplateClient) -> None:
    if not _open and not getattr(_until_exit, "registered", False):
        atexit.register(_close_all)
        _until_exit.registered = True  # type: ignore[attr-defined]
    _open.add(client)


def _close_all() -> None:
    """At exit: every template ends now and is reaped here. Left to end on its own once this
    process is gone, it would be re-parented to PID 1, which in a container may never reap it
    (``[mpify_nb-tmpl] <defunct>`` for ever); it kills and reaps its ranks itself."""
    for client in list(_open):
        client.close("the process that started it exited")


def _forget_after_fork() -> None:
    _open.clear()  # a forked child (a DataLoader worker) must never close its parent's templates


os.register_at_fork(after_in_child=_forget_after_fork)


class Holdings:
    """What one template holds and is importing, as its answers tell (guarded by its client's lock)."""

    def __init__(self) -> None:
        self.modules: set[str] = set()  # its sys.modules
        self._frozen: frozenset[str] = frozenset()
        self.grown: set[str] = set()  # names it was asked to hold and holds
        self.queued: dict[str, None] = {}  # asked, not answered yet (in order)
        self.failed: dict[str, str] = {}  # name -> why its import failed there
        self.rejected: Optional[tuple[str, str]] = None  # (module, why) that made it unusable
        self.trying: Optional[str] = None  # the module it imports now
        self.trying_since = 0.0

    def frozen(self) -> frozenset[str]:
        if len(self._frozen) != len(self.modules):
            self._frozen = frozenset(self.modules)
        return self._frozen

    def to_ask(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` it neither holds, nor is importing, nor failed on; now queued."""
        new = [n for n in dict.fromkeys(names)
               if n not in self.modules and n not in self.queued and n not in self.failed]
        self.queued.update(dict.fromkeys(new))
        return new

    def wait(self, cond: threading.Condition, dead: Callable[[], bool], timeout: Optional[float],
             stuck_after: float, names: Optional[Iterable[str]]) -> Optional[str]:
        """With ``cond`` held: wait until none of ``names`` (None: nothing) is queued. "" when so (or
        the template is unusable), None when ``timeout`` ran out, else what went wrong: the module
        stuck for over ``stuck_after`` s ("has been importing X for N s"), or "died" (``dead()``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wanted = None if names is None else set(names)

        def waiting() -> bool:
            return bool(self.queued) if wanted is None else any(n in wanted for n in self.queued)

        while waiting() and not dead() and self.rejected is None:
            now = time.monotonic()
            stuck_at = (now if self.trying is None else self.trying_since) + stuck_after
            if now >= stuck_at:
                return f"has been importing {self.trying} for {now - self.trying_since:.0f} s"
            if deadline is not None and now >= deadline:
                return None
            cond.wait(min(stuck_at, deadline if deadline is not None else stuck_at) - now)
        return "died" if dead() and waiting() else ""

    def on_reply(self, reply: tuple) -> None:
        kind = reply[0]
        if kind == READY:
            self.modules.update(reply[3])
        elif kind == TRYING:
            self.trying, self.trying_since = reply[1], time.monotonic()
        elif kind == GREW:
            name, added, failure = reply[1:4]
            self.modules.update(added)
            self.queued.pop(name, None)
            self.trying = None
            if failure:
                self.failed[name] = failure
            else:
                self.grown.add(name)
        elif kind == REJECTED:
            self.rejected = (reply[1], reply[2])
            self.queued.clear()
            self.trying = None


class TemplateClient:
    """Starts a template process, makes it grow, and asks it for ranks. Thread-safe."""

    def __init__(self, grow: Sequence[str] = (), paths: Sequence[str] = ()) -> None:
        ours, theirs = framing.socketpair()
        self.env_signature = _env_signature()
        self._control = ours
        self.started_at = time.monotonic()
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
        _until_exit(self)
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._ready = False
        self._dead = False
        self._next_id = 0
        self._forked: dict[int, int] = {}
        self._refused: dict[int, str] = {}
        self._exited: dict[int, int] = {}
        self._born: dict[int, frozenset[str]] = {}  # pid -> the modules it was born holding
        self.held = Holdings()
        self._live: set[int] = set()  # ranks forked and not yet exited
        self._in_flight: set[int] = set()  # FORK requests not answered yet: ranks about to live
        self._closed_why = ""  # why this process closed it ("" while it has not)
        self._closing = False  # a thread is closing it
        self._retiring = False
        try:
            framing.send(self._control, pickle.dumps(("start", self.held.to_ask(grow), list(paths))))
        except OSError:
            pass  # it died at once: the reader sees it, and wait_ready() says so
        self._reader = threading.Thread(target=self._read_replies, name="mpify_nb-template-reader", daemon=True)
        self._reader.start()

    @property
    def ready(self) -> bool:
        return self._ready and self.alive()

    @property
    def modules(self) -> Optional[frozenset[str]]:
        """Every module it holds now (its sys.modules), once it is ready."""
        with self._cond:
            return self.held.frozen() if self._ready else None

    @property
    def failed(self) -> dict[str, str]:
        """The modules it was asked to hold whose import failed there, with why."""
        return dict(self.held.failed)

    @property
    def rejected(self) -> Optional[tuple[str, str]]:
        """(module, why) when a module made its forks unsafe: it forks nothing more."""
        return self.held.rejected

    @property
    def trying(self) -> Optional[str]:
        """The module it imports now, if any."""
        return self.held.trying

    def holds(self) -> set[str]:
        """The modules it was asked to hold and holds (besides what every template holds)."""
        with self._cond:
            return set(self.held.grown)

    def lacks(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` it does not hold (yet)."""
        with self._cond:
            return [n for n in names if n not in self.held.modules]

    def born_with(self, pid: int) -> Optional[frozenset[str]]:
        """The modules the rank ``pid`` was born holding (its template's at its fork)."""
        with self._cond:
            return self._born.get(pid)

    # -- growing ---------------------------------------------------------------------------

    def grow(self, names: Iterable[str], paths: Sequence[str] = ()) -> list[str]:
        """Ask it to import ``names`` too, one by one between forks, with ``paths`` (the caller's
        site-packages directories) on its sys.path; return those newly asked."""
        with self._cond:
            if self._retiring or self.held.rejected is not None or self._dead:
                return []
            new = self.held.to_ask(names)
        if new:
            self._tell((GROW, new, list(paths)))
        return new

    def compile(self, files: Sequence[str]) -> None:
        """Have it compile these sources (the notebook's own modules) for its ranks (rank/code_cache.py)."""
        if files and not (self._retiring or self._dead):
            self._tell((COMPILE, list(files)))

    def _tell(self, message: tuple) -> None:
        try:
            with self._send_lock:
                framing.send(self._control, pickle.dumps(message))
        except OSError:
            pass  # it is gone: the reader says so

    @property
    def growing(self) -> bool:
        with self._cond:
            return bool(self.held.queued) and not self._dead

    def wait_grown(self, timeout: Optional[float], stuck_after: float, names: Optional[Iterable[str]] = None) -> bool:
        """Wait until it holds what it was asked to (``names`` of it, or all), or failed on it, or
        was made unusable by it; True if so, False when ``timeout`` ran out first. Raises
        TemplateUnresponsive when one module's import has taken over ``stuck_after`` s (a network
        wait?), TemplateDied when it died."""
        with self._cond:
            waiting = self.held.wait(self._cond, lambda: self._dead, timeout, stuck_after, names)
        if waiting is None:
            return False
        if waiting == "died":
            raise TemplateDied(f"the template process (pid {self.pid}) died ({self.how_it_ended()}) "
                               "while it imported the modules ranks need")
        if waiting:
            raise TemplateUnresponsive(f"the template process (pid {self.pid}) {waiting}")
        return True

    def live_count(self) -> int:
        """Its ranks that live, or are being forked."""
        with self._cond:
            return len(self._alive_ranks()) + len(self._in_flight)

    def _alive_ranks(self) -> list[int]:
        # A rank that exited is gone even before the template reaps it and says so (EXITED): a
        # template in a long import reaps nothing meanwhile.
        return [pid for pid in self._live if _process_state(pid) not in (None, "Z", "X")]

    @property
    def retiring(self) -> bool:
        return self._retiring

    def retire(self, wait: bool = True) -> bool:
        """Fork nothing more, grow nothing more, and stop once the ranks it forked, or is
        forking, are gone (they die with it). True when it had none: it is stopped now
        (``wait=False``: in the background)."""
        with self._cond:
            first = not self._retiring
            self._retiring = True
            self.held.queued.clear()
            idle = not self._alive_ranks() and not self._in_flight
        if first and not idle:
            self._tell((RETIRE,))
            threading.Thread(target=self._close_when_idle, name="mpify_nb-template-retire", daemon=True).start()
        if idle and wait:
            self.close("retired")
        elif idle:
            self._close_later("retired")
        return idle

    def _close_when_idle(self) -> None:
        with self._cond:
            while not self._dead and (self._alive_ranks() or self._in_flight):
                self._cond.wait(0.5)  # an EXITED wakes us; a template that cannot say so, the clock
        self._close_later("retired, after its last rank")

    def abandon(self, why: str) -> None:
        """Kill it now and let go of it in the background: a template that can no longer serve
        and holds no ranks, which may be in the middle of a long import and would not notice a
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
        """Wait until it has started (imported torch). Raises TemplateUnresponsive when it is still
        starting after ``timeout`` s, TemplateDied when it died."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._ready or self._dead, timeout)
        if self._dead:
            raise TemplateDied(f"the template process (pid {self.pid}) died while starting ({self.how_it_ended()})")
        if not ok:
            self._give_up(f"is still starting (it imports torch) {time.monotonic() - self.started_at:.1f} s "
                          "after it was started")

    def fork(self, fds: list[int], timeout: float = 30.0, role: str = "rank") -> int:
        """Fork a rank holding ``fds`` = [channel, stdout, stderr] (a spare: [channel]); return its
        pid. Raises TemplateUnresponsive if it did not fork within ``timeout``, TemplateRetired if
        it forks no more."""
        deadline = time.monotonic() + timeout
        self.wait_ready(timeout)
        with self._cond:
            if self._retiring or self.held.rejected is not None:  # checked where retire() counts what is in flight
                raise TemplateRetired(f"the template process (pid {self.pid}) is retiring: it forks no more ranks")
            request_id = self._next_id
            self._next_id += 1
            self._in_flight.add(request_id)
        try:
            return self._fork(request_id, fds, role, deadline, timeout)
        finally:
            with self._cond:
                self._in_flight.discard(request_id)
                self._cond.notify_all()  # it may have retired meanwhile: _close_when_idle looks again

    def _fork(self, request_id: int, fds: list[int], role: str, deadline: float, timeout: float) -> int:
        started = time.monotonic()
        try:
            with self._send_lock:
                framing.send(self._control, pickle.dumps((FORK, request_id, role)), fds)
        except OSError as e:
            raise TemplateDied(f"the template process (pid {self.pid}) is gone ({self.how_it_ended()}): {e}") from None
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._forked or request_id in self._refused or self._dead,
                                max(0.0, deadline - time.monotonic()))
            if request_id in self._forked:
                return self._forked.pop(request_id)
            if request_id in self._refused:
                raise TemplateRetired(f"the template process (pid {self.pid}) forks no more ranks: "
                                      f"{self._refused.pop(request_id)}")
            if self._dead:
                raise TemplateDied(f"the template process (pid {self.pid}) died ({self.how_it_ended()}) "
                                   "before it could fork a rank")
            trying = self.held.trying
        within = f"did not fork a rank within {time.monotonic() - started:.1f} s"
        self._give_up(within + (f" (it was importing {trying}, which a fork waits for)" if trying else ""))

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
        _open.discard(self)

    def _read_replies(self) -> None:
        try:
            while True:
                message = framing.recv(self._control)
                if message is None:
                    break
                reply = pickle.loads(message[0])
                kind = reply[0]
                with self._cond:
                    self.held.on_reply(reply)
                    if kind == READY:
                        self._ready = True
                    elif kind == FORKED:
                        self._forked[reply[1]] = reply[2]
                        self._exited.pop(reply[2], None)  # an earlier process's, under a pid reused
                        self._born[reply[2]] = self.held.frozen()
                        self._live.add(reply[2])
                    elif kind == REFUSED:
                        self._refused[reply[1]] = reply[2]
                    elif kind == EXITED:
                        self._exited[reply[1]] = reply[2]
                        if len(self._exited) > _EXITS_KEPT:  # codes nobody asked for (a rank that ended well)
                            self._exited.pop(next(iter(self._exited)))
                        self._born.pop(reply[1], None)
                        self._live.discard(reply[1])
                    self._cond.notify_all()
        except (OSError, EOFError):
            pass
        with self._cond:
            self._dead = True
            self._cond.notify_all()
        self._proc.poll()  # reap it if it exited


def _process_state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


