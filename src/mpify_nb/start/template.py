"""The template: a warm, never-used process that ranks are forked from, and what it holds.

A fresh interpreter that imports torch costs ~1.6 s; a fork of one that already
did costs ~15 ms. The template is that already-warm interpreter. It is started
with spawn semantics (a new ``python``), imports torch and this library, and then
does nothing but fork ranks on request and, between two forks, import the modules
its ranks need. It never touches CUDA, never runs user code and never starts threads,
so a fork of it is as clean as a spawn: the notebook may have initialized CUDA, and
nothing of one call leaks into the next.

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

It grows in place (what: start/preload.py; ``set_preload`` here chooses it). Every module a
rank would import before its call (the notebook's installed ones: wire/modules.py) and every
one earlier calls' ranks imported is asked of it (GROW), and it imports them one at a time,
between forks, so a fork never lands in an import::

    call starts: ready_for_call() ── GROW (what is wanted and it lacks) ──> template imports them
                 waits until it holds them (the ranks would import them anyway; the template
                 does it once for all of them), then forks: a rank imports only what is left
    during the call: a rank's IMPORTED news (every ~0.1 s) ── learn() ── GROW ──> template
                 imports them beside the call, so the next call finds them held
    a module that initializes CUDA, starts a thread or a process at import: the template
                 forks no more (REJECTED) and ends with its last rank; the module is
                 remembered and left out, and a new template takes over

The result of a call never depends on what the template held: a rank imports, before
its call, whatever of the notebook's modules it was not born with (``born_with``).

The template is made, and judged, with the notebook's own environment: while a call plays a
rank in this process, ``os.environ`` holds that rank's variables (``OMP_NUM_THREADS=1``,
``RANK``...), and a template made from them would be replaced at the next call
(``set_caller_environ``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

from . import preload
from .environ import _env_signature
from .template_client import TemplateClient, TemplateDied, TemplateUnresponsive  # noqa: F401  (the names users import from here)

_lock = threading.Lock()
_client: Optional[TemplateClient] = None
_on_replaced: list[Callable[[TemplateClient], None]] = []  # told when a template stops serving (spare ranks)

#: Seconds a template may take to start (it imports torch): no call's timeout counts them.
START_PATIENCE = 120.0
#: Seconds one module's import in the template may take before the template is given up (a
#: module that waits on the network?): it is then left out, and a new template takes over.
STEP_PATIENCE = 60.0


def get_template() -> TemplateClient:
    """The current template, started (or restarted) as needed."""
    global _client
    with _lock:
        old = _client
        if old is not None and (not old.alive() or old.retiring or old.rejected is not None
                                or old.env_signature != _env_signature()):
            if old.rejected is not None:
                preload.mark_failed(*old.rejected)
            _client = None
            if old.alive():
                old.retire(wait=False)  # a Session's ranks live on in it: it ends when they do
            else:
                old.close("it had died")
        if _client is None:
            _client = TemplateClient(first_wanted(), preload.site_paths())
        client = _client
    if old is not None and old is not client:
        for hook in list(_on_replaced):
            hook(old)
    return client


def first_wanted() -> list[str]:
    """What a new template imports right after torch: the named modules."""
    return preload.named() if preload.enabled() else []


def on_replaced(hook: Callable[[TemplateClient], None]) -> None:
    """Call ``hook(old)`` whenever a template stops serving (replaced, retired, shut down)."""
    if hook not in _on_replaced:
        _on_replaced.append(hook)


def ready_for_call() -> tuple[TemplateClient, float]:
    """The template to fork a call's ranks from, holding what they need, and the seconds spent
    waiting for it: for it to start (it imports torch: a fresh kernel's first call, or after a
    variable read at import time changed) and to import what the ranks need (the notebook's
    libraries, what earlier calls' ranks imported). No call's timeout counts them: it is the
    template's one-time preparation, not the call's work, and each part has its own limit
    (START_PATIENCE for the start, STEP_PATIENCE for each module). Raises TemplateUnresponsive
    when it does not start."""
    t0 = time.monotonic()
    for _ in range(_TRIES):
        client = get_template()
        client.wait_ready(START_PATIENCE)
        if not preload.enabled():
            return client, time.monotonic() - t0
        _settle_learning()
        wanted = first_wanted() + wanted_now()
        client.grow(wanted, preload.site_paths())
        client.compile(preload.own_sources(_cwd()))  # the notebook's own modules: compiled, not imported
        try:
            client.wait_grown(None, STEP_PATIENCE, wanted)
        except TemplateUnresponsive:  # stuck in one import: leave that module out, start over
            stuck = client.trying
            if stuck is not None:
                preload.mark_failed(stuck, f"its import took over {STEP_PATIENCE:.0f} s in the template")
            _replace(client)
            continue
        except TemplateDied:
            continue  # get_template() starts a new one
        _remember_failures(client)
        if client.rejected is None:
            return client, time.monotonic() - t0
    return get_template(), time.monotonic() - t0  # one that forks: its ranks import what it lacks


#: Templates a call tries before it forks from one that lacks what it wanted.
_TRIES = 3


def wanted_now() -> list[str]:
    """What the template should hold for the next call: the named and learned modules
    (start/preload.py), and the installed ones a rank imports before its call (wire/modules.py)."""
    cwd = _cwd()
    return preload.wanted(cwd) + preload.installed_for_call(cwd)


def _cwd() -> Optional[str]:
    try:
        return os.getcwd()
    except OSError:
        return None


def _replace(client: TemplateClient) -> None:
    global _client
    with _lock:
        if _client is not client:
            return
        _client = None
    client.retire(wait=False)
    for hook in list(_on_replaced):
        hook(client)


def _remember_failures(client: TemplateClient) -> None:
    for name, why in client.failed.items():
        preload.mark_failed(name, why)


def grow_now(names: Sequence[str]) -> None:
    """Ask the current template to hold ``names`` too (the notebook's warm-up: what the first DDP
    imports), in the background, as if ranks had imported them; never waits, starts none."""
    if not preload.enabled():
        return
    failed = preload.failed()
    preload.learn([(n, getattr(sys.modules.get(n), "__file__", None)) for n in names if n not in failed])
    refresh()


def refresh(cwd: Optional[str] = None) -> None:
    """Ask the current template to hold every module the ranks are known to need (see
    start/preload.py), in the background; never waits for it. Starts no template."""
    if not preload.enabled():
        return
    client = _client
    if client is not None and client.alive():
        client.grow(preload.wanted(cwd), preload.site_paths())
        # The notebook's own modules too: compiled before the first call's fork, not at it (~10 ms there).
        client.compile(preload.own_sources(cwd if cwd is not None else _cwd()))


_busy = 0  # background work under way that may make the template grow (wait_preloaded waits for it)
_busy_done = threading.Condition(_lock)


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
                _busy_done.notify_all()

    with _lock:
        _busy += 1
    threading.Thread(target=run, name="mpify_nb-preload", daemon=True).start()


def _settle_learning(timeout: float = 5.0) -> None:
    """Let what the last call's ranks reported reach preload's memory before the next call asks."""
    with _lock:
        _busy_done.wait_for(lambda: not _busy, timeout)


def learn(imported: list) -> None:
    """A rank imported these modules ((name, file) pairs, start/preload.py): let the template come to
    hold them, in the background, for the next calls (this never makes a call wait)."""
    if not preload.enabled() or not imported:
        return
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


def wait_preloaded(timeout: Optional[float] = None) -> bool:
    """Wait until the template holds what it was asked to hold (or failed on it); True if so."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        if not _busy_done.wait_for(lambda: not _busy, timeout):
            return False
    client = _client
    if client is None or not client.alive():
        return True
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        done = client.wait_grown(left, STEP_PATIENCE if left is None else max(left, STEP_PATIENCE))
    except TemplateDied:
        return True  # nothing is on its way any more
    _remember_failures(client)
    return done


def drop_preloaded() -> None:
    """Preloading was turned off: retire a template that holds more than torch."""
    client = _client
    if client is not None and (client.holds() or client.growing):
        _replace(client)


def set_preload(modules: Union[bool, Sequence[str]] = True) -> None:
    """Choose what the template that ranks are forked from holds, besides torch and numpy.

    ``True`` (the default): the template comes to hold the installed modules the ranks import:
    those the notebook imported (every rank imports them before its call) and those ranks
    imported in earlier calls. It imports them itself, between two calls' forks, so from the
    second call on no rank imports them again. A list of module names: those too, from now on.
    ``False``: nothing more than torch and numpy (ranks import the rest on every call);
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


def wait_started(timeout: float = START_PATIENCE) -> bool:
    """Wait until the current template (if any: none is started) has started; True if it has."""
    client = _client
    if client is None:
        return False
    try:
        client.wait_ready(timeout)
    except TemplateDied:
        return False
    return True


def current_pid() -> Optional[int]:
    """The pid of the running template, if any (without starting one)."""
    client = _client
    return client.pid if client is not None and client.alive() else None


def shutdown() -> bool:
    """Stop the template to free its memory (about 220 MB); the next call starts a new one.

    Ranks forked from it die with it, so while some live (an open Session's, a call running on
    another thread) it is not stopped: it ends once they have exited, and a RuntimeWarning says
    so. Returns True when it is gone now."""
    global _client
    with _lock:
        client, _client = _client, None
    if client is None:
        return True
    for hook in list(_on_replaced):
        hook(client)  # its spare ranks go first: they are no one's ranks
    if client.retire():
        return True
    import warnings

    warnings.warn(f"mpify_nb.template.shutdown(): the template (pid {client.pid}) still has {client.live_count()} "
                  "live ranks (an open Session's, or a call's): it ends when they do, so close the Session to "
                  "free its memory", RuntimeWarning, stacklevel=2)
    return False
