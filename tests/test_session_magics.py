"""Persistent ranks through the magics (%dist_init, automatic mode, %%rank, ...), in a real
Jupyter kernel (ipykernel) driven by nbclient, 2 ranks on CPU with gloo.

Kernel starts are slow here, so almost everything shares one kernel (``dist``), whose
ranks live for the whole module: each test uses its own variable names and leaves two
live ranks behind (a test that kills or stops ranks starts or restarts them again). The
example notebook gets a kernel of its own. The first tests need no kernel at all: where
a cell goes, and how its lines are cut.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jupyter_core.utils import run_sync  # noqa: E402

import nbutil  # noqa: E402
from mpify_nb.magics.auto import route, split_cell  # noqa: E402
from mpify_nb.magics.session import parse_ranks  # noqa: E402
from test_magics import Kernel as MagicsKernel  # noqa: E402
from test_magics import Ran, wait_for_output  # noqa: E402
from versions import (  # noqa: E402
    DDP_BACKWARD_WAIT,
    DTENSOR_MODULE,
    GLOO_RECORDER,
    GLOO_SIZE_MISMATCH,
    TORCH,
    needs_fsdp2_on_cpu,
)

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT = 120
LIBRARY_PATH = re.compile(r"mpify_nb/|site-packages|session\.py|interactiveshell\.py")


# -- where a cell goes (no kernel) -------------------------------------------------------------

@pytest.mark.parametrize("cell, automatic, where", [
    ("x = 1", True, "ranks"),
    ("x = 1", False, "kernel"),
    ("%dist_status", True, "kernel"),
    ("%pip list\n!ls\n# a comment\n", True, "kernel"),
    ("", True, "kernel"),
    ("# only a comment", True, "kernel"),
    ("%dist_push a\ny = a * 2", True, "ranks"),
    ("%time y = f()", True, "ranks"),  # timing magics time the code where it runs
    ("%timeit f()", True, "ranks"),
    ("%%time\nf()", True, "ranks"),
    ("%%capture out\nprint(1)", True, "kernel"),  # %%capture runs its body again: that goes to the ranks
    ("%%bash\nls", True, "kernel"),
    ("%%rank [0]\nx", True, "kernel"),
    ("%%distributed\nx", True, "kernel"),
    ("%%local\nx", True, "local"),
    ("%%local\nx", False, "local"),
    ("model?", True, "kernel"),
])
def test_where_a_cell_goes(cell, automatic, where):
    assert route(cell, automatic)[0] == where


def test_router_texts():
    assert route("x = 1\n", True)[1] == "%%distributed --auto\nx = 1\n"
    assert route("%%rank[0,1]\nx", False)[1] == "%%rank [0,1]\nx"  # nbdistributed's spelling
    assert route("%%local\nx\n", True)[1] == "#%%local\nx\n"  # line numbers kept


def test_split_cell_keeps_line_numbers_and_order():
    cell = "%dist_push a\nb = a * 2\nc = (1 +\n%2)\n%time d = f(b)\n!ls\nd\n"
    plan = split_cell(cell)
    kinds = [(p.kind, p.lineno) for p in plan.pieces]
    assert kinds == [("kernel", 1), ("ranks", 2), ("time", 5), ("kernel", 6), ("ranks", 7)]
    ranks = plan.pieces[1].source.splitlines()
    assert ranks[1:4] == ["b = a * 2", "c = (1 +", "%2)"]  # a modulo inside brackets is code
    assert plan.pieces[2].source.splitlines()[4] == "d = f(b)"
    assert plan.pieces[4].source.splitlines()[6] == "d"
    timeit = split_cell("%%timeit -n 3 -r 2 import math\nmath.sqrt(2)\n", 2).pieces
    assert [(p.kind, p.options, p.setup.strip(), p.lineno) for p in timeit] == [
        ("timeit", "-n 3 -r 2", "import math", 3)]


@pytest.mark.parametrize("spec, ranks", [
    ("[0]", [0]), ("[0,1]", [0, 1]), ("[0-2]", [0, 1, 2]), ("0, 2", [0, 2]), (" [1] ", [1]),
])
def test_parse_ranks(spec, ranks):
    assert parse_ranks(spec, 3) == ranks


@pytest.mark.parametrize("spec", ["", "[]", "[3]", "[a]", "[2-1]"])
def test_parse_ranks_rejects(spec):
    with pytest.raises(ValueError):
        parse_ranks(spec, 3)


def test_each_group_of_session_magics_is_a_magics_class_of_its_own_module():
    # One Magics class per group of magics, each from the module whose job it is, none mixed into
    # another (they share one SessionState instead): every magic, once.
    from IPython.core.magic import Magics

    from mpify_nb.magics.session import magics_classes

    where: dict[str, dict[str, str]] = {"line": {}, "cell": {}}
    for cls in magics_classes():
        assert cls.__bases__ == (Magics,), cls
        for kind, table in cls.magics.items():
            for name, method in table.items():
                assert name not in where[kind], name
                where[kind][name] = getattr(cls, method).__module__.rsplit(".", 1)[1]
    lifecycle = ["dist_debug", "dist_init", "dist_reset", "dist_restart", "dist_shutdown", "dist_status", "dist_where"]
    assert where == {
        "line": {**dict.fromkeys(lifecycle, "lifecycle"), **dict.fromkeys(["dist_pull", "dist_push", "sync"], "data"),
                 "dist_view": "views", "dist_mode": "router",
                 **dict.fromkeys(["dist_stop", "dist_wait"], "background")},
        "cell": dict.fromkeys(["distributed", "local", "rank"], "rank_cells"),
    }


# -- a kernel -----------------------------------------------------------------------------------

class Kernel(MagicsKernel):
    """A real ipykernel (this interpreter), one cell at a time through nbclient (``run``,
    ``ok``, ``interrupt`` as in test_magics). Its processes carry a marker, so :meth:`close`
    can check that none outlives it."""

    def __init__(self, cwd: Path):
        self.marker = uuid.uuid4().hex
        env = dict(os.environ, **{nbutil.MARKER_VAR: self.marker, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
        super().__init__(cwd, env=env, client_class=nbutil.StackTellingClient, marker=self.marker,
                         kernel_name=nbutil.KERNEL_NAME, kernel_manager_class=nbutil.VenvKernelManager)

    def fails(self, source: str, ename: str) -> Ran:
        ran = self.run(source)
        assert not ran.ok, f"cell should have failed: {source!r}\n{ran.outputs}"
        assert ran.reply["content"]["ename"] == ename, ran.outputs
        return ran

    def value(self, expression: str):
        """The kernel's own value of ``expression`` (a %%local cell), as Python."""
        import ast

        return ast.literal_eval(self.ok(f"%%local\nprint(repr({expression}))").stream("stdout").strip())

    def close(self) -> None:
        self._setup.__exit__(None, None, None)
        nbutil.assert_no_leftovers(self.marker)


