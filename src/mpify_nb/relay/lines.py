"""The lines the relay writes (relay/output.py): cutting a rank's bytes into lines, a live display
line (a bar, a partial line that grows), and the caller's own streams while ranks write beside it.

::

    rank bytes ── split_lines / whole_characters ──> whole lines, whole UTF-8 characters
    "\\rbar 40%"  ── Bar: display(..., display_id), then update_display_data, left at its last state
    caller's print(...) ── LineTracker: passed through; its "\\r" redraws (tqdm) a Bar of its own
    whole lines of rank k ── LabelledStreams.write: "[rank k] ..." on the cell's stdout or stderr
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, TextIO

BAR_INTERVAL = 0.1  # a bar's live line in Jupyter is redrawn at most 10 times a second
BAR_TEXT_INTERVAL = 2.0  # elsewhere each redraw is a new line: one every 2 s (and the final one)
#: A per-rank view gets a rank's text at most this often (each update of a widget's outputs
#: resends all of them: given a line at a time, 1000 lines sent 20 MB; now 1.2 MB)
VIEW_INTERVAL = 0.1
#: How long a rank's line waits for the caller's own line (a print without its end) to end.
_MID_LINE_WAIT = 0.5


class Bar:
    """One rank's carriage-return line (a tqdm or Lightning bar, a ``\\r`` print) while it is drawn.
    In Jupyter it is one display output per bar, updated in place (update_display_data), which
    stays with its final state; elsewhere a labelled line every 2 s, and the final state."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.text = ""  # its state now
        self.shown: Optional[str] = None  # the state last shown (None: never)
        self.last_shown: Optional[float] = None
        self.handle: Any = None  # the Jupyter display handle, once shown

    def due(self, jupyter: bool) -> float:
        """When its next state may be shown."""
        if jupyter:
            return 0.0 if self.last_shown is None else self.last_shown + BAR_INTERVAL
        return (self.started if self.last_shown is None else self.last_shown) + BAR_TEXT_INTERVAL

    def draw(self, display: Callable, bundle: dict, before: Callable[[], None]) -> None:
        """Show ``bundle`` as this line: a new display (after ``before()``) the first time, then
        an update of it. Never raises: a broken display must not stop the relay (ranks would block)."""
        try:
            if self.handle is None:
                before()
                self.handle = display(bundle, raw=True, display_id=True)
            else:
                self.handle.update(bundle, raw=True)
        except Exception:
            pass


class ViewFeed:
    """A per-rank view's feed (magics/views.py): each fd's text goes to ``sink(rank, "stdout" |
    "stderr", text)`` at most every ``VIEW_INTERVAL`` seconds; the relay asks when it is due."""

    def __init__(self, sink: Callable[[int, str, str], None]) -> None:
        self.sink = sink
        self._held: dict[int, tuple[tuple[int, int], str]] = {}  # fd -> (rank, stream), its text
        self._last: dict[int, float] = {}  # fd -> when the sink last got its text

    def add(self, fd: int, where: tuple[int, int], text: str) -> None:
        self._held[fd] = (where, self._held[fd][1] + text if fd in self._held else text)
        if time.monotonic() >= self._last.get(fd, 0.0) + VIEW_INTERVAL:
            self.give(fd)

    def give(self, fd: int) -> None:
        held = self._held.pop(fd, None)
        self._last[fd] = time.monotonic()
        if held is not None:
            (rank, stream), text = held
            try:
                self.sink(rank, ("stdout", "stderr")[stream], text)
            except Exception:
                pass  # a broken view must not stop the relay (ranks would block)

    def due(self) -> list[float]:
        return [self._last.get(fd, 0.0) + VIEW_INTERVAL for fd in self._held]

    def give_due(self) -> None:
        now = time.monotonic()
        for fd in [fd for fd in self._held if now >= self._last.get(fd, 0.0) + VIEW_INTERVAL]:
            self.give(fd)

    def give_all(self) -> None:
        for fd in list(self._held):
            self.give(fd)


def notebook_display(stream: TextIO):
    """IPython's ``display`` when ``stream`` is a Jupyter kernel's output stream, else None."""
    if not type(stream).__module__.startswith("ipykernel."):
        return None
    try:
        from IPython.core.getipython import get_ipython
        from IPython.display import display
    except ImportError:
        return None
    return display if get_ipython() is not None else None


