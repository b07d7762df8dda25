"""%%ranch and %ranch_result, in a real Jupyter kernel (ipykernel) driven by nbclient.

Most tests share one kernel (``kernel``): each runs its own cells and uses its own
variable names. The interrupt test and the example notebook get a kernel of their own.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import nbformat
import pytest
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

import nbutil
from mpify_nb.magics import names_read_from_notebook
from versions import DTENSOR_MODULE, needs_fsdp2_on_cpu

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT = 120  # seconds; a cell that hangs fails the test instead of blocking the suite
LIBRARY_PATH = re.compile(r"mpify_nb/|site-packages|launcher\.py|interactiveshell\.py")


# -- a small kernel driver ----------------------------------------------------------------

class Ran:
    """One executed cell: its outputs and the kernel's execute_reply."""

    def __init__(self, cell, reply: dict):
        self.cell = cell
        self.reply = reply
        self.outputs = cell.outputs

    @property
    def ok(self) -> bool:
        return self.reply["content"]["status"] == "ok"

    def stream(self, name: Optional[str] = None) -> str:
        return "".join(o.text for o in self.outputs
                       if o.output_type == "stream" and (name is None or o.name == name))

    def shown(self, mime: str = "text/plain") -> list[str]:
        """What display_data/execute_result outputs show in ``mime``, in order."""
        return [o.data[mime] for o in self.outputs
                if o.output_type in ("display_data", "execute_result") and mime in o.data]

    @property
    def error(self):
        errors = [o for o in self.outputs if o.output_type == "error"]
        assert len(errors) == 1, f"expected one error output, got {self.outputs}"
        return errors[0]

    def error_text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(self.error.traceback))  # without colors


class Kernel:
    """A real ipykernel, executing cells one at a time through nbclient."""

    def __init__(self, cwd: Path, env: Optional[dict] = None, client_class: type = NotebookClient, **client_options):
        self.nb = nbformat.v4.new_notebook()
        self._replies: dict[int, dict] = {}
        client_options.setdefault("kernel_name", "python3")
        self.client = client_class(
            self.nb, timeout=CELL_TIMEOUT, allow_errors=True,
            resources={"metadata": {"path": str(cwd)}},
            on_cell_executed=self._record, **client_options,
        )
        self._setup = self.client.setup_kernel(**({} if env is None else {"env": env}))
        self._setup.__enter__()

    def _record(self, cell, cell_index: int, execute_reply: dict) -> None:
        self._replies[cell_index] = execute_reply

    def run(self, source: str, during: Optional[Callable] = None) -> Ran:
        """Execute one cell. ``during(cell)`` runs in a thread meanwhile (to watch outputs, interrupt)."""
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        index = len(self.nb.cells) - 1
        failures: list[BaseException] = []
        watcher = None
        if during is not None:
            def target():
                try:
                    during(cell)
                except BaseException as e:  # reported after the cell ends
                    failures.append(e)
            watcher = threading.Thread(target=target, daemon=True)
            watcher.start()
        try:
            self.client.execute_cell(cell, index)
        except BaseException as error:
            if isinstance(self.client, nbutil.StackTellingClient):  # where each process was at a timeout
                self.client.note_stacks(error)
            raise
        if watcher is not None:
            watcher.join(timeout=CELL_TIMEOUT)
        if failures:
            raise failures[0]
        return Ran(cell, self._replies[index])

    def ok(self, source: str) -> Ran:
        ran = self.run(source)
        assert ran.ok, f"cell failed: {source!r}\n{ran.outputs}"
        return ran

    def interrupt(self) -> None:
        run_sync(self.client.km.interrupt_kernel)()  # what the notebook's stop button sends

    def close(self) -> None:
        self._setup.__exit__(None, None, None)