def texts(ran: Ran) -> str:
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") + "\n" for o in ran.outputs)


def pids(kernel: Kernel) -> list[int]:
    return kernel.value("[r.pid for r in __import__('mpify_nb.magics.session').magics.session.session().status()]")


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    def make() -> Kernel:
        k = nbutil.ready(Kernel(tmp_path_factory.mktemp("dist")), "ok", ["%load_ext mpify_nb", "%dist_init -n 2"])
        k.init_output = nbutil.stream_text(k.nb.cells[-1])  # what %dist_init printed
        return k

    yield from nbutil.shared_kernel(make)  # a test that fails leaves the next a fresh kernel and ranks


# -- starting, automatic mode, where cells run ---------------------------------------------------

def test_init_starts_ranks_with_a_group_and_the_next_cell_reaches_every_rank(dist):
    assert re.search(r"2 ranks ready: rank 0 pid \d+ on cpu, rank 1 pid \d+ on cpu", dist.init_output)
    assert "Automatic mode on" in dist.init_output
    # The very first ordinary cell after %dist_init (nbdistributed lost it, 7 of 7 times).
    ran = dist.ok("(rank, world_size, str(device), dist.is_initialized(), dist.get_world_size(), torch.__name__)")
    assert ran.shown() == ["[rank 0] (0, 2, 'cpu', True, 2, 'torch')\n[rank 1] (1, 2, 'cpu', True, 2, 'torch')"]
    again = dist.run("%dist_init -n 2")
    assert not again.ok and "ranks are running already" in again.stream("stderr")


def test_ordinary_cells_run_on_every_rank_and_keep_their_state(dist):
    dist.ok("state_t = torch.tensor([rank + 1.0])\ndist.all_reduce(state_t)")
    ran = dist.ok("state_t * 2")
    assert ran.shown() == ["[rank 0] tensor([6.])\n[rank 1] tensor([6.])"]
    assert dist.value("'state_t' in globals()") is False  # the kernel is not a rank
    assert dist.ok("state_t.item();").shown() == []  # a trailing ';' hides the values


def test_local_cells_and_dist_mode(dist):
    dist.ok("%%local\nlocal_only = 5")
    assert dist.value("local_only") == 5
    dist.ok("%%local\nlocal_timed = %time local_only + 1")  # code a kernel magic runs stays local too
    assert dist.value("local_timed") == 6
    assert dist.fails("local_only_on_ranks", "RankRaisedError")
    assert "Automatic mode is on" in dist.ok("%dist_mode").stream()
    try:
        assert "off" in dist.ok("%dist_mode off").stream()
        off = dist.ok("import os\nos.getpid() == __import__('os').getpid(), 'kernel'")
        assert off.shown() == ["(True, 'kernel')"]  # an ordinary cell, in the kernel
        assert dist.ok("%%distributed\nrank").shown() == ["[rank 0] 0\n[rank 1] 1"]
        dist.ok("%dist_mode --enable")  # nbdistributed's spelling
        assert dist.ok("rank").shown() == ["[rank 0] 0\n[rank 1] 1"]
    finally:
        dist.ok("%dist_mode on")


def test_a_frontends_silent_request_stays_in_the_kernel(dist):
    # Variable explorers and editors send silent execute requests: never to the ranks.
    reply = run_sync(dist.client.kc.execute_interactive)("silent_probe = 'kernel'", silent=True, timeout=60)
    assert reply["content"]["status"] == "ok", reply
    assert dist.value("silent_probe") == "kernel"
    note = dist.ok("silent_probe").stream()  # the ranks never ran it: they lack the name, and get it now
    assert note.startswith("[mpify_nb] sent from the notebook to rank 0, 1: silent_probe"), note


def test_rank_cells(dist):
    assert dist.ok("%%rank [0]\nonly_zero = 'zero'\nrank").shown() == ["[rank 0] 0"]
    assert dist.ok("%%rank[1]\nrank").shown() == ["[rank 1] 1"]
    assert dist.ok("%%rank [0-1]\nrank").shown() == ["[rank 0] 0\n[rank 1] 1"]
    assert dist.ok("%%rank [0]\nonly_zero").shown() == ["[rank 0] 'zero'"]
    bad = dist.run("%%rank [2]\nrank")
    assert not bad.ok and "rank 2 does not exist (ranks are 0..1)" in bad.stream("stderr")


def test_distributed_to_both_runs_in_the_kernel_first(dist):
    ran = dist.ok("%%distributed --to both\ndef both_sq(v):\n    return v * v\nboth_sq(3)")
    assert ran.shown() == ["[kernel] 9", "[rank 0] 9\n[rank 1] 9"]
    assert dist.value("both_sq(4)") == 16
    assert dist.ok("both_sq(rank + 2)").shown() == ["[rank 0] 4\n[rank 1] 9"]
    error = dist.fails("%%distributed --to both\nboth_x = 1\nundefined_in_kernel", "NameError")
    text = error.error_text()
    assert "[kernel]" in text and re.search(rf"Cell In\[{error.cell.execution_count}\], line 3", text), text
    assert dist.ok("'both_x' in globals()").shown() == ["[rank 0] False\n[rank 1] False"]  # ranks never ran it


# -- names flow from the notebook ---------------------------------------------------------------

