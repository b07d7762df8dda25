"""``Session``: persistent ranks kept across calls, on the same engine as ``ranch``.

From the bottom up: ``ranks`` (start, frames, deaths), ``recovery`` (a stuck call: stop,
collective watch, abort, rebuild), ``calls`` (one call: send, wait, results), ``background``
(background work, and reading the ranks' variables while a call runs), ``session`` (the public
API) and ``status`` (what ``status()`` and ``where()`` answer: ``RankStatus``, ``RankWhere``).

It may import the engine and what lies below it.
"""
