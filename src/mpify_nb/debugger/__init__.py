"""The frontend's visual debugger (JupyterLab's and VS Code's panel) across persistent ranks.

The kernel keeps its own debugger (ipykernel's, with its debugpy) for the ``kernel`` thread; the
ranks' debuggers (rank/debugger.py: pydevd on a socketpair in each rank) are added to it, so the
frontend sees one debugger whose threads are ``rank 0 / MainThread``, ``rank 1 / MainThread`` and
``kernel / MainThread``::

    frontend ── debug_request (control) ──> ipykernel ── Hub.handle (hub.py) ──> kernel's own debugger
             <── debug_reply / debug_event ──          └─ links.RankLink ── DEBUG frames ──> rank k

``ids`` (a rank's thread, frame and variable ids renumbered into one space), ``links`` (the
kernel's line to one rank's debugger: requests, answers with a time limit), ``threads`` (which
threads are stopped, and the events that say so), ``ranks`` (the Sessions' ranks attached, the
frontend's setup replayed, detached, gone; their events), ``hub`` (every request routed, answered,
merged) and ``kernel`` (installing the hub into the running ipykernel).

It may import ``session/`` (the ranks it debugs are Sessions'), the engine and what lies below.
"""
