"""Waits inside torch that only the flight recorder would show, seen another way where gloo has
no recorder (torch < 2.8; see compat.has_gloo_recorder).

On such a torch a rank blocked in a collective whose frame is not ``distributed_c10d.py``'s (a
DTensor's ``full_tensor()``, a functional collective, DDP's gradient all_reduce inside
``backward()``) shows nothing the collective watch (torchdist/waits.py) knows. The control
thread looks here instead, only once the caller asked it to watch (some rank of the group is
not running the request), at the main thread::

    its stack holds _functional_collectives.wait_tensor      a wait, at once: that function
    (DTensor's collectives go through it too)                 does nothing else
    its innermost Python frame is torch's, and the thread    a wait: a computing thread uses
    sleeps without using any CPU for IDLE_LOOKS looks in a    CPU; one that sleeps inside torch
    row (autograd's backward running DDP's or FSDP's hooks)   with a peer absent waits for it

What it waits in is named after the torch call the user's code made (``Tensor.backward``,
``DTensor.full_tensor``), or, when that call is a tensor's dispatch, the torch.distributed
function it waits in: which collective it is, only the recorder knows.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Optional

#: Looks in a row (the control thread looks every 50 ms) a thread must sleep inside torch
#: without using CPU before it counts as waiting on a collective.
IDLE_LOOKS = 10

_TORCH_DIR: Optional[str] = None
_FUNCTIONAL = os.path.join("distributed", "_functional_collectives.py")

#: thread id -> (its CPU time at the last look, how many looks in a row it slept without using any)
_idle: dict[int, tuple[int, int]] = {}


def _torch_dir() -> Optional[str]:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        torch = sys.modules.get("torch")
        path = getattr(torch, "__file__", None)
        if path is None:
            return None
        _TORCH_DIR = os.path.dirname(os.path.abspath(path)) + os.sep
    return _TORCH_DIR


def look(thread_id: int) -> Optional[str]:
    """What ``thread_id`` waits in inside torch (a name for the user: ``Tensor.backward``), or None."""
    torch_dir = _torch_dir()
    frame = sys._current_frames().get(thread_id)
    if torch_dir is None or frame is None:
        return None
    inside = _torch_frames(frame, torch_dir)  # innermost first, up to the first frame not torch's
    if not inside:
        _idle.pop(thread_id, None)
        return None
    if any(f.f_code.co_filename.endswith(_FUNCTIONAL) and f.f_code.co_name == "wait_tensor" for f in inside):
        return _name(inside, torch_dir)
    if not _sleeping_without_cpu(thread_id):
        return None
    return _name(inside, torch_dir)


def _torch_frames(frame: Any, torch_dir: str) -> list:
    inside = []
    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
        inside.append(frame)
        frame = frame.f_back
    return inside


def _sleeping_without_cpu(thread_id: int) -> bool:
    """Has the thread slept, and used no CPU, since the last IDLE_LOOKS looks?"""
    native = _native_id(thread_id)
    state_and_cpu = _state_and_cpu(native) if native is not None else None
    if state_and_cpu is None:
        _idle.pop(thread_id, None)
        return False
    state, cpu = state_and_cpu
    last = _idle.get(thread_id)
    looks = last[1] + 1 if last is not None and last[0] == cpu and state == "S" else 0
    _idle[thread_id] = (cpu, looks)
    return looks >= IDLE_LOOKS


def _native_id(thread_id: int) -> Optional[int]:
    if thread_id == threading.main_thread().ident:
        # The process's first thread (its id is the pid). Not its native_id: in a process forked
        # from another thread (a rank from the template), Python 3.11 keeps the parent's there.
        return os.getpid()
    for thread in threading.enumerate():
        if thread.ident == thread_id:
            return thread.native_id
    return None


def _state_and_cpu(native_id: int) -> Optional[tuple[str, int]]:
    """(state letter, user + system CPU time in clock ticks) of one of this process's threads."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def _name(inside: list, torch_dir: str) -> str:
    """The torch call the user's code made (the outermost of ``inside``), qualified; a dispatch
    (``__torch_dispatch__``) is named by the innermost torch.distributed function instead."""
    outer = _qualified(inside[-1], torch_dir)
    if not outer.rsplit(".", 1)[-1].startswith("__"):
        return outer
    for frame in inside:
        if os.sep + "distributed" + os.sep in frame.f_code.co_filename:
            return _qualified(frame, torch_dir)
    return outer


def _qualified(frame: Any, torch_dir: str) -> str:
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)  # Python 3.11+: Class.method
    if "." in name and "<" not in name:
        return name
    module = os.path.splitext(code.co_filename[len(torch_dir):])[0].replace(os.sep, ".")
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
    return f"torch.{module}.{code.co_name}"
