"""What a persistent rank waits on in torch.distributed, as its control thread sees it.

Torch gives no signal that a rank waits for a peer that will never come (under torchrun
such a rank blocks until the peer's process exits), so a Session looks for itself. Two
sources, read from the rank's control thread while its main thread runs a request::

    torch's flight recorder    every collective a gloo or NCCL group is asked for, from any
    (pending_collectives)      thread and through any API: plain and async_op dist.* calls,
                               Work.wait(), DTensor and functional collectives, object
                               collectives, barriers, DDP's and FSDP's hooks on autograd's
                               threads. An entry is retired when its work completes, so an
                               entry not retired is a collective issued and not done; its
                               sequence number says which one of its group's.
    the main thread's frame    a send/recv (the recorder leaves point-to-point out) or any
    (blocked_call)             dist.* call on a torch without the recorder: the innermost
                               Python frame is the c10d function whose C++ wait blocks.
    hidden_waits.py            where gloo has no recorder (torch < 2.8): a wait deeper in
                               torch, seen from the stack and the thread's CPU time.

The caller (session/session.py) puts this together with what it knows and the rank does not: which
ranks are idle, finished, failed or dead. A collective is stuck when a rank of its group
will never issue it: that rank is not running the request and its own recorder's count for
the group (issued_counts) is below the collective's number.
"""

from __future__ import annotations

import dis
import functools
import os
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from . import compat, hidden_waits

#: Entries the recorder keeps (a ring). Only the newest matter: an unfinished collective is
#: one of the last few issued, and a small ring keeps a dump cheap (32 entries: ~0.2 ms).
RECORDER_ENTRIES = 32

_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mpify_nb/, above torchdist/
_LIBRARY_PREFIXES = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, _PACKAGE_DIR})


@dataclass(frozen=True)
class Wait:
    """A collective a rank waits on: ``op`` (e.g. ``"all_reduce"``), the global ranks of its
    group (None: every rank), the group's name and the collective's number in it (both None
    when seen on the stack, not in the recorder), and the user's line that waits, if found."""

    op: str
    ranks: Optional[tuple[int, ...]]
    group: Optional[str] = None
    seq: Optional[int] = None
    where: Optional[tuple[str, int]] = None
    #: a point-to-point wait whose peer is unknown: stuck only once no other rank of
    #: ``ranks`` can come (a pipeline stage waits for its neighbour, not for the last stage)
    any_peer: bool = False


#: Wall-clock ns when this process's current default group was made: the recorder keeps
#: entries of groups destroyed since, whose names and numbers the new groups reuse.
_groups_born_ns = 0


def enable_recorder() -> None:
    """Make the groups this process creates from now on record their collectives (unless
    the user chose a recorder size), and forget what earlier groups recorded. Call before
    ``init_process_group``."""
    global _groups_born_ns
    if not any(os.environ.get(name) for name in _RECORDER_VARIABLES):
        os.environ[compat.recorder_variable()] = str(RECORDER_ENTRIES)
    _groups_born_ns = time.time_ns()


def _recorder_entries(only_active: bool = True) -> list[dict]:
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    entries: list[dict] = []
    c10d = sys.modules.get("torch._C._distributed_c10d")
    # torch >= 2.8 records gloo's collectives in _dump_fr_trace; NCCL's are in _dump_nccl_trace
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            entries += pickle.loads(dump(True, False, only_active)).get("entries", [])
        except Exception:
            continue  # no NCCL in this torch, or no group of that kind
    seen: set = set()
    fresh = []
    for e in entries:
        key = (e.get("pg_id"), e.get("collective_seq_id"), e.get("p2p_seq_id"), e.get("time_created_ns"))
        if key not in seen and (e.get("time_created_ns") or 0) >= _groups_born_ns:
            seen.add(key)
            fresh.append(e)
    return fresh


def _ranks_by_group_name() -> dict[str, Optional[tuple[int, ...]]]:
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            return {}
        world = dist.GroupMember.WORLD
        return {name: None if group is world else tuple(dist.get_process_group_ranks(group))
                for group, name in c10d._world.pg_names.items()}
    except Exception:
        return {}


def pending_collectives() -> list[Wait]:
    """The collectives this process issued and that have not completed, oldest first."""
    pending = [e for e in _recorder_entries() if not e.get("retired", True) and not e.get("is_p2p")]
    if not pending:
        return []
    groups = _ranks_by_group_name()
    out = []
    for entry in pending:
        name = str(entry.get("process_group", ("",))[0])
        if name not in groups:
            continue  # a group destroyed since
        op = str(entry.get("profiling_name", "a collective")).split(":")[-1]
        out.append(Wait(op, groups[name], name, int(entry.get("collective_seq_id", 0))))
    return out


def issued_counts() -> dict[str, int]:
    """{group name: the number of the last collective this process issued on it}."""
    counts: dict[str, int] = {}
    for entry in _recorder_entries(only_active=False):  # NCCL's dump leaves the retired out when asked
        if entry.get("is_p2p"):
            continue
        name = str(entry.get("process_group", ("",))[0])
        counts[name] = max(counts.get(name, 0), int(entry.get("collective_seq_id", 0)))
    return counts