def wait_for_output(cell, pattern: str, timeout: float = 60.0) -> re.Match:
    """Wait until the cell's stream output so far matches ``pattern`` (read while the cell runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = "".join(o.get("text", "") for o in list(cell.outputs))
        match = re.search(pattern, text, re.S)
        if match:
            return match
        time.sleep(0.05)
    raise AssertionError(f"no output matching {pattern!r} within {timeout} s; outputs: {cell.outputs}")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    # A test that fails leaves the next a fresh kernel.
    yield from nbutil.shared_kernel(lambda: nbutil.ready(Kernel(tmp_path_factory.mktemp("kernel")), "ok",
                                                         ["%load_ext mpify_nb"]))


def process_gone(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` no longer exists (killed and reaped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False


# -- which names a cell takes from the notebook (pure analysis, no kernel) -----------------

# Builtins are among them: only names the notebook defines are shipped (notebook_names_for).
@pytest.mark.parametrize("source, expected", [
    ("x = 1\nx + y", ["y"]),
    ("model = make()\nmodel(data)", ["make", "data"]),
    ("x = x + 1", ["x"]),
    ("x += 1", ["x"]),
    ("import numpy as np\nnp.zeros(n)", ["n"]),
    ("def f(a, *args, k=default, **kw):\n    b = a + g(c)\n    return b\nf(1)", ["default", "g", "c"]),
    ("def f():\n    return helper()\ndef helper():\n    return 1\nf()", []),
    ("[i * scale for i in data if i > lo]", ["data", "lo", "scale"]),  # the order Python evaluates them
    ("{k: v for k, v in pairs}", ["pairs"]),
    ("lambda q: q + offset", ["offset"]),
    ("class A(Base):\n    x = 1\n    y = x + 1\n    def m(self):\n        return x", ["Base", "x"]),
    # The loop may not run: then s is the notebook's.
    ("for i in range(3):\n    s = i\n    t = s + i\ns", ["range", "s"]),
    ("for batch in data:\n    out = model(batch)\n    loss = out.sum()", ["data", "model"]),
    ("if flag:\n    a = 1\nelse:\n    a = 2\na", ["flag"]),
    ("if flag:\n    a = 1\na", ["flag", "a"]),
    ("while go():\n    n = 1\n    n += 1", ["go"]),
    ("with open(p) as fh:\n    text = fh.read()\ntext", ["open", "p"]),
    ("try:\n    r = risky()\nexcept ValueError as e:\n    print(e, r)", ["risky", "ValueError", "print", "r"]),
    ("match cmd:\n    case [x, y] if x > lim:\n        x + y", ["cmd", "lim"]),
    ("def f():\n    global counter\n    counter = 1\n    return counter\nf()", ["counter"]),
    ("obj.attr.method(arg)", ["obj", "arg"]),
    ("f'{value:>{width}}'", ["value", "width"]),
])
def test_names_read_from_notebook(source, expected):
    assert names_read_from_notebook(ast.parse(source)) == expected


# -- in a real kernel ------------------------------------------------------------------------

def test_magics_are_registered_and_listed(kernel):
    ran = kernel.ok("%lsmagic")
    listing = ran.shown()[0]
    assert "%%ranch" in listing and "%ranch_result" in listing


def test_cell_runs_on_every_rank_and_values_are_labelled(kernel):
    ran = kernel.ok("%%ranch 2\nimport os\nprint('hello from', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n"
                    "int(os.environ['RANK']) * 10 + 1")
    out = ran.stream("stdout")
    assert "hello from 0 of 2\n" in out and "[rank 0]" not in out  # rank 0 is the notebook: unprefixed
    assert "[rank 1] hello from 1 of 2\n" in out
    assert ran.shown() == ["[rank 0] 1\n[rank 1] 11"]
    result = kernel.ok("%ranch_result")
    assert result.shown() == ["[1, 11]"]


def test_a_rank_runs_its_cell_without_importing_the_magics(kernel):
    # What a rank runs for a cell lives below the process boundary (rank/cells.py): rank 1 never
    # imports magics/ (nor IPython for it); rank 0 is the notebook, where the magics are loaded.
    ran = kernel.ok("%%ranch 2\nimport sys\nsorted(m for m in sys.modules if m.startswith('mpify_nb.magics'))[:1]")
    assert ran.shown() == ["[rank 0] ['mpify_nb.magics']\n[rank 1] []"]


def test_lines_of_different_ranks_never_share_a_line(kernel):
    # print() on rank 0 writes its text and its newline separately: a rank's line must not land between.
    ran = kernel.ok("%%ranch 3\nimport os, time\nfor i in range(40):\n"
                    "    print(f'line {i} of rank {os.environ[\"RANK\"]}')\n    time.sleep(0.001)")
    lines = ran.stream("stdout").splitlines()
    assert len(lines) == 120
    mixed = [line for line in lines if not re.fullmatch(r"(\[rank [12]\] )?line \d+ of rank \d", line)]
    assert not mixed, mixed[:3]


def test_one_rank_and_the_cell_compiles_as_a_normal_cell(kernel):
    # The library's own `from __future__ import annotations` must not leak into the cell.
    ran = kernel.ok("%%ranch 1\ndef annotated(x: int) -> None:\n    pass\nannotated.__annotations__['x']")
    assert ran.shown() == ["[rank 0] int"]


def test_display_works_on_every_rank(kernel):
    ran = kernel.ok("%%ranch 2\nimport os\ndisplay({'rank': os.environ['RANK']})")
    assert ran.shown() == ["{'rank': '0'}"]  # rank 0: IPython's display
    assert "[rank 1] {'rank': '1'}\n" in ran.stream("stdout")  # rank 1: printed


def test_rank0_assignments_stay_in_the_notebook(kernel):
    kernel.ok("%%ranch 2\nimport os\nkept_rank = int(os.environ['RANK'])\n"
              "def kept_fn():\n    return 'defined in a %%ranch cell'\nkept_pid = os.getpid()")
    ran = kernel.ok("import os\nkept_rank, kept_fn(), kept_pid == os.getpid()")
    assert ran.shown() == ["(0, 'defined in a %%ranch cell', True)"]


def test_notebook_names_are_shipped_to_other_ranks(kernel):
    kernel.ok(
        "import numpy as np\n"
        "ship_offset = 100\n"
        "def ship_add(a):\n    return a + ship_offset\n"
        "class ShipPoint:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __repr__(self):\n        return f'ShipPoint({self.x})'\n"
    )
    ran = kernel.ok("%%ranch 2\nimport os\nr = int(os.environ['RANK'])\n"
                    "p = ShipPoint(ship_add(r))\n(p, int(np.arange(4).sum()), os.getpid())")
    values = kernel.ok("values = %ranch_result\n"
                       "[(type(p).__name__, p.x, s, isinstance(p, ShipPoint)) for p, s, _ in values]").shown()
    assert values == ["[('ShipPoint', 100, 6, True), ('ShipPoint', 101, 6, True)]"]
    shown = ran.shown()[0]
    assert re.fullmatch(r"\[rank 0\] \(ShipPoint\(100\), 6, \d+\)\n\[rank 1\] \(ShipPoint\(101\), 6, \d+\)", shown)
    pids = kernel.ok("import os\n[v[2] == os.getpid() for v in values]").shown()
    assert pids == ["[True, False]"]  # rank 1 really ran in another process


def test_a_stale_unpicklable_value_is_not_shipped_when_the_cell_assigns_it_first(kernel):
    kernel.ok("stale_gen = (i for i in range(3))")
    ran = kernel.ok("%%ranch 2\nstale_gen = 5\nstale_gen + 1")
    assert ran.shown() == ["[rank 0] 6\n[rank 1] 6"]


def test_an_unpicklable_notebook_value_gives_a_clean_error(kernel):
    kernel.ok("bad_gen = (i for i in range(3))")
    ran = kernel.run("%%ranch 2\nnext(bad_gen)")
    assert not ran.ok
    assert ran.error.ename == "PayloadError"
    text = ran.error_text()
    assert "'bad_gen' (generator)" in text and "cannot pickle 'generator' object" in text
    assert not LIBRARY_PATH.search(text), text


def test_rich_display_for_rank0_text_for_the_others(kernel):
    kernel.ok("class RichThing:\n    def _repr_html_(self):\n        return '<b>rich</b>'\n"
              "    def __repr__(self):\n        return 'RichThing()'")
    ran = kernel.ok("%%ranch 2\nRichThing()")
    assert ran.shown() == ["[rank 0]", "RichThing()", "[rank 1] RichThing()"]
    assert ran.shown("text/html") == ["<b>rich</b>"]


def test_multiline_values_stay_aligned(kernel):
    ran = kernel.ok("%%ranch 2\nclass TwoLines:\n    def __repr__(self):\n        return 'x\\ny'\nTwoLines()")
    assert ran.shown() == ["[rank 0] x\n         y\n[rank 1] x\n         y"]


def test_no_value_shown_without_a_final_expression_or_with_a_semicolon(kernel):
    assert kernel.ok("%%ranch 2\nquiet_value = 3").shown() == []
    assert kernel.ok("%ranch_result").shown() == ["[None, None]"]
    assert kernel.ok("%%ranch 2\nquiet_value + 1;").shown() == []
    assert kernel.ok("%ranch_result").shown() == ["[4, 4]"]


def test_no_gather_keeps_rank0_only(kernel):
    # Rank 1's value could not even be sent back: with --no-gather it is not asked for.
    ran = kernel.ok("%%ranch 2 --no-gather\nimport os\n"
                    "'mine' if os.environ['RANK'] == '0' else (i for i in range(2))")
    assert ran.shown() == ["[rank 0] 'mine'"]
    assert kernel.ok("%ranch_result").shown() == ["['mine']"]


def test_error_on_rank1_fails_the_cell_with_the_rank_and_the_cell_line(kernel):
    ran = kernel.run("%%ranch 2\nimport os\nerr_x = 1\nif os.environ['RANK'] == '1':\n"
                     "    raise ValueError('boom on ' + os.environ['RANK'])\n'unreached'")
    assert not ran.ok
    assert ran.reply["content"]["ename"] == "RankRaisedError"  # what nbclient/papermill/CI see
    text = ran.error_text()
    assert "rank 1 raised ValueError: boom on 1" in text
    # The cell's line 5 (line 1 is %%ranch), with its source, and no library frames.
    # The cell's own number, as its prompt shows it (In [n]): IPython 9 counts the cell before running it.
    assert re.search(rf"Cell In\[{ran.cell.execution_count}\], line 5, in <module>\n"
                     r"\s+raise ValueError\('boom on ' \+ os.environ\['RANK'\]\)", text), text
    assert not LIBRARY_PATH.search(text), text
    usage = kernel.run("%ranch_result")
    assert not usage.ok and "no %%ranch cell has finished" in usage.stream("stderr")


def test_error_in_a_notebook_function_shows_both_cells(kernel):
    defined = kernel.ok("def fails_on_rank1():\n    import os\n    if os.environ['RANK'] == '1':\n"
              "        raise KeyError('deep')\n    return 0")
    ran = kernel.run("%%ranch 2\nfails_on_rank1()")
    text = ran.error_text()
    assert "rank 1 raised KeyError: 'deep'" in text
    assert re.search(rf"Cell In\[{ran.cell.execution_count}\], line 2, in <module>\n\s+fails_on_rank1\(\)", text), text
    assert re.search(rf"Cell In\[{defined.cell.execution_count}\], line 4, in fails_on_rank1\n"
                     r"\s+raise KeyError\('deep'\)", text), text


def test_error_on_rank0(kernel):
    ran = kernel.run("%%ranch 2\nimport os\nif os.environ['RANK'] == '0':\n    1 / 0")
    text = ran.error_text()
    assert "rank 0 raised ZeroDivisionError" in text
    assert re.search(rf"Cell In\[{ran.cell.execution_count}\], line 4, in <module>\n\s+1 / 0", text), text


def test_syntax_error_points_at_the_cell_line(kernel):
    ran = kernel.run("%%ranch 2\nok_line = 1\nbad = (")
    assert not ran.ok
    text = ran.error_text()
    assert re.search(rf"Cell In\[{ran.cell.execution_count}\], line 3\n\s+bad = \(", text), text
    assert "SyntaxError: '(' was never closed" in text
    assert not LIBRARY_PATH.search(text), text


@pytest.mark.parametrize("line, message", [
    ("%%ranch", "the following arguments are required: N"),
    ("%%ranch x", "N must be a whole number of ranks, not 'x'"),
    ("%%ranch 0", "N must be at least 1"),
    ("%%ranch 2 --timeout 0", "--timeout must be more than 0 seconds"),
    ("%%ranch 2 --timeout soon", "--timeout must be a number of seconds"),
    ("%%ranch 2 --bogus", "unrecognized arguments: --bogus"),
    ("%%ranch 2 --gpus 0,1", "add --ddp"),
    ("%%ranch 2 --ddp --gpus a,b", "--gpus takes GPU ids separated by commas"),
    ("%%ranch 2 --ddp --gpus 0", "give one GPU id per rank"),
])
def test_bad_options_give_a_usage_message_not_a_traceback(kernel, line, message):
    ran = kernel.run(f"{line}\nnever_runs = 1")
    assert not ran.ok
    assert not [o for o in ran.outputs if o.output_type == "error"]  # no traceback
    err = ran.stream("stderr")
    assert err.startswith("UsageError: %%ranch: ") and message in err, err
    assert "usage: %%ranch N [--ddp] [--gpus IDS] [--timeout S] [--no-gather]" in err
    assert ran.reply["content"]["ename"] == "UsageError"


def test_gpus_on_a_machine_without_cuda_is_a_usage_error(kernel):
    if "True" in kernel.ok("import torch\nprint(torch.cuda.is_available())").stream():
        pytest.skip("this machine has CUDA")
    ran = kernel.run("%%ranch 2 --ddp --gpus 0,1\nnever_runs = 1")
    assert "UsageError: %%ranch: " in ran.stream("stderr") and "needs CUDA GPUs" in ran.stream("stderr")


def test_help(kernel):
    ran = kernel.ok("%%ranch?")
    pages = [p["data"]["text/plain"] for p in ran.reply["content"]["payload"] if p.get("source") == "page"]
    text = re.sub(r"\x1b\[[0-9;]*m", "", "".join(pages))
    assert "%%ranch N [--ddp] [--gpus IDS] [--timeout S] [--no-gather]" in text
    assert "%%%ranch" not in text
    for option in ("--ddp", "--gpus IDS", "--timeout S", "--no-gather", "rank 0"):
        assert option in text
    ran = kernel.ok("%ranch_result?")
    pages = "".join(p["data"]["text/plain"] for p in ran.reply["content"]["payload"])
    assert "per-rank values of the last %%ranch cell" in pages


def test_ddp_all_reduce_with_gloo(kernel):
    ran = kernel.ok("%%ranch 2 --ddp\nimport torch, torch.distributed as dist\n"
                    "t = torch.tensor([dist.get_rank() + 1.0])\ndist.all_reduce(t)\n"
                    "(dist.get_backend(), dist.get_world_size(), t.item())")
    assert ran.shown() == ["[rank 0] ('gloo', 2, 3.0)\n[rank 1] ('gloo', 2, 3.0)"]
    # The group is gone from the notebook afterwards; the tensor rank 0 made stays.
    after = kernel.ok("import torch.distributed as dist\n(dist.is_initialized(), t.item())")
    assert after.shown() == ["(False, 3.0)"]


def test_a_ddp_model_left_by_a_ddp_cell_says_its_group_ended(kernel):
    kernel.ok("%%ranch 2 --ddp\nimport torch\ntorch.manual_seed(0)\n"
              "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
              "model(torch.ones(1, 2)).sum().backward()")
    # Before: gloo's "Connection closed by peer ... typically caused by a remote worker crashing".
    ran = kernel.run("model(torch.ones(1, 2))")
    assert not ran.ok
    assert ran.error.ename == "RuntimeError"
    assert "process group of a ranch call (or a %%ranch --ddp cell) that has ended" in ran.error.evalue
    assert "Connection closed" not in ran.error_text()
    # The model itself is there, trained, and usable.
    assert kernel.ok("tuple(model.module(torch.ones(1, 2)).shape)").shown() == ["(1, 1)"]


@needs_fsdp2_on_cpu
def test_fsdp_modules_dtensors_and_meshes_left_by_a_ddp_cell_say_their_group_ended(kernel):
    from mpify_nb.torchdist.groups import FSDP_ENDED_MESSAGE, MESH_ENDED_MESSAGE

    kernel.ok("%%ranch 2 --ddp\nimport torch\nfrom torch.distributed.device_mesh import init_device_mesh\n"
              "from torch.distributed.fsdp import fully_shard\n"
              "from torch.distributed.tensor import Shard, distribute_tensor\n"
              "sharded_mesh = init_device_mesh('cpu', (2,))\n"
              "sharded = fully_shard(torch.nn.Linear(2, 1), mesh=sharded_mesh)\n"
              "sharded(torch.ones(1, 2)).sum().backward()\n"
              "sharded_t = distribute_tensor(torch.arange(4.0), sharded_mesh, [Shard(0)])")
    # Before: gloo's "Connection closed by peer" (the module), "Could not resolve the process group" (the rest).
    for use, message in [("sharded(torch.ones(1, 2))", FSDP_ENDED_MESSAGE),
                         ("sharded.weight.full_tensor()", MESH_ENDED_MESSAGE),
                         ("sharded_t.full_tensor()", MESH_ENDED_MESSAGE),
                         ("sharded_mesh.get_group()", MESH_ENDED_MESSAGE)]:
        ran = kernel.run(use)
        assert (ran.error.ename, ran.error.evalue) == ("RuntimeError", message), (use, ran.error_text())
    # What needs no other rank still works: this rank's own shard.
    assert kernel.ok("sharded_t.to_local().tolist()").shown() == ["[0.0, 1.0]"]


def test_dtensors_and_meshes_left_by_a_ddp_cell_say_their_group_ended_on_every_torch(kernel):
    """The same for DTensors and meshes alone, on every torch we support: the public DTensor API
    (torch >= 2.5) or torch.distributed._tensor (2.4), a mesh's group names (2.8+) or infos."""
    from mpify_nb.torchdist.groups import MESH_ENDED_MESSAGE

    kernel.ok("%%ranch 2 --ddp\nimport torch\nfrom torch.distributed.device_mesh import init_device_mesh\n"
              f"from {DTENSOR_MODULE} import Shard, distribute_tensor\n"
              "alone_mesh = init_device_mesh('cpu', (2,))\n"
              "alone_t = distribute_tensor(torch.arange(4.0), alone_mesh, [Shard(0)])\n"
              "alone_full = alone_t.full_tensor().tolist()")
    assert kernel.ok("alone_full").shown() == ["[0.0, 1.0, 2.0, 3.0]"]
    # Before (torch < 2.8): nothing was disarmed; full_tensor() failed in gloo ("Connection closed by peer").
    for use in ["alone_t.full_tensor()", "alone_mesh.get_group()"]:
        ran = kernel.run(use)
        assert (ran.error.ename, ran.error.evalue) == ("RuntimeError", MESH_ENDED_MESSAGE), (use, ran.error_text())
    assert kernel.ok("alone_t.to_local().tolist()").shown() == ["[0.0, 1.0]"]


