"""``async_op=True`` collectives handed back before their check is over, and issued later in order.

A rank's async collective returns at once, as torch's does: a correct program may wait on it only
after a blocking send or recv its peer needs first (rank 0: ``w = all_reduce(t, async_op=True);
send(x, 1); w.wait()``; rank 1: ``recv(x, 0); all_reduce(t, async_op=True)``). So when its peers'
calls are not all published yet, the check goes on in the group's *lane*::

    user thread: w = dist.all_reduce(t, async_op=True)
      Group.collective_async: publish, looks for SPIN ── all there ──> judged, issued here: torch's Work
                                                      └─ not yet ───> Lane.add ──> a DeferredWork, at once
    the lane's thread (one per group, while it holds calls and IDLE seconds after; asleep on the bell):
      its head: the peers' calls ── alike ──> torch's own call issues it to gloo (async), on this thread
                                 └─ apart ──> the Work fails with the CollectiveError (w.wait() raises)
      then the next: collectives reach gloo in the order the rank made them
    a later collective on the group, sync or async, goes behind the lane's (a sync one waits for it
    to empty, seen by the watch as waiting in the lane's head); point-to-point calls do not wait

A rank publishes at most :data:`AHEAD` calls beyond those it judged, the rest wait in the lane
unpublished: a peer then never has a slot of its ring overwritten before it read it (table.py).
The watch sees a thread in ``w.wait()`` of a call still in the lane as waiting in the lane's
head, at the line that called it (torchdist/waits.py, :func:`groups.waiting_in`); the lane's
calls are among the rank's ops, not done. The lane's thread runs only Python that waits (the
bell's futex and a lock release the GIL) or issues; an abort of the group, or the group destroyed,
fails every call it holds.
"""

from __future__ import annotations

import _thread
import sys
import threading
from collections import deque
from typing import Any, Callable, Optional

import torch
from torch._C._distributed_c10d import Work

from ..recorder import Op
from . import calls
from .mismatch import HOLD_INTERRUPTS

#: Calls a rank publishes beyond the last one it judged (table.RING must be at least 2 * AHEAD + 2).
AHEAD = 3
#: Seconds a thread waiting for the lane sleeps at most before it looks again (the stop button).
SLICE = 0.05
#: Seconds the lane's thread stays once empty, for the next async call (a loop of them would
#: otherwise start a thread per call: ~100 us each on 2 loaded cores).
IDLE = 0.5


class LaneClosed(RuntimeError):
    """An async collective the check still held when its group ended: its peers never made the
    same call, so it never reached gloo. Raised by its ``Work.wait()``.

    Example (a ``%%distributed`` cell; rank 1 issues nothing before the group is destroyed):

    ```python
    w = dist.all_reduce(t, async_op=True) if rank == 0 else None
    dist.destroy_process_group()
    w.wait() if w else None   # rank 0: LaneClosed: the process group 0 was destroyed before this
                              # all_reduce's check was over: its peers never made the call
    ```
    """


