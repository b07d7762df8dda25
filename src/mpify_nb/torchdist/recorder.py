"""Torch's flight recorder, read: its dumps (gloo's and NCCL's, one format) as :class:`Op` records.

Torch records every collective a gloo or NCCL group is asked for in a ring per process (the
flight recorder, ``TORCH_FR_BUFFER_SIZE`` entries), from any thread and through any API. A dump
(``torch._C._distributed_c10d._dump_fr_trace`` for gloo, ``_dump_nccl_trace`` for NCCL; a pickled
dict) holds, per entry::

    process_group      (name, description): the group, named alike on every rank
    collective_seq_id  its number among the group's collectives (1, 2, ...; p2p entries: 0)
    profiling_name     "gloo:all_reduce", "nccl:_allgather_base", "nccl:send 0->1" (group ranks)
    input_sizes/dtypes [[4]] / ["Float"]; output_sizes/dtypes likewise
    retired            its work completed (for NCCL: the watchdog saw its CUDA event)
    time_created_ns    wall clock
    is_p2p             a send/recv (NCCL records them; gloo does not)

This module only parses (no torch needed: the tests feed it recorded dumps); reading this
process's own recorder is torchdist/waits.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

#: c10's ScalarType names (as the recorder writes them) -> torch's dtype names.
_DTYPES = {
    "Byte": "uint8", "Char": "int8", "Short": "int16", "Int": "int32", "Long": "int64",
    "Half": "float16", "Float": "float32", "Double": "float64", "ComplexHalf": "complex32",
    "ComplexFloat": "complex64", "ComplexDouble": "complex128", "Bool": "bool", "BFloat16": "bfloat16",
    "QInt8": "qint8", "QUInt8": "quint8", "QInt32": "qint32", "UInt16": "uint16", "UInt32": "uint32",
    "UInt64": "uint64",
}

#: The names backends record -> the torch.distributed call a user writes.
_OP_NAMES = {
    "allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all_single", "all_reduce_barrier": "barrier",
    "recvAnySource": "recv", "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor",
}

#: Ops whose ranks may pass tensors of different sizes (uneven splits).
_ANY_SIZES = {"all_to_all", "all_to_all_single", "coalesced"}
#: Ops with a root: the tensors of its other ranks are compared (the root's list is not theirs).
ROOTED = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}
P2P = {"send", "recv"}

Tensors = tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each tensor


@dataclass(frozen=True)
class Op:
    """One collective or point-to-point operation of a rank, from its recorder or its stack.

    ``kind``: the torch.distributed call (``"all_reduce"``, ``"broadcast"``, ``"send"`` ...);
    ``group``: the group's name (alike on every rank; None when unknown) and ``ranks`` its
    global ranks (None: the whole world); ``seq``: its number among the group's collectives
    (None for point-to-point, and for a call seen only on a stack); ``root``: a broadcast's or
    scatter's src, a reduce's or gather's dst, a send's or recv's peer (a global rank; None:
    unknown); ``done``: it completed on this rank; ``issued_ns``: when (wall clock);
    ``called``: told by the collective check a rank waits in (the call as the user made it,
    not yet in the backend), not by the recorder; ``nth``: a send's or recv's count among this
    rank's sends to (recvs from) that peer since its groups began (torchdist/p2p.py)."""

    kind: str
    group: Optional[str] = None
    ranks: Optional[tuple[int, ...]] = None
    seq: Optional[int] = None
    inputs: Tensors = ()
    outputs: Tensors = ()
    root: Optional[int] = None
    tag: Optional[int] = None
    done: bool = False
    issued_ns: int = 0
    called: bool = False
    nth: Optional[int] = None

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P

    def members(self, world: int) -> tuple[int, ...]:
        return self.ranks if self.ranks is not None else tuple(range(world))


def _tensors(sizes: Any, dtypes: Any) -> Tensors:
    sizes, dtypes = list(sizes or []), list(dtypes or [])
    out = []
    for i, shape in enumerate(sizes):
        dtype = dtypes[i] if i < len(dtypes) else (dtypes[-1] if dtypes else "?")
        out.append((_DTYPES.get(str(dtype), str(dtype).lower()), tuple(int(d) for d in shape)))
    return tuple(out)


def op_name(profiling_name: str) -> tuple[str, Optional[tuple[int, int]]]:
    """("all_reduce", None) from "gloo:all_reduce"; ("send", (0, 1)) from "nccl:send 0->1": the
    op and, for NCCL's point-to-point, (this rank, its peer) as group ranks."""
    name = profiling_name.split(":", 1)[-1].strip()
    head, _, meta = name.partition(" ")
    kind = _OP_NAMES.get(head, head)
    pair = None
    try:
        if kind == "send" and "->" in meta:
            me, peer = meta.split("->")
            pair = (int(me), int(peer))
        elif kind == "recv" and "<-" in meta:
            me, peer = meta.split("<-")
            pair = (int(me), int(peer))
    except ValueError:
        pair = None
    return kind, pair


