"""in_torchddp / TorchDDPCtx: a torch.distributed process group for the ranks of a call.

Used three ways::

    ranch(4, train, cfg, ctx=in_torchddp())   # the group is up around train() on every rank
    in_torchddp(4, train, cfg)                # launcher form (mpify): returns rank 0's value
    def train(cfg):
        with in_torchddp():                   # inside a rank, or any process with RANK/WORLD_SIZE
            ...

Rendezvous: the usual ``env://``. Under ``ranch`` it goes to the call's store, hosted by a
*spawned* rank, never by the caller (torchdist/rendezvous.py): if any rank dies before joining,
the launcher kills the ranks, the store goes with them, and a caller blocked in
``init_process_group`` gets an error at once instead of waiting 30 minutes.

What ``ranch`` and a Session share with this module about groups (GPU ids, the store's
listening socket, torch's group count) is in torchdist/groups.py, below all three.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any, Callable, Optional

from .torchdist import compat
from .torchdist.groups import GpuSpec, group_count, parse_gpus, set_group_count


class TorchDDPCtx:
    """Context manager that sets up a ``torch.distributed`` default process group on entry
    and destroys it on exit, restoring the process's CUDA device and environment.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... Default: ``nccl`` when the rank has a GPU, else ``gloo``.
        gpus: GPU ids by rank, e.g. ``"3,1"`` (rank 0 on GPU 3, rank 1 on GPU 1). Default: rank i
            on GPU i when CUDA is available and the backend is not gloo-on-CPU. Ids are as torch
            sees them in the caller (after its ``CUDA_VISIBLE_DEVICES``).
        timeout: seconds for collectives (torch's default when None).

    ``in_torchddp()`` returns one; ``TorchDDPCtx`` is the class (mpify's name for it).

    Example (a notebook cell):

    ```python
    import torch.distributed as dist
    from mpify_nb import ranch, TorchDDPCtx

    def backend_and_size():
        return dist.get_backend(), dist.get_world_size()

    ranch(2, backend_and_size, ctx=TorchDDPCtx(backend="gloo"))
    ```

    ```output
    [('gloo', 2), ('gloo', 2)]
    ```
    """

    def __init__(self, backend: Optional[str] = None, gpus: GpuSpec = None, timeout: Optional[float] = None):
        self.backend = backend
        self.gpus = parse_gpus(gpus)
        self.timeout = timeout
        self._saved: list[tuple[Optional[int], bool]] = []
        self._on_cpu = False  # fewer GPUs here than ranks: every rank on CPU (_mpify_prepare)

    def __getstate__(self) -> dict:
        return {"backend": self.backend, "gpus": self.gpus, "timeout": self.timeout, "on_cpu": self._on_cpu}

    def __setstate__(self, state: dict) -> None:  # in a rank: no warm-up of the notebook's DDP here
        self.backend, self.gpus, self.timeout = state["backend"], state["gpus"], state["timeout"]
        self._saved = []
        self._on_cpu = state.get("on_cpu", False)

    def __repr__(self) -> str:
        return f"TorchDDPCtx(backend={self.backend!r}, gpus={self.gpus!r}, timeout={self.timeout!r})"

    # Called by ranch in the caller before any rank starts: bad options fail here, clearly.
    def _mpify_prepare(self, nprocs: int, caller_rank: Optional[int]) -> None:
        import torch

        if self.gpus is not None and len(self.gpus) < nprocs:
            raise ValueError(f"gpus={self.gpus} names {len(self.gpus)} GPUs for {nprocs} ranks: "
                             "give one GPU id per rank")
        from .start import placement

        wants_gpu = self.gpus is not None or self.backend == "nccl"
        if not wants_gpu:
            # By default a rank takes the GPU of its local rank, when every rank of this machine
            # can have its own (two ranks on one GPU cannot share an NCCL group); else all run on
            # CPU with gloo, as a Session's ranks do. Under Ray each rank is given its own GPU.
            count = torch.cuda.device_count() if self.backend is None and torch.cuda.is_available() else 0
            if 0 < count < nprocs and placement.get_placement() == "local":
                self._on_cpu = True
                warnings.warn(f"{nprocs} ranks and {count} GPU(s) here: every rank runs on CPU with gloo; "
                              "pass gpus= (one id per rank) or backend='nccl' to choose", stacklevel=3)
            return

        if placement.get_placement() == "ray":
            if self.gpus is not None:
                raise ValueError(f"in_torchddp(gpus={self.gpus}) names GPUs of this machine, and the ranks are "
                                 "placed on a Ray cluster: ask Ray for them with set_placement('ray', num_gpus=1)")
            return  # the GPUs are on the nodes: Ray's placement group reserves them
        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError(f"in_torchddp(backend={self.backend!r}, gpus={self.gpus}) needs CUDA GPUs, "
                               "and torch sees none here; use backend='gloo' to run on CPU")
        ids = self.gpus if self.gpus is not None else list(range(nprocs))
        bad = [i for i in ids[:nprocs] if i >= count]
        if bad:
            raise ValueError(f"GPU id(s) {bad} do not exist: torch sees {count} GPU(s) (ids 0..{count - 1})"
                             + ("" if self.gpus is not None else f"; {nprocs} ranks need {nprocs} GPUs, "
                                "pass gpus= to choose them or backend='gloo'"))

    def device_for(self, local_rank: int) -> Optional[int]:
        """The GPU id this rank uses, or None for CPU."""
        import torch

        if self.gpus is not None:
            if local_rank >= len(self.gpus):
                raise ValueError(f"gpus={self.gpus} has no GPU for local rank {local_rank}")
            return self.gpus[local_rank]
        if self.backend not in (None, "nccl") or self._on_cpu:
            return None
        if self.backend == "nccl" or torch.cuda.is_available():
            count = torch.cuda.device_count()
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
            if count >= local_world or self.backend == "nccl" and local_rank < count:
                return local_rank
            if count > 0 and os.environ.get("CUDA_VISIBLE_DEVICES"):
                # Fewer GPUs visible than ranks here, and a device list given: each rank was
                # given its own (Ray sets CUDA_VISIBLE_DEVICES per rank), numbered from 0.
                return local_rank % count
            if self.backend == "nccl":
                return local_rank  # asked for: torch says why it cannot be
            # Not a GPU each: every rank of this machine on CPU (one backend for all), as
            # _mpify_prepare decides for ranch; two ranks cannot share one GPU's NCCL group.
        return None

    def __enter__(self) -> TorchDDPCtx:
        import torch
        import torch.distributed as dist

        try:
            rank = int(os.environ["RANK"])
            world_size = int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError):
            raise RuntimeError("in_torchddp() needs RANK and WORLD_SIZE in the environment: use it inside "
                               "ranch(...), or launch with torchrun") from None
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group is already initialized in this process; "
                               "in_torchddp() would replace it (destroy it first)")
        device = self.device_for(local_rank)
        previous = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        if device is not None:
            torch.cuda.set_device(device)
        self._saved.append((previous, device is not None))
        backend = self.backend or ("nccl" if device is not None else "gloo")
        kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size}
        if self.timeout is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=self.timeout)
        kwargs["init_method"] = "env://"  # under ranch: the call's store (torchdist/rendezvous.py)
        groups_before = group_count()
        try:
            with compat.quiet_gloo_banner():
                dist.init_process_group(**kwargs)
        except BaseException:
            set_group_count(groups_before)
            self._restore_device()
            raise
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                compat.destroy_process_group()  # torch < 2.8's gloo could deadlock in destroy_process_group
        finally:
            self._restore_device()

    def _restore_device(self) -> None:
        if not self._saved:
            return
        previous, changed = self._saved.pop()
        if changed and previous is not None:
            import torch

            torch.cuda.set_device(previous)


def in_torchddp(
    nprocs: Optional[int] = None,
    fn: Optional[Callable] = None,
    *args: Any,
    backend: Optional[str] = None,
    gpus: GpuSpec = None,
    **kwargs: Any,
) -> Any:
    """A DDP process group around your code.

    ``in_torchddp()`` (no nprocs) returns a ``TorchDDPCtx`` context manager: pass it as
    ``ranch(..., ctx=in_torchddp())``, or use ``with in_torchddp():`` inside a rank.

    ``in_torchddp(nprocs, fn, *args, **kwargs)`` runs ``fn`` on ``nprocs`` ranks inside the
    group and returns rank 0's value (mpify's launcher form). ``ranch`` options
    (``caller_rank``, ``need``, ``imports``, ``timeout``) are accepted; other keywords go to ``fn``.

    Example (a notebook cell): learn ``y = 2x`` on 2 ranks (on their GPUs when there are enough):

    ```python
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from mpify_nb import in_torchddp

    def train(steps):
        device = "cuda" if torch.cuda.is_available() else "cpu"   # in_torchddp set this rank's GPU
        model = DDP(torch.nn.Linear(1, 1, bias=False).to(device))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.linspace(-1, 1, 32, device=device).unsqueeze(1)
        for _ in range(steps):
            loss = (model(x) - 2 * x).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        return round(model.module.weight.item(), 3)

    in_torchddp(2, train, 100)       # rank 0's value
    ```

    ```output
    2.0
    ```
    """
    if nprocs is None:
        if fn is not None or args or kwargs:
            raise TypeError("in_torchddp(): give nprocs and fn to launch, or nothing to get a context manager")
        return TorchDDPCtx(backend=backend, gpus=gpus)
    if fn is None:
        raise TypeError("in_torchddp(nprocs, fn, ...): fn is missing")
    from .launcher.ranch import ranch

    if "ctx" in kwargs:
        raise TypeError("in_torchddp(nprocs, fn, ...) makes its own ctx; use ranch(..., ctx=...) to pass one")
    if "gather" in kwargs:
        raise TypeError("in_torchddp(nprocs, fn, ...) returns rank 0's value; use ranch(..., gather=True) for all")
    return ranch(nprocs, fn, *args, ctx=TorchDDPCtx(backend=backend, gpus=gpus), gather=True, **kwargs)[0]
