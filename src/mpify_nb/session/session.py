"""Session: N persistent ranks that keep their Python state across calls.

``ranch`` starts fresh ranks for every call. A ``Session`` starts ranks 0..N-1 once
(all of them child processes: the caller is *not* a rank) with a ``torch.distributed``
group among them, and then runs code in their namespaces, call after call, until
``close()``. It is the engine's long-lived use (engine/core.py), ranch's the short-lived one:
ranks are forked from the warm template (start/placement.py, start/template.py), talk over socketpairs
made before they exist (wire/framing.py, wire/protocol.py), data travels with wire/payload.py (dill functions,
shared-memory tensors and arrays), output goes through relay/pipes.py and errors come back as
wire/errors.py's ``RankError``\\ s.

Data flow of one ``run()``::

    caller (Session, one thread)                          rank k (rank/session.py)
    ----------------------------                          ------------------------
    RUN (source, filename) ────── work channel ─────────> main thread: exec the body,
                                                           eval the last expression
    wait loop, one select() over every rank's:
      work channel     <── DONE value / FAIL traceback ── main thread
      stdout/stderr    <── print(...) ─────────────────── main thread (and C code)
      control channel  <── SEEN snapshot ─────────────── control thread, when the watch looks (LOOK):
                                                           what the rank waits in (torchdist/waits.py)
      pidfd            <── readable when the rank dies
      wake pipe        <── interrupt() from any thread, SIGINT, close()
    relay: "[rank k] ..." lines into the cell running now (written on the caller's thread)

When the call is stuck, the caller acts (``_stop``, ``_collective_failed``)::

    interrupt / timeout  ── INTERRUPT req ──> control thread: SIGINT to the main thread
    the collective watch (engine/watch.py), from half a second into a call, every 50 ms while
    some rank is not running req (idle, finished, failed, dead):
                         ── LOOK round ────> every live rank: what it waits in, what it issued
                         <── SEEN ─────────  (engine/verdict.py judges)
    some rank waits on a collective that a rank of its group never issues, or collectives
    that cannot match (CollectiveError):
                         ── ABORT_GROUP ───> every rank shuts down its TCP connections to
                                             the other ranks and destroys its groups: a rank
                                             blocked in gloo raises within ~10 ms, even when
                                             the user still holds the group (a DDP wrapper)
                         <── ABORTED ──────  (the rebuild waits for every rank's ack)
    then, once every rank is idle:
                         ── GROUP (port) ──> all ranks join a new group in place
                                             (Python state kept)
    a rank dies          ── the call fails at once with RankExitedError; restart() forks
                            a fresh one from the template and rebuilds the group

Its rooms, from the bottom: session/ranks.py (the ranks, an engine's: start, hear, bury),
session/recovery.py (a stuck call: stop, collective watch, abort, rebuild), session/calls.py
(one call: send, wait, results), and here the public calls.

Security: the only channels are socketpairs and pipes created before the ranks exist.
The rendezvous store (torch's TCPStore, no pickle) listens on loopback in rank 0, on a
socket the caller bound and handed over; the caller itself listens on nothing.
"""

from __future__ import annotations

import ast
import itertools
import linecache
import os
import pickle
import threading
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional

from ..engine import interrupts
from ..engine.where import where_of
from ..start import placement
from ..torchdist.groups import parse_gpus
from ..wire import payload
from ..wire.errors import PayloadError, RankError
from ..wire.protocol import APPLY, MISSING, NO_REQUEST, PULL, PUSH, RUN
from .background import SessionBackground
from .calls import Ranks, check_timeout
from .status import RankStatus, RankWhere, Where, _rss


