"""The engine: the one owner of a set of live ranks, under both ``ranch`` and ``Session``.

``core`` (``Engine``: start through the placer, channels, output, deaths, the one event loop),
``capabilities`` (what a capability registers on every engine: frame handlers, hooks around a call
and a rank's end), ``members`` (``Member``: the engine's view of one live rank, how
it died), ``user_waits`` (ranks waiting for the user: at a stdin prompt, ``prompts``, or held at
a breakpoint; a call's clock does not count it), the caller's half of each capability that
touches running ranks (``prompts``: stdin; ``comms``: widgets; ``watch``: the collective watch,
looking at a call's ranks, and ``verdict``: what their looks mean, a collective that can never
finish and where each rank is; ``where``: where each rank is, in words; ``checked``: a call the
ranks' collective check refused, as the call's ``CollectiveError``, and ``set_collective_checks``),
``interrupts`` (the stop button: SIGINT while a call waits, and for calls on other threads) and
``background`` (a call's loop on a thread of its own, in the starting cell's context, behind a
``BackgroundWork`` handle).

It may import ``wire/``, ``torchdist/``, ``rank/`` (the rank's half of a capability),
``relay/`` and ``start/``.
"""
