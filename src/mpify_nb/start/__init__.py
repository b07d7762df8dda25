"""Where a rank starts: the placement seam and what is behind it.

``placement`` (the seam: which placer turns "rank r" into a running process; ``set_placement``,
``set_start_method``), ``placer`` (what a placer is: ``Layout``, ``RankProcess``), ``local``
(this machine's placers: forked from the template, or spawned), ``template`` (the current warm
process ranks are forked from, and what it grows in place; ``set_preload``, ``shutdown``),
``template_client`` (the caller's handle on one template process), ``template_process`` (that
process itself, which imports between forks and runs ``rank.loop.main`` in each), ``environ``
(the environment our new interpreters start with), ``preload`` (what the template learns to
hold), ``spares`` (spare ranks, forked before a call and ready on their GPU; ``set_spare_ranks``)
and ``ray_ranks/`` (the ``"ray"`` placement).

It may import ``wire/``, ``torchdist/`` and ``rank/``.
"""
