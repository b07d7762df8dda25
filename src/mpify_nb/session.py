"""Session: N persistent ranks that keep their Python state across calls.

``ranch`` starts fresh ranks for every call. A ``Session`` starts ranks 0..N-1 once
(all of them child processes: the caller is *not* a rank) with a ``torch.distributed``
group among them, and then runs code in their namespaces, call after call, until
``close()``. It reuses ranch's rooms: ranks are forked from the warm template
(placement.py, template.py), talk over socketpairs made before they exist (wire.py),
data travels with payload.py (dill functions, shared-memory tensors and arrays), output
goes through relay.py and errors come back as errors.py's ``RankError``\\ s.

Data flow of one ``run()``::

    caller (Session, one thread)                          rank k (session_rank.py)
    ----------------------------                          ------------------------
    RUN (source, filename) ────── work channel ─────────> main thread: exec the body,
                                                           eval the last expression
    wait loop, one select() over every rank's:
      work channel     <── DONE value / FAIL traceback ── main thread
      stdout/stderr    <── print(...) ─────────────────── main thread (and C code)
      control channel  <── COLLECTIVE [waits] ─────────── control thread: what the rank waits
                                                           on in torch.distributed (waits.py)
      pidfd            <── readable when the rank dies
      wake pipe        <── interrupt() from any thread, SIGINT, close()
    relay: "[rank k] ..." lines into the cell running now (written on the caller's thread)

When the call is stuck, the caller acts (``_stop``, ``_collective_failed``)::

    interrupt / timeout  ── INTERRUPT req ──> control thread: SIGINT to the main thread
    some rank not running req (idle, finished, failed, dead):
                         ── WATCH req ─────> the ranks still running req read torch's recorder
                         ── PEEK req ──────> a rank not running req, once a collective of its
                         <── ISSUED ───────  group waits: its count of the group's collectives
    some rank waits on a collective that a rank of its group never issues (CollectiveError):
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

Security: the only channels are socketpairs and pipes created before the ranks exist.
The rendezvous store (torch's TCPStore, no pickle) listens on loopback in rank 0, on a
socket the caller bound and handed over; the caller itself listens on nothing.
"""

from __future__ import annotations

import ast
import itertools
import os
import pickle
import selectors
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from . import comms, interrupts, payload, placement, prompts, wire
from . import session_rank as proto
from .errors import (
    CollectiveError,
    PayloadError,
    RankError,
    RankExitedError,
    RemoteFailure,
    SessionClosedError,
    merge_rank_errors,
    source_location,
)
from .groups import listen_on, parse_gpus
from .relay import OutputRelay
from .waits import Wait

Ranks = Union[int, Iterable[int], None]

#: How long a rank must sit in a collective while some other rank is idle before the
#: call gives up on it (the idle rank will never join).
COLLECTIVE_GRACE = 0.3
#: How long a rank runs on while some other rank is not running the call before it is asked
#: to read torch's recorder (the collective watch's first look).
_WATCH_AFTER = 0.05
#: After an interrupt, how long ranks still running get before their group is destroyed
#: under them (unsticks a gloo collective), and before we stop waiting for them at all.
_ABORT_AFTER = 0.15
_ABORT_ANYWAY = 0.5
_STOP_PATIENCE = 5.0
#: Pipe capacity for a rank's stdout/stderr: output printed between calls waits there.
_PIPE_SIZE = 1 << 20


@dataclass
class RankStatus:
    """One row of :meth:`Session.status`."""

    rank: int
    pid: int
    state: str  # "idle", "running" or "dead"
    device: str
    rss: Optional[int]  # resident memory, bytes (None once dead, or on another host)
    gpu_memory: Optional[int]  # bytes allocated by torch on its GPU; None without CUDA
    last_cell: str  # first line of the last thing it ran
    exit_detail: str = ""  # how it died
    node: str = "127.0.0.1"  # address of the host it runs on (a Ray node's, under Ray)


class _Member:
    """The caller's view of one persistent rank."""

    def __init__(self, rank: int, work: socket.socket, control: socket.socket,
                 process: placement.RankProcess, out_r: int, err_r: int):
        self.rank = rank
        self.work = work
        self.control = control
        self.process = process
        self.out_r, self.err_r = out_r, err_r
        self.state = "starting"  # starting, idle, running, dead
        self.device = "?"
        self.req = proto.NO_REQUEST  # the request it runs for us now
        self.answer: Optional[tuple[bytes, Any, list[int]]] = None  # (kind, body, fds) for self.req
        # what it waits on in torch.distributed for self.req (waits.py)
        self.waits: list[Wait] = []
        self.watched = proto.NO_REQUEST  # the request for which it reads torch's recorder
        # {group name: number of its last collective} for the request self.issued_req
        self.issued: Optional[dict[str, int]] = None
        self.issued_req = proto.NO_REQUEST
        self.gpu_memory: Optional[int] = None
        self.aborts = 0  # ABORT_GROUP sent and not yet acknowledged
        self.last_cell = ""
        self.exit_error: Optional[RankExitedError] = None
        self.start_failure: Optional[RemoteFailure] = None
        self.control_theirs: Optional[socket.socket] = None  # the rank's end, until sent
        self.buried = False  # its process is gone and its fds are closed
        self.died_during = proto.NO_REQUEST  # the call running when it died

    @property
    def pid(self) -> int:
        return self.process.pid  # on a Ray node, known once the rank has called back

    @property
    def alive(self) -> bool:
        return self.state != "dead"