def test_notebook_names_a_rank_lacks_are_shipped_never_overwriting_a_rank(dist):
    dist.ok("%%local\nimport math as flow_math\nflow_scale = 10\n"
            "def flow_helper(v):\n    return v * flow_scale\n"
            "class FlowPoint:\n    def __init__(self, x):\n        self.x = x\n"
            "    def __repr__(self):\n        return f'FlowPoint({self.x})'")
    before = dist.value("sorted(k for k in globals() if not k.startswith('_'))")
    dist.ok("flow_scale = 3")  # the ranks' own flow_scale
    ran = dist.ok("FlowPoint(flow_helper(rank + 1)), flow_math.floor(2.5), flow_scale")
    note = ran.stream("stdout")
    assert note.count("\n") == 1 and note.startswith("[mpify_nb] sent from the notebook to rank 0, 1: ")
    assert set(note.split(": ", 1)[1].strip().split(", ")) == {"FlowPoint", "flow_helper", "flow_math"}
    # flow_helper reads the notebook's flow_scale, which travels with it; the ranks' stays theirs.
    assert ran.shown() == ["[rank 0] (FlowPoint(10), 2, 3)\n[rank 1] (FlowPoint(20), 2, 3)"]
    assert "sent" not in dist.ok("flow_helper(1)").stream()  # they have it now: nothing sent
    # Nothing was written into the notebook's namespace (no stand-ins for rank variables).
    after = dist.value("sorted(k for k in globals() if not k.startswith('_'))")
    assert after == before
    assert dist.value("flow_scale") == 10


def test_an_unpicklable_notebook_value_gives_a_clean_error(dist):
    dist.ok("%%local\nflow_gen = (i for i in range(3))")
    ran = dist.run("next(flow_gen)")
    assert not ran.ok
    text = ran.error_text()
    assert "'flow_gen' (generator)" in text and "rank 0, 1 lacks" in text, text


# -- output --------------------------------------------------------------------------------------

def test_output_is_labelled_keeps_partial_lines_whitespace_and_stderr(dist):
    ran = dist.ok("import sys\nprint('out', rank, end='')\nprint('!')\nprint('   ')\n"
                  "print('err', rank, file=sys.stderr)")
    out, err = ran.stream("stdout"), ran.stream("stderr")
    for r in (0, 1):  # (a partial line that waited 0.1 s for its end is a display line of its own)
        assert f"[rank {r}] out {r}!\n" in texts(ran), ran.outputs
        assert f"[rank {r}]    \n" in out, out
        assert f"[rank {r}] err {r}\n" in err and "err" not in out, (out, err)


def test_output_is_live(dist, tmp_path):
    go = tmp_path / "go"
    source = ("import os, time\nprint('waiting', flush=True)\ndeadline = time.monotonic() + 60\n"
              f"while not os.path.exists({str(go)!r}):\n"
              "    assert time.monotonic() < deadline, 'the first line never reached the notebook'\n"
              "    time.sleep(0.02)\n'done'")
    ran = dist.run(source, during=lambda cell: (wait_for_output(cell, r"\[rank 1\] waiting"), go.touch()))
    assert ran.ok, ran.outputs


def test_no_output_leaks_into_the_next_cell(dist):
    dist.ok("import threading, time\n"
            "def leak_later():\n    time.sleep(1.0)\n    print('late line', rank, flush=True)\n"
            "threading.Thread(target=leak_later).start()\nprint('tail', end='')")
    nxt = dist.ok("'next'")  # done well within the second (a line printed while it runs is its own)
    assert "late" not in texts(nxt) and "tail" not in texts(nxt), nxt.outputs
    time.sleep(1.2)
    later = dist.ok("'later'")
    assert "tail" not in texts(later), later.outputs


def test_rich_display_from_ranks_is_labelled(dist):
    ran = dist.ok("from IPython.display import HTML\n"
                  "class RichRank:\n    def _repr_html_(self):\n        return f'<b>rank {rank}</b>'\n"
                  "display(HTML('<i>hi</i>'))\nRichRank()")
    html = ran.shown("text/html")
    assert any("[rank 0]" in h and "<i>hi</i>" in h for h in html), ran.outputs
    assert any("[rank 1]" in h and "<i>hi</i>" in h for h in html), ran.outputs
    assert "<b>rank 0</b>" in html and "<b>rank 1</b>" in html, html  # the values, each under its label
    assert "[rank 0]" in ran.shown() and "[rank 1]" in ran.shown()


def test_ipython_display_and_matplotlib_figures_from_ranks(dist):
    ran = dist.ok("from IPython.display import display, Markdown\ndisplay(Markdown(f'**rank {rank}**'))")
    assert sorted(ran.shown("text/markdown")) == ["**rank 0**", "**rank 1**"], ran.outputs
    ran = dist.ok("import matplotlib.pyplot as plt\nplt.plot([0, rank + 1])\nplt.show()")
    shown = [o for o in ran.outputs if o.output_type == "display_data"]
    images = [o for o in shown if "image/png" in o.data]
    labels = sorted(o.data["text/plain"] for o in shown if "image/png" not in o.data)
    assert len(images) == 2 and labels == ["[rank 0]", "[rank 1]"], ran.outputs
    ran = dist.ok("fig_value = plt.figure()\nplt.plot([1, 2])\nfig_value")  # a figure as the value
    assert len([o for o in ran.outputs if "image/png" in o.get("data", {})]) == 2, ran.outputs  # not 4


def test_no_javascript_outputs_ever(dist):
    for cell in dist.nb.cells:
        for o in cell.get("outputs", []):
            assert "application/javascript" not in o.get("data", {}), o


# -- timing and capture magics ------------------------------------------------------------------

