"""What mpify_nb knows of torch.distributed and the training libraries built on it.

``groups`` (GPU ids, the store's listening socket, torch's group count, the groups torch would
destroy with the GIL held or keep alive for good), ``rendezvous`` (every ``init_process_group`` of
a call, or of a Session's cell, goes to one store in a process we can stop), ``waits`` (a look at a
rank: what it waits in, from torch's flight recorder and its stack, and where it is; ``stacks``:
what a thread's stack says, the call it is blocked in and the user's line; ``hidden_waits``:
the stack and CPU time standing in for gloo's recorder before torch 2.8), ``recorder`` (the
recorder's dumps, gloo's and NCCL's, read as ops), ``p2p`` (the peer and tag ``isend``/``irecv``
note beside their ``Work``, which gloo records nowhere), ``checks/`` (the collective check: every
rank compares each call with its peers' before any enters gloo, which would abort a rank whose
peer sends more than it expects), ``libraries`` (what accelerate, Lightning
and Hugging Face expect of a rank, and leave behind), ``compat`` (which torch has what: every
version check, in one place) and ``warmup`` (the notebook's first DDP, warmed between cells).

Both sides use it. It imports nothing else of mpify_nb.
"""
