"""torch.distributed process groups: what ``in_torchddp`` (ddp.py), ``ranch`` (launcher.py), a
Session (session.py) and its ranks (session_rank.py) all need of them.

* ``parse_gpus``: GPU ids by rank, as ``gpus=`` gives them (``"3,1"``, ``[3, 1]``);
* ``listen_on``: the rendezvous store's listening socket, on one address only (a TCPStore
  given just a port listens on every interface);
* ``group_count`` / ``set_group_count``: torch's count of groups made in this process, put
  back after a failed ``init_process_group`` (torch names a group's store keys after it);
* ``disarm_ended_ddp``: a DistributedDataParallel model left in the notebook by a call whose
  group has ended fails at once, clearly, when used.

torch is never imported here at module level: the caller may not have imported it yet.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any, Optional, Union

GpuSpec = Union[str, Sequence[int], None]


def parse_gpus(gpus: GpuSpec) -> Optional[list[int]]:
    """GPU ids by rank (``"3,1"``, ``[3, 1]``, ``3``) as a list, checked; None stays None."""
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


def listen_on(addr: str, port: int, backlog: int) -> Any:
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


ENDED_GROUP_MESSAGE = (
    "this DistributedDataParallel model was made on the process group of a ranch call (or a %%ranch --ddp "
    "cell) that has ended: that group ended with the call and its other ranks are gone, so the model "
    "cannot run its collectives here. Use its .module (the trained model itself, e.g. model.module(x)), "
    "or wrap it in DistributedDataParallel again inside a new call."
)


def disarm_ended_ddp(roots: Sequence[Any]) -> int:
    """After a call whose process group ended: make each DistributedDataParallel model found in
    ``roots`` (and one level inside them: containers, attributes) fail at once with a clear
    RuntimeError when used, instead of gloo's "Connection closed by peer" (or a hang) when it
    tries to talk to ranks that are gone. Returns how many were found."""
    torch = sys.modules.get("torch")
    parallel = sys.modules.get("torch.nn.parallel")
    if torch is None or parallel is None:
        return 0
    ddp_type = parallel.DistributedDataParallel
    found = 0
    seen: set[int] = set()
    for obj in _one_level_down(roots):
        if issubclass(type(obj), ddp_type) and id(obj) not in seen:
            seen.add(id(obj))
            if not getattr(obj, "_mpify_group_ended", False):
                obj._mpify_group_ended = True
                obj.register_forward_pre_hook(_refuse_ended_group)
            found += 1
    return found


def _refuse_ended_group(module, args) -> None:
    raise RuntimeError(ENDED_GROUP_MESSAGE)


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
