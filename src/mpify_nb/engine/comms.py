"""Widgets on ranks, the caller's side: each rank's comms opened in the notebook's kernel under
the same ids, their messages passed on both ways (the rank's side is rank/comms.py).

::

    rank k ── frame {"op": "comm_open", comm_id, ...} ──> CommBridge.from_rank(k, frame)
                                                            kernel comm, same comm_id, target,
                                                            data, metadata, buffers ──> frontend
    rank k ── comm_msg / comm_close / clear ────────────> kernel comm.send / .close / clear_output
    frontend comm_msg / comm_close to that id ──> kernel comm's on_msg / on_close
                                                  ──> send_to_rank(k, frame): rank k only

A rank's comm ids are UUIDs (a widget's view names its model by that id), so a rank's model
and its kernel twin share one id and the kernel's own widgets are left alone. When a rank
is gone (restarted, dead, its Session closed) :meth:`CommBridge.close_rank` closes its models
in the frontend: no dead widget still looks live. Without a kernel (a Session from plain
Python) there is no frontend: frames are dropped, and ranks are told not to make comms.

An Output widget on a rank captures under a placeholder id (rank/comms.py: PARENT): here it
becomes the id of the kernel message running now (the cell, or the frontend's comm_msg
whose handler runs on the rank), the one the relayed output is published under.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional

from ..rank.comms import PARENT


def kernel() -> Any:
    """The ipykernel this process runs, when it runs one (None in plain Python)."""
    module = sys.modules.get("ipykernel.kernelbase")
    if module is None:
        return None
    try:
        return module.Kernel.instance() if module.Kernel.initialized() else None
    except Exception:
        return None


class CommBridge:
    """The ranks' comms, twinned in the kernel. ``send_to_rank(rank, frame)`` delivers a
    frontend's message (a dict: op, comm_id, data, metadata, buffers) to that rank.

    Example (what a Session does)::

        bridge = CommBridge(lambda rank, frame: ...)   # deliver to the rank
        bridge.from_rank(1, frame)                      # a frame rank 1 sent
        bridge.close_rank(1)                            # rank 1 restarted: close its models
    """

    def __init__(self, send_to_rank: Callable[[int, dict], None]):
        self._send_to_rank = send_to_rank
        self._lock = threading.Lock()
        self._comms: dict[int, dict[str, Any]] = {}  # rank -> {comm_id: the kernel's comm}
        self._capturing: dict[int, set[str]] = {}  # rank -> its Output models capturing now

    @staticmethod
    def available() -> bool:
        """Is there a frontend to show widgets (this process is a Jupyter kernel)?"""
        return kernel() is not None

    def open_ids(self, rank: Optional[int] = None) -> list[str]:
        """The comm ids open now (of ``rank``, or of every rank)."""
        with self._lock:
            ranks = [rank] if rank is not None else sorted(self._comms)
            return [cid for r in ranks for cid in self._comms.get(r, {})]

    def from_rank(self, rank: int, frame: dict) -> None:
        """A comm message rank ``rank`` sent: to the frontend, through the kernel's twin."""
        if kernel() is None:
            return  # nothing renders widgets here
        op, comm_id = frame.get("op"), frame.get("comm_id", "")
        if op == "clear":
            self._clear(rank, bool(frame.get("wait")))
            return
        data, metadata, buffers = frame.get("data") or {}, frame.get("metadata") or {}, frame.get("buffers") or []
        self._translate(rank, comm_id, data)
        try:
            if op == "comm_open":
                self._open(rank, comm_id, frame, data, metadata, buffers)
            elif op == "comm_msg":
                twin = self._twin(rank, comm_id)
                if twin is not None:
                    twin.send(data=data, metadata=metadata, buffers=buffers)
            elif op == "comm_close":
                with self._lock:
                    twin = self._comms.get(rank, {}).pop(comm_id, None)
                    self._capturing.get(rank, set()).discard(comm_id)
                if twin is not None:
                    twin.close(data=data, metadata=metadata, buffers=buffers)
        except Exception as e:  # the frontend's loss, not the cell's
            print(f"[mpify_nb] rank {rank}'s widget message could not be passed on: {type(e).__name__}: {e}",
                  file=sys.stderr)

    def close_rank(self, rank: int) -> None:
        """Rank ``rank`` is gone: close its models in the frontend."""
        with self._lock:
            twins = self._comms.pop(rank, {})
            self._capturing.pop(rank, None)
        for twin in twins.values():
            try:
                twin.close()
            except Exception:
                pass  # the kernel is going away too

    def close(self) -> None:
        """Every rank is gone."""
        for rank in list(self._comms):
            self.close_rank(rank)

    @staticmethod
    def show(rank: int, bundle: dict) -> None:
        """A display a rank made while it handled a frontend's message (interact's result):
        published as it came; the Output widget that captures now takes it."""
        from IPython.display import publish_display_data

        data = bundle.get("data", bundle) if isinstance(bundle, dict) else {"text/plain": repr(bundle)}
        metadata = bundle.get("metadata", {}) if isinstance(bundle, dict) and "data" in bundle else {}
        publish_display_data(dict(data), metadata)

    # -- inside --------------------------------------------------------------------------------

    def _open(self, rank: int, comm_id: str, frame: dict, data: dict, metadata: dict, buffers: list) -> None:
        import comm

        twin = comm.create_comm(comm_id=comm_id, target_name=frame.get("target_name") or "comm",
                                target_module=frame.get("target_module"), data=data, metadata=metadata,
                                buffers=buffers)
        twin.on_msg(lambda msg: self._from_frontend(rank, comm_id, "comm_msg", msg))
        twin.on_close(lambda msg: self._from_frontend(rank, comm_id, "comm_close", msg))
        with self._lock:
            self._comms.setdefault(rank, {})[comm_id] = twin

    def _twin(self, rank: int, comm_id: str) -> Any:
        with self._lock:
            return self._comms.get(rank, {}).get(comm_id)

    def _from_frontend(self, rank: int, comm_id: str, op: str, msg: dict) -> None:
        """The frontend's message to a rank's model (on the kernel's thread, between cells)."""
        if op == "comm_close":
            with self._lock:
                self._comms.get(rank, {}).pop(comm_id, None)
                self._capturing.get(rank, set()).discard(comm_id)
        content = msg.get("content", {})
        frame = {"op": op, "comm_id": comm_id, "data": content.get("data") or {},
                 "metadata": msg.get("metadata") or {},
                 "buffers": [bytes(memoryview(b)) for b in msg.get("buffers") or ()]}
        try:
            self._send_to_rank(rank, frame)
        except KeyboardInterrupt:
            print(f"[mpify_nb] interrupted: rank {rank}'s widget handler stopped", file=sys.stderr)
        except Exception as e:
            print(f"[mpify_nb] rank {rank} could not handle the widget's message: {type(e).__name__}: {e}",
                  file=sys.stderr)

    def _translate(self, rank: int, comm_id: str, data: dict) -> None:
        """An Output widget's capture id: the placeholder becomes the kernel message running now.
        Output that was relayed before the capture starts or ends is flushed first."""
        state = data.get("state")
        if not isinstance(state, dict) or "msg_id" not in state:
            return
        _flush_kernel_streams()
        if state["msg_id"] == PARENT:
            parent = kernel().get_parent() or {}
            state["msg_id"] = parent.get("header", {}).get("msg_id", "")
        with self._lock:
            capturing = self._capturing.setdefault(rank, set())
            if state["msg_id"]:
                capturing.add(comm_id)
            else:
                capturing.discard(comm_id)

    def _clear(self, rank: int, wait: bool) -> None:
        """``clear_output()`` on a rank: clears its Output widget that captures now (nothing
        outside one: the cell holds every rank's output)."""
        with self._lock:
            capturing = bool(self._capturing.get(rank))
        if capturing:
            from IPython.display import clear_output

            _flush_kernel_streams()
            clear_output(wait=wait)


def _flush_kernel_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
