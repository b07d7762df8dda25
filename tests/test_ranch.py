"""ranch's API: what a call returns, what each rank sees, what the caller keeps, and
which arguments are refused before anything starts.

Rank code lives in helpers_ranks (cheap to import on a rank); functions defined inside
a test travel by value, as a notebook's would.
"""

# Fixtures come from helpers_ranch by import; their parameters shadow the imported names.
# ruff: noqa: F811

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import helpers_ranks as hr
import mpify_nb
from helpers_ranch import (  # noqa: F401  (method, scripts: fixtures)
    BOTH_METHODS,
    assert_gone,
    finish,
    method,
    no_rank_started,
    scripts,
    start_script,
)
from mpify_nb import PayloadError, RankRaisedError, distributed, in_torchddp

WORLD_VARS = hr.WORLD_VARS


@pytest.fixture
def clean_world_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller starts without RANK & co, so a leftover would show."""
    for name in WORLD_VARS:
        monkeypatch.delenv(name, raising=False)


# -- results ----------------------------------------------------------------------------------

@BOTH_METHODS
def test_results_gathered_by_rank(method):
    results = mpify_nb.ranch(3, hr.rank_and_identity)
    assert [r for r, _ in results] == [0, 1, 2]
    pids = [ident[0] for _, ident in results]
    assert pids[0] == os.getpid()  # the caller is rank 0
    assert len(set(pids)) == 3
    assert_gone([ident for _, ident in results[1:]])  # spawn, execute, terminate


def test_caller_rank_none_all_ranks_new():
    results = mpify_nb.ranch(3, hr.rank_and_identity, caller_rank=None)
    assert [r for r, _ in results] == [0, 1, 2]
    assert os.getpid() not in [ident[0] for _, ident in results]
    assert_gone([ident for _, ident in results])


def test_caller_rank_1(clean_world_env):
    results = mpify_nb.ranch(3, hr.world_env, caller_rank=1)
    assert [int(env["RANK"]) for env in results] == [0, 1, 2]
    pids = mpify_nb.ranch(3, hr.rank_and_identity, caller_rank=1)
    assert pids[1][1][0] == os.getpid()
    assert os.getpid() not in (pids[0][1][0], pids[2][1][0])


def test_gather_false():
    assert mpify_nb.ranch(3, hr.echo, 7, gather=False) == (0, (7,), {})
    assert mpify_nb.ranch(3, hr.echo, 7, caller_rank=2, gather=False) == (2, (7,), {})
    assert mpify_nb.ranch(3, hr.echo, 7, caller_rank=None, gather=False) is None


def test_args_and_kwargs_pass_through():
    results = mpify_nb.ranch(2, hr.echo, 1, "two", [3.0], key={"k": (4, None)}, other=b"x")
    for r, (rank, args, kwargs) in enumerate(results):
        assert rank == r
        assert args == (1, "two", [3.0])
        assert kwargs == {"key": {"k": (4, None)}, "other": b"x"}


def test_functions_defined_in_a_test_travel_by_value():
    offset = 5

    def closure(x):
        return x + offset + int(os.environ["RANK"])

    assert mpify_nb.ranch(3, closure, 10) == [15, 16, 17]
    assert mpify_nb.ranch(2, lambda: int(os.environ["WORLD_SIZE"]) * 2) == [4, 4]


# -- the world each rank sees -------------------------------------------------------------------

@BOTH_METHODS
def test_world_env_in_every_rank_and_in_the_caller(method, clean_world_env):
    before = dict(os.environ)
    results = mpify_nb.ranch(3, hr.world_env)  # rank 0's is the caller's own os.environ
    for r, env in enumerate(results):
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == results[0]["MASTER_PORT"]
        assert 0 < int(env["MASTER_PORT"]) < 65536
    assert dict(os.environ) == before  # and gone again from the caller


def test_master_port_differs_between_calls():
    first = mpify_nb.ranch(2, hr.world_env)[1]["MASTER_PORT"]
    second = mpify_nb.ranch(2, hr.world_env)[1]["MASTER_PORT"]
    assert first != second


@pytest.mark.parametrize("fail", [False, True])
def test_cwd_and_environ_restored(fail, tmp_path):
    """User code on the caller's rank may chdir and set variables: the caller gets its own back,
    also when the code raised."""
    before_env, before_cwd = dict(os.environ), os.getcwd()
    if fail:
        with pytest.raises(RankRaisedError, match="wandered off"):
            mpify_nb.ranch(2, hr.wander, str(tmp_path), True)
    else:
        assert mpify_nb.ranch(2, hr.wander, str(tmp_path), False) == [str(tmp_path)] * 2
    assert os.getcwd() == before_cwd
    assert dict(os.environ) == before_env


def test_sigint_handler_restored():
    """The caller's SIGINT handler is its own again after a call (a success and a failure)."""
    before = signal.getsignal(signal.SIGINT)
    mpify_nb.ranch(2, hr.rank)
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(RankRaisedError):
        mpify_nb.ranch(2, hr.wander, os.getcwd(), True)
    assert signal.getsignal(signal.SIGINT) is before
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    assert wakeup == -1


