"""Background work from Python: ``ranch(..., wait=False)`` and ``Session.run(..., wait=False)``,
real processes and a real gloo group. The handle (``BackgroundWork``), the ranks' state read while
the work runs (``Session.pull``), refusals while it holds the ranks, and what every blocking call
guards holding for it too: errors, ``timeout=``, a rank killed, a collective that can never finish,
``close()``, prompts. What a notebook sees (each output in the cell that started the work) is
test_background_kernel.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import pytest

import helpers_mismatch
import helpers_ranks
import presses
from helpers_ranks import start_time
from mpify_nb import BackgroundWork, RanksBusyError, Session, in_torchddp, ranch
from mpify_nb.wire.errors import CollectiveError, RankExitedError, RankRaisedError, SessionClosedError

TRAIN = ("import time\nsteps_done = 0\nlosses = []\n"
         "for step in range(100000):\n"
         "    losses.append(1.0 / (step + 1))\n"
         "    steps_done += 1\n"
         "    time.sleep(0.01)\n")


def until(condition, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.02)


def steps_done(session: Session, rank: int = 0) -> int:
    """How many steps rank ``rank`` has made so far (0 before the work defined the name)."""
    try:
        return session.pull("steps_done", rank=rank)
    except NameError:
        return 0


def alive(pid: int, start) -> bool:
    return start_time(pid) == start


@pytest.fixture
def session():
    s = Session(2)
    idents = {row.rank: (row.pid, start_time(row.pid)) for row in s.status()}
    yield s
    start = time.monotonic()
    s.close()
    print(f"close took {time.monotonic() - start:.2f} s")
    assert not any(alive(*ident) for ident in idents.values()), "close() left a rank running"


# -- ranch(..., wait=False) ---------------------------------------------------------------------------

def test_ranch_in_the_background_returns_at_once_and_its_result_is_the_calls():
    environ_before = os.environ.get("RANK")
    start = time.monotonic()
    work = ranch(2, helpers_ranks.steps, 20, 0.05, wait=False)
    assert time.monotonic() - start < 1.0  # 20 steps of 50 ms: it did not wait for them
    assert isinstance(work, BackgroundWork) and isinstance(work, concurrent.futures.Future)
    assert not work.done() and work.running() and work.ranks == [0, 1]
    assert repr(work).startswith("<BackgroundWork ranch(steps) on ranks [0, 1]: running for ")
    called = []
    work.add_done_callback(lambda done: called.append(done.result()[0]["rank"]))
    values = work.result(timeout=60)
    assert [v["rank"] for v in values] == [0, 1]
    # The caller's rank ran here, on the work's own thread; rank 1 in a process of its own.
    assert values[0]["pid"] == os.getpid() and values[0]["thread"] == "mpify_nb-background"
    assert values[1]["pid"] != os.getpid()
    assert called == [0] and work.done() and not work.cancelled() and work.exception() is None
    assert repr(work).startswith("<BackgroundWork ranch(steps) on ranks [0, 1]: finished after ")
    assert os.environ.get("RANK") == environ_before  # the caller's rank's variables are put back
    assert ranch(2, helpers_ranks.rank, gather=True) == [0, 1]  # the process is free again
    # gather=False and caller_rank=None as a blocking call has them
    assert ranch(2, helpers_ranks.rank, gather=False, wait=False).result() == 0
    assert ranch(2, helpers_ranks.rank, caller_rank=None, wait=False).result() == [0, 1]


def test_ranch_in_the_background_raises_the_calls_error_from_result():
    work = ranch(2, helpers_ranks.steps, 3, 0.01, 1, wait=False)
    with pytest.raises(RankRaisedError) as info:
        work.result(timeout=60)
    assert info.value.rank == 1 and "rank 1 fails after 3 steps" in str(info.value)
    assert isinstance(work.exception(), RankRaisedError) and not work.cancelled()
    assert repr(work).startswith("<BackgroundWork ranch(steps) on ranks [0, 1]: failed after ")
    assert "RankRaisedError: rank 1 raised ValueError" in repr(work)


def test_ranch_in_the_background_keeps_timeout_and_refuses_a_second_call_that_plays_a_rank(tmp_path):
    work = ranch(2, helpers_ranks.steps_until_file, str(tmp_path / "never"), timeout=1, wait=False)
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        work.result(timeout=60)
    go = tmp_path / "go"
    work = ranch(2, helpers_ranks.steps_until_file, str(go), wait=False)
    try:
        with pytest.raises(RanksBusyError) as info:  # the notebook plays rank 0 of the running work
            ranch(2, helpers_ranks.rank)
        message = str(info.value)
        assert "another call that plays a rank in this process is running" in message
        assert "the background work ranch(steps_until_file)" in message and ".cancel() stops it" in message
        assert info.value.work is work
        # Calls in which every rank is a new process run beside it.
        assert ranch(2, helpers_ranks.rank, caller_rank=None) == [0, 1]
        with pytest.raises(TimeoutError, match="still runs after 0.2 s; it goes on"):
            work.result(timeout=0.2)
        assert not work.done()
    finally:
        go.touch()
    assert work.result(timeout=60)[0] > 0


def test_cancel_stops_every_rank_of_a_ranch_in_the_background(tmp_path):
    work = ranch(2, helpers_ranks.steps_until_file, str(tmp_path / "never"), wait=False)
    until(lambda: bool(work.where().get(1)), what="a look at rank 1")
    where = work.where()
    assert sorted(where) == [0, 1]
    assert any("steps_until_file" in line for line in where[1].stack), where
    assert work.cancel() is True and work.cancelled() and work.done()
    with pytest.raises(concurrent.futures.CancelledError, match="ranch.steps_until_file. was cancelled"):
        work.result()
    with pytest.raises(concurrent.futures.CancelledError):
        work.exception()
    assert work.cancel() is True  # again: it stays cancelled
    assert repr(work).startswith("<BackgroundWork ranch(steps_until_file) on ranks [0, 1]: cancelled after ")
    assert ranch(2, helpers_ranks.rank) == [0, 1]  # nothing of it is left in the way
    done = ranch(2, helpers_ranks.rank, wait=False)
    done.result(timeout=60)
    assert done.cancel() is False and not done.cancelled() and done.result() == [0, 1]


def test_the_stop_button_stops_the_cell_not_the_background_work(tmp_path, sigint_handler):
    go = tmp_path / "go"
    work = ranch(2, helpers_ranks.steps_until_file, str(go), wait=False)
    until(lambda: bool(work.where().get(1)), what="a look at rank 1")
    with pytest.raises(KeyboardInterrupt):  # what a cell waiting for something else gets
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    time.sleep(0.5)
    assert not work.done()  # it goes on
    presses.press_when_waiting_in("result")
    with pytest.raises(KeyboardInterrupt, match="stopped waiting; the background work ranch"):
        work.result()  # a wait the stop button ends: the work goes on
    assert not work.done()
    go.touch()
    assert work.result(timeout=60)[1] > 0


def test_a_ranch_in_the_background_guards_what_a_blocking_one_does(tmp_path):
    # A peer that returned without joining the collective the notebook's rank 0 waits in, on the work's thread.
    work = ranch(2, helpers_mismatch.returns_early, ctx=in_torchddp(), wait=False)
    with pytest.raises(CollectiveError, match="rank 0"):
        work.result(timeout=60)
    # A rank killed mid-call.
    work = ranch(2, helpers_ranks.steps_until_file, str(tmp_path / "never"), str(tmp_path), wait=False)
    until(lambda: (tmp_path / "pid1").exists(), what="rank 1's pid")
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    with pytest.raises(RankExitedError) as info:
        work.result(timeout=60)
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
    assert ranch(2, helpers_ranks.rank) == [0, 1]


def test_a_cell_can_await_background_work():
    async def main():
        return await ranch(2, helpers_ranks.rank, wait=False)

    assert asyncio.run(main()) == [0, 1]

    async def failing():
        return await ranch(2, helpers_ranks.steps, 1, 0.0, 1, wait=False)

    with pytest.raises(RankRaisedError):
        asyncio.run(failing())


# -- Session.run(..., wait=False) ---------------------------------------------------------------------

def test_a_session_in_the_background_is_read_live_and_refuses_other_calls(session):
    session.run("import torch\nw = torch.zeros(262144)")  # 1 MB, updated in place by the work
    work = session.run(TRAIN + "    w += 1\n", wait=False)
    assert isinstance(work, BackgroundWork) and work.ranks == [0, 1]
    until(lambda: steps_done(session) > 5 and steps_done(session, 1) > 5, what="steps")
    first = session.pull("steps_done", rank=None)
    until(lambda: steps_done(session) > first[0] + 5, what="more steps")
    assert not work.done()
    losses = session.pull("losses", rank=1)
    assert losses[:3] == [1.0, 0.5, 1.0 / 3] and len(losses) >= first[1]
    w = session.pull("w")
    assert w.shape == (262144,) and w[0].item() >= first[0]
    with pytest.raises(NameError, match="name 'nope' is not defined on rank 0"):
        session.pull("nope")
    for refused in (lambda: session.run("1"), lambda: session.push(x=1), lambda: session.restart([1]),
                    lambda: session.run("1", wait=False), lambda: session.apply(helpers_ranks.rank)):
        with pytest.raises(RanksBusyError) as info:
            refused()
        assert str(info.value).startswith("ranks 0, 1 run the background work Session.run (running for ")
        assert "its .result() waits for it, its .cancel() stops it" in str(info.value)
        assert info.value.work is work
    assert [row.state for row in session.status()] == ["running", "running"]
    where = session.where()
    source = (TRAIN + "    w += 1\n").splitlines()
    for r in (0, 1):  # in the loop, its line's source known here (Session.run's code is in linecache)
        assert where[r].line is not None and where[r].line[1] in (5, 6, 7, 8), where
        assert source[where[r].line[1] - 1].strip() in "\n".join(where[r].stack), where
    assert sorted(work.where()) == [0, 1]
    assert "running for" in repr(work)
    pids = [row.pid for row in session.status()]
    assert work.cancel() is True
    with pytest.raises(concurrent.futures.CancelledError, match="Session.run was cancelled .interrupted"):
        work.result()
    # Stopped as the stop button stops a blocking call: the ranks and their state are kept.
    assert [row.pid for row in session.status()] == pids
    kept = session.run("steps_done")
    assert kept[0] >= first[0] and session.pull("steps_done") == kept[0]  # not running now: as it is
    assert session.run("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()") == \
        {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_a_session_in_the_background_ends_as_a_blocking_call_would(session):
    work = session.run("x = 1\n" + "import time\nfor _ in range(10):\n    time.sleep(0.02)\nrank * 10", wait=False)
    assert work.result(timeout=60) == {0: 0, 1: 10}
    assert session.run("x") == {0: 1, 1: 1}  # free as soon as result() returns
    work = session.run("raise ValueError(f'bad {rank}')", ranks=[1], wait=False)
    with pytest.raises(RankRaisedError, match="bad 1") as info:
        work.result(timeout=60)
    assert session.last_error is info.value
    work = session.run("import time\ntime.sleep(30)", wait=False, timeout=1)
    with pytest.raises(TimeoutError, match="did not finish within 1 s .* their state is kept"):
        work.result(timeout=60)
    # Nobody is at the starting cell to answer a prompt: the read raises, saying why.
    work = session.run("input('name? ')", ranks=[0], wait=False)
    with pytest.raises(RankRaisedError, match=r"StdinUnavailableError: rank 0 read its stdin .* in background "
                                              r"work \(Session.run\), where nobody can answer"):
        work.result(timeout=60)
    assert session.run("x") == {0: 1, 1: 1}


def test_a_collective_that_can_never_finish_ends_background_work_and_the_group_is_rebuilt(session):
    work = session.run("t = torch.ones(2)\ndist.all_reduce(t)", ranks=[0], wait=False)
    with pytest.raises(CollectiveError):
        work.result(timeout=60)
    assert session.run("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()") == \
        {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_a_rank_killed_during_background_work_fails_it_and_restart_replaces_it(session):
    session.run("kept = rank")
    work = session.run(TRAIN, wait=False)
    until(lambda: steps_done(session) > 2, what="steps")
    victim = session.status()[1].pid
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RankExitedError) as info:
        work.result(timeout=60)
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
    session.restart()
    assert session.status()[1].pid != victim
    assert session.run("globals().get('kept')") == {0: 0, 1: None}


def test_close_ends_background_work_and_its_ranks(session):
    work = session.run(TRAIN, wait=False)
    until(lambda: steps_done(session) > 2, what="steps")
    idents = [(row.pid, start_time(row.pid)) for row in session.status()]
    session.close()
    with pytest.raises(SessionClosedError):
        work.result(timeout=60)
    assert not any(alive(*ident) for ident in idents)
