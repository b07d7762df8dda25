"""Where output is relayed: ranks' stdout/stderr pipes, read live (a thread, or a Session's pump) into the cell.

Each rank's file descriptors 1 and 2 are pipes (so C extensions' output is
caught too). One thread, the relay, reads them all and writes whole lines to the
caller's own ``sys.stdout``/``sys.stderr``, each line prefixed with its rank::

    [rank 1] epoch 0 loss 0.731

A line ends at ``\\n`` (or ``\\r``: see bars below). A partial
line (``print("working...", end="", flush=True)``) is shown once it has waited
``_PARTIAL_WAIT`` seconds for its end. In Jupyter it is then a live display line of
its rank's own (display_id), which grows as more comes and is finished there by its
end, so two ranks' partial lines each grow on their own line. Elsewhere its end
continues it on the same line, unless another rank (or the caller) wrote meanwhile:
then a newline closes the open line first and the rest comes on a new, labelled
one. So output is live and lines of different ranks never interleave mid-line. The pipes are always
drained, so a rank can never block on a full pipe, and nothing is lost at exit.

A carriage-return line (tqdm's bar, Lightning's, ``print(..., end="\\r")``) is a
*bar*: its redraws would garble the lines of other ranks, so it is not written to
the stream. Each rank's bar is one live line of the cell instead::

    rank 1 pipe:  "\\rbar  3%" "\\rbar 50%" ... "\\rbar 100%" "\\n"
        relay:    Bar(text) --- Jupyter: display(..., display_id) then update_display
                                 at most 10/s, left at its final state
                             --- elsewhere (terminal, file): "[rank 1] bar 50%\\n" at
                                 most every 2 s, and its final state

A bare leading ``\\r`` (tqdm starts every redraw with one) shows nothing by itself.
The caller's own bar (rank 0 of ``ranch``) is the notebook's own output, unlabelled;
in Jupyter it is a live display line too while the relay runs (``LineTracker``): in
the stream, another rank's bar display coming between two of its redraws would leave
its earlier state frozen above (a stream's ``\\r`` cannot reach back over an output).

A per-rank view (magics/views.py, tabs) takes a Session call's output raw instead:
``retarget(..., sink)`` gives each rank's text to ``sink(rank, "stdout", text)``.

The thread runs in a copy of the caller's ``contextvars`` context: ipykernel
uses one to route output (streams and displays) to the cell that started the call.

A :class:`~mpify_nb.Session` (persistent ranks) uses the same line assembly without
the thread: its ranks' pipes outlive every call, so it ``adopt``-s their read ends
and ``pump``-s them from its own wait loop, on the caller's thread, writing to the
streams of the cell running now (``retarget``); ``end_call`` drains them at the end
of each call so nothing spills into the next cell.

Who does what::

    rank fd 1/2 ── pipe ──> OutputRelay (here): add / adopt, read (_run's thread or pump),
                            end_call, forget, close; the caller's streams tracked, forks
                              │ bytes, per fd, with (rank, stream)
                              v
                            RankOutput (relay/output.py): labelled lines, bars, growing
                            partial lines, a view's feed; taken prompts
                              │ cutting and drawing
                              v
                            relay/lines.py: split_lines, whole_characters, Bar, LineTracker, ViewFeed
"""

from __future__ import annotations

import contextvars
import os
import selectors
import sys
import threading
import time
import weakref
from typing import Any, Optional, TextIO

from .lines import LineTracker
from .output import _CHUNK, _PARTIAL_WAIT, RankOutput

#: Relays running in this process, for the fork handler below.
_running: weakref.WeakSet[OutputRelay] = weakref.WeakSet()


# The caller's own rank may fork (DataLoader workers on rank 0) while the relay thread
# writes: a child inherits every lock held at that moment, held for ever (its holder does not
# exist there), and its first print blocks. Two locks are at stake: the one the relay's
# trackers share, and the caller's stream's own (ipykernel's OutStream takes ``_buffer_lock``
# in every write, the relay thread's and its IOPub thread's). So a fork waits until neither
# is held, holds both across the fork (the order every writer takes them in), and the child
# gets fresh ones, with no line to wait for.
_held_over_fork: list[Any] = []


