"""The engine: the one owner of a set of live ranks, under both ``ranch`` and ``Session``.

``core`` (``Engine``: start through the placer, channels, output, deaths, the one event loop),
the caller's half of each capability that touches running ranks (``prompts``: stdin; ``comms``:
widgets; ``watch``: the collective watch, looking at a call's ranks, and ``verdict``: what their
looks mean, a collective that can never finish and where each rank is) and ``interrupts`` (the
stop button for calls on other threads).

It may import ``wire/``, ``torchdist/``, ``rank/`` (the rank's half of a capability),
``relay/`` and ``start/``.
"""
