"""One ``ranch()`` call (launcher/ranch.py checks it first): its ranks started, GO, their answers
gathered, every rank ended. Spawn, execute, terminate.

A ranch call is the engine's (engine/core.py) short-lived use: one request, CALL, to each rank, and
the ranks exit after it. Data flow of one call::

    caller (notebook process)                                   rank r (r != caller_rank)
    ------------------------                                    ---------------------------
    pack_call(fn, args, ctx)  ── PayloadError here, before any rank exists (launcher/ranch.py)
    placer.reserve(world) ── where each rank lands: LOCAL_RANK, GROUP_RANK, MASTER_ADDR/PORT
    engine.spawn(r) ─ placer.start(r) ──────────────────────> born (forked from template, spawned,
                                                                 or forked on a Ray node: ray_ranks/)
    send setup + CALL ───────── socketpair ─────────────────> load call    (rank/loop.py: rank.loop.serve)
                          <──────────────────────────────────  STORE: the store's port (its host, on Ray)
    wait for every READY  <──────────────────────────────────  READY
    send GO to all ─────────────────────────────────────────> (no rendezvous before every rank loaded;
                                                                 on Ray, GO tells the store's port)
    [caller enters ctx, runs fn:       (watch thread:           enters ctx, runs fn
     launcher/own_rank.py]                       engine.pump,
                                         engine/watch.py: LOOK ──> control thread: SEEN
                                        <─── RETURNED ─────────  fn returned (its group up)
                                        <─── DONE / FAIL ─────  sends its answer, exits
                                        <─── pidfd readable ─── (or dies: signal, segfault, OOM)
    relay thread  <────────────── stdout/stderr pipes ───────  print(...)          (relay/pipes.py)
    gather values; kill stragglers; placer.release(); restore env/cwd/CUDA/torch.distributed

The first failure wins (launcher/outcome.py): it is the root cause (the others usually fail
because a peer vanished). The watch thread then kills every rank at once; a caller blocked
in a gloo collective gets an error within ~2 s, a caller blocked in the
rendezvous is freed at once (the TCPStore lives in a spawned rank, not in the
caller), and a caller running Python code is interrupted with a signal. The call
then raises the root cause.

Ranks that wait in collectives that can never finish (another op, other sizes, a peer that
returned without joining: engine/verdict.py) are found by the engine's collective watch, as in
a Session: the call ends with ``CollectiveError``, the caller's own rank unstuck by cutting its
connections to the others. A rank's error raised inside a collective (gloo's "Connection
closed by peer") is held a moment and explained the same way (launcher/watched.py).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import uuid
from typing import Any, Callable, Optional

from ..engine import background, core, interrupts, members
from ..rank import checks as rank_checks
from ..relay.pipes import OutputRelay
from ..start import environ, placement
from ..torchdist import compat, rendezvous, waits
from ..wire import framing, payload, shm
from ..wire.errors import RankError, RemoteFailure, safe_str
from ..wire.protocol import CALL, DONE, FAIL, GO, GPU_USED, IMPORTED, READY, STORE, pack
from . import own_rank
from .next_call import ForNextCall
from .outcome import Outcome
from .watched import WatchedCall

# Seconds a finished rank may take to exit after sending its value before it is killed.
_EXIT_GRACE = 5.0
#: How long a rank's error raised inside a collective waits for news of the group's other ranks
#: (one that returned without joining it, or raised first) before it is taken as the root cause.
_EXPLAIN_PATIENCE = 0.5
#: The request id of a call's one request (CALL) to each of its ranks.
_REQUEST = 1



class _Rank(members.Member):
    """The caller's view of one rank of a call."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ready = False  # it loaded the call
        self.done = False  # sent its value or its error, or died
        self.value: Any = None