def deferrable(pg: Any) -> bool:
    """May an async call on ``pg`` be handed back before its check is over? Not inside a coalescing
    manager (the call issues nothing), under a dispatch or function mode (they belong to this
    thread), nor when collectives are registered for compiled code to wait on (a Work must exist)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        if c10d is None or pg in getattr(c10d._world, "pg_coalesce_state", {}):
            return False
        if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
            return False
        c10d_c = getattr(torch._C, "_distributed_c10d", None)
        inflight = getattr(c10d_c, "_allow_inflight_collective_as_graph_input", None)
        return not (inflight is not None and inflight())
    except Exception:
        return False


class Deferred:
    """One call in a lane: what it is, how to issue it, and once settled its work or error."""

    __slots__ = ("index", "description", "line", "issue", "grad", "published", "work", "error", "gate", "future")

    def __init__(self, index: int, description: bytes, line: bytes, issue: Callable[[], Any],
                 published: bool) -> None:
        self.index = index
        self.description = description
        self.line = line
        self.issue = issue
        self.grad = torch.is_grad_enabled()
        self.published = published
        self.work: Any = None
        self.error: Optional[BaseException] = None
        self.gate = _thread.allocate_lock()  # held until settled: waiters block on it, in C
        self.gate.acquire()
        self.future: Any = None

    @property
    def settled(self) -> bool:
        return not self.gate.locked()


class Lane:
    """A group's calls handed back before their check was over, in the order the rank made them,
    and the thread that finishes each check and issues it."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.items: deque[Deferred] = deque()
        self.lock = threading.Lock()
        self.came = threading.Condition(self.lock)  # a call added to the empty lane, or the group closed
        self.thread: Optional[threading.Thread] = None

    def add(self, index: int, description: bytes, line: bytes, issue: Callable[[], Any], published: bool) -> Work:
        item = Deferred(index, description, line, issue, published)
        with self.lock:
            self.items.append(item)
            self._publish_ready()
            thread = None
            if self.thread is None:
                thread = self.thread = threading.Thread(target=self._run, daemon=True,
                                                        name=f"mpify_nb-check-lane-{self.group.name}")
            else:
                self.came.notify()
        if thread is not None:
            thread.start()
        return DeferredWork(item, self)

    def _publish_ready(self) -> None:
        """Publish, in order, the calls a peer can read before their slots come round again."""
        group = self.group
        for item in self.items:
            if item.published:
                continue
            if item.index - group.judged > AHEAD:
                return
            group.publish(item.index, item.description, item.line)
            item.published = True

    # -- the lane's thread ------------------------------------------------------------------------

    def _run(self) -> None:
        group = self.group
        while True:
            with self.lock:
                if not self.items and not group.closing:
                    self.came.wait(IDLE)
                if not self.items:
                    self.thread = None
                    return
                item = self.items[0]
                self._publish_ready()  # the head has room: every call before it was judged

            def checking() -> tuple[Op, Optional[tuple[str, int]]]:  # what a look at this thread says
                return self.gating()

            try:
                got = group.wait_for_peers(item.index, checking, self._gone)
            except BaseException as e:  # an abort, the group gone: no call of the lane will be issued
                self._fail_all(e)
                return
            work, error = None, group.judge(item.index, item.description, item.line, got)
            if error is None:
                try:
                    with torch.set_grad_enabled(item.grad):
                        work = item.issue()
                except BaseException as e:  # torch refused it (as it would have at the call)
                    error = e
            with self.lock:
                self.items.popleft()
            self._settle(item, work, error)

    def _gone(self) -> Optional[BaseException]:
        """Why the lane's calls can no longer be issued (the group destroyed or closed), or None."""
        group = self.group
        pg = group.pg()
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        alive = pg is not None and c10d is not None and pg in getattr(c10d._world, "pg_names", {})
        if alive and not group.closing:
            return None
        return LaneClosed(f"the process group {group.name} was destroyed before this {{kind}}'s check was over: "
                          "its peers never made the call")

    def _fail_all(self, error: BaseException) -> None:
        with self.lock:
            items = list(self.items)
            self.items.clear()
            self.thread = None
        for item in items:
            self._settle(item, None, error)

    def _settle(self, item: Deferred, work: Any, error: Optional[BaseException]) -> None:
        if isinstance(error, LaneClosed):
            error = LaneClosed(str(error).replace("{kind}", calls.decode(item.description)[0]))
        with self.lock:
            item.work, item.error = work, error
            future = item.future
            item.gate.release()
        if future is not None:
            _link(future, work, error)

    # -- what a look says ------------------------------------------------------------------------

    def gating(self, item: Optional[Deferred] = None) -> tuple[Op, Optional[tuple[str, int]]]:
        """The call the lane waits for now (its head; ``item`` once the lane is empty), numbered
        as the recorder will number it, and the user's line that made it."""
        try:
            head = self.items[0]
        except IndexError:
            if item is None:
                raise
            head = item
        return self.group.op_of(calls.decode(head.description), self.group.number()), calls.where(head.line)

    def ops(self) -> list[tuple[Op, int]]:
        """(op, index) of each call still in the lane, numbered as the recorder will number them."""
        items = list(self.items)
        if not items:
            return []
        first = self.group.number()
        return [(self.group.op_of(calls.decode(item.description), None if first is None else first + i), item.index)
                for i, item in enumerate(items) if not item.settled]

    def drain(self) -> None:
        """Wait until every call in the lane was issued or failed (a sync collective comes next)."""
        while True:
            try:
                last = self.items[-1]
            except IndexError:
                return
            _await_settled(self, last)

    def join(self, timeout: float) -> None:
        with self.lock:
            self.came.notify_all()  # an idle thread: the group is closing
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def _await_settled(lane: Lane, item: Deferred) -> None:
    """Block until ``item`` is issued or failed. The watch reads ``checking`` here (groups.waiting_in):
    this rank waits in the lane's head. The stop button on a persistent rank is held in the group
    until then (a peer may be entering gloo on this rank's word), as a wait in the check holds it."""

    def checking() -> tuple[Op, Optional[tuple[str, int]]]:
        return lane.gating(item)

    while True:
        try:
            if item.gate.acquire(True, SLICE):  # in C: no frame of the threading module below this one
                item.gate.release()
                return
        except KeyboardInterrupt as e:
            if not HOLD_INTERRUPTS[0]:
                raise
            lane.group.held = e


