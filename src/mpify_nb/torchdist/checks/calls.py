"""A rank's call to a collective, said so that every rank of the group can compare it with its own.

Each checked call becomes a *description*, a small tuple of plain values that every rank
publishes before any of them enters gloo (torchdist/checks/groups.py)::

    (kind, reduce op, root, tag, inputs, outputs, extra)

    kind      the torch.distributed call: "all_reduce", "broadcast", "send" (isend too) ...
    reduce op "SUM", "MAX" ... for the reducing calls, else None
    root      a broadcast's or scatter's src, a reduce's or gather's dst, a send's or recv's
              peer: a rank of the group (not a global rank), else None
    tag       a send's or recv's tag, else None
    inputs    ((dtype, shape), ...) of what this rank passes in: a tensor, or a list's tensors
    outputs   the same of what it receives into
    extra     all_to_all_single's (output splits, input splits); a send's or recv's
              blocking flag; else None

Ranks that call alike publish the same bytes, so the common case costs one comparison of bytes;
only when they differ are the descriptions read and judged by :func:`apart` (another op, src or
dst, reduce op, or tensors whose dtypes or sizes do not fit what each peer sends and expects)
and :func:`p2p_apart` (a send and the recv that takes it). The rules never flag what gloo
runs correctly: the same numbers of elements in other shapes, uneven ``all_to_all`` splits
that fit, a gather's root with a list the others lack.

It imports nothing but the standard library; torch's objects are only looked at.
"""

from __future__ import annotations

import marshal
import math
import struct
from collections.abc import Sequence
from typing import Any, Callable, Optional

Tensors = tuple[tuple[str, tuple[int, ...]], ...]
Description = tuple  # (kind, reduce op, root, tag, inputs, outputs, extra)

#: A description's bytes: marshal (the ranks may be different builds of one Python only across
#: hosts, and version 4 reads the same in every Python 3 since 3.4).
_MARSHAL_VERSION = 4

#: The calls whose tensors must be alike on every rank (dtypes and numbers of elements).
_ALIKE = {
    "all_reduce", "broadcast", "reduce", "barrier", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "_reduce_scatter_base", "all_reduce_coalesced", "all_gather_coalesced",
}
#: Calls with a root, and which argument names it.
ROOTED = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}
P2P = {"send", "recv"}

#: kind -> (its input argument, its output argument, its root's (global, group) arguments,
#: its reduce op's argument). The user's call names them as in torch's signature (2.4 to 2.13).
LAYOUTS: dict[str, tuple[Optional[str], Optional[str], Optional[tuple[str, str]], Optional[str]]] = {
    "all_reduce": ("tensor", None, None, "op"),
    "broadcast": ("tensor", None, ("src", "group_src"), None),
    "reduce": ("tensor", None, ("dst", "group_dst"), "op"),
    "all_gather": ("tensor", "tensor_list", None, None),
    "all_gather_into_tensor": ("input_tensor", "output_tensor", None, None),
    "all_gather_single": ("input_tensor", "output_tensor", None, None),
    "_all_gather_base": ("input_tensor", "output_tensor", None, None),
    "gather": ("tensor", "gather_list", ("dst", "group_dst"), None),
    "scatter": ("scatter_list", "tensor", ("src", "group_src"), None),
    "reduce_scatter": ("input_list", "output", None, "op"),
    "reduce_scatter_tensor": ("input", "output", None, "op"),
    "reduce_scatter_single": ("input", "output", None, "op"),
    "_reduce_scatter_base": ("input", "output", None, "op"),
    "all_to_all": ("input_tensor_list", "output_tensor_list", None, None),
    "all_to_all_single": ("input", "output", None, None),
    "barrier": (None, None, None, None),
    "all_reduce_coalesced": ("tensors", None, None, "op"),
    "all_gather_coalesced": ("input_tensor_list", "output_tensor_lists", None, None),
    "send": ("tensor", None, ("dst", "group_dst"), None),
    "recv": (None, "tensor", ("src", "group_src"), None),
}


class Unchecked(Exception):
    """A call whose arguments are not for the check to judge (a sparse tensor, a form it does
    not know): every rank still publishes, saying so, and the call goes on unchecked."""


# -- describing a call --------------------------------------------------------------------------

