"""Spare ranks (issue 36): ranks forked before a call (on a GPU, made ready on it: rank/spare.py),
each used by one rank of one later call; capped, turned off, stopped when idle, never orphaned,
and a rank like any other once a call took it (its failures and mismatches are found alike).

On CPU they are off by default (nothing to get ready); ``set_spare_ranks(n)`` turns them on here,
which is how these tests reach every path but CUDA's own calls (mocked below).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import helpers_mismatch as hm
import helpers_ranks as hr
import mpify_nb
from mpify_nb.rank import imports_news, spare
from mpify_nb.start import spares, template
from mpify_nb.torchdist.checks import wrappers
from test_mismatch import HELPERS, STOPPED

NO_HANG = 120.0


@pytest.fixture(autouse=True)
def spare_ranks():
    cap, idle = spares._cap, spares._idle
    yield
    mpify_nb.set_spare_ranks(cap, idle=idle)
    spares.pool.drop_all()


def wait_until(condition, what: str, timeout: float = NO_HANG) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.02)


def ready_spares(count: int) -> dict[int, int]:
    """Wait until ``count`` spares are ready; {rank: pid}."""
    wait_until(lambda: sum(s["ready"] for s in spares.pool.status()) == count, f"{count} spares ready")
    return {s["rank"]: s["pid"] for s in spares.pool.status()}


def alive(pid: int) -> bool:
    """A live process (a zombie waits for its parent to reap it: it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] not in ("Z", "X")


def pid() -> int:
    return os.getpid()


def test_a_spare_is_used_by_one_rank_of_one_call_and_replaced():
    mpify_nb.set_spare_ranks(2)
    first = mpify_nb.ranch(3, pid)
    waiting = ready_spares(2)
    assert sorted(waiting) == [1, 2] and not set(waiting.values()) & set(first)
    second = mpify_nb.ranch(3, pid)
    assert second[1:] == [waiting[1], waiting[2]]  # the spares were these ranks
    after = ready_spares(2)
    assert not set(after.values()) & set(second)  # used once: new ones wait now
    third = mpify_nb.ranch(3, pid)
    assert third[1:] == [after[1], after[2]] and len(set(first + second + third) - {os.getpid()}) == 6


def test_spares_are_capped_and_a_rank_without_one_is_forked():
    mpify_nb.set_spare_ranks(1)
    mpify_nb.ranch(3, pid)
    waiting = ready_spares(1)
    assert list(waiting) == [1]
    second = mpify_nb.ranch(3, pid)
    assert second[1] == waiting[1] and second[2] not in waiting.values()


def test_spares_turned_off_are_stopped_and_none_start():
    mpify_nb.set_spare_ranks(2)
    mpify_nb.ranch(3, pid)
    waiting = ready_spares(2)
    mpify_nb.set_spare_ranks(0)
    assert spares.pool.status() == []
    wait_until(lambda: not any(alive(p) for p in waiting.values()), "the spares stopped")
    mpify_nb.ranch(3, pid)
    time.sleep(0.5)  # the pool's thread would fork them now
    assert spares.pool.status() == [] and not [t for t in threading.enumerate() if t.name == "mpify_nb-spares"]


def test_by_default_there_are_no_spares_on_cpu():
    mpify_nb.set_spare_ranks("auto")
    mpify_nb.ranch(3, pid)
    time.sleep(0.5)
    assert spares.pool.status() == [] and not [t for t in threading.enumerate() if t.name == "mpify_nb-spares"]


def test_idle_spares_are_stopped_and_their_thread_ends():
    mpify_nb.set_spare_ranks(2, idle=1.0)
    mpify_nb.ranch(3, pid)
    waiting = ready_spares(2)
    wait_until(lambda: not any(alive(p) for p in waiting.values()), "the idle spares stopped")
    assert spares.pool.status() == []
    wait_until(lambda: not [t for t in threading.enumerate() if t.name == "mpify_nb-spares"], "its thread ended")


