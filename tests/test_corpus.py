"""A corpus of notebook functions that use popular libraries, each shipped to 2 ranks (issue 27).

tests/scripts/corpus.py is pasted into a notebook cell, after the libraries were imported there,
so each of its ``c_*`` functions is a notebook function naming library functions, classes,
methods, metrics and fitted objects (torch, numpy, pandas, scikit-learn, transformers,
Lightning, torchmetrics, fastai and fastcore, timm-style model code). Every function must:

* ship: nothing walks a library's globals (fastai's metrics used to end in RecursionError);
* run on rank 1 as in the notebook: rank 1's value equals rank 0's (the notebook's own);
* do so alone (its own payload) as well as in one call with all the others.

Marked ``libraries`` (the imports take seconds); skipped when one of them is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
for _module in ("sklearn", "transformers", "lightning", "torchmetrics", "fastai", "pandas"):
    if importlib.util.find_spec(_module) is None:  # not imported here: the kernels import them
        pytest.skip(f"{_module} is not installed (pip install mpify_nb[test])", allow_module_level=True)

import nbutil  # noqa: E402

pytestmark = pytest.mark.libraries

CORPUS = (Path(__file__).resolve().parent / "scripts" / "corpus.py").read_text()


def _parse(cell, tag: str):
    for line in nbutil.stream_text(cell).splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"no {tag} line in: {nbutil.all_text(cell)[-3000:]}")


def test_every_corpus_function_ships_and_runs_alike_on_every_rank():
    cells = nbutil.run_cells([
        "import json, mpify_nb\nfrom mpify_nb import ranch, in_torchddp\nmpify_nb.set_preload(True)\n"
        "mpify_nb.set_rank_imports(True)  # on, as by default\n",
        CORPUS,
        "print('NAMES', json.dumps([f.__name__ for f in CORPUS]))",
        # All in one call (one payload)...
        "together = ranch(2, run_corpus, CORPUS, ctx=in_torchddp())\n"
        "print('TOGETHER', json.dumps(together))\n"
        "mpify_nb.start.template.wait_preloaded(300)\n",
        # ...and each alone, from a template that holds the libraries by now.
        "alone = {}\n"
        "for f in CORPUS:\n"
        "    try:\n"
        "        alone[f.__name__] = ranch(2, f, ctx=in_torchddp())\n"
        "    except Exception as e:\n"
        "        alone[f.__name__] = f'ERROR: {type(e).__name__}: {e}'[:2000]\n"
        "print('ALONE', json.dumps(alone))\n",
    ], timeout=600)
    names = _parse(cells[2], "NAMES")
    together = _parse(cells[3], "TOGETHER")
    failures = {}
    for name in names:
        on_0, on_1 = together[0][name], together[1][name]
        if isinstance(on_0, str) and on_0.startswith("ERROR"):
            failures[name] = f"rank 0 (the notebook) failed: {on_0}"
        elif on_1 != on_0:
            failures[name] = f"rank 1 gave {on_1!r}, the notebook {on_0!r}"
    alone = _parse(cells[4], "ALONE")
    for name in names:
        values = alone[name]
        if isinstance(values, str):
            failures[name + " (alone)"] = values
        elif values != [together[0][name]] * 2:
            failures[name + " (alone)"] = f"got {values!r}, the notebook {together[0][name]!r}"
    assert not failures, json.dumps(failures, indent=1)
    assert len(names) >= 29, names


def test_every_public_name_of_fastai_ships_in_a_notebook_function():
    """26 of fastai's exported names (accuracy, error_rate, mae, mse...) used to end in RecursionError.
    A notebook function naming every public name of tabular.all, callback.all and distributed ships,
    and on rank 1 each name is the very object the library holds there (checked by name)."""
    cells = nbutil.run_cells([
        "import json, sys, mpify_nb\nfrom mpify_nb import ranch\nmpify_nb.set_rank_imports(True)\n"
        "from fastai.tabular.all import *\nfrom fastai.callback.all import *\nfrom fastai.distributed import *\n"
        "import fastai.tabular.all as _t, fastai.callback.all as _c, fastai.distributed as _d\n",
        "NAMES = sorted({n for m in (_t, _c, _d) for n in dir(m) if not n.startswith('_') and n in globals()})\n"
        "exec('def uses_every_name():\\n    return [' + ', '.join(NAMES) + ']\\n')\n"
        "def check():\n"
        "    values = uses_every_name()\n"
        "    return len(values), sum(type(v).__name__ == 'function' for v in values)\n"
        "print('NOTEBOOK', json.dumps([len(NAMES), check()]))\n"
        "print('RANKS', json.dumps(ranch(2, check)))\n",
    ], timeout=400)
    count, mine = _parse(cells[1], "NOTEBOOK")
    assert count > 700, count
    assert _parse(cells[1], "RANKS") == [mine, mine]
