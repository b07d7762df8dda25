"""Tiny training runs with accelerate, Lightning Fabric, Lightning Trainer and HF Trainer.

The same source serves two ways, so results can be compared exactly:

* under torchrun: ``python -m torch.distributed.run --nproc-per-node 2 libraries.py NAME``
  prints one JSON line per rank (``RESULT {...}``);
* in a notebook: the tests paste this file's text into a cell (everything above the
  ``__main__`` block), then run ``ranch(2, train_NAME)``, as a user would.

Each ``train_*`` returns ``{"rank", "losses", "weights"}`` from its own rank. Models are
built from configs (no downloads), data is synthetic, a few steps only.
"""

import os

import torch


def _data(n=32, dim=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def train_accelerate():
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = accelerator.unwrap_model(model).weight.detach().flatten().tolist()
    return {"rank": accelerator.process_index, "losses": losses, "weights": weights}


def train_fabric():
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(_data(), batch_size=4))
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"rank": fabric.global_rank, "losses": losses, "weights": model.weight.detach().flatten().tolist()}


def _lightning_module():
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regressor


def train_lightning():
    import lightning as L

    L.seed_everything(0, verbose=False)
    model = _lightning_module()()
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(_data(), batch_size=4))
    weights = model.layer.weight.detach().flatten().tolist()
    return {"rank": trainer.global_rank, "losses": model.losses, "weights": weights}


def train_hf():
    import tempfile

    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, set_seed

    set_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (40, 8), generator=g)
    data = [{"input_ids": row, "labels": int(row.sum()) % 2} for row in ids]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=5, per_device_train_batch_size=4, logging_steps=1,
                                 report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    weights = model.classifier.weight.detach().flatten().tolist()
    return {"rank": trainer.args.process_index, "losses": losses, "weights": weights}


if __name__ == "__main__":
    import json
    import sys

    result = globals()["train_" + sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)
    # Leave without torch's teardown: a rank that exits while its peer tears the group down
    # can abort in C++ ("terminate called without an active exception", SIGABRT; 2 of 12 torchrun
    # runs on a loaded machine, once in CI), after both had printed their results.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stderr.flush()
    os._exit(0)
