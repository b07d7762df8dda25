"""What mpify_nb knows of torch.distributed and the training libraries built on it.

``groups`` (GPU ids, the store's listening socket, torch's group count), ``waits`` (what a rank
waits on in a collective: torch's flight recorder, its stack; ``hidden_waits``: the stack and CPU
time standing in for gloo's recorder before torch 2.8), ``libraries`` (what accelerate, Lightning
and Hugging Face expect of a rank, and leave behind) and ``compat`` (which torch has what: every
version check, in one place).

Both sides use it. It imports nothing else of mpify_nb.
"""