class Session:
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

    Example (a notebook cell)::

        from mpify_nb import Session
        with Session(2) as s:
            s.run("t = torch.ones(2) * (rank + 1)")
            s.run("dist.all_reduce(t); t")        # -> {0: tensor([3., 3.]), 1: tensor([3., 3.])}
            s.pull("t", rank=None)                 # -> [tensor([3., 3.]), tensor([3., 3.])]
    """

    #: How the error of a dead rank says to replace it (the magics say ``%dist_restart``).
    restart_how = "Session.restart()"

    def __init__(self, n: int, *, ddp: bool = True, gpus: Any = None, backend: Optional[str] = None,
                 timeout: Optional[float] = None):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, not {n!r}")
        _check_timeout(timeout)
        self.world_size = n
        self.ddp = bool(ddp)
        self.timeout = timeout
        self._gpus = parse_gpus(gpus)
        if self._gpus is not None and len(self._gpus) < n:
            raise ValueError(f"gpus={self._gpus} names {len(self._gpus)} GPUs for {n} ranks: give one per rank")
        self._local = placement.get_placement() == "local"
        if self._gpus is not None and not self._local:
            raise ValueError("Session(gpus=...): under set_placement('ray') Ray gives each rank its GPUs "
                             "(set_placement('ray', num_gpus=1)); leave gpus out")
        self._backend = backend
        self.closed = False
        self._gone = threading.Event()  # set when close() has ended every rank
        self._members: dict[int, _Member] = {}
        self._ids = itertools.count(1)
        self._call_lock = threading.Lock()
        self._flag_lock = threading.Lock()
        self._current = proto.NO_REQUEST  # the request of the call running now
        self._interrupt_asked = False
        self._group_broken = False
        #: the error the last failed call raised (debug() starts at its root-cause rank)
        self.last_error: Optional[RankError] = None
        self._display: Optional[Callable[[int, dict], None]] = None
        self._cells = itertools.count(1)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._relay = OutputRelay(sys.stdout, sys.stderr)
        # A call's prompts for its ranks' reads of stdin, made at the first one (on the call's
        # own thread: the frontend's cell is found there).
        self._prompter: Optional[prompts.Prompter] = None
        self._placer: Optional[placement.Placer] = None
        self._comms = comms.CommBridge(self._comm_to_rank)  # widgets: ranks' comms twinned in the kernel
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
            ) -> dict[int, Any]:
        """Run ``source`` in each rank's namespace; return ``{rank: value of its last expression}``
        (None when the source does not end with an expression, or ends with ``;``).

        ``filename`` is what tracebacks show (IPython's cell file name gives ``Cell In[n]``).
        ``display(rank, mimebundle)`` is called here for ``display(obj)`` on a rank (default:
        its text printed, labelled). Output is live, ``[rank k] ...``.

        Raises ``RankRaisedError`` (identical errors of several ranks merged),
        ``CollectiveError``, ``RankExitedError``, ``TimeoutError``, ``KeyboardInterrupt``;
        after each of them the session stays usable (dead ranks need ``restart()``).

        >>> s.run("x = rank * 10\\nx + 1")
        {0: 1, 1: 11}
        """
        if not isinstance(source, str):
            raise TypeError(f"source must be a str, not {type(source).__name__}")
        if filename is None:
            filename = f"<session cell {next(self._cells)}>"
        ast.parse(source, filename, "exec")  # a SyntaxError is raised here, once, not by every rank
        body = pickle.dumps((source, filename, _wants_value(source)))
        first = next((line.strip() for line in source.splitlines() if line.strip()), "")
        return self._call(proto.RUN, body, [], ranks, timeout, display, first)

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
        packed = payload.pack_call(fn, args, kwargs)  # PayloadError before anything is sent
        try:
            return self._call(proto.APPLY, packed.data, packed.fds, ranks, timeout, None,
                              f"apply({getattr(fn, '__qualname__', repr(fn))})")
        finally:
            packed.close_later()

    def push(self, ranks: Ranks = None, **variables: Any) -> None:
        """Define ``variables`` in the namespace of each rank. Big tensors and numpy arrays
        go through shared memory, written once whatever the number of ranks (each rank maps
        it copy-on-write: its writes stay its own).

        >>> s.push(lr=0.1, batch=torch.randn(1024, 1024))
        """
        try:
            data, fds = payload.dumps(variables)
        except Exception as e:
            raise PayloadError(f"cannot send {sorted(variables)} to the ranks: {type(e).__name__}: {e}") from e
        packed = payload.PackedCall(data, fds)
        try:
            self._call(proto.PUSH, data, fds, ranks, None, None, f"push {', '.join(variables)}")
        finally:
            packed.close_later()

    def pull(self, name: str, rank: Optional[int] = 0) -> Any:
        """The value of ``name`` on ``rank``; ``rank=None``: a list of every rank's, by rank.
        A name a rank lacks raises ``NameError`` naming the rank; a value that cannot be
        pickled (a generator, an open file) raises ``PayloadError``.

        >>> s.pull("loss")            # rank 0's
        >>> s.pull("loss", rank=None) # [rank 0's, rank 1's, ...]
        """
        targets = None if rank is None else [rank]
        try:
            values = self._call(proto.PULL, pickle.dumps(name), [], targets, None, None, None)
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
        values = self._call(proto.MISSING, pickle.dumps(list(names)), [], ranks, None, None, None)
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
        from .rank_stdin import post_mortem

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
            state = "dead" if not m.alive else "running" if m.req != proto.NO_REQUEST else "idle"
            rss = _rss(m.pid) if state != "dead" and m.process.shares_clock else None  # its /proc is ours
            rows.append(RankStatus(r, m.pid, state, m.device, rss, m.gpu_memory if state != "dead" else None,
                                   m.last_cell, str(m.exit_error) if m.exit_error else "", self._layout.nodes[r]))
        return rows

    def interrupt(self) -> None:
        """Stop what the ranks run now (what the notebook's stop button does); callable from
        any thread. The running call raises ``KeyboardInterrupt``; every rank lives on with
        its state. Does nothing between calls."""
        with self._flag_lock:
            if self._current == proto.NO_REQUEST:
                return
            self._interrupt_asked = True
        self._wake()

    def restart(self, ranks: Ranks = None) -> None:
        """Replace ``ranks`` (default: the dead ones) with fresh ranks forked from the template,
        and rebuild the group; the other ranks keep their state.

        >>> s.restart()        # after rank 1 was killed
        >>> s.restart([0])     # a fresh rank 0, even though it was alive
        """
        with self._call_lock:
            self._check_open()
            self._notice_deaths()
            targets = [r for r, m in self._members.items() if not m.alive] if ranks is None \
                else self._targets(ranks)
            if not targets:
                return
            self._raise_if_others_dead(targets)  # restart those too, or the group cannot form
            # Either done or not begun: the stop button only sets a flag while ranks are replaced
            # (a KeyboardInterrupt between burying the old ones and starting their successors left
            # a session without those ranks). It takes effect once the restart is done.
            with self._flag_lock:
                self._interrupt_asked = False
            restore = _take_sigint(self._on_sigint, self)
            try:
                for r in targets:
                    self._bury(self._members[r])  # stays a member, dead, until its successor exists
                self._start(targets)
            finally:
                restore()
            if self._interrupt_asked:
                raise KeyboardInterrupt(f"interrupted, after ranks {targets} were restarted")

    def close(self) -> None:
        """End every rank; when this returns their processes are gone. Idempotent."""
        with self._flag_lock:
            first = not self.closed
            self.closed = True
        if not first:
            self._gone.wait()  # another thread is closing it: return when it is done
            return
        # Done whole, as restart(): the stop button only notes that it was pressed (an interrupt
        # half-way left rank fds and the relay open), and raises once every rank is gone.
        interrupted = []
        restore = _take_sigint(lambda: interrupted.append(True), self)
        try:
            # Killed before taking the lock: a call running in another thread then ends at once.
            for m in list(self._members.values()):
                m.process.kill()
            self._wake()
            with self._call_lock:
                for m in list(self._members.values()):
                    self._bury(m)
                self._members.clear()
                if self._placer is not None:
                    self._placer.release()
                self._selector.close()
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._relay.close(timeout=0)
        finally:
            self._gone.set()
            restore()
        if interrupted:
            raise KeyboardInterrupt("interrupted, after the Session was closed")

    def _forget_in_child(self) -> None:
        """In a fork of the caller (a DataLoader worker of the notebook): drop our copies of the
        ranks' channels, or the ranks would not see the caller die while this child lives."""
        self.closed = True
        fds = [self._wake_r, self._wake_w]
        for m in self._members.values():
            fds += [m.work.detach(), m.control.detach(), m.out_r, m.err_r]
            if m.process.death_fd is not None:
                fds.append(m.process.death_fd)
        try:
            fds.append(self._selector.fileno())  # type: ignore[attr-defined]
        except (AttributeError, ValueError):
            pass
        self._members = {}
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<Session closed>"
        states = {r: ("dead" if not m.alive else "running" if m.req else "idle") for r, m in self._members.items()}
        return f"<Session {self.world_size} ranks {states}>"

    # -- starting ranks ----------------------------------------------------------------

    def _session_config(self, rank: int, rendezvous: tuple[str, int, bool]) -> dict:
        gpu: Any = "auto" if self._backend in (None, "nccl") else None
        if self._gpus is not None:
            gpu = self._gpus[rank]
        return {"world_size": self.world_size, "ddp": self.ddp, "backend": self._backend, "gpu": gpu,
                "rendezvous": rendezvous, "comms": self._comms.available()}  # comms: widgets (comms.py)

    def _start(self, ranks: list[int]) -> None:
        """Start ``ranks`` (fresh processes) and, with ddp, (re)build the group with every
        live member; return once all have joined."""
        # No rank may still be cutting connections to its peers when the new group's are made.
        deadline = time.monotonic() + 5.0
        while any(m.alive and m.aborts > 0 for m in self._members.values()) and time.monotonic() < deadline:
            self._pump(0.05)
        self._raise_if_others_dead(ranks)
        live_old = [m for m in self._members.values() if m.alive and m.rank not in ranks]
        host = min([m.rank for m in live_old] + ranks)  # the rank that hosts the store
        placer = self._placer
        assert placer is not None
        # The store lives in the host rank, on its node's address (127.0.0.1 on this machine).
        listener = None
        if self.ddp and self._local:  # bound here, handed to the host: no rank has to retry
            listener = listen_on(self._layout.nodes[host], 0, self.world_size * 2)
            port = listener.getsockname()[1]
        else:  # on a Ray node the host binds it itself
            port = placer.store_port() if self.ddp else 0
        new: list[_Member] = []
        try:
            common = {"cwd": os.getcwd(), "sys_path": list(sys.path), "argv": list(sys.argv)}
            for r in ranks:
                m = self._spawn(placer, r)  # the host first: its node is known once it is placed (again)
                new.append(m)
                address = self._layout.nodes[host]
                env = dict(self._base_env, MASTER_ADDR=address, MASTER_PORT=str(port), **self._layout.env_of(r))
                setup = dict(common, rank=r, env=env,
                             session=self._session_config(r, (address, port, r == host)))
                assert m.control_theirs is not None
                fds = [m.control_theirs.fileno()] + ([listener.fileno()] if listener and r == host else [])
                try:
                    wire.send(m.work, pickle.dumps(setup), fds)
                except OSError:
                    pass  # died at birth; the wait below says how
                m.control_theirs.close()
                m.control_theirs = None
            req = next(self._ids)
            for m in live_old:
                if self.ddp:
                    body = pickle.dumps((self._layout.nodes[host], port, m.rank == host))
                    self._send_request(m, proto.GROUP, req, body,
                                       [listener.fileno()] if listener and m.rank == host else [], None)
        except BaseException:
            for m in new:  # a rank that could not be started: a dead member, never a missing one
                self._bury(m)
            raise
        finally:
            if listener is not None:
                listener.close()  # the host rank holds it now
        self._wait_started(new, live_old, req)

    def _raise_if_others_dead(self, ranks: list[int]) -> None:
        """With ddp, a group of every rank cannot form while a rank other than ``ranks`` (those
        being started) is dead: its survivors would wait in the rendezvous until it times out."""
        dead = [m for m in self._members.values() if not m.alive and m.rank not in ranks]
        if self.ddp and dead:
            raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])

    def _spawn(self, placer: placement.Placer, r: int) -> _Member:
        ours, theirs = wire.socketpair()
        control_ours, control_theirs = wire.socketpair()
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        for fd in (out_w, err_w):
            try:
                import fcntl

                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
            except (OSError, AttributeError):
                pass  # the default 64 KiB will do
        try:
            process = placer.start(r, theirs.fileno(), out_w, err_w, None)
        except BaseException:
            for s in (ours, control_ours, control_theirs):
                s.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            theirs.close()
            os.close(out_w)
            os.close(err_w)
        m = _Member(r, ours, control_ours, process, out_r, err_r)
        m.control_theirs = control_theirs  # sent with the setup
        self._members[r] = m
        self._relay.adopt(r, out_r, err_r)
        sel = self._selector
        sel.register(ours, selectors.EVENT_READ, ("work", m))
        sel.register(control_ours, selectors.EVENT_READ, ("control", m))
        sel.register(out_r, selectors.EVENT_READ, ("out", m))
        sel.register(err_r, selectors.EVENT_READ, ("out", m))
        if process.death_fd is not None:
            sel.register(process.death_fd, selectors.EVENT_READ, ("death", m))
        return m

    def _wait_started(self, new: list[_Member], old: list[_Member], req: int) -> None:
        self._relay.retarget(sys.stdout, sys.stderr)
        try:
            while True:
                failed = [m for m in new + old if not m.alive or m.start_failure is not None
                          or (m.answer is not None and m.answer[0] == proto.FAIL)]
                if failed:
                    break
                if all(m.state == "idle" for m in new) and all(m.req == proto.NO_REQUEST for m in old):
                    self._group_broken = False
                    return
                self._pump(None)
        finally:
            self._relay.end_call([fd for m in new + old for fd in (m.out_r, m.err_r)])
        # Some rank could not start or join: nothing half-built stays behind.
        errors: list[RankError] = []
        for m in failed:
            error: Optional[RankError] = None
            if m.exit_error is not None:
                error = m.exit_error
            elif m.start_failure is not None:
                error = m.start_failure.to_error(m.rank, payload.loads)
            elif m.answer is not None:
                error = _failure_of(m)
            if error is not None:
                errors.append(error)
                if m in new and m.exit_error is None:
                    m.exit_error = RankExitedError(m.rank, None, f"it could not start: {error}")
        for m in new:  # dead members, each with why: restart() tries them again
            m.process.kill()
            self._bury(m)
        self._group_broken = True
        raise merge_rank_errors(errors)

    def _bury(self, m: _Member) -> None:
        """Make sure ``m``'s process is gone, then let go of everything that was its (once)."""
        if m.buried:
            return
        m.buried = True
        self._comms.close_rank(m.rank)  # widgets: its models close in the frontend
        m.process.kill()
        if not m.process.wait_gone(5.0):
            pass  # its template died with it, or the kernel is slow: the pidfd says nothing more
        if m.state != "dead":
            m.process.exit_code(timeout=1.0)  # lets the template forget it
        m.process.kill_leftovers()  # what it started, in its own process group
        self._relay.forget([m.out_r, m.err_r])
        self._unregister(m.work, m.control, m.out_r, m.err_r, m.process.death_fd)
        if m.answer is not None:
            payload.close_fds(m.answer[2])
        m.work.close()
        m.control.close()
        os.close(m.out_r)
        os.close(m.err_r)
        m.process.close()
        m.state = "dead"

    # -- one call ----------------------------------------------------------------------

    def _targets(self, ranks: Ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        out = sorted(set(int(r) for r in ranks))  # type: ignore[union-attr]
        bad = [r for r in out if not 0 <= r < self.world_size]
        if bad or not out:
            raise ValueError(f"ranks must be in 0..{self.world_size - 1}, not {bad or 'none'}")
        return out

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("this Session is closed; start a new one")

    def _send_request(self, m: _Member, kind: bytes, req: int, body: bytes, fds: list[int],
                      label: Optional[str]) -> None:
        m.req, m.answer, m.waits = req, None, []
        if label is not None:
            m.last_cell = label
            m.state = "running"
        try:
            wire.send(m.work, proto.pack(kind, req, body), fds)
        except OSError:
            pass  # it died; the wait sees its pidfd

    def _call(self, kind: bytes, body: bytes, fds: list[int], ranks: Ranks, timeout: Optional[float],
              display: Optional[Callable[[int, dict], None]], label: Optional[str]) -> dict[int, Any]:
        if timeout is None:
            timeout = self.timeout
        _check_timeout(timeout)
        targets = self._targets(ranks)
        with self._call_lock:
            self._check_open()
            self._notice_deaths()
            dead = [self._members[r] for r in targets if not self._members[r].alive]
            if dead:
                raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])
            if self._group_broken:
                self._rebuild()  # an earlier rebuild failed (or waited for a rank): try again now
            req = next(self._ids)
            members = [self._members[r] for r in targets]
            self._display = display
            with self._flag_lock:
                self._current, self._interrupt_asked = req, False
            restore = _take_sigint(self._on_sigint, self)
            # views hook (issue 21): a per-rank view takes the ranks' streams (magics/views.py)
            self._relay.retarget(sys.stdout, sys.stderr, getattr(display, "rank_streams", None))
            self._prompter = None
            try:
                for m in members:
                    self._send_request(m, kind, req, body, fds, label)
                return self._wait(members, req, timeout)
            except RankError as e:
                self.last_error = e
                raise
            finally:
                self._close_prompts()
                with self._flag_lock:
                    self._current = proto.NO_REQUEST
                restore()
                self._relay.end_call([fd for m in self._members.values() for fd in (m.out_r, m.err_r)])
                self._display = None

    def _wait(self, members: list[_Member], req: int, timeout: Optional[float]) -> dict[int, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        stuck_since: Optional[float] = None
        partial_since: Optional[float] = None  # since when some rank has not been running req
        try:
            while True:
                dead = [m for m in members if not m.alive]
                if dead and self.closed:
                    raise SessionClosedError("the Session was closed while this call ran")
                if dead:
                    self._stop(members, req)
                    raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])
                if all(m.req != req for m in members):
                    break
                if self._interrupt_asked:
                    raise KeyboardInterrupt
                now = time.monotonic()
                # Time a rank waits for the user (a pdb prompt) is not the call's.
                prompter = self._prompter
                wait = None if deadline is None or prompter is not None and prompter.waiting else (
                    deadline + (prompter.waited() if prompter is not None else 0.0) - now)
                if wait is not None and wait <= 0:
                    assert timeout is not None  # a deadline comes from it
                    running = [m.rank for m in members if m.req == req]
                    self._stop(members, req)
                    raise TimeoutError(_timed_out(timeout, running, [m.rank for m in members if m.req == req]))
                if self.ddp:
                    if partial_since is None and not all(m.alive and m.req == req for m in self._members.values()):
                        partial_since = now
                    if partial_since is not None:
                        # A rank that runs on alone a while reads torch's recorder; most finish
                        # within a millisecond of the others, and a look costs them time.
                        left = partial_since + _WATCH_AFTER - now
                        if left <= 0:
                            self._watch_recorders(req)
                        else:
                            wait = left if wait is None else min(wait, left)
                    stuck, missing = self._stuck(req)
                    if stuck and missing:
                        stuck_since = stuck_since or now
                        if now - stuck_since >= COLLECTIVE_GRACE:
                            self._collective_failed(members, req, stuck, missing)
                        left = stuck_since + COLLECTIVE_GRACE - now
                        wait = left if wait is None else min(wait, left)
                    else:
                        stuck_since = None
                self._pump(wait)
        except KeyboardInterrupt:
            self._stop(members, req)
            raise
        return self._results(members)

    def _results(self, members: list[_Member]) -> dict[int, Any]:
        values: dict[int, Any] = {}
        errors: list[RankError] = []
        for m in members:
            assert m.answer is not None
            kind, body, fds = m.answer
            m.answer = None
            if kind == proto.DONE:
                if len(body):
                    value, meta = payload.unpack_result(body, fds)
                    m.gpu_memory = meta.get("gpu_memory")
                    values[m.rank] = value
                else:
                    values[m.rank] = None
            else:
                errors.append(_failure_of(m, body, fds))
        if errors:
            raise merge_rank_errors(errors)
        return values

    # -- when a call is stuck ----------------------------------------------------------

    def _watch_recorders(self, req: int) -> None:
        """Some rank is not running ``req`` (idle, finished, failed, dead): the ranks that still
        run it read torch's recorder for collectives they wait on (waits.py): it sees waits
        that a frame does not (Work.wait(), DTensor, DDP's hooks on autograd threads)."""
        for m in self._members.values():
            if m.alive and m.req == req and m.watched != req:
                m.watched = req
                self._send_control(m, proto.WATCH, req)

    def _stuck(self, req: int) -> tuple[list[_Member], list[_Member]]:
        """Ranks waiting in a collective for this call, and the ranks of its group that will
        never issue it: dead, or not running ``req`` and never having issued it (asked once
        per call, by PEEK: a rank that ran an async collective and finished has joined)."""
        absent = [m for m in self._members.values() if not m.alive or m.req != req]
        if not absent:
            return [], []
        stuck: list[_Member] = []
        missing: dict[int, _Member] = {}
        for m in self._members.values():
            if not (m.alive and m.req == req):
                continue
            for wait in m.waits:
                peers = [a for a in absent if wait.ranks is None or a.rank in wait.ranks]
                if wait.any_peer and any(r != m.rank and (wait.ranks is None or r in wait.ranks)
                                         for r, other in self._members.items() if other not in absent):
                    continue  # a rank it may be waiting for still runs
                if wait.seq is not None and wait.group is not None:
                    for a in peers:
                        if a.alive and a.issued_req != req:
                            a.issued_req, a.issued = req, None
                            self._send_control(a, proto.PEEK, req)
                    if any(a.alive and a.issued is None for a in peers):
                        continue  # not known yet whether they joined it
                    peers = [a for a in peers if not a.alive or (a.issued or {}).get(wait.group, 0) < wait.seq]
                if peers:
                    stuck.append(m)
                    missing.update((a.rank, a) for a in peers)
                    break
        if not stuck:
            return [], []
        return stuck, [missing[r] for r in sorted(missing)]

    def _collective_failed(self, members: list[_Member], req: int, stuck: list[_Member],
                           missing: list[_Member]) -> None:
        dead = [m for m in missing if not m.alive]
        waiting = {m.rank: m.waits[0] for m in stuck if m.waits}
        errors = [_failure_of(m) for m in missing if m.answer is not None and m.answer[0] == proto.FAIL
                  and m.req == proto.NO_REQUEST and m in members]
        for m in missing:
            if m.answer is not None and m in members:
                payload.close_fds(m.answer[2])
                m.answer = None
        self._abort_group()
        self._settle(members, req)
        if dead:
            raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in dead])
        rebuilt = self._rebuild()
        self._raise_if_died_during(req)
        raise CollectiveError([m.rank for m in stuck], [m.rank for m in missing], _describe(waiting),
                              errors, rebuilt)

    def _raise_if_died_during(self, req: int) -> None:
        """A rank that died during call ``req`` (while its group was aborted or rebuilt, say) is
        the news: its RankExitedError, not a collective error that says the group is broken."""
        died = [m for m in self._members.values() if not m.alive and m.died_during == req]
        if died:
            raise merge_rank_errors([m.exit_error or RankExitedError(m.rank, None) for m in died])

    def _stop(self, members: list[_Member], req: int) -> None:
        """Interrupt every rank still running ``req``; unstick collectives; rebuild the group
        when it was torn down. Bounded in time; a second Ctrl-C does not cut it short."""
        if self._prompter is None:  # a read that comes now is answered end of file at once
            self._prompter = prompts.Prompter(self._wake)
        self._close_prompts()  # a rank at a prompt reads KeyboardInterrupt, then end of file
        for m in members:
            if m.alive and m.req == req:
                self._send_control(m, proto.INTERRUPT, req)
        aborted = False
        start = time.monotonic()
        last_signal = start
        while True:
            try:
                running = [m for m in members if m.alive and m.req == req]
                if not running:
                    break
                now = time.monotonic()
                if now - start > _STOP_PATIENCE:
                    break  # they ignore interrupts: leave them running, their answer is dropped
                # Blocked in a collective (seen on its stack), or in C++ that ignores SIGINT for
                # longer (a DDP backward waiting on its all_reduce): cut the group under it.
                if self.ddp and not aborted and (
                        (now - start > _ABORT_AFTER and any(m.waits for m in running))
                        or now - start > _ABORT_ANYWAY):
                    self._abort_group()
                    aborted = True
                if now - last_signal > 1.0:  # the user's code may have swallowed one
                    for m in running:
                        self._send_control(m, proto.INTERRUPT, req)
                    last_signal = now
                self._pump(0.05)
            except KeyboardInterrupt:
                continue
        for m in members:
            if m.answer is not None:
                payload.close_fds(m.answer[2])
                m.answer = None
        if self._group_broken:
            self._rebuild()

    def _settle(self, members: list[_Member], req: int) -> None:
        """After an abort: wait (bounded) for the stuck ranks to come back, interrupting them
        if their code carries on."""
        start = time.monotonic()
        while any(m.alive and m.req == req for m in members) and time.monotonic() - start < 2.0:
            self._pump(0.05)
        if any(m.alive and m.req == req for m in members):
            self._stop(members, req)
        for m in members:
            if m.answer is not None and m.req == proto.NO_REQUEST:
                payload.close_fds(m.answer[2])
                m.answer = None

    def _abort_group(self) -> None:
        """Every live rank cuts its connections to the others and destroys its groups: a rank
    blocked in a gloo collective raises at once (see session_rank._cut_connections)."""
        self._group_broken = True
        live = [m for m in self._members.values() if m.alive]
        for m in live:
            peers = pickle.dumps([(p.pid, self._layout.nodes[p.rank]) for p in live if p is not m])
            m.aborts += 1
            self._send_control(m, proto.ABORT_GROUP, proto.NO_REQUEST, peers)

    def _rebuild(self) -> bool:
        """A new group on a new port, in place, on every rank (all must be alive and idle)."""
        if not self.ddp:
            return False
        members = list(self._members.values())
        if len(members) < self.world_size or not all(m.alive and m.req == proto.NO_REQUEST for m in members):
            return False
        try:
            self._start([])
            return True
        except RankError:
            return False

    # -- events ------------------------------------------------------------------------

    def _pump(self, wait: Optional[float]) -> None:
        """Handle what the ranks sent (answers, output, deaths) within ``wait`` seconds."""
        due = self._relay.due()
        if due is not None:
            wait = due if wait is None else min(wait, due)
        for key, _ in self._selector.select(wait):
            what, m = key.data
            if what == "out":
                if not self._relay.pump(key.fd):
                    self._selector.unregister(key.fd)
            elif what == "work":
                self._on_work(m)
            elif what == "control":
                self._on_control(m)
            elif what == "death":
                self._on_death(m)
            else:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                for reply, answer in self._prompter.take_answers() if self._prompter is not None else ():
                    reply(answer)

    def _on_work(self, m: _Member) -> None:
        try:
            message = wire.recv(m.work)
        except (OSError, EOFError):
            message = None
        if message is None:
            self._on_death(m)
            return
        data, fds = message
        kind, req, body = proto.unpack(data)
        if kind == proto.READY:
            info = pickle.loads(body)
            m.device, m.state = info["device"], "idle"
        elif kind == proto.DISPLAY:
            self._show(m.rank, pickle.loads(body))
        elif kind == proto.COMM_OUT:  # widgets (comms.py)
            self._comm_from_rank(m, pickle.loads(body))
        elif kind == proto.ASK:
            self._ask(m, req, pickle.loads(body))
        elif req == proto.NO_REQUEST and kind == proto.FAIL:
            m.start_failure = pickle.loads(body)[0]
        elif req == m.req and req != proto.NO_REQUEST:
            m.answer = (kind, bytes(body) if len(body) < (1 << 20) else body, fds)
            m.req = proto.NO_REQUEST
            m.waits = []
            if m.state == "running":
                m.state = "idle"
        else:
            payload.close_fds(fds)  # the answer to a call that gave up on it

    def _on_control(self, m: _Member) -> None:
        try:
            message = wire.recv(m.control)
        except (OSError, EOFError):
            message = None
        if message is None:
            self._unregister(m.control)
            return
        kind, req, body = proto.unpack(message[0])
        if kind == proto.ABORTED:
            m.aborts -= 1
        elif kind == proto.COLLECTIVE and req == m.req:
            m.waits = pickle.loads(body)
        elif kind == proto.ISSUED and req == m.issued_req:
            m.issued = pickle.loads(body)
        elif kind == proto.ASK:
            self._ask(m, req, pickle.loads(body))

    def _on_death(self, m: _Member) -> None:
        if not m.alive:
            return
        # It may have answered just before it died.
        while m.req != proto.NO_REQUEST:
            try:
                m.work.settimeout(0)
                message = wire.recv(m.work)
            except (OSError, EOFError):
                break
            finally:
                m.work.settimeout(None)
            if message is None:
                break
            data, fds = message
            kind, req, body = proto.unpack(data)
            if req == m.req:
                m.answer, m.req = (kind, bytes(body), fds), proto.NO_REQUEST
            else:
                payload.close_fds(fds)
        self._unregister(m.work, m.control, m.process.death_fd)
        m.process.wait_gone(2.0)
        code = m.process.exit_code(timeout=2.0)
        # Every later call fails with this until the rank is replaced: say how.
        m.exit_error = RankExitedError(m.rank, code, m.process.death_detail(),
                                       f"Its Python state is lost; {self.restart_how} starts a fresh rank {m.rank} "
                                       "and rebuilds the group (the other ranks keep their state).")
        m.state = "dead"
        self._comms.close_rank(m.rank)  # widgets: its models close in the frontend
        m.died_during = self._current
        m.waits = []
        if m.answer is None:
            m.req = proto.NO_REQUEST
        self._group_broken = self.ddp

    def _notice_deaths(self) -> None:
        """Between calls nobody watches: look now at the pidfds of ranks thought alive."""
        import select

        fds = [m.process.death_fd for m in self._members.values() if m.alive and m.process.death_fd is not None]
        if not fds:
            return
        ended = set(select.select(fds, [], [], 0)[0])
        for m in list(self._members.values()):
            if m.alive and m.process.death_fd in ended:
                self._on_death(m)

    def _ask(self, m: _Member, req: int, token: int) -> None:
        """Rank ``m`` reads its stdin: ask the user (prompts.py), its open line the prompt."""
        prompt = self._relay.take_prompt(m.rank)

        def reply(answer: Any) -> None:
            self._send_control(m, proto.ANSWER, req, pickle.dumps((token, answer)))

        if self._prompter is None:
            self._prompter = prompts.Prompter(self._wake)
        self._prompter.ask(m.rank, prompt, reply)

    def _close_prompts(self) -> None:
        """No one answers prompts of this call any more: the reads still waiting are ended."""
        if self._prompter is None:
            return
        for reply, answer in self._prompter.close():
            reply(answer)

    # -- widgets: the ranks' comms (comms.py, rank_comms.py) -----------------------------

    def _comm_from_rank(self, m: _Member, frame: dict) -> None:
        for fd in (m.out_r, m.err_r):  # what it printed before goes first (an Output widget captures by time)
            self._relay.pump(fd)
        self._comms.from_rank(m.rank, frame)
        if "sync" in frame:  # it waits for this before it prints on (rank_comms._emit)
            self._send_control(m, proto.COMM_ACK, proto.NO_REQUEST, pickle.dumps(frame["sync"]))

    def _comm_to_rank(self, rank: int, frame: dict) -> None:
        """A frontend's message to a widget of ``rank``: handled there like a tiny cell (output
        relayed, the stop button reaches it). While a call runs on another thread, it is only
        queued: the rank handles it after that call, and its answer is dropped."""
        m = self._members.get(rank)
        if self.closed or m is None or not m.alive:
            return
        body = pickle.dumps(frame)
        if not self._call_lock.acquire(blocking=False):
            try:
                wire.send(m.work, proto.pack(proto.COMM, next(self._ids), body))
            except OSError:
                pass
            return
        self._call_lock.release()
        self._call(proto.COMM, body, [], [rank], None, self._comms.show, None)

    def _show(self, rank: int, bundle: dict) -> None:
        if self._display is not None:
            self._display(rank, bundle)
            return
        text = bundle.get("text/plain", "")
        for line in str(text).splitlines() or [""]:
            print(f"[rank {rank}] {line}")

    def _unregister(self, *objs: Any) -> None:
        """Stop selecting on these (None and what is not registered are skipped)."""
        for obj in objs:
            if obj is None:
                continue
            try:
                self._selector.unregister(obj)
            except (KeyError, ValueError):
                pass

    def _send_control(self, m: _Member, kind: bytes, req: int, body: bytes = b"") -> None:
        try:
            wire.send(m.control, proto.pack(kind, req, body))
        except OSError:
            pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def _on_sigint(self) -> None:
        # A signal handler: no lock (the main thread may hold it), a flag and a byte.
        self._interrupt_asked = True
        self._wake()
        interrupts.interrupt_other_threads()  # one press stops every call, ranch's included

    def interrupt_from_signal(self) -> None:
        """The stop button, while this session's call runs on a thread other than the main one
        (interrupts.py calls this from the main thread's SIGINT handler)."""
        if self._current != proto.NO_REQUEST:
            self._interrupt_asked = True
            self._wake()


