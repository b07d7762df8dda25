"""Scripts as the PyTorch examples and tutorials write them, on CPU with gloo (issue 38).

* ``multigpu``: pytorch/examples' DDP tutorial series style: ``ddp_setup(rank, world_size)`` fixes
  MASTER_ADDR/MASTER_PORT and calls ``init_process_group``; a ``Trainer`` with a DDP model, a
  DistributedSampler, epochs; ``main(rank, world_size, ...)`` started by ``mp.spawn``. Its torchrun
  twin (``main_torchrun``) reads the environment instead, as multigpu_torchrun.py does.
* ``dist_tuto``: pytorch/tutorials' "Writing distributed applications": ``init_process(rank, size,
  fn)`` sets the address and port and makes the group, ``run(rank, size)`` sends and receives, then
  all-reduces.
* ``tp``: pytorch/examples' tensor-parallel example style: ``init_device_mesh`` makes the group (its
  own ``init_process_group``), ``parallelize_module`` shards an MLP column- then row-wise, a few
  steps of training; each rank reports its loss and its shard's checksum.
* ``fsdp2``: pytorch/examples' FSDP2 example style: its own ``init_process_group``, ``fully_shard``
  on each layer then on the model, Adam, each rank its own batches; each rank reports its losses
  and the sums of the full (unsharded) parameters.

Each prints ``RESULT {...}`` per rank. Run as::

    python bring_your_script.py multigpu|dist_tuto          # mp.spawn, 2 processes
    torchrun --nproc-per-node 2 bring_your_script.py multigpu|dist_tuto|tp|fsdp2

In a notebook, everything above the entry point at the end is the cell; ``ranch(2, main, 2,
pass_rank=True)`` runs it as mp.spawn would.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(1234)
        self.size = size
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id, save_every):
        self.gpu_id = gpu_id
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.losses = []

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        total = 0.0
        for source, targets in self.train_data:
            total += self._run_batch(source, targets)
        self.losses.append(round(total, 6))

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def load_train_objs():
    torch.manual_seed(0)
    train_set = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def train_and_report(rank, world_size, total_epochs, batch_size):
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, rank, save_every=10)
    trainer.train(total_epochs)
    weight = trainer.model.module.weight.detach()
    return {"rank": rank, "world": world_size, "losses": trainer.losses,
            "weight_sum": round(weight.sum().item(), 6), "weight_0": round(weight[0, 0].item(), 8)}


def main(rank, world_size, total_epochs=3, batch_size=32):
    ddp_setup(rank, world_size)
    result = train_and_report(rank, world_size, total_epochs, batch_size)
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return result


def main_torchrun(total_epochs=3, batch_size=32):
    dist.init_process_group(backend="gloo")
    result = train_and_report(dist.get_rank(), dist.get_world_size(), total_epochs, batch_size)
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return result


# -- pytorch/tutorials' dist_tuto ------------------------------------------------------------------

def run(rank, size):
    """Blocking point-to-point: rank 0 sends to rank 1; then a ring of sums by all_reduce."""
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    else:
        dist.recv(tensor=tensor, src=0)
    received = tensor[0].item()
    group = dist.new_group(list(range(size)))
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return {"rank": rank, "received": received, "sum": total[0].item()}


def init_process(rank, size, fn, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    result = fn(rank, size)
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return result


def tuto_torchrun():
    dist.init_process_group("gloo")
    result = run(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return result


# -- pytorch/examples' tensor parallel -----------------------------------------------------------

class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = torch.nn.Linear(10, 32)
        self.relu = torch.nn.ReLU()
        self.out_proj = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def tensor_parallel(steps=3):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    torch.manual_seed(0)
    model = parallelize_module(ToyModel(), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1)  # every rank the same input, as the example does
    losses = []
    for _ in range(steps):
        inp = torch.rand(20, 10)
        loss = model(inp).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 5))
    shard = model.in_proj.weight.to_local()
    result = {"rank": dist.get_rank(), "losses": losses, "shard_sum": round(shard.sum().item(), 6)}
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return result


# -- pytorch/examples' FSDP2 --------------------------------------------------------------------

def fsdp2(steps=3):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    assert isinstance(model, FSDPModule)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own data
    losses = []
    for _ in range(steps):
        loss = model(torch.rand(8, 16)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
    full = [round(p.full_tensor().sum().item(), 6) for p in model.state_dict().values()]  # flat: one line
    result = {"rank": dist.get_rank(), "losses": losses, "full": full}
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    import sys

    which = sys.argv[1]
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if which == "multigpu":
        if under_torchrun:
            main_torchrun()
        else:
            mp.spawn(main, args=(2,), nprocs=2)
    elif which == "dist_tuto":
        if under_torchrun:
            tuto_torchrun()
        else:
            mp.spawn(init_process, args=(2, run), nprocs=2)
    elif which == "tp":
        tensor_parallel()
    elif which == "fsdp2":
        fsdp2()
