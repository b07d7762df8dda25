"""Enter TorchDDPCtx(gpus="2,3") as local rank 1 on a CPU-only machine with CUDA mocked (4 fake GPUs).

    python gpu_mock.py

Prints one JSON line: the devices set_device was asked for, the error
init_process_group raised (on a CPU build, nccl is not compiled in: the error says
which backend was chosen), and whether a group is left up. In its own process because a
failed init_process_group leaves torch.distributed state behind in the process.
"""

import json
import os

import torch
import torch.distributed as dist

from mpify_nb import TorchDDPCtx

asked: list = []
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 4
torch.cuda.set_device = lambda device: asked.append(int(device))
os.environ.update(RANK="0", LOCAL_RANK="1", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])

error = backend = None
try:
    with TorchDDPCtx(gpus="2,3"):
        backend = dist.get_backend()  # where NCCL is built in (a CUDA build)
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"set_device": asked, "error": error, "backend": backend, "initialized": dist.is_initialized()}))
