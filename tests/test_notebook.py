"""mpify_nb in a real Jupyter kernel (ipykernel driven by nbclient): what a notebook user sees.

Each test starts its own kernel (independent tests), runs cells in it, reads the cells'
outputs, and shuts the kernel down; ``nbutil`` fails the test if the kernel left any
process (template, rank) running.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from nbclient.exceptions import CellExecutionError  # noqa: E402

import nbutil  # noqa: E402  (conftest puts tests/ on sys.path)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_digits.ipynb"

# Cells start with this: what a notebook user would import.
PRELUDE = "import os, sys, time\nfrom mpify_nb import ranch, in_torchddp, RankError, RankRaisedError"


def _lines(text: str) -> list[str]:
    return text.splitlines()


# -- the example notebook ----------------------------------------------------------------

def test_example_notebook_is_saved_without_outputs():
    nb = nbformat.read(EXAMPLE, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the example has no code cells"
    assert all(c.outputs == [] and c.execution_count is None for c in code)


def test_example_notebook_trains_on_two_ranks():
    """The example notebook as a user runs it: with the warm-up between cells on (the default;
    conftest.py starts the other tests' kernels without it)."""
    nb = nbformat.read(EXAMPLE, as_version=4)
    nbutil.execute_notebook(nb, timeout=120, cwd=EXAMPLE.parent, env=dict(os.environ, MPIFY_NB_PREWARM="1"))
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not any(nbutil.errors(c) for c in code)
    text = "".join(nbutil.stream_text(c) for c in code)

    found = re.findall(r"test accuracy: ([0-9.]+)", text)
    assert found, f"no accuracy printed; outputs were:\n{text}"
    assert float(found[-1]) > 0.8

    # Both ranks trained: rank 1's per-epoch lines came back labelled, rank 0's not.
    assert re.search(r"\[rank 1\] epoch 0: loss [0-9.]+ on \d+ images", text), text
    assert re.search(r"(^|\n)epoch 0: loss [0-9.]+ on \d+ images", text), text
    # Each rank saw half the training set (the DistributedSampler split it).
    sizes = {int(n) for n in re.findall(r"on (\d+) images", text)}
    assert sizes == {674}, sizes
    nbutil.keep_executed_example(EXAMPLE, nb)  # the docs build renders it (no second run)


# -- notebook-defined code on the ranks --------------------------------------------------

def test_cell_defined_function_uses_notebook_imports_constants_and_helpers(notebook):
    cells = notebook([
        PRELUDE,
        "import numpy as np\nimport torch\nimport torch.distributed as dist\nSCALE = 3",
        "def helper(n):\n    return np.arange(n) * SCALE",
        # Uses np, SCALE and helper from other cells, torch.distributed from the prelude cell.
        "def work(n):\n"
        "    rank = int(os.environ['RANK'])\n"
        "    local = torch.from_numpy(helper(n) + rank)\n"
        "    total = local.clone()\n"
        "    dist.all_reduce(total)\n"
        "    return os.getpid(), rank, local.sum().item(), total.tolist()\n",
        "results = ranch(2, work, 4, ctx=in_torchddp())\n"
        "print(results)\n"
        "assert results[0][0] == os.getpid(), 'rank 0 is the kernel itself'\n"
        "assert results[1][0] != os.getpid(), 'rank 1 is another process'\n"
        "print('ranks', [r[1] for r in results])\n"
        "print('sums', [r[2] for r in results])\n"
        "print('reduced', [r[3] for r in results])\n"
        "print('executable', sys.executable)",
        # The launcher form returns rank 0's value.
        "print('launcher', in_torchddp(2, work, 2)[1:])",
    ])
    out = nbutil.stream_text(cells[4])
    assert "ranks [0, 1]" in out
    assert "sums [18, 22]" in out  # (0+3+6+9) + 4 * rank
    assert "reduced [[1, 7, 13, 19], [1, 7, 13, 19]]" in out  # [0, 3, 6, 9] + [1, 4, 7, 10], on both ranks
    import sys

    assert f"executable {sys.executable}" in out, "the kernel must run the project's interpreter"
    assert "launcher (0, 3, [1, 7])" in nbutil.stream_text(cells[5])


def test_imports_reach_the_callers_rank_too(notebook):
    cells = notebook([
        PRELUDE,
        "def uses_np():\n    return int(np.arange(4).sum()) + int(os.environ['RANK'])",
        "print(ranch(2, uses_np, imports='import numpy as np'))",
        "print(np.__name__)",  # as with mpify: the notebook keeps what imports= imported
    ])
    assert nbutil.stream_text(cells[2]) == "[6, 7]\n"
    assert nbutil.stream_text(cells[3]) == "numpy\n"


def test_lambda_closure_and_notebook_class_travel_both_ways(notebook):
    cells = notebook([
        PRELUDE,
        "class Point:\n"
        "    def __init__(self, x, y):\n"
        "        self.x, self.y = x, y\n"
        "    def norm2(self):\n"
        "        return self.x ** 2 + self.y ** 2\n"
        "    def __repr__(self):\n"
        "        return f'Point({self.x}, {self.y})'\n",
        "def make_shift(k):\n"
        "    def shift(p):  # a closure over k, taking and returning a notebook class\n"
        "        return Point(p.x + k, p.y + k * int(os.environ['RANK']))\n"
        "    return shift\n",
        # A closure as the function, an instance as the argument and as the return value.
        "moved = ranch(2, make_shift(10), Point(1, 2))\n"
        "print('moved', moved, [isinstance(p, Point) for p in moved], [type(p) is Point for p in moved])",
        # A lambda as the function.
        "print('lambda', ranch(2, lambda p: p.norm2() + int(os.environ['RANK']), Point(3, 4)))",
        # A lambda and a closure as arguments, a lambda as a return value.
        "def apply(f, g, p):\n"
        "    return g(f(p)), (lambda: p.norm2())\n"
        "pairs = ranch(2, apply, lambda p: Point(p.x + 1, p.y), make_shift(1), Point(1, 2))\n"
        "print('apply', [(q, later()) for q, later in pairs])\n",
        # The class still works with instances that came back.
        "print('norm', moved[1].norm2())",
    ])
    assert "moved [Point(11, 2), Point(11, 12)] [True, True] [True, True]" in nbutil.stream_text(cells[3])
    assert "lambda [25, 26]" in nbutil.stream_text(cells[4])
    # f: (1, 2) -> (2, 2); shift(1) on rank r: (3, 2 + r); the returned lambda: (1, 2).norm2()
    assert "apply [(Point(3, 2), 5), (Point(3, 3), 5)]" in nbutil.stream_text(cells[5])
    assert "norm 265" in nbutil.stream_text(cells[6])  # 11**2 + 12**2


# -- output ------------------------------------------------------------------------------

TALK = '''\
import ctypes

def talk():
    if int(os.environ["RANK"]) != 1:
        return "quiet"
    print("hello from one")
    print("part A, ", end="")
    sys.stdout.flush()
    time.sleep(0.2)  # the relay must hold the partial line, not send it alone
    print("part B", end="")
    print(" and the end")
    sys.stdout.flush()
    os.write(1, b"raw fd 1\\n")
    os.write(2, b"raw fd 2\\n")
    libc = ctypes.CDLL(None)
    libc.printf(b"printf from C\\n")
    libc.fflush(None)  # C stdio buffers fully when stdout is a pipe
    print("to stderr", file=sys.stderr)
    print("no newline at exit", end="")
    return "talked"
'''


def test_rank_output_appears_labelled_in_the_calling_cell(notebook):
    cells = notebook([
        PRELUDE,
        TALK,
        "print(ranch(2, talk))",
        "print('next cell')",
    ])
    # A partial line shown before its end ("part A, " waits 0.2 s) grows on a live display line
    # of its own, where its end completes it: in order with the stream lines around it.
    out = "".join(o.get("text", "") if o.get("output_type") == "stream" else o["data"]["text/plain"] + "\n"
                  for o in cells[2].outputs if o.get("name") != "stderr")
    err = nbutil.stream_text(cells[2], "stderr")
    assert _lines(out) == [
        "[rank 1] hello from one",
        "[rank 1] part A, part B and the end",
        "[rank 1] raw fd 1",
        "[rank 1] printf from C",
        "[rank 1] no newline at exit",  # the relay ends a partial line when the rank exits
        "['quiet', 'talked']",
    ], out
    assert _lines(err) == ["[rank 1] raw fd 2", "[rank 1] to stderr"], err
    # Nothing leaked into the next cell, nothing went missing in between.
    assert nbutil.stream_text(cells[3]) == "next cell\n"
    assert nbutil.stream_text(cells[3], "stderr") == ""


def test_lines_of_rank_0_and_rank_1_do_not_mix(notebook):
    # A barrier before each print makes both ranks print at the same moment, the worst case
    # (a DDP training loop does this: every rank prints its loss right after the same step).
    cells = notebook([
        PRELUDE,
        "import torch.distributed as dist\n"
        "def chatter(n):\n"
        "    rank = dist.get_rank()\n"
        "    for i in range(n):\n"
        "        dist.barrier()\n"
        "        print(f'rank {rank} line {i} ' + 'x' * 40)\n"
        "    return n\n",
        "print(ranch(2, chatter, 200, ctx=in_torchddp()))",
    ])
    lines = _lines(nbutil.stream_text(cells[2]))
    assert lines[-1] == "[200, 200]"
    expected = {f"rank 0 line {i} " + "x" * 40 for i in range(200)}
    expected |= {f"[rank 1] rank 1 line {i} " + "x" * 40 for i in range(200)}
    broken = [ln for ln in lines[:-1] if ln not in expected]
    assert not broken, f"{len(broken)} lines mixed up, e.g. {broken[:3]}"
    assert len(lines) == 401


def test_tqdm_progress_bar_renders_in_the_cell(notebook):
    cells = notebook([
        PRELUDE,
        "from tqdm import tqdm\n"
        "def loop(n, bar_on):\n"
        "    rank = int(os.environ['RANK'])\n"
        "    total = 0\n"
        "    for i in tqdm(range(n), desc=f'steps of rank {rank}', mininterval=0, disable=rank != bar_on):\n"
        "        total += i\n"
        "        time.sleep(0.002)\n"
        "    return total\n",
        "print(ranch(2, loop, 50, 0))",  # the usual idiom: a bar on rank 0 only
        "print(ranch(2, loop, 50, 1))",
    ])
    assert nbutil.stream_text(cells[2]) == "[1225, 1225]\n"
    # The caller's own bar (rank 0) is a live line too, as a rank's bar: a display redrawn in
    # place, left at its final state, unlabelled (it is the notebook's own output).
    assert "steps of rank" not in nbutil.stream_text(cells[2], "stderr")
    bars = [o["data"]["text/plain"] for o in cells[2].outputs if o.get("output_type") == "display_data"]
    assert len(bars) == 1 and re.fullmatch(r"steps of rank 0: 100%.*50/50.*", bars[0]), cells[2].outputs

    # A bar on rank 1: one live line of the cell (a display redrawn in place), labelled, left
    # at its final state; none of its redraws in the stream.
    assert nbutil.stream_text(cells[3]) == "[1225, 1225]\n"
    assert "rank 1" not in nbutil.stream_text(cells[3], "stderr")
    bars = [o["data"]["text/plain"] for o in cells[3].outputs if o.get("output_type") == "display_data"]
    assert len(bars) == 1, cells[3].outputs
    assert re.fullmatch(r"\[rank 1\] steps of rank 1: 100%.*50/50.*", bars[0]), bars


# -- errors ------------------------------------------------------------------------------

FAILS = '''\
def fails(x):
    if int(os.environ["RANK"]) == 1:
        raise ValueError(f"bad value {x} on purpose")
    return x
'''


def test_rank_error_fails_the_cell_with_the_remote_traceback(notebook):
    with pytest.raises(CellExecutionError) as info:
        notebook([PRELUDE, FAILS, "ranch(2, fails, 7)", "print('not reached')"])
    error = info.value
    assert error.ename == "RankRaisedError"
    text = nbutil.strip_ansi(str(error))
    assert "rank 1 raised ValueError: bad value 7 on purpose" in text
    # The user's own source line, from the cell (named as IPython names cells), and no
    # library frames above it.
    assert re.search(r"Cell In\[2\], line 3, in fails", text), text  # FAILS is the second cell: In [2]
    assert 'raise ValueError(f"bad value {x} on purpose")' in text
    assert "launcher/" not in text and "rank/loop.py" not in text


def test_a_warning_on_rank_1_shows_its_source_line(notebook):
    # A warning names the notebook cell's line, and Python prints that line under it: the
    # cell exists only in the kernel's linecache, so the rank had no line to print.
    cells = notebook([
        PRELUDE,
        "import warnings\n"
        "def warns():\n"
        "    warnings.warn('careful on rank ' + os.environ['RANK'])  # the source line\n"
        "    return 1\n",
        "print(ranch(2, warns))",
    ])
    err = nbutil.stream_text(cells[2], "stderr")
    lines = err.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("[rank 1] ") and "careful on rank 1" in ln)
    assert "UserWarning" in lines[at], err
    source = "warnings.warn('careful on rank ' + os.environ['RANK'])  # the source line"
    assert lines[at + 1] == f"[rank 1]   {source}", err


