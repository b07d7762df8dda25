"""Widgets on a persistent rank: its comms (ipywidgets' link to each model in the frontend)
travel over the rank's channel to the caller, which opens them in the notebook's kernel.

A rank has no kernel, so ``comm.create_comm`` would give ipywidgets a comm that sends
nothing: the frontend got a widget's view but never its model ("model not found"). Here a
Session rank's comms send over its channel, installed through the ``comm`` package's
hooks, as ipykernel installs its own::

    rank (this module)                          caller (engine/comms.py)            frontend
    widget opens, changes, closes:
      comm.publish_msg ───── frame ──────────> CommBridge.from_rank ──────> comm_open / comm_msg /
        {"op": "comm_open"/"comm_msg"/          kernel comm, same comm_id     comm_close on iopub
         "comm_close", comm_id, data,
         metadata, buffers, target_name}
      from any thread, at once (a long cell's updates are live)
    deliver(frame) <─ COMM request ──────────── kernel comm's on_msg <────── comm_msg / comm_close
      on the main thread, between requests        (a frontend message)          on shell
      (a kernel handles comm messages between cells too), as user code: the stop button
      reaches a handler, and what it prints and displays goes to the caller like a cell's

``clear_output()`` inside an Output widget goes as a ``clear`` frame (the caller clears the
Output, not the cell). ``tqdm.auto`` picks its widget bar when it sees a Jupyter kernel's
shell module loaded: it is, on a rank with comms (:func:`_want_widget_tqdm`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import itertools
import sys
import threading
from typing import Any, Callable, Optional

from . import display

#: The msg_id a rank's Output widget captures under; the caller puts the id of the kernel's
#: message running now (a cell's execute_request, or a frontend's comm_msg) in its place.
PARENT = "mpify-nb-rank-parent"

#: Sends one frame (a dict) to the caller; set by the rank's serve loop.
_send: Optional[Callable[[dict], None]] = None
_manager: Any = None
#: How long a frame that moves an Output widget's capture waits for the caller's ack (the
#: caller pumps only while it waits on a call: between calls, a background thread's frame
#: goes on after this).
SYNC_TIMEOUT = 0.5
_acks: dict[int, threading.Event] = {}
_tokens = itertools.count(1)


class _Kernel:
    """What ipywidgets asks of a comm's ``kernel``: not None (so it sends), and the parent
    request an Output widget captures under (see PARENT)."""

    def get_parent(self, channel: str = "shell") -> dict:
        return {"header": {"msg_id": PARENT, "msg_type": "execute_request"}}


def _flush_stdio() -> None:
    """What the rank printed so far reaches the caller before the frame does (an Output widget
    captures by time: prints before its end belong to it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def install(send: Callable[[dict], None]) -> None:
    """Route this rank's comms to ``send`` (one frame a message), from now on."""
    global _send
    _send = send
    if "comm" in sys.modules:
        _patch_comm(sys.modules["comm"])
    else:  # patched when something imports it (ipywidgets does): a rank without widgets pays nothing
        sys.meta_path.insert(0, display.AfterImport("comm", _patch_comm))
    functions = sys.modules.get("IPython.core.display_functions")
    if functions is not None:
        _patch_clear(functions)
        _rebind_preloaded(functions)
    else:
        sys.meta_path.insert(0, display.AfterImport("IPython.core.display_functions", _patch_clear))
    if "tqdm.autonotebook" in sys.modules:  # preloaded by the template, where it chose text bars
        _want_widget_tqdm()
        for name in ("tqdm.autonotebook", "tqdm.auto"):
            if name in sys.modules:
                importlib.reload(sys.modules[name])
    else:
        sys.meta_path.insert(0, _BeforeImport("tqdm.autonotebook", _want_widget_tqdm))


def deliver(frame: dict) -> None:
    """A frontend's message to one of this rank's comms (the caller's COMM request): to the comm
    manager, as ipykernel hands it a shell message. A handler's error is logged to stderr by
    the manager (as in a kernel); nothing is raised but an interrupt."""
    manager = _get_comm_manager()
    op = frame.get("op")
    msg = {
        "header": {"msg_id": PARENT, "msg_type": op},
        "parent_header": {},
        "metadata": frame.get("metadata") or {},
        "content": {"comm_id": frame.get("comm_id"), "data": frame.get("data") or {}},
        "buffers": [memoryview(b) for b in frame.get("buffers") or ()],
    }
    if op == "comm_msg":
        manager.comm_msg(None, None, msg)
    elif op == "comm_close":
        manager.comm_close(None, None, msg)


def _patch_comm(comm: Any) -> None:
    """The ``comm`` package's hooks, as ipykernel sets them in a kernel."""
    comm.create_comm = _create_comm
    comm.get_comm_manager = _get_comm_manager


def _get_comm_manager() -> Any:
    global _manager
    if _manager is None:
        from comm.base_comm import CommManager

        _manager = CommManager()
    return _manager


_comm_cls: Optional[type] = None


def _create_comm(*args: Any, **kwargs: Any) -> Any:
    global _comm_cls
    if _comm_cls is None:  # made at first use: ``comm`` is imported only by a rank with widgets
        _comm_cls = _comm_class()
    return _comm_cls(*args, **kwargs)


def _comm_class() -> type:
    from comm.base_comm import BaseComm

    class _RankComm(BaseComm):
        """A comm whose messages go to the caller, which opens its twin in the kernel."""

        kernel = _Kernel()

        def publish_msg(self, msg_type: str, data: Optional[dict] = None, metadata: Optional[dict] = None,
                        buffers: Optional[list] = None, **keys: Any) -> None:
            frame = {"op": msg_type, "comm_id": self.comm_id, "data": data or {}, "metadata": metadata or {},
                     "buffers": [bytes(memoryview(b)) for b in buffers or ()]}
            if msg_type == "comm_open":
                frame["target_name"] = keys.get("target_name") or self.target_name
                frame["target_module"] = keys.get("target_module")
            _emit(frame)

    return _RankComm


def _emit(frame: dict) -> None:
    """Send ``frame``. One that starts or ends an Output widget's capture (or clears it) waits
    until the caller has passed it on: this rank's stdout is a pipe beside the channel, and
    what it prints next must reach the frontend after the frame, what it printed before,
    before it (the caller relays the pipe's bytes before it passes a frame on)."""
    _flush_stdio()
    if _send is None:
        return
    state = frame.get("data", {}).get("state")
    if frame["op"] != "clear" and not (isinstance(state, dict) and "msg_id" in state):
        _send(frame)
        return
    token = next(_tokens)
    done = _acks[token] = threading.Event()
    frame["sync"] = token
    try:
        _send(frame)
        done.wait(SYNC_TIMEOUT)
    finally:
        _acks.pop(token, None)


def acked(token: int) -> None:
    """The caller passed on the frame ``token`` (its COMM_ACK, on the control thread)."""
    done = _acks.get(token)
    if done is not None:
        done.set()


# -- clear_output and tqdm ---------------------------------------------------------------------

def _patch_clear(module: Any) -> None:
    original = module.clear_output

    def clear_output(wait: bool = False) -> None:
        """``IPython.display.clear_output`` on a rank: clears the Output widget that captures
        now (the caller knows which); outside one, what a terminal does."""
        if _send is None:
            original(wait)
            return
        _emit({"op": "clear", "wait": bool(wait)})

    clear_output.__doc__ = original.__doc__
    module.clear_output = clear_output


def _rebind_preloaded(functions: Any) -> None:
    """Modules the template preloaded (ipywidgets' interact and Output, IPython.display) bound
    IPython's ``display`` and ``clear_output`` before this rank replaced them (rank/display.py,
    here): rebind those names to the replacements."""
    shown = sys.modules.get("IPython.display")
    if shown is None:
        return
    swaps = [(name, shown.__dict__.get(name), functions.__dict__.get(name)) for name in ("display", "clear_output")]
    swaps = [(name, old, new) for name, old, new in swaps if old is not None and new is not None and old is not new]
    if not swaps:
        return
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)  # never getattr(module, name): a module's __getattr__ may import
        if not isinstance(names, dict):
            continue
        for name, old, new in swaps:
            if names.get(name) is old:
                names[name] = new


def _want_widget_tqdm() -> None:
    """tqdm.autonotebook picks the widget bar when ipykernel's shell module is loaded (a Jupyter
    kernel): on a rank with comms, widgets do reach the frontend, so load it (when ipywidgets is
    there too; without it tqdm would warn and fall back anyway)."""
    if importlib.util.find_spec("ipywidgets") is None:
        return
    try:
        importlib.import_module("ipykernel.zmqshell")
    except Exception:
        return
    if "comm" in sys.modules:
        _patch_comm(sys.modules["comm"])  # ours, whatever ipykernel set


class _BeforeImport(importlib.abc.MetaPathFinder):
    """Calls ``first()`` when ``name`` is about to be imported."""

    def __init__(self, name: str, first: Callable[[], None]):
        self.name, self.first = name, first

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        self.first()
        return importlib.util.find_spec(name)
