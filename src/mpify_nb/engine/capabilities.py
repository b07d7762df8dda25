"""Capabilities: what an engine does with frames it does not know itself, and when.

A capability (widgets' comms, the debugger, stdin prompts) claims frame kinds (protocol.claim)
and has ``install(engine)`` run on every engine made from then on (add_capability), ranch's and a
Session's. There it registers, on the engine::

    on(kind, handler)        handler(member, req, body, fds) for each frame of ``kind`` from a rank
    before_call(hook)        hook(engine, members) on the owner's thread before a call's requests go
    after_call(hook)         hook(engine, members) on the owner's thread once the call is over
    when_gone(hook)          hook(engine, member) once, when a rank died or was buried

Its rank side registers with rank/control.py's ``on`` and sends with ``to_caller``.
"""

from __future__ import annotations

from typing import Any, Callable

#: handler(member, request id, body, fds) for one kind of frame from a rank; it owns ``fds``.
Handler = Callable[[Any, int, Any, list], None]
#: install(engine): a capability registers on a new engine (core.py's Engine; typed Any here,
#: which core.py imports).
Install = Callable[[Any], None]
#: hook(engine, members): before a call, after it.
CallHook = Callable[[Any, list], None]

#: What every new engine runs first: capabilities that handle frames of their own (add_capability).
_capabilities: list[Install] = []


def add_capability(install: Install) -> None:
    """Have ``install(engine)`` run on every engine made from now on, ranch's and a Session's:
    it registers the capability's frame handlers there (``engine.on(kind, handler)``).

    Example (a capability's module; its rank side registers with rank_control.on)::

        COMM_MSG = protocol.claim(b"u", "comms")
        capabilities.add_capability(lambda e: e.on(COMM_MSG, lambda m, req, body, fds: show(m.rank, body)))
    """
    if install not in _capabilities:
        _capabilities.append(install)


def remove_capability(install: Install) -> None:
    """Engines made from now on go without it."""
    if install in _capabilities:
        _capabilities.remove(install)


class Capabilities:
    """An engine's registrations: frame handlers by kind, and the hooks around its calls."""

    def __init__(self) -> None:
        self.handlers: dict[bytes, Handler] = {}
        self._call_hooks: list[CallHook] = []
        self._end_hooks: list[CallHook] = []
        self._gone_hooks: list[Callable[[Any, Any], None]] = []

    def install_capabilities(self) -> None:
        """Every capability added so far registers here (the engine is ready for them)."""
        for install in list(_capabilities):
            install(self)

    def on(self, kind: bytes, handler: Handler) -> None:
        """Handle frames of ``kind`` from every rank with ``handler`` (one per kind)."""
        if kind in self.handlers and self.handlers[kind] != handler:
            raise ValueError(f"frames of kind {kind!r} have a handler already")
        self.handlers[kind] = handler

    def before_call(self, hook: CallHook) -> None:
        """Run ``hook(engine, members)`` on the owner's thread before each call's requests go
        to ``members`` (the loop is the caller's then: the hook may pump_idle() for answers)."""
        self._call_hooks.append(hook)

    def after_call(self, hook: CallHook) -> None:
        """Run ``hook(engine, members)`` on the owner's thread once each call is over, however
        it ended, before the next can start (the loop is still the caller's: the hook may
        pump_idle() for what the ranks sent as it ended)."""
        self._end_hooks.append(hook)

    def when_gone(self, hook: Callable[[Any, Any], None]) -> None:
        """Run ``hook(engine, member)`` once when a rank has died or been buried."""
        self._gone_hooks.append(hook)
