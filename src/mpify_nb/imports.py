"""import_star: ``from mod import *`` into a namespace (mpify compatibility)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Optional, Union


def import_star(modules: Union[str, Iterable[str]], ns: Optional[dict] = None) -> None:
    """Do ``from <mod> import *`` for each module, into ``ns``: by default the globals of
    the code that calls it (a notebook cell's are the notebook's, a function's are its own).

    Typical use is inside a function run by ranch (a notebook cell):

    ```python
    import torch
    from mpify_nb import import_star, ranch

    def train():
        import_star(["torch.nn.functional"])   # relu, softmax... now globals of train
        return relu(torch.tensor([-1.0, 2.0])).tolist()  # noqa: F821

    ranch(2, train)
    ```

    ```output
    [[0.0, 2.0], [0.0, 2.0]]
    ```
    """
    if isinstance(modules, str):
        modules = [modules]
    if ns is None:
        ns = sys._getframe(1).f_globals
    for name in modules:
        module = importlib.import_module(name)
        public = getattr(module, "__all__", None)
        if public is None:
            public = [n for n in vars(module) if not n.startswith("_")]
        for attr in public:
            ns[attr] = getattr(module, attr)
