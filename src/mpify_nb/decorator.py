"""@distributed: a function that runs on N ranks whenever it is called."""

from __future__ import annotations

import functools
from typing import Any, Callable

from .ddp import TorchDDPCtx
from .launcher.ranch import ranch


def distributed(nprocs: int, *, ddp: bool = False, **ranch_options: Any) -> Callable[[Callable], Callable]:
    """Decorate a function so that calling it runs it on ``nprocs`` ranks.

    The call returns what ``ranch`` returns (the list of per-rank values, or the
    caller's value with ``gather=False``). ``ddp=True`` wraps it in ``in_torchddp()``;
    other keywords are ``ranch`` options (``caller_rank``, ``gather``, ``timeout``, ``ctx``...).

    Example (a notebook cell):

    ```python
    from mpify_nb import distributed

    @distributed(2, ddp=True)
    def world():
        import torch.distributed as dist
        return dist.get_world_size()

    world()
    ```

    ```output
    [2, 2]
    ```
    """
    if ddp and "ctx" in ranch_options:
        raise TypeError("distributed(): pass ddp=True or ctx=..., not both")
    if ddp:
        ranch_options["ctx"] = TorchDDPCtx()

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"@distributed decorates a function, not {type(fn).__name__}")

        @functools.wraps(fn)
        def run_on_ranks(*args: Any, **kwargs: Any) -> Any:
            return ranch(nprocs, fn, *args, **ranch_options, **kwargs)

        run_on_ranks.nprocs = nprocs  # type: ignore[attr-defined]
        run_on_ranks.local = fn  # type: ignore[attr-defined]  (the plain function, to call in-process)
        return run_on_ranks

    return decorate
