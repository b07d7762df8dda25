"""import_star: ``from mod import *`` into a namespace (mpify compatibility)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Optional, Union


def import_star(modules: Union[str, Iterable[str]], ns: Optional[dict] = None) -> None:
    """Do ``from <mod> import *`` for each module, into ``ns`` (default: ``__main__``'s globals).

    Inside a rank this fills the rank's ``__main__``; typical use is in a function run by ranch::

        def train():
            import_star(["fastai.vision.all"])
            ...
    """
    if isinstance(modules, str):
        modules = [modules]
    if ns is None:
        ns = sys.modules["__main__"].__dict__
    for name in modules:
        module = importlib.import_module(name)
        public = getattr(module, "__all__", None)
        if public is None:
            public = [n for n in vars(module) if not n.startswith("_")]
        for attr in public:
            ns[attr] = getattr(module, attr)
