"""in_torchddp / TorchDDPCtx: a torch.distributed process group for the ranks of a call.

Used three ways::

    ranch(4, train, cfg, ctx=in_torchddp())   # the group is up around train() on every rank
    in_torchddp(4, train, cfg)                # launcher form (mpify): returns rank 0's value
    def train(cfg):
        with in_torchddp():                   # inside a rank, or any process with RANK/WORLD_SIZE
            ...

Rendezvous: under ``ranch`` the TCPStore is hosted by a *spawned* rank
(``MPIFY_NB_STORE_RANK``), never by the caller. If any rank dies before joining,
the launcher kills the ranks, the store goes with them, and a caller blocked in
``init_process_group`` gets an error at once instead of waiting 30 minutes.
Outside ``ranch`` it is the usual ``env://`` rendezvous.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

GpuSpec = Union[str, Sequence[int], None]


def _parse_gpus(gpus: GpuSpec) -> Optional[list[int]]:
    if gpus is None:
        return None
    if isinstance(gpus, str):
        parts = [p for p in gpus.replace(" ", "").split(",") if p]
        try:
            ids = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"gpus must list GPU ids like '3,1', not {gpus!r}") from None
    elif isinstance(gpus, int):
        ids = [int(gpus)]
    else:
        ids = [int(g) for g in gpus]
    if not ids:
        raise ValueError("gpus is empty: give at least one GPU id, or leave it None")
    if any(i < 0 for i in ids):
        raise ValueError(f"GPU ids cannot be negative: {ids}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"gpus lists a GPU twice ({ids}): each rank needs its own GPU")
    return ids


class TorchDDPCtx:
    """Context manager that sets up a ``torch.distributed`` default process group on entry
    and destroys it on exit, restoring the process's CUDA device and environment.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... Default: ``nccl`` when the rank has a GPU, else ``gloo``.
        gpus: GPU ids by rank, e.g. ``"3,1"`` (rank 0 on GPU 3, rank 1 on GPU 1). Default: rank i
            on GPU i when CUDA is available and the backend is not gloo-on-CPU. Ids are as torch
            sees them in the caller (after its ``CUDA_VISIBLE_DEVICES``).
        timeout: seconds for collectives (torch's default when None).
    """

    def __init__(self, backend: Optional[str] = None, gpus: GpuSpec = None, timeout: Optional[float] = None):
        self.backend = backend
        self.gpus = _parse_gpus(gpus)
        self.timeout = timeout
        self._saved: list[tuple[Optional[int], bool]] = []
        self._store: Any = None

    def __getstate__(self) -> dict:
        return {"backend": self.backend, "gpus": self.gpus, "timeout": self.timeout}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.backend, self.gpus, self.timeout = state["backend"], state["gpus"], state["timeout"]

    def __repr__(self) -> str:
        return f"TorchDDPCtx(backend={self.backend!r}, gpus={self.gpus!r}, timeout={self.timeout!r})"

    # Called by ranch in the caller before any rank starts: bad options fail here, clearly.
    def _mpify_prepare(self, nprocs: int, caller_rank: Optional[int]) -> None:
        import torch

        if self.gpus is not None and len(self.gpus) < nprocs:
            raise ValueError(f"gpus={self.gpus} names {len(self.gpus)} GPUs for {nprocs} ranks: "
                             "give one GPU id per rank")
        wants_gpu = self.gpus is not None or self.backend == "nccl"
        if not wants_gpu:
            return
        from . import placement

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

    # Called by a rank of ranch after it loaded the call, before it reports ready: the rank
    # that hosts the rendezvous store opens it now, so no one connects to a closed port
    # (TCPStore clients that do back off for ~0.7 s).
    def _mpify_rank_setup(self) -> None:
        store_rank = os.environ.get("MPIFY_NB_STORE_RANK")
        if store_rank is None or os.environ.get("RANK") != store_rank:
            return
        self._store = _make_store(is_master=True)

    def device_for(self, local_rank: int) -> Optional[int]:
        """The GPU id this rank uses, or None for CPU."""
        import torch

        if self.gpus is not None:
            if local_rank >= len(self.gpus):
                raise ValueError(f"gpus={self.gpus} has no GPU for local rank {local_rank}")
            return self.gpus[local_rank]
        if self.backend not in (None, "nccl"):
            return None
        if self.backend == "nccl" or torch.cuda.is_available():
            count = torch.cuda.device_count()
            if 0 < count <= local_rank:
                # Fewer GPUs visible than the local rank: each rank was given its own (Ray sets
                # CUDA_VISIBLE_DEVICES per rank), so its GPUs are numbered from 0 here.
                return local_rank % count
            return local_rank
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
        store_rank = os.environ.get("MPIFY_NB_STORE_RANK")
        groups_before = group_count()
        try:
            if store_rank is not None:
                store = getattr(self, "_store", None)
                self._store = None
                kwargs["store"] = store or _make_store(is_master=rank == int(store_rank))
            else:
                kwargs["init_method"] = "env://"
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
                dist.destroy_process_group()
        finally:
            self._restore_device()

    def _restore_device(self) -> None:
        if not self._saved:
            return
        previous, changed = self._saved.pop()
        if changed and previous is not None:
            import torch

            torch.cuda.set_device(previous)


ENDED_GROUP_MESSAGE = (
    "this DistributedDataParallel model was made on the process group of a ranch call (or a %%ranch --ddp "
    "cell) that has ended: that group ended with the call and its other ranks are gone, so the model "
    "cannot run its collectives here. Use its .module (the trained model itself, e.g. model.module(x)), "
    "or wrap it in DistributedDataParallel again inside a new call."
)
FSDP_ENDED_MESSAGE = (
    "this FSDP module (fully_shard) was sharded on the process group of a ranch call (or a %%ranch --ddp "
    "cell) that has ended: the other ranks, which hold the rest of its parameters, are gone with that group, "
    "so it cannot gather them here. Gather what you need inside the call (e.g. get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True)) from torch.distributed.checkpoint.state_dict), or "
    "shard a new model inside a new call."
)
MESH_ENDED_MESSAGE = (
    "this DeviceMesh (or a DTensor on it) was made on the process group of a ranch call (or a %%ranch --ddp "
    "cell) that has ended: that group ended with the call and its other ranks are gone, so it cannot run "
    "collectives here. A DTensor's own shard is its .to_local(); gather a full tensor (.full_tensor()) "
    "inside the call."
)


def disarm_ended_ddp(roots: Sequence[Any]) -> int:
    """After a call whose process group ended: make each object found in ``roots`` (and one level
    inside them: containers, attributes) that needs that group fail at once with a clear
    RuntimeError when used, instead of gloo's "Connection closed by peer" (or a hang, or torch's
    "Could not resolve the process group") when it tries to talk to ranks that are gone:
    DistributedDataParallel and FSDP2 (``fully_shard``) modules when called, DeviceMeshes and
    DTensors (through their mesh) when they need a collective. Returns how many were found."""
    torch = sys.modules.get("torch")
    parallel = sys.modules.get("torch.nn.parallel")
    if torch is None or parallel is None:
        return 0
    ddp_type = parallel.DistributedDataParallel
    # Only when the call imported them: a notebook that never used FSDP or DTensor has none.
    fsdp_type = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    dtensor_type = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    mesh_type = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    found = 0
    seen: set[int] = set()
    for obj in _one_level_down(roots):
        if id(obj) in seen:
            continue
        kind = type(obj)
        if issubclass(kind, ddp_type):
            _refuse_calls(obj, ENDED_GROUP_MESSAGE)
        elif fsdp_type is not None and issubclass(kind, fsdp_type):
            for module in obj.modules():  # each FSDP submodule gathers its own parameters
                if isinstance(module, fsdp_type):
                    _refuse_calls(module, FSDP_ENDED_MESSAGE)
            if dtensor_type is not None:
                for parameter in obj.parameters():
                    if isinstance(parameter, dtensor_type):
                        _refuse_collectives(parameter.device_mesh)
        elif dtensor_type is not None and issubclass(kind, dtensor_type):
            _refuse_collectives(obj.device_mesh)
        elif mesh_type is not None and issubclass(kind, mesh_type):
            _refuse_collectives(obj)
        else:
            continue
        seen.add(id(obj))
        found += 1
    return found


def _refuse_calls(module: Any, message: str) -> None:
    if not getattr(module, "_mpify_group_ended", False):
        module._mpify_group_ended = message
        # In front of the module's own hooks: FSDP's pre-forward hook is where it gathers.
        module.register_forward_pre_hook(_refuse_ended_group, prepend=True)


def _refuse_ended_group(module, args) -> None:
    raise RuntimeError(module._mpify_group_ended)


class _EndedGroupNames(list):
    """A DeviceMesh's group names, once its groups ended: every collective on the mesh (a
    DTensor's ``full_tensor``, ``redistribute``, ``mesh.get_group()``) looks its group up by
    index here, and gets the reason instead. Iterating (pickling the mesh) still works."""

    def __getitem__(self, index: Any) -> Any:
        raise RuntimeError(MESH_ENDED_MESSAGE)


def _refuse_collectives(mesh: Any) -> None:
    names = getattr(mesh, "_dim_group_names", None)  # private to torch: guarded, as is its type
    if type(names) is list:
        mesh._dim_group_names = _EndedGroupNames(names)


def _one_level_down(roots: Sequence[Any]):
    """``roots``, and what they hold one level down: items of lists, tuples, sets and dicts, and
    attributes of objects whose class the notebook defined (a trainer of its own). By type only:
    no attribute of a library object is read (some warn, or do work, when touched)."""
    for root in roots:
        yield root
        for child in _held_by(root):
            yield child
            if type(child) in (list, tuple, dict):  # e.g. {"model": ddp} or [ddp, opt]
                yield from _held_by(child)


def _held_by(obj: Any) -> list:
    kind = type(obj)
    if kind is dict:
        return list(itertools.islice(obj.values(), 10000))  # a million-item list is not worth a look
    if kind in (list, tuple, set):
        return list(itertools.islice(obj, 10000))
    if kind.__module__ == "__main__" and not isinstance(obj, type):
        try:
            attributes = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return []
        return list(itertools.islice(attributes.values(), 10000)) if type(attributes) is dict else []
    return []


def group_count() -> Optional[int]:
    """torch's count of process groups made in this process (private, hence guarded)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._world.group_count
    except (ImportError, AttributeError):
        return None