class Call(WatchedCall):
    """One ranch call: start its ranks, GO, gather their answers; the first failure wins. What it
    does with the collective watch is WatchedCall's (launcher/watched.py)."""

    def __init__(self, nprocs: int, caller_rank: Optional[int], timeout: Optional[float], imports: str = ""):
        self.nprocs = nprocs
        self.imports = imports
        self.caller_rank = caller_rank
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.aborting = False  # we are stopping the ranks: their deaths are no news
        self.finished = False  # the caller's own rank is done; the watch may end
        self.own_returned = False  # the caller's own rank returned from fn
        self.unquiet: Optional[Callable[[], None]] = None  # puts torch's C++ warnings back
        self.layout: Optional[placement.Layout] = None
        self.own = own_rank.OwnRank()
        self.engine = core.Engine(OutputRelay(sys.stdout, sys.stderr), pump_output=False)
        #: the first failure wins (launcher/outcome.py); the user's stop
        self.outcome = Outcome(self._stop_everything, self.engine.wake)
        self.engine.user_waits.open_prompts()  # ranks' reads of stdin, asked of the user (on this thread)
        self.engine.on(READY, self._on_ready)
        self.engine.on(STORE, self._on_store)
        self.store_port: Optional[int] = None  # the port the store's host bound on its Ray node
        self.news = ForNextCall(self.engine)  # what the ranks imported, the GPUs they used
        self.engine.on(DONE, self._on_value)
        self.engine.on(FAIL, self._on_error)
        self.engine.on_death = self._on_death
        self.engine.on_wake = self._on_wake
        self.ranks: dict[int, _Rank] = self.engine.members
        self.watch = self.engine.watch  # the collective watch (engine/watch.py)
        #: ranch(wait=False): this thread runs background work, which its handle stops (not the
        #: stop button: that is the cell's running now), and whose ranks' prompts are refused
        self.work = background.current()
        if self.work is not None:
            self.work.attach(self.engine, self.interrupt_from_signal, self.where_now)

    # -- the whole call ------------------------------------------------------------------

    def run(self, packed: payload.PackedCall, fn, args, kwargs, ctx, claimed: bool = False) -> list:
        """The call, start to end; ``claimed``: the process was claimed for its own rank already
        (background work: by the cell that started it)."""
        with own_rank.process_claimed(self.caller_rank is not None and not claimed), \
                interrupts.presses.during_call():
            if self.own.on_main_thread:
                interrupts.install()
            elif self.work is None:
                interrupts.register(self)  # the stop button reaches us through the main thread
            try:
                return self._run(packed, fn, args, kwargs, ctx)
            finally:
                interrupts.unregister(self)

    def _run(self, packed: payload.PackedCall, fn, args, kwargs, ctx) -> list:
        state = own_rank.CallerState.snapshot(self.caller_rank is not None)
        if state.environ is not None:
            environ.set_caller_environ(state.environ)  # os.environ is rank 0's until restore()
        relay = self.engine.relay
        garbage = shm.garbage_mark()
        values: list = [None] * self.nprocs
        watcher: Optional[threading.Thread] = None
        placer = placement.get_placer()
        try:
            self._ready(placer)
            layout = self.layout = placer.reserve(self.nprocs, self.caller_rank, self._time_left())
            env = _world_env(layout, self.nprocs, self.caller_rank)
            self._start_ranks(placer, layout, packed, env)
            relay.start()
            self._watch(until=lambda: all(r.ready or r.done for r in self.ranks.values()))
            if not self.outcome.over:
                told = _tell_store_port(env, self.store_port)
                for handle in self.ranks.values():
                    self.engine.send(handle, GO, _REQUEST, told)  # one that just died: the watch reports how
                self._begin_watch()
                if self.caller_rank is None:
                    self._watch(until=self._all_done)
                else:
                    watcher = threading.Thread(target=self._watch, args=(self._all_done,),
                                               name="mpify_nb-watch", daemon=True)
                    watcher.start()
                    try:
                        own_env = dict(env, **layout.env_of(self.caller_rank))
                        values[self.caller_rank] = self._run_own_rank(fn, args, kwargs, ctx, own_env)
                    finally:
                        self.finished = True
                        self.engine.wake()
                        watcher.join()
            self._drain()
            self.outcome.raise_if_failed()
            self._judge_returned()
            for r in self.ranks.values():
                values[r.rank], r.value = r.value, None  # the user's now: theirs to drop
            shm.drop_import_garbage(garbage)
            return values
        except KeyboardInterrupt as e:
            self.outcome.interrupted = True
            if e.args:
                raise
            where = self._where_they_were()  # "" before the first look at the ranks
            raise KeyboardInterrupt("every rank was stopped" + (f"; where they were: {where}" if where else "")) \
                from None
        finally:
            self.finished = True
            self.watch.end()
            self.engine.user_waits.close_prompts()  # the ranks are done or stopped: no one reads the answers
            _stop_ranks(list(self.ranks.values()), self.outcome.over, _store_host(self.nprocs, self.caller_rank))
            for handle in self.ranks.values():
                self.engine.bury(handle)
            placer.release()
            packed.close_later()
            relay.close()
            with self.outcome.cond:
                self.engine.close()
            state.disarm_ended_ddp(values)  # first: an ended DDP lets go of its group while it is kept
            state.restore()
            if self.unquiet is not None:
                self.unquiet()
            if state.environ is not None:
                environ.set_caller_environ(None)
            self.news.call_ended(placer, self.ranks)  # spare ranks for the next call

    # -- starting ranks ------------------------------------------------------------------

    def _start_ranks(self, placer: placement.Placer, layout: placement.Layout, packed: payload.PackedCall,
                     env: dict) -> None:
        base = dict(os.environ) if placer.ships_environ else {}
        base.update(env)
        common = {"cwd": os.getcwd(), "sys_path": list(sys.path), "argv": list(sys.argv)}
        for r in range(self.nprocs):
            if r == self.caller_rank:
                continue
            try:
                self.engine.spawn(placer, r, self._time_left(), member=_Rank)
            except TimeoutError as e:
                raise TimeoutError(f"ranch: the call did not finish within {self.timeout:g} s: {e}") from None
        # The setup and the call right after the fork: a rank loads while the next one is born.
        # Ahead of the call, the modules it must import first that its template does not hold.
        calls: dict[Optional[frozenset], bytes] = {}
        host = _store_host(self.nprocs, self.caller_rank)
        for r, handle in self.ranks.items():
            rank_env = dict(base, **layout.env_of(r))
            setup = pickle.dumps(dict(common, rank=r, env=rank_env))
            held = getattr(handle.process, "modules_held", None)
            call = calls.get(held)
            if call is None:
                call = calls[held] = pack(CALL, _REQUEST, packed.body(held))
            # The store's host gets the socket its port is bound to: the port stays ours till it listens.
            store = [layout.store_socket.fileno()] if r == host and layout.store_socket is not None else []
            try:
                framing.send(handle.channel, setup, store)
                framing.send(handle.channel, call, packed.fds)
            except OSError:
                pass  # it died at birth; the watch reports how
        layout.let_go_of_store()

    def _ready(self, placer: placement.Placer) -> None:
        """Wait until ranks can start. The template's preparation (its start: it imports torch; its
        imports of what the ranks need) is a one-time cost, not the call's: the deadline moves by it."""
        prepared = placer.ready(self._time_left())
        if self.deadline is not None:
            self.deadline += prepared

    def _time_left(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    # -- watching ranks ------------------------------------------------------------------

    def _all_done(self) -> bool:
        return all(r.done for r in self.ranks.values()) and (self.caller_rank is None or self.finished)

    def _watch(self, until: Callable[[], bool]) -> None:
        """Handle rank events until ``until()`` holds or a failure was recorded."""
        while not self.outcome.over:
            if self.outcome.held is not None:
                if time.monotonic() >= self.outcome.held[1] or self._held_answered():
                    break
            elif until():
                break
            wait = self.engine.user_waits.time_left(self.deadline)  # time a rank waits for the user is not the call's
            if wait is not None and wait <= 0:
                self._time_out()
                return
            verdict = self.watch.verdict
            if verdict is not None and self.outcome.held is None:
                self._collective_failed(verdict)
                return
            if self.outcome.held is not None:
                left = max(0.0, self.outcome.held[1] - time.monotonic())
                wait = left if wait is None else min(wait, left)
            looks = self.watch.tick()
            if looks is not None:
                wait = looks if wait is None else min(wait, looks)
            self.engine.pump(wait)
        self.outcome.release(self._explain)  # a death noticed meanwhile is recorded already: the error joins it

    def _on_wake(self, data: bytes) -> None:
        for signum in data:
            # A SIGINT after a failure is ours (the stop of the caller's rank), or comes too late to
            # change what the call raises; a process that ignores SIGINT keeps ignoring the user's.
            if signum == signal.SIGINT and self.outcome.root is None and not self.own.ignores_user_sigint:
                # The user interrupted: stop every rank so the main thread can return.
                self.outcome.stopped_by_user()
                self._quiet_echoes()
                self.engine.kill_all()

    def _on_ready(self, handle: _Rank, req: int, body: Any, fds: list) -> None:
        handle.ready = True

    def _on_store(self, handle: _Rank, req: int, body: Any, fds: list) -> None:
        self.store_port = pickle.loads(body)

    def _on_value(self, handle: _Rank, req: int, body: Any, fds: list) -> None:
        handle.done = True
        try:
            handle.value = payload.unpack_result(body, fds)
        except Exception as e:
            self.outcome.fail(RankError(handle.rank, f"the value returned by rank {handle.rank} could not be "
                                              f"unpickled here: {type(e).__name__}: {safe_str(e)}"))

    def _on_error(self, handle: _Rank, req: int, body: Any, fds: list) -> None:
        handle.done = True
        self.outcome.failed_ranks.add(handle.rank)
        payload.close_fds(fds)
        failure: RemoteFailure = pickle.loads(body)[0]
        error = self._as_refusal(failure.to_error(handle.rank, payload.loads))  # the collective check's?
        if not handle.process.shares_clock:
            error.when = time.monotonic()  # another host's clock: order by when we heard
        # A rank whose death we see only through its link (on another host) may have died before
        # this error was raised, and caused it: wait that long for the news before choosing the root cause.
        patience = max((r.process.death_latency for r in self.ranks.values() if not r.done), default=0.0)
        if error.context is not None:  # raised in a collective: a peer may have left it (_explain)
            patience = max(patience, _EXPLAIN_PATIENCE)
        if patience > 0 and self.outcome.hold(error, patience):
            return
        self.outcome.fail(error)

    def _on_death(self, handle: _Rank) -> None:
        noticed = time.monotonic()
        self.engine.unregister(handle.process.death_fd)
        self._read_sent(handle)  # it may have answered just before dying
        if handle.done:
            return
        handle.done = True
        if not self.aborting:  # not one of the ranks we killed ourselves
            self.outcome.fail(handle.death_error(noticed))

    def _stop_everything(self) -> None:
        """The call has failed: kill every rank (the store's host with them: a caller blocked in
        the rendezvous is freed), stop the caller's own."""
        self._quiet_echoes()
        self.engine.kill_all()
        self.own.abort()

    def _quiet_echoes(self) -> None:
        """The call fails: torch's C++ warnings in this process from here on are echoes of it (a
        store client whose host was killed prints a C++ stack), not news. Until the call ends."""
        if self.caller_rank is not None and self.unquiet is None:
            self.unquiet = compat.quiet_cpp_warnings()

    def _drain(self) -> None:
        """After the ranks ran (or were stopped): read the answers already sent. An error a
        rank sent before a peer's echo of it must not be lost."""
        self.outcome.release(self._explain)
        self.aborting = self.outcome.over
        for handle in self.ranks.values():
            self._read_sent(handle)
        self.outcome.release(self._explain)

    def _read_sent(self, handle: _Rank) -> None:
        """Handle the answers ``handle`` has already sent, without waiting for more."""
        self.engine.read_sent(handle, lambda: not handle.done, (READY, IMPORTED, GPU_USED, DONE, FAIL))

    # -- the caller's own rank -----------------------------------------------------------

    def _run_own_rank(self, fn, args, kwargs, ctx, env) -> Any:
        """Run the caller's rank on this thread. A failure is recorded, not raised:
        run() raises the root cause once it has heard from every rank."""
        rank = self.caller_rank
        assert rank is not None
        waits.mark_groups_born()  # what this process's recorder holds is of its earlier calls
        waits.note_p2p()
        with self.own.running(env, self.engine.wake_w), rank_checks.in_the_notebook():
            try:
                return self.own.play(fn, args, kwargs, ctx, self.imports, lambda: self._own_rank_returned(rank))
            except own_rank.Aborted:
                return None  # another rank failed first; run() reports it
            except KeyboardInterrupt:
                if self.outcome.root is not None and not self.outcome.interrupted:
                    return None  # our own SIGINT, landed after the user code: same as Aborted
                self.outcome.interrupted = True
                self.engine.kill_all()
                raise
            except BaseException as e:
                if self._refused(e):  # the collective check: every rank raised it, none entered gloo
                    return None
                failure = RemoteFailure.capture(e, lambda exc: None).to_error(rank, payload.loads)
                failure.__cause__ = e
                try:
                    failure.context = waits.snapshot_of_failure(rank, e)
                except Exception:
                    pass  # only a clearer error is lost
                if failure.context is not None and self.outcome.root is None \
                        and self.outcome.hold(failure, _EXPLAIN_PATIENCE):
                    return None  # raised in a collective: the watch thread explains it (_explain)
                # Is this the echo of a peer's failure (e.g. "Connection closed by peer")?
                # Then the peer's own report is on its way: give it a moment.
                if self.outcome.root is None:
                    # A rank on another host is seen to die only once its link says so: wait that long.
                    running = [r for r in self.ranks.values() if not r.done]
                    patience = 2.0 if members.stirred(running) else max(
                        (r.process.death_latency for r in running), default=0.0)
                    self.outcome.wait_for_news(patience)
                self.outcome.fail(failure)
                return None

    def interrupt_from_signal(self) -> None:
        """The user pressed stop while this call runs on a thread other than the main one
        (called by engine/interrupts.py on the main thread): stop it as the main thread's SIGINT would."""
        with self.outcome.cond:
            if self.engine.closed:
                return
            try:
                os.write(self.engine.wake_w, bytes([signal.SIGINT]))  # the watch stops every rank
            except OSError:
                pass
            self.own.interrupt()  # the caller's rank runs on our thread



def _stop_ranks(ranks: list[_Rank], failed: bool, store_host: Optional[int]) -> None:
    """The call's end: finished ranks get a moment to exit on their own; everything else is killed
    now (the store's host too: it waits to be told the call is over, its store may still be in use).
    Gone is seen on the rank's own pidfd, not told by the template that forked it: a template in a
    long import (its preload) tells its children's exits only after it, and a call waited for it."""
    deadline = time.monotonic() + (0 if failed else _EXIT_GRACE)
    for handle in ranks:
        if failed or not handle.done or handle.rank == store_host:
            handle.process.kill()
        else:
            remaining = max(0.0, deadline - time.monotonic())
            if not handle.process.wait_gone(remaining):
                handle.process.kill()


def _store_host(nprocs: int, caller_rank: Optional[int]) -> Optional[int]:
    """The rank that hosts the call's rendezvous store: a spawned one, never the caller (killing
    the ranks then frees a caller blocked in the rendezvous: torchdist/rendezvous.py); None
    when the caller is the only rank."""
    return next((r for r in range(nprocs) if r != caller_rank), None)


def _tell_store_port(env: dict, port: Optional[int]) -> bytes:
    """GO's body: the port the store's host bound on its Ray node (STORE), which the caller's own
    rank learns from ``env``; empty where the caller bound it (this machine)."""
    if port is None:
        return b""
    rendezvous.learn_port(env, port)
    return pickle.dumps(port)


def _world_env(layout: placement.Layout, nprocs: int, caller_rank: Optional[int]) -> dict:
    """The variables every rank gets alike; layout.env_of(rank) adds each one's own. Groups
    record their collectives in a small ring, for the collective watch (torchdist/waits.py)."""
    host = _store_host(nprocs, caller_rank)
    port = layout.master_port if host is not None and nprocs > 1 else 0  # 0: a world of one, in-process
    env = dict(layout.world_env(nprocs), **waits.recorder_env())
    env[rendezvous.VARIABLE] = rendezvous.spec(layout.master_addr, port, nprocs, uuid.uuid4().hex[:12])
    if host is not None:
        env[rendezvous.HOST_VARIABLE] = str(host)
    return env