@BOTH_METHODS
def test_ranks_see_what_the_caller_just_changed(method, monkeypatch, tmp_path):
    """An env variable set, a directory chdir'ed to and a sys.path entry added just before
    the call are what every rank sees (the template was started long before)."""
    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    module = f"mpify_test_mod_{uuid.uuid4().hex[:8]}"
    (module_dir / f"{module}.py").write_text("def hello():\n    return 'hello from ' + __name__\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.setenv("MPIFY_TEST_FROM_CALLER", "1")
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(module_dir))
    results = mpify_nb.ranch(3, hr.probe_callers_world, module, caller_rank=None)
    assert results == [("1", str(workdir), f"hello from {module}")] * 3


@BOTH_METHODS
def test_nothing_of_a_call_leaks_into_the_next(method):
    mpify_nb.ranch(2, hr.leave_traces, "left behind", caller_rank=None)
    assert hr.LEAKY is None
    traces = mpify_nb.ranch(2, hr.find_traces, caller_rank=None)
    assert traces == [dict.fromkeys(["module global", "__main__ global", "environ", "module attribute"])] * 2


# -- need=, imports=, import_star -----------------------------------------------------------------

def test_need_defines_main_globals_on_ranks(monkeypatch):
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "MPIFY_NEEDED", {"lr": 0.1}, raising=False)
    monkeypatch.setattr(main, "MPIFY_NEEDED_TOO", [1, 2], raising=False)
    without = mpify_nb.ranch(2, hr.main_globals, "MPIFY_NEEDED", caller_rank=None)
    assert without == [{}, {}]  # a rank's __main__ is fresh: need= is what brings them
    results = mpify_nb.ranch(2, hr.main_globals, "MPIFY_NEEDED", "MPIFY_NEEDED_TOO",
                             need="MPIFY_NEEDED, MPIFY_NEEDED_TOO", caller_rank=None)
    assert results == [{"MPIFY_NEEDED": "{'lr': 0.1}", "MPIFY_NEEDED_TOO": "[1, 2]"}] * 2


def test_need_with_a_missing_name():
    with no_rank_started(), pytest.raises(PayloadError) as info:
        mpify_nb.ranch(2, hr.rank, need="mpify_surely_not_defined_anywhere")
    assert "mpify_surely_not_defined_anywhere" in str(info.value)


def test_imports_run_in_every_rank():
    results = mpify_nb.ranch(2, hr.main_globals, "J", "PP", imports="import json as J\nimport pprint as PP",
                             caller_rank=None)
    assert [sorted(r) for r in results] == [["J", "PP"]] * 2
    assert "module 'json'" in results[0]["J"]


def test_imports_with_a_syntax_error():
    with no_rank_started(), pytest.raises(PayloadError, match="imports="):
        mpify_nb.ranch(2, hr.rank, imports="import (")


def test_import_star():
    assert mpify_nb.ranch(2, hr.use_import_star, caller_rank=None) == [(True, '{"joined": "a/b"}')] * 2
    # and the next call's __main__ is clean again
    assert mpify_nb.ranch(2, hr.main_globals, "dumps", caller_rank=None) == [{}, {}]