def _before_fork() -> None:
    relays = list(_running)
    # Every relay's lock before any stream's (a relay thread holds its own while it waits for
    # a stream's), and a stream that two relays write to once.
    streams = {id(lock): lock for relay in relays for lock in
               (getattr(target, "_buffer_lock", None) for target in relay._streams.targets) if lock is not None}
    for lock in [*(relay._streams.cond for relay in relays), *streams.values()]:
        lock.acquire()
        _held_over_fork.append(lock)


def _after_fork_in_parent() -> None:
    while _held_over_fork:
        _held_over_fork.pop().release()


def _after_fork_in_child() -> None:
    _held_over_fork.clear()
    for relay in list(_running):
        relay._streams.cond = threading.Condition()
        for tracker in relay._streams.trackers:
            tracker._cond = relay._streams.cond
            tracker.mid_line = False
        for target in relay._streams.targets:
            lock = getattr(target, "_buffer_lock", None)
            if lock is not None:
                target._buffer_lock = type(lock)()  # type: ignore[union-attr]


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


#: Serializes the swapping of sys.stdout/sys.stderr between relays of concurrent calls.
_streams_lock = threading.Lock()


class OutputRelay(RankOutput):
    """The ranks' pipes: made (``add``) or adopted, read by its own thread (``ranch``) or pumped
    (a Session), drained at a call's end and closed. What their bytes become is RankOutput's."""

    def __init__(self, stdout: TextIO, stderr: TextIO):
        super().__init__(stdout, stderr)
        self._selector = selectors.DefaultSelector()
        self._adopted: set[int] = set()  # read ends the caller owns (a Session's): never closed here
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = False
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name="mpify_nb-relay", daemon=True
        )
        self._started = False
        self._tracking = False

    def add(self, rank: int) -> tuple[int, int]:
        """Make the pipes for ``rank``; return their write ends (for the rank; close them after)."""
        ends = []
        for stream in (0, 1):
            r, w = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(r, False)
            with self._lock:
                self._pending[r] = b""
                self._where[r] = (rank, stream)
                self._selector.register(r, selectors.EVENT_READ, (rank, stream))
            ends.append(w)
        self._wake()
        return ends[0], ends[1]

    def start(self) -> None:
        """Start relaying; the caller's sys.stdout/sys.stderr are tracked until close()."""
        self._started = True
        _running.add(self)
        self._thread.start()
        # Another call's relay (a call in another thread) may track them already: then we
        # write through its trackers, and leave the streams to it.
        with _streams_lock:
            self._tracking = not isinstance(sys.stdout, LineTracker) and not isinstance(sys.stderr, LineTracker)
            if self._tracking:
                sys.stdout, sys.stderr = self._streams.trackers

    def _untrack(self) -> None:
        # Put the caller's streams back, unless its code has replaced them meanwhile.
        if not self._tracking:
            return
        with _streams_lock:
            if sys.stdout is self._streams.trackers[0]:
                sys.stdout = self._streams.targets[0]
            if sys.stderr is self._streams.trackers[1]:
                sys.stderr = self._streams.targets[1]

    def close(self, timeout: float = 2.0) -> None:
        """Wait until every rank's pipes have closed (the ranks are gone), at most
        ``timeout`` seconds, then write out what is left and stop."""
        self._stopping = True
        self._wake()
        if self._started:
            self._thread.join(timeout)
        with self._lock:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    self._read(key.fd, key.data)  # whatever is there now
                    self._finish(key.fd, key.data)
        if self._thread.is_alive():  # it leaves once nothing is watched
            self._thread.join()
        with self._streams.cond:
            for tracker in self._streams.trackers:
                tracker.show_bar()  # the caller's bar, left at its last state
        self._untrack()
        _running.discard(self)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                watched = [k for k in self._selector.get_map().values() if k.data is not None]
                if self._stopping and not watched:
                    return
            with self._lock:
                wait = self._partial_wait()
            if self._stopping:
                wait = 0.2 if wait is None else min(wait, 0.2)
            events = self._selector.select(timeout=wait)
            with self._lock:
                self._show_partials()
                for key, _ in events:
                    if key.data is None:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    elif key.fd in self._pending and not self._read(key.fd, key.data):
                        self._finish(key.fd, key.data)
            # Once asked to stop, leave after the join timeout even if a grandchild holds a pipe.

    def _read(self, fd: int, where: tuple[int, int]) -> bool:
        """Read what is available; False at end of file."""
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            self._emit(fd, where, chunk)

    def _show_due_bars(self) -> None:
        for fd, bar in list(self._bars.items()):
            key = self._selector.get_map().get(fd)
            if key is not None:
                self._show_bar(fd, key.data, bar)

    def _show_partials(self) -> None:
        self._show_due_bars()
        now = time.monotonic()
        if self._sink is not None:
            self._sink.give_due()
        for fd, since in list(self._partial_since.items()):
            if now - since >= _PARTIAL_WAIT:
                where = self._where.get(fd)
                if where is not None:
                    self._show_partial(fd, where)

    def _finish(self, fd: int, where: tuple[int, int]) -> None:
        self._end_of(fd, where)
        if fd in self._adopted:
            self._adopted.discard(fd)
            return
        self._selector.unregister(fd)
        os.close(fd)

    # -- driven by a Session's own loop (no thread) ----------------------------------------

    def adopt(self, rank: int, out_fd: int, err_fd: int) -> None:
        """Relay ``rank``'s stdout/stderr from these read ends (non-blocking; the caller owns
        them and calls :meth:`pump` when they are readable)."""
        with self._lock:
            for stream, fd in ((0, out_fd), (1, err_fd)):
                os.set_blocking(fd, False)
                self._pending[fd] = b""
                self._where[fd] = (rank, stream)
                self._adopted.add(fd)

    def pump(self, fd: int) -> bool:
        """Relay what adopted ``fd`` has now; False once it reached end of file (its rank is
        gone: its last partial line was written out and the fd is forgotten, not closed)."""
        with self._lock:
            where = self._where.get(fd)
            if where is None:
                return False
            if self._read(fd, where):
                return True
            self._finish(fd, where)
            return False

    def catch_up(self, fds) -> None:
        """Before a rank's display or widget frame is shown: relay what it printed first, its
        held view text included (a frame on the channel overtakes bytes in its pipes)."""
        for fd in fds:
            self.pump(fd)
        with self._lock:
            if self._sink is not None:
                for fd in fds:
                    self._sink.give(fd)

    def due(self) -> Optional[float]:
        """Show the partial lines that waited long enough; seconds until the next is due."""
        with self._lock:
            self._show_partials()
            return self._partial_wait()

    def end_call(self, fds) -> None:
        """The call is over: relay everything still in these adopted pipes, partial lines
        included, so nothing of this call appears in the next one."""
        with self._lock:
            for fd in fds:
                where = self._where.get(fd)
                if where is None:
                    continue
                if not self._read(fd, where):
                    self._finish(fd, where)
                    continue
                self._flush_partial(fd, where)
            self._end_of_call()

    def forget(self, fds) -> None:
        """Stop relaying these adopted fds (their rank is being closed); write what is left."""
        with self._lock:
            for fd in fds:
                where = self._where.get(fd)
                if where is not None:
                    self._read(fd, where)
                    self._finish(fd, where)

    def take_prompt(self, rank: int) -> str:
        """The text ``rank`` left on an open stdout line before it read its stdin (input()'s
        prompt, pdb's ``(Pdb) ``): what its pipe holds now is read, and the open line is taken
        (RankOutput._take_partial), for the frontend's prompt to show instead of the cell."""
        with self._lock:
            fd = next((f for f, where in self._where.items() if where == (rank, 0)), None)
            if fd is None or fd in self._bars:
                return ""
            self._partial_told.pop(fd, None)  # after its answer, its next prompt is told at once
            self._read(fd, (rank, 0))
            return self._take_partial(fd)


__all__ = ["OutputRelay"]
