"""Scripts people already have, pasted into a notebook (issue 38), in a real kernel: through
``ranch``, ``%%ranch`` and persistent cells, a rank failing around the script's own
``init_process_group`` ends the cell within 2 s; the stop button frees a kernel waiting in the
rendezvous; nothing is left listening in the kernel; a cell that makes (or destroys) its own
group in a Session; nbdistributed's magics as its users type them.
"""

from __future__ import annotations

import datetime
import re
import time

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

import nbutil  # noqa: E402
from test_magics import wait_for_output  # noqa: E402
from test_session_magics import Kernel, texts  # noqa: E402
from versions import needs_fsdp2_on_cpu  # noqa: E402

#: The issue's promise: a rank failing anywhere ends the cell within this many seconds of it.
ENDS_WITHIN = 2.0

SETUP = ("%load_ext mpify_nb\nimport os, time\nimport torch\nimport torch.distributed as dist\n"
         "from mpify_nb import ranch, in_torchddp\n"
         "def listening():\n"
         "    mine = set()\n"
         "    for fd in os.listdir('/proc/self/fd'):\n"
         "        try:\n"
         "            target = os.readlink(f'/proc/self/fd/{fd}')\n"
         "        except OSError:\n"
         "            continue  # closed meanwhile\n"
         "        if target.startswith('socket:['):\n"
         "            mine.add(target[8:-1])\n"
         "    found = set()\n"
         "    for table in ('/proc/net/tcp', '/proc/net/tcp6'):\n"
         "        for line in open(table).readlines()[1:]:\n"
         "            f = line.split()\n"
         "            if f[3] == '0A' and f[9] in mine:\n"
         "                found.add(int(f[1].rsplit(':', 1)[1], 16))\n"
         "    return sorted(found)\n")

#: The issue's script: rank 1 fails before its own init_process_group, the notebook (rank 0) goes in.
JOB = ('def job():\n'
       '    if os.environ["RANK"] == "1":\n'
       '        raise FileNotFoundError(f"shard 1 is missing AT {time.time():.3f}")\n'
       '    dist.init_process_group("gloo")\n')


def lines(ran) -> list[str]:
    """What a cell showed, line by line (blank lines and mpify_nb's notes of names sent dropped)."""
    return [line for line in texts(ran).splitlines() if line and not line.startswith("[mpify_nb] sent")]


def _ended_at(ran) -> float:
    """When the kernel answered the cell (nbclient's record of it), as time.time() counts."""
    stamp = ran.cell.metadata["execution"]["shell.execute_reply"]
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _failed_at(text: str) -> float:
    match = re.search(r"AT (\d+\.\d+)", text)
    assert match, text
    return float(match.group(1))


@pytest.fixture(scope="module")
def nb(tmp_path_factory):
    yield from nbutil.shared_kernel(lambda: nbutil.ready(Kernel(tmp_path_factory.mktemp("nb")), "ok", [SETUP]))


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    yield from nbutil.shared_kernel(lambda: nbutil.ready(Kernel(tmp_path_factory.mktemp("dist")), "ok",
                                                         [SETUP, "%dist_init -n 2", "x = rank * 10"]))


# -- ranch and %%ranch: the kernel is rank 0 ----------------------------------------------------

def test_the_issues_script_through_ranch_ends_with_rank_1s_error(nb):
    nb.ok(JOB)
    ran = nb.fails("ranch(2, job, timeout=10)", "RankRaisedError")
    text = ran.error_text()
    assert "rank 1 raised FileNotFoundError: shard 1 is missing" in text
    assert _ended_at(ran) - _failed_at(text) < ENDS_WITHIN
    assert nb.ok("print(ranch(2, lambda: int(os.environ['RANK']) + 1))").stream() == "[1, 2]\n"


def test_the_issues_script_as_a_ranch_cell_ends_with_rank_1s_error(nb):
    ran = nb.fails('%%ranch 2 --timeout 10\nif os.environ["RANK"] == "1":\n'
                   '    raise FileNotFoundError(f"shard 1 is missing AT {time.time():.3f}")\n'
                   'dist.init_process_group("gloo")\n', "RankRaisedError")
    text = ran.error_text()
    assert "FileNotFoundError: shard 1 is missing" in text
    assert _ended_at(ran) - _failed_at(text) < ENDS_WITHIN