def test_import_star_in_the_caller():
    ns: dict = {}
    mpify_nb.import_star("json", ns)
    assert ns["dumps"]([1]) == "[1]"
    assert set(ns) == set(__import__("json").__all__)


# -- @distributed -------------------------------------------------------------------------------

def test_distributed_decorator(monkeypatch):
    @distributed(2)
    def where(x, y=0):
        return x + y + int(os.environ["RANK"])

    assert where(10, y=5) == [15, 16]
    monkeypatch.setenv("RANK", "7")
    assert where.local(1) == 8  # the plain function, run here
    assert where.nprocs == 2
    assert where.__name__ == "where"


def test_distributed_decorator_with_ranch_options():
    ranks = distributed(3, caller_rank=None, gather=False)(hr.rank_and_identity)
    assert ranks() is None
    assert distributed(3, caller_rank=2)(hr.rank_and_identity)()[2][1][0] == os.getpid()


def test_distributed_ddp():
    @distributed(2, ddp=True)
    def world():
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    assert world() == [(0, 2), (1, 2)]
    with pytest.raises(TypeError):
        distributed(2, ddp=True, ctx=in_torchddp())


# -- bad arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args, kwargs, error, words",
    [
        ((0, hr.rank), {}, ValueError, "nprocs"),
        ((-1, hr.rank), {}, ValueError, "nprocs"),
        (("2", hr.rank), {}, ValueError, "nprocs"),
        ((True, hr.rank), {}, ValueError, "nprocs"),
        ((2, hr.rank), {"caller_rank": 2}, ValueError, "caller_rank"),
        ((2, hr.rank), {"caller_rank": -1}, ValueError, "caller_rank"),
        ((2, 42), {}, TypeError, "callable"),
        ((2, hr.rank), {"ctx": in_torchddp}, TypeError, "in_torchddp()"),
        ((2, hr.rank), {"ctx": 3}, TypeError, "context manager"),
        ((2, hr.rank), {"timeout": -1}, ValueError, "timeout"),
        ((2, hr.rank), {"timeout": 0}, ValueError, "timeout"),
        ((2, hr.rank), {"timeout": "10"}, ValueError, "timeout"),
    ],
    ids=["nprocs=0", "nprocs=-1", "nprocs=str", "nprocs=True", "caller_rank=2", "caller_rank=-1",
         "fn=42", "ctx=in_torchddp", "ctx=3", "timeout=-1", "timeout=0", "timeout=str"],
)
def test_bad_arguments(args, kwargs, error, words):
    with no_rank_started(), pytest.raises(error) as info:
        mpify_nb.ranch(*args, **kwargs)
    assert words in str(info.value)


def test_bad_start_method():
    with pytest.raises(ValueError, match="start method"):
        mpify_nb.set_start_method("fork")
    assert mpify_nb.get_start_method() in ("template", "spawn")


# -- a script without a __main__ guard ---------------------------------------------------------

@BOTH_METHODS
def test_script_without_main_guard(method, scripts):
    """Its top level (which calls ranch) runs once, in the caller: never again in a rank."""
    proc = start_script("no_guard.py", method=method)
    scripts.append(proc)
    out, err = finish(proc, timeout=120)
    assert proc.returncode == 0, f"{out}\n{err}"
    assert out.count("TOP-LEVEL-RAN") == 1, out
    assert f"TOP-LEVEL-RAN pid={proc.pid}" in out
    assert "RESULT [26, 27, 28]" in out


def test_template_shutdown_frees_it_and_the_next_call_starts_a_new_one():
    from mpify_nb.start import template

    old_pid = template.get_template().pid
    template.shutdown()
    assert not os.path.exists(f"/proc/{old_pid}") or open(f"/proc/{old_pid}/stat").read().split()[2] == "Z"
    assert [r for r, _ in mpify_nb.ranch(2, hr.rank_and_identity)] == [0, 1]
    assert template.get_template().pid != old_pid


def test_need_imports_and_import_star_reach_a_main_function_and_its_helpers():
    """A __main__ function travels with its own globals: names that only need=, imports= and
    import_star give (the caller never defines them) must still reach it and its helpers."""
    script = Path(__file__).parent / "scripts" / "notebook_like_imports.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([[6.0, 4.0, "given by need="]] * 2)