#: Open sessions of this process, for the fork handler below.
_sessions: weakref.WeakSet[Session] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for session in list(_sessions):
        if not session.closed:
            session._forget_in_child()
    _sessions.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- helpers --------------------------------------------------------------------------------

def _check_timeout(timeout: Optional[float]) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")


def _timed_out(timeout: float, running: list[int], still: list[int]) -> str:
    """What a call that ran out of time did to the ranks that were still running it."""
    message = f"the call did not finish within {timeout:g} s (ranks still running: {running}); "
    if not still:
        return message + "they were interrupted, their state is kept"
    return message + (f"they were interrupted, but ranks {still} did not stop (C code that ignores "
                      f"interrupts?): they still run it, later calls wait for them, and "
                      f"restart({still}) replaces them")


def _wants_value(source: str) -> bool:
    """IPython shows the last expression's value unless the cell ends with ';'."""
    lines = [line for line in source.rstrip().splitlines() if line.strip()]
    return not lines or not lines[-1].split("#", 1)[0].rstrip().endswith(";")


def _describe(waiting: dict[int, Wait]) -> str:
    """"dist.all_reduce (rank 0 at Cell In[7], line 6)": what the ranks were left waiting in."""
    if not waiting:
        return "a collective"
    ops = sorted({w.op for w in waiting.values()})
    places = [f"rank {r} at {source_location(w.where[0])}, line {w.where[1]}"
              for r, w in sorted(waiting.items()) if w.where is not None]
    text = " / ".join(op if "." in op else f"dist.{op}" for op in ops)
    return f"{text} ({'; '.join(places)})" if places else text


def _failure_of(m: _Member, body: Any = None, fds: Optional[list[int]] = None) -> RankError:
    if body is None:
        assert m.answer is not None
        _kind, body, fds = m.answer
        m.answer = None
    payload.close_fds(fds or [])
    failure, _interrupted, meta = pickle.loads(body)
    if meta:
        m.gpu_memory = meta.get("gpu_memory")
    return failure.to_error(m.rank, payload.loads)


def _rss(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _take_sigint(on_sigint: Callable[[], None], session: Session) -> Callable[[], None]:
    """While a call waits: SIGINT (the stop button) sets a flag instead of raising anywhere,
    so it never cuts a message in half; the wait loop raises KeyboardInterrupt itself. On
    another thread, the main thread's handler reaches us through interrupts.py."""
    if threading.current_thread() is not threading.main_thread():
        interrupts.install()
        interrupts.register(session)
        return lambda: interrupts.unregister(session)
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: on_sigint())
    except ValueError:
        return lambda: None

    def restore() -> None:
        signal.signal(signal.SIGINT, old)

    return restore


__all__ = ["Session", "RankStatus"]
