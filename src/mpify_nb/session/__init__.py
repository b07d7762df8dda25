"""``Session``: persistent ranks kept across calls, on the same engine as ``ranch``.

From the bottom up: ``ranks`` (start, frames, deaths), ``recovery`` (a stuck call: stop,
collective watch, abort, rebuild), ``calls`` (one call: send, wait, results) and ``session``
(the public API).

It may import the engine and what lies below it.
"""
