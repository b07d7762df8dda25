"""Where the ranks' output is relayed into the notebook's cell (runs in the caller).

``pipes`` (the ranks' stdout/stderr pipes, read by a thread or by the engine's pump),
``output`` (what a rank's bytes become: labelled lines, bars, a view's feed) and ``lines``
(cutting lines, live display lines, the cell's streams written with each rank's label, the
caller's own writes beside them).

It imports nothing else of mpify_nb.
"""