def test_timeout_stops_the_cell(kernel):
    ran = kernel.run("%%ranch 2 --timeout 1\nimport time\nwhile True:\n    time.sleep(60)")
    assert not ran.ok
    assert ran.error.ename == "TimeoutError"
    text = ran.error_text()
    assert "did not finish within 1 s" in text
    assert not LIBRARY_PATH.search(text), text
    assert kernel.ok("%%ranch 2\n'after timeout'").shown() == ["[rank 0] 'after timeout'\n[rank 1] 'after timeout'"]


def test_output_of_every_rank_is_live(kernel, tmp_path):
    # Rank 1 waits for a file that the test creates only once it has *seen* rank 1's
    # first line in the cell: if output were not relayed live, rank 1 would give up.
    go = tmp_path / "go"
    source = (
        "%%ranch 2\nimport os, time\nfrom tqdm.auto import tqdm\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('waiting for the notebook', flush=True)\n"
        "    deadline = time.monotonic() + 60\n"
        f"    while not os.path.exists({str(go)!r}):\n"
        "        assert time.monotonic() < deadline, 'the first line never reached the notebook'\n"
        "        time.sleep(0.02)\n"
        "for i in tqdm(range(3), desc='bar'):\n    pass\n'done'"
    )
    ran = kernel.run(source, during=lambda cell: (wait_for_output(cell, r"\[rank 1\] waiting"), go.touch()))
    assert ran.ok, ran.outputs
    err = ran.stream("stderr")
    displays = [o for o in ran.outputs if o.get("output_type") == "display_data"]
    # Rank 0's tqdm.auto: a widget where ipywidgets is installed, else a text bar of its stream,
    # redrawn in place with \r.
    if importlib.util.find_spec("ipywidgets") is not None:
        assert any("application/vnd.jupyter.widget-view+json" in o["data"] for o in displays), ran.outputs
    else:
        assert re.search(r"(?:^|[\r\n])bar: 100%[^\r\n]*3/3", err), err
    # Rank 1's bar (text: no notebook there) is a live line of the cell, labelled, at its final state.
    texts = [o["data"].get("text/plain", "") for o in displays]
    assert any(re.fullmatch(r"\[rank 1\] bar: 100%[^\r\n]*3/3.*", t) for t in texts), ran.outputs


