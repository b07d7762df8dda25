"""On a machine with CUDA GPUs: a rank's imports before the call create no CUDA context.

    PYTHONPATH=$PWD/src python tests/scripts/gpu_rank_imports.py

This script plays a notebook that imported a library which asks about the GPU at import
(``torch.cuda.is_available()``, ``device_count()``, as many do at module level). Every rank
imports what the notebook imported before it loads a call (wire/modules.py), with those
questions answered by NVML: the call must find CUDA not initialized on every rank, then each
rank must use its own GPU under ``in_torchddp()``. Runs 2 ranks where 2 GPUs are, 1 rank on a
single GPU (the import check is the same; a world of one). Prints ``OK`` or raises.
"""

import os
import sys
import tempfile
import textwrap

import torch

import mpify_nb
from mpify_nb import in_torchddp, ranch

assert torch.cuda.is_available(), "needs a CUDA GPU"
N = min(2, torch.cuda.device_count())
where = tempfile.mkdtemp()
with open(os.path.join(where, "asks_the_gpu.py"), "w") as f:
    f.write(textwrap.dedent("""
        import torch
        DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0
        """))
sys.path.insert(0, where)
import asks_the_gpu  # noqa: E402


def before_anything():
    return torch.cuda.is_initialized(), "asks_the_gpu" in sys.modules


def own_device():
    x = torch.ones(1, device="cuda")
    torch.distributed.all_reduce(x)
    return torch.cuda.current_device(), float(x)


before = ranch(N, before_anything, caller_rank=None)
print("before:", before)
assert before == [(False, True)] * N
devices = ranch(N, own_device, ctx=in_torchddp(), caller_rank=None)
print("devices:", devices)
assert devices == [(k, float(N)) for k in range(N)]
mpify_nb.template.shutdown()
print("OK", asks_the_gpu.DEVICES)
