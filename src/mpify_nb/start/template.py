"""The template: a warm, never-used process that ranks are forked from.

A fresh interpreter that imports torch costs ~1.6 s; a fork of one that already
did costs ~15 ms. The template is that already-warm interpreter. It is started
with spawn semantics (a new ``python``), imports torch and this library, and then
does nothing but fork ranks on request. It never touches CUDA, never runs user
code and never starts threads, so a fork of it is as clean as a spawn: the
notebook may have initialized CUDA, and nothing of one call leaks into the next.

The caller's handle on one template process is start/template_client.py's ``TemplateClient``;
this module keeps the current one (and a candidate preloading beside it)::

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
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

from . import preload
from .environ import _env_signature
from .template_client import TemplateClient, TemplateDied, TemplateUnresponsive  # noqa: F401  (the names users import from here)

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


def learn(imported: list) -> None:
    """A call's ranks imported these modules (start/preload.py): let the template come to hold
    them, in the background, for the next calls (the call has returned, and this never makes it wait)."""
    try:
        cwd = os.getcwd()
    except OSError:
        return
    in_background(_learn, imported, cwd)


def _learn(imported: list, cwd: str) -> None:
    try:
        preload.learn(imported, cwd)
        refresh(cwd)
    except Exception:
        pass  # only a speed-up is lost


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


