"""A corpus of notebook functions that use popular libraries, as people write them in notebooks.

tests/test_corpus.py pastes this text into a notebook cell (so every function here is a notebook
function, module ``__main__``), ships each one to 2 ranks with ``ranch`` and checks that every
rank gets the value the notebook itself gets. Each ``c_*`` function returns something small and
exact (rounded floats, shapes, names) that is the same on every rank.

Libraries: torch, numpy, pandas, scikit-learn, transformers, Lightning (+ torchmetrics), fastai
(tabular, metrics, callbacks, fastcore's patches and transforms), and timm-style model code
(a registry, partial norm layers, DropPath), written here because timm itself is not installed.
"""

import dataclasses
import enum
import functools
import math as m
from collections import namedtuple
from typing import Optional

import lightning as L
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
import torchmetrics
from fastai.callback.core import Callback
from fastai.tabular.all import (
    Categorify,
    Learner,
    Normalize,
    TabularPandas,
    accuracy,
    error_rate,
    mae,
    mse,
    rmse,
)
from fastcore.foundation import L as FL
from fasttransform import Transform
from sklearn.datasets import make_classification
from sklearn.decomposition import PCA
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler
from torch import nn
from transformers import BertConfig, BertModel, get_linear_schedule_with_warmup
from transformers.activations import ACT2FN


def r(x, n=5):
    """Round floats (nested) so ranks compare exactly."""
    if isinstance(x, (list, tuple)):
        return [r(v, n) for v in x]
    if isinstance(x, torch.Tensor):
        return r(x.detach().flatten().tolist(), n)
    return round(float(x), n)


# -- torch -------------------------------------------------------------------------------------

class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def c_sequential_with_a_lambda_layer():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), Lambda(lambda x: F.gelu(x) * 2), nn.Linear(3, 1))
    return r(net(torch.ones(2, 4)))


class TinyNet(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.a = nn.Linear(4, hidden)
        self.b = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))

    @classmethod
    def make(cls):
        torch.manual_seed(1)
        return cls()

    @staticmethod
    def inputs():
        return torch.arange(8.0).reshape(2, 4)


def c_module_subclass_with_super_and_classmethods():
    return r(TinyNet.make()(TinyNet.inputs()))


def c_optimizer_partial_and_scheduler():
    torch.manual_seed(2)
    model = nn.Linear(3, 1)
    make_opt = functools.partial(torch.optim.AdamW, lr=0.1, weight_decay=0.01)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5)
    for _ in range(5):
        loss = model(torch.ones(4, 3)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return r(loss)


@dataclasses.dataclass
class Config:
    n: int = 12
    dim: int = 3
    seed: int = 3


class Squares(torch.utils.data.Dataset):
    def __init__(self, cfg: Config):
        g = torch.Generator().manual_seed(cfg.seed)
        self.x = torch.randn(cfg.n, cfg.dim, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i].pow(2).sum()


def c_dataclass_dataset_and_loader():
    loader = torch.utils.data.DataLoader(Squares(Config()), batch_size=4)
    return [r(y.sum()) for _, y in loader]


def c_all_reduce_in_the_group():
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return r(t)


def even(n):
    return n == 0 or odd(n - 1)


def odd(n):
    return n != 0 and even(n - 1)


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def c_recursion_and_mutual_recursion():
    return [even(10), odd(7), fib(15)]


def chunks(xs, size):
    for i in range(0, len(xs), size):
        yield xs[i:i + size]


def c_notebook_generator():
    return [sum(c) for c in chunks(list(range(10)), 3)]


class Color(enum.Enum):
    RED = 1
    GREEN = 2


Point = namedtuple("Point", "x y")


def c_enum_and_namedtuple():
    p = Point(Color.GREEN.value, 5)
    return [p.x + p.y, Color(1).name]


def with_tensors(x: torch.Tensor, frame: Optional[pd.DataFrame] = None) -> torch.Tensor:
    return x * 2


def c_annotations_name_library_types():
    return r(with_tensors(torch.ones(2)))


def c_module_alias_and_math():
    return r([m.sqrt(16), m.pi])


@functools.lru_cache(maxsize=64)
def slow_square(x):
    return x * x


def c_lru_cached_notebook_function():
    return [slow_square(i) for i in range(5)]


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return ("logged", fn(*args, **kwargs))

    return wrapper


@logged
def add(a, b):
    return a + b


def c_notebook_decorator():
    return list(add(2, 3))


class Activated(nn.Module):
    act = F.gelu  # a library function held by a notebook class

    def forward(self, x):
        return type(self).act(x)


def c_class_attribute_is_a_library_function():
    return r(Activated()(torch.tensor([0.5, -0.5])))


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    @property
    def total(self):
        return self.a + self.b


def c_slots_and_properties():
    return Slotted(2, 5).total


# -- timm-style model code ----------------------------------------------------------------------

_registry = {}


def register_model(fn):
    _registry[fn.__name__] = fn
    return fn


class DropPath(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = torch.rand(x.shape[0], 1, generator=torch.Generator().manual_seed(0)) >= self.p
        return x * keep / (1 - self.p)


class Block(nn.Module):
    def __init__(self, dim, norm_layer=functools.partial(nn.LayerNorm, eps=1e-6), act_layer=nn.GELU, drop_path=0.1):
        super().__init__()
        self.norm = norm_layer(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), act_layer(), nn.Linear(dim * 2, dim))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x):
        return x + self.drop_path(self.mlp(self.norm(x)))


