"""The output relay: fork-safe while the caller's rank forks, and live for partial lines.

The notebook is rank 0, so a DataLoader with workers on rank 0 forks the notebook process
while the relay is running. Nothing the relay holds may be inherited locked by such a
child: a worker that prints, warns or logs must never block.
"""

from __future__ import annotations

import io
import sys

import pytest

import helpers_ranks as hr
import mpify_nb

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
    monkeypatch.setattr(sys, "stdout", captured)
    results = mpify_nb.ranch(2, hr.partial_line_then_wait, str(tmp_path / "flag"), captured.getvalue)
    monkeypatch.undo()
    assert results == ["watched", "seen"]
    # Its end came on the same line: nobody else wrote meanwhile.
    assert "[rank 1] working... done\n" in captured.getvalue()


def test_rank_0_dataloader_workers_that_print_never_hang(notebook):
    # Before the relay was fork-safe, about 1 call in 10 of these hung (a worker blocked on
    # the relay's lock, inherited locked). 30 calls, each bounded by the cell timeout.
    cells = notebook([PRELUDE, CHATTY_LOADER] + ["print(ranch(2, load))"] * 30, timeout=60)
    for cell in cells[2:]:
        assert nbutil.stream_text(cell).splitlines()[-1] == "[20, 0]"