def test_time_and_timeit_measure_on_the_ranks(dist):
    ran = dist.ok("%time timed = rank * 2")
    out = ran.stream("stdout")
    for r in (0, 1):  # each rank's lines in order (the ranks' lines may interleave)
        mine = [line for line in out.splitlines() if line.startswith(f"[rank {r}] ")]
        assert len(mine) == 2 and re.fullmatch(rf"\[rank {r}\] CPU times: user .+, sys: .+, total: .+", mine[0]) \
            and re.fullmatch(rf"\[rank {r}\] Wall time: .+", mine[1]), out
    assert dist.ok("timed").shown() == ["[rank 0] 0\n[rank 1] 2"]  # %time assigned on the ranks
    ran = dist.ok("%timeit -n 3 -r 2 timed + 1")
    lines = ran.stream("stdout").splitlines()
    assert len(lines) == 2 and all(re.fullmatch(
        rf"\[rank {r}\] .* per loop \(mean ± std. dev. of 2 runs, 3 loops each\)", line)
        for r, line in enumerate(lines)), lines
    # A collective in %timeit: every rank loops as many times (the kernel picks the count).
    ran = dist.ok("timed_t = torch.ones(1)\n%timeit -r 2 dist.all_reduce(timed_t)")
    assert ran.stream("stdout").count("per loop") == 2
    ran = dist.ok("timed_v = %time rank + 5\nres = %timeit -o -n 2 -r 2 timed_v * 2")
    assert ran.stream("stdout").count("Wall time") == 2 and ran.stream("stdout").count("per loop") == 2
    assert dist.ok("timed_v").shown() == ["[rank 0] 5\n[rank 1] 6"]  # assigned on the ranks
    assert dist.value("sorted(res)") == [0, 1]  # the results, by rank, in the notebook
    assert dist.value("res[1].loops") == 2
    ran = dist.ok("%%timeit -n 2 -r 3 timed_setup = 1\ntimed_setup + rank")
    assert ran.stream("stdout").count("(mean ± std. dev. of 3 runs, 2 loops each)") == 2, ran.outputs
    ran = dist.ok("%%time\ntimed_cell = timed + 1\ntimed_cell")
    assert "[rank 1] Wall time" in ran.stream("stdout") and ran.shown() == ["[rank 0] 1\n[rank 1] 3"]


def test_what_ranks_run_for_a_cell_never_imports_the_magics(dist):
    # %time, %timeit and %sync send functions to the ranks, by reference: they live below the
    # process boundary (rank/cells.py), so a rank imports nothing of magics/ (nor IPython for it).
    dist.ok("%time below_boundary = rank\n%timeit -n 1 -r 1 below_boundary")
    dist.ok("%sync")
    ran = dist.ok("import sys\nsorted(m for m in sys.modules if m.startswith('mpify_nb.magics'))")
    assert ran.shown() == ["[rank 0] []\n[rank 1] []"]


def test_magic_lines_in_a_rank_cell_run_in_the_kernel_in_their_turn(dist):
    dist.ok("%%local\norder_src = 41")
    ran = dist.ok("%dist_push order_src\norder_dst = order_src + rank\n%dist_pull order_dst --rank 1\n"
                  "order_dst * 10")
    assert "sent from the notebook" not in ran.stream()  # pushed on purpose, before the code ran
    assert ran.shown() == ["[rank 0] 410\n[rank 1] 420"]
    assert dist.value("order_dst") == 42


def test_capture_captures_the_ranks_output(dist):
    assert dist.ok("%%capture captured\nprint('into capture', rank)").outputs == []
    text = dist.value("captured.stdout")
    assert "[rank 0] into capture 0" in text and "[rank 1] into capture 1" in text


def test_push_and_pull(dist):
    dist.ok("%%local\nimport torch\npushed_big = torch.arange(16 * 2**20, dtype=torch.float32)\n"
            "pushed_cfg = {'lr': 0.1}")
    ran = dist.ok("%dist_push pushed_big pushed_cfg")
    assert "Sent pushed_big, pushed_cfg to ranks 0, 1." in ran.stream()
    assert dist.ok("float(pushed_big[-1]), pushed_cfg['lr'] * (rank + 1)").shown() == [
        f"[rank 0] ({16 * 2**20 - 1.0}, 0.1)\n[rank 1] ({16 * 2**20 - 1.0}, 0.2)"]
    dist.ok("pulled = torch.full((2,), float(rank))")
    dist.ok("%dist_pull pulled --rank 1")
    assert dist.value("pulled.tolist()") == [1.0, 1.0]
    dist.ok("%dist_pull pulled --all")
    assert dist.value("[t.tolist() for t in pulled]") == [[0.0, 0.0], [1.0, 1.0]]
    missing = dist.run("%dist_pull never_defined_anywhere")
    assert not missing.ok and "name 'never_defined_anywhere' is not defined on rank 0" in missing.error_text()


def test_pull_brings_the_real_value_or_fails_leaving_the_notebooks_name_alone(dist):
    # Before: %dist_pull of a generator put a RemoteRepr (a text stand-in) into the notebook's
    # name, and a datetime64 array of 1 MiB or more could not come back at all.
    dist.ok("%%local\npulled_gen = 'the notebook keeps this'")
    dist.ok("pulled_gen = (i for i in range(3))\n"
            "import numpy as np\npulled_hours = np.arange(200_000).astype('datetime64[h]').astype('M8[ns]')")
    ran = dist.fails("%dist_pull pulled_gen", "PayloadError")
    text = ran.error_text()
    assert text.startswith("PayloadError: cannot pull 'pulled_gen' from rank 0") and "generator" in text, text
    assert dist.value("pulled_gen") == "the notebook keeps this"
    dist.ok("%dist_pull pulled_hours --rank 1")
    assert dist.value("(str(pulled_hours.dtype), str(pulled_hours[-1]))") == (
        "datetime64[ns]", "1992-10-25T07:00:00.000000000")


def test_status_and_sync(dist):
    ran = dist.ok("%dist_status")
    [bundle] = [o.data for o in ran.outputs if o.output_type == "display_data"]
    assert "<table>" in bundle["text/html"] and "idle" in bundle["text/html"]
    text = bundle["text/plain"]
    assert re.search(r"^0\s+\d+\s+idle\s+cpu\s+[\d.]+ MB", text, re.M) and re.search(r"^1\s+\d+\s+idle", text, re.M)
    assert "in sync" in dist.ok("%sync").stream()


# -- errors -------------------------------------------------------------------------------------

def test_a_rank_error_fails_the_cell_with_the_cell_line_and_state_is_kept(dist):
    dist.ok("err_keep = rank * 10")
    ran = dist.fails("err_a = 1\nif rank == 1:\n    raise ValueError('boom on ' + str(rank))\nerr_a", "RankRaisedError")
    text = ran.error_text()
    assert "rank 1 raised ValueError: boom on 1" in text
    # The cell's own number, as its prompt shows it (In [n]): IPython 9 counts the cell before running it.
    assert re.search(rf"Cell In\[{ran.cell.execution_count}\], line 3, in <module>\n"
                     r"\s+raise ValueError\('boom on ' \+ str\(rank\)\)", text), text
    assert not LIBRARY_PATH.search(text), text
    assert dist.ok("err_keep, err_a").shown() == ["[rank 0] (0, 1)\n[rank 1] (10, 1)"]


