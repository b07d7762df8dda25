#!/usr/bin/env python
"""Issue 9 point 5, issue 27: warm calls with heavy libraries (accelerate, Lightning, HF Trainer, fastai).

This process plays the notebook: it imports torch, accelerate, transformers and lightning
at the top, and defines each training function here, in ``__main__`` (so ``ranch`` ships
it by value, as from a notebook, and its module globals make rank 1 import the library).

For each library, side by side in one run, 2 ranks, median of ``--reps`` calls:

* before: ``set_preload(False)``, so rank 1 is forked from a template holding torch only
  and imports the library on every call;
* after: ``set_preload(True)``; one call teaches the template what rank 1 imports, then
  (once the preloading template is in) the timed calls;
* launcher: the library's own fork-based notebook launcher on the same training code
  (accelerate's ``notebook_launcher``; Lightning's ``strategy="ddp_notebook"``), whose
  ranks inherit every module from this process.

fastai (issue 27): ``from fastai.tabular.all import *`` here, as a fastai notebook starts;
a tabular Learner trained with ``learn.distrib_ctx(sync_bn=False, cpu=True)`` through
``ranch(2, train_fastai, ctx=in_torchddp())``, against ``notebook_launcher`` on the same
function. Since issue 27 every rank imports what this process imported before it loads a
call, so "before" (preload off) pays for all of them on every call; "after" is the warm path.

Printed per library: whole-call medians and "launch to fn on rank 1" (from just before
``ranch`` to the first line of ``fn`` on rank 1), and the ratios after/launcher and
before/after; and how long the preloading template took to be ready. Targets (issue 9,
issue 27): after <= 1.5x launcher; launch to fn <= 0.1 s after.

``--load N`` runs N busy loops (one process each) for the whole run: a loaded machine.

Run: ``.venv/bin/python benchmarks/bench_libraries.py [--quick] [--load 2]
[--only accelerate,lightning,hf,fastai]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

from _common import Result, finish, fmt_list, fmt_s, machine_line, median

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator, notebook_launcher  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

import mpify_nb  # noqa: E402
from mpify_nb import in_torchddp, ranch, template  # noqa: E402

try:  # a fastai notebook's first cell
    from fastai.distributed import DistributedDL  # noqa: E402
    from fastai.tabular.all import (  # noqa: E402
        Categorify,
        CategoryBlock,
        Normalize,
        TabularDataLoaders,
        accuracy,
        set_seed,
        tabular_learner,
    )
except ImportError:
    DistributedDL = None


def _arrived() -> float:
    """Called first thing in fn: when rank 1 got there (CLOCK_MONOTONIC is machine-wide)."""
    return time.monotonic()


def _data(n=32, dim=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def train_accelerate():
    t = _arrived()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=4))
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return t


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train_lightning(strategy="ddp"):
    t = _arrived()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(_data(), batch_size=4))
    return t


def train_hf():
    t = _arrived()
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    ids = torch.randint(0, 64, (40, 8), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": row, "labels": int(row.sum()) % 2} for row in ids]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=5, per_device_train_batch_size=4, report_to=[],
                                 save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
        Trainer(model=model, args=args, train_dataset=data).train()
    return t


def _broadcast_on_cpu(self, t, rank):
    """fastai's DistributedDL._broadcast calls .cuda() (NCCL): on CPU ranks, gloo broadcasts this."""
    t = torch.LongTensor(t)
    torch.distributed.broadcast(t, rank)
    return t.tolist()


def _frame(n=2048):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    df = pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "c": rng.choice(["x", "y", "z"], n)})
    df["y"] = ((df.a + 0.5 * df.b + (df.c == "x")) > 0.3).astype(int)
    return df


def _quiet(*args):
    pass


def train_fastai():
    t = _arrived()
    DistributedDL._broadcast = _broadcast_on_cpu
    set_seed(0)
    dls = TabularDataLoaders.from_df(
        _frame(), y_names="y", y_block=CategoryBlock(), cat_names=["c"], cont_names=["a", "b"],
        procs=[Categorify, Normalize], valid_idx=list(range(1792, 2048)), bs=64, device="cpu")
    learn = tabular_learner(dls, layers=[64, 32], n_out=2, metrics=accuracy)
    learn.remove_cbs(learn.cbs.filter(lambda cb: type(cb).__name__ == "ProgressCallback"))
    learn.logger = _quiet  # the recorder's table, on rank 0
    with learn.distrib_ctx(sync_bn=False, cpu=True):
        learn.fit_one_cycle(2, 1e-2)
    return t


