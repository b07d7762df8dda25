"""The output relay: fork-safe while the caller's rank forks, and live for partial lines.

The notebook is rank 0, so a DataLoader with workers on rank 0 forks the notebook process
while the relay is running. Nothing the relay holds may be inherited locked by such a
child: a worker that prints, warns or logs must never block.
"""

from __future__ import annotations

import io
import re
import sys
import threading
import time

import pytest

import helpers_ranks as hr
import mpify_nb
from mpify_nb.relay import pipes as relay_module

nbutil = pytest.importorskip("nbutil")  # conftest puts tests/ on sys.path

PRELUDE = "import os, sys, time\nfrom mpify_nb import ranch"

CHATTY_LOADER = '''
import logging, warnings, torch
log = logging.getLogger("chatty")
logging.basicConfig(level=logging.INFO)

class Chatty(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        warnings.warn("odd sample")
        print("sample", i)
        log.info("sample %d", i)
        return torch.tensor([float(i)])

def load():
    if os.environ["RANK"] == "1":  # keeps the relay busy writing while rank 0's workers fork
        for i in range(5000):
            print("rank 1 line", i, "x" * 50)
        return 0
    batches = 0
    for _ in range(10):
        for batch in torch.utils.data.DataLoader(Chatty(), batch_size=4, num_workers=2):
            batches += 1
    return batches
'''


def test_partial_line_is_shown_before_its_end(tmp_path, monkeypatch):
    # Rank 1 waits for the caller to have shown its partial line: before partial lines were
    # shown, it waited its full 30 s and the caller never saw the line in time.
    captured = io.StringIO()
    monkeypatch.setattr(hr, "watched", captured)
    monkeypatch.setattr(sys, "stdout", captured)
    results = mpify_nb.ranch(2, hr.partial_line_then_wait, str(tmp_path / "flag"), hr.watched_text)
    monkeypatch.undo()
    assert results == ["watched", "seen"]
    # Its end came on the same line: nobody else wrote meanwhile.
    assert "[rank 1] working... done\n" in captured.getvalue()


class _LockedStream(io.TextIOBase):
    """Writes the way ipykernel's OutStream does: holding the stream's ``_buffer_lock``."""

    def __init__(self) -> None:
        self._buffer_lock = threading.RLock()
        self.writes = 0

    def write(self, text: str) -> int:
        with self._buffer_lock:
            time.sleep(0.0002)  # a wide window for a fork to land in
            self.writes += 1
        return len(text)


def test_a_child_forked_while_the_relay_writes_can_print(monkeypatch):
    """A child the caller forks while the relay thread holds the caller's stream's own lock
    (ipykernel's, in a notebook) would inherit it held and block on its first print. Forks wait
    for the relay's write, and children get fresh locks. Before: the first child or so hung."""
    stream = _LockedStream()
    monkeypatch.setattr(sys, "stdout", stream)
    assert mpify_nb.ranch(2, hr.fork_printers_while_rank_1_prints, 2.0) == [0, 0]
    assert stream.writes > 100  # rank 1's lines did go through the relay meanwhile


def test_rank_0_dataloader_workers_that_print_never_hang(notebook):
    # Before the relay was fork-safe, about 1 call in 10 of these hung (a worker blocked on
    # the relay's lock, inherited locked). 30 calls, each bounded by the cell timeout.
    cells = notebook([PRELUDE, CHATTY_LOADER] + ["print(ranch(2, load))"] * 30, timeout=60)
    # The result ends the cell's text. Not always on a line of its own: rank 0's workers print
    # through ipykernel's own forked-process output, which can deliver a piece of a worker's line
    # ("7" of "sample 7") after the cell's last print (seen once in CI).
    for cell in cells[2:]:
        assert nbutil.stream_text(cell).rstrip().endswith("[20, 0]"), nbutil.stream_text(cell)[-300:]


TWO_BARS = '''
from tqdm import tqdm

def two_bars(n):
    rank = int(os.environ["RANK"])
    print(f"rank {rank} starts")
    for i in tqdm(range(n), desc=f"bar of rank {rank}", mininterval=0):
        time.sleep(0.01)
    print(f"rank {rank} done")
    return rank
'''


def _displays(cell) -> list:
    return [o for o in cell.outputs if o.get("output_type") == "display_data"]