def _link(future: Any, work: Any, error: Optional[BaseException]) -> None:
    """Complete ``future`` as the issued work's own future completes (or with ``error``)."""
    if error is not None:
        future.set_exception(error)
        return

    def copy(done: Any) -> None:
        try:
            future.set_result(done.value())
        except Exception as e:
            future.set_exception(e)

    work.get_future().add_done_callback(copy)


class DeferredWork(Work):
    """The ``Work`` of an async collective whose check finishes in its group's lane: torch's own
    calls on it (``wait``, ``is_completed``, ``get_future``...) wait for the lane first, then go
    to the work gloo gave. A mismatch the check finds raises from ``wait()`` and fails the future."""

    def __init__(self, item: Deferred, lane: Optional[Lane]) -> None:
        super().__init__()
        self._item = item
        self._lane = lane

    def _issued(self) -> Any:
        item, lane = self._item, self._lane
        if not item.settled and lane is not None:
            _await_settled(lane, item)
        if item.error is not None:
            if lane is not None:
                lane.group.held = None  # the error is the news
            raise item.error
        if lane is not None:
            lane.group.raise_held()
        return item.work

    def wait(self, timeout: Any = None) -> bool:
        work = self._issued()
        return work.wait() if timeout is None else work.wait(timeout)

    def is_completed(self) -> bool:
        item = self._item
        return item.settled and (item.error is not None or item.work.is_completed())

    def is_success(self) -> bool:
        item = self._item
        return item.settled and item.error is None and item.work.is_success()

    def exception(self) -> Any:
        item = self._item
        if not item.settled:
            return None
        return item.error if item.error is not None else item.work.exception()

    def result(self) -> Any:
        return self._issued().result()

    def source_rank(self) -> int:
        return self._issued().source_rank()

    def synchronize(self) -> None:
        self._issued().synchronize()

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` that completes with the collective's value (a list of its
        tensors), or fails with the check's error: as a DDP communication hook chains it."""
        item = self._item
        lane = self._lane
        lock = lane.lock if lane is not None else threading.Lock()
        with lock:
            if item.future is None:
                item.future = torch.futures.Future()
                if not item.settled:
                    return item.future
                work, error = item.work, item.error
            else:
                return item.future
        _link(item.future, work, error)
        return item.future

    def _get_op_type(self) -> Any:
        item = self._item
        if item.settled and item.work is not None:
            return item.work._get_op_type()
        raise RuntimeError("this collective's check is not over")

    def __repr__(self) -> str:
        kind = calls.decode(self._item.description)[0]
        state = "failed" if self._item.error is not None else "issued" if self._item.settled else "checking"
        return f"<DeferredWork {kind} #{self._item.index} ({state})>"


def failed(error: BaseException) -> DeferredWork:
    """A Work that raises ``error`` from ``wait()`` (an async call the check refused at once)."""
    item = Deferred(-1, calls.UNCHECKED, b"", lambda: None, True)
    item.error = error
    item.gate.release()
    return DeferredWork(item, None)
