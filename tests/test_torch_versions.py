"""The torch versions we claim (issue 31): the floor is stated the same everywhere, a torch below it
fails at once, and what older torches lack is made up for (torchdist/compat.py): a gloo group is
destroyed without deadlock, gloo's banner stays out of the output, a wait deeper in torch is seen
without the flight recorder (torchdist/hidden_waits.py), and a module's shared kernel recovers
from a failed test.

Most of this only shows on an old torch: ``nox -s floor`` runs these tests (and every
version-sensitive module) on the floor.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from mpify_nb.torchdist import compat, hidden_waits
from versions import TORCH

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


# -- the floor, stated once --------------------------------------------------------------------

def test_the_floor_is_the_same_in_the_metadata_the_code_the_ci_job_and_the_docs():
    floor = f"{compat.FLOOR[0]}.{compat.FLOOR[1]}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'"torch>=([\d.]+)"', pyproject) == [floor]
    noxfile = (ROOT / "noxfile.py").read_text()
    assert re.search(rf'^FLOOR_TORCH = "torch=={re.escape(floor)}\.\d+"$', noxfile, re.M), "noxfile's FLOOR_TORCH"
    for page in ["README.md", "docs/install.md", "docs/index.md"]:
        text = (ROOT / page).read_text()
        assert f"torch ≥ {floor}" in text, page
        assert not re.search(r"torch ?(≥|>=) ?2\.[0-35-9]\b", text), page


@pytest.mark.parametrize("text, version", [("2.4.1+cu121", (2, 4)), ("2.13.0", (2, 13)), ("2.9.0a0+gitabc", (2, 9)),
                                           ("2.5.0.dev20240801", (2, 5))])
def test_parse_version(text, version):
    assert compat.parse_version(text) == version


def test_a_torch_below_the_floor_fails_at_import_naming_both_versions():
    with pytest.raises(ImportError) as raised:
        compat.check_floor("2.1.2")
    assert str(raised.value).startswith(f"mpify_nb needs torch >= {compat.FLOOR[0]}.{compat.FLOOR[1]}, and this "
                                        "environment has torch 2.1.2: install a newer torch")
    compat.check_floor(f"{compat.FLOOR[0]}.{compat.FLOOR[1]}.0")
    compat.check_floor("3.0.0")
    # What a user sees: `import mpify_nb` with such a torch (one that claims 2.1.2, here).
    code = ("import sys, types\nsys.modules['torch'] = types.SimpleNamespace(__version__='2.1.2')\n"
            "import mpify_nb")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, MPIFY_NB_PREWARM="0"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"ImportError: mpify_nb needs torch >= {compat.FLOOR[0]}.{compat.FLOOR[1]}, and this environment has torch "
        "2.1.2"), done.stderr


# -- what older torches lack -------------------------------------------------------------------

def test_gloo_groups_made_and_destroyed_in_a_loop_never_hang():
    """Torch < 2.8: destroy_process_group deadlocked in gloo's destructor (its worker waiting for
    the GIL the destroying thread held): 4 of 15 such calls on 2.1, and here the second call on
    2.4. A hang ends the script at its timeout, and fails the test instead of stalling it."""
    process = subprocess.Popen([sys.executable, str(SCRIPTS / "ddp_loop.py"), "30"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env=dict(os.environ, MPIFY_NB_PREWARM="0"))
    try:
        out, _ = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"ranch(..., ctx=in_torchddp()) hung; its output:\n{out[-3000:]}")
    assert process.returncode == 0, out[-3000:]
    assert out.splitlines()[-1] == "all 30 calls"


def test_the_listen_fd_store_is_the_legacy_one_before_2_8():
    # torch 2.4-2.7: "The libuv TCPStore backend does not support initialization with an listen fd".
    assert compat.listen_fd_store_options() == ({} if TORCH >= (2, 8) else {"use_libuv": False})


def test_gloo_banner_lines_are_dropped_unless_a_peer_is_missing():
    ok = b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    short = b"[Gloo] Rank 0 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3\n"
    assert compat.drop_gloo_banner(b"before\n" + ok + b"after\n" + short) == b"before\nafter\n" + short


def test_a_ddp_call_prints_nothing_of_gloo_on_the_callers_stdout():
    """Torch 2.8 prints "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected
    peer ranks is : 1" from C++ on each rank's fd 1 as a group is made: the caller's (a notebook
    cell) and the ranks' (relayed with their label)."""
    code = "from mpify_nb import in_torchddp, ranch\nprint(ranch(2, int, ctx=in_torchddp()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, MPIFY_NB_PREWARM="0"))
    assert (done.returncode, done.stdout) == (0, "[0, 0]\n"), done.stderr


