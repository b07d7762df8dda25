"""``ranch()``: one call on short-lived ranks, with the caller as one of them.

``ranch`` (``ranch()`` and its checks before anything starts), ``call`` (one call: its ranks
started, GO, answers gathered, every rank ended), ``outcome`` (the first failure wins: the root
cause, errors held a moment as possible echoes, the user's stop), ``watched`` (its half of the
collective watch: a verdict ends the call), ``own_rank`` (the caller's own rank, run on the
calling thread, and what it changes in this process for the call), ``stopping`` (stopping
that rank only at a safe point, never inside an import) and ``next_call`` (what a call's ranks
say for the next one: the modules they imported, the GPUs they used).

It may import the engine and what lies below it.
"""
