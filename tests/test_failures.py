"""How ranch fails: every failure is reported (which rank, why), ends within seconds
instead of hanging, leaves no process behind, and the next call works.

Ranks record their (pid, start time) in a temporary directory as soon as they run
(helpers_ranks.record), so a test knows every rank even when the rank never answers,
and can check afterwards that each one is gone. Bounds on durations are loose
(30 s): they prove "no hang" (gloo's default is 30 minutes), not speed.
"""

# Fixtures come from helpers_ranch by import; their parameters shadow the imported names.
# ruff: noqa: F811

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import helpers_ranks as hr
import mpify_nb
from helpers_ranch import (  # noqa: F401  (method, scripts: fixtures)
    BOTH_METHODS,
    assert_gone,
    assert_next_call_works,
    current_template,
    finish,
    leak_snapshot,
    method,
    no_rank_started,
    records,
    scripts,
    start_script,
    wait_for_records,
)
from mpify_nb import RankError, RankExitedError, RankRaisedError, in_torchddp

NO_HANG = 30.0  # seconds: far below any built-in timeout, far above a slow shared machine


def others(found: dict, caller_rank=0) -> list:
    """The recorded identities of the ranks that are not the caller."""
    return [ident for r, ident in found.items() if r != caller_rank]


# -- a rank raises -------------------------------------------------------------------------

@BOTH_METHODS
def test_rank_raises_others_stopped(method, tmp_path):
    started = time.monotonic()
    with pytest.raises(RankRaisedError) as info:
        # rank 1 raises; ranks 0 (this process, in Python) and 2 (a process) sleep 60 s
        mpify_nb.ranch(3, hr.raise_on, 1, str(tmp_path), 60)
    assert time.monotonic() - started < NO_HANG
    err = info.value
    assert isinstance(err, RankError) and isinstance(err, RuntimeError)
    assert err.rank == 1
    message = str(err)
    assert message.startswith("rank 1 raised ValueError: boom from rank 1")
    assert "ValueError" in err.exc_type
    assert 'raise ValueError(f"boom from rank {target}")' in message  # the user's source line
    assert "helpers_ranks.py" in message
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "boom from rank 1"
    assert 'raise ValueError(f"boom from rank {target}")' in err.remote_traceback
    rendered = "\n".join(err._render_traceback_())  # what IPython shows instead of our frames
    assert "boom from rank 1" in rendered and "helpers_ranks.py" in rendered
    assert "mpify_nb/rank.py" not in rendered  # the library frames that led to user code are dropped
    found = records(tmp_path)
    assert sorted(found) == [0, 1, 2]
    assert_gone(others(found))
    assert_next_call_works()


def test_caller_rank_raises(tmp_path):
    """The caller's own rank raising is reported like any rank's, and stops the others."""
    started = time.monotonic()
    with pytest.raises(RankRaisedError) as info:
        mpify_nb.ranch(3, hr.raise_on, 0, str(tmp_path), 60)
    assert time.monotonic() - started < NO_HANG
    assert info.value.rank == 0
    assert "boom from rank 0" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert_gone(others(records(tmp_path)))
    assert_next_call_works()


def test_rank_raises_while_caller_blocked_in_all_reduce(tmp_path):
    """Rank 1 raises while rank 0 (the caller) waits in a gloo all_reduce for it."""
    started = time.monotonic()
    with pytest.raises(RankRaisedError) as info:
        mpify_nb.ranch(2, hr.ddp_raise_on, 1, str(tmp_path), ctx=in_torchddp())
    assert time.monotonic() - started < NO_HANG
    assert info.value.rank == 1
    assert "rank 1 gives up" in str(info.value)
    assert not dist.is_initialized()  # the caller's group is gone with the call
    assert_gone(others(records(tmp_path)))
    assert_next_call_works()


# -- a rank dies before joining the group ---------------------------------------------------