def test_two_ranks_bars_each_end_as_one_line_with_100_percent(notebook):
    # Before: rank 1's redraws went to the same stderr stream as rank 0's, each labelled and
    # cut by newlines, so rank 0's bar was split over several lines and the two garbled.
    cells = notebook([PRELUDE, TWO_BARS, "print(ranch(2, two_bars, 40))"])
    cell = cells[2]
    out, err = nbutil.stream_text(cell), nbutil.stream_text(cell, "stderr")
    # Plain output as ever: labelled lines for rank 1, the notebook's own for rank 0.
    assert [ln for ln in out.splitlines()] == \
        ["rank 0 starts", "[rank 1] rank 1 starts", "rank 0 done", "[rank 1] rank 1 done", "[0, 1]"] or \
        sorted(out.splitlines()) == sorted(
            ["rank 0 starts", "[rank 1] rank 1 starts", "rank 0 done", "[rank 1] rank 1 done", "[0, 1]"]), out
    # Rank 1's bar: one live display line, left at its final state, labelled.
    bars = [d for d in _displays(cell) if "bar of rank 1" in d["data"].get("text/plain", "")]
    assert len(bars) == 1, cell.outputs
    assert re.fullmatch(r"\[rank 1\] bar of rank 1: 100%\|.*\| 40/40 .*", bars[0]["data"]["text/plain"]), bars
    assert "rank 1" not in err, err  # none of its redraws in the stream
    # Rank 0's bar: the notebook's own, a live display line too (unlabelled), never cut.
    assert "bar of rank 0" not in err, err
    bars = [d for d in _displays(cell) if "bar of rank 0" in d["data"].get("text/plain", "")]
    assert len(bars) == 1, cell.outputs
    assert re.fullmatch(r"bar of rank 0: 100%\|.*\| 40/40 .*", bars[0]["data"]["text/plain"]), bars


def test_a_bare_carriage_return_makes_no_empty_line(notebook):
    cells = notebook([PRELUDE, "def cr():\n    print('\\rhello')\n    print('\\r', end='')\n    return 1\n",
                      "print(ranch(2, cr))"])
    out = nbutil.stream_text(cells[2])
    assert "[rank 1] \n" not in out and "[rank 1] \r" not in out, out
    shown = nbutil.all_text(cells[2])
    assert "[rank 1] hello" in shown, cells[2].outputs


def test_bars_of_other_ranks_are_labelled_lines_at_a_bounded_rate_outside_jupyter(capsys):
    # A terminal (or a log file) cannot redraw several lines: each rank's bar is printed as a
    # labelled line at most every 2 s, and its final state; never a raw \r of another rank.
    import mpify_nb

    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys, "stdout", buf)
        m.setattr(sys, "stderr", buf)
        assert mpify_nb.ranch(2, hr.tqdm_bar, 60, 0.05, caller_rank=None) == [60, 60]
    lines = buf.getvalue().split("\n")
    for rank in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[rank {rank}] ")]
        assert all("\r" not in ln for ln in mine), mine
        assert re.search(r"bar: 100%\|.*60/60", mine[-1]), mine
        assert 2 <= len(mine) <= 4, mine  # ~3 s of bar: 1 or 2 timed states, and the final one


def test_a_long_line_without_its_end_is_shown_and_the_timeout_holds(monkeypatch):
    # Before: the relay showed a partial line with a regular expression that backtracks
    # quadratically over a line without its end, in C, holding the GIL: 60 kB held the call
    # (its timeout, the stop button, every other thread) for ~50 s.
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stdout", captured)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        mpify_nb.ranch(2, hr.long_line_then_sleep, 60_000, 30, timeout=3)
    took = time.monotonic() - start
    monkeypatch.undo()
    assert took < 8, f"the call took {took:.1f} s"
    assert captured.getvalue() == '[rank 1] "' + "x" * 59_998 + '"\n'


def test_relaying_is_linear_in_a_lines_length():
    # Lines of 1, 4 and 16 MB without their end, fed 64 KiB at a time: each is shown once,
    # whole and labelled, in time proportional to its size.
    out = io.StringIO()
    relay = relay_module.OutputRelay(out, io.StringIO())
    fd = 1000  # no real fd: _emit is what the pipes feed
    relay._pending[fd] = b""
    relay._where[fd] = (1, 0)
    times = []
    for size in (1 << 20, 4 << 20, 16 << 20):
        out.seek(0)
        out.truncate()
        start = time.perf_counter()
        for _ in range(size // relay_module._CHUNK):
            relay._emit(fd, (1, 0), b"y" * relay_module._CHUNK)
        relay._emit(fd, (1, 0), b"\n")
        times.append(time.perf_counter() - start)
        assert out.getvalue() == "[rank 1] " + "y" * size + "\n"
    assert times[2] < 40 * max(times[0], 0.02), times  # 16x the size: not 256x the time (before: 80x)
