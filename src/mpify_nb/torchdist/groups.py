"""torch.distributed process groups: what ``in_torchddp`` (ddp.py), ``ranch`` (launcher/call.py), a
Session (session/session.py) and its ranks (rank/session.py) all need of them.

* ``parse_gpus``: GPU ids by rank, as ``gpus=`` gives them (``"3,1"``, ``[3, 1]``);
* ``listen_on``: the rendezvous store's listening socket, on one address only (a TCPStore
  given just a port listens on every interface);
* ``group_count`` / ``set_group_count``: torch's count of groups made in this process, put
  back after a failed ``init_process_group`` (torch names a group's store keys after it);
* ``disarm_ended_ddp``: a DistributedDataParallel model left in the notebook by a call whose
  group has ended fails at once, clearly, when used;
* ``forget_ended_groups``: the ended groups torch itself keeps alive (its functions' defaults),
  let go of, so their sockets close;
* ``keep_groups`` / ``release_ended_groups``: every group a rank makes is held here too, so that
  no C++ owner (a DDP model's Reducer) destroys it with the GIL held, which deadlocks in torch;
  an ended group torch's own objects still hold (a DeviceMesh, FSDP2's mesh info) is taken from
  them first, so it goes, its gloo listener with it.

torch is never imported here at module level: the caller may not have imported it yet.
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Sequence
from typing import Any, Optional, Union

from . import compat

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
    fsdp_type = compat.fsdp_module_type()
    dtensor_type = compat.dtensor_type()
    mesh_type = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    found = 0
    seen: set[int] = set()
    for obj in _one_level_down(roots):
        if id(obj) in seen:
            continue
        kind = type(obj)
        if issubclass(kind, ddp_type):
            _refuse_calls(obj, ENDED_GROUP_MESSAGE)
            _let_go_of_group(obj)
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
        elif dtensor_type is not None and issubclass(kind, torch.nn.Module):  # tensor parallel's
            meshes = [p.device_mesh for p in obj.parameters() if isinstance(p, dtensor_type)]
            if not meshes:
                continue
            for mesh in meshes:
                _refuse_collectives(mesh)
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


#: What a DistributedDataParallel holds its group by: the Reducer and the Logger (C++, each holds
#: the group) and the group itself.
_DDP_GROUP_HOLDERS = ("logger", "reducer", "process_group")


def _let_go_of_group(model: Any) -> None:
    """An ended DDP model left in the notebook (a %%ranch cell's ``model``) kept its group, and the
    group's gloo listener with it: the notebook listened on a port after the call. Dropped while
    :func:`keep_groups` still holds the group (the Reducer's destructor then does not free it, with
    the GIL held). ``.module`` stays; calling the DDP is refused anyway."""
    for name in _DDP_GROUP_HOLDERS:
        if getattr(model, name, None) is not None:
            try:
                setattr(model, name, None)
            except Exception:
                pass  # only a listener is left open


def _refuse_ended_group(module, args) -> None:
    raise RuntimeError(module._mpify_group_ended)


class _EndedGroupNames(list):
    """A DeviceMesh's group names (torch < 2.8: its group infos), once its groups ended: every
    collective on the mesh (a DTensor's ``full_tensor``, ``redistribute``, ``mesh.get_group()``)
    looks its group up by index here, and gets the reason instead. Iterating (pickling the mesh)
    still works.

    Unless a group of that name is up again: DTensor's sharding caches keep this mesh, and hand it
    to the DTensors of a later call's equal mesh (a module-level tensor-parallel script in %%ranch,
    run again), whose group, made afresh, has the same name; refused, that run failed."""

    def __getitem__(self, index: Any) -> Any:
        found = super().__getitem__(index)
        if isinstance(index, int) and _group_name_is_up(found):
            return found
        raise RuntimeError(MESH_ENDED_MESSAGE)


def _group_name_is_up(entry: Any) -> bool:
    """Is the group a mesh's entry names (a name; torch < 2.8: (tag, ranks, name)) up now?"""
    name = entry[2] if isinstance(entry, tuple) and len(entry) == 3 else entry
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        return isinstance(name, str) and name in c10d._world.pg_names.values()  # type: ignore[union-attr]
    except AttributeError:
        return False


def _refuse_collectives(mesh: Any) -> None:
    name = compat.mesh_group_names_attribute(mesh)  # private to torch, and named by version
    if name is not None:
        setattr(mesh, name, _EndedGroupNames(getattr(mesh, name)))


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


def forget_ended_groups() -> int:
    """Let go of the ended process groups torch keeps alive itself; return how many were held.

    ``torch.distributed.nn.functional`` writes ``group=group.WORLD`` in its functions'
    signatures: imported while a group is up (``torch._dynamo`` imports it, and DDP imports
    ``torch._dynamo``), it holds that group for good. After ``destroy_process_group`` the group
    then lives on, its gloo listener and its store with it: a notebook that ran a DDP call kept
    listening. Each default that holds a group no longer in torch's table becomes None, what an
    import with no group gives (torch's functions read None as the default group)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    group_type = getattr(c10d, "ProcessGroup", None)
    if c10d is None or not isinstance(group_type, type):
        return 0
    try:
        live = {id(g) for g in c10d._world.pg_map}
    except AttributeError:
        return 0
    ended: list = []

    def without_ended(values: tuple) -> tuple:
        for v in values:
            if isinstance(v, group_type) and id(v) not in live and not any(v is e for e in ended):
                ended.append(v)
        return tuple(None if isinstance(v, group_type) and id(v) not in live else v for v in values)

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch.distributed" or name.startswith("torch.distributed.")):
            continue
        for value in list(vars(module).values()):
            if type(value) is not types.FunctionType:
                continue
            if value.__defaults__ and any(isinstance(v, group_type) for v in value.__defaults__):
                value.__defaults__ = without_ended(value.__defaults__)
            kw = value.__kwdefaults__
            if kw and any(isinstance(v, group_type) for v in kw.values()):
                value.__kwdefaults__ = dict(zip(kw, without_ended(tuple(kw.values()))))
    if ended:
        backends = compat._backends_of(ended)  # destroyed with the GIL released (compat.destroy_process_group)
        count = len(ended)
        ended.clear()
        while backends:
            backends.pop()
        return count
    return 0


#: (group, its backends) of every group made in this process since keep_groups(), until released.
_kept: list[tuple[Any, list]] = []
_original_helper: Any = None
#: How many groups this process has made since keep_groups() (a call that made none has nothing to let go of).
made = 0


def keep_groups() -> None:
    """Hold every process group this process makes from now on, and its backends (idempotent;
    nothing until torch.distributed is imported).

    A DDP model's Reducer (C++, freed with the GIL held when the model is) may be the last owner
    of a group its script destroyed: torch then runs ``~ProcessGroupGloo`` with the GIL held, which
    joins gloo's worker threads, and one that is freeing the last collective's work waits for the
    GIL (``~AsyncWork -> ~ThreadLocalState -> SafePyObject decref``): the process hangs for good,
    with the GIL held, so no timeout or interrupt can act (about 1 time in 4 with a script that
    trains, destroys its group and returns). Held here, the group outlives the Reducer; a backend
    dropped by :func:`release_ended_groups` is destroyed with the GIL released (compat)."""
    global _original_helper
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or _original_helper is not None:
        return
    original = getattr(c10d, "_new_process_group_helper", None)
    if original is None or getattr(original, "_mpify_nb", False):
        return
    _original_helper = original

    def helper(*args: Any, **kwargs: Any) -> Any:
        global made
        made += 1
        result = original(*args, **kwargs)
        try:
            group = result[0]
            if isinstance(group, c10d.ProcessGroup):
                _kept.append((group, compat._backends_of([group])))
        except Exception:
            pass  # only the deadlock guard is lost
        return result

    helper._mpify_nb = True  # type: ignore[attr-defined]
    setattr(c10d, "_new_process_group_helper", helper)  # noqa: B010 (a private name torch may lack in type stubs)


def release_ended_groups() -> int:
    """Let go of the kept groups torch has ended (no longer in its table), the group first, then
    its backends: the last reference to a backend is ours, and its destructor runs with the GIL
    released. Groups still up stay kept. Returns how many were released."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or not _kept:
        return 0
    live = {id(g) for g in c10d._world.pg_map}
    ended = [entry for entry in _kept if id(entry[0]) not in live]
    _kept[:] = [entry for entry in _kept if id(entry[0]) in live]
    count = len(ended)
    held_elsewhere = _held_elsewhere(ended)
    if held_elsewhere:
        _let_torch_objects_go_of(held_elsewhere)
    del held_elsewhere
    backends = [b for _group, held in ended for b in held]
    ended.clear()  # the groups: a Reducer that still holds one keeps it, not its backends
    while backends:
        backends.pop()  # destroyed now, with the GIL released (compat.destroy_process_group)
    return count


def _held_elsewhere(ended: list) -> list:
    """The groups of ``ended`` ((group, backends) pairs) that a Python object besides ``ended``
    still holds: by their reference counts, against an object held the same way."""
    alone = [(object(), [])]
    baseline = [sys.getrefcount(obj) for obj, _backends in alone][0]
    return [group for group, _backends in ended if sys.getrefcount(group) > baseline]


def _let_torch_objects_go_of(ended: list) -> int:
    """Drop the references torch's own objects keep to the ``ended`` groups, so the groups (and
    their gloo listeners) go when :func:`release_ended_groups` lets go of them: a DeviceMesh keeps
    its groups in ``_pg_registry`` (torch 2.13), and a mesh lives on in DTensor's sharding caches
    after the call, in an FSDP2 or tensor-parallel model's parameters left in the notebook; FSDP2's
    mesh info keeps ``shard_process_group`` (HSDP's ``replicate_process_group`` too). The registry
    is a dict the collector does not track (``gc.get_referrers`` misses it), so torch.distributed's
    objects are scanned (about 0.15 s per 300,000 live objects; only when a group is held).
    An attribute that held a group becomes None, a registry loses the entry: both were of a group
    whose ranks are gone (disarm_ended_ddp refuses what would use them). Returns how many."""
    import gc

    ids = {id(group) for group in ended}
    dropped = 0
    for obj in gc.get_objects():
        module = getattr(type(obj), "__module__", None)
        if not (isinstance(module, str) and module.startswith("torch.distributed")):
            continue
        try:
            attributes = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            continue
        if type(attributes) is not dict:
            continue
        for name, value in list(attributes.items()):
            if id(value) in ids:
                attributes[name] = None
                dropped += 1
            elif type(value) is dict:
                for key in [k for k, v in value.items() if id(v) in ids]:
                    del value[key]
                    dropped += 1
    return dropped
