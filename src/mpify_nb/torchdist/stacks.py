"""What a thread's Python stack says about a rank (a look of torchdist/waits.py reads it):
the torch.distributed call it is blocked in, as the user called it (a send's peer and tag, a
broadcast's src: the recorder keeps no roots; a ``Work.wait()``, a DDP forward), the user's
line it is at, the function it is blocked in (``sleep()``), its frames from the user's code in.

``_called_names`` reads which function a frame is calling from its bytecode, following the
value stack, since a frame blocked in C shows no frame of its callee.
"""

from __future__ import annotations

import dis
import functools
import linecache
import os
import sys
from typing import Any, Optional

from . import p2p, rendezvous
from .recorder import ROOTED, Op

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mpify_nb/, above torchdist/
_LIBRARY_PREFIXES = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, _PACKAGE_DIR})
#: p2p's wrappers stand between the user's send/recv and torch's: a frame of torch's, not ours.
_P2P_FILE = p2p.__file__


def _ours(filename: str) -> bool:
    """A frame of this library's (what runs the user's code), not one it put inside their call."""
    return filename.startswith(_PACKAGE_DIR) and filename != _P2P_FILE


def _in_our_loop(frame: Any) -> bool:
    """The thread is in this library's own code, outside the user's (a persistent rank between cells)."""
    while frame is not None:
        if _ours(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def _doing(frame: Any, native_id: Optional[int]) -> str:
    """"running" (Python, or C code that runs), or "in sleep()": the call it is blocked in."""
    if frame is None:
        return "running"
    state = b"R"
    if native_id is not None:
        try:
            with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            pass
    if state == b"R":
        return "running"
    name = _calling(frame)
    return f"in {name}()" if name else "waiting"


def _stack(frame: Any) -> tuple[tuple[str, int, str], ...]:
    """The thread's frames from the user's code in (what it calls included), outermost first:
    none while it runs none of the user's code (a persistent rank between cells)."""
    frames = []
    seen_user = False
    while frame is not None:
        filename = frame.f_code.co_filename
        if seen_user and _ours(filename):
            break  # our code, which runs the user's
        seen_user = seen_user or _is_user_file(filename)
        frames.append((filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(reversed(frames)) if seen_user else ()


def blocked_call(frame: Any) -> tuple[Optional[Op], str, bool]:
    """(the torch.distributed op the thread at ``frame`` waits in, how the user called it, whether
    its peer is unknown); (None, "", False) when it waits in none. A collective waits in C++
    under its c10d function's frame; a send or recv's locals name its peer and tag."""
    if frame is None:
        return None, "", False
    filename = frame.f_code.co_filename
    if filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
        return _c10d_call(frame)
    if filename == _RENDEZVOUS_FILE and frame.f_code.co_name == "_wait_open":
        # Waits, in Python, for the call's store to open: a rendezvous of the whole world.
        return Op("init_process_group"), "dist.init_process_group", False
    if filename.endswith(os.path.join("nn", "parallel", "distributed.py")):
        return None, f"DistributedDataParallel.{frame.f_code.co_name}", False
    if _calling(frame) == "wait":
        work = _unfinished_work(frame)
        if work is not None:  # Work.wait() on an isend/irecv (a pipeline schedule's, say)
            kind = _P2P_OPS.get(int(work._get_op_type()))
            label = f"Work.wait() of a {kind or 'collective'}"
            note = p2p.noted(work) if kind else None
            if note is not None:  # its isend/irecv noted its peer and tag
                op, peer_unknown = _p2p_op(*note)
                return op, label, peer_unknown
            if kind is None and (collective := _COLLECTIVE_OPS.get(int(work._get_op_type()))) is not None:
                # An async_op collective's: named as the user called it (the recorder, where there is
                # one, gives its number; before torch 2.8 gloo's has none, and this is all there is).
                return Op(collective), f"dist.{collective}", False
            return (Op(kind) if kind else None), label, kind is not None
    return None, "", False


#: c10d's functions a rendezvous waits in (its store, gloo's connections), by what the user called.
_RENDEZVOUS = {"init_process_group": "init_process_group", "_new_process_group_helper": "init_process_group",
               "_store_based_barrier": "init_process_group", "new_group": "new_group",
               "_new_group_with_tag": "new_group"}
_RENDEZVOUS_FILE = rendezvous.__file__


def _c10d_call(frame: Any) -> tuple[Optional[Op], str, bool]:
    name = frame.f_code.co_name
    local = frame.f_locals
    if name in _RENDEZVOUS:  # a group being made: every rank of the world must come
        called = _RENDEZVOUS[name]
        if name == "_new_process_group_helper" and frame.f_back is not None and \
                frame.f_back.f_code.co_name in ("new_group", "_new_group_with_tag"):
            called = "new_group"
        return Op(called), f"dist.{called}", False
    group = local.get("group")
    ranks = _group_ranks(group)
    group_name = _group_name(group)
    label = f"dist.{name}"
    if name in ("send", "recv"):
        op, peer_unknown = _p2p_op(name, local)
        return op, label, peer_unknown
    root = None
    if name in ROOTED:
        which = ROOTED[name]
        root = p2p.global_rank_of(local.get(which), local.get(f"group_{which}"), group)
    return Op(name, group_name, ranks, root=root), label, False


def _p2p_op(name: str, local: dict) -> tuple[Op, bool]:
    """A send's or recv's op from its arguments (``local``: by name), and whether its peer is unknown."""
    group = local.get("group")
    ranks = _group_ranks(group)
    peer = p2p.global_rank_of(local.get("dst" if name == "send" else "src"),
                              local.get("group_dst" if name == "send" else "group_src"), group)
    tensor = local.get("tensor")
    shape = getattr(tensor, "shape", None)
    tensors = ((_dtype_name(tensor), tuple(shape)),) if shape is not None else ()
    tag = local.get("tag") if isinstance(local.get("tag"), int) else None
    nth = local.get("_nth")  # an isend's or irecv's, noted; a blocking call's is the one under way:
    if nth is None:  # a recv is counted as it is posted, a send once it is made
        nth = p2p.count(name, peer) + (1 if name == "send" else 0)
    op = Op(name, _group_name(group), ranks, None, tensors if name == "send" else (),
            tensors if name == "recv" else (), peer, tag, nth=nth or None)
    return op, peer is None


def _dtype_name(tensor: Any) -> str:
    return str(getattr(tensor, "dtype", "?")).replace("torch.", "")


def _group_name(group: Any) -> Optional[str]:
    try:
        from torch.distributed import distributed_c10d as c10d

        if group is None:
            group = c10d._get_default_group()
        return c10d._world.pg_names.get(group)
    except Exception:
        return None


#: torch's OpType numbers of point-to-point work (c10d/Types.hpp: SEND, RECV, RECVANYSOURCE).
_P2P_OPS = {12: "send", 13: "recv", 14: "recv"}
#: ... and of collectives, by the torch.distributed function that issues them.
_COLLECTIVE_OPS = {0: "broadcast", 1: "all_reduce", 2: "all_reduce_coalesced", 3: "reduce", 4: "all_gather",
                   5: "all_gather_into_tensor", 6: "all_gather_coalesced", 7: "gather", 8: "scatter",
                   9: "reduce_scatter", 10: "all_to_all_single", 11: "all_to_all", 15: "barrier",
                   16: "reduce_scatter_tensor"}


def _calling(frame) -> Optional[str]:
    """The name of the function or method ``frame`` is calling now (it waits in it), if any."""
    return _called_names(frame.f_code).get(frame.f_lasti)


_NAMED_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD")


@functools.lru_cache(maxsize=256)
def _called_names(code) -> dict[int, str]:
    """{offset of a call instruction: the name of the function it calls} of ``code``. The
    value stack is followed instruction by instruction (names for what global, name and
    attribute loads push): a call pops its callee and its arguments, and the callee is the
    deepest named value of those (it was pushed before them)."""
    out: dict[int, str] = {}
    stack: list[Optional[str]] = []
    precall = 0  # 3.11: PRECALL pops the arguments, CALL the callee
    for ins in dis.get_instructions(code):
        try:
            effect = dis.stack_effect(ins.opcode, ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None, jump=False)
        except ValueError:
            effect = 0
        if ins.opname == "PRECALL":
            precall = effect
            continue
        if ins.opname.startswith("CALL"):
            effect, precall = effect + precall, 0
            popped = max(0, 1 - effect)  # it pushes one value: its result
            names = [n for n in stack[len(stack) - popped:] if n is not None] if popped else []
            if names:
                out[ins.offset] = names[0]
            del stack[max(0, len(stack) - popped):]
            stack.append(None)
            continue
        if ins.opname in _NAMED_LOADS and isinstance(ins.argval, str):
            attribute = ins.opname in ("LOAD_ATTR", "LOAD_METHOD")
            del stack[max(0, len(stack) - int(attribute)):]
            pushed = effect + int(attribute)
            # A global pushed with a NULL below it (3.11+): the NULL is no callee; a method's two
            # slots are both its own.
            stack.extend([ins.argval if attribute else None] * (pushed - 1) + [ins.argval] * min(pushed, 1))
            continue
        if effect < 0:
            del stack[max(0, len(stack) + effect):]
        else:
            stack.extend([None] * effect)
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


def _group_ranks(group: Any) -> Optional[tuple[int, ...]]:
    """The global ranks of ``group`` (None: the world, or unknown), so a collective on a
    subgroup is not blamed on ranks outside it."""
    try:
        if group is None:
            return None
        import torch.distributed as dist

        if group is dist.GroupMember.WORLD:
            return None
        return tuple(sorted(dist.get_process_group_ranks(group)))
    except Exception:
        return None


def _is_user_file(filename: str) -> bool:
    """The user's code: not torch's, the standard library's or ours; a ``<name>`` only when its
    source is known (a Session's cell is; ``python -c``'s ``<string>`` is not)."""
    if filename.startswith("<"):
        return filename in linecache.cache
    return not filename.startswith(_LIBRARY_PREFIXES) and not filename.startswith(_PACKAGE_DIR)


def user_line_in(frames: tuple[tuple[str, int, str], ...]) -> Optional[tuple[str, int]]:
    """(file, line) of the innermost frame of a stack :func:`_stack` took that is the user's own code
    (a cell, a module of theirs), not torch's, the standard library's or ours; None once our own code
    is reached first (what calls it, a rank's loop, a template's ``python -c``, is not the user's).
    Read from the stack, never from the live frame again: the thread goes on meanwhile, and two reads
    of its frame could name two lines."""
    for filename, lineno, _function in reversed(frames):
        if _ours(filename):
            return None
        if _is_user_file(filename):
            return filename, lineno
    return None
