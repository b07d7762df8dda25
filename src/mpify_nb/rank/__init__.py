"""Everything that runs inside a rank process, from its birth to its exit.

``loop`` (every rank's one request loop; a ``ranch`` rank's one CALL), ``control`` (the control
thread: stdin answers, interrupts, the caller's looks, the caller's death), ``session`` (a persistent rank's
requests), ``group`` (its process group), ``cells`` (what a rank runs for a notebook cell: a ``%%ranch``
cell, ``%time``/``%timeit``, ``%sync``), ``stdin``, ``display`` and ``mpl_backend``, ``comms`` (widgets),
``debugger`` (the frontend's debugger panel: pydevd on a socketpair, relayed on the control channel),
``checks`` (the collective check installed, switched, its error the caller's CollectiveError),
``imports_news`` (what a rank imports, told to the caller as it goes), ``spare`` (a spare rank, ready
on its GPU before its call) and ``process`` (what each of our processes does for itself). The
caller's half of each capability is in ``engine/``.

It may import ``wire/`` and ``torchdist/`` only: nothing of the caller's side (tests/test_layers.py).
"""
