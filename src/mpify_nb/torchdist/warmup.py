"""The notebook's first DDP call as fast as its later ones: what ``DistributedDataParallel(...)``
imports the first time in a process, imported ahead of it, in the background, between cells.

The first ``DistributedDataParallel(model)`` of a process reads ``torch._dynamo`` (to ask how to
optimize DDP), and importing it costs 1.5-5 s and ~70 MB (sympy, the compiler stack); the
later ones cost milliseconds. When the notebook plays rank 0, its first DDP call pays it. So in a
kernel, while no cell runs (the user writes the next one), and only where the notebook imported
torch (a notebook that only drives ranks keeps its memory), a daemon thread imports it, and asks
the template to hold it too (a spawned rank's first DDP is as warm)::

    import mpify_nb (in a kernel) ── post_run_cell, once ──> start(after=the template started)
        pre_run_cell / post_run_cell, each cell ──> cell_started() / cell_ended()
        thread: wait for the template; torch imported here? before each piece of work, wait until
        no cell has run for IDLE_BEFORE_WORK (a cell that calls wait() lets it go on); take the import lock while no
        other thread is inside an import; import torch._dynamo; release; a first training step
        of a private model, the lock held the same way (a CPU-only torch); then the hooks
        (mpify_nb/__init__.py: the template grows it, the ranks' preamble leaves it out)

The step: a process's first forward, backward and optimizer step pay once what the later ones do
not (the dispatcher's first look-ups of each op, autograd's engine, the optimizer's first step and
the dynamo-disabled wrappers it goes through): the first DDP call's own steps paid ~5 ms of it.
What only the calling thread can pay (its OpenMP team, its thread-local state), the first call
still does: ~1.1-1.3x its later ones on 2 CPU cores.

A script has no time between its calls: nothing is warmed there (a call would wait for it). Nor
do cells run one after another (Run All) wait for it: it never competes with a running cell for the
CPU, the import lock or a fork; the first DDP of such a run imports what it needs itself, as it
would without the warm-up. Work under way (one import, seconds) is not stopped by a cell that starts.

Safe where it runs:

* it holds the interpreter's import lock for its whole import, taken only while no other thread
  is inside one: no import of another thread interleaves with it (two threads importing one
  import cycle at once can hand one of them a half-made module), a new import elsewhere waits
  for its end (once, seconds), and so does a fork, at its first step (a fork handler of ours, run
  before logging's and the relay's take locks the import needs): a DataLoader worker forked in
  the notebook never copies a half-made module, and never deadlocks the notebook;
* it creates no CUDA context (``torch.cuda.is_initialized()`` stays False): importing
  ``torch._dynamo`` asks at most ``torch.cuda.is_available()``, which makes none; the step runs
  only where torch is built for the CPU alone (on a CUDA build autograd's first backward asks the
  CUDA driver for its devices), on tensors of its own, drawing no random number (the notebook's
  random streams are untouched);
* ``MPIFY_NB_PREWARM=template`` turns it off and keeps the template's start at import (a machine
  whose idle CPU is shared: a kernel and its template each pay 1-2 CPU-s for ``torch._dynamo``);
  ``MPIFY_NB_PREWARM=0`` turns off both.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Callable, Optional

try:
    import _imp
except ImportError:  # not CPython: no import lock to take
    _imp = None  # type: ignore[assignment]

#: What DistributedDataParallel imports the first time it is made in a process, then at its first
#: forward (its ``record_function`` looks once for torch's optional CUPTI monitor: ~1.3 ms).
DDP_LAZY_IMPORTS = ("torch._dynamo", "torch.profiler._cupti_monitor")

_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_hooks: list[Callable[[list[str]], None]] = []
_done = threading.Event()
#: What happened: "" (not run, or running), "imported", "skipped: why", "failed: why".
outcome = ""


#: A process of ours (the template, a rank), which imported this module with MPIFY_NB_CHILD set:
#: a rank's environment becomes the notebook's later, so it is read once, now.
_IN_CHILD = os.environ.get("MPIFY_NB_CHILD") == "1"


#: MPIFY_NB_PREWARM's values: what ``import mpify_nb`` starts ahead of the first call.
PREWARM_ALL = "1"  # the template, and in a kernel the first DDP's imports between cells (the default)
PREWARM_TEMPLATE = "template"  # the template only
PREWARM_OFF = "0"  # nothing: the first call starts the template
PREWARM_VALUES = (PREWARM_ALL, PREWARM_TEMPLATE, PREWARM_OFF)
_warned_of: set = set()


def prewarm_setting() -> str:
    """MPIFY_NB_PREWARM, read now; a value it cannot be is named in a warning (once) and taken as
    the default."""
    value = os.environ.get("MPIFY_NB_PREWARM", PREWARM_ALL).strip().lower() or PREWARM_ALL
    if value in PREWARM_VALUES:
        return value
    if value not in _warned_of:
        _warned_of.add(value)
        warnings.warn(f"MPIFY_NB_PREWARM={value!r} is none of {', '.join(map(repr, PREWARM_VALUES))}: "
                      f"taken as {PREWARM_ALL!r} (the default)", stacklevel=2)
    return PREWARM_ALL


def enabled() -> bool:
    """Does this process warm up between cells (MPIFY_NB_PREWARM=1, the default)?"""
    return not _IN_CHILD and prewarm_setting() == PREWARM_ALL


def start(after: Optional[Callable[[], object]] = None, modules: Sequence[str] = DDP_LAZY_IMPORTS,
          need_torch: bool = True, step: Optional[bool] = None) -> None:
    """Import ``modules`` on a daemon thread, once per process, after ``after()`` returns (the
    template's start); with ``need_torch``, only if the notebook has imported torch by then;
    with ``step`` (default: for the first DDP's modules), then take a first training step of a
    private model (a CPU-only torch)."""
    if step is None:
        step = tuple(modules) == DDP_LAZY_IMPORTS
    global _thread
    if not enabled():
        return
    with _lock:
        if _thread is not None:
            return
        _thread = threading.Thread(target=_run, args=(after, tuple(modules), need_torch, step),
                                   name="mpify_nb-warm-ddp", daemon=True)
        _thread.start()


def when_imported(hook: Callable[[list[str]], None]) -> None:
    """Call ``hook(names)`` with every module the warm-up imported, once it has (on its thread)."""
    if hook not in _hooks:
        _hooks.append(hook)


def wait(timeout: Optional[float] = None) -> bool:
    """Wait until the warm-up has ended (done, skipped or failed); True if it has. A cell waiting
    here lets it work though the cell runs."""
    global _waiters
    with _cells:
        _waiters += 1
        _cells.notify_all()
    try:
        return _done.wait(timeout)
    finally:
        with _cells:
            _waiters -= 1


#: How long no cell must have run before the warm-up takes its next piece of work (a module's
#: import, the first step): cells run one after another (Run All) leave milliseconds between them.
IDLE_BEFORE_WORK = 1.0
_cells = threading.Condition()
_cells_running = 0
_idle_since = time.monotonic()
_waiters = 0  # threads in wait(): the warm-up goes on while they wait, cell or not


def cell_started(*_info: object) -> None:
    """A cell starts (IPython's ``pre_run_cell``): no new work until it has ended."""
    global _cells_running
    with _cells:
        _cells_running += 1


def cell_ended(*_result: object) -> None:
    """A cell ended (``post_run_cell``; IPython sends one for an empty cell too, without its start)."""
    global _cells_running, _idle_since
    with _cells:
        _cells_running = max(0, _cells_running - 1)
        _idle_since = time.monotonic()
        _cells.notify_all()


def _wait_until_idle() -> None:
    with _cells:
        while not _waiters:
            if _cells_running:
                _cells.wait()
                continue
            left = _idle_since + IDLE_BEFORE_WORK - time.monotonic()
            if left <= 0:
                return
            _cells.wait(left)


def _run(after: Optional[Callable[[], object]], modules: tuple[str, ...], need_torch: bool, step: bool) -> None:
    global outcome
    try:
        if after is not None:
            after()
        missing = [m for m in modules if m not in sys.modules]
        if need_torch and "torch" not in sys.modules:
            outcome = "skipped: the notebook has not imported torch"
        elif not missing:
            outcome = "skipped: already imported"
        else:
            added: list[str] = []
            for name in missing:
                _wait_until_idle()
                try:
                    added += import_alone(name)
                except ModuleNotFoundError:
                    continue  # not in this torch: its first DDP does not import it either
            if step and "torch" in sys.modules and _cpu_only_torch():
                _wait_until_idle()
                try:
                    added += alone(_first_step)
                except Exception:
                    pass  # only its speed-up is lost: the imports stand
            _wait_until_idle()  # the hooks make the template import it too: a fork there waits for it
            for hook in list(_hooks):
                hook(added)
            outcome = "imported"
        if "torch.distributed" in sys.modules:
            from .checks import wrappers

            wrappers.look_for_bound_names()  # the first call's check then looks only at what came since
    except BaseException as e:  # only a speed-up is lost; the first DDP call imports it itself
        outcome = f"failed: {type(e).__name__}: {e}"
    finally:
        _done.set()


def import_alone(name: str, patience: float = 600.0) -> list[str]:
    """Import ``name`` holding the import lock (:func:`alone`); the modules that import added."""
    return alone(lambda: importlib.import_module(name), patience)


def alone(work: Callable[[], object], patience: float = 600.0) -> list[str]:
    """Run ``work()`` holding the import lock, taken once no other thread is inside an import;
    the modules it imported. They are counted while the lock is held: what another thread
    imported while this one waited for it (the user's next cell importing fastai, say) is the
    notebook's, not ours, and its ranks must import it."""
    if _imp is None:
        before = set(sys.modules)
        work()
        return [n for n in list(sys.modules) if n not in before]
    _gate_forks()
    deadline = time.monotonic() + patience
    while True:
        _fork_gate.acquire()
        _imp.acquire_lock()
        if not _another_thread_imports():
            break
        _imp.release_lock()
        _fork_gate.release()
        if time.monotonic() > deadline:
            raise TimeoutError(f"other threads kept importing for {patience:.0f} s")
        time.sleep(0.05)
    try:
        before = set(sys.modules)
        work()
        return [n for n in list(sys.modules) if n not in before]
    finally:
        _imp.release_lock()
        _fork_gate.release()


def _cpu_only_torch() -> bool:
    """Is torch built for the CPU alone (no CUDA, ROCm, XPU or MPS for autograd to ask about)?"""
    torch = sys.modules["torch"]
    return (torch.version.cuda is None and getattr(torch.version, "hip", None) is None
            and not getattr(torch._C, "_has_xpu", False) and not torch.backends.mps.is_built())


def _first_step() -> None:
    """A training step of a private 4-4-1 perceptron on the CPU, drawing no random number."""
    import torch

    layers = [torch.nn.utils.skip_init(torch.nn.Linear, 4, k) for k in (4, 1)]  # no init: no random draw
    model = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1])
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _another_thread_imports() -> bool:
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
                return True
            frame = frame.f_back
    return False


# A fork waits for the work of ``alone`` to end: ``os.fork`` takes the import lock, but only after
# every ``before`` fork handler has run, and those take locks the work needs. logging's takes its
# module lock (``logging.getLogger`` in every module torch._dynamo imports), the relay's the cell's
# streams (relay/pipes.py): a fork in the middle of the work held them while it waited for the import
# lock, and the work waited for them: the notebook hung for good (a DataLoader with workers, in the
# first cell after ``import torch``). Handlers run in the reverse of their registration, so ours is
# registered at each ``alone`` (a few per process), after every handler there is by then: it runs
# first, waits for the work to end and keeps new work from starting until the child exists; the
# others then take locks nobody inside an import holds. (Its earlier registrations just take the
# re-entrant gate again.)
_fork_gate = threading.RLock()  # re-entrant: a fork from inside the work itself passes


def _gate_forks() -> None:
    import logging  # noqa: F401  (its handler must be registered before ours, so it runs after)

    os.register_at_fork(before=_close_fork_gate, after_in_parent=_open_fork_gate, after_in_child=_new_fork_gate)


def _close_fork_gate() -> None:
    _fork_gate.acquire()


def _open_fork_gate() -> None:
    _fork_gate.release()


def _new_fork_gate() -> None:
    global _fork_gate
    _fork_gate = threading.RLock()  # the child has no warm-up thread: nothing to wait for