@pytest.mark.parametrize("how", ["raise", "kill"])
def test_rank_fails_to_load_payload(how, tmp_path):
    """Rank 1 cannot even load the call: the caller must not enter the rendezvous and hang."""
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        mpify_nb.ranch(3, hr.takes_payload, hr.FailsToLoad(1, how), str(tmp_path), ctx=in_torchddp())
    assert time.monotonic() - started < NO_HANG
    err = info.value
    assert err.rank == 1
    if how == "raise":
        assert isinstance(err, RankRaisedError)
        assert "this payload refuses to load on rank 1" in str(err)
    else:
        assert isinstance(err, RankExitedError)
        assert err.signal_name == "SIGKILL"
    assert records(tmp_path) == {}  # fn never ran anywhere: no rank got the go
    assert not dist.is_initialized()
    assert_next_call_works()


@BOTH_METHODS
def test_rank_dies_during_rendezvous(method, scripts):
    """Rank 2 dies after the go, while rank 0 (the caller) and rank 1 wait in the rendezvous
    for it: the caller is stuck in C++ and must be freed within seconds. (In a script: a
    caller whose rendezvous failed must not leave this test process in a bad state.)"""
    proc = start_script("rendezvous_dies.py", method=method)
    scripts.append(proc)
    out, err = finish(proc, timeout=120)
    match = re.search(r"FIRST-ERROR (\w+) rank=(\d+) signal=(\w+) seconds=([\d.]+)", out)
    assert match, f"{out}\n{err}"
    assert match.group(1, 2, 3) == ("RankExitedError", "2", "SIGKILL")
    assert float(match.group(4)) < NO_HANG
    assert "DIST-INITIALIZED False" in out


def test_ddp_call_after_failed_rendezvous(scripts):
    proc = start_script("rendezvous_dies.py", "--then-ddp")
    scripts.append(proc)
    out, err = finish(proc, timeout=120)
    assert "FIRST-ERROR RankExitedError rank=2" in out, f"{out}\n{err}"
    assert "SECOND-CALL [3.0, 3.0]" in out, f"{out}\n{err}"


# -- a rank dies ----------------------------------------------------------------------------

def test_a_peer_that_dies_before_the_callers_rank_began_stops_it_before_its_code_runs(monkeypatch):
    """CI (test_no_leaks_over_30_calls, 70 s instead of 6, now and then): rank 1 died the moment
    it started, while the caller's own rank had not begun the user's code yet. The stop asked of
    it then was dropped (nothing to stop), and the caller went on to run the function: a 60 s
    sleep, the whole of it. Here the caller's rank begins 1 s late: the stop waits for it, and
    the function never runs in the notebook."""
    from mpify_nb.launcher import call

    begin = call.waits.mark_groups_born

    def late() -> None:
        time.sleep(1.0)  # a loaded machine: the caller's thread starts its rank late
        begin()

    monkeypatch.setattr(call.waits, "mark_groups_born", late)
    started = time.monotonic()
    with pytest.raises(RankExitedError) as info:
        mpify_nb.ranch(2, hr.exit_at_once_on, 1, 60)
    assert time.monotonic() - started < NO_HANG
    assert info.value.rank == 1 and info.value.exitcode == 3, info.value
    assert_next_call_works()


@pytest.mark.parametrize(
    "how, exitcode, words",
    [
        ("sigkill", -signal.SIGKILL, ["SIGKILL"]),
        ("segfault", -signal.SIGSEGV, ["SIGSEGV", "segmentation fault"]),
        ("exit3", 3, ["exited with code 3"]),
    ],
)
def test_rank_dies(how, exitcode, words, tmp_path):
    started = time.monotonic()
    with pytest.raises(RankExitedError) as info:
        mpify_nb.ranch(3, hr.die_on, 1, how, str(tmp_path), 60)
    assert time.monotonic() - started < NO_HANG
    err = info.value
    assert err.rank == 1
    assert err.exitcode == exitcode
    assert str(err).startswith("rank 1 ")
    for word in words:
        assert word in str(err)
    assert_gone(others(records(tmp_path)))
    assert_next_call_works()


@pytest.mark.parametrize("method", ["spawn"], indirect=True)
def test_rank_killed_spawn(method, tmp_path):
    with pytest.raises(RankExitedError) as info:
        mpify_nb.ranch(3, hr.die_on, 2, "sigkill", str(tmp_path), 60)
    assert info.value.rank == 2 and info.value.signal_name == "SIGKILL"
    assert_gone(others(records(tmp_path)))
    assert_next_call_works()