def entries_to_ops(entries: list[dict], groups: Optional[dict[str, Optional[tuple[int, ...]]]] = None,
                   born_ns: int = 0, pg_config: Optional[dict] = None) -> list[Op]:
    """The ops of a dump's ``entries`` (in the order recorded), of the groups alive now.

    ``groups``: {name: global ranks (None: the world)} of this process's current groups (an
    entry of another group is dropped); None: every group, ranks from ``pg_config`` (a dump
    read elsewhere). ``born_ns``: entries older are of groups destroyed since. A group made
    again under the same name starts its numbers at 1 again: only its newest life is kept."""
    ops: list[Op] = []
    last: dict[str, int] = {}  # group -> its last collective number so far
    for e in entries:
        created = int(e.get("time_created_ns") or 0)
        if created and created < born_ns:
            continue
        pg = tuple(e.get("process_group") or ("", ""))
        name = str(pg[0])
        if groups is not None:
            if name not in groups:
                continue
            ranks = groups[name]
        else:  # a dump read elsewhere: the default group is the world
            ranks = None if pg[1:2] == ("default_pg",) else _config_ranks(pg_config, name)
        kind, pair = op_name(str(e.get("profiling_name", "")))
        p2p = bool(e.get("is_p2p")) or kind in P2P
        seq = None if p2p else int(e.get("collective_seq_id") or 0)
        if seq is not None:
            if seq <= last.get(name, 0):
                # A group made again under this name: what came before is of its earlier life.
                ops = [o for o in ops if not (o.group == name and o.seq is not None and o.seq >= seq)]
            last[name] = seq
        root = None
        if pair is not None:
            peer = pair[1]
            root = ranks[peer] if ranks is not None and 0 <= peer < len(ranks) else peer
        ops.append(Op(kind, name, ranks, seq, _tensors(e.get("input_sizes"), e.get("input_dtypes")),
                      _tensors(e.get("output_sizes"), e.get("output_dtypes")), root,
                      done=bool(e.get("retired")) or e.get("state") == "completed", issued_ns=created))
    return ops


def _config_ranks(pg_config: Optional[dict], name: str) -> Optional[tuple[int, ...]]:
    """A group's global ranks from a dump's ``pg_config`` ({"ranks": "[0, 1]"}), if it says."""
    info = (pg_config or {}).get(name)
    if not isinstance(info, dict):
        return None
    text = str(info.get("ranks", "")).strip("[] ")
    try:
        ranks = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        return None
    return ranks or None


def read_dump(data: Any) -> dict:
    """A dump as a dict (the bytes torch returns are a pickle; tests keep them as files)."""
    import pickle

    if isinstance(data, (bytes, bytearray, memoryview)):
        return pickle.loads(bytes(data))
    return dict(data)


def issued(ops: list[Op]) -> dict[str, int]:
    """{group: the number of the last collective issued on it}."""
    out: dict[str, int] = {}
    for o in ops:
        if o.seq is not None and o.group is not None:
            out[o.group] = max(out.get(o.group, 0), o.seq)
    return out


def numel(tensors: Tensors) -> tuple[int, ...]:
    return tuple(math.prod(shape) for _dtype, shape in tensors)


def dtypes(tensors: Tensors) -> tuple[str, ...]:
    return tuple(dtype for dtype, _shape in tensors)


def why_apart(a: Op, b: Op) -> Optional[str]:
    """Why ``a`` and ``b`` (the same collective number of a group, on two ranks) cannot be the
    same collective: "a different op", "different sizes", ...; None when they can."""
    kind_a, kind_b = _ALIASES.get(a.kind, a.kind), _ALIASES.get(b.kind, b.kind)
    if kind_a != kind_b:
        if a.called != b.called:  # one rank in its check, the other already in gloo
            called, recorded = (a, b) if a.called else (b, a)
            if _GLOO_RECORDS.get(_ALIASES.get(called.kind, called.kind)) == recorded.kind:
                return _inputs_apart(called, recorded)
        return "a different op"
    kind = a.kind
    if kind in ROOTED and a.root is not None and b.root is not None and a.root != b.root:
        return f"a different {ROOTED[kind]}"
    ta, tb = _compared(a), _compared(b)
    if ta is None or tb is None:
        return None
    if dtypes(ta) and dtypes(tb) and set(dtypes(ta)) != set(dtypes(tb)):
        return "different dtypes"
    if kind not in _ANY_SIZES and numel(ta) and numel(tb) and sum(numel(ta)) != sum(numel(tb)):
        return "different sizes"
    return None


