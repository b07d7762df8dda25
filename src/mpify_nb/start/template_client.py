"""The caller's handle on one template process (start/template.py keeps the current one):
start it, ask it for ranks, hear their exits, retire it, close it.

::

    caller (TemplateClient)                  template (template_process.serve)
      | -- ("preload", names, paths) -------->| import one by one ("trying" name ... READY)
      | -- FORK id + fds [channel, out, err] -->| os.fork() a rank
      |<------------------- FORKED id, pid -----|
      |<---------------- EXITED pid, status ----|
      | -- HAS id, names ---------------------->| (which of them it holds)
      |  (control socket closes: caller died)   | SIGKILL every rank it forked, exit
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
from collections.abc import Sequence
from typing import NoReturn, Optional

from ..wire import framing
from .environ import _env_signature, bootstrap_env, own_process_group
from .template_process import EXITED, FORK, FORKED, HAS, READY


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
        _until_exit(self)
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
        _open.discard(self)

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



def _process_state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


