"""Functions the mismatch tests run *on ranks* under ``ranch`` (ranks import this module by name).

Each makes one distributed mistake on a gloo group of 2 ranks (``ctx=in_torchddp()``), or runs a
healthy workload that must raise no alarm. Torch is imported inside the functions: importing
this module stays cheap. The tests find the lines they expect with :func:`line_of`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def line_of(text: str, nth: int = 1) -> int:
    """The number of the ``nth`` line of this file that contains ``text``."""
    found = [i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line]
    return found[nth - 1]


def environment_variable(name: str):
    return os.environ.get(name)


def _rank() -> int:
    return int(os.environ["RANK"])


def op_mismatch():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    dist.all_reduce(x)
    if _rank() == 0:
        dist.all_reduce(x)  # op_mismatch rank 0
    else:
        dist.broadcast(x, 0)  # op_mismatch rank 1
    return x.tolist()


def gather_vs_reduce():
    import torch
    import torch.distributed as dist

    x = torch.ones(3)
    if _rank() == 0:
        dist.all_gather([torch.ones(3), torch.ones(3)], x)  # gather_vs_reduce rank 0
    else:
        dist.all_reduce(x)  # gather_vs_reduce rank 1


def broadcast_src():
    import torch
    import torch.distributed as dist

    x = torch.ones(2, 3)
    dist.broadcast(x, _rank())  # broadcast_src both


def reduce_scatter_sizes():
    import torch
    import torch.distributed as dist

    out = torch.zeros(2 + _rank())
    dist.reduce_scatter(out, [torch.ones(2 + _rank()), torch.ones(2 + _rank())])  # reduce_scatter both
    return out.tolist()


def sizes():
    import torch
    import torch.distributed as dist

    y = torch.ones(2 + _rank())
    dist.all_reduce(y)  # sizes both
    return y.tolist()


def broadcast_sizes():
    import torch
    import torch.distributed as dist

    x = torch.ones(2)
    dist.all_reduce(x)
    y = torch.arange(4.0) if _rank() == 0 else torch.zeros(5)
    dist.broadcast(y, 0)  # broadcast_sizes both: gloo fills 4 of rank 1's 5, and both return
    return y.tolist()


def recv_recv():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    dist.recv(x, 1 - _rank())  # recv_recv both


def isend_isend():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    work = dist.isend(x, 1 - _rank())
    work.wait()  # isend_isend both


def isend_irecv_tag():
    import torch
    import torch.distributed as dist

    x = torch.ones(2, 2)
    work = dist.isend(x, 1, tag=7) if _rank() == 0 else dist.irecv(x, 0, tag=8)
    work.wait()  # isend_irecv_tag both


def subgroup():
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    x = torch.ones(4, dtype=torch.float64)
    if _rank() == 0:
        dist.all_reduce(x, group=group)  # subgroup rank 0
    else:
        dist.barrier(group=group)  # subgroup rank 1


def returns_early():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    dist.all_reduce(x)
    dist.all_reduce(x)
    if _rank() == 0:
        dist.all_reduce(x)  # returns_early rank 0
    return x.tolist()


def busy_rank_1(seconds: float):
    """Not a mistake: rank 0 waits in all_reduce while rank 1 computes for ``seconds``."""
    import torch
    import torch.distributed as dist

    x = torch.ones(1)
    if _rank() == 1:
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # busy_rank_1 rank 1
            pass
    dist.all_reduce(x)  # busy_rank_1 both
    return x.item()


def seen_waiting_unnumbered(seconds: float):
    """Rank 0 returns at once; rank 1 is seen by the watch's looks for ``seconds`` as gloo before
    torch 2.8 shows a rank that wakes from a collective: waiting in it, by its frame alone, with
    no number that tells whether rank 0 made its part (its control thread's snapshot says so)."""
    if _rank() == 1:
        from mpify_nb.torchdist import waits

        real = waits.snapshot

        def waiting_unnumbered(rank, *args, **kwargs):
            seen = real(rank, *args, **kwargs)
            return waits.Snapshot(rank, (), None, "DTensor.full_tensor", True, seen.where, "waiting")

        waits.snapshot = waiting_unnumbered
        try:
            time.sleep(seconds)  # seen_waiting_unnumbered rank 1
        finally:
            waits.snapshot = real
    return _rank()


def working_collective():
    import torch
    import torch.distributed as dist

    x = torch.ones(2) * (_rank() + 1)
    dist.all_reduce(x)
    return x.tolist()


# -- healthy workloads that must raise no alarm (each rank 1 starts late: looks happen) ---------

def _late() -> None:
    if _rank() == 1:
        time.sleep(1.5)


def healthy(workload: str):
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    _late()
    if workload == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(30):
            if step == 10:
                _late()
            opt.zero_grad()
            model(torch.ones(4, 8)).sum().backward()
            opt.step()
        return round(model.module.bias.item(), 4)
    if workload == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # A CPU mesh, said: fully_shard's default mesh is CUDA's wherever CUDA is, and a gloo
        # rank with no GPU of its own then fails ("invalid device ordinal" on an H200 with 2 ranks).
        mesh = init_device_mesh("cpu", (2,))
        net = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), mesh=mesh)
        for _ in range(3):
            net(torch.ones(2, 4)).sum().backward()
            _late()
        return "ok"
    if workload == "dtensor":
        import importlib

        from torch.distributed.device_mesh import init_device_mesh

        from mpify_nb.torchdist import compat

        # public in torch.distributed.tensor since torch 2.5
        dtensor = importlib.import_module("torch.distributed.tensor" if compat.torch_version() >= (2, 5)
                                          else "torch.distributed._tensor")
        Shard, distribute_tensor = dtensor.Shard, dtensor.distribute_tensor
        mesh = init_device_mesh("cpu", (2,))
        d = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        _late()
        return d.full_tensor().sum().item()
    if workload == "pipeline":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        from mpify_nb.torchdist import compat

        # torch < 2.6 does not infer the stages' shapes: a microbatch of 2 rows, given
        given = {} if compat.torch_version() >= (2, 6) else {"input_args": torch.ones(2, 4)}
        stage = PipelineStage(torch.nn.Linear(4, 4), _rank(), 2, torch.device("cpu"), **given)
        schedule = ScheduleGPipe(stage, 2)
        _late()
        out = schedule.step(torch.ones(4, 4)) if _rank() == 0 else schedule.step()
        return None if out is None else tuple(out.shape)
    if workload == "async":
        x = torch.ones(4)
        work = dist.all_reduce(x, async_op=True)
        _late()
        work.wait()
        objects = [None, None]
        dist.all_gather_object(objects, {"rank": _rank()})
        return x.tolist(), objects
    if workload == "long":
        x = torch.ones(1)
        if _rank() == 1:
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                pass
        dist.all_reduce(x)
        return x.item()
    raise ValueError(workload)


