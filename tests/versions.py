"""What the tests expect of the torch they run on (the suite runs on today's torch and on the floor,
``nox -s floor``): the version, where its APIs live, the wording its gloo uses, and skips that
name the torch a test needs. Every "which torch has what" of the library itself is in
src/mpify_nb/torchdist/compat.py; this is the tests' side of it.
"""

from __future__ import annotations

import pytest
import torch

from mpify_nb.torchdist import compat

#: (major, minor) of the torch the tests run on.
TORCH = compat.parse_version(torch.__version__)

#: gloo's flight recorder (torch >= 2.8): a hidden wait is named by its collective; before, by
#: what the stack shows (torchdist/hidden_waits.py).
GLOO_RECORDER = compat.has_gloo_recorder()

#: What a rank is said to wait in when a DDP backward waits for a rank that never comes: the
#: recorder's all_reduce, or (before 2.8) the torch call the stack shows.
DDP_BACKWARD_WAIT = "dist.all_reduce" if GLOO_RECORDER else "Tensor.backward"

#: Where the public DTensor API is (torch.distributed.tensor since 2.5).
DTENSOR_MODULE = "torch.distributed.tensor" if TORCH >= (2, 5) else "torch.distributed._tensor"

#: What gloo prints when a rank receives more data than its tensor holds (it then aborts the rank):
#: torch 2.13's gloo says the first, 2.4-2.8's the second.
GLOO_SIZE_MISMATCH = ("Received data size doesn't match expected size", "op.preamble.length <= op.nbytes")


def needs_torch(version: tuple[int, int], why: str) -> pytest.MarkDecorator:
    """Skip the test on a torch older than ``version``, saying what it needs and why."""
    return pytest.mark.skipif(TORCH < version, reason=f"needs torch >= {version[0]}.{version[1]} "
                                                      f"({why}); this is torch {torch.__version__}")


#: FSDP2 (fully_shard) on CPU ranks with gloo: torch 2.4's needs CUDA ("CUDA driver version is
#: insufficient"), 2.6's forward fails ("'Stream' object has no attribute 'record_event'").
needs_fsdp2_on_cpu = needs_torch((2, 8), "FSDP2 on CPU: 2.4's needs CUDA, 2.6's forward fails in "
                                         "foreach_all_gather ('Stream' object has no attribute 'record_event')")

#: gloo's flight recorder (torch >= 2.8) numbers each collective of a group and keeps its sizes: only
#: with it are mismatched collectives and wrong values told apart (before, the ranks wait until the
#: call's timeout or the stop button, whose message says where each rank was and that it went unchecked).
needs_gloo_recorder = needs_torch((2, 8), "gloo's flight recorder: it numbers collectives and keeps their sizes, "
                                          "which tell mismatched collectives and wrong values apart")


def numbered(op: str, sizes: str = "", waited: bool = False) -> str:
    """How a rank's wait in collective ``op`` reads in a where-text (a regex): with the recorder
    ``all_reduce #1 of float32\\[1\\] \\(\\d+ s\\)``, before torch 2.8 ``all_reduce`` (the stack
    knows the call only)."""
    if not GLOO_RECORDER:
        return op
    return f"{op} #1" + (f" of {sizes}" if sizes else "") + (r" \(\d+ s\)" if waited else "")