def test_identical_errors_are_shown_once_with_the_ranks(dist):
    ran = dist.fails("%%rank [0,1]\n1 / 0", "RankRaisedError")
    text = ran.error_text()
    assert "ranks [0, 1] raised ZeroDivisionError: division by zero" in text
    assert text.count("Traceback") == 1 and "rank 0 raised" not in text and "rank 1 raised" not in text
    assert re.search(rf"Cell In\[{ran.cell.execution_count}\], line 2, in <module>\n\s+1 / 0", text), text


def test_a_syntax_error_points_at_the_cell_line(dist):
    ran = dist.run("fine = 1\nbad = (")
    assert not ran.ok
    text = ran.error_text()
    assert re.search(rf"Cell In\[{ran.cell.execution_count}\], line 2\n\s+bad = \(", text), text
    assert "SyntaxError" in text, text


def test_a_collective_not_every_rank_joins_ends_with_an_error_and_the_group_is_rebuilt(dist):
    dist.ok("coll_t = torch.ones(1)\ncoll_keep = rank + 100")
    ran = dist.fails("%%rank [0]\ndist.all_reduce(coll_t)", "CollectiveError")
    # The type leads, as in every error a cell shows (it is what `except` names).
    n = ran.cell.execution_count
    assert ran.error_text().startswith(f"CollectiveError: rank 0 was left waiting in dist.all_reduce (rank 0 at "
                                       f"Cell In[{n}], line 2), which rank 1 never joined;"), ran.error_text()
    ran = dist.fails("if rank == 1:\n    raise RuntimeError('early')\ndist.all_reduce(coll_t)", "CollectiveError")
    assert "rank 1 raised RuntimeError: early" in ran.error_text()
    ran = dist.ok("dist.all_reduce(coll_t)\ncoll_t.item(), coll_keep")
    assert ran.shown() == ["[rank 0] (2.0, 100)\n[rank 1] (2.0, 101)"]


# Issue 18: every way torch waits on a process group ends the cell when a peer cannot come.
# Rank 0 alone (%%rank [0]) waits on a collective that rank 1, idle, never issues; no Python
# frame of rank 0 is in distributed_c10d.py for any of these (before: the cell hung). With
# gloo's flight recorder (torch >= 2.8) the collective is named; before, what the stack shows
# (torchdist/hidden_waits.py: the torch call that waits, or the function it waits in).
HIDDEN_WAITS = {
    "async_work": ("", "hid_t = torch.ones(2)\nhid_w = dist.all_reduce(hid_t, async_op=True)\nhid_w.wait()",
                   "dist.all_reduce", 3),
    "functional": ("import torch.distributed._functional_collectives as funcol",
                   "hid_f = funcol.all_reduce(torch.ones(2), 'sum', dist.group.WORLD)\nhid_f.sum().item()",
                   "dist.all_reduce" if GLOO_RECORDER else "torch.distributed._functional_collectives.wait_tensor",
                   2),
    "dtensor": ("from torch.distributed.device_mesh import init_device_mesh\n"
                f"from {DTENSOR_MODULE} import distribute_tensor, Shard\n"
                "hid_mesh = init_device_mesh('cpu', (2,))\n"
                "hid_d = distribute_tensor(torch.arange(8.0), hid_mesh, [Shard(0)])",
                "hid_full = hid_d.full_tensor()", "dist.all_gather" if GLOO_RECORDER else "DTensor.full_tensor", 1),
    "pipeline": ("from torch.distributed.pipelining import PipelineStage, ScheduleGPipe\n"
                 # torch < 2.6 does not infer the stages' shapes: a microbatch of 2 rows, given
                 "hid_stage = PipelineStage(torch.nn.Linear(4, 4), rank, 2, torch.device('cpu')"
                 + (")\n" if TORCH >= (2, 6) else ", input_args=torch.ones(2, 4))\n") +
                 "hid_sched = ScheduleGPipe(hid_stage, 2)\n"
                 "hid_sched.step(torch.ones(4, 4)) if rank == 0 else hid_sched.step()",
                 "hid_sched.step(torch.ones(4, 4))", "Work.wait() of a send", 1),
    "fsdp2_forward": ("from torch.distributed.device_mesh import init_device_mesh\n"
                      "from torch.distributed.fsdp import fully_shard\ntorch.manual_seed(0)\n"
                      "hid_net = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)),\n"
                      "                     mesh=init_device_mesh('cpu', (2,)))",
                      "hid_out = hid_net(torch.ones(2, 4))", "dist.all_gather", 1),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=needs_fsdp2_on_cpu) if c == "fsdp2_forward" else c
                                  for c in sorted(HIDDEN_WAITS)])
def test_a_hidden_wait_for_an_idle_rank_ends_the_cell_and_the_group_works_again(dist, case):
    setup, cell, op, line = HIDDEN_WAITS[case]
    dist.ok(f"hid_keep = rank + 10\n{setup}")
    started = time.monotonic()
    # The waits as gloo holds them, the collective check off: on, a call made through torch.distributed
    # (an async all_reduce, FSDP2's all-gather, gloo's functional all_reduce) waits in the check at the
    # call itself (tests/test_collective_checks.py), before any of these.
    dist.ok("%%local\nfrom mpify_nb import set_collective_checks\nset_collective_checks(False)")
    try:
        ran = dist.fails(f"%%rank [0]\n{cell}", "CollectiveError")
    finally:
        dist.ok("%%local\nset_collective_checks(True)")
    took = time.monotonic() - started
    text = ran.error_text()
    number = ran.cell.execution_count
    assert f"rank 0 was left waiting in {op} (rank 0 at Cell In[{number}], line {line + 1}), " \
           "which rank 1 never joined; the process group was rebuilt" in text, text
    assert took < 15, took  # ~0.4 s; before: hung until the stop button
    ran = dist.ok("hid_t2 = torch.ones(1)\ndist.all_reduce(hid_t2)\nhid_t2.item(), hid_keep")
    assert ran.shown() == ["[rank 0] (2.0, 10)\n[rank 1] (2.0, 11)"]


