"""The engine: a set of live rank processes, started through a placer and watched in one loop.

``ranch`` and ``Session`` are its two uses. What a rank is, how it talks, prints, reads stdin
and dies is the engine's; what a failure means is each use's own, in the frame handlers it
registers (:meth:`Engine.on`) and in its ``on_death``/``on_wake``::

    ranch (launcher/call.py)                         Session (session/)
    one request; the ranks exit after it        many requests; the ranks stay
      spawn(r) for each rank but the caller's     spawn(r, control=True) for every rank
      setup + CALL, right after each fork         setup (+ its control end, the store socket)
      every READY, then GO                        every READY (its group is up)
      pump() on a watch thread while the          per call: RUN / APPLY / PUSH / PULL ...,
        caller plays its own rank (launcher/own_rank.py)pump() on the call's thread
      DONE / FAIL: the first failure wins,        DONE / FAIL per request; stuck: stop, abort
        kill every rank                             the group, rebuild (session/recovery.py)
      bury every rank                             bury on restart() and close()
            |                                           |
            v                                           v
    +----------------------------------- Engine ------------------------------------+
    | members {rank: Member}     handlers {kind: handler(member, req, body, fds)}   |
    |                                                                                |
    | spawn ── socketpair(s), stdout/stderr pipes, placer.start(r) ──────────────────+──> rank r, born:
    | send(m, kind, req) ── channel ─────────────────────────────────────────────────+──> rank.loop.serve, one
    |                                                                                |    request at a time
    | send_control(m, kind, req) ── control channel (a ranch rank: its channel) ─────+──> its control thread
    |                                                                                |    (rank/control.py)
    | pump(wait): one select over                                                    |
    |   channel, control  -> handlers[kind]   <── READY DONE FAIL ASK IMPORTED ... ──+─── rank r
    |   stdout/stderr     -> relay.pump       <── print(...) (ranch: the relay's own thread)
    |   pidfd             -> on_death(m)      <── it died (signal, segfault, OOM, its node)
    |   wake pipe         -> prompt answers (ANSWER to the rank); on_wake(bytes): SIGINT
    | ASK: user_waits asks the user (prompts.Prompter); its time_left() does not     |
    |   count that wait, nor a rank held at a debugger's breakpoint (pause/unpause)  |
    | watch (engine/watch.py): LOOK now and then, SEEN / RETURNED -> verdict.judge   |
    | bury(m): kill, wait, end what it left; close its fds                           |
    +--------------------------------------------------------------------------------+

A capability (widgets' comms, say) claims frame kinds (protocol.claim), registers its handlers
on every engine (capabilities.py: add_capability) and on every rank's control thread
(rank/control.py: on), and sends from a rank with rank/control.py's to_caller: written once, for
every rank of both uses.
A capability that must hear ranks between calls too (the debugger: a frontend asks while no cell
runs) reads their control channels from its own thread with pump_idle(), which yields to the
owner's loop (loop_lock); it may act before each call (before_call), after it (after_call) and
when a rank is gone (when_gone).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import select
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

from ..relay.pipes import OutputRelay
from ..start import placement
from ..wire import framing, payload
from ..wire.protocol import ANSWER, ASK, NO_REQUEST, PEEK_STDIN, pack, unpack
from . import watch as collective_watch
from .capabilities import Capabilities
from .members import Member
from .user_waits import UserWaits

#: How long a dead rank's burial waits to hear it was reaped (its template does it within milliseconds,
#: unless it is in a long import).
_REAPED_WITHIN = 0.5


class Engine(Capabilities):
    """Live ranks and their one event loop. ``pump_output``: relay the ranks' stdout/stderr
    in :meth:`pump` (a Session: written on the call's thread), else on the relay's own
    thread (ranch: the caller's own rank runs while ranks print)."""

    def __init__(self, relay: OutputRelay, pump_output: bool, persistent: bool = False):
        self.members: dict[int, Any] = {}
        self.relay = relay
        self.pump_output = pump_output
        self.persistent = persistent  # a Session's: its ranks live across calls
        #: Held by the thread that runs this engine's loop for its owner (a Session's call, with
        #: the lock re-entered there); pump_idle() takes it only when nobody holds it.
        self.loop_lock = threading.RLock()
        super().__init__()
        self.handlers[ASK] = self._on_ask
        self.on_death: Callable[[Any], None] = lambda m: None  # the rank's pidfd or channel says it ended
        self.on_wake: Callable[[bytes], None] = lambda data: None  # bytes written to the wake pipe
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        #: ranks at an input prompt or held at a breakpoint: the user's time, not the call's
        self.user_waits = UserWaits(self.wake)
        self.selector.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        self.closed = False
        #: the collective watch (engine/watch.py): looks at a call's ranks, judges what they wait in
        self.watch = collective_watch.Watch(self)
        relay.on_partial = self._peek_stdin
        self.install_capabilities()

    def starting_call(self, members: Sequence[Member]) -> None:
        """The owner starts a call on ``members``: nothing is paused yet; the hooks run."""
        self.user_waits.new_call()
        for hook in list(self._call_hooks):
            hook(self, list(members))

    def ended_call(self, members: Sequence[Member]) -> None:
        """The owner's call on ``members`` is over: the after_call hooks run."""
        for hook in list(self._end_hooks):
            hook(self, list(members))

    def gone(self, m: Member) -> None:
        """``m`` has died (or is being buried): tell the capabilities, once."""
        if m.gone_told:
            return
        m.gone_told = True
        self.user_waits.unpause(m.rank)
        for hook in list(self._gone_hooks):
            hook(self, m)

    # -- starting ----------------------------------------------------------------------------

    def spawn(self, placer: placement.Placer, rank: int, timeout: Optional[float], *,
              member: Callable[..., Any] = Member, control: bool = False,
              pipe_size: int = 0) -> tuple[Any, Optional[socket.socket]]:
        """Start rank ``rank`` through ``placer``. With ``control``, it gets a control channel
        too: returns the rank's end of it, to send with its setup (then close)."""
        ours, theirs = framing.socketpair()
        control_ours = control_theirs = None
        if control:
            control_ours, control_theirs = framing.socketpair()
        if self.pump_output:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            for fd in (out_w, err_w) if pipe_size else ():
                try:
                    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, pipe_size)
                except (OSError, AttributeError):
                    pass  # the default 64 KiB will do
            out_fds: tuple[int, ...] = (out_r, err_r)
        else:
            out_w, err_w = self.relay.add(rank)
            out_fds = ()
        try:
            process = placer.start(rank, theirs.fileno(), out_w, err_w, timeout)
        except BaseException:
            for s in (ours, control_ours, control_theirs):
                if s is not None:
                    s.close()
            for fd in out_fds:
                os.close(fd)
            raise
        finally:
            theirs.close()
            os.close(out_w)
            os.close(err_w)
        m = member(rank, ours, process, control_ours, out_fds)
        self.members[rank] = m
        sel = self.selector
        sel.register(ours, selectors.EVENT_READ, ("frame", m))
        if control_ours is not None:
            sel.register(control_ours, selectors.EVENT_READ, ("control", m))
        if out_fds:
            self.relay.adopt(rank, *out_fds)
            for fd in out_fds:
                sel.register(fd, selectors.EVENT_READ, ("out", m))
        if process.death_fd is not None:
            sel.register(process.death_fd, selectors.EVENT_READ, ("death", m))
        return m, control_theirs

    # -- talking -----------------------------------------------------------------------------

    def send(self, m: Member, kind: bytes, req: int, body: bytes = b"", fds=()) -> bool:
        """A frame on ``m``'s channel; False when it is gone (its death is the news, not this)."""
        try:
            framing.send(m.channel, pack(kind, req, body), fds)
            return True
        except OSError:
            return False

    def send_control(self, m: Member, kind: bytes, req: int, body: bytes = b"") -> bool:
        """A frame for ``m``'s control thread (on its channel when it has no control channel);
        False when it is gone."""
        if m.buried or (m.control is None and not m.channel_open):
            return False
        try:
            framing.send(m.control if m.control is not None else m.channel, pack(kind, req, body))
            return True
        except OSError:
            return False

    # -- the loop ----------------------------------------------------------------------------

    def pump(self, wait: Optional[float]) -> None:
        """Handle what the ranks sent (frames, output, deaths) within ``wait`` seconds."""
        if self.pump_output:
            due = self.relay.due()
            if due is not None:
                wait = due if wait is None else min(wait, due)
        for key, _ in self.selector.select(wait):
            what, m = key.data
            if what == "out":
                if not self.relay.pump(key.fd):
                    self.unregister(key.fd)
            elif what == "frame":
                self._on_frame(m, m.channel)
            elif what == "control":
                self._on_frame(m, m.control)
            elif what == "death":
                self.on_death(m)
            else:
                try:
                    data = os.read(self.wake_r, 4096)
                except BlockingIOError:
                    data = b""
                for reply, answer in self.user_waits.take_answers():
                    reply(answer)
                self.on_wake(data)

    def pump_idle(self, wait: float) -> bool:
        """From a capability's own thread: when nobody runs this engine's loop, handle what the
        ranks sent on their control channels, and their deaths, within ``wait`` seconds. False
        at once when the loop is someone else's now (their pump handles those frames)."""
        if not self.loop_lock.acquire(blocking=False):
            return False
        try:
            if self.closed:
                return True
            by_fd: dict[int, tuple[str, Any]] = {}
            for m in list(self.members.values()):
                if m.buried or m.gone_told:  # a dead rank's channels say nothing more
                    continue
                if m.control is not None and m.control.fileno() >= 0:
                    by_fd[m.control.fileno()] = ("control", m)
                if m.process.death_fd is not None:
                    by_fd[m.process.death_fd] = ("death", m)
            if not by_fd:
                time.sleep(wait)
                return True
            for fd in select.select(list(by_fd), [], [], wait)[0]:
                what, m = by_fd[fd]
                if m.buried:
                    continue
                if what == "control":
                    self._on_frame(m, m.control)
                else:
                    self.on_death(m)
            return True
        finally:
            self.loop_lock.release()

    def _on_frame(self, m: Member, sock: socket.socket, kinds: Optional[tuple[bytes, ...]] = None,
                  on_end: bool = True) -> None:
        try:
            message = framing.recv(sock)
        except (OSError, EOFError):
            message = None
        if message is None:
            self.unregister(sock)
            if sock is m.channel:
                m.channel_open = False
                if on_end:
                    self.on_death(m)
            return
        data, fds = message
        kind, req, body = unpack(data)
        handler = self.handlers.get(kind)
        if handler is None or kinds is not None and kind not in kinds:
            payload.close_fds(fds)  # nobody here speaks it (or it is no news now)
            return
        handler(m, req, body, fds)

    def read_sent(self, m: Member, more: Callable[[], bool], kinds: tuple[bytes, ...]) -> None:
        """Handle the frames of ``kinds`` that ``m`` has already sent (others are dropped),
        without waiting for more, while ``more()``: a rank that died may have answered first."""
        m.channel.settimeout(1.0)  # a message cut short by a kill must not stall us
        try:
            while m.channel_open and more():
                if not select.select([m.channel], [], [], 0)[0]:
                    break
                self._on_frame(m, m.channel, kinds, on_end=False)
        finally:
            if m.channel_open:
                m.channel.settimeout(None)

    def wake(self) -> None:
        if self.closed:
            return
        try:
            os.write(self.wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def unregister(self, *objs: Any) -> None:
        """Stop selecting on these (None and what is not registered are skipped)."""
        for obj in objs:
            if obj is None:
                continue
            try:
                self.selector.unregister(obj)
            except (KeyError, ValueError):
                pass

    # -- a rank reads its stdin --------------------------------------------------------------

    def _peek_stdin(self, rank: int) -> None:
        """Rank ``rank``'s stdout holds a partial line (the relay saw it): ask its control thread
        whether a read of fd 0 follows it (a prompt), while a call runs (from any thread)."""
        m = self.members.get(rank)
        if m is not None and self.watch.active:
            self.send_control(m, PEEK_STDIN, NO_REQUEST)

    def _on_ask(self, m: Member, req: int, body: Any, fds: list) -> None:
        """Rank ``m`` reads its stdin: ask the user (engine/prompts.py), its open line the prompt."""
        token = pickle.loads(body)
        prompt = self.relay.take_prompt(m.rank)

        def reply(answer: Any) -> None:
            self.send_control(m, ANSWER, req, pickle.dumps((token, answer)))

        self.user_waits.ask(m.rank, prompt, reply)

    # -- ending ------------------------------------------------------------------------------

    def kill_all(self) -> None:
        for m in self.members.values():
            m.process.kill()

    def bury(self, m: Member) -> None:
        """Make sure ``m``'s process is gone, then let go of everything that was its (once)."""
        if m.buried:
            return
        m.buried = True
        self.gone(m)
        m.process.kill()
        # Gone as its own pidfd says; then reaped (by us, or by the template that forked it, which
        # says so), waited for only a moment: a template in a long import of its preload reaps after
        # it, and each call's end waited for that (up to 5 s) when this waited for its word.
        m.process.wait_gone(5.0)
        m.process.exit_code(timeout=_REAPED_WITHIN)
        m.process.kill_leftovers()  # what it started, in its own process group
        if m.out_fds:
            self.relay.forget(list(m.out_fds))
        self.unregister(m.channel, m.control, *m.out_fds, m.process.death_fd)
        m.channel.close()
        if m.control is not None:
            m.control.close()
        for fd in m.out_fds:
            os.close(fd)
        m.process.close()

    def close(self) -> None:
        """After every rank is buried: the loop's own fds."""
        self.watch.end()
        self.closed = True
        self.selector.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def forget_in_child(self) -> None:
        """In a fork of the caller (a DataLoader worker of the notebook): drop our copies of the
        ranks' channels, or the ranks would not see the caller die while this child lives."""
        self.closed = True
        fds = [self.wake_r, self.wake_w]
        for m in self.members.values():
            fds += [m.channel.detach(), *m.out_fds]
            if m.control is not None:
                fds.append(m.control.detach())
            if m.process.death_fd is not None:
                fds.append(m.process.death_fd)
        try:
            fds.append(self.selector.fileno())  # type: ignore[attr-defined]
        except (AttributeError, ValueError):
            pass
        self.members.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
