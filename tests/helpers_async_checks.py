"""Functions the async-collective tests run *on ranks* under ``ranch`` (ranks import this module by
name): ``async_op=True`` collectives whose peers come later, with the collective check on."""

from __future__ import annotations

import time
from pathlib import Path


def line_of(text: str) -> int:
    """The number of the line of this file that contains ``text``."""
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


def interleaved():
    """The issue's program: rank 0's async all_reduce, then a blocking send rank 1 must receive
    before it calls the all_reduce. Correct on gloo without the check; a deadlock if the async
    call waits for its peers at the call."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.ones(4) * (rank + 1)
    x = torch.zeros(3)
    if rank == 0:
        w = dist.all_reduce(t, async_op=True)
        before = w.is_completed()
        dist.send(torch.arange(3.0), 1)
        w.wait()
    else:
        dist.recv(x, 0)
        w = dist.all_reduce(t, async_op=True)
        before = False
        w.wait()
    return t.tolist(), x.tolist(), before, w.is_completed(), [r.tolist() for r in w.result()]


def chained():
    """get_future() chained with then(), its value read after a send the peer needs first."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.ones(2) * (rank + 1)
    if rank == 0:
        fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 10)
        dist.send(torch.ones(1), 1)
    else:
        dist.recv(torch.zeros(1), 0)
        fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 10)
    return fut.wait().tolist()


def in_order(later: str):
    """Rank 0's async all_reduce waits in its check (rank 1 receives first); a later collective on
    the group (``later``: "sync" broadcast, or "async" all_reduce of another size, waited first)
    must reach gloo after it, as on rank 1."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    a = torch.ones(4) * (rank + 1)
    b = torch.arange(6.0) * (rank + 1)
    if rank == 1:
        dist.recv(torch.zeros(1), 0)
    w = dist.all_reduce(a, async_op=True)
    if rank == 0:
        dist.send(torch.ones(1), 1)
    if later == "sync":
        dist.broadcast(b, 0)
    else:
        w2 = dist.all_reduce(b, async_op=True)
        w2.wait()
    w.wait()
    c = torch.ones(1) * (rank + 1)
    dist.all_reduce(c)  # the next collective: both ranks' counts alike
    return a.tolist(), b.tolist(), c.item()


def mismatched(when: str):
    """An async all_reduce of float32 on rank 0 and float64 on rank 1. ``when``: "later" (rank 0's
    waits in its lane, rank 1 receives first) or "at once" (both there: judged at the call).
    Each rank catches the error where it raises, then the group's next collective runs."""
    import traceback

    import torch
    import torch.distributed as dist
    from mpify_nb.errors import CollectiveError

    rank = dist.get_rank()
    x = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)
    if when == "at once":
        dist.barrier()
    elif rank == 1:
        dist.recv(torch.zeros(1), 0)
    w = dist.all_reduce(x, async_op=True)  # mismatched async call
    if when == "later" and rank == 0:
        dist.send(torch.ones(1), 1)
    try:
        w.wait()  # mismatched async wait
        caught, at = "no error", None
    except CollectiveError as e:
        caught, at = str(e), traceback.extract_tb(e.__traceback__)[0].lineno
    y = torch.ones(2) * (rank + 1)
    dist.all_reduce(y)
    return caught, at, y.tolist()


def many_ahead(bad: int):
    """Rank 0 makes 12 async all_reduces before rank 1 makes any (more than a ring of slots ahead:
    the rest wait unpublished); the ``bad``-th is float64 on rank 1 (-1: none). Every other call
    adds up, the bad one raises the same error from its wait() on both ranks."""
    import torch
    import torch.distributed as dist
    from mpify_nb.errors import CollectiveError

    rank = dist.get_rank()
    if rank == 1:
        dist.recv(torch.zeros(1), 0)
    tensors = [torch.ones(3, dtype=torch.float64 if rank == 1 and i == bad else torch.float32) * (i + rank)
               for i in range(12)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    if rank == 0:
        dist.send(torch.ones(1), 1)
    out = []
    for w, t in zip(works, tensors):
        try:
            w.wait()
            out.append(t[0].item())
        except CollectiveError as e:
            out.append(str(e).split(":")[0])
    return out


def hook_returns_at_once():
    """DDP with torch's allreduce communication hook (``dist.all_reduce(..., async_op=True)
    .get_future()``): rank 1 comes 0.5 s late to each backward; rank 0's hook returns before rank
    1 calls its own. Returns the weights and, on rank 0, whether each step's hook returned before
    rank 1's hook was called (each rank's times: wall clock of one host)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    times: list[tuple[float, float]] = []

    def hook(state, bucket):
        called = time.time()
        fut = default_hooks.allreduce_hook(state, bucket)
        times.append((called, time.time()))
        return fut

    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        loss = model(torch.ones(4, 8) * (rank + 1 + step)).sum()  # (DDP's forward may sync the ranks)
        if rank == 1:
            time.sleep(0.5)
        loss.backward()
        opt.step()
    weights = [round(v, 5) for v in model.module.weight.flatten().tolist()]
    return weights, times