def test_a_rank_that_raises_beside_a_ddp_backward_ends_the_cell_with_its_own_error(dist):
    """The issue's first story: rank 1 raises while rank 0 waits in DDP's gradient
    all_reduce, on autograd's threads. The cell ends by itself, rank 1's ValueError first."""
    dist.ok("from torch.nn.parallel import DistributedDataParallel as DDP\nddp_keep = rank")
    started = time.monotonic()
    ran = dist.fails("ddp_net = DDP(torch.nn.Linear(2, 1))\nddp_out = ddp_net(torch.ones(1, 2)).sum()\n"
                     "if rank == 1:\n    raise ValueError('boom on rank 1')\nddp_out.backward()", "CollectiveError")
    assert time.monotonic() - started < 15
    text = ran.error_text()
    number = ran.cell.execution_count
    assert text.index("rank 1 raised ValueError: boom on rank 1") < text.index("Meanwhile rank 0 was left waiting")
    assert re.search(rf"Cell In\[{number}\], line 4, in <module>\n\s+raise ValueError\('boom on rank 1'\)", text)
    assert f"rank 0 was left waiting in {DDP_BACKWARD_WAIT} (rank 0 at Cell In[{number}], line 5), which rank 1 " \
           "never joined" in text, text
    ran = dist.ok("ddp_net = DDP(torch.nn.Linear(2, 1))\nddp_net(torch.ones(1, 2)).sum().backward()\n"
                  "ddp_net.module.bias.grad.item(), ddp_keep")
    assert ran.shown() == ["[rank 0] (1.0, 0)\n[rank 1] (1.0, 1)"]


def test_an_anomaly_raised_in_one_ranks_backward_ends_the_cell(dist):
    """Anomaly mode raises inside rank 1's backward (a NaN gradient), while rank 0's
    backward waits for rank 1's gradients. (Rank 0's root is of a positive number: with the
    weights torch 2.4 draws, a bare sum was negative, and rank 0 raised too.)"""
    ran = dist.fails("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                     "an_net = DDP(torch.nn.Linear(2, 1))\n"
                     "an_x = torch.tensor([[0.0, 1.0]]) if rank == 1 else torch.ones(1, 2)\n"
                     "with torch.autograd.detect_anomaly(check_nan=True):\n"
                     "    an_net(an_x.sqrt() * 0 + an_x).sum().abs().add(1).pow(0.5).mul(0).add(an_x.sqrt().sum() * 0)"
                     ".backward() if rank == 0 else (an_net(an_x).sum() * an_x.sqrt().pow(-1).sum()).backward()",
                     "CollectiveError")
    text = ran.error_text()
    assert "rank 1 raised RuntimeError: Function" in text and "returned nan values" in text, text
    assert f"Meanwhile rank 0 was left waiting in {DDP_BACKWARD_WAIT}" in text, text


def test_a_rank_that_computes_long_is_waited_for(dist):
    """No false alarm: rank 0 waits in all_reduce for 3 s while rank 1 computes; nothing is
    wrong, so the cell just takes that long."""
    ran = dist.ok("import time\nslow_t = torch.ones(1)\nif rank == 1:\n    time.sleep(3)\n"
                  "dist.all_reduce(slow_t)\nslow_t.item()")
    assert ran.shown() == ["[rank 0] 2.0\n[rank 1] 2.0"]


def test_ranks_that_raise_different_errors_show_each_with_its_ranks(dist):
    # Rank 0 raises first: its error is the cell's; rank 1's follows, with its own traceback.
    ran = dist.fails("import time\nif rank == 1:\n    time.sleep(0.3)\n    raise KeyError('late on 1')\n"
                     "raise ValueError('first on 0')", "RankRaisedError")
    n = ran.cell.execution_count
    assert ran.error_text() == (
        "RankRaisedError: rank 0 raised ValueError: first on 0\n\n"
        "--- traceback from rank 0 ---\n"
        "Traceback (most recent call last):\n"
        f"  Cell In[{n}], line 5, in <module>\n"
        "    raise ValueError('first on 0')\n"
        "ValueError: first on 0\n\n"
        "rank 1 raised KeyError: 'late on 1'\n\n"
        "--- traceback from rank 1 ---\n"
        "Traceback (most recent call last):\n"
        f"  Cell In[{n}], line 4, in <module>\n"
        "    raise KeyError('late on 1')\n"
        "KeyError: 'late on 1'")


def test_a_rank_that_a_collective_aborts_says_how_to_recover(dist):
    dist.ok("abort_keep = rank + 200")
    # Rank 0 sends 2 floats where rank 1 expects 1: gloo aborts rank 1 (SIGABRT), its message on stderr
    # (with the collective check off: on, the ranks refuse the call before either enters it).
    dist.ok("%%local\nfrom mpify_nb import set_collective_checks\nset_collective_checks(False)")
    try:
        ran = dist.fails("dist.all_gather([torch.zeros(2 - rank) for _ in range(2)], torch.ones(2 - rank))",
                         "RankExitedError")
    finally:
        dist.ok("%%local\nset_collective_checks(True)")
    assert any(wording in ran.stream("stderr") for wording in GLOO_SIZE_MISMATCH), ran.outputs
    shown = ("RankExitedError: rank 1 was killed by SIGABRT (an abort in C++ code, e.g. gloo's check that a "
             "collective's tensors match: the rank printed why on its stderr)\n"
             "Its Python state is lost; %dist_restart starts a fresh rank 1 and rebuilds the group "
             "(the other ranks keep their state).")
    assert ran.error_text() == shown
    assert dist.fails("abort_keep", "RankExitedError").error_text() == shown  # every cell, until restarted
    assert "Restarted rank 1" in dist.ok("%dist_restart").stream()
    assert dist.ok("%%rank [0]\nabort_keep").shown() == ["[rank 0] 200"]
    ran = dist.ok("abort_t = torch.ones(1)\ndist.all_reduce(abort_t)\nabort_t.item()")
    assert ran.shown() == ["[rank 0] 2.0\n[rank 1] 2.0"]


def interrupt_when(kernel: Kernel, pattern: str) -> Callable:
    def press_stop(cell):
        try:
            wait_for_output(cell, pattern)
            time.sleep(0.2)
        finally:
            kernel.interrupt()
    return press_stop


