"""The wire format: what crosses between a caller and its ranks, and how it is framed.

``errors`` (what comes back when a rank fails), ``framing`` (frames on the socketpairs, file
descriptors included), ``protocol`` (the frame kinds and request ids), ``payload`` (the call and
its results, pickled with dill), ``ship`` (what travels by reference and what by value, and the
path to what cannot travel), ``modules`` (what a rank imports before it loads a call) and ``shm``
(the shared memory big tensors travel in).

Both sides use it: the notebook and every rank. It imports nothing else of mpify_nb.
"""