@register_model
def tiny_vit(pretrained=False, **kwargs):
    torch.manual_seed(4)
    return nn.Sequential(*[Block(8, **kwargs) for _ in range(2)])


def create_model(name, **kwargs):
    return _registry[name](**kwargs)


def c_timm_style_registry_and_partial_norm():
    model = create_model("tiny_vit", drop_path=0.2).eval()
    return r(model(torch.ones(2, 8)).sum())


# -- numpy and pandas ----------------------------------------------------------------------------

FRAME = pd.DataFrame({"k": list("abcabc"), "v": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})


def c_pandas_groupby_with_a_lambda():
    return FRAME.groupby("k")["v"].apply(lambda s: s.max() - s.min()).to_dict()


def c_numpy_vectorize_and_random_state():
    rs = np.random.RandomState(5)
    f = np.vectorize(lambda a: a * 3 if a > 0 else 0.0)
    return r(f(rs.randn(4)).tolist())


# -- scikit-learn --------------------------------------------------------------------------------

X, Y = make_classification(n_samples=60, n_features=5, random_state=0)
FITTED = LogisticRegression(max_iter=200).fit(X, Y)  # fitted in the notebook, used on the ranks


def c_sklearn_fit_and_score():
    return r(LogisticRegression(max_iter=200).fit(X, Y).score(X, Y))


def c_sklearn_pipeline_with_a_notebook_transform():
    pipe = make_pipeline(FunctionTransformer(lambda a: a * 2.0), StandardScaler(), PCA(n_components=2),
                         LogisticRegression(max_iter=200))
    return r(cross_val_score(pipe, X, Y, cv=3).tolist())


def c_sklearn_estimator_fitted_in_the_notebook():
    return FITTED.predict(X[:6]).tolist()


# -- transformers --------------------------------------------------------------------------------

def c_transformers_model_from_config():
    torch.manual_seed(6)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    out = BertModel(config).eval()(torch.arange(8).reshape(1, 8))
    return [list(out.last_hidden_state.shape), r(out.last_hidden_state.sum(), 3)]


def c_transformers_schedule_and_activations():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=10)
    lrs = []
    for _ in range(4):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    return r(lrs) + r(ACT2FN["gelu_new"](torch.tensor([1.0])))


# -- Lightning -----------------------------------------------------------------------------------

class LitRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.metric = torchmetrics.MeanSquaredError()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.metric.update(self.layer(x), y)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def c_lightning_module_steps_by_hand():
    L.seed_everything(7, verbose=False)
    model = LitRegressor()
    opt = model.configure_optimizers()
    x = torch.ones(4, 3)
    for i in range(3):
        loss = model.training_step((x, x.sum(1, keepdim=True)), i)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [r(loss), r(model.metric.compute())]


def c_torchmetrics_functional():
    preds = torch.tensor([0, 1, 1, 0])
    target = torch.tensor([0, 1, 0, 0])
    return r(torchmetrics.functional.accuracy(preds, target, task="binary"))


# -- fastai / fastcore ---------------------------------------------------------------------------

def c_fastai_metrics():
    inp = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    targ = torch.tensor([1, 0, 0])
    pred, real = torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.5])
    return r([accuracy(inp, targ), error_rate(inp, targ), mae(pred, real), mse(pred, real), rmse(pred, real)])


def c_fastai_patched_methods_are_there():
    from pathlib import Path

    return [hasattr(Learner, "fit_one_cycle"), hasattr(Learner, "lr_find"), hasattr(Path, "ls")]


class CountBatches(Callback):
    order = 50

    def __init__(self):
        self.count = 0

    def after_batch(self):
        self.count += 1


class Doubler(Transform):
    def encodes(self, x: int):
        return x * 2

    def decodes(self, x: int):
        return x // 2


def c_fastcore_transform_and_list():
    t = Doubler()
    return [t(3), t.decode(8), list(FL(1, 2, 3).map(lambda v: v + 1)), CountBatches().count]


def c_fastai_tabular_pandas():
    df = pd.DataFrame({"a": [1.0, 2.0, 3.0, 4.0], "c": list("xyxy"), "y": [0, 1, 0, 1]})
    to = TabularPandas(df, procs=[Categorify, Normalize], cat_names=["c"], cont_names=["a"], y_names="y")
    return [list(to.xs.columns), r(to.xs["a"].tolist(), 4)]


def c_the_issue_learner_with_accuracy():
    """The issue's repro: a Learner made with ``metrics=accuracy`` inside a notebook function."""
    learn = Learner(None, nn.Linear(2, 2), loss_func=nn.CrossEntropyLoss(), metrics=[accuracy, error_rate],
                    cbs=[CountBatches()])
    return [type(m).__name__ for m in learn.metrics] + [hasattr(learn, "fit_one_cycle")]


# -- the whole corpus ---------------------------------------------------------------------------

CORPUS = [f for name, f in list(globals().items()) if name.startswith("c_") and callable(f)]


def run_corpus(functions):
    """Every function's value by name; an error as the string ``ERROR: ...`` instead."""
    out = {}
    for f in functions:
        try:
            out[f.__name__] = f()
        except Exception as e:  # noqa: BLE001 (a test reports every failing function at once)
            out[f.__name__] = f"ERROR: {type(e).__name__}: {e}"
    return out
