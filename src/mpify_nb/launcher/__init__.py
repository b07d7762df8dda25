"""``ranch()``: one call on short-lived ranks, with the caller as one of them.

``call`` (``ranch`` and its one call's policy: the first failure wins, every rank is ended),
``watched`` (its half of the collective watch: a verdict ends the call) and ``own_rank`` (the
caller's own rank, and what it changes in this process for the call).

It may import the engine and what lies below it.
"""
