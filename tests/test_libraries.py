"""accelerate, Lightning (Fabric and Trainer) and HF Trainer inside ranch, in a real kernel.

Each library's tiny run (tests/scripts/libraries.py) is pasted into a notebook cell and run
with ``ranch(2, ...)`` three times in a row, as a user would; every call must give exactly
what a ``torchrun --nproc-per-node 2`` run of the same file gives, and leave the notebook
as it was (thread count, logging handlers, library singletons). These are slow (Lightning
imports in ~3 s): marked ``libraries``, skipped when a library is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

import nbutil  # noqa: E402
from versions import needs_torch  # noqa: E402

pytestmark = pytest.mark.libraries

SCRIPT = Path(__file__).resolve().parent / "scripts" / "libraries.py"
# What a notebook cell holds: the training functions, not the torchrun entry point.
TRAINING_CELL = SCRIPT.read_text().split('if __name__ == "__main__":')[0]

NEEDS = {"accelerate": "accelerate", "fabric": "lightning", "lightning": "lightning", "hf": "transformers"}


def _require(name: str) -> None:
    for module in NEEDS[name].split():
        pytest.importorskip(module, reason=f"{module} is not installed (pip install mpify_nb[test])")


def torchrun(name: str) -> list[dict]:
    """Rank results of ``torchrun --nproc-per-node 2 libraries.py name``, by rank."""
    return nbutil.torchrun_results(SCRIPT, name)


def _state_probe() -> str:
    """A cell printing what a call must leave as it was in the notebook."""
    return (
        "import logging, torch, sys\n"
        "def _singletons():\n"
        "    st = sys.modules.get('accelerate.state')\n"
        "    return None if st is None else [len(c._shared_state) for c in\n"
        "                                    (st.PartialState, st.AcceleratorState, st.GradientState)]\n"
        "print('STATE', json.dumps({'threads': torch.get_num_threads(),\n"
        "    'root': [type(h).__name__ for h in logging.root.handlers], 'level': logging.root.level,\n"
        "    'singletons': _singletons()}))\n"
    )


#: The module each run makes rank 1 import (and the template then preloads).
LIBRARY_MODULE = {"accelerate": "accelerate", "fabric": "lightning.fabric", "lightning": "lightning.pytorch",
                  "hf": "transformers.trainer"}


def _run_three_times(name: str, extra_cells: list[str] = ()) -> list:
    """The run three times in a kernel with preloading on (as by default): the first call from a
    template holding torch only, the next two from one that preloaded what rank 1 imported."""
    cells = nbutil.run_cells([
        "import json, os, sys, torch, mpify_nb\nfrom mpify_nb import ranch\ntorch.set_num_threads(2)\n"
        "mpify_nb.set_preload(True)\n"
        "def held(name):\n    return name in sys.modules\n",
        TRAINING_CELL,
        _state_probe(),
        *[f"print('RESULTS', json.dumps(ranch(2, train_{name})))\n" + _state_probe()
          + ("mpify_nb.start.template.wait_preloaded(300)\n" if call == 0 else "") for call in range(3)],
        f"print('HELD', json.dumps(ranch(2, held, {LIBRARY_MODULE[name]!r})))",
        *extra_cells,
    ], timeout=300)
    return cells


def _parse(cell, tag: str):
    for line in nbutil.stream_text(cell).splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"no {tag} line in: {nbutil.all_text(cell)[-3000:]}")


def _check(name: str, cells, expected: list[dict]) -> None:
    before = _parse(cells[2], "STATE")
    for call in range(3):
        cell = cells[3 + call]
        got = _parse(cell, "RESULTS")
        assert [r["rank"] for r in got] == [0, 1]
        for mine, theirs in zip(got, expected):
            assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6), (name, call)
            assert mine["weights"] == pytest.approx(theirs["weights"], rel=1e-5, abs=1e-6), (name, call)
        after = _parse(cell, "STATE")
        assert after["threads"] == before["threads"] == 2, (name, call, after)
        assert after["root"] == before["root"] and after["level"] == before["level"], (name, call, after)
        if after["singletons"] is not None:  # accelerate was imported: its state is empty again
            assert after["singletons"] == [0, 0, 0], (name, call, after)
    # Rank 1 found the library in its template: it did not import it again.
    assert _parse(cells[6], "HELD")[1] is True, nbutil.all_text(cells[6])


# notebook_launcher's agent listens on use_port (29500 by default): a free one, since 29500, the default
# of every torchrun, may be taken on a shared machine (CI once: EADDRINUSE in accelerate's rendezvous).
NOTEBOOK_LAUNCHER = (
    "import socket, tempfile\n"
    "from accelerate import notebook_launcher\n"
    "with socket.socket() as s:\n"
    "    s.bind(('127.0.0.1', 0)); free_port = s.getsockname()[1]\n"
    "def nl_probe(where):\n"
    "    from accelerate import Accelerator\n"
    "    a = Accelerator(cpu=True)\n"
    "    open(os.path.join(where, f'{a.process_index}-of-{a.num_processes}'), 'w').close()\n"
    "with tempfile.TemporaryDirectory() as where:\n"
    "    notebook_launcher(nl_probe, args=(where,), num_processes=2, use_port=str(free_port))\n"
    "    print('NL', json.dumps(sorted(os.listdir(where))))\n"
)


def _check_notebook_launcher(cell) -> None:
    assert _parse(cell, "NL") == ["0-of-2", "1-of-2"], nbutil.all_text(cell)


def test_accelerate_three_calls_then_notebook_launcher():
    _require("accelerate")
    expected = torchrun("accelerate")
    cells = _run_three_times("accelerate", [NOTEBOOK_LAUNCHER])
    _check("accelerate", cells, expected)
    _check_notebook_launcher(cells[-1])


def test_fabric_ddp_three_calls():
    _require("fabric")
    _check("fabric", _run_three_times("fabric"), torchrun("fabric"))


def test_lightning_trainer_ddp_three_calls():
    _require("lightning")
    _check("lightning", _run_three_times("lightning"), torchrun("lightning"))


@needs_torch((2, 6), "transformers 5 disables its PyTorch models below 2.6")
def test_hf_trainer_three_calls_then_notebook_launcher():
    _require("hf")
    _require("accelerate")
    expected = torchrun("hf")
    cells = _run_three_times("hf", [NOTEBOOK_LAUNCHER])
    _check("hf", cells, expected)
    _check_notebook_launcher(cells[-1])