def test_the_settings_and_their_variables(monkeypatch):
    with pytest.raises(ValueError, match="set_spare_ranks takes 'auto', True/False or a number >= 0, not -1"):
        mpify_nb.set_spare_ranks(-1)
    with pytest.raises(ValueError, match="idle must be a positive number of seconds, not 0"):
        mpify_nb.set_spare_ranks(2, idle=0)
    monkeypatch.setenv("MPIFY_NB_SPARE_RANKS", "3")
    monkeypatch.setenv("MPIFY_NB_SPARE_IDLE", "42")
    assert spares._from_environment() == (3, 42.0)
    monkeypatch.setenv("MPIFY_NB_SPARE_RANKS", "off")
    assert spares._from_environment()[0] == 0
    mpify_nb.set_spare_ranks(False)
    assert spares._cap == 0
    mpify_nb.set_spare_ranks(True)
    assert spares._cap == "auto"


def test_a_replaced_template_takes_its_spares_with_it(monkeypatch):
    mpify_nb.set_spare_ranks(2)
    mpify_nb.ranch(3, pid)
    waiting = ready_spares(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read at import time: the next call needs a new template
    second = mpify_nb.ranch(3, pid)
    assert not set(second) & set(waiting.values())
    wait_until(lambda: not any(alive(p) for p in waiting.values()), "the old template's spares stopped")


@pytest.mark.parametrize("how", ["raises", "sigkill"])
def test_a_failing_spare_rank_is_reported_as_a_fresh_one(tmp_path, how):
    mpify_nb.set_spare_ranks(2)
    mpify_nb.ranch(3, pid)
    waiting = ready_spares(2)
    if how == "raises":
        with pytest.raises(mpify_nb.RankRaisedError) as info:
            mpify_nb.ranch(3, hr.raise_on, 1, str(tmp_path), 60, timeout=NO_HANG)
        assert info.value.rank == 1 and "ValueError: boom from rank 1" in str(info.value)
    else:
        with pytest.raises(mpify_nb.RankExitedError) as info:
            mpify_nb.ranch(3, hr.die_on, 2, "sigkill", str(tmp_path), 60, timeout=NO_HANG)
        assert info.value.rank == 2 and "SIGKILL" in str(info.value)
    recorded = {json.loads((tmp_path / f"{r}.json").read_text())[0] for r in (1, 2)}
    assert recorded == set(waiting.values())  # they were the spares


@pytest.mark.parametrize("check", ["on", "off"])
def test_a_mismatch_between_spare_ranks_is_found(check, monkeypatch):
    """By the collective check (on by default; installed in the template, so in the spares forked
    from it) before any rank enters the collective, or with the check off, by the watch. The
    spares were forked with the check on: the call's setting is what holds."""
    mpify_nb.set_spare_ranks(2)
    mpify_nb.ranch(2, pid, caller_rank=None)
    waiting = ready_spares(2)
    if check == "off":
        monkeypatch.setenv(wrappers.VARIABLE, "0")
        monkeypatch.setattr(wrappers, "_on", [False])
    with pytest.raises(mpify_nb.errors.CollectiveError) as info:
        mpify_nb.ranch(2, hm.op_mismatch, ctx=mpify_nb.in_torchddp(), caller_rank=None, timeout=60)
    found = "wait in" if check == "off" else "called"
    assert str(info.value) == (
        f"the ranks {found} collectives that cannot match (a different op): rank 0 at {HELPERS}, line "
        f"{hm.line_of('op_mismatch rank 0')}: all_reduce #2 of float32[4]; rank 1 at line "
        f"{hm.line_of('op_mismatch rank 1')}: broadcast #2 of float32[4] from rank 0; {STOPPED}")
    assert {s["pid"] for s in spares.pool.status()}.isdisjoint(waiting.values())  # they were used


def test_spares_die_with_a_notebook_killed_with_sigkill(tmp_path):
    src = str(Path(__file__).resolve().parent.parent / "src")
    script = textwrap.dedent("""
        import json, os, sys, time
        import mpify_nb
        from mpify_nb.start import spares
        mpify_nb.set_spare_ranks(2)
        mpify_nb.ranch(3, os.getpid)
        while sum(s["ready"] for s in spares.pool.status()) < 2:
            time.sleep(0.02)
        print(json.dumps([s["pid"] for s in spares.pool.status()]), flush=True)
        time.sleep(3600)
    """)
    env = dict(os.environ, PYTHONPATH=src)
    env.pop("MPIFY_NB_CHILD", None)
    notebook = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = notebook.stdout.readline()  # type: ignore[union-attr]
        waiting = json.loads(line)
        assert len(waiting) == 2 and all(alive(p) for p in waiting)
    finally:
        notebook.send_signal(signal.SIGKILL)
        notebook.wait()
    wait_until(lambda: not any(alive(p) for p in waiting), "the spares died with the notebook", timeout=30)


# -- the GPU's side, CUDA mocked (no GPU here) ---------------------------------------------------

def test_a_spare_gets_its_gpu_ready_and_leaves_nothing_allocated(monkeypatch):
    import torch

    done: list = []
    for name, call in [("set_device", "set_device"), ("synchronize", "synchronize"),
                       ("current_blas_handle", "cublas"), ("empty_cache", "empty_cache"),
                       ("reset_peak_memory_stats", "reset_peak"),
                       ("reset_accumulated_memory_stats", "reset_accumulated")]:
        monkeypatch.setattr(torch.cuda, name, lambda *a, _c=call: done.append((_c,) + a))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: done.append(("nccl",)) or (2, 28, 9))
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: done.append(("clear_workspaces",)),
                        raising=False)
    environ = dict(os.environ)
    try:
        report = spare.prepare({"env": dict(environ, CUDA_VISIBLE_DEVICES="3,2"), "device": 1})
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,2"  # set before CUDA started
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert report["cuda"] is True and report["error"] == "" and sorted(report["seconds"]) == ["context", "cublas",
                                                                                               "nccl"]
    assert done == [("set_device", 1), ("synchronize", 1), ("nccl",), ("cublas",), ("clear_workspaces",),
                    ("empty_cache",), ("reset_peak", 1), ("reset_accumulated", 1)]