def p2p_counted():
    """Rank 0 sends rank 1 two blocking sends and an isend; rank 1 receives them (two recvs and an
    irecv): what each counted (torch >= 2.6 makes send() of isend(): counted once)."""
    import torch
    import torch.distributed as dist

    from mpify_nb.torchdist import p2p

    t = torch.ones(3)
    if _rank() == 0:
        dist.send(t, 1)
        dist.send(t, dst=1, tag=0)
        dist.isend(t, 1).wait()
    else:
        dist.recv(t, 0)
        dist.recv(t, src=0)
        dist.irecv(t, 0).wait()
    return sorted(p2p.counts())


def peers_named_in_a_subgroup():
    """Ranks 1 and 2 of three form a group: a call's ``group_src``/``group_dst`` in it, as the global
    rank a look names (rank 0, outside the group, answers None)."""
    import torch.distributed as dist

    from mpify_nb.torchdist import p2p

    group = dist.new_group([1, 2])  # every rank makes it, members or not
    if _rank() == 0:
        return None
    return [p2p.global_rank_of(None, 1, group), p2p.global_rank_of(None, 0, group),
            p2p.global_rank_of(None, 2, group), p2p.global_rank_of(0, 1, group),
            p2p.global_rank_of(None, 1, None), p2p.global_rank_of(None, None, group),
            p2p.global_rank_of(True, None, None)]