def test_kernel_keeps_working_after_a_rank_error(notebook):
    cells = notebook([
        PRELUDE,
        FAILS,
        "ranch(2, fails, 7)",
        "try:\n"
        "    ranch(2, fails, 8)\n"
        "except RankRaisedError as e:\n"
        "    print('caught', e.rank, e.exc_type, type(e.__cause__).__name__, e.__cause__)",
        "print(ranch(2, lambda: int(os.environ['RANK']) * 10))",
        "print(ranch(2, fails, 9, caller_rank=1))",  # now the kernel plays rank 1 and raises itself
        "print(in_torchddp(2, lambda: __import__('torch').distributed.get_world_size()))",
    ], allow_errors=True)
    (error,) = nbutil.errors(cells[2])
    assert error.ename == "RankRaisedError"
    text = nbutil.error_text(error)
    assert "rank 1 raised ValueError: bad value 7 on purpose" in text
    assert 'raise ValueError(f"bad value {x} on purpose")' in text

    assert nbutil.stream_text(cells[3]) == "caught 1 ValueError ValueError bad value 8 on purpose\n"
    assert not nbutil.errors(cells[4]) and nbutil.stream_text(cells[4]) == "[0, 10]\n"
    (own,) = nbutil.errors(cells[5])
    assert own.ename == "RankRaisedError"
    assert "rank 1 raised ValueError: bad value 9 on purpose" in nbutil.error_text(own)
    assert nbutil.stream_text(cells[6]) == "2\n"


# -- the harness itself ------------------------------------------------------------------

def test_leftover_check_finds_and_kills_tagged_processes():
    """The leak check behind every kernel test can fail: a tagged process is found and killed."""
    marker = f"selftest-{uuid.uuid4().hex}"  # unique: another session may run this test meanwhile
    env = dict(os.environ, **{nbutil.MARKER_VAR: marker})
    proc = subprocess.Popen(["sleep", "60"], env=env)
    try:
        # Until the child has exec'd, /proc/<pid>/environ still shows our own environment.
        deadline = time.monotonic() + 10
        while nbutil.leftover_processes(marker) != [proc.pid] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert nbutil.leftover_processes(marker) == [proc.pid]
        with pytest.raises(AssertionError, match="sleep 60"):
            nbutil.assert_no_leftovers(marker, grace=0.2)
        assert proc.wait(timeout=5) == -9
        assert nbutil.leftover_processes(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
