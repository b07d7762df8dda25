"""What a rank's bytes become in the cell: labelled lines, live bars, growing partial lines, a view's feed.

The relay (relay/pipes.py) reads each rank's pipes and hands their bytes here, per fd, with the
rank and stream (``where``) they belong to::

    bytes of (rank, stream) ── RankOutput._emit ──> whole lines ──> LabelledStreams: "[rank k] ..."
         │                                      │                  on the caller's stream
         │                                      └── "...\\r" lines ──> a Bar: one live line (_show_bar)
         ├── a partial line, waited _PARTIAL_WAIT ──> _write_partial: a growing display line (Jupyter)
         │                                            or the stream, continued by its end
         └── a per-rank view (retarget's sink) ──> ViewFeed: raw text by rank, no labels

The cutting, drawing and writing themselves (split_lines, Bar, LabelledStreams, LineTracker,
ViewFeed) are relay/lines.py's.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, TextIO

from .lines import Bar, LabelledStreams, LineTracker, ViewFeed, notebook_display, split_lines, whole_characters

_CHUNK = 1 << 16
_PARTIAL_WAIT = 0.1  # how long a partial line waits for its end before it is shown
#: A partial line (or a bar's state) this long is shown at once: what waits for its end stays
#: bounded, so relaying costs time linear in the output's size, however long a line is.
_LONG_LINE = _CHUNK
#: A rank's new partial line is told to on_partial at most this often.
_PARTIAL_TELL = 0.2
#: Outside Jupyter the status line is a line on stderr: one at most this often.
STATUS_TEXT_INTERVAL = 30.0


def _underlying(stream: TextIO) -> TextIO:
    return stream._stream if isinstance(stream, LineTracker) else stream


class RankOutput:
    """The ranks' output state for the cell running now, by fd: pending bytes, bars, growing
    lines, which rank's line is open. The relay (relay/pipes.py) feeds it; its callers hold its lock."""

    def __init__(self, stdout: TextIO, stderr: TextIO):
        # Another call's tracker is not a target: it may be gone before we are done.
        stdout, stderr = _underlying(stdout), _underlying(stderr)
        #: the cell's streams, written labelled ("[rank k] ..."), with whose line is open on each
        self._streams = LabelledStreams(stdout, stderr, threading.Condition())
        self._pending: dict[int, bytes] = {}
        self._partial_since: dict[int, float] = {}  # fd -> when its pending partial line began
        self._where: dict[int, tuple[int, int]] = {}  # fd -> (rank, stream)
        self._bars: dict[int, Bar] = {}  # fd -> the bar line it is drawing now
        self._display = notebook_display(stdout)  # None: a terminal or a file, bars as text lines
        #: fd -> its partial line shown before its end, in Jupyter: a live display line of its own
        self._growing: dict[int, Bar] = {}
        #: where a call's output goes instead of the streams: sink(rank, "stdout"|"stderr", text),
        #: raw (a per-rank view: no labels, no line assembly; see magics/views.py)
        self._sink: Optional[ViewFeed] = None
        self._status: Optional[Bar] = None  # the call's live status line (status())
        #: on_partial(rank): a rank's stdout holds a line without its end (a prompt, maybe: pdb's
        #: "(Pdb) " before a read of fd 0 that only a look at the rank sees; engine/core.py)
        self.on_partial: Optional[Callable[[int], None]] = None
        self._partial_told: dict[int, float] = {}  # fd -> when on_partial was last called for it
        self._lock = threading.Lock()

    def retarget(self, stdout: TextIO, stderr: TextIO,
                 sink: Optional[Callable[[int, str, str], None]] = None) -> None:
        """Write to these streams from now on (the cell that runs now); or, with ``sink``, give
        each rank's output to ``sink(rank, "stdout" | "stderr", text)`` as it comes, raw, until
        :meth:`end_call` (a per-rank view)."""
        stdout, stderr = _underlying(stdout), _underlying(stderr)
        with self._lock:
            self._sink = ViewFeed(sink) if sink is not None else None
            self._streams.retarget(stdout, stderr)
            self._display = notebook_display(stdout)

    def status(self, text: Optional[str]) -> None:
        """The call's one live status line (engine/watch.py: what ranks have waited in for a
        while): drawn, redrawn in place, or emptied (``None``, and at the end of the call). In
        Jupyter a display line; elsewhere a line on stderr at most every ``STATUS_TEXT_INTERVAL``."""
        with self._lock:
            line = self._status
            if text is None:
                if line is not None and line.handle is not None and line.shown and self._display is not None:
                    line.draw(self._display, {"text/plain": ""}, lambda: None)
                self._status = None
                return
            if line is None:
                line = self._status = Bar(time.monotonic())
            if text == line.shown:
                return
            now = time.monotonic()
            display = self._display
            if display is not None:
                line.draw(display, {"text/plain": text}, self._streams.flush)
            elif line.last_shown is None or now >= line.last_shown + STATUS_TEXT_INTERVAL:
                try:
                    self._streams.trackers[1].write(text + "\n")
                except Exception:
                    pass
            else:
                return
            line.shown, line.last_shown = text, now

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
                self._tell_partial(fd, where)
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
            self._tell_partial(fd, where)

    def _tell_partial(self, fd: int, where: tuple[int, int]) -> None:
        """A partial line begins on a rank's stdout: tell on_partial, at most every
        ``_PARTIAL_TELL`` seconds per rank (a rank printing dots costs it little)."""
        now = time.monotonic()
        if self.on_partial is None or where[1] != 0 or now < self._partial_told.get(fd, 0.0) + _PARTIAL_TELL:
            return
        self._partial_told[fd] = now
        try:
            self.on_partial(where[0])
        except Exception:
            pass  # a prompt shown a little later is all that is lost

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
                self._streams.write(fd, where, b"".join(plain))
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
            self._streams.write(fd, where, b"".join(plain))

    # -- progress bars: a rank's carriage-return line, shown as one live line ------------------

    def _start_bar(self, fd: int, where: tuple[int, int]) -> Bar:
        stream = where[1]
        self._end_growing(fd, where)
        if self._streams.is_open(fd, stream):
            self._streams.write(fd, where, b"\n")  # its partial line, shown already, ends where it is
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
                self._streams.write(fd, where, (bar.text + "\n").encode())
        else:
            if bar.handle is None and not bar.text:
                return  # a bare "\r", or a bar cleared before it was shown: no empty line
            # (what the ranks wrote before the bar stays above it)
            bar.draw(self._display, {"text/plain": label + bar.text}, self._streams.flush)
        bar.shown = bar.text
        bar.last_shown = now

    def _end_bar(self, fd: int, where: tuple[int, int]) -> None:
        bar = self._bars.pop(fd, None)
        if bar is not None:
            self._show_bar(fd, where, bar, final=True)

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
            self._streams.write(fd, where, shown)
            return
        if line is None:
            line = self._growing[fd] = Bar(time.monotonic())
        line.text += shown.decode("utf-8", errors="replace")
        self._show_line(where, line)

    def _show_line(self, where: tuple[int, int], line: Bar) -> None:
        if line.text == line.shown or self._display is None:
            return
        line.draw(self._display, {"text/plain": f"[rank {where[0]}] {line.text}"}, self._streams.flush)
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

    def _end_of(self, fd: int, where: tuple[int, int]) -> None:
        """``fd`` reached its end: write out what it left (a partial line, a bar's last state)."""
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
        if rest or self._streams.open_line[where[1]] == fd:
            self._streams.write(fd, where, rest + b"\n")

    # -- the end of a call, a prompt ------------------------------------------------------

    def _flush_partial(self, fd: int, where: tuple[int, int]) -> None:
        """The call is over: what ``fd`` left unfinished is finished in this cell. A bar (a
        ``\r`` line left open: fastai's console bar) stays at its state now, and the next cell's
        redraws start a bar of their own there: its display belongs to this cell, and an update
        of it would change this cell's output, not show in the next. A partial line, whole
        characters, goes out as it is (a cell's last ``end=''`` is kept)."""
        rest = whole_characters(self._pending.get(fd, b""))
        self._pending[fd] = self._pending[fd][len(rest):]
        self._partial_since.pop(fd, None)
        bar = self._bars.get(fd)
        if bar is not None:
            if rest.strip():
                bar.text = rest.decode("utf-8", errors="replace")
            self._end_bar(fd, where)
        elif rest and self._sink is not None:
            self._to_sink(fd, where, rest)
        elif rest:
            self._write_partial(fd, where, rest)
        self._end_growing(fd, where)

    def _end_of_call(self) -> None:
        if self._sink is not None:
            self._sink.give_all()
        self._sink = None
        self._streams.new_call()  # the next call's output starts on lines of its own

    def _take_partial(self, fd: int) -> str:
        """``fd``'s open line, taken (input()'s prompt). In Jupyter that is all of it: a part shown
        already (a rank slow between its prompt and its read: its ASK came after _PARTIAL_WAIT) is
        taken back from its live display line, which is emptied; the prompt shows it instead, as
        it does when the ASK comes in time. Elsewhere the part written to the stream stays there."""
        buf = self._pending.get(fd, b"")
        taken = whole_characters(buf)
        self._pending[fd] = buf[len(taken):]
        self._partial_since.pop(fd, None)
        self._streams.close_line(fd, 0)  # what the rank writes after the answer starts a new line
        prompt = taken.decode("utf-8", errors="replace")
        line = self._growing.pop(fd, None)
        if line is not None and self._display is not None:
            prompt = line.text + prompt
            if line.handle is not None and line.shown:
                line.draw(self._display, {"text/plain": ""}, lambda: None)
        return prompt