def test_interrupt_stops_every_rank_and_the_kernel_stays_usable(tmp_path):
    k = Kernel(tmp_path)
    try:
        k.ok("%load_ext mpify_nb")
        seen: dict = {}

        def press_stop(cell):
            try:
                seen["pids"] = wait_for_output(cell, r"pid (\d+).*\[rank 1\] pid (\d+)|\[rank 1\] pid (\d+).*pid (\d+)")
            finally:
                k.interrupt()  # even when the pids never showed: the cell must end, and the test report why

        ran = k.run("%%ranch 2\nimport os, time\nprint('pid', os.getpid(), flush=True)\n"
                    "while True:\n    time.sleep(60)", during=press_stop)
        assert not ran.ok
        assert ran.error.ename == "KeyboardInterrupt"
        assert "every rank was stopped" in ran.error_text()
        groups = [int(g) for g in seen["pids"].groups() if g]
        kernel_pid = int(k.ok("import os\nprint(os.getpid())").stream())
        rank1 = [p for p in groups if p != kernel_pid]
        assert len(rank1) == 1, (groups, kernel_pid)
        assert process_gone(rank1[0]), f"rank 1 (pid {rank1[0]}) is still running"
        after = k.ok("%%ranch 2\nimport os\nint(os.environ['RANK'])")
        assert after.shown() == ["[rank 0] 0\n[rank 1] 1"]
    finally:
        k.close()


