"""Where the ranks' output is relayed into the notebook's cell (runs in the caller).

``pipes`` (the ranks' stdout/stderr pipes, read by a thread or by the engine's pump),
``output`` (what a rank's bytes become: labelled lines, bars, a view's feed) and ``lines``
(cutting lines, live display lines, the caller's own streams).

It imports nothing else of mpify_nb.
"""