def test_the_stop_button_frees_the_kernel_waiting_in_the_scripts_rendezvous(nb):
    nb.ok('def never_comes():\n'
          '    if os.environ["RANK"] == "2":\n'
          '        time.sleep(300)\n'
          '    print("rendezvous", flush=True)\n'
          '    dist.init_process_group("gloo")\n')
    pressed: list = []

    def press(cell) -> None:
        wait_for_output(cell, r"rendezvous")
        time.sleep(1.0)  # into init_process_group, waiting for rank 2
        pressed.append(time.time())
        nb.interrupt()

    ran = nb.run("ranch(3, never_comes)", during=press)
    assert not ran.ok and ran.reply["content"]["ename"] == "KeyboardInterrupt", ran.outputs
    assert _ended_at(ran) - pressed[0] < ENDS_WITHIN


def test_a_fixed_master_port_works_run_after_run_and_nothing_listens_in_the_kernel_after(nb):
    """pytorch/examples' ddp_setup, pasted: MASTER_PORT fixed, DDP, destroy_process_group; three
    runs give the same weights; the kernel listens on what it listened on before (its own ZMQ
    ports), not on torch's store (*:PORT, kept by a DDP model's group) nor gloo's."""
    before = nb.value("listening()")
    nb.ok("def ddp_setup(rank, world_size):\n"
          "    os.environ['MASTER_ADDR'] = 'localhost'\n"
          "    os.environ['MASTER_PORT'] = '12355'\n"
          "    dist.init_process_group(backend='gloo', rank=rank, world_size=world_size)\n"
          "def main(rank, world_size):\n"
          "    from torch.nn.parallel import DistributedDataParallel as DDP\n"
          "    ddp_setup(rank, world_size)\n"
          "    torch.manual_seed(0)\n"
          "    model = DDP(torch.nn.Linear(4, 1))\n"
          "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
          "    for _ in range(3):\n"
          "        loss = (model(torch.ones(2, 4) * (rank + 1)) - 1).pow(2).mean()\n"
          "        opt.zero_grad(); loss.backward(); opt.step()\n"
          "    dist.destroy_process_group()\n"
          "    return round(model.module.weight.detach().sum().item(), 6)\n")
    runs = [nb.value("ranch(2, main, 2, pass_rank=True)") for _ in range(3)]
    assert runs == [runs[0]] * 3 and runs[0][0] == runs[0][1]
    assert nb.value("listening()") == before
    # The same script at module level in %%ranch: its DDP `model` stays in the notebook, and held
    # its group's gloo listener (a port listening in the kernel after every such cell).
    cell = ("%%ranch 2\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "rank = int(os.environ['RANK'])\n"
            "ddp_setup(rank, 2)\n"
            "torch.manual_seed(0)\n"
            "model = DDP(torch.nn.Linear(4, 1))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(3):\n"
            "    loss = (model(torch.ones(2, 4) * (rank + 1)) - 1).pow(2).mean()\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
            "dist.destroy_process_group()\n"
            "round(model.module.weight.detach().sum().item(), 6)")
    for _ in range(2):
        assert lines(nb.ok(cell)) == [f"[rank 0] {runs[0][0]}", f"[rank 1] {runs[0][0]}"]
        assert nb.value("listening()") == before
    assert nb.value("round(model.module.weight.detach().sum().item(), 6)") == runs[0][0]  # the model is kept
    refused = nb.fails("model(torch.ones(1, 4))", "RuntimeError").error_text()
    assert "made on the process group of a ranch call" in refused


#: pytorch/examples' tensor-parallel and FSDP2 examples written as module-level scripts: in
#: %%ranch the kernel is rank 0, so their model stays in the notebook.
TP_CELL = ("%%ranch 2\n"
           "from torch.distributed.device_mesh import init_device_mesh\n"
           "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
           "torch.manual_seed(0)\n"
           "tp_model = parallelize_module(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),\n"
           "                                                  torch.nn.Linear(8, 2)),\n"
           "                              init_device_mesh('cpu', (int(os.environ['WORLD_SIZE']),)),\n"
           "                              {'0': ColwiseParallel(), '2': RowwiseParallel()})\n"
           "opt = torch.optim.SGD(tp_model.parameters(), lr=0.1)\n"
           "for _ in range(2):\n"
           "    opt.zero_grad(); tp_model(torch.ones(2, 4)).sum().backward(); opt.step()\n"
           "dist.destroy_process_group()\n"
           "round(tp_model[0].weight.to_local().sum().item(), 6)")