def test_interrupt_stops_every_rank_and_keeps_state(dist):
    dist.ok("intr_keep = rank + 1")
    ran = dist.run("import time\nprint('sleeping', flush=True)\ntime.sleep(30)",
                   during=interrupt_when(dist, r"\[rank 0\] sleeping.*\[rank 1\] sleeping|"
                                               r"\[rank 1\] sleeping.*\[rank 0\] sleeping"))
    assert not ran.ok and ran.reply["content"]["ename"] == "KeyboardInterrupt"
    assert ran.error.ename == "KeyboardInterrupt" and "keeps its state" in ran.error_text()
    assert dist.ok("intr_keep").shown() == ["[rank 0] 1\n[rank 1] 2"]


def test_interrupt_during_a_hung_all_reduce(dist):
    # Rank 0 waits in all_reduce while rank 1 is busy (not idle): only the stop button ends it.
    dist.ok("hung_t = torch.ones(1)")
    ran = dist.run("import time\nprint('in', flush=True)\nif rank == 0:\n    dist.all_reduce(hung_t)\n"
                   "else:\n    time.sleep(30)", during=interrupt_when(dist, r"\[rank 1\] in"))
    assert ran.reply["content"]["ename"] == "KeyboardInterrupt", ran.outputs
    # %%rank [0] all_reduce: hung for good (rank 1 never comes); it ends on its own or by the button.
    ran = dist.run("%%rank [0]\nprint('in', flush=True)\ndist.all_reduce(hung_t)",
                   during=interrupt_when(dist, r"\[rank 0\] in"))
    assert ran.reply["content"]["ename"] in ("KeyboardInterrupt", "CollectiveError"), ran.outputs
    ran = dist.ok("dist.all_reduce(hung_t)\nhung_t.item()")
    assert ran.shown() == ["[rank 0] 2.0\n[rank 1] 2.0"]


