"""The notebook's first DDP call as fast as its later ones (issue 36): what the first
``DistributedDataParallel(...)`` of a process imports (``torch._dynamo``: seconds) is imported
ahead, in a kernel between cells, on a background thread, holding the import lock, with no CUDA
context made.

Each case runs in a fresh kernel or interpreter (the first DDP of a process is the point); a
script prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

NO_HANG = 300
#: conftest.py starts the tests' kernels with MPIFY_NB_PREWARM=template; these cases are about the default.
DEFAULT_PREWARM = {"MPIFY_NB_PREWARM": "1"}

SRC = str(Path(__file__).resolve().parent.parent / "src")


def run_script(source: str, timeout: float = NO_HANG, **env: str) -> Any:
    environ = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    environ.pop("MPIFY_NB_CHILD", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], env=environ, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_in_a_kernel_the_first_ddp_call_imports_nothing_and_no_rank_imports_the_warmups_modules(notebook):
    """In a kernel the warm-up starts once the cell that imported mpify_nb has finished (the user
    writes the next one meanwhile): the notebook's first DDP (made, then its first forward) imports
    nothing, the template holds what a spawned rank's first DDP imports, and ranks do not import the
    warm-up's modules for the notebook (with preloading off they are born without them, and stay
    so); its training step drew no random number and made no CUDA context."""
    import nbutil

    cells = notebook([
        "import json, sys, torch\nimport mpify_nb\nmpify_nb.set_preload(True)\nrng = torch.random.get_rng_state()",
        "from mpify_nb.torchdist import warmup\nfrom mpify_nb.start import template\n"
        "print(warmup.wait(240), warmup.outcome, template.wait_preloaded(240))\n"
        "print(torch.equal(rng, torch.random.get_rng_state()), torch.cuda.is_initialized())  # its step drew nothing",
        "from mpify_nb import in_torchddp, ranch\n"
        "from mpify_nb.rank import imports_news\n"
        "def first_ddp():\n"
        "    from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "    before = set(sys.modules)\n"
        "    DDP(torch.nn.Linear(4, 4))(torch.ones(2, 4)).sum().backward()  # made, a step\n"
        "    return sorted(set(sys.modules) - before), 'torch._dynamo' in imports_news._born_with\n"
        "found = ranch(2, first_ddp, ctx=in_torchddp())\n"
        "mpify_nb.set_preload(False)\n"
        "print(json.dumps({'notebook': found[0][0], 'rank_born_with_it': found[1][1], "
        "'cuda': torch.cuda.is_initialized(), "
        "'ranks_hold': ranch(2, lambda: 'torch._dynamo' in sys.modules, caller_rank=None)}))",
    ], timeout=300, env=DEFAULT_PREWARM)
    assert nbutil.stream_text(cells[1]) == "True imported True\nTrue False\n"
    assert json.loads(nbutil.stream_text(cells[2])) == {"notebook": [], "rank_born_with_it": True, "cuda": False,
                                                         "ranks_hold": [False, False]}


def test_the_warmup_works_only_while_no_cell_runs(notebook):
    """Cells run one after another (Run All, or a cell that runs long) leave it nothing to do: it never
    competes with a running cell for the CPU, the import lock or a fork. Before, it imported while the
    next cells ran (in CI, in nearly every short-lived test kernel). A cell that waits for it lets it go."""
    import nbutil

    cells = notebook([
        "import sys, time, torch\nimport mpify_nb\n"
        "from mpify_nb.torchdist import warmup\nfrom mpify_nb.start import template",
        "print(template.wait_started(240))\ntime.sleep(3)  # the template is ready: only this cell holds it back\n"
        "print(repr(warmup.outcome), 'torch._dynamo' in sys.modules)",
        "print(warmup.wait(240), warmup.outcome, 'torch._dynamo' in sys.modules)",
    ], timeout=300, env=DEFAULT_PREWARM)
    assert nbutil.stream_text(cells[1]) == "True\n'' False\n"
    assert nbutil.stream_text(cells[2]) == "True imported True\n"


def test_a_script_warms_nothing_up():
    """A script has no idle time between its calls: a warm-up would make them wait for its imports."""
    found = run_script("""
        import json, sys, threading, time
        import torch
        import mpify_nb
        from mpify_nb import in_torchddp, ranch
        from mpify_nb.torchdist import warmup
        ranch(2, lambda: 0, ctx=in_torchddp())
        time.sleep(1)
        print(json.dumps({"outcome": warmup.outcome, "dynamo": "torch._dynamo" in sys.modules,
                          "threads": [t.name for t in threading.enumerate() if "warm" in t.name]}))
    """)
    assert found == {"outcome": "", "dynamo": False, "threads": []}


def test_the_warmup_creates_no_cuda_context_where_cuda_is_available():
    # CUDA mocked (a CPU machine): available with one GPU, and anything that would make a context raises.
    found = run_script("""
        import json, os
        import torch
        made = []
        def make_context(*args, **kwargs):
            made.append(1)
            raise AssertionError("a CUDA context was made")
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch.cuda._lazy_init = make_context
        torch._C._cuda_init = make_context
        import mpify_nb  # MPIFY_NB_PREWARM=0: nothing starts at import; the test starts the warm-up
        from mpify_nb.torchdist import warmup
        os.environ["MPIFY_NB_PREWARM"] = "1"
        warmup.start()
        warmup.wait(240)
        print(json.dumps({"outcome": warmup.outcome, "contexts": len(made), "cuda": torch.cuda.is_initialized()}))
    """, MPIFY_NB_PREWARM="0")
    assert found == {"outcome": "imported", "contexts": 0, "cuda": False}


def test_a_fork_or_an_import_during_the_warmup_waits_for_its_end(tmp_path):
    """Holding the import lock: a fork (a DataLoader worker forked in the notebook) never copies a
    half-made module, and another thread's import never interleaves with the warm-up's."""
    (tmp_path / "slow_module.py").write_text("import time\nSTARTED = time.monotonic()\ntime.sleep(1.5)\n"
                                             "ENDED = time.monotonic()\n")
    (tmp_path / "other_module.py").write_text("import time\nSTARTED = time.monotonic()\n")
    found = run_script(f"""
        import json, os, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        import mpify_nb
        from mpify_nb.torchdist import warmup
        os.environ["MPIFY_NB_PREWARM"] = "1"
        warmup.start(modules=["slow_module"], need_torch=False)
        while "slow_module" not in sys.modules:
            time.sleep(0.001)  # it is inside the import now
        pid = os.fork()
        if pid == 0:
            os._exit(0 if hasattr(sys.modules["slow_module"], "ENDED") else 1)  # whole, or not at all
        forked = time.monotonic()
        child = os.waitpid(pid, 0)[1]
        import other_module
        warmup.wait(60)
        slow = sys.modules["slow_module"]
        print(json.dumps({{"child_saw_it_whole": os.waitstatus_to_exitcode(child) == 0,
                          "fork_after_end": forked >= slow.ENDED,
                          "import_after_end": other_module.STARTED >= slow.ENDED,
                          "outcome": warmup.outcome}}))
    """, MPIFY_NB_PREWARM="0")
    assert found == {"child_saw_it_whole": True, "fork_after_end": True, "import_after_end": True,
                     "outcome": "imported"}


def test_a_fork_during_the_warmup_of_a_module_that_logs_and_prints_does_not_deadlock(tmp_path):
    """``os.fork`` runs its ``before`` handlers, then takes the import lock: logging's handler took
    its lock, the relay's the streams, and the import the warm-up held the import lock for then
    waited for them (``logging.getLogger`` in a module of torch._dynamo). Before: the notebook hung
    for good (CI: a DataLoader with workers in the first calls after ``import torch``)."""
    (tmp_path / "logging_module.py").write_text(
        "import logging, sys, time\nSTARTED = time.monotonic()\ntime.sleep(1.0)\n"
        "log = logging.getLogger('logging_module.inner')\nprint('imported', file=sys.stderr)\n"
        "ENDED = time.monotonic()\n")
    found = run_script(f"""
        import json, os, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        import mpify_nb
        from mpify_nb.torchdist import warmup
        os.environ["MPIFY_NB_PREWARM"] = "1"
        warmup.start(modules=["logging_module"], need_torch=False)
        while "logging_module" not in sys.modules:
            time.sleep(0.001)  # it is inside the import now, before its getLogger
        pid = os.fork()
        if pid == 0:
            os._exit(0 if hasattr(sys.modules["logging_module"], "ENDED") else 1)
        forked = time.monotonic()
        child = os.waitpid(pid, 0)[1]
        warmup.wait(60)
        print(json.dumps({{"child_saw_it_whole": os.waitstatus_to_exitcode(child) == 0,
                          "fork_after_end": forked >= sys.modules["logging_module"].ENDED,
                          "outcome": warmup.outcome}}))
    """, timeout=60, MPIFY_NB_PREWARM="0")
    assert found == {"child_saw_it_whole": True, "fork_after_end": True, "outcome": "imported"}


def test_what_another_thread_imported_while_the_warmup_waited_is_the_notebooks(tmp_path):
    """The warm-up waits for another thread's import to end before it takes the import lock (the
    user's next cell importing fastai, say): what that import added is the notebook's, so the
    ranks' preamble keeps it. Before, every module imported during that wait was counted as the
    warm-up's and left out: fastai's patched Learner.fit_one_cycle was missing on rank 1."""
    (tmp_path / "users_slow_library.py").write_text("import time\ntime.sleep(1.5)\nimport users_patch\n")
    (tmp_path / "users_patch.py").write_text("PATCHED = True\n")
    (tmp_path / "warm_module.py").write_text("WARM = True\n")
    found = run_script(f"""
        import json, os, sys, threading, time
        sys.path.insert(0, {str(tmp_path)!r})
        from mpify_nb.torchdist import warmup
        os.environ["MPIFY_NB_PREWARM"] = "1"
        seen = []
        warmup.when_imported(seen.extend)
        user = threading.Thread(target=lambda: __import__("users_slow_library"))
        user.start()
        while "users_slow_library" not in sys.modules:
            time.sleep(0.001)  # the user's import has begun
        warmup.start(modules=["warm_module"], need_torch=False)
        warmup.wait(60)
        user.join()
        print(json.dumps({{"ours": sorted(seen), "outcome": warmup.outcome}}))
    """, MPIFY_NB_PREWARM="0")
    assert found == {"ours": ["warm_module"], "outcome": "imported"}


@pytest.mark.parametrize("prewarm, template_at_import", [("0", False), ("template", True), ("Template ", True)])
def test_no_warmup_starts_with_prewarm_off_or_template_only(notebook, prewarm, template_at_import):
    """MPIFY_NB_PREWARM=0: nothing starts at import; =template: the template does, and nothing is
    imported between cells (nor in the template, which is asked only by the warm-up)."""
    import nbutil

    cells = notebook([
        "import torch, mpify_nb",
        "import sys, time, threading\ntime.sleep(2)\nfrom mpify_nb.torchdist import warmup\n"
        "from mpify_nb.start import template\n"
        "print(repr(warmup.outcome), [t.name for t in threading.enumerate() if 'warm' in t.name], "
        "template.current_pid() is not None, 'torch._dynamo' in sys.modules)",
        "print(mpify_nb.ranch(2, lambda: 'torch._dynamo' in sys.modules, caller_rank=None))",
    ], env={"MPIFY_NB_PREWARM": prewarm})
    assert nbutil.stream_text(cells[1]) == f"'' [] {template_at_import} False\n"
    assert nbutil.stream_text(cells[2]) == "[False, False]\n"


def test_a_prewarm_value_it_cannot_be_is_named_and_taken_as_the_default():
    found = run_script("""
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from mpify_nb.torchdist import warmup
            print(json.dumps([warmup.prewarm_setting(), warmup.prewarm_setting(), [str(w.message) for w in caught]]))
    """, MPIFY_NB_PREWARM="yes")
    assert found == ["1", "1", ["MPIFY_NB_PREWARM='yes' is none of '1', 'template', '0': taken as '1' (the default)"]]


def test_the_warmup_looks_at_the_modules_ahead_so_the_first_calls_check_looks_only_at_what_came_since(tmp_path):
    """The collective check points every name an earlier import bound to torch's own call at its wrapper: a
    look at every module (~2,400, 14-26 ms) that the notebook's first call paid (its first DDP call 1.3x ->
    2.1x its later ones). The warm-up looks ahead between cells; a module imported after it is still found
    by the call's install, and both names are checked."""
    (tmp_path / "bound_before.py").write_text("from torch.distributed.distributed_c10d import scatter\n")
    (tmp_path / "bound_after.py").write_text("from torch.distributed import all_reduce as reduce_it\n")
    found = run_script(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import torch, torch.distributed
        import bound_before
        from mpify_nb.torchdist import warmup
        from mpify_nb.torchdist.checks import wrappers
        warmup.start()
        warmup.wait(240)
        ahead = "bound_before" in wrappers._scanned and "torch" in wrappers._scanned
        import bound_after
        wrappers.install_wrappers()
        checked = [m.scatter is wrappers._wrappers["scatter"] for m in (bound_before,)] + \\
                  [bound_after.reduce_it is wrappers._wrappers["all_reduce"]]
        wrappers.uninstall()
        print(json.dumps({{"outcome": warmup.outcome, "ahead": ahead, "checked": checked,
                          "own_again": bound_after.reduce_it is torch.distributed.all_reduce}}))
        """, MPIFY_NB_PREWARM="1")
    assert found == {"outcome": "imported", "ahead": True, "checked": [True, True], "own_again": True}, found