FSDP2_CELL = ("%%ranch 2\n"
              "from torch.distributed.device_mesh import init_device_mesh\n"
              "from torch.distributed.fsdp import fully_shard\n"
              "dist.init_process_group('gloo')\n"
              "mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n"
              "torch.manual_seed(0)\n"
              "fsdp_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
              "for layer in (fsdp_model[0], fsdp_model[2]):\n"
              "    fully_shard(layer, mesh=mesh)\n"
              "fully_shard(fsdp_model, mesh=mesh)\n"
              "opt = torch.optim.Adam(fsdp_model.parameters(), lr=0.01)\n"
              "for _ in range(2):\n"
              "    fsdp_model(torch.ones(2, 4) * (dist.get_rank() + 1)).pow(2).mean().backward()\n"
              "    opt.step(); opt.zero_grad()\n"
              "dist.destroy_process_group()\n"
              "round(fsdp_model[0].weight.to_local().sum().item(), 6)")


@needs_fsdp2_on_cpu
def test_tensor_parallel_and_fsdp2_models_left_in_the_kernel_leave_nothing_listening(nb):
    """A module-level tensor-parallel or FSDP2 script in %%ranch leaves its model in the kernel: the
    model's DeviceMesh kept its ended group (``_pg_registry``, and DTensor's caches kept the mesh),
    FSDP2's mesh info too, so every such cell left a gloo port listening in the kernel. Now nothing
    new listens, run after run (the tensor-parallel cell's second run failed too: DTensor's caches
    gave it the first run's mesh, refused since); the models' own shards stay readable, their
    forward is refused with the reason."""
    before = nb.value("listening()")
    for cell, name, reason in ((TP_CELL, "tp_model", "made on the process group of a ranch call"),
                               (FSDP2_CELL, "fsdp_model", "sharded on the process group of a ranch call")):
        shown = []
        for _ in range(2):
            shown.append(lines(nb.ok(cell)))
            assert nb.value("listening()") == before
        assert shown[0] == shown[1] and [line[:9] for line in shown[0]] == ["[rank 0] ", "[rank 1] "]
        kept = nb.value(f"round({name}[0].weight.to_local().sum().item(), 6)")
        assert kept == float(shown[0][0][9:])  # rank 0's shard, kept in the notebook
        assert reason in nb.fails(f"{name}(torch.ones(1, 4))", "RuntimeError").error_text()


def test_the_kernels_excepthook_is_its_own_after_ranch_and_ranch_cells(nb, tmp_path):
    """init_process_group wraps sys.excepthook in a "[rank0]: " one (torch's c10d). IPython swaps
    the hook around each cell, which hid it after a blocking call; a call in the background whose
    group came up between cells left the kernel with torch's hook for good."""
    go, done = tmp_path / "go", tmp_path / "done"
    nb.ok("import sys\nbetween_cells = []  # the kernel's hook, as IPython finds it before each cell\n"
          "get_ipython().events.register('pre_run_cell', lambda info: between_cells.append(sys.excepthook))")
    nb.ok("ranch(2, lambda: dist.get_rank(), ctx=in_torchddp())")
    nb.ok("%%ranch 2 --ddp\ndist.get_rank()")
    nb.ok(f"def group_between_cells():\n"
          f"    while not os.path.exists({str(go)!r}):\n"
          f"        time.sleep(0.01)\n"
          f"    dist.init_process_group('gloo')\n"
          f"    dist.destroy_process_group()\n"
          f"    return dist.is_initialized()\n"
          f"work = ranch(2, group_between_cells, wait=False)\n"
          f"work.add_done_callback(lambda work: open({str(done)!r}, 'w').close())")
    go.touch()  # the kernel is idle (no cell runs): the group comes up and goes between cells
    deadline = time.monotonic() + 60
    while not done.exists():
        assert time.monotonic() < deadline, "the background call did not end"
        time.sleep(0.05)
    assert nb.value("work.result()") == [False, False]
    hooks = nb.value("[getattr(h, '__qualname__', repr(h)) for h in between_cells]")
    assert set(hooks) == {"IPKernelApp.excepthook"}, hooks
    ran = nb.fails("1 / 0", "ZeroDivisionError")
    assert "[rank0]" not in ran.error_text()