class Session(SessionBackground):
    """N persistent ranks (0..N-1, all child processes) with a ``torch.distributed`` group,
    whose namespaces live across calls.

    Args:
        n: number of ranks.
        ddp: start a process group among them (``init_process_group`` on every rank).
        gpus: GPU ids by rank (``"3,1"`` or ``[3, 1]``); default: rank i on GPU i when CUDA
            is available (and the backend is not gloo), else CPU.
        backend: ``"gloo"``, ``"nccl"``...; default nccl on GPUs, gloo on CPU.
        timeout: default time limit in seconds for every call (None: no limit).

    Each rank's namespace starts with ``rank``, ``world_size``, ``device``, ``dist``
    (``torch.distributed``) and ``torch``. The constructor returns once every rank is up
    and the group is ready.

    Example (a notebook cell):

    ```python
    from mpify_nb import Session

    with Session(2) as s:
        s.run("t = torch.ones(2) * (rank + 1)")
        print(s.run("dist.all_reduce(t); t"))     # the last expression's value, by rank
        print(s.pull("t", rank=None))              # every rank's t
    ```

    ```output
    {0: tensor([3., 3.]), 1: tensor([3., 3.])}
    [tensor([3., 3.]), tensor([3., 3.])]
    ```
    """

    #: How the error of a dead rank says to replace it (the magics say ``%dist_restart``).
    restart_how = "Session.restart()"
    def __init__(self, n: int, *, ddp: bool = True, gpus: Any = None, backend: Optional[str] = None,
                 timeout: Optional[float] = None):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, not {n!r}")
        check_timeout(timeout)
        gpu_list = parse_gpus(gpus)
        if gpu_list is not None and len(gpu_list) < n:
            raise ValueError(f"gpus={gpu_list} names {len(gpu_list)} GPUs for {n} ranks: give one per rank")
        if gpu_list is not None and placement.get_placement() != "local":
            raise ValueError("Session(gpus=...): under set_placement('ray') Ray gives each rank its GPUs "
                             "(set_placement('ray', num_gpus=1)); leave gpus out")
        super().__init__(n, bool(ddp), gpu_list, backend)
        self.timeout = timeout
        self._gone = threading.Event()  # set when close() has ended every rank
        self._cells = itertools.count(1)
        self._modules_sent: dict[int, frozenset[str]] = {}  # rank -> modules its apply() calls imported
        _sessions.add(self)
        interrupts.install()  # from the main thread: the stop button then reaches calls on others
        try:
            # Held for the session's life: on Ray, a placement group with a bundle per rank.
            self._placer = placement.get_placer()
            self._layout = self._placer.reserve(n, None, timeout)
            self._base_env = dict(os.environ) if self._placer.ships_environ else {}
            self._base_env.update(self._layout.world_env(n))
            self._base_env.pop("MPIFY_NB_STORE_RANK", None)
            self._start(list(range(n)))
        except BaseException:
            self.close()
            raise

    # -- the public calls --------------------------------------------------------------

    def run(self, source: str, ranks: Ranks = None, timeout: Optional[float] = None, *,
            filename: Optional[str] = None, display: Optional[Callable[[int, dict], None]] = None,
            wait: bool = True) -> Any:
        """Run ``source`` in each rank's namespace; return ``{rank: value of its last expression}``
        (None when the source does not end with an expression, or ends with ``;``).

        ``filename`` is what tracebacks show (IPython's cell file name gives ``Cell In[n]``).
        ``display(rank, mimebundle)`` is called here for ``display(obj)`` on a rank (default:
        its text printed, labelled). Output is live, ``[rank k] ...``.

        ``wait=False``: return a :class:`BackgroundWork` at once and run it in the background,
        holding every rank (another call is refused meanwhile: ``RanksBusyError``); its output
        goes to the cell that started it, ``pull`` reads the ranks' variables as they are now,
        its ``result()`` is this dict.

        Raises ``RankRaisedError`` (identical errors of several ranks merged),
        ``CollectiveError``, ``RankExitedError``, ``TimeoutError``, ``KeyboardInterrupt``;
        after each of them the session stays usable (dead ranks need ``restart()``).

        >>> s.run("x = rank * 10\\nx + 1")
        {0: 1, 1: 11}
        >>> h = s.run("for step in range(10**6): loss = 1 / (step + 1)", wait=False)
        >>> s.pull("step")           # while it runs
        4127
        """
        if not isinstance(source, str):
            raise TypeError(f"source must be a str, not {type(source).__name__}")
        if filename is None:
            filename = f"<session cell {next(self._cells)}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for where()
        ast.parse(source, filename, "exec")  # a SyntaxError is raised here, once, not by every rank
        body = pickle.dumps((source, filename, _wants_value(source)))
        first = next((line.strip() for line in source.splitlines() if line.strip()), "")
        if not wait:
            return self._in_background("Session.run", self._targets(ranks),
                                       lambda: self._call(RUN, body, [], ranks, timeout, display, first))
        return self._call(RUN, body, [], ranks, timeout, display, first)

    def apply(self, fn: Callable, *args: Any, ranks: Ranks = None, timeout: Optional[float] = None,
              **kwargs: Any) -> dict[int, Any]:
        """Call ``fn(*args, **kwargs)`` on each rank; return ``{rank: value}``. ``fn`` travels
        like with ``ranch`` (dill, notebook globals included) and also sees the rank's
        namespace (``rank``, ``model``...) for names it does not bring.

        >>> s.apply(lambda: rank ** 2)
        {0: 0, 1: 1}
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        targets = self._targets(ranks)
        packed = payload.pack_call(fn, args, kwargs)  # PayloadError before anything is sent
        try:
            return self._call(APPLY, self._body(packed, targets), packed.fds, ranks, timeout, None,
                              f"apply({getattr(fn, '__qualname__', repr(fn))})")
        finally:
            packed.close_later()

    def push(self, ranks: Ranks = None, **variables: Any) -> None:
        """Define ``variables`` in the namespace of each rank. Big tensors and numpy arrays
        go through shared memory, written once whatever the number of ranks (each rank maps
        it copy-on-write: its writes stay its own).

        >>> s.push(lr=0.1, batch=torch.randn(1024, 1024))
        """
        targets = self._targets(ranks)
        packed = payload.pack_values(variables)  # PayloadError before anything is sent
        try:
            self._call(PUSH, self._body(packed, targets), packed.fds, ranks, None, None,
                       f"push {', '.join(variables)}")
        finally:
            packed.close_later()

    def _body(self, packed: payload.PackedCall, targets: list[int]) -> bytes:
        """What to send: ahead of the pickle, the modules the notebook imported that were not sent
        to these ranks yet (wire/modules.py); once sent, a rank has imported them (or failed to,
        the same way next time)."""
        held = frozenset.intersection(*(self._modules_sent.get(r, frozenset()) for r in targets))
        body = packed.body(held)
        for r in targets:
            self._modules_sent[r] = self._modules_sent.get(r, frozenset()) | frozenset(packed.modules)
        return body

    def pull(self, name: str, rank: Optional[int] = 0) -> Any:
        """The value of ``name`` on ``rank``; ``rank=None``: a list of every rank's, by rank.
        A name a rank lacks raises ``NameError`` naming the rank; a value that cannot be
        pickled (a generator, an open file) raises ``PayloadError``.

        While a call runs (background work, a call on another thread), it is read as it is then,
        beside the running code, which goes on (the Background work guide: what such a read sees).

        >>> s.pull("loss")            # rank 0's
        >>> s.pull("loss", rank=None) # [rank 0's, rank 1's, ...]
        """
        targets = None if rank is None else [rank]
        try:
            if self._busy_elsewhere():
                values = self._peek(name, self._targets(targets))
            else:
                values = self._call(PULL, pickle.dumps(name), [], targets, None, None, None)
        except RankError as e:
            cause = e.__cause__
            who = f"rank {e.ranks[0]}" if len(e.ranks) == 1 else f"ranks {e.ranks}"
            if isinstance(cause, NameError):
                raise NameError(f"name {name!r} is not defined on {who}") from None
            if isinstance(cause, PayloadError):  # it cannot be pickled: no stand-in comes back
                raise PayloadError(f"cannot pull {name!r} from {who}: {cause}") from None
            raise
        return values[rank] if rank is not None else [values[r] for r in sorted(values)]

    def missing_names(self, names: Iterable[str], ranks: Ranks = None) -> dict[int, set[str]]:
        """``{rank: the names of ``names`` its namespace (and builtins) lacks}``."""
        values = self._call(MISSING, pickle.dumps(list(names)), [], ranks, None, None, None)
        return {r: set(v or ()) for r, v in values.items()}

    def debug(self, rank: Optional[int] = None, timeout: Optional[float] = None) -> None:
        """pdb post mortem on a rank, in the frames of the last error a cell raised there,
        with its locals; commands are asked of you as ``input()`` is. ``rank``: by default the
        root cause of the last call that failed (the rank that raised, not the ranks left
        waiting for it).

        >>> s.run("x = 1 / (rank - 1)")   # RankRaisedError: rank 1 raised ZeroDivisionError
        >>> s.debug()                     # (Pdb) p rank  ->  1
        """
        if rank is None:
            if self.last_error is None:
                raise ValueError("no call of this Session has failed: name a rank to debug (debug(rank=k))")
            rank = self.last_error.rank
        self._targets(rank)  # ValueError for a rank out of range
        from ..rank.stdin import post_mortem

        if not self.apply(post_mortem, ranks=[rank], timeout=timeout)[rank]:
            raise ValueError(f"no cell has failed on rank {rank} (since it started): there is nothing to debug")

    def status(self) -> list[RankStatus]:
        """One row per rank: pid, state (idle, running, dead), device, RSS, GPU memory, last cell.
        Callable from another thread while a call runs."""
        if self._call_lock.acquire(blocking=False):
            try:
                self._notice_deaths()
            finally:
                self._call_lock.release()
        rows = []
        for r in sorted(self._members):
            m = self._members[r]
            state = "dead" if not m.alive else "running" if m.req != NO_REQUEST else "idle"
            rss = _rss(m.pid) if state != "dead" and m.process.shares_clock else None  # its /proc is ours
            group = m.group or ("session" if self.ddp else "none")
            rows.append(RankStatus(r, m.pid, state, m.device, rss, m.gpu_memory if state != "dead" else None,
                                   m.last_cell, str(m.exit_error) if m.exit_error else "", self._layout.nodes[r],
                                   group if state != "dead" else "none"))
        return rows

    def where(self, timeout: float = 5.0) -> Where:
        """Each rank's Python stack and the collectives it waits in, now: from another thread
        while a call runs (the call goes on), or between calls. A rank that does not answer
        within ``timeout`` seconds (C code holding its interpreter) is left out.

        >>> threading.Thread(target=s.run, args=("dist.all_reduce(t)",), kwargs={"ranks": [0]}).start()
        >>> print(s.where())
        rank 0: waits in all_reduce #3 of float32[2]
          Cell In[5], line 1, in <module>
            dist.all_reduce(t)
          ...
        rank 1: idle
        """
        self._check_open()
        return where_of(self._look_at_ranks(timeout), self._engine.user_waits.waiting)

    def interrupt(self) -> None:
        """Stop what the ranks run now (what the notebook's stop button does); callable from
        any thread. The running call raises ``KeyboardInterrupt``; every rank lives on with
        its state. Does nothing between calls."""
        with self._flag_lock:
            if self._current == NO_REQUEST:
                return
            self._interrupt_asked = True
        self._engine.wake()

    def restart(self, ranks: Ranks = None) -> None:
        """Replace ``ranks`` (default: the dead ones) with fresh ranks forked from the template,
        and rebuild the group; the other ranks keep their state. With no rank dead, the Session's
        group is rebuilt in place where a cell destroyed it or made its own instead.

        >>> s.restart()        # after rank 1 was killed, or a cell's dist.destroy_process_group()
        >>> s.restart([0])     # a fresh rank 0, even though it was alive
        """
        self._refuse_if_busy()
        with self._call_lock:
            self._check_open()
            self._notice_deaths()
            targets = [r for r, m in self._members.items() if not m.alive] if ranks is None \
                else self._targets(ranks)
            if not targets:
                if self.ddp and any(m.group not in (None, "session") for m in self._members.values()):
                    self._start([])  # every rank joins a new group in place, its state kept
                return
            self._raise_if_others_dead(targets)  # restart those too, or the group cannot form
            # Either done or not begun: the stop button only sets a flag while ranks are replaced
            # (a KeyboardInterrupt between burying the old ones and starting their successors left
            # a session without those ranks). It takes effect once the restart is done.
            with self._flag_lock:
                self._interrupt_asked = False
            restore = interrupts.take_sigint(self._on_sigint, self)
            try:
                for r in targets:
                    self._bury(self._members[r])  # stays a member, dead, until its successor exists
                    self._modules_sent.pop(r, None)
                self._start(targets)
            finally:
                restore()
            if self._interrupt_asked:
                raise KeyboardInterrupt(f"interrupted, after ranks {targets} were restarted")

    def close(self) -> None:
        """End every rank; when this returns their processes are gone. Idempotent."""
        # Done whole or not begun, as restart(): SIGINT is taken before anything changes, then only noted
        # (a press half-way left fds open; one before it was taken left ranks running, close() hanging).
        interrupted = []
        restore = interrupts.take_sigint(lambda: interrupted.append(True), self)
        with self._flag_lock:
            first, self.closed = not self.closed, True
        if not first:
            restore()
            self._gone.wait()  # another thread is closing it: return when it is done
            if interrupted:
                raise KeyboardInterrupt("interrupted, after the Session was closed")
            return
        try:
            # Killed before taking the lock: a call running in another thread then ends at once.
            for m in list(self._members.values()):
                m.process.kill()
            self._engine.wake()
            with self._call_lock:
                for m in list(self._members.values()):
                    self._bury(m)
                self._members.clear()
                if self._placer is not None:
                    self._placer.release()
                self._engine.close()
                self._engine.relay.close(timeout=0)
        finally:
            self._gone.set()
            restore()
        if interrupted:
            raise KeyboardInterrupt("interrupted, after the Session was closed")

    def _forget_in_child(self) -> None:
        """In a fork of the caller (a DataLoader worker of the notebook): drop our copies of the
        ranks' channels, or the ranks would not see the caller die while this child lives."""
        self.closed = True
        self._engine.forget_in_child()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<Session closed>"
        states = {r: ("dead" if not m.alive else "running" if m.req else "idle") for r, m in self._members.items()}
        return f"<Session {self.world_size} ranks {states}>"


_sessions: weakref.WeakSet[Session] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for session in list(_sessions):
        if not session.closed:
            session._forget_in_child()
    _sessions.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)




# -- helpers --------------------------------------------------------------------------------

def _wants_value(source: str) -> bool:
    """IPython shows the last expression's value unless the cell ends with ';'."""
    lines = [line for line in source.rstrip().splitlines() if line.strip()]
    return not lines or not lines[-1].split("#", 1)[0].rstrip().endswith(";")




__all__ = ["Session", "RankStatus", "Where", "RankWhere"]