# -- timeout --------------------------------------------------------------------------------

@pytest.mark.parametrize("caller_rank", [0, None])
def test_timeout_all_sleeping(caller_rank, tmp_path):
    assert_next_call_works()  # a warm template: the short timeout is for the ranks' work
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        mpify_nb.ranch(3, hr.sleep_and_record, str(tmp_path), 60, caller_rank=caller_rank, timeout=2)
    assert time.monotonic() - started < NO_HANG
    assert "2 s" in str(info.value)
    found = records(tmp_path)
    assert sorted(found) == [0, 1, 2]
    assert_gone(others(found, caller_rank))
    assert_next_call_works()


def test_timeout_only_caller_sleeping(tmp_path):
    """The other ranks are done; the caller's own rank sleeps in Python: it is interrupted."""
    assert_next_call_works()  # a warm template: the short timeout is for the ranks' work
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        mpify_nb.ranch(3, hr.sleep_on, 0, str(tmp_path), 60, timeout=2)
    assert time.monotonic() - started < NO_HANG
    assert "[0]" in str(info.value)  # the rank still running
    assert_gone(others(records(tmp_path)))
    assert_next_call_works()


def test_timeout_caller_blocked_in_all_reduce(tmp_path):
    """Rank 1 sleeps; the caller waits in C++ (gloo all_reduce) past the timeout."""
    assert_next_call_works()  # a warm template: the short timeout is for the ranks' work
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        mpify_nb.ranch(2, hr.ddp_sleep_on, 1, str(tmp_path), 60, ctx=in_torchddp(), timeout=2)
    assert time.monotonic() - started < NO_HANG
    assert not dist.is_initialized()
    assert_gone(others(records(tmp_path)))
    assert_next_call_works()


# -- the user interrupts (a kernel's SIGINT to its process group) -----------------------------

@pytest.mark.parametrize(
    "method, mode",
    [("template", "sleep"), ("template", "allreduce"), ("spawn", "sleep"), ("spawn", "allreduce")],
)
def test_interrupt_caller(method, mode, tmp_path, scripts):
    """SIGINT to the caller's process group while ranks run (``sleep``: everyone sleeps;
    ``allreduce``: the caller is blocked in gloo while rank 1 sleeps): the caller sees
    KeyboardInterrupt within seconds, the ranks are gone, and its next call works."""
    nprocs = 3 if mode == "sleep" else 2
    proc = start_script("caller.py", mode, str(tmp_path), method=method)
    scripts.append(proc)
    found = wait_for_records(tmp_path, nprocs, proc=proc)
    time.sleep(0.3)  # let the caller get into its sleep / all_reduce
    sent = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 0, f"{out}\n{err}"
    match = re.search(r"KEYBOARD-INTERRUPT (\S+)", out)
    assert match, f"no KeyboardInterrupt in the caller:\n{out}\n{err}"
    assert float(match.group(1)) - sent < NO_HANG
    assert "FIRST-CALL-RETURNED" not in out
    assert "SECOND-CALL [0, 1]" in out, f"{out}\n{err}"
    assert_gone(others(found))


@BOTH_METHODS
def test_caller_killed(method, tmp_path, scripts):
    """The calling process is SIGKILLed while its ranks sleep: ranks (and the template) follow."""
    proc = start_script("caller.py", "sleep", str(tmp_path), method=method)
    scripts.append(proc)
    found = wait_for_records(tmp_path, 3, proc=proc)
    assert found[0][0] == proc.pid
    proc.kill()
    out, _ = proc.communicate()
    doomed = others(found)
    if method == "template":
        line = re.search(r"TEMPLATE (\d+) (\d+)", out)
        assert line, out
        doomed.append((int(line.group(1)), int(line.group(2))))
    # Orphans now: only init can reap them, so a zombie counts as gone.
    assert_gone(doomed, timeout=NO_HANG, what="rank or template", zombie_ok=True)