# -- persistent cells ---------------------------------------------------------------------------

def test_a_rank_failing_before_a_cells_own_init_ends_the_cell_and_keeps_state(dist):
    ran = dist.fails('if rank == 1:\n'
                     '    raise FileNotFoundError(f"shard 1 is missing AT {time.time():.3f}")\n'
                     'dist.init_process_group("gloo")\n', "CollectiveError")
    text = ran.error_text()
    assert "rank 1 raised FileNotFoundError: shard 1 is missing" in text
    assert "rank 0 was left waiting in dist.init_process_group" in text
    assert _ended_at(ran) - _failed_at(text) < ENDS_WITHIN
    assert lines(dist.ok("x")) == ["[rank 0] 0", "[rank 1] 10"]


def test_a_cell_that_makes_and_destroys_its_own_group_then_sync_and_dist_restart(dist):
    """A torchrun script pasted into a persistent cell runs as it is (the Session's group steps
    aside); the ranks are then without a group, and %sync, the next collective and %dist_restart
    say so and bring the Session's back."""
    ran = dist.ok("os.environ['MASTER_ADDR'] = 'localhost'; os.environ['MASTER_PORT'] = '12355'\n"
                  "dist.init_process_group('gloo', rank=rank, world_size=world_size)\n"
                  "t = torch.tensor([rank + 1.0]); dist.all_reduce(t)\n"
                  "dist.destroy_process_group()\n"
                  "t.item()")
    assert lines(ran) == ["[rank 0] 3.0", "[rank 1] 3.0"]
    assert "no process group; %dist_restart brings the Session's group back" in texts(dist.ok("%sync"))
    ran = dist.fails("dist.all_reduce(t)", "RankRaisedError")
    assert "%dist_restart (Session.restart()) brings the Session's group back" in ran.error_text()
    assert "the Session's process group is rebuilt on every rank" in texts(dist.ok("%dist_restart"))
    assert lines(dist.ok("%sync")) == ["ranks 0, 1 in sync"]
    assert lines(dist.ok("dist.all_reduce(t); t.item()")) == ["[rank 0] 6.0", "[rank 1] 6.0"]


def test_a_cell_that_makes_its_own_group_over_the_sessions_keeps_it(dist):
    ran = dist.ok("dist.init_process_group('gloo')\nu = torch.tensor([1.0]); dist.all_reduce(u); u.item()")
    assert lines(ran) == ["[rank 0] 2.0", "[rank 1] 2.0"]
    assert lines(dist.ok("%sync")) == ["ranks 0, 1 in sync (a barrier on the group a cell made)"]


# -- nbdistributed's magics, as its users type them ------------------------------------------------

def test_nbdistributed_style_notebook_runs_to_the_end():
    """The magics in the order nbdistributed's demo notebook uses them (rank count by -n, on
    CPU): every cell runs, but the one that raises on rank 1 on purpose."""
    cells = [
        "%load_ext mpify_nb",
        "%dist_debug",
        "%dist_init --num-processes 2",
        "%dist_shutdown",
        "%dist_init -n 2",
        "%dist_status",
        "%%distributed\nimport torch\nimport torch.distributed as dist\n"
        "print(f'Hello from rank {rank}/{world_size-1}')",
        "%%distributed\ntensor = torch.tensor([0 + rank, 1 + rank, 2 + rank])\nprint(f'Rank {rank} tensor: {tensor}')",
        "%%distributed\ndist.all_reduce(tensor, op=dist.ReduceOp.SUM)\nprint(f'Rank {rank} after: {tensor}')",
        "%%rank [0]\nmaster_data = torch.tensor([1, 2, 3])\nprint(f'Master data: {master_data}')",
        "%%rank[1]\nprint('only rank 1')",
        "%sync",
        "%%distributed\nb = torch.tensor([1., 2., 3.]) if rank == 0 else torch.zeros(3)\ndist.barrier()\n"
        "dist.broadcast(b, src=0)\ndist.barrier()\nprint(f'Rank {rank} after broadcast: {b}')",
        "%%distributed\nif rank == 1:\n    undefined_variable\nelse:\n    print(f'Rank {rank} executes successfully')",
        "%%distributed\nprint(f'Rank {rank} executes successfully')",
        "%dist_shutdown --force",
        "%dist_debug",
        "%dist_init --num-ranks 4",
        "%dist_status",
        "%%rank [0,2]\nprint(f'This runs on even ranks: {rank}')",
        "%%rank[1-3]\nprint(f'This runs on ranks 1 through 3: {rank}')",
        "%dist_shutdown",
    ]
    done = nbutil.run_cells(cells, timeout=120, allow_errors=True)
    failed = [i for i, c in enumerate(done) if nbutil.errors(c)]
    assert failed == [13], [(i, nbutil.all_text(done[i])[-500:]) for i in failed]
    assert "NameError: name 'undefined_variable' is not defined" in nbutil.all_text(done[13])
    assert "nbdistributed's %dist_debug showed the workers' state" in nbutil.all_text(done[1])
    assert "tensor([1, 3, 5])" in nbutil.all_text(done[8])
    assert "after broadcast: tensor([1., 2., 3.])" in nbutil.all_text(done[12])
    assert "2 ranks stopped" in nbutil.all_text(done[15])
    assert "4 ranks ready" in nbutil.all_text(done[17])
    assert sorted(re.findall(r"runs on ranks 1 through 3: (\d)", nbutil.all_text(done[20]))) == ["1", "2", "3"]


