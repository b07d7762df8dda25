"""Where a rank starts: the placement seam and what is behind it.

``placement`` (the seam: a placer turns "rank r" into a running process; ``set_placement``),
``template`` (the caller's handle on the warm process ranks are forked from; ``set_preload``),
``template_process`` (that process itself, which runs ``rank.loop.main`` in each fork),
``preload`` (what the template learns to preload) and ``ray_ranks/`` (the ``"ray"`` placement).

It may import ``wire/``, ``torchdist/`` and ``rank/``.
"""