def test_stop_button_stops_a_call_on_a_background_thread(kernel):
    """The kernel is idle (it ignores SIGINT then) while a thread runs ranch: the stop button
    must still end that call, with KeyboardInterrupt in the thread, and the ranks gone."""
    kernel.ok(
        "import threading, time, os, mpify_nb\n"
        "def spin(seconds):\n"
        "    end = time.monotonic() + seconds\n"
        "    while time.monotonic() < end:\n"
        "        time.sleep(0.05)\n"
        "    return os.getpid()\n"
        "outcome = []\n"
        "def worker():\n"
        "    try:\n"
        "        outcome.append(mpify_nb.ranch(2, spin, 120))\n"
        "    except BaseException as e:\n"
        "        outcome.append(type(e).__name__)\n"
        "background = threading.Thread(target=worker)\n"
        "background.start()\n"
        "time.sleep(2)\n"
    )
    kernel.interrupt()
    ran = kernel.ok("background.join(30)\nprint(background.is_alive(), outcome)")
    assert ran.stream().strip() == "False ['KeyboardInterrupt']", ran.outputs
    after = kernel.ok("%%ranch 2\nimport os\nint(os.environ['RANK'])")
    assert after.shown() == ["[rank 0] 0\n[rank 1] 1"]


def test_example_notebook_runs():
    path = ROOT / "examples" / "magics.ipynb"
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit it with outputs cleared"
    NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()  # raises on an unexpected error
    text = "\n".join(
        o.get("text", "") + o.get("data", {}).get("text/plain", "") + "\n".join(o.get("traceback", []))
        for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "[rank 1] rank 1 of 3 got" in text  # live output, labelled
    assert "[rank 2] Summary(rank=2, total=260)" in text  # values, labelled
    assert "rank 1 raised ValueError" in text  # the error example (tagged raises-exception)
    assert "TimeoutError" in text
    nbutil.keep_executed_example(path, nb)  # the docs build renders it (no second run)
