"""A torchrun-style training function whose DDP model outlives its group, called N times in a row.

    python ddp_outlives_group.py N

Each call: every rank (this process as rank 0) makes its own group on a fixed MASTER_PORT,
trains a DDP model three steps, destroys the group and returns, the model still alive (kept
in a list on rank 0, as a notebook cell would keep it; dropped after the call). torch then
destroys the group from the Reducer with the GIL held, and about 1 call in 4 deadlocked
(``~ProcessGroupGloo`` joining a gloo thread that waits for the GIL): this process hung for
good, where no timeout could act. Prints ``CALL i seconds`` per call and ``DONE N``. Run as
its own process: a hang is the news, and the test's subprocess timeout finds it.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mpify_nb

kept = []


def train(port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.ones(8, 10)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    kept.append(model)  # on rank 0 (this process) the model lives on after the call
    return round(loss.item(), 4)


if __name__ == "__main__":
    calls = int(sys.argv[1])
    for i in range(calls):
        started = time.monotonic()
        result = mpify_nb.ranch(2, train, 29511, timeout=120)
        kept.clear()  # the model dies now, in this process, after its group ended
        print(f"CALL {i} {time.monotonic() - started:.2f} {result}", flush=True)
    print(f"DONE {calls}", flush=True)
