"""A tiny fastai tabular training with ``learn.distrib_ctx``, on CPU ranks.

The same source serves three ways, so results can be compared exactly:

* under torchrun: ``python -m torch.distributed.run --nproc-per-node 2 fastai_tabular.py``
  prints one JSON line per rank (``RESULT {...}``);
* in a notebook: the tests paste this file's text into a cell (everything above the
  ``__main__`` block), then run ``ranch(2, train_fastai, ctx=in_torchddp())``, a
  ``%%ranch 2 --ddp`` cell, or ``train_fastai()`` on persistent ranks, as a user would.

What fastai needs on CPU (under torchrun as well): ``distrib_ctx(sync_bn=False, cpu=True)``
(SyncBatchNorm is GPU-only; without ``cpu=True`` accelerate wraps nothing), and a
``DistributedDL._broadcast`` that does not call ``.cuda()`` (fastai's assumes NCCL). The patch
is made inside the training function: it runs on every rank, like the rest of the training.
"""

import os

import numpy as np
import pandas as pd
import torch
from fastai.distributed import DistributedDL
from fastai.tabular.all import (
    Categorify,
    CategoryBlock,
    Normalize,
    TabularDataLoaders,
    accuracy,
    error_rate,
    rank_distrib,
    set_seed,
    tabular_learner,
)


def broadcast_on_cpu(self, t, rank):
    """DistributedDL._broadcast without ``.cuda()``: gloo broadcasts CPU tensors."""
    t = torch.LongTensor(t)
    torch.distributed.broadcast(t, rank)
    return t.tolist()


def frame(n=320):
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "c": rng.choice(["x", "y", "z"], n)})
    df["y"] = ((df.a + 0.5 * df.b + (df.c == "x")) > 0.3).astype(int)
    return df


def train_fastai(epochs=2):
    DistributedDL._broadcast = broadcast_on_cpu
    set_seed(0, reproducible=True)
    dls = TabularDataLoaders.from_df(
        frame(), y_names="y", y_block=CategoryBlock(), cat_names=["c"], cont_names=["a", "b"],
        procs=[Categorify, Normalize], valid_idx=list(range(256, 320)), bs=32, device="cpu")
    learn = tabular_learner(dls, layers=[16], n_out=2, metrics=[accuracy, error_rate])
    with learn.distrib_ctx(sync_bn=False, cpu=True):
        learn.fit_one_cycle(epochs, 1e-2)
    weights = [round(float(w), 6) for w in next(learn.model.parameters()).detach().flatten()[:8]]
    return {"rank": rank_distrib(), "losses": [float(v) for v in learn.recorder.losses],
            "values": [[float(v) for v in row] for row in learn.recorder.values], "weights": weights}


if __name__ == "__main__":
    import json

    result = train_fastai()
    print("RESULT " + json.dumps(result), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    os._exit(0)  # as tests/scripts/libraries.py: no teardown race between the two workers
