"""fastai, a supported library (issue 27): a tabular Learner trained with ``learn.distrib_ctx``
through every route, in a real kernel, gives what ``torchrun --nproc-per-node 2`` gives.

The training (tests/scripts/fastai_tabular.py) is pasted into a notebook cell, as a user would,
after ``from fastai.tabular.all import *`` (so the notebook holds fastai, its ``@patch``-ed
methods and its metrics), then run:

* ``ranch(2, train_fastai, ctx=in_torchddp())``, three times: the first from a template that
  holds torch only, the others from one that preloaded fastai;
* a ``%%ranch 2 --ddp`` cell;
* persistent ranks (``%dist_init -n 2``, then the cells run on the ranks).

Tabular only: ``fastai.vision`` needs torchvision's C ops, and PyPI's torchvision beside the CPU
torch fails to import. Marked ``libraries`` (fastai imports in seconds).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
if importlib.util.find_spec("fastai") is None:  # not imported here: kernels import it
    pytest.skip("fastai is not installed (pip install mpify_nb[test])", allow_module_level=True)

import nbutil  # noqa: E402

pytestmark = pytest.mark.libraries

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fastai_tabular.py"
TRAINING_CELL = SCRIPT.read_text().split('if __name__ == "__main__":')[0]
# What a fastai notebook starts with: everything fastai exports, patches and metrics included.
IMPORTS = ("from fastai.tabular.all import *\nfrom fastai.distributed import *\nimport json, sys, mpify_nb\n"
           "mpify_nb.set_rank_imports(True)  # on, as by default\n")


@pytest.fixture(scope="module")
def expected() -> list[dict]:
    """Rank results of ``torchrun --nproc-per-node 2 fastai_tabular.py``, by rank."""
    return nbutil.torchrun_results(SCRIPT, timeout=240)


def _parse(cell, tag: str):
    for line in nbutil.stream_text(cell).splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"no {tag} line in: {nbutil.all_text(cell)[-3000:]}")


def _check(got: list[dict], expected: list[dict], where: str) -> None:
    assert [r["rank"] for r in got] == [0, 1], where
    for mine, theirs in zip(got, expected):
        losses = mine["losses"]
        assert losses[-1] < losses[0], (where, losses)  # it learns
        assert losses == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6), where
        assert len(mine["values"]) == len(theirs["values"]) == 2, where  # one row per epoch
        for row, their_row in zip(mine["values"], theirs["values"]):  # losses, accuracy, error rate
            assert row == pytest.approx(their_row, rel=1e-5, abs=1e-6), where
        assert mine["weights"] == pytest.approx(theirs["weights"], rel=1e-5, abs=1e-6), where


def test_ranch_with_in_torchddp_three_calls(expected):
    cells = nbutil.run_cells([
        IMPORTS + "from mpify_nb import ranch, in_torchddp\nmpify_nb.set_preload(True)\n",
        TRAINING_CELL,
        *["print('RESULTS', json.dumps(ranch(2, train_fastai, ctx=in_torchddp())))\n"
          + ("mpify_nb.start.template.wait_preloaded(300)\n" if call == 0 else "") for call in range(3)],
        "print('HELD', json.dumps(ranch(2, lambda: 'fastai.callback.schedule' in sys.modules)))",
    ], timeout=400)
    for call in range(3):
        _check(_parse(cells[2 + call], "RESULTS"), expected, f"call {call + 1}")
    assert _parse(cells[5], "HELD") == [True, True]


def test_ranch_cell_with_ddp(expected):
    cells = nbutil.run_cells([
        IMPORTS + "%load_ext mpify_nb\n",
        TRAINING_CELL,
        "%%ranch 2 --ddp\nresult = train_fastai()\nresult",
        "values = %ranch_result\nprint('RESULTS', json.dumps(values))",
    ], timeout=400)
    _check(_parse(cells[3], "RESULTS"), expected, "%%ranch 2 --ddp")


def test_persistent_ranks(expected):
    """The training is defined in the notebook (a %%local cell); the ranks' cell calls it, so it
    is sent to them (a notebook function naming fastai's metrics and patched methods)."""
    cells = nbutil.run_cells([
        "%load_ext mpify_nb\n%dist_init -n 2",
        "%%local\n" + IMPORTS + TRAINING_CELL,
        "result = train_fastai()",  # on the ranks (automatic mode)
        "%%local\n%dist_pull result --all\nprint('RESULTS', json.dumps(result))",
        "%dist_shutdown",
    ], timeout=400)
    _check(_parse(cells[3], "RESULTS"), expected, "persistent ranks")