#: One call under torch's other names for it: compared as one.
_ALIASES = {"all_gather_into_tensor": "all_gather_single", "_all_gather_base": "all_gather_single",
            "reduce_scatter_tensor": "reduce_scatter_single", "_reduce_scatter_base": "reduce_scatter_single"}
#: What gloo's recorder calls a call (torch 2.13): every all_gather form "all_gather", every
#: reduce_scatter an "all_reduce" of its input. A rank seen in its collective check holds the call
#: by the user's name while a peer past its check is seen by the recorder's: FSDP's
#: ``all_gather_single`` is the same collective as a peer's recorded ``all_gather``.
_GLOO_RECORDS = {"all_gather_single": "all_gather", "reduce_scatter_single": "all_reduce",
                 "reduce_scatter": "all_reduce"}


def _inputs_apart(called: Op, recorded: Op) -> Optional[str]:
    """A call seen in the check against what gloo recorded of a peer's: its inputs are what gloo
    records (a reduce_scatter's list is recorded tensor by tensor: not compared)."""
    if called.kind == "reduce_scatter" or not called.inputs or not recorded.inputs:
        return None
    if set(dtypes(called.inputs)) != set(dtypes(recorded.inputs)):
        return "different dtypes"
    if sum(numel(called.inputs)) != sum(numel(recorded.inputs)):
        return "different sizes"
    return None


def _compared(o: Op) -> Optional[Tensors]:
    """The tensors of ``o`` that must agree on every rank: what each rank itself passes (a
    gather's root also receives, a scatter's root also sends: those lists are not compared)."""
    if o.kind == "scatter":
        return o.outputs
    if o.kind == "gather":
        return o.inputs
    if o.kind == "barrier":
        return None
    if o.kind in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
        return o.outputs
    return o.inputs or o.outputs


def pairs(a: Op, a_rank: int, b: Op, b_rank: int) -> bool:
    """Can point-to-point ``a`` (on ``a_rank``) and ``b`` (on ``b_rank``) be each other's other half?"""
    if {a.kind, b.kind} != {"send", "recv"}:
        return False
    if a.root is not None and a.root != b_rank or b.root is not None and b.root != a_rank:
        return False
    return a.tag is None or b.tag is None or a.tag == b.tag


def p2p_apart(a: Op, b: Op) -> Optional[str]:
    """Why a send and the recv it pairs with cannot carry the same tensor, or None."""
    if a.tag is not None and b.tag is not None and a.tag != b.tag:
        return "a different tag"
    ta, tb = a.inputs or a.outputs, b.inputs or b.outputs
    if ta and tb and set(dtypes(ta)) != set(dtypes(tb)):
        return "different dtypes"
    if ta and tb and sum(numel(ta)) != sum(numel(tb)):
        return "different sizes"
    return None


# -- in words -----------------------------------------------------------------------------------

def op_text(op: Op, sizes: bool = True) -> str:
    """"all_reduce #5 of float32[4]", "broadcast #5 of float32[4] from rank 0", "recv from rank 1
    of float32[4]", "barrier #3" (``sizes``: with the tensors)."""
    if op.is_p2p:
        peer = f"rank {op.root}" if op.root is not None else "any rank"
        text = f"{op.kind} {'to' if op.kind == 'send' else 'from'} {peer}"
        tensors = op.inputs or op.outputs
    else:
        text = op.kind if op.seq is None else f"{op.kind} #{op.seq}"
        if op.ranks is not None:
            text += f" on group {list(op.ranks)}"
        tensors = shown_tensors(op)
    if sizes and tensors:
        text += f" of {tensors_text(tensors)}"
    if op.kind in ROOTED and op.root is not None:
        text += f" {'from' if ROOTED[op.kind] == 'src' else 'to'} rank {op.root}"
    if op.is_p2p and op.tag:
        text += f" (tag {op.tag})"
    return text


def shown_tensors(op: Op) -> Tensors:
    if op.kind == "scatter" or op.kind.startswith("reduce_scatter"):
        return op.outputs
    return op.inputs or op.outputs


def tensors_text(tensors: Tensors) -> str:
    return ", ".join(f"{dtype}[{', '.join(str(d) for d in shape)}]" for dtype, shape in tensors)


def with_root(op: Op, root: Optional[int], tag: Optional[int] = None) -> Op:
    return replace(op, root=root if root is not None else op.root, tag=tag if tag is not None else op.tag)