def test_the_banner_printed_on_fd_1_while_a_group_is_made_is_kept_out(capfd, monkeypatch):
    monkeypatch.setattr(compat, "gloo_prints_banner", lambda: True)
    banner = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    with compat.quiet_gloo_banner():
        os.write(1, b"mine 1\n" + banner + b"mine 2\n")
    os.write(1, b"after\n")
    assert capfd.readouterr().out == "mine 1\nmine 2\nafter\n"


def test_a_thread_asleep_inside_torch_is_seen_waiting_and_a_busy_one_is_not():
    """The collective watch's stand-in for gloo's recorder (torch < 2.8): a thread whose innermost
    frame is torch's and that sleeps without using CPU for IDLE_LOOKS looks waits; one that
    computes never does. (A torch future stands in for a collective's wait here.)"""
    future = torch.futures.Future()
    sleeper = threading.Thread(target=future.wait, daemon=True)
    stop = threading.Event()
    big = torch.randn(300, 300)

    def compute():
        while not stop.is_set():
            torch.nn.functional.softmax(big @ big, dim=0)

    busy = threading.Thread(target=compute, daemon=True)
    sleeper.start()
    busy.start()
    try:
        time.sleep(0.2)
        seen, busy_seen = [], []
        for _ in range(hidden_waits.IDLE_LOOKS + 5):
            seen.append(hidden_waits.look(sleeper.ident))
            busy_seen.append(hidden_waits.look(busy.ident))
            time.sleep(0.05)
    finally:
        stop.set()
        future.set_result(None)
        sleeper.join()
        busy.join()
    assert seen[:hidden_waits.IDLE_LOOKS] == [None] * hidden_waits.IDLE_LOOKS
    assert seen[hidden_waits.IDLE_LOOKS:] == ["Future.wait"] * 5
    assert busy_seen == [None] * (hidden_waits.IDLE_LOOKS + 5)


# -- a module's shared kernel recovers ----------------------------------------------------------

INNER_CONFTEST = """
import importlib.util, sys
sys.path.insert(0, {tests!r})
spec = importlib.util.spec_from_file_location("mpify_nb_tests_conftest", {conftest!r})
ours = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ours)
pytest_runtest_makereport = ours.pytest_runtest_makereport
_recover_shared_kernels = ours._recover_shared_kernels
"""

INNER_TESTS = """
import pytest
import nbutil
from test_session_magics import Kernel


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    def make():
        k = Kernel(tmp_path_factory.mktemp("k"))
        k.ok("%load_ext mpify_nb")
        k.ok("%dist_init -n 2")
        return k

    shared = nbutil.SharedKernel(make)
    yield shared
    shared.close()


def test_one_that_kills_rank_1_and_fails(dist):
    dist.run("%%rank [1]\\nimport os, signal\\nos.kill(os.getpid(), signal.SIGKILL)")
    assert False, "this test fails, and leaves rank 1 dead"


def test_the_next_one_has_both_ranks(dist):
    assert dist.ok("rank").shown() == ["[rank 0] 0\\n[rank 1] 1"]
    assert dist.recoveries == 1
"""


def test_a_module_kernel_recovers_from_a_failed_test_so_one_failure_shows_as_one(tmp_path):
    """Before: a module's kernel kept whatever a failed test left (a dead rank, a stuck cell), and
    every later test of the module failed with it (on torch 2.8, 5 after one)."""
    tests = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text(textwrap.dedent(INNER_CONFTEST).format(
        tests=str(tests), conftest=str(tests / "conftest.py")))
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    summary = done.stdout.strip().splitlines()[-1]
    assert re.match(r"1 failed, 1 passed in ", summary), done.stdout[-3000:]
    assert "FAILED test_inner.py::test_one_that_kills_rank_1_and_fails" in done.stdout