# -- the template dies ----------------------------------------------------------------------

def test_template_killed_between_calls():
    assert_next_call_works()
    old = current_template()
    assert old is not None
    os.kill(old[0], signal.SIGKILL)  # no wait: the next call may still see it as alive
    results = mpify_nb.ranch(3, hr.rank_and_identity)
    assert [r for r, _ in results] == [0, 1, 2]
    new = current_template()
    assert new is not None and new != old
    assert_gone([old], timeout=NO_HANG, what="template")
    assert_gone([ident for _, ident in results[1:]])


def test_template_killed_during_call(tmp_path):
    assert_next_call_works()
    old = current_template()
    assert old is not None

    def kill_template_once_ranks_run() -> None:
        wait_for_records(tmp_path, 3)
        os.kill(old[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_template_once_ranks_run)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(RankError) as info:
            mpify_nb.ranch(3, hr.sleep_and_record, str(tmp_path), 60)
    finally:
        killer.join()
    assert time.monotonic() - started < NO_HANG
    assert info.value.rank in (1, 2)  # its ranks die with it
    assert f"template process it was forked from (pid {old[0]}) died" in str(info.value)
    # Orphaned by the template's death: only init can reap them, so a zombie counts as gone.
    # With the template gone the caller cannot wait for their exit statuses; a rank may
    # still be in the middle of dying (SIGKILLed) when the call returns: allow it a moment.
    assert_gone(others(records(tmp_path)) + [old], timeout=NO_HANG, what="rank or template", zombie_ok=True)
    assert_next_call_works()
    assert current_template() != old


# -- nothing leaks --------------------------------------------------------------------------

def _leak_mix(tmp_path: Path) -> list:
    """One call of each kind, successes and failures; each returns normally."""

    def ok():
        assert mpify_nb.ranch(3, hr.rank_and_identity)[2][0] == 2

    def ok_no_caller():
        assert len(mpify_nb.ranch(2, hr.rank_and_identity, caller_rank=None)) == 2

    def ddp_ok():
        assert mpify_nb.ranch(2, hr.all_reduce_rank_plus_one, ctx=in_torchddp()) == [3.0, 3.0]

    def raises():
        with pytest.raises(RankRaisedError):
            mpify_nb.ranch(3, hr.raise_on, 2, str(tmp_path), 60)

    def killed():
        with pytest.raises(RankExitedError):
            mpify_nb.ranch(2, hr.die_on, 1, "sigkill", str(tmp_path), 60)

    def exits():
        with pytest.raises(RankExitedError):
            mpify_nb.ranch(2, hr.die_on, 1, "exit3", str(tmp_path), 60)

    def times_out():
        with pytest.raises(TimeoutError):
            mpify_nb.ranch(2, hr.sleep_and_record, str(tmp_path), 60, timeout=0.5)

    def bad_result():
        with pytest.raises(RankRaisedError):
            mpify_nb.ranch(2, hr.return_unpicklable_on, 1)

    def load_fails():
        with pytest.raises(RankRaisedError):
            mpify_nb.ranch(2, hr.takes_payload, hr.FailsToLoad(1, "raise"), str(tmp_path))

    return [ok, raises, ok_no_caller, killed, ddp_ok, times_out, exits, bad_result, load_fails]


def test_no_leaks_over_30_calls(tmp_path):
    assert_next_call_works()  # the template is up, lazy imports are done
    before = leak_snapshot()
    calls = _leak_mix(tmp_path)
    for i in range(30):
        calls[i % len(calls)]()
    after = leak_snapshot()
    assert after == before
    assert not dist.is_initialized()


def test_payload_errors_leak_nothing():
    assert_next_call_works()
    before = leak_snapshot()
    with socket.socket() as unpicklable:
        for _ in range(5):
            with pytest.raises(mpify_nb.PayloadError):
                mpify_nb.ranch(2, hr.echo, unpicklable)
    gc.collect()  # what only the garbage collector would close is a leak all the same
    after = leak_snapshot()
    assert after == before


# -- nothing listens beyond loopback ---------------------------------------------------------

def test_listening_sockets_are_loopback_only():
    """During a DDP call, every TCP socket a rank listens on (TCPStore, gloo) is bound to
    127.0.0.1 or ::1, never to all interfaces."""
    per_rank = mpify_nb.ranch(3, hr.listening_sockets, ctx=in_torchddp())
    everything = [address for found in per_rank for address in found]
    assert everything, "no listening socket found: the check itself is broken"
    hosts = {address.rsplit(":", 1)[0] for address in everything}
    assert hosts <= {"127.0.0.1", "::1"}, f"ranks listen on {sorted(everything)}"


def test_a_call_without_ddp_listens_on_nothing():
    assert mpify_nb.ranch(2, hr.listening_now, caller_rank=None) == [[], []]


def test_the_rendezvous_store_closes_with_the_call():
    port = mpify_nb.ranch(2, hr.master_port, ctx=in_torchddp())[0]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# -- errors are never lost ------------------------------------------------------------------

@pytest.mark.parametrize("failing", [1, 0])
def test_exception_whose_str_raises_is_reported_with_its_traceback(failing):
    with pytest.raises(RankRaisedError) as info:
        mpify_nb.ranch(2, hr.raise_str_exploding, (failing,))
    error = info.value
    assert error.rank == failing
    assert error.exc_type.endswith("StrExplodes")
    assert "__str__ exploded" in error.exc_message
    assert "in raise_str_exploding" in error.remote_traceback
    assert_next_call_works()


def test_deleted_working_directory_is_named_before_any_rank_starts(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    os.chdir(gone)
    try:
        gone.rmdir()
        with pytest.raises(FileNotFoundError, match="working directory no longer exists"):
            mpify_nb.ranch(2, hr.rank)
    finally:
        os.chdir(here)
    assert_next_call_works()


# -- the call's limits --------------------------------------------------------------------

def test_timeout_covers_starting_ranks_when_the_template_is_stopped():
    assert_next_call_works()
    old = current_template()
    assert old is not None
    os.kill(old[0], signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="stopped"):
            mpify_nb.ranch(2, hr.rank, timeout=3)
    finally:
        try:
            os.kill(old[0], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert time.monotonic() - started < NO_HANG
    assert_gone([old], timeout=NO_HANG, what="template")  # replaced, not left stopped
    assert_next_call_works()


def test_more_ranks_than_file_descriptors_fails_at_once():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        with no_rank_started(), pytest.raises(OSError, match="file descriptors"):
            mpify_nb.ranch(1000, hr.rank)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert_next_call_works()


# -- threads ------------------------------------------------------------------------------

WORLD_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "MPIFY_NB_STORE_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _in_threads(calls: int, caller_rank) -> list:
    outcomes: list = []

    def worker() -> None:
        for _ in range(calls):
            try:
                outcomes.append(mpify_nb.ranch(2, hr.rank, caller_rank=caller_rank))
            except RuntimeError as e:
                outcomes.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=NO_HANG * 4)
    assert not any(t.is_alive() for t in threads), "a thread's calls hung"
    return outcomes


@pytest.mark.parametrize("caller_rank", [0, None])
def test_calls_from_two_threads_leave_nothing_behind(caller_rank):
    import sys

    stdout, stderr = sys.stdout, sys.stderr
    before = {k: os.environ.get(k) for k in WORLD_VARS}
    outcomes = _in_threads(40, caller_rank)
    assert len(outcomes) == 80
    assert {k: os.environ.get(k) for k in WORLD_VARS} == before
    assert sys.stdout is stdout and sys.stderr is stderr
    results = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert all(r == [0, 1] for r in results)
    if caller_rank is None:
        assert not refused, f"calls with no caller rank may run side by side: {refused[:1]}"
    else:
        # A second call that plays a rank cannot share the process: refused at once, clearly.
        assert all("another call that plays a rank" in str(e) for e in refused), refused[:1]
        assert results, "no call got through"


@pytest.mark.parametrize("caller_rank", [0, None])
def test_interrupt_stops_a_call_running_on_another_thread(caller_rank, tmp_path, sigint_handler):
    """Signal handlers run on the main thread only; the stop button must still stop a call
    that a worker thread runs (the caller's own rank included), and leave nothing."""
    assert_next_call_works()  # from the main thread: our SIGINT handler is in place
    outcome: list = []

    def worker() -> None:
        try:
            outcome.append(mpify_nb.ranch(2, hr.sleep_in_python, str(tmp_path), 120, caller_rank=caller_rank))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    found = wait_for_records(tmp_path, 2)
    with pytest.raises(KeyboardInterrupt):  # the main thread gets its own, as always
        signal.raise_signal(signal.SIGINT)
    thread.join(timeout=NO_HANG)
    assert not thread.is_alive(), "the call on the other thread went on after the interrupt"
    assert len(outcome) == 1 and isinstance(outcome[0], KeyboardInterrupt), outcome
    assert_gone([ident for ident in found.values() if ident[0] != os.getpid()], timeout=NO_HANG)
    assert_next_call_works()


# -- killed by hand, or by the OOM killer: the cgroup's count says (issue 35) ---------------------

def _fake_cgroup(tmp_path, version: int, count: int) -> tuple[str, str, str]:
    """A /proc/<pid>/cgroup and a cgroup tree, as Linux lays them out: (proc, root, counter file)."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "77").mkdir(parents=True)
    if version == 2:
        (proc / "77" / "cgroup").write_text("0::/user.slice/notebook.scope\n")
        counter = root / "user.slice" / "notebook.scope" / "memory.events"
        text = f"low 0\nhigh 0\nmax 12\noom 3\noom_kill {count}\noom_group_kill 0\n"
    else:
        (proc / "77" / "cgroup").write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n")
        counter = root / "memory" / "docker" / "abc" / "memory.oom_control"
        text = f"oom_kill_disable 0\nunder_oom 0\noom_kill {count}\n"
    counter.parent.mkdir(parents=True)
    counter.write_text(text)
    return str(proc), str(root), str(counter)


@pytest.mark.parametrize("version", [1, 2])
def test_the_cgroups_oom_count_tells_the_oom_killer_from_a_signal(tmp_path, version):
    from mpify_nb.start.oom import OomWatch

    proc, root, counter = _fake_cgroup(tmp_path, version, 2)
    watch = OomWatch(77, proc, root)  # the rank starts
    assert watch.counter is not None and watch.counter.path == counter and watch.before == 2
    name = os.path.basename(counter)
    assert watch.cause() == ("killed by a signal sent by hand or by another process, not the OOM killer: its "
                             f"cgroup's oom_kill count ({name}) stayed at 2")
    with open(counter) as f:
        text = f.read()
    with open(counter, "w") as f:
        f.write(text.replace("oom_kill 2", "oom_kill 3"))  # the OOM killer struck while it ran
    cause = watch.cause()
    assert cause.startswith(f"by the out-of-memory killer: its cgroup's oom_kill count ({name}) rose from 2 to 3 "
                            "while it ran"), cause
    error = RankExitedError(1, -signal.SIGKILL, killed_by=cause)
    assert str(error) == f"rank 1 was killed by SIGKILL ({cause})"
    # no memory cgroup to read: nothing claimed either way
    assert OomWatch(77, proc, str(tmp_path / "nowhere")).cause() == ""
    assert str(RankExitedError(1, -signal.SIGKILL)) == \
        "rank 1 was killed by SIGKILL (killed by hand, or by the kernel's out-of-memory killer)"


def test_a_rank_killed_by_hand_is_said_to_be_not_the_oom_killer(tmp_path):
    from mpify_nb.start.oom import OomKills

    if OomKills.of(os.getpid()) is None:
        pytest.skip("no memory cgroup's oom_kill count can be read here")
    with pytest.raises(RankExitedError) as info:
        mpify_nb.ranch(3, hr.die_on, 1, "sigkill", str(tmp_path), 60)
    message = str(info.value)
    assert message.startswith("rank 1 was killed by SIGKILL (killed by a signal sent by hand or by another "
                              "process, not the OOM killer: its cgroup's oom_kill count ("), message
    assert_next_call_works()
