"""The frames a caller and its ranks exchange: one kind byte, a request id, a body.

Every rank, a ``ranch`` rank and a Session's alike, speaks this one protocol over its
channel (and a Session's rank also over its control channel). Each kind byte means one
thing whichever way and whichever channel it travels, so the caller dispatches every frame
it reads through one table (engine/core.py) and a rank's control thread through another
(rank/control.py). A capability that adds frames (widgets' comms) picks kind bytes not
listed here and registers its handlers in those two tables: :func:`claim` keeps two
capabilities from taking the same byte.
"""

from __future__ import annotations

import struct
from typing import Any

# -- to a rank, on its channel (the rank's main thread: one request at a time) ---------------
CALL = b"c"  # a ranch call (fn, args, ctx; memfds): load it, READY, wait for GO, run, answer, exit
GO = b"G"  # every rank of a ranch call has loaded it: run it (its body: the store's port, when a STORE told it)
RUN, APPLY, PUSH, PULL, MISSING, GROUP = b"r", b"a", b"p", b"l", b"m", b"g"  # a Session's requests
CHECKS = b"K"  # a Session's request: the collective check on or off from now on (set_collective_checks)
# -- to a rank's control thread (a Session's control channel; a ranch rank's channel once it runs)
INTERRUPT, ABORT_GROUP, ANSWER = b"i", b"x", b"n"
LOOK = b"w"  # the caller looks at the rank (engine/watch.py): what it waits in, where it is; SEEN answers
PEEK_STDIN = b"k"  # its stdout holds a partial line (a prompt?): is a thread reading fd 0 itself? (ASK RAW)
PEEK = b"v"  # a Session rank's variable, read now while a call runs (a live pull); PEEKED answers
# -- from a rank ----------------------------------------------------------------------------------
READY = b"R"  # started (a Session's rank: its group is up) or loaded (a ranch call)
STORE = b"S"  # the rendezvous store's host on a Ray node bound this port (pickled): the caller tells the others
DONE, FAIL = b"D", b"F"  # the answer to a request: its value; (RemoteFailure, interrupted, meta)
DISPLAY = b"P"  # display(obj) on a Session's rank: a mime bundle
ASK = b"Q"  # the rank reads its stdin (rank/stdin.py): a token; the caller sends ANSWER (token, answer)
IMPORTED = b"M"  # the modules a ranch rank imported (as it goes, and before its answer; start/preload.py)
GPU_USED = b"U"  # the CUDA device a ranch rank used (before its answer): a spare gets it ready (start/spares.py)
ABORTED = b"A"  # a Session rank cut its group's connections (ABORT_GROUP)
SEEN = b"C"  # a rank's answer to LOOK: a torchdist.waits.Snapshot (from its control thread)
RETURNED = b"I"  # a ranch rank's fn returned, its group still up: its Snapshot (before ctx.__exit__)
PEEKED = b"V"  # the answer to PEEK: b"\x01" + the value (payload.pack_result; memfds), or b"\x00" + (why, text)
# -- widgets (rank/comms.py, engine/comms.py): a frontend's comm message to a rank (its main thread, a request
#    like a tiny cell); a rank's comm frame to the kernel (any thread); the caller passed on a frame
#    marked "sync" (to the control thread)
COMM, COMM_OUT, COMM_ACK = b"u", b"W", b"o"

_ID = struct.Struct("!Q")
NO_REQUEST = 0

#: Every kind byte in use, by name: a capability's claim() must not take one of them.
_claimed: dict[bytes, str] = {
    value: name for name, value in dict(globals()).items()
    if isinstance(value, bytes) and len(value) == 1 and name.isupper()
}


def claim(kind: bytes, name: str) -> bytes:
    """Reserve the kind byte ``kind`` for a capability's frames (``name`` says whose); returns it.
    Raises ValueError when another frame has it already."""
    if len(kind) != 1:
        raise ValueError(f"a frame kind is one byte, not {kind!r}")
    holder = _claimed.setdefault(kind, name)
    if holder != name:
        raise ValueError(f"frame kind {kind!r} is taken by {holder}")
    return kind


def pack(kind: bytes, req_id: int, body: bytes = b"") -> bytes:
    return kind + _ID.pack(req_id) + body


def unpack(data: Any) -> tuple[bytes, int, Any]:
    """(kind, request id, body as a memoryview: no copy of a big payload)."""
    view = memoryview(data)
    return bytes(view[:1]), _ID.unpack(view[1:9])[0], view[9:]