def set_group_count(count: Optional[int]) -> None:
    """Undo the count a failed ``init_process_group`` left behind. torch names a group's
    store keys after it, so a stale count makes the next rendezvous in this process wait,
    until its timeout, for peers that use fresh names."""
    if count is None:
        return
    try:
        from torch.distributed import distributed_c10d

        distributed_c10d._world.group_count = count
    except (ImportError, AttributeError):
        pass


def _make_store(is_master: bool) -> Any:
    """The rendezvous TCPStore of a ranch call. Its server listens on MASTER_ADDR only
    (loopback under ranch): by default TCPStore would listen on every interface."""
    # Public API (torch.distributed.TCPStore), re-exported from a private module without __all__.
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world_size = int(os.environ["WORLD_SIZE"])
    if not is_master:
        return TCPStore(addr, port, world_size, is_master=False)
    # The store owns the listening socket from here on, and closes it.
    return TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False,
                    master_listen_fd=_listen_on(addr, port, world_size * 2).detach())


def _listen_on(addr: str, port: int, backlog: int) -> Any:
    """A socket listening on ``addr:port`` only, for a TCPStore's server (which, given just
    a port, would listen on every interface)."""
    import socket

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener


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

    Example (a notebook cell)::

        def train(epochs):
            model = DDP(Net())
            ...
            return accuracy
        in_torchddp(2, train, 5)     # -> rank 0's accuracy
    """
    if nprocs is None:
        if fn is not None or args or kwargs:
            raise TypeError("in_torchddp(): give nprocs and fn to launch, or nothing to get a context manager")
        return TorchDDPCtx(backend=backend, gpus=gpus)
    if fn is None:
        raise TypeError("in_torchddp(nprocs, fn, ...): fn is missing")
    from .launcher import ranch

    if "ctx" in kwargs:
        raise TypeError("in_torchddp(nprocs, fn, ...) makes its own ctx; use ranch(..., ctx=...) to pass one")
    if "gather" in kwargs:
        raise TypeError("in_torchddp(nprocs, fn, ...) returns rank 0's value; use ranch(..., gather=True) for all")
    return ranch(nprocs, fn, *args, ctx=TorchDDPCtx(backend=backend, gpus=gpus), gather=True, **kwargs)[0]
