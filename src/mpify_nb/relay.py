"""Where output is relayed: ranks' stdout/stderr, live, into the calling cell.

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
"""

from __future__ import annotations

import contextvars
import os
import selectors
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional, TextIO

from .relay_lines import Bar, LineTracker, ViewFeed, notebook_display, split_lines, whole_characters

_CHUNK = 1 << 16
_MID_LINE_WAIT = 0.5
_PARTIAL_WAIT = 0.1  # how long a partial line waits for its end before it is shown
#: A partial line (or a bar's state) this long is shown at once: what waits for its end stays
#: bounded, so relaying costs time linear in the output's size, however long a line is.
_LONG_LINE = _CHUNK


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
               (getattr(target, "_buffer_lock", None) for target in relay._targets) if lock is not None}
    for lock in [*(relay._cond for relay in relays), *streams.values()]:
        lock.acquire()
        _held_over_fork.append(lock)


def _after_fork_in_parent() -> None:
    while _held_over_fork:
        _held_over_fork.pop().release()


def _after_fork_in_child() -> None:
    _held_over_fork.clear()
    for relay in list(_running):
        relay._cond = threading.Condition()
        for tracker in relay._trackers:
            tracker._cond = relay._cond
            tracker.mid_line = False
        for target in relay._targets:
            lock = getattr(target, "_buffer_lock", None)
            if lock is not None:
                target._buffer_lock = type(lock)()  # type: ignore[union-attr]


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


#: Serializes the swapping of sys.stdout/sys.stderr between relays of concurrent calls.
_streams_lock = threading.Lock()


def _underlying(stream: TextIO) -> TextIO:
    return stream._stream if isinstance(stream, LineTracker) else stream