def test_a_killed_rank_fails_the_cell_shows_dead_and_restarts(dist):
    dist.ok("kill_keep = 'kept'")
    before = pids(dist)
    ran = dist.fails("%%rank [1]\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "RankExitedError")
    assert "rank 1" in ran.error_text() and "SIGKILL" in ran.error_text()
    nxt = dist.fails("kill_keep", "RankExitedError")  # the next cell fails at once too
    assert "rank 1" in nxt.error_text()
    status = dist.ok("%dist_status").shown()[0]
    assert re.search(r"^1\s+\d+\s+dead", status, re.M), status
    ran = dist.ok("%dist_restart")
    assert "Restarted rank 1" in ran.stream()
    after = pids(dist)
    assert after[0] == before[0] and after[1] != before[1]
    assert dist.ok("%%rank [0]\nkill_keep").shown() == ["[rank 0] 'kept'"]
    ran = dist.ok("kill_t = torch.ones(1)\ndist.all_reduce(kill_t)\nkill_t.item()")
    assert ran.shown() == ["[rank 0] 2.0\n[rank 1] 2.0"]
    # A named rank is replaced even though it is alive.
    dist.ok("%dist_restart 0")
    assert pids(dist)[0] != before[0]


def press_until_it_stops(kernel: Kernel, pattern: str, presses: list[float], every: float = 10.0,
                         most: int = 5) -> Callable:
    """Press the stop button once ``pattern`` shows, and again every ``every`` s while the cell shows
    no error yet (``most`` presses in all); ``presses`` gets each press's time."""
    def press_stop(cell):
        wait_for_output(cell, pattern)
        time.sleep(0.2)
        while len(presses) < most and not any(o.get("output_type") == "error" for o in list(cell.outputs)):
            presses.append(time.monotonic())
            kernel.interrupt()
            deadline = time.monotonic() + every
            while time.monotonic() < deadline and not any(o.get("output_type") == "error" for o in list(cell.outputs)):
                time.sleep(0.05)
    return press_stop


def test_a_press_in_the_cell_after_a_stopped_one_is_its_own(dist):
    """Presses within 0.5 s of a stop repeat it and change nothing, within its cell: the next cell's
    first press stops that cell. (The stop-during-restart test below pressed 0.46 s after the test
    before it stopped its cell: the press was dropped, in every CI run.)"""
    dist.ok("%%local\nfrom mpify_nb.engine import interrupts\n"
            "with interrupts.presses.during_call():\n    assert interrupts.presses.take()  # stops this call")
    assert dist.value("interrupts.presses.take()") is True  # the next cell, well within 0.5 s


def test_the_stop_button_during_dist_restart_leaves_every_rank(dist):
    # Before: an interrupt inside %dist_restart (between removing a rank and starting its
    # successor) left a session without that rank: every later cell failed with KeyError: 1.
    dist.ok("restart_keep = rank")
    # Restarts until the button stops them. The press that went unseen in every CI run came within 0.5 s
    # of the stop that ended the test before's cell, and was taken for a repeat of it (fixed: a press
    # belongs to its cell). The test presses again if one goes unseen, so that what follows is checked.
    presses: list[float] = []
    ran = dist.run("%%local\nfor _ in range(100_000):\n    get_ipython().run_line_magic('dist_restart', '1')",
                   during=press_until_it_stops(dist, r"Restarted rank 1", presses))
    assert ran.reply["content"].get("ename") == "KeyboardInterrupt", (len(presses), ran.reply["content"])
    assert len(presses) == 1, f"{len(presses) - 1} press(es) went unseen, the cell stopped at press {len(presses)}"
    assert dist.value("[(r.rank, r.state) for r in __import__('mpify_nb.magics.session').magics.session"
                      ".session().status()]") == [(0, "idle"), (1, "idle")]
    assert dist.ok("globals().get('restart_keep'), rank").shown() == ["[rank 0] (0, 0)\n[rank 1] (None, 1)"]


def test_magics_are_listed_and_have_help(dist):
    listing = dist.ok("%lsmagic").shown()[0]
    for name in ("%dist_init", "%dist_mode", "%dist_push", "%dist_pull", "%sync", "%dist_status", "%dist_restart",
                 "%dist_shutdown", "%dist_reset", "%%distributed", "%%rank", "%%local"):
        assert name in listing, name
    ran = dist.ok("%dist_init?")
    page = "".join(p["data"]["text/plain"] for p in ran.reply["content"]["payload"] if p.get("source") == "page")
    page = re.sub(r"\x1b\[[0-9;]*m", "", page)
    assert "%dist_init -n N [-g IDS] [--backend gloo|nccl] [--timeout S]" in page and "automatic" in page, page


def test_usage_errors(dist):
    for line, message in [("%dist_pull", "name a variable"),
                          ("%dist_push nothing_like_this", "the notebook has no 'nothing_like_this'"),
                          ("%dist_mode sideways", "expected on or off"), ("%dist_restart 7", "rank 7 does not exist")]:
        ran = dist.run(line)
        assert not ran.ok and not [o for o in ran.outputs if o.output_type == "error"], ran.outputs
        assert ran.reply["content"]["ename"] == "UsageError"
        assert message in ran.stream("stderr"), (line, ran.stream("stderr"))


# -- many cells, shutdown, reset -------------------------------------------------------------------

def test_200_cells_leak_no_fds_or_memory_in_the_kernel(dist):
    # Counted: the fds open in each of three looks 50 ms apart. Threads of the kernel open and close
    # fds of their own now and then (IPython's history thread: history.sqlite-journal, the profile
    # directory; the listing's own): caught in one look, they would make the count race. A leaked
    # fd stays, and is in every look.
    probe = ("%%local\nimport os, time\n"
             "def look():\n"
             "    fds = {}\n"
             "    for f in os.listdir('/proc/self/fd'):\n"
             "        try:\n"
             "            fds[f] = os.readlink('/proc/self/fd/' + f)\n"
             "        except OSError:\n"
             "            pass\n"
             "    return fds\n"
             "looks = []\n"
             "for _ in range(3):\n"
             "    looks.append(look())\n"
             "    time.sleep(0.05)\n"
             "fds = {f: t for f, t in looks[0].items() if all(other.get(f) == t for other in looks[1:])}\n"
             "print(repr((fds, "
             "int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))))")
    import ast

    for i in range(20):  # warm up
        dist.ok(f"leak_v = rank + {i}\nprint('x')\nleak_v")
    fds0, rss0 = ast.literal_eval(dist.ok(probe).stream().strip())
    for i in range(200):
        dist.ok(f"leak_v = rank + {i}\nprint('x')\nleak_v")
    fds1, rss1 = ast.literal_eval(dist.ok(probe).stream().strip())
    new = {f: t for f, t in fds1.items() if fds0.get(f) != t}
    assert len(fds1) <= len(fds0), f"{len(fds0)} -> {len(fds1)} fds; new or changed: {new}"
    assert rss1 - rss0 < 16 * 2**20, f"the kernel grew by {(rss1 - rss0) / 2**20:.1f} MB over 200 cells"


def test_shutdown_leaves_no_process_and_reset_allows_a_new_init(dist):
    before = pids(dist)
    ran = dist.ok("%dist_shutdown")
    assert "2 ranks stopped" in ran.stream()
    assert all(gone(p, timeout=0.5) for p in before), [p for p in before if not gone(p, 0)]
    assert dist.ok("import os\nos.getpid() > 0").shown() == ["True"]  # automatic mode is off
    assert "No ranks are running" in dist.ok("%dist_shutdown").stream()
    dist.ok("%dist_init -n 2")
    assert dist.ok("rank").shown() == ["[rank 0] 0\n[rank 1] 1"]
    second = pids(dist)
    dist.ok("%dist_reset")
    assert all(gone(p) for p in second)
    assert "No ranks" in dist.ok("%dist_status").stream()
    dist.ok("%dist_init -n 2")  # leave the module's kernel as it found it


def test_debug_is_ipythons_own_again_after_reset_even_after_a_second_init(dist):
    # %dist_init puts the failed rank's post mortem in %debug's place, and %dist_reset gives IPython's
    # own back. A second %dist_init once took its own stand-in for IPython's %debug (a new bound
    # method is never `is` the installed one): %debug of a kernel error then recursed for ever, and
    # %dist_reset never gave IPython's back.
    magics = "__import__('mpify_nb.magics.session').magics.session._current"
    stand_in = f"{magics}.lifecycle._debug_the_rank"
    installed = f"get_ipython().magics_manager.magics['line']['debug'] == {stand_in}"
    dist.ok("%dist_shutdown")
    dist.ok("%dist_init -n 2")  # this kernel's second
    try:
        assert dist.value(installed) is True
        assert dist.value(f"{magics}.state.ipython_debug == {stand_in}") is False  # IPython's, kept for later
    finally:
        dist.ok("%dist_reset")
    assert dist.value(installed) is False
    dist.ok("%dist_init -n 2")  # leave the module's kernel as it found it


def test_init_options_timeout_and_gpus(dist):
    dist.ok("%dist_shutdown")
    try:
        if "True" not in dist.ok("import torch\nprint(torch.cuda.is_available())").stream():
            bad = dist.run("%dist_init -n 2 -g 0,1")
            assert not bad.ok and bad.reply["content"]["ename"] == "UsageError", bad.outputs
            assert "needs CUDA GPUs" in bad.stream("stderr")
            assert "needs CUDA GPUs" in dist.run("%dist_init -n 2 --backend nccl").stream("stderr")
        assert "at least 1" in dist.run("%dist_init -n 0").stream("stderr")
        dist.ok("%dist_init -n 2 --timeout 1")
        ran = dist.fails("import time\ntime.sleep(5)", "TimeoutError")
        assert dist.ok("rank").shown() == ["[rank 0] 0\n[rank 1] 1"], ran.outputs  # usable after
    finally:
        dist.ok("%dist_reset")
        dist.ok("%dist_init -n 2")  # leave the module's kernel as it found it


# -- the example notebook ----------------------------------------------------------------------------

def test_example_notebook_runs():
    path = ROOT / "examples" / "persistent.ipynb"
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit it with outputs cleared"
    nb.metadata["kernelspec"] = {"name": nbutil.KERNEL_NAME, "display_name": nbutil.KERNEL_NAME, "language": "python"}
    nbutil.execute_notebook(nb, timeout=CELL_TIMEOUT, cwd=path.parent)  # raises on an unexpected error
    text = "\n".join(nbutil.all_text(c) for c in nb.cells if c.cell_type == "code")
    assert "[rank 1] tensor(" in text
    assert "rank 0 raised NameError: name 't' is not defined" in text
    assert "rank 0 asked for input, but this frontend cannot answer" in text  # %dist_debug without stdin
    assert "KeyboardInterrupt" in text
    assert "rank 1 was killed by SIGKILL" in text and "Restarted rank 1" in text
    assert "2 ranks stopped" in text
    nbutil.keep_executed_example(path, nb)  # the docs build renders it (no second run)