_dtype_names: dict[Any, str] = {}


def spec(tensor: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of a dense tensor, as the recorder's ops say it: ("float32", (4,))."""
    try:
        dtype = tensor.dtype
        shape = tuple(tensor.shape)
    except AttributeError:
        raise Unchecked("not a tensor") from None
    if tensor.is_sparse:
        raise Unchecked("a sparse tensor")
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).replace("torch.", "")
    return name, shape


def tensors(value: Any) -> Tensors:
    """The specs of a tensor, a list of them, or a list of lists (flattened); () for None."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        out: list = []
        for item in value:
            out.extend(tensors(item) if isinstance(item, (list, tuple)) else (spec(item),))
        return tuple(out)
    return (spec(value),)


def redop_name(op: Any) -> Optional[str]:
    if op is None:
        return None
    name = getattr(op, "name", None)  # ReduceOp.RedOpType
    if isinstance(name, str):
        return name
    return repr(op)  # a ReduceOp instance (premul_sum...): compared as torch shows it


def describe(kind: str, args: dict, group_rank: Callable[[Any, Any], Optional[int]],
             blocking: bool = True) -> Description:
    """The description of a call to ``kind`` with ``args`` (by name). ``group_rank(global,
    group)`` turns a root's arguments into a rank of the group (None: not one)."""
    layout = LAYOUTS.get(kind)
    if layout is None:
        raise Unchecked(kind)
    in_name, out_name, root_names, op_name = layout
    inputs = tensors(args.get(in_name)) if in_name else ()
    outputs = tensors(args.get(out_name)) if out_name else ()
    root = None
    if root_names is not None:
        root = group_rank(args.get(root_names[0]), args.get(root_names[1]))
        if root is None:
            raise Unchecked("no root")  # recv from any rank; a root outside the group (torch says so)
    redop = None
    if op_name:  # every reducing call's default is a sum
        redop = redop_name(args[op_name]) if args.get(op_name) is not None else "SUM"
    tag = None
    extra: Any = None
    if kind in P2P:
        tag = args.get("tag", 0)
        if not isinstance(tag, int):
            raise Unchecked("a tag that is not an int")
        extra = blocking
    elif kind == "all_to_all_single":
        extra = (_splits(args.get("output_split_sizes")), _splits(args.get("input_split_sizes")))
    return (kind, redop, root, tag, inputs, outputs, extra)


def _splits(value: Any) -> Optional[tuple[int, ...]]:
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise Unchecked("splits that are not ints") from None


def encode(description: Description) -> bytes:
    return marshal.dumps(description, _MARSHAL_VERSION)


def decode(data: bytes) -> Description:
    return marshal.loads(data)


UNCHECKED = encode(("?", None, None, None, (), (), None))  # a rank that does not judge this one


# -- what a rank publishes: a call's description and the user's line, in one slot ---------------

def joined(description: bytes, line: bytes, room: int) -> bytes:
    """A slot's bytes (``room`` at most: a call too big to publish whole goes unjudged)."""
    data = struct.pack("<I", len(description)) + description + line
    if len(data) <= room:
        return data
    data = struct.pack("<I", len(UNCHECKED)) + UNCHECKED + line  # too big to judge here
    return data if len(data) <= room else struct.pack("<I", len(UNCHECKED)) + UNCHECKED


def description_of(data: bytes) -> bytes:
    (length,) = struct.unpack_from("<I", data)
    return data[4:4 + length]


def line_of(data: bytes) -> Optional[tuple[str, int]]:
    """The user's (file, line) a slot names (None: none), from its bytes after the description."""
    (length,) = struct.unpack_from("<I", data)
    return where(data[4 + length:])


def where(line: bytes) -> Optional[tuple[str, int]]:
    """(file, line) of an encoded line (None: empty, or not one)."""
    if not line:
        return None
    try:
        filename, lineno = decode(line)
        return str(filename), int(lineno)
    except Exception:
        return None


# -- the rules ---------------------------------------------------------------------------------