LIBRARIES = {
    "accelerate": (train_accelerate, lambda: notebook_launcher(train_accelerate, num_processes=2), "notebook_launcher"),
    "lightning": (train_lightning, lambda: train_lightning("ddp_notebook"), "ddp_notebook"),
    "hf": (train_hf, lambda: notebook_launcher(train_hf, num_processes=2), "notebook_launcher"),
    "fastai": (train_fastai, lambda: notebook_launcher(train_fastai, num_processes=2), "notebook_launcher"),
}
#: What ranch enters around fn, by library (fastai's route: a DDP group made by in_torchddp).
CONTEXTS = {"fastai": in_torchddp}


def time_ranch(fn, reps: int, ctx=None) -> tuple[list[float], list[float]]:
    """Whole-call seconds and launch-to-fn-on-rank-1 seconds, per call."""
    calls, to_fn = [], []
    for _ in range(reps):
        t0 = time.monotonic()
        arrived = ranch(2, fn, ctx=ctx() if ctx else None)
        calls.append(time.monotonic() - t0)
        to_fn.append(arrived[1] - t0)
    return calls, to_fn


def time_launcher(launch, reps: int) -> list[float]:
    calls = []
    for _ in range(reps):
        t0 = time.monotonic()
        launch()
        calls.append(time.monotonic() - t0)
    return calls


def bench(name: str, reps: int) -> tuple[dict, list[Result]]:
    fn, launch, launcher_name = LIBRARIES[name]
    ctx = CONTEXTS.get(name)
    figures: dict = {}

    mpify_nb.set_preload(False)
    ranch(2, fn, ctx=ctx() if ctx else None)  # a template without preloads, warm
    figures["before"], figures["before_to_fn"] = time_ranch(fn, reps, ctx)

    mpify_nb.set_preload(True)
    t0 = time.monotonic()
    ranch(2, fn, ctx=ctx() if ctx else None)  # the first call: rank 1 imports; the template learns it
    ready = template.wait_preloaded(timeout=600)
    figures["preload_seconds"] = time.monotonic() - t0
    ranch(2, fn, ctx=ctx() if ctx else None)  # the first call from the preloaded template
    figures["after"], figures["after_to_fn"] = time_ranch(fn, reps, ctx)
    figures["preload_ready"] = ready

    launch()  # warm
    figures["launcher"] = time_launcher(launch, reps)

    before, after, launcher = (median(figures[k]) for k in ("before", "after", "launcher"))
    before_fn, after_fn = median(figures["before_to_fn"]), median(figures["after_to_fn"])
    print(f"\n{name}: median of {reps} calls")
    for key in ("before", "after", "launcher", "before_to_fn", "after_to_fn"):
        print(f"  {key:14s} {fmt_s(median(figures[key])):>10s}  {fmt_list(figures[key])}")
    print(f"  after/{launcher_name} = {after / launcher:.2f}x   before/after = {before / after:.1f}x   "
          f"launch to fn: {before_fn:.3f} s -> {after_fn:.3f} s   "
          f"first call to preloaded: {figures['preload_seconds']:.1f} s")
    issue = "27" if name == "fastai" else "9.5"
    results = [
        Result(issue, f"{name}: ranch call, preload on / {launcher_name}", after / launcher, "x", "<= 1.5x",
               after / launcher <= 1.5, f"before {fmt_s(before)}, after {fmt_s(after)}, "
               f"{launcher_name} {fmt_s(launcher)}"),
        Result(issue, f"{name}: launch to fn on rank 1, preload on", after_fn, "s", "<= 0.1 s",
               after_fn <= 0.1, f"preload off: {before_fn:.3f} s"),
    ]
    return figures, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 calls per figure instead of 5")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--only", default="accelerate,lightning,hf" + (",fastai" if DistributedDL else ""))
    parser.add_argument("--load", type=int, default=0, metavar="N", help="N busy loops run meanwhile")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    print(machine_line() + (f"; loaded: {args.load} busy loops" if args.load else ""))
    # Busy until this process is gone, however it ends (a kill leaves no loop behind).
    busy = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
    loops = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(args.load)]
    results, raw = [], {}
    try:
        for name in args.only.split(","):
            raw[name], res = bench(name.strip(), reps)
            results += res
    finally:
        for loop in loops:  # ours, by pid
            loop.kill()
            loop.wait()
    template.shutdown()
    if args.json:
        with open(args.json + ".raw", "w") as f:
            json.dump(raw, f, indent=1)
    return finish("Issue 9 point 5: heavy libraries, warm calls", results, args)


if __name__ == "__main__":
    sys.exit(main())
