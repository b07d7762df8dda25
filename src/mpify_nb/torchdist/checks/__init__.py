"""The collective check: ranks compare their calls before any of them enters gloo.

gloo aborts a process (SIGABRT from its I/O thread, which Python cannot catch) when a peer sends
more bytes than it expects: an ``all_reduce`` of float32 on one rank and float64 on another,
a ``reduce_scatter_tensor`` or ``all_to_all_single`` of other sizes, a ``recv`` into a smaller
tensor. Under ``ranch`` the notebook is rank 0. So every rank publishes each call it makes
(its op, src or dst, reduce op, the dtypes and sizes of its tensors, its line) and waits for its
peers' before it enters the collective; calls that cannot be one raise the same
``CollectiveError`` on every rank, and none of them sent a byte::

    wrappers.py   torch.distributed's calls wrapped, once per process; the switch
    calls.py      a call described (plain values) and the rules that compare them
    groups.py     a group's check: publish, wait, compare; its table made with the group
    deferred.py   async calls handed back at once: the group's lane finishes their check, in order
    mismatch.py   what calls that cannot be one raise, alike on every rank
    table.py      shared memory for the ranks of one host: rings of slots, a futex bell
    store.py      the group's store, for ranks on different hosts (collectives only)

A look at a rank (torchdist/waits.py) sees one waiting in its check as waiting in the
collective (:func:`groups.waiting_in`): a peer that never comes is the collective watch's. It
imports nothing of mpify_nb outside torchdist/.
"""
