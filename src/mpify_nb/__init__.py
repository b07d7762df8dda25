"""mpify_nb: run PyTorch code on many processes straight from a Jupyter notebook.

Spawn, execute, terminate: ``ranch(n, fn, *args)`` starts fresh ranks (the notebook
itself is rank 0), runs ``fn`` on every rank, returns the results and leaves
nothing running.

Where things happen, by module (each imports only modules of its own layer or lower ones,
never round: tests/test_layers.py):

================  ===============================================================
magics/           %%ranch, the session magics (``%load_ext mpify_nb``)
ddp.py            in_torchddp / TorchDDPCtx
launcher.py       ranch(): one request to short-lived ranks; the first failure wins
session.py        Session: persistent ranks across calls (its rooms: session_calls.py,
                  session_recovery.py, session_ranks.py)
engine.py         the engine under both: a set of live ranks and their one event loop
own_rank.py       the caller's own rank in a ranch call, and what it changes here
placement.py      where a rank starts (the seam): template fork, fresh spawn, or a placement
                  registered with it (ray_ranks/ registers "ray"; this module tells placement
                  how to import it when first asked)
template.py       the warm process ranks are forked from; set_preload (the process itself:
                  template_process.py)
rank.py           what a rank does from birth to exit: every rank's one request loop
protocol.py       the frames between a caller and its ranks
rank_control.py   a rank's control thread (stdin, interrupts, the caller's death)
session_rank.py   a Session rank's requests; rank_group.py its process group
preload.py        what the template comes to hold: the modules ranks need
payload.py        packing the call and the results (dill, shared-memory tensors)
shm.py            the shared memory they travel in (memfds)
relay.py          where ranks' output is relayed into the cell: the pipes, read live
                  (what a rank's bytes become there: relay_output.py; lines: relay_lines.py)
groups.py         torch.distributed groups: GPU ids, the store's socket, the group count
process.py        what each of our processes does for itself: name, orphans, exit
errors.py         where errors come back: RankError and the remote traceback
interrupts.py     the stop button for calls on threads other than the main one
================  ===============================================================
"""

from __future__ import annotations

import os

from . import placement
from .ddp import TorchDDPCtx, in_torchddp
from .decorator import distributed
from .errors import PayloadError, RankError, RankExitedError, RankRaisedError
from .imports import import_star
from .launcher import ranch
from .placement import get_placement, get_start_method, set_placement, set_start_method
from .session import RankStatus, Session
from .template import set_preload

__version__ = "0.1.0"

__all__ = [
    "ranch",
    "Session",
    "RankStatus",
    "in_torchddp",
    "TorchDDPCtx",
    "distributed",
    "import_star",
    "RankError",
    "RankRaisedError",
    "RankExitedError",
    "PayloadError",
    "set_start_method",
    "get_start_method",
    "set_placement",
    "get_placement",
    "placement",
    "set_preload",
]


def _load_ray() -> None:
    from . import ray_ranks  # noqa: F401  (registers the "ray" placement with placement.py)


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
    from .interrupts import install as _install_sigint

    _install_sigint()  # the stop button reaches calls on other threads too (interrupts.py)

# Start the template now, in the background, so the first call does not pay for
# importing torch. Not in our own children (ranks and the template itself).
if os.environ.get("MPIFY_NB_CHILD") != "1" and get_start_method() == "template" \
        and os.environ.get("MPIFY_NB_PREWARM", "1") != "0":
    from .template import prewarm as _prewarm

    _prewarm()
