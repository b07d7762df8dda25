"""The README's demo: a tiny DDP job on 2 CPU ranks, this process being rank 0.

Run it with::

    python examples/demo.py

Rank 1 is a fresh process started for the call and gone when it returns; its
prints come back here labelled ``[rank 1]``. Rank 0 prints unlabelled.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mpify_nb import in_torchddp, ranch


def all_reduce_demo(base: float) -> list[float]:
    """Every rank contributes ``base * (rank + 1)``; all_reduce sums them on every rank."""
    rank = dist.get_rank()
    t = torch.tensor([base * (rank + 1), 1.0])
    dist.all_reduce(t)  # sum over ranks: [base * (1 + 2), world_size]
    print(f"all_reduce on rank {rank}: {t.tolist()}")
    return t.tolist()


def ddp_step(lr: float) -> float:
    """One SGD step of a 1-weight linear model ``y = w x`` under DDP, each rank on its own data.

    Loss ``mean((w x)^2)`` has gradient ``2 w x^2``: 2 on rank 0 (x = 1), 8 on rank 1
    (x = 2). DDP averages them to 5, so with w = 1 and lr = 0.1 every rank ends with w = 0.5.
    """
    rank = dist.get_rank()
    linear = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    model = DDP(linear)
    x = torch.full((4, 1), float(rank + 1))  # rank 0 sees 1s, rank 1 sees 2s
    loss = model(x).pow(2).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    weight = model.module.weight.item()
    print(f"rank {rank} of {os.environ['WORLD_SIZE']}: local loss {loss.item():.4f}, weight after step {weight:.4f}")
    return weight


def main() -> None:
    sums = ranch(2, all_reduce_demo, 10.0, ctx=in_torchddp())
    print("all_reduce results by rank:", sums)
    assert sums == [[30.0, 2.0], [30.0, 2.0]], sums

    weights = ranch(2, ddp_step, 0.1, ctx=in_torchddp())
    print("weights by rank after one DDP step:", weights)
    assert weights == [0.5, 0.5], "DDP averages the gradients: every rank has the same weight"


if __name__ == "__main__":
    main()