def blocked_call(thread_id: int) -> Optional[Wait]:
    """The torch.distributed call ``thread_id`` is blocked in, seen on its stack, or None.
    A collective waits in C++ under its c10d function's frame."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    filename = frame.f_code.co_filename
    if filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
        name = frame.f_code.co_name
        peer = frame.f_locals.get("dst" if name == "send" else "src") if name in ("send", "recv") else None
        if isinstance(peer, int):
            return Wait(name, (peer,))
        ranks = _group_ranks(frame)
        return Wait(name, None if ranks is None else tuple(ranks), any_peer=name in ("send", "recv"))
    if filename.endswith(os.path.join("nn", "parallel", "distributed.py")):
        return Wait(f"DistributedDataParallel.{frame.f_code.co_name}", None)
    if _calling(frame) == "wait":
        work = _unfinished_work(frame)
        if work is not None:  # Work.wait() on an isend/irecv (a pipeline schedule's, say)
            op = int(work._get_op_type())
            if op in _P2P_OPS:
                return Wait(f"Work.wait() of a {_P2P_OPS[op]}", None, any_peer=True)
            # A collective's: named as the recorder names it (the only source before torch 2.8)
            return Wait(_COLLECTIVE_OPS.get(op, "Work.wait() of a collective"), None, any_peer=True)
    return None


#: torch's OpType numbers of point-to-point work (c10d/Types.hpp: SEND, RECV, RECVANYSOURCE).
_P2P_OPS = {12: "send", 13: "recv", 14: "recv"}
#: ... and of collectives, by the torch.distributed function that issues them.
_COLLECTIVE_OPS = {0: "broadcast", 1: "all_reduce", 2: "all_reduce_coalesced", 3: "reduce", 4: "all_gather",
                   5: "all_gather_into_tensor", 6: "all_gather_coalesced", 7: "gather", 8: "scatter",
                   9: "reduce_scatter", 10: "all_to_all_single", 11: "all_to_all", 15: "barrier",
                   16: "reduce_scatter_tensor"}


def _calling(frame) -> Optional[str]:
    """The name of the method ``frame`` is calling now (it waits in it), if it calls one."""
    names = _called_names(frame.f_code)
    return names.get(frame.f_lasti)


@functools.lru_cache(maxsize=256)
def _called_names(code) -> dict[int, str]:
    """{offset of a call instruction: the attribute name loaded just before it} of ``code``."""
    out: dict[int, str] = {}
    last_attribute: Optional[str] = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_METHOD", "LOAD_ATTR"):
            last_attribute = ins.argval if isinstance(ins.argval, str) else None
        elif ins.opname in ("CALL", "CALL_METHOD", "CALL_FUNCTION", "PRECALL"):
            if last_attribute is not None:
                out[ins.offset] = last_attribute
            if ins.opname != "PRECALL":
                last_attribute = None
    return out


def _unfinished_work(frame) -> Any:
    """A torch.distributed ``Work`` not completed among ``frame``'s local names (the one
    whose ``wait()`` blocks), or None."""
    try:
        from torch._C._distributed_c10d import Work

        for value in list(frame.f_locals.values()):
            if isinstance(value, Work) and not value.is_completed():
                return value
    except Exception:
        pass
    return None


def _group_ranks(frame) -> Optional[list[int]]:
    """The global ranks of the ``group`` a c10d function was called with (None: the world),
    so a collective on a subgroup is not blamed on ranks outside it."""
    try:
        group = frame.f_locals.get("group")
        if group is None:
            return None
        import torch.distributed as dist

        if group is dist.GroupMember.WORLD:
            return None
        return sorted(dist.get_process_group_ranks(group))
    except Exception:
        return None


def user_line(thread_id: int) -> Optional[tuple[str, int]]:
    """(file, line) of the innermost frame of ``thread_id`` that is the user's own code (a
    cell, a module of theirs), not torch's, the standard library's or ours."""
    frame: Any = sys._current_frames().get(thread_id)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_PREFIXES) and not filename.startswith("<frozen"):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


def waits_of(thread_id: int, recorder: bool) -> list[Wait]:
    """What the rank waits on now: the recorder's unfinished collectives (when asked for:
    a dump costs ~0.2 ms), else the blocking call on ``thread_id``'s stack; where gloo has no
    recorder (torch < 2.8), a wait deeper in torch, seen another way (torchdist/hidden_waits.py)."""
    found = pending_collectives() if recorder else []
    if not found:
        blocked = blocked_call(thread_id)
        if blocked is None and recorder and _unrecorded_group():
            op = hidden_waits.look(thread_id)
            blocked = Wait(op, None, any_peer=True) if op is not None else None
        found = [blocked] if blocked is not None else []
    return found


def _unrecorded_group() -> bool:
    """Is this process's group one whose collectives the recorder misses (gloo before torch 2.8)?"""
    if compat.has_gloo_recorder():
        return False
    try:
        import torch.distributed as dist

        return dist.is_initialized() and dist.get_backend() == "gloo"
    except Exception:
        return False
