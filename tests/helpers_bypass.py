"""Functions run *on ranks* under ``ranch`` (ranks import this module by name): rank 0 calls
``dist.all_reduce`` (checked) while rank 1 enters the same collective number from C++, which the
collective check never sees (a user mistake: the ranks run different code)."""

from __future__ import annotations

from pathlib import Path


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


def checked_against_cpp(how: str, elements: int):
    """Rank 0: ``dist.all_reduce`` of ``elements`` floats; rank 1: ``how`` ("ddp": a DDP backward,
    whose bucket all_reduce is 5 floats; "functional": a functional all_reduce of 4; "method": the
    process group's own ``allreduce`` of 4)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    if rank == 0:
        dist.all_reduce(torch.ones(elements))  # rank 0's checked call
    elif how == "ddp":
        model(torch.ones(2, 4)).sum().backward()  # rank 1 from C++
    elif how == "functional":
        import torch.distributed._functional_collectives as funcol

        funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD).wait()  # rank 1 from C++
    else:
        dist.group.WORLD.allreduce(torch.ones(4)).wait()  # rank 1 from C++
    return "returned"