def test_a_spare_whose_gpu_fails_says_why():
    report = spare.prepare({"env": dict(os.environ), "device": 0})  # no CUDA on this machine
    assert report["cuda"] is False and report["error"].startswith("context: ")


def test_auto_keeps_a_spare_for_each_rank_that_used_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(spares, "_cap", "auto")
    spares.pool.plan = {1: 0, 2: None, 3: 2}
    assert spares.pool._wanted() == {1: 0, 3: 2}
    monkeypatch.setattr(spares, "_cap", 1)
    assert spares.pool._wanted() == {1: 0}
    spares.pool.plan = {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert imports_news.gpu_used() == 3  # what a rank reports at the end of its call (GPU_USED)


def test_after_the_spares_template_grew_a_spare_is_no_use(tmp_path):
    """A spare born before the template took in more modules lacks them: a fresh rank is forked."""
    mpify_nb.set_spare_ranks(2)
    mpify_nb.ranch(3, pid)
    waiting = ready_spares(2)
    client = template.get_template()
    client.grow(["wave"])
    assert client.wait_grown(NO_HANG, NO_HANG)
    assert spares.pool.take(client, 1) is None
    wait_until(lambda: not alive(waiting[1]), "the stale spare stopped")


def claim_a_gpu(device: int) -> int:
    """As if this rank had made a CUDA context on ``device`` (there is no GPU here)."""
    import torch

    torch.cuda.is_initialized = lambda: True
    torch.cuda.current_device = lambda: device
    return device


def test_the_gpu_each_spawned_rank_used_reaches_the_caller_at_the_calls_end():
    """What auto spares are planned from: each rank says, before its answer, which GPU it used."""
    mpify_nb.set_spare_ranks(0)  # the plan is kept; no spare starts
    assert mpify_nb.ranch(2, claim_a_gpu, 5, caller_rank=None) == [5, 5]
    assert spares.pool.plan == {0: 5, 1: 5}
    assert mpify_nb.ranch(3, pid) and spares.pool.plan == {1: None, 2: None}  # rank 0: the caller's own