def apart(descriptions: Sequence[Description], size: int) -> Optional[str]:
    """Why the ranks' calls (``descriptions[i]``: group rank i's) cannot be one collective, or
    None: "a different op", "a different src", "a different reduce op", "different dtypes",
    "different sizes". A rank that did not judge its call (UNCHECKED) makes it None."""
    if any(d[0] == "?" for d in descriptions):
        return None
    kind = descriptions[0][0]
    if any(d[0] != kind for d in descriptions):
        return "a different op"
    if kind in ROOTED and len({d[2] for d in descriptions}) > 1:
        return f"a different {ROOTED[kind]}"
    if len({d[1] for d in descriptions}) > 1:
        return f"a different reduce op: {', '.join(str(d[1]) for d in descriptions)}"
    if kind in _ALIKE:
        first = _counted(descriptions[0])
        for d in descriptions[1:]:
            why = _differ(first, _counted(d))
            if why:
                return why
        return None
    return _flows_apart(kind, descriptions, size)


def _counted(d: Description) -> tuple:
    return tuple((dtype, math.prod(shape)) for dtype, shape in d[4]), \
        tuple((dtype, math.prod(shape)) for dtype, shape in d[5])


def _differ(a: Any, b: Any) -> Optional[str]:
    if a == b:
        return None
    return "different dtypes" if _dtypes(a) != _dtypes(b) else "different sizes"


def _dtypes(value: Any) -> set:
    out: set = set()
    for part in value:
        for item in part if isinstance(part, tuple) and part and isinstance(part[0], tuple) else (part,):
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                out.add(item[0])
    return out


def _flows_apart(kind: str, descriptions: Sequence[Description], size: int) -> Optional[str]:
    """Calls whose ranks pass different tensors by design: what each rank sends to each peer
    must be what that peer expects from it."""
    sends = [_flow(kind, d, i, size, sending=True) for i, d in enumerate(descriptions)]
    expects = [_flow(kind, d, i, size, sending=False) for i, d in enumerate(descriptions)]
    if kind in ("gather", "scatter"):  # the non-root ranks alike among themselves, too
        side = 4 if kind == "gather" else 5
        alike = {tuple((t, math.prod(s)) for t, s in d[side]) for d in descriptions}
        if len(alike) > 1:
            return _differ(*sorted(alike)[:2])
    why = None
    for i in range(size):
        for j, sent in sends[i].items():
            expected = expects[j].get(i)
            if expected != sent:
                found = _differ((sent,), (expected,))
                if found == "different dtypes":
                    return found
                why = why or found
    return why


def _flow(kind: str, d: Description, me: int, size: int, sending: bool) -> dict[int, Any]:
    """{peer: (dtype, number of elements)} this rank sends to each peer (``sending``) or expects
    from each; a missing or malformed entry is None (it then fits nothing)."""
    inputs, outputs, root = d[4], d[5], d[2]

    def element(items: Tensors, j: int) -> Any:
        return (items[j][0], math.prod(items[j][1])) if j < len(items) else None

    if kind == "gather":
        if sending:
            return {root: element(inputs, 0)}
        return {i: element(outputs, i) for i in range(size)} if me == root else {}
    if kind == "scatter":
        if sending:
            return {j: element(inputs, j) for j in range(size)} if me == root else {}
        return {root: element(outputs, 0)}
    if kind == "all_to_all":
        items = inputs if sending else outputs
        return {j: element(items, j) for j in range(size)} if len(items) == size else {j: None for j in range(size)}
    if kind == "all_to_all_single":
        items = inputs if sending else outputs
        splits = (d[6] or (None, None))[1 if sending else 0]
        if not items:
            return {j: None for j in range(size)}
        dtype, shape = items[0]
        rows = shape[0] if shape else 1
        row = math.prod(shape[1:]) if shape else 1
        if splits is None:
            return {j: (dtype, rows / size * row) for j in range(size)}
        if len(splits) != size:
            return {j: None for j in range(size)}
        return {j: (dtype, splits[j] * row) for j in range(size)}
    return {}


def p2p_apart(send: Description, recv: Description) -> Optional[str]:
    """Why a send and the recv that takes it cannot carry one tensor, or None (also for another
    tag: gloo pairs each tag's calls apart, so that is not this send's recv)."""
    if send[0] == "?" or recv[0] == "?" or send[3] != recv[3]:
        return None
    return _differ(_counted(send)[0], _counted(recv)[1])