class LineTracker:
    """Stands in for one of the caller's streams during a call: passes everything
    through, and remembers whether the caller is in the middle of a line."""

    def __init__(self, stream: TextIO, cond: threading.Condition):
        self._stream = stream
        self._cond = cond
        self.mid_line = False
        self.rank_line_open = False  # a rank's partial line is shown on this stream, unfinished
        self._display = notebook_display(stream)
        self._bar: Optional[Bar] = None  # the caller's own carriage-return line, in Jupyter
        self._bar_line = ""  # its text since its last \r

    def write(self, text: str) -> int:
        with self._cond:
            if text and self.rank_line_open:
                self._stream.write("\n")  # the caller's text starts on a line of its own
                self.rank_line_open = False
            written = len(text)
            if self._display is not None and (self._bar is not None or redraws(text)):
                text = self._draw_bar(text)  # what follows the bar's newline, if any
                if not text:
                    return written
            n = self._stream.write(text)
            if text:
                self.mid_line = not text.endswith(("\n", "\r"))
                if not self.mid_line:
                    self._cond.notify_all()
        return n

    def _draw_bar(self, text: str) -> str:
        """The caller's bar (tqdm on rank 0 in ``%%ranch``) is a live display line too, like the
        ranks' bars: in the stream, a display of another rank's bar coming between two redraws
        would freeze the first one above it (a stream's ``\r`` cannot reach back over an output
        in between). Returns the text after the bar's newline (for the stream)."""
        if self._bar is None:
            head, cut, text = text.partition("\r")  # what came before the bar stays in the stream
            if head:
                self._stream.write(head)
            self._flush_stream()  # and stays above the bar
            self._bar = Bar(time.monotonic())
            text = cut + text
        line, newline, rest = text.replace("\r\n", "\n").partition("\n")
        line = self._bar_line + line
        self._bar_line = state = line.rsplit("\r", 1)[-1]  # the text since the last \r
        if state.strip():
            self._bar.text = state
        elif newline and line.endswith("\r"):
            self._bar.text = ""  # cleared (tqdm leave=False)
        if newline or time.monotonic() >= self._bar.due(True):
            self.show_bar()
        if newline:
            self._bar, self._bar_line = None, ""
            self.mid_line = False
        return rest

    def show_bar(self) -> None:
        """Show the caller's bar state if it changed (at most every ``BAR_INTERVAL`` while drawn)."""
        bar = self._bar
        if bar is None or bar.text == bar.shown or self._display is None:
            return
        if bar.handle is not None or bar.text:
            bar.draw(self._display, {"text/plain": bar.text}, lambda: None)
        bar.shown, bar.last_shown = bar.text, time.monotonic()

    def _flush_stream(self) -> None:
        try:
            self._stream.flush()
        except Exception:
            pass

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def redraws(text: str) -> bool:
    """``text`` redraws its line (a ``\r`` not part of a ``\r\n``)."""
    return "\r" in text.replace("\r\n", "")


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """``data`` cut after each ``\\n``, ``\\r`` or ``\\r\\n``: (whole lines, ends kept; the partial
    line after the last end). Linear in ``len(data)`` (a regular expression such as
    ``[^\\r\\n]*(?:\\r\\n|\\n|\\r)`` backtracks quadratically over a long line without an end,
    in C, holding the GIL: 60 kB took 50 s)."""
    lines = data.splitlines(keepends=True)  # bytes.splitlines cuts at these three only (str at more)
    if lines and not lines[-1].endswith((b"\n", b"\r")):
        return lines, lines.pop()
    return lines, b""


def whole_characters(buf: bytes) -> bytes:
    """The longest prefix of ``buf`` that does not end inside a UTF-8 character."""
    for back in range(1, min(4, len(buf)) + 1):
        byte = buf[-back]
        if byte < 0x80:
            return buf  # ASCII: whole
        if byte >= 0xC0:  # the lead byte of a character: is it complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return buf if back >= need else buf[:-back]
    return buf


class LabelledStreams:
    """The cell's two streams, stdout and stderr, as the ranks' lines are written to them: each
    line labelled ``[rank k]``, a line left open for the rank (fd) that wrote its start, and
    the caller's own writes (its ``LineTracker`` on each) kept from landing inside it. Its
    callers hold ``cond`` (shared with the trackers) or the relay's lock."""

    def __init__(self, stdout: TextIO, stderr: TextIO, cond: threading.Condition):
        self.cond = cond
        self.targets = (stdout, stderr)
        self.trackers = (LineTracker(stdout, cond), LineTracker(stderr, cond))
        self.open_line: list[Optional[int]] = [None, None]  # per stream: the fd whose line is open

    def retarget(self, stdout: TextIO, stderr: TextIO) -> None:
        """Write to these streams from now on (the cell that runs now)."""
        self.targets = (stdout, stderr)
        self.trackers = (LineTracker(stdout, self.cond), LineTracker(stderr, self.cond))

    def is_open(self, fd: int, stream: int) -> bool:
        """Is ``fd``'s line open on ``stream`` (shown up to its end, which has not come)?"""
        return self.open_line[stream] == fd and self.trackers[stream].rank_line_open

    def close_line(self, fd: int, stream: int) -> None:
        """What ``fd`` writes next on ``stream`` starts a line of its own."""
        if self.open_line[stream] == fd:
            self.open_line[stream] = None
            self.trackers[stream].rank_line_open = False

    def new_call(self) -> None:
        """The next call's output starts on lines of its own (a new cell's output area)."""
        self.open_line = [None, None]
        for tracker in self.trackers:
            tracker.rank_line_open = False

    def flush(self) -> None:
        for target in self.targets:
            try:
                target.flush()
            except Exception:
                pass

    def write(self, fd: int, where: tuple[int, int], data: bytes) -> None:
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
        target, tracker = self.targets[stream], self.trackers[stream]
        with self.cond:
            continuing = self.open_line[stream] == fd and tracker.rank_line_open
            if tracker.mid_line and not self.cond.wait_for(lambda: not tracker.mid_line, _MID_LINE_WAIT):
                tracker.mid_line = False
                lead = "\n"  # the caller left a line open: start ours on a new one
            elif not continuing and tracker.rank_line_open:
                lead = "\n"  # another rank's line is open: close it
            else:
                lead = ""
            text = lead + "".join(line if i == 0 and continuing else prefix + line for i, line in enumerate(lines))
            still_open = bool(tail)
            self.open_line[stream] = fd if still_open else None
            tracker.rank_line_open = still_open
            try:
                target.write(text)
                target.flush()
            except Exception:
                pass  # a closed or broken caller stream must not kill the relay (ranks would block)
