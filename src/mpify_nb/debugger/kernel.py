"""The hub put into the running ipykernel: its debug requests and its debugger's events go through it.

::

    ipykernel control thread: debug_request ──> kernel.do_debug_request = Hub.handle
    ipykernel's Debugger (its debugpy): events ──> Debugger.event_callback = Hub.kernel_event
                                                   ──> the kernel's own publishing (IOPub)
    every engine made from now on (engine.add_capability): Hub.install_engine; a Session's
    ranks are then the hub's to debug

Done once per kernel, at ``import mpify_nb`` in a kernel and at ``%load_ext mpify_nb``; nothing
happens in plain Python, in ranks, or where ipykernel has no debugger (no debugpy).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..engine import capabilities, comms
from .hub import Hub

_ATTRIBUTE = "_mpify_nb_debug_hub"


def install(kernel: Any = None) -> Optional[Hub]:
    """The hub of ``kernel`` (default: the running ipykernel), put in place on first use; None
    where there is no kernel or it has no debugger."""
    kernel = kernel if kernel is not None else comms.kernel()
    debugger = getattr(kernel, "debugger", None) if kernel is not None else None
    if kernel is None or debugger is None or not hasattr(debugger, "process_request"):
        return None
    hub = getattr(kernel, _ATTRIBUTE, None)
    if hub is not None:
        return hub
    hub = Hub(debugger, debugger.event_callback)
    setattr(kernel, _ATTRIBUTE, hub)
    kernel.do_debug_request = hub.handle
    debugger.event_callback = hub.kernel_event
    # The kernel's own stack (a --to both cell) shows the cell's frames, not the magics' (ipykernel
    # turns these paths into its debugpy's "not my code" rules when the frontend attaches).
    modules = getattr(debugger, "kernel_modules", None)
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "**")
    if isinstance(modules, list) and package not in modules:
        modules.append(package)
    capabilities.add_capability(hub.install_engine)
    from ..session.session import _sessions  # Sessions made before: theirs too

    for session in list(_sessions):
        if not session.closed:
            hub.install_engine(session._engine)
    return hub


def hub() -> Optional[Hub]:
    """The running kernel's hub, if installed."""
    kernel = comms.kernel()
    return getattr(kernel, _ATTRIBUTE, None) if kernel is not None else None
