"""``python ddp_loop.py N``: N calls of ranch(2, ..., ctx=in_torchddp()), each making a gloo group,
running one all_reduce and destroying the group; prints "call i" after each and "all N calls"."""

import sys

import torch
import torch.distributed as dist

from mpify_nb import in_torchddp, ranch


def one_all_reduce() -> float:
    # The tensor is dropped when this returns, while gloo's worker may still hold it: the worker
    # then frees its Python object, which needs the GIL (torch < 2.8's destroy deadlock).
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


if __name__ == "__main__":
    calls = int(sys.argv[1])
    for i in range(calls):
        assert ranch(2, one_all_reduce, ctx=in_torchddp()) == [2.0, 2.0]
        print(f"call {i}", flush=True)
    print(f"all {calls} calls", flush=True)