class OutputRelay:
    def __init__(self, stdout: TextIO, stderr: TextIO):
        # Another call's tracker is not a target: it may be gone before we are done.
        stdout, stderr = _underlying(stdout), _underlying(stderr)
        self._targets = (stdout, stderr)
        self._cond = threading.Condition()
        self._trackers = (LineTracker(stdout, self._cond), LineTracker(stderr, self._cond))
        self._selector = selectors.DefaultSelector()
        self._pending: dict[int, bytes] = {}
        self._partial_since: dict[int, float] = {}  # fd -> when its pending partial line began
        self._where: dict[int, tuple[int, int]] = {}  # fd -> (rank, stream)
        self._adopted: set[int] = set()  # read ends the caller owns (a Session's): never closed here
        self._bars: dict[int, Bar] = {}  # fd -> the bar line it is drawing now
        self._display = notebook_display(stdout)  # None: a terminal or a file, bars as text lines
        self._open_line: list[Optional[int]] = [None, None]  # per stream: the fd whose line is open
        #: fd -> its partial line shown before its end, in Jupyter: a live display line of its own
        self._growing: dict[int, Bar] = {}
        #: where a call's output goes instead of the streams: sink(rank, "stdout"|"stderr", text),
        #: raw (a per-rank view: no labels, no line assembly; see magics/views.py)
        self._sink: Optional[ViewFeed] = None
        self._lock = threading.Lock()
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
                sys.stdout, sys.stderr = self._trackers

    def _untrack(self) -> None:
        # Put the caller's streams back, unless its code has replaced them meanwhile.
        if not self._tracking:
            return
        with _streams_lock:
            if sys.stdout is self._trackers[0]:
                sys.stdout = self._targets[0]
            if sys.stderr is self._trackers[1]:
                sys.stderr = self._targets[1]

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
        with self._cond:
            for tracker in self._trackers:
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

    def _emit(self, fd: int, where: tuple[int, int], chunk: bytes) -> None:
        if self._sink is not None:
            # Whole lines go at once; a partial one waits _PARTIAL_WAIT for its end, as in lines
            # (so input()'s prompt, taken before it is shown, is the frontend's, not the view's).
            cut = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
            if cut:
                whole, tail = self._pending[fd] + chunk[:cut], chunk[cut:]
                self._to_sink(fd, where, whole)  # it ends with a line end: whole characters
                self._pending[fd] = tail
            else:
                self._pending[fd] += chunk
            if not self._pending[fd]:
                self._partial_since.pop(fd, None)
            elif len(self._pending[fd]) > _LONG_LINE:
                self._to_sink(fd, where, self._pending[fd])
            elif cut or fd not in self._partial_since:
                self._partial_since[fd] = time.monotonic()
            return
        # What is pending holds no line end, so only the new chunk is searched for one.
        cut = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
        if cut:
            whole, self._pending[fd] = self._pending[fd] + chunk[:cut], chunk[cut:]
            self._lines(fd, where, whole)
        else:
            self._pending[fd] += chunk  # bounded by _LONG_LINE + _CHUNK: see below
        bar = self._bars.get(fd)
        if bar is not None and len(self._pending[fd]) > _LONG_LINE:
            self._end_bar(fd, where)  # no bar has a state that long: it is a line after all
            bar = None
        if bar is not None:
            # A bar's text comes after its \r (tqdm writes "\r" + bar): what is here is its state now.
            self._partial_since.pop(fd, None)
            shown = whole_characters(self._pending[fd])
            if shown.strip():
                bar.text = shown.decode("utf-8", errors="replace")
            self._show_bar(fd, where, bar)
        elif not self._pending[fd]:
            self._partial_since.pop(fd, None)
        elif len(self._pending[fd]) > _LONG_LINE:
            self._show_partial(fd, where)  # it would only grow while it waits for its end
        elif cut or fd not in self._partial_since:
            self._partial_since[fd] = time.monotonic()

    def _lines(self, fd: int, where: tuple[int, int], data: bytes) -> None:
        """Whole lines from ``fd``: plain ones are written out labelled; a line with a carriage
        return in it (a progress bar) becomes a live bar line (see Bar) until its newline."""
        plain: list[bytes] = []
        lines, _tail = split_lines(data)  # data ends with a line end: no tail
        growing = self._growing.get(fd)
        if growing is not None and lines:
            if not lines[0].endswith(b"\r"):  # its end: the line is whole, where it was shown
                growing.text += lines.pop(0).rstrip(b"\r\n").decode("utf-8", errors="replace")
            self._end_growing(fd, where)  # (before a bar's first redraw: it ends where it is)
        for line in lines:
            is_bar_step = line.endswith(b"\r")
            bar = self._bars.get(fd)
            if bar is None and not is_bar_step:
                plain.append(line)
                continue
            if plain:
                self._write(fd, where, b"".join(plain))
                plain = []
            if bar is None:
                bar = self._start_bar(fd, where)
            body = line.rstrip(b"\r\n").decode("utf-8", errors="replace")
            if body.strip():
                bar.text = body
            elif not is_bar_step or body:
                bar.text = ""  # cleared (tqdm leave=False): nothing left to show
            if not is_bar_step:  # its newline: the line is done, its last state stays
                self._end_bar(fd, where)
        if plain:
            self._write(fd, where, b"".join(plain))

    # -- progress bars: a rank's carriage-return line, shown as one live line ------------------

    def _start_bar(self, fd: int, where: tuple[int, int]) -> Bar:
        stream = where[1]
        self._end_growing(fd, where)
        if self._open_line[stream] == fd and self._trackers[stream].rank_line_open:
            self._write(fd, where, b"\n")  # its partial line, shown already, ends where it is
        bar = self._bars[fd] = Bar(time.monotonic())
        return bar

    def _show_bar(self, fd: int, where: tuple[int, int], bar: Bar, final: bool = False) -> None:
        """Show the bar's state if it changed, at most every ``BAR_INTERVAL`` (Jupyter) or
        ``BAR_TEXT_INTERVAL`` (text: a new labelled line each time) seconds; always its final state."""
        if bar.text == bar.shown:
            return
        now = time.monotonic()
        if not final and now < bar.due(self._display is not None):
            return
        label = f"[rank {where[0]}] "
        if self._display is None:
            if bar.text:
                self._write(fd, where, (bar.text + "\n").encode())
        else:
            if bar.handle is None and not bar.text:
                return  # a bare "\r", or a bar cleared before it was shown: no empty line
            # (what the ranks wrote before the bar stays above it)
            bar.draw(self._display, {"text/plain": label + bar.text}, self._flush_targets)
        bar.shown = bar.text
        bar.last_shown = now

    def _end_bar(self, fd: int, where: tuple[int, int]) -> None:
        bar = self._bars.pop(fd, None)
        if bar is not None:
            self._show_bar(fd, where, bar, final=True)

    def _show_due_bars(self) -> None:
        for fd, bar in list(self._bars.items()):
            key = self._selector.get_map().get(fd)
            if key is not None:
                self._show_bar(fd, key.data, bar)

    def _flush_targets(self) -> None:
        for target in self._targets:
            try:
                target.flush()
            except Exception:
                pass

    def _partial_wait(self) -> Optional[float]:
        """Seconds until the oldest pending partial line, or a bar's new state, is due to be
        shown (None: none)."""
        due = [since + _PARTIAL_WAIT for since in self._partial_since.values()]
        due += self._sink.due() if self._sink is not None else []
        jupyter = self._display is not None
        due += [bar.due(jupyter) for bar in self._bars.values() if bar.text != bar.shown]
        if not due:
            return None
        return max(0.0, min(due) - time.monotonic())

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

    def _show_partial(self, fd: int, where: tuple[int, int]) -> None:
        """Write out ``fd``'s pending partial line (its whole characters) now."""
        buf = self._pending.get(fd, b"")
        if self._sink is not None:
            self._to_sink(fd, where, buf)
            return
        shown = whole_characters(buf)
        if not shown:
            return
        self._pending[fd] = buf[len(shown):]
        self._partial_since.pop(fd, None)
        self._write_partial(fd, where, shown)

    def _write_partial(self, fd: int, where: tuple[int, int], shown: bytes) -> None:
        """A partial line's part, shown before its end. In Jupyter it grows a live display line
        of its rank's own (update_display_data), so two ranks' partial lines each grow on their
        own line; its end finishes it there (the display keeps it). Elsewhere it is written to
        the stream, and another rank's writing ends it (a new labelled line continues it)."""
        line = self._growing.get(fd)
        if self._display is None or len(shown) + (len(line.text) if line is not None else 0) > _LONG_LINE:
            self._end_growing(fd, where)  # redrawing a line this long would cost its length each time
            self._write(fd, where, shown)
            return
        if line is None:
            line = self._growing[fd] = Bar(time.monotonic())
        line.text += shown.decode("utf-8", errors="replace")
        self._show_line(where, line)

    def _show_line(self, where: tuple[int, int], line: Bar) -> None:
        if line.text == line.shown or self._display is None:
            return
        line.draw(self._display, {"text/plain": f"[rank {where[0]}] {line.text}"}, self._flush_targets)
        line.shown = line.text

    def _end_growing(self, fd: int, where: tuple[int, int]) -> None:
        line = self._growing.pop(fd, None)
        if line is not None:
            self._show_line(where, line)

    def _to_sink(self, fd: int, where: tuple[int, int], data: bytes) -> None:
        """A per-rank view: ``data`` goes as it is to its rank's place (whole characters)."""
        shown = whole_characters(data)
        self._pending[fd] = data[len(shown):]
        self._partial_since.pop(fd, None)
        if shown and self._sink is not None:
            self._sink.add(fd, where, shown.decode("utf-8", errors="replace"))

    def _finish(self, fd: int, where: tuple[int, int]) -> None:
        rest = self._pending.pop(fd, b"")
        self._partial_since.pop(fd, None)
        self._where.pop(fd, None)
        if self._sink is not None:
            if rest:
                self._to_sink(fd, where, rest)
                self._pending.pop(fd, None)
                rest = b""
            self._sink.give(fd)
        if fd in self._bars:  # the rank ended on a bar line: its last state is its final one
            if rest.strip():
                self._bars[fd].text = rest.decode("utf-8", errors="replace")
            self._end_bar(fd, where)
            rest = b""
        if fd in self._growing:
            self._growing[fd].text += rest.decode("utf-8", errors="replace")
            self._end_growing(fd, where)
            rest = b""
        if rest or self._open_line[where[1]] == fd:
            self._write(fd, where, rest + b"\n")
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

    def retarget(self, stdout: TextIO, stderr: TextIO,
                 sink: Optional[Callable[[int, str, str], None]] = None) -> None:
        """Write to these streams from now on (the cell that runs now); or, with ``sink``, give
        each rank's output to ``sink(rank, "stdout" | "stderr", text)`` as it comes, raw, until
        :meth:`end_call` (a per-rank view)."""
        stdout, stderr = _underlying(stdout), _underlying(stderr)
        with self._lock:
            self._sink = ViewFeed(sink) if sink is not None else None
            self._targets = (stdout, stderr)
            self._trackers = (LineTracker(stdout, self._cond), LineTracker(stderr, self._cond))
            self._display = notebook_display(stdout)

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
                rest = whole_characters(self._pending.get(fd, b""))
                self._pending[fd] = self._pending[fd][len(rest):]
                self._partial_since.pop(fd, None)
                if rest and self._sink is not None:
                    self._to_sink(fd, where, rest)
                elif rest:
                    self._write_partial(fd, where, rest)  # as it is: a cell's last "end=''" is kept
                self._end_growing(fd, where)
            if self._sink is not None:
                self._sink.give_all()
            self._sink = None
            # The next call's output starts on lines of its own (a new cell's output area).
            self._open_line = [None, None]
            for tracker in self._trackers:
                tracker.rank_line_open = False

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
        prompt, pdb's ``(Pdb) ``): what its pipe holds now is read, and the line's part not
        shown yet is taken, for the frontend's prompt to show instead of the cell."""
        with self._lock:
            fd = next((f for f, where in self._where.items() if where == (rank, 0)), None)
            if fd is None or fd in self._bars:
                return ""
            self._read(fd, (rank, 0))
            buf = self._pending.get(fd, b"")
            taken = whole_characters(buf)
            self._pending[fd] = buf[len(taken):]
            self._partial_since.pop(fd, None)
            if self._open_line[0] == fd:  # what the rank writes after the answer starts a new line
                self._open_line[0] = None
                self._trackers[0].rank_line_open = False
            self._end_growing(fd, (rank, 0))
            return taken.decode("utf-8", errors="replace")

    def _write(self, fd: int, where: tuple[int, int], data: bytes) -> None:
        """Write ``data`` from ``fd``, labelled line by line. It may end mid-line (a partial
        line shown): that line stays open for ``fd`` until its end comes, or someone else writes."""
        rank, stream = where
        prefix = f"[rank {rank}] "
        whole, rest = split_lines(data)
        # A line end never falls inside a UTF-8 character: each line decodes alone.
        lines = [line.decode("utf-8", errors="replace") for line in whole]
        tail = rest.decode("utf-8", errors="replace")
        if tail:
            lines.append(tail)
        target, tracker = self._targets[stream], self._trackers[stream]
        with self._cond:
            continuing = self._open_line[stream] == fd and tracker.rank_line_open
            if tracker.mid_line and not self._cond.wait_for(lambda: not tracker.mid_line, _MID_LINE_WAIT):
                tracker.mid_line = False
                lead = "\n"  # the caller left a line open: start ours on a new one
            elif not continuing and tracker.rank_line_open:
                lead = "\n"  # another rank's line is open: close it
            else:
                lead = ""
            text = lead + "".join(line if i == 0 and continuing else prefix + line for i, line in enumerate(lines))
            still_open = bool(tail)
            self._open_line[stream] = fd if still_open else None
            tracker.rank_line_open = still_open
            try:
                target.write(text)
                target.flush()
            except Exception:
                pass  # a closed or broken caller stream must not kill the relay (ranks would block)
