"""Ranks on a Ray cluster: the placer behind ``set_placement("ray")``.

Ray does what a cluster manager does (which nodes, their resources, starting and
killing work there, moving big objects, authentication); everything else is the
one-machine path: the rank runs ``rank.loop.main`` in a process forked on its node,
and the caller's launcher, payload, relay and errors see a rank like any other::

    caller (notebook = Ray driver, rank 0)                  Ray worker on a node (a task)
    --------------------------------------                  -----------------------------
    reserve(): one placement group, a bundle per rank ──>   (all bundles, or none)
      where they landed -> LOCAL_RANK, GROUP_RANK, MASTER_ADDR/PORT
    start(r): a bridge holds rank r's channel end
      launcher sends setup + call to the bridge
      memfds -> one ray.put per call ────── object store ─> ray.get (per node: one transfer); the rank
                                                             maps the object where the node's store
                                                             holds it, copy-on-write (no copy per rank);
                                                             on the caller's machine: its memfds, opened
                                                             through /proc (no transfer, no copy)
      submit _serve_rank in bundle r ─────────────────────> connects back: TCP to the caller, token first
                                                             forks the rank (rank.loop.main, as on one machine)
      channel / stdout / stderr  <══ frames over the link ══ rank's channel, stdout, stderr
    kill(): close the link ─────────────────────────────>  SIGKILL the rank and its process group
             (no answer within 3 s: ray.cancel(force=True))  the task returns; the worker stays warm
    release(): remove the placement group

Why tasks and not actors: an actor is a new worker process for every call, which
imports torch again (7-10 s per call measured here); a task runs on one of Ray's
pooled workers, which keeps torch imported between calls (0.09 s). Nothing of
ours outlives a call: no actor, no placement group, no rank process; the idle
worker belongs to Ray's pool, as after any Ray task.

The link is a TCP connection from the worker to the caller's node address (never
0.0.0.0), on a port open only during the call; the first 32 bytes a connection
sends must be the call's random token, which travels to the worker inside Ray's
own (authenticated) task submission. Nothing is unpickled before that check.

One module per job: ``placer`` (reserve, start, release: the caller's side),
``handle`` (the caller's handle on one rank, bridging its channel to its link),
``worker`` (the Ray task on the node), ``link`` (the frames both sides speak),
``client`` (under Ray Client, the hub actor the links go through).

Importing this package registers ``"ray"`` with start/placement.py (``register_placement``); the
package's ``__init__`` has placement import it the first time ``set_placement("ray")`` is
called, so nothing here is imported before.
"""

from .. import placement
from .client import drop_hub
from .link import interface_of
from .placer import RayOptions, RayPlacer, connect

placement.register_placement("ray", placement.Elsewhere(RayOptions.make, RayPlacer, drop_hub))

__all__ = ["RayOptions", "RayPlacer", "connect", "drop_hub", "interface_of"]
