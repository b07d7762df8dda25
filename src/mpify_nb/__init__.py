"""mpify_nb: run PyTorch code on many processes straight from a Jupyter notebook.

Spawn, execute, terminate: ``ranch(n, fn, *args)`` starts fresh ranks (the notebook
itself is rank 0), runs ``fn`` on every rank, returns the results and leaves
nothing running.

The packages, from the top down (each imports only from those below it; tests/test_layers.py):

==============================  ============================================================
magics/                          %%ranch and the persistent ranks' magics (``%load_ext mpify_nb``)
ddp.py, decorator.py, imports.py in_torchddp, @distributed, import_star
debugger/                        the frontend's debugger panel across a Session's ranks (kernel side)
launcher/, session/              ranch(): one call on short-lived ranks; Session: persistent ranks
engine/                          the one owner of live ranks under both, and the caller's half of
                                 each capability (stdin prompts, widget comms, the stop button)
start/                           where a rank starts: placement, the warm template, Ray
relay/                           the ranks' output, relayed into the cell
rank/                            everything that runs inside a rank process
wire/, torchdist/                the wire format (errors, frames, payload); torch.distributed
==============================  ============================================================

Each package's ``__init__`` says what its modules do.
"""

from __future__ import annotations

import os
import sys

from .torchdist import compat as _compat
from .torchdist import warmup as _warmup

# A torch older than the floor fails here, naming both versions (read without importing torch).
_compat.check_floor()

# The template (below) first, before the rest of this package loads: it imports torch meanwhile, on
# another core, and a fresh process's first call, which waits for it, comes ~60 ms sooner.
if os.environ.get("MPIFY_NB_CHILD") != "1" and _warmup.prewarm_setting() != _warmup.PREWARM_OFF:
    from .start.placement import get_start_method as _start_method

    if _start_method() == "template":
        from .start.template import prewarm as _prewarm

        _prewarm()

from .ddp import TorchDDPCtx, in_torchddp
from .decorator import distributed
from .engine.background import BackgroundWork, RanksBusyError
from .engine.checked import set_collective_checks
from .imports import import_star
from .launcher.ranch import ranch
from .session.session import RankStatus, Session
from .start import placement, template
from .start.placement import get_placement, get_start_method, set_placement, set_start_method
from .start.spares import set_spare_ranks
from .start.template import set_preload
from .wire import errors
from .wire.errors import PayloadError, RankError, RankExitedError, RankRaisedError
from .wire.modules import set_rank_imports

__version__ = "0.1.0"

__all__ = [
    "ranch",
    "Session",
    "RankStatus",
    "BackgroundWork",
    "in_torchddp",
    "TorchDDPCtx",
    "distributed",
    "import_star",
    "RankError",
    "RankRaisedError",
    "RankExitedError",
    "PayloadError",
    "RanksBusyError",
    "set_start_method",
    "get_start_method",
    "set_placement",
    "get_placement",
    "placement",
    "set_preload",
    "set_spare_ranks",
    "set_rank_imports",
    "set_collective_checks",
]


# Modules that moved into packages, still importable by their documented names
# (``import mpify_nb.template``; ``from mpify_nb.errors import CollectiveError``).
sys.modules.setdefault(f"{__name__}.errors", errors)
sys.modules.setdefault(f"{__name__}.placement", placement)
sys.modules.setdefault(f"{__name__}.template", template)


def _load_ray() -> None:
    from .start import ray_ranks  # noqa: F401  (registers the "ray" placement with start/placement.py)


placement.provide_placement("ray", _load_ray)  # ray_ranks/ is imported the first time it is asked for


def load_ipython_extension(ipython) -> None:
    """``%load_ext mpify_nb``: register the magics (%%ranch, and the persistent ranks' %dist_init ...)."""
    from .magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext mpify_nb``: stop the persistent ranks and automatic mode."""
    from .magics import unload_ipython_extension as unload

    unload(ipython)


if os.environ.get("MPIFY_NB_CHILD") != "1":
    from .engine.interrupts import install as _install_sigint

    _install_sigint()  # the stop button reaches calls on other threads too (engine/interrupts.py)
    if "ipykernel" in sys.modules:  # in a Jupyter kernel: its debugger panel reaches persistent ranks too
        from .debugger.kernel import install as _install_debugger

        _install_debugger()

# Start the template now, in the background, so the first call does not pay for
# importing torch; then what this process's first DDP needs. Not in our own children
# (ranks and the template itself).
def _after_warmup(names: list) -> None:
    """The warm-up imported ``names`` (on its thread): what the first call would do next, done now."""
    from .start.template import grow_now, wanted_now
    from .wire.modules import leave_out_ours
    from .wire.ship import index_modules

    leave_out_ours(names)  # not the notebook's own imports: no rank imports them for it
    grow_now(_warmup.DDP_LAZY_IMPORTS)  # the template too: a spawned rank's first DDP is as warm
    index_modules()  # what each global of theirs is (objects held by modules travel by name)
    wanted_now()  # which of the notebook's modules the ranks import first, and where each lives


def _warm_when_idle() -> None:
    """In an IPython shell (a Jupyter kernel): once the cell that imported us has finished, while
    the user writes the next one (no cell runs), import what this process's first DDP needs. Not in
    a script: it has no idle time, and its calls would wait for the warm-up's imports."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return

    def once(*_args) -> None:
        shell.events.unregister("post_run_cell", once)
        _warmup.start(after=_wait_started)

    shell.events.register("pre_run_cell", _warmup.cell_started)
    shell.events.register("post_run_cell", _warmup.cell_ended)
    shell.events.register("post_run_cell", once)


# The template was started at the top, in the background, so the first call does not pay for
# importing torch; in a kernel, between cells, what this process's first DDP needs.
# Not in our own children (ranks and the template itself).
if get_start_method() == "template" and _warmup.enabled():
    from .start.template import wait_started as _wait_started

    _warmup.when_imported(_after_warmup)
    _warm_when_idle()
