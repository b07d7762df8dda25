"""fastai.vision through ``ranch(..., ctx=in_torchddp())``: a check by hand, not in CI.

PyPI's torchvision fails to import beside the CPU torch 2.13 wheel the suite uses, so this runs in
a venv where torch and torchvision match (a CUDA build, which runs on CPU)::

    python3 -m venv /work/venvs/fastai-vision
    /work/venvs/fastai-vision/bin/pip install torch==2.14.1 torchvision==0.29.1 fastai accelerate dill ipython numpy
    PYTHONPATH=$PWD/src MPIFY_NB_PRELOAD=0 /work/venvs/fastai-vision/bin/python tests/scripts/fastai_vision_check.py

Its functions are this script's ``__main__``, so they travel by value as a notebook's do. It
trains a ``vision_learner`` (resnet18, not pretrained: nothing downloaded) on generated images
for one epoch, twice, and prints each rank's last recorder row; both ranks must agree.
"""

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from fastai.distributed import DistributedDL
from fastai.vision.all import (
    ImageDataLoaders,
    PILImage,
    Resize,
    accuracy,
    error_rate,
    resnet18,
    set_seed,
    vision_learner,
)

from mpify_nb import in_torchddp, ranch


def broadcast_on_cpu(self, t, rank):
    t = torch.LongTensor(t)
    torch.distributed.broadcast(t, rank)
    return t.tolist()


def make_images(where, n=48):
    rng = np.random.default_rng(0)
    paths, labels = [], []
    for i in range(n):
        label = i % 2
        image = (rng.random((16, 16, 3)) * 100 + label * 120).astype(np.uint8)
        path = Path(where) / f"img{i}.png"
        PILImage.create(image).save(path)
        paths.append(path)
        labels.append(str(label))
    return paths, labels


def train(where):
    DistributedDL._broadcast = broadcast_on_cpu
    set_seed(0, reproducible=True)
    paths, labels = make_images(where)
    dls = ImageDataLoaders.from_lists(where, paths, labels, valid_pct=0.25, seed=0, bs=8,
                                      item_tfms=Resize(16), device="cpu", num_workers=0)
    learn = vision_learner(dls, resnet18, pretrained=False, metrics=[accuracy, error_rate], n_out=2)
    with learn.distrib_ctx(sync_bn=False, cpu=True):
        learn.fit_one_cycle(1, 1e-3)
    return [float(v) for v in learn.recorder.values[-1]], len(Path(where).ls())  # fastcore's Path.ls


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as where:
        for _ in range(2):
            start = time.monotonic()
            results = ranch(2, train, where, ctx=in_torchddp())
            print("RESULT", results, f"{time.monotonic() - start:.1f} s")
            assert results[0] == results[1], results