# -- scripts from the PyTorch examples and tutorials, against torchrun -----------------------------

SCRIPT = nbutil.REPO_ROOT / "tests" / "scripts" / "bring_your_script.py"
SCRIPT_CELL = SCRIPT.read_text().split('if __name__ == "__main__":')[0]


def _results_of(cell) -> list:
    import ast

    return ast.literal_eval(nbutil.stream_text(cell).strip().splitlines()[-1])


@pytest.mark.timeout(600)  # four torchrun runs and twelve cells: ~3 min beside another pytest worker on 2 cores
def test_examples_and_tutorials_scripts_give_torchruns_numbers_run_after_run():
    """pytorch/examples' multigpu.py style (mp.spawn's main(rank, world_size), its own ddp_setup on
    a fixed MASTER_PORT), pytorch/tutorials' dist_tuto (init_process sets its port, run() sends,
    receives, all-reduces), pytorch/examples' tensor parallel (init_device_mesh, parallelize_module)
    and FSDP2 (fully_shard per layer, Adam) pasted into a notebook: the same numbers as torchrun,
    every run; multigpu_torchrun.py's twin (the group from the environment) as well."""
    expected = {name: nbutil.torchrun_results(SCRIPT, name) for name in ("multigpu", "dist_tuto", "tp", "fsdp2")}
    cells = nbutil.run_cells([
        "%load_ext mpify_nb\nimport json\nfrom mpify_nb import ranch",
        SCRIPT_CELL,
        *["print(ranch(2, main, 2, pass_rank=True))"] * 3,
        *["print(ranch(2, init_process, 2, run, pass_rank=True))"] * 2,
        *["print(ranch(2, tensor_parallel))"] * 2,
        *["print(ranch(2, fsdp2))"] * 2,
        "print(ranch(2, main_torchrun))",
        "%%ranch 2\n"  # the tutorial written as a module-level script: the cell is the script
        "import os\nrank, size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])\n"
        "os.environ['MASTER_ADDR'] = '127.0.0.1'; os.environ['MASTER_PORT'] = '29500'\n"
        "dist.init_process_group('gloo', rank=rank, world_size=size)\n"
        "module_level = run(rank, size)\n"
        "dist.destroy_process_group()\n"
        "module_level",
    ], timeout=360)
    multigpu = [_results_of(c) for c in cells[2:5]]
    tuto = [_results_of(c) for c in cells[5:7]]
    tp = [_results_of(c) for c in cells[7:9]]
    fsdp = [_results_of(c) for c in cells[9:11]]
    assert multigpu == [expected["multigpu"]] * 3
    assert tuto == [expected["dist_tuto"]] * 2
    assert tp == [expected["tp"]] * 2  # the notebook's own rank checked its DTensor's collectives too
    assert fsdp == [expected["fsdp2"]] * 2
    assert _results_of(cells[11]) == expected["multigpu"]
    shown = nbutil.all_text(cells[12])
    for rank in (0, 1):
        assert str(expected["dist_tuto"][rank]) in shown
