"""Code as people bring it to ranch (issue 38): torchrun-style functions that read RANK and
WORLD_SIZE, make their own group (often on a MASTER_PORT of their own), and the ways they fail.

Shipped to ranks by reference (this module is on every rank's sys.path). A failing rank says
when it failed (``time.time()``) in its message, or in a file when it dies: the test measures
how long the call took to end after that.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path


def _rank() -> int:
    return int(os.environ["RANK"])


def _fail(how: str, where: str) -> None:
    """Fail the way ``how`` says: raise, or die (``os._exit``) after writing the time to ``where``."""
    if how == "raise":
        raise FileNotFoundError(f"shard {_rank()} is missing AT {time.time():.3f}")
    Path(where).write_text(f"{time.time():.3f}")
    os._exit(3)


def fails_around_init(failing: int, when: str, how: str = "raise", where: str = "") -> int:
    """A script whose rank ``failing`` fails ``when`` ("before", "during" or "after") its own
    ``init_process_group`` (env://, the port ranch set), while the others go on into it."""
    import torch
    import torch.distributed as dist

    rank = _rank()
    if rank == failing and when == "before":
        _fail(how, where)
    if rank == failing and when == "during":
        # The others wait in the rendezvous already; this rank dies a moment into its own.
        time.sleep(0.2)
        threading.Timer(0.002, _fail, ("exit", where)).start()
    dist.init_process_group("gloo")
    if rank == failing and when == "after":
        _fail(how, where)
    t = torch.ones(1)
    dist.all_reduce(t)  # the others wait here for the failed rank
    dist.destroy_process_group()
    return int(t.item())


def fails_in_ddp_ctx(failing: int) -> int:
    """Under ``ctx=in_torchddp()``: rank ``failing`` raises while the others wait in a barrier."""
    import torch.distributed as dist

    if _rank() == failing:
        _fail("raise", "")
    dist.barrier()
    return _rank()


def never_joins(absent: int, seconds: float = 60.0) -> int:
    """Rank ``absent`` never reaches the rendezvous (it sleeps); the others wait in it."""
    import torch.distributed as dist

    if _rank() == absent:
        time.sleep(seconds)
        return -1
    dist.init_process_group("gloo")
    dist.destroy_process_group()
    return _rank()


def ddp_on_fixed_port(port: int, steps: int = 3) -> float:
    """pytorch/examples' ddp_setup as written: MASTER_ADDR/PORT fixed in the script, its own
    init_process_group with rank and world_size, DDP training, destroy_process_group."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    rank, world_size = _rank(), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(16.0).reshape(4, 4) / 16 + rank
    for _ in range(steps):
        loss = (model(x) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    return round(float(model.module.weight.detach().sum()), 6)


def tcp_init(port: int) -> float:
    """``init_process_group(init_method="tcp://...")`` on a port of the script's own."""
    import torch
    import torch.distributed as dist

    rank, world_size = _rank(), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def two_groups_in_a_row() -> list:
    """init, all_reduce, destroy, then init again in the same call: the second group must not
    read the first one's keys."""
    import torch
    import torch.distributed as dist

    out = []
    for k in (1, 10):
        dist.init_process_group("gloo")
        t = torch.tensor([float(k * (_rank() + 1))])
        dist.all_reduce(t)
        out.append(t.item())
        dist.destroy_process_group()
    return out


def init_with_world_size(world_size: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=_rank(), world_size=world_size)
    dist.destroy_process_group()
    return _rank()


def init_again() -> None:
    """A script that makes its own group, run with ``ctx=in_torchddp()``: a second default group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")


def take_master_port() -> str:
    """Try to bind MASTER_PORT as a stranger would (SO_REUSEADDR on): what happens."""
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError as e:
            return f"refused: {e.strerror}"
        return "taken"


def rank_and_world(rank: int, world_size: int, scale: int = 1) -> tuple:
    """mp.spawn's ``fn(i, *args)``: the rank first, then what the call passed."""
    return rank * scale, world_size, int(os.environ["RANK"])


def _shard_sums(model) -> list:
    """Each parameter's local shard (a DTensor's ``to_local()``), summed: what the rank holds."""
    return [round(float(p.detach().to_local().sum()), 6) for p in model.parameters()]


def fsdp2_model(keep: bool, steps: int = 2):
    """pytorch/examples' FSDP2 style on the call's group (``ctx=in_torchddp()``): a CPU mesh,
    ``fully_shard`` per layer then on the model, a few steps. Returns the model on rank 0 when
    ``keep`` (the caller then holds it, as a notebook keeps what a call returns), else the shards' sums."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.ones(2, 4) * (_rank() + 1)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model if keep and _rank() == 0 else _shard_sums(model)
