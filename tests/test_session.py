"""Session: persistent ranks, with real processes and a real gloo group.

Every test starts its own ``Session(2)`` (forked from the warm template: ~0.1 s), and
checks that its rank processes are gone when it is closed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import mpify_nb
import presses
from helpers_ranks import own_tcp_sockets, start_time
from mpify_nb import RankStatus, Session
from mpify_nb.wire.errors import (
    CollectiveError,
    RankExitedError,
    RankRaisedError,
    SessionClosedError,
    merge_rank_errors,
)
from versions import DDP_BACKWARD_WAIT

ALL_REDUCE = "t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()"


def identities(s: Session) -> dict[int, tuple[int, int]]:
    return {row.rank: (row.pid, start_time(row.pid)) for row in s.status()}


def gone(idents) -> bool:
    return all(start_time(pid) != start for pid, start in idents.values())


@pytest.fixture
def session():
    s = Session(2)
    idents = identities(s)
    yield s
    s.close()
    assert gone(idents), "close() left a rank running"


def test_start_gives_a_ready_group_and_namespace_then_close_ends_every_rank():
    with Session(2) as s:
        idents = identities(s)
        # The very first request is not lost, and the group is already up.
        values = s.run(ALL_REDUCE)
        assert s.world_size == 2 and not s.closed
    assert values == {0: [3.0, 3.0], 1: [3.0, 3.0]}
    assert s.closed
    assert gone(idents)


def test_namespace_and_pids(session):
    assert session.run("rank, world_size, str(device), dist.is_initialized(), torch.__name__") == {
        0: (0, 2, "cpu", True, "torch"), 1: (1, 2, "cpu", True, "torch")}
    pids = {row.pid for row in session.status()}
    assert os.getpid() not in pids and len(pids) == 2


def test_run_returns_last_expression_keeps_state_and_relays_output_as_written(session, capsys):
    assert session.run("x = rank * 10\nx + 1") == {0: 1, 1: 11}
    assert session.run("x;") == {0: None, 1: None}  # ';' hides the value, as in IPython
    assert session.run("y = x") == {0: None, 1: None}
    session.run("import sys\nprint('  two spaces  ')\nprint()\nprint('a', 1)\n"
                "print('partial', end='')\nprint('oops', file=sys.stderr)", ranks=[1])
    out, err = capsys.readouterr()
    assert out == "[rank 1]   two spaces  \n[rank 1] \n[rank 1] a 1\n[rank 1] partial"
    assert err == "[rank 1] oops\n"
    # C code's output (C stdio, fully buffered on a pipe unless PYTHONUNBUFFERED) belongs to its cell too.
    session.run("import ctypes\nlibc = ctypes.CDLL(None)\n"
                "cbuf = ctypes.create_string_buffer(8192)\n"
                "libc.setvbuf(ctypes.c_void_p.in_dll(libc, 'stdout'), cbuf, 0, 8192)\n"  # _IOFBF
                "libc.printf(b'from C\\n')", ranks=[0])
    assert capsys.readouterr().out == "[rank 0] from C\n"
    assert session.pull("y", rank=None) == [0, 10]


def test_errors_name_the_rank_show_the_source_and_identical_ones_are_merged(session):
    session.run("kept = rank")
    with pytest.raises(RankRaisedError) as info:
        session.run("a = 1\nraise ValueError('bad ' + str(kept * 0))", filename="/tmp/cell-7.py")
    err = info.value
    assert err.ranks == [0, 1] and "ranks [0, 1] raised ValueError: bad 0" in str(err)
    assert 'File "/tmp/cell-7.py", line 2' in str(err)
    assert "raise ValueError('bad ' + str(kept * 0))" in str(err)
    with pytest.raises(RankRaisedError) as info:
        session.run("if rank == 1:\n    t_undefined\n")
    assert info.value.ranks == [1] and info.value.rank == 1
    assert "NameError" in str(info.value) and "    t_undefined" in str(info.value)
    assert session.run("kept") == {0: 0, 1: 1}
    with pytest.raises(SyntaxError):
        session.run("def (")
    # sys.exit() in a cell is an error of that cell, not the end of the rank.
    with pytest.raises(RankRaisedError, match="SystemExit"):
        session.run("import sys\nsys.exit(3)")
    # A value that cannot be pickled comes back as its repr.
    assert repr(session.run("(x for x in [])", ranks=[0])[0]).startswith("<generator object")
    assert session.run("kept") == {0: 0, 1: 1}


def test_a_collective_some_rank_never_joins_fails_fast_and_the_group_is_rebuilt(session):
    session.run("kept = rank + 100")
    start = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        session.run("t = torch.ones(2)\ndist.all_reduce(t)", ranks=[0])
    assert time.monotonic() - start < 60  # not gloo's 30-minute timeout (speed: bench_session.py)
    assert info.value.waiting == [0] and info.value.missing == [1] and info.value.rebuilt
    assert "all_reduce" in str(info.value)
    assert session.run(ALL_REDUCE) == {0: [3.0, 3.0], 1: [3.0, 3.0]}
    # A rank that raises before the all_reduce its peer waits in.
    with pytest.raises(CollectiveError) as info:
        session.run("if rank == 1:\n    raise RuntimeError('boom')\nt = torch.ones(2)\ndist.all_reduce(t)")
    assert info.value.missing == [1] and info.value.waiting == [0]
    assert [type(e) for e in info.value.errors] == [RankRaisedError] and "boom" in str(info.value)
    assert session.run(ALL_REDUCE) == {0: [3.0, 3.0], 1: [3.0, 3.0]}
    assert session.run("kept") == {0: 100, 1: 101}


def test_a_subgroup_collective_blames_only_its_members_and_a_held_group_is_unstuck():
    """Rank 2 is not in the subgroup, so it is not waited for; rank 1 holds the subgroup in
    its namespace (as a DDP wrapper would), which must not keep rank 0 stuck."""
    with Session(3) as s:
        s.run("g = dist.new_group([0, 1])\nkept = rank")
        assert s.run("t = torch.ones(1)\nif rank < 2:\n    dist.all_reduce(t, group=g)\nt.item()") == {
            0: 2.0, 1: 2.0, 2: 1.0}
        with pytest.raises(CollectiveError) as info:
            s.run("t = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t, group=g)")
        assert info.value.waiting == [0] and info.value.missing == [1]
        assert s.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item(), kept") == {r: (3.0, r) for r in range(3)}


def test_interrupt_stops_every_rank_keeps_state_and_the_next_call_works(session, sigint_handler):
    idents = identities(session)
    session.run("kept = rank")
    threading.Timer(0.3, session.interrupt).start()
    with pytest.raises(KeyboardInterrupt):
        session.run("import time\ntime.sleep(30)")
    start = time.monotonic()
    assert session.run("kept") == {0: 0, 1: 1}
    assert time.monotonic() - start < 30  # no leftover wait (speed: bench_session.py)
    # A rank stuck in C++ (an all_reduce rank 1 never joins) is unstuck too.
    threading.Timer(0.1, session.interrupt).start()
    with pytest.raises(KeyboardInterrupt):
        session.run("t = torch.ones(2)\ndist.all_reduce(t)", ranks=[0])
    assert session.run(ALL_REDUCE) == {0: [3.0, 3.0], 1: [3.0, 3.0]}
    # Ctrl-C in the caller (SIGINT to this process) while it waits.
    presses.press_when_waiting_in("run")
    with pytest.raises(KeyboardInterrupt):
        session.run("import time\ntime.sleep(30)")
    assert session.run("kept") == {0: 0, 1: 1}
    assert identities(session) == idents  # no rank died
    session.interrupt()  # between calls: nothing to stop, and the next call is not affected
    assert session.run("kept") == {0: 0, 1: 1}


def test_interrupt_unsticks_a_ddp_backward_that_waits_for_a_busy_rank(session):
    """A backward on rank 0 waits in C++ (autograd) for an all_reduce that rank 1, still
    busy in Python, has not reached: nothing is wrong yet, so nothing is detected, and
    SIGINT cannot land in the C++ wait; the interrupt still ends it, and the model can be
    wrapped again on the rebuilt group."""
    make = ("from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "torch.manual_seed(0)\nmodel = DDP(torch.nn.Linear(4, 1))")
    session.run(make)
    threading.Timer(0.8, session.interrupt).start()
    with pytest.raises(KeyboardInterrupt):
        session.run("import time\nif rank == 1:\n    time.sleep(60)\nmodel(torch.ones(2, 4)).sum().backward()")
    session.run(make)  # re-wrapped on the new group
    assert session.run("model(torch.ones(2, 4)).sum().backward()\nmodel.module.bias.grad.item()") == {
        0: 2.0, 1: 2.0}


def test_a_ddp_backward_that_waits_for_an_idle_rank_ends_with_collective_error(session):
    """The same backward on rank 0 alone: rank 1 is idle and will never join. No Python
    frame shows the all_reduce (it runs on autograd's side), torch's recorder does: the call
    ends by itself, names the wait and its line, and the group works again."""
    make = ("from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "torch.manual_seed(0)\nmodel = DDP(torch.nn.Linear(4, 1))\n"
            "for _ in range(2):  # together: DDP's first two forwards sync (buckets, their order)\n"
            "    model(torch.ones(2, 4)).sum().backward()")
    session.run(make)
    started = time.monotonic()
    with pytest.raises(CollectiveError) as caught:
        session.run("x = torch.ones(2, 4)\nmodel(x).sum().backward()", ranks=[0], timeout=30)
    assert time.monotonic() - started < 10  # ~0.4 s; generous for a loaded machine
    assert caught.value.waiting == [0] and caught.value.missing == [1] and caught.value.rebuilt
    assert f'rank 0 was left waiting in {DDP_BACKWARD_WAIT} (rank 0 at File "<session cell' in str(caught.value)
    assert '>", line 2), which rank 1 never joined' in str(caught.value)
    session.run(make)
    assert session.run("model.zero_grad()\nmodel(torch.ones(2, 4)).sum().backward()\n"
                       "model.module.bias.grad.item()") == {0: 2.0, 1: 2.0}


def test_the_stop_button_reaches_a_call_running_on_another_thread(session, sigint_handler):
    outcome = []

    def call() -> None:
        try:
            session.run("import time\ntime.sleep(30)")
            outcome.append("finished")
        except KeyboardInterrupt:
            outcome.append("interrupted")

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(0.5)
    with pytest.raises(KeyboardInterrupt):  # the main thread's own KeyboardInterrupt, as in a script
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    worker.join(5)
    assert outcome == ["interrupted"]
    assert session.run("rank") == {0: 0, 1: 1}


def test_timeout_interrupts_and_keeps_state(session):
    session.run("kept = rank")
    with pytest.raises(TimeoutError):
        session.run("import time\ntime.sleep(30)", timeout=0.3)
    assert session.run("kept") == {0: 0, 1: 1}


def test_a_killed_rank_fails_the_call_at_once_and_restart_replaces_it(session):
    session.run("kept = rank")
    victim = session.status()[1].pid
    threading.Timer(0.3, os.kill, (victim, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RankExitedError) as info:
        session.run("import time\ntime.sleep(30)")
    assert time.monotonic() - start < 25  # not the 30 s sleep (speed: bench_session.py)
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
    rows = session.status()
    assert [r.state for r in rows] == ["idle", "dead"] and "SIGKILL" in rows[1].exit_detail
    with pytest.raises(RankExitedError):
        session.run("kept")
    assert session.run("kept", ranks=[0]) == {0: 0}
    session.restart()
    assert session.status()[1].pid != victim
    assert session.run("globals().get('kept')") == {0: 0, 1: None}  # rank 0 kept its state
    assert session.run(ALL_REDUCE) == {0: [3.0, 3.0], 1: [3.0, 3.0]}
    # Killed between calls: the next call says so at once.
    victim = session.status()[0].pid
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.1)
    with pytest.raises(RankExitedError) as info:
        session.run("1")
    assert info.value.rank == 0
    session.restart([0])
    assert session.run(ALL_REDUCE) == {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_push_and_pull_big_tensors_and_arrays_through_shared_memory(session):
    import numpy as np
    import torch

    big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MB
    arr = np.arange(1 << 18, dtype=np.float64).reshape(512, 512)  # 2 MB
    session.push(big=big, arr=arr, lr=0.5)
    assert session.run("float(big[-1]), float(arr.sum()), lr") == {
        r: (float(big[-1]), float(arr.sum()), 0.5) for r in (0, 1)}
    # On the rank the tensor is a mapping of the shared-memory file, not a pickled copy.
    maps = open(f"/proc/{session.status()[0].pid}/maps").read()
    assert "memfd:mpify_nb-tensor" in maps
    session.run("big[0] = rank + 7")  # copy-on-write: each rank's writes stay its own
    pulled = session.pull("big", rank=None)
    assert [float(t[0]) for t in pulled] == [7.0, 8.0] and float(big[0]) == 0.0
    assert torch.equal(pulled[1][1:], big[1:])
    assert session.pull("arr", rank=1).shape == (512, 512)
    session.run("only_on_0 = 1", ranks=[0])
    assert session.pull("only_on_0") == 1
    with pytest.raises(NameError, match="rank 1"):
        session.pull("only_on_0", rank=1)
    assert session.missing_names(["only_on_0", "print", "nope"]) == {0: {"nope"}, 1: {"only_on_0", "nope"}}


def test_apply_runs_a_notebook_function_that_sees_the_rank_namespace(session):
    # A notebook cell: its globals are __main__'s, so f travels by value and sees the rank's names
    # (a function of an importable module, this one's included, runs in that module's globals).
    cell = {"__name__": "__main__"}
    exec("scale = 3\n"
         "def f(a, b=0):\n"
         "    return rank * scale + a + b\n", cell)  # rank lives in the rank's namespace
    f = cell["f"]

    assert session.apply(f, 1, b=10) == {0: 11, 1: 14}
    assert session.apply(f, 0, ranks=1) == {1: 3}


def test_status_rows(session):
    session.run("import time\nz = 1", ranks=[0])
    rows = session.status()
    assert all(isinstance(r, RankStatus) for r in rows)
    assert [(r.rank, r.state, r.device, r.gpu_memory) for r in rows] == [(0, "idle", "cpu", None),
                                                                         (1, "idle", "cpu", None)]
    assert all(r.rss and r.rss > 10 << 20 for r in rows)
    assert rows[0].last_cell == "import time" and rows[1].last_cell == ""
    seen = []
    threading.Timer(0.3, lambda: seen.extend(r.state for r in session.status())).start()
    session.run("import time\ntime.sleep(0.8)", ranks=[1])
    assert seen == ["idle", "running"]


def test_many_calls_leak_no_fds_and_closed_session_refuses(session):
    session.run("1")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        session.run("1")
    assert len(os.listdir("/proc/self/fd")) <= before
    session.close()
    with pytest.raises(SessionClosedError):
        session.run("1")


def _network_sockets_here() -> set[str]:
    return {inode for inode, _, _ in own_tcp_sockets()}


def test_the_caller_listens_on_no_network_port():
    """Ranks reach the caller only through socketpairs and pipes made before they existed.
    (Other tests' clients, such as a kernel's zmq sockets, may live here: only new ones count.)"""
    before = _network_sockets_here()
    with Session(2) as s:
        s.run("dist.barrier()")
        assert _network_sockets_here() - before == set()


def test_merge_rank_errors_keeps_different_errors_apart():
    a = RankRaisedError(0, "ValueError", "x", "tb")
    b = RankRaisedError(1, "ValueError", "x", "tb")
    c = RankRaisedError(2, "KeyError", "y", "tb")
    assert merge_rank_errors([b, a]).ranks == [0, 1]
    root = merge_rank_errors([a, c])
    assert root.ranks == [root.rank] and len(root.others) == 1
    # Each distinct error is shown with its ranks, identical ones once; the inputs stay as they were
    # (a dead rank's error is raised again by later calls).
    shown = merge_rank_errors([c, b, a])
    assert (shown.rank, shown.ranks, type(shown)) == (0, [0, 1], RankRaisedError)
    assert str(shown) == ("ranks [0, 1] raised ValueError: x\n\n--- traceback from ranks [0, 1] ---\ntb\n\n"
                          "rank 2 raised KeyError: y\n\n--- traceback from rank 2 ---\ntb")
    assert str(merge_rank_errors([c, b, a])) == str(shown)
    assert (str(c), c.others) == ("rank 2 raised KeyError: y\n\n--- traceback from rank 2 ---\ntb", [])
    dead = [RankExitedError(0, -9), RankExitedError(1, -6)]
    assert str(merge_rank_errors(dead)).splitlines()[::2] == [str(dead[0]), str(dead[1])]
    assert merge_rank_errors(dead[:1]) is dead[0] and str(dead[0]).count("rank") == 1


def test_rich_display_from_a_rank_reaches_the_callback(session, capsys):
    shown = []
    session.run("class Bold:\n    def _repr_html_(self):\n        return f'<b>{rank}</b>'\n"
                "from IPython.display import display as ipython_display\nipython_display(Bold())",
                display=lambda rank, bundle: shown.append((rank, bundle.get("text/html"))))
    assert sorted(shown) == [(0, "<b>0</b>"), (1, "<b>1</b>")]
    session.run("display(42)", ranks=[1])  # no callback: the text, labelled
    assert capsys.readouterr().out == "[rank 1] 42\n"


def test_a_figure_drawn_on_a_rank_is_shown_at_the_end_of_the_cell(session):
    pytest.importorskip("matplotlib")
    shown = []
    session.run("import matplotlib.pyplot as plt\nplt.plot([1, 2, rank])", ranks=[0],
                display=lambda rank, bundle: shown.append((rank, sorted(bundle))))
    assert shown == [(0, ["image/png", "text/plain"])]
    assert session.run("len(plt.get_fignums())", ranks=[0]) == {0: 0}  # closed after, as inline does


def test_a_figure_is_shown_when_the_template_preloaded_matplotlib():
    """A template that preloads matplotlib (named here; or learned from ranks) has it imported with the
    kernel's backend already read: a Session's rank must still draw into the cell."""
    pytest.importorskip("matplotlib")
    from mpify_nb.start import preload, template

    was = preload.enabled()
    try:
        template.shutdown()
        mpify_nb.set_preload(["matplotlib.pyplot"])
        assert template.wait_preloaded(timeout=120)
        with Session(1, ddp=False) as s:
            assert s.run("import sys\n'matplotlib.pyplot' in sys.modules") == {0: True}  # preloaded
            shown: list = []
            s.run("import matplotlib.pyplot as plt\nplt.plot([1, 2])",
                  display=lambda rank, bundle: shown.append((rank, sorted(bundle))))
            assert shown == [(0, ["image/png", "text/plain"])]
    finally:
        with preload._lock:
            preload._named.clear()
        mpify_nb.set_preload(was)
        template.shutdown()


def test_ranks_die_with_their_caller_even_when_it_forked():
    """A caller killed outright (a kernel that dies) takes its ranks along, even when a fork of
    it (a DataLoader worker of the notebook) still lives: the fork holds no rank's channel."""
    script = ("import os, sys, time\nfrom mpify_nb import Session\ns = Session(2)\n"
              "child = os.fork()\nif child == 0:\n    time.sleep(60)\n    os._exit(0)\n"
              "print(child, *[r.pid for r in s.status()], flush=True)\ntime.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    fork = None
    try:
        line = caller.stdout.readline() if caller.stdout else ""
        fork, *pids = [int(p) for p in line.split()]
        assert len(pids) == 2
        idents = {r: (pid, start_time(pid)) for r, pid in enumerate(pids)}
    finally:
        caller.kill()
        caller.wait()
    try:
        deadline = time.monotonic() + 10
        while not gone(idents) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(idents)
    finally:
        if fork is not None:
            os.kill(fork, signal.SIGKILL)


def test_close_from_another_thread_ends_a_running_call(session):
    threading.Timer(0.3, session.close).start()
    with pytest.raises(SessionClosedError):
        session.run("import time\ntime.sleep(30)")
    assert session.closed


def test_programs_a_rank_starts_read_end_of_file_from_stdin(session):
    """A rank's stdin asks the notebook's user (issue 20), but what the rank starts reads
    /dev/null as before: a subprocess reading stdin, a forked child; neither hangs."""
    read = ("import subprocess, sys\n"
            "subprocess.run([sys.executable, '-c', 'import sys; print(repr(sys.stdin.read()))'],"
            " capture_output=True, text=True, timeout=20).stdout.strip()")
    assert session.run(read, timeout=30) == {0: "''", 1: "''"}
    forked = ("import os\npid = os.fork()\nif pid == 0:\n    import sys\n"
              "    os._exit(0 if sys.stdin.readline() == '' else 3)\nos.waitpid(pid, 0)[1] >> 8")
    assert session.run(forked, timeout=30) == {0: 0, 1: 0}


def test_the_stop_button_during_restart_leaves_every_rank_a_member(session, sigint_handler):
    # Before: restart() removed the members before their successors existed; an interrupt
    # 2-10 ms in left status() without them, and every later call failed with KeyError: 0.
    # A restart is done whole or not begun: a press before it began (a loaded machine can run the
    # timer before restart() is even called) leaves rank 1 as it was, its state kept.
    outcomes = []
    for delay in (0.002, 0.004, 0.006, 0.008, 0.010, 0.03):
        session.run("kept = rank")
        old_pid = session.status()[1].pid
        timer = threading.Timer(delay, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        try:
            timer.start()  # in the try: on a loaded machine it can press before start() returns
            session.restart([1])
            time.sleep(0.2)  # an interrupt that came after restart() returned lands here
            timer.join()  # or here, when a loaded machine ran the timer later still
            outcomes.append("done")
        except KeyboardInterrupt as interrupt:
            outcomes.append("interrupted after" if "were restarted" in str(interrupt) else "interrupted")
        timer.join()
        rows = session.status()
        assert [r.rank for r in rows] == [0, 1], (delay, rows)
        replaced = rows[1].pid != old_pid
        assert replaced or outcomes[-1] == "interrupted", (delay, outcomes)
        session.restart()  # whatever is dead (nothing, unless a start failed)
        assert [r.state for r in session.status()] == ["idle", "idle"]
        assert session.run("globals().get('kept'), rank") == {0: (0, 0), 1: (None if replaced else 1, 1)}
        assert session.run(ALL_REDUCE) == {0: [3.0, 3.0], 1: [3.0, 3.0]}
    assert any(outcome.startswith("interrupted") for outcome in outcomes), outcomes


DISPLAY_THREAD = """
import threading
stop_displays = threading.Event()
def keep_displaying():
    i = 0
    while not stop_displays.is_set():
        display({"i": i, "pad": "d" * 50_000})
        i += 1
displayer = threading.Thread(target=keep_displaying, daemon=True)
displayer.start()
"""


def test_display_from_a_rank_thread_keeps_the_channel_whole(session):
    # Before: the thread's DISPLAY frames and the main thread's answers interleaved on the
    # socket; within 25 calls the caller read garbage (UnicodeDecodeError, OverflowError,
    # MemoryError from a bogus length) and declared the rank dead.
    shown: list[tuple[int, int]] = []

    def on_display(rank: int, bundle: dict) -> None:
        shown.append((rank, len(bundle["text/plain"])))

    session.run(DISPLAY_THREAD, display=on_display)
    try:
        for i in range(40):
            assert session.run(f"'r' * 100_000 + str({i} + rank)", display=on_display) == \
                {0: "r" * 100_000 + str(i), 1: "r" * 100_000 + str(i + 1)}
    finally:
        session.run("stop_displays.set()\ndisplayer.join()")
    assert shown and all(length > 50_000 for _rank, length in shown)
    assert [r.state for r in session.status()] == ["idle", "idle"]


def test_a_corrupt_length_is_refused_before_anything_is_allocated():
    from mpify_nb.wire import framing as wire

    a, b = wire.socketpair()
    with a, b:
        a.sendall(wire._HEADER.pack(1 << 62, 0))
        with pytest.raises(ConnectionError, match="corrupt message header"):
            wire.recv(b)


def test_datetime_arrays_push_pull_and_run_and_a_value_that_cannot_travel_raises(session):
    # Before: a datetime64 array of 1 MiB or more could not be pushed, and pull/run handed back a
    # RemoteRepr (a text stand-in) without saying so.
    import numpy as np

    from helpers_ranks import time_arrays

    arrays = time_arrays(200_000)
    session.push(**arrays)
    assert session.run("str(stamps[-1]), gaps.dtype.str, records['when'][0].item().year") == \
        {r: ("2048-10-25T07:00:00.000000000", "<m8[ns]", 2026) for r in (0, 1)}
    session.run("import numpy as np\nstamps = stamps + np.timedelta64(rank, 'D')")
    pulled = session.pull("stamps", rank=None)
    assert [str(p[-1]) for p in pulled] == ["2048-10-25T07:00:00.000000000", "2048-10-26T07:00:00.000000000"]
    assert np.array_equal(session.pull("records"), arrays["records"])
    assert str(session.run("stamps", ranks=[1])[1][0]) == "2026-01-02T00:00:00.000000000"


def test_pulling_a_value_that_cannot_be_pickled_raises(session):
    # Before: pull handed back a RemoteRepr (a text stand-in) without saying so. A generator
    # cannot be pickled: pull says so; a cell's shown value may still be its repr.
    from mpify_nb import PayloadError
    from mpify_nb.rank.session import RemoteRepr

    session.run("g = (i for i in range(3))")
    with pytest.raises(PayloadError, match=r"cannot pull 'g' from rank 0: .*generator"):
        session.pull("g")
    shown = session.run("g", ranks=[0])[0]
    assert isinstance(shown, RemoteRepr) and repr(shown).startswith("<generator object <genexpr>")


STUCK_VALUE = """
import threading
class PicklesForever:
    def __reduce__(self):
        threading.Event().wait()  # never set
stuck_value = PicklesForever()
"""


def test_a_value_that_never_finishes_pickling_is_interrupted_like_user_code(session):
    # Before: results were pickled where interrupts are ignored: the call raised TimeoutError
    # after 8 s saying the ranks "were interrupted", but both stayed running and every later
    # call timed out (or hung).
    session.run(STUCK_VALUE)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"they were interrupted, their state is kept$"):
        session.run("stuck_value", timeout=2)
    assert time.monotonic() - start < 6
    assert [r.state for r in session.status()] == ["idle", "idle"]
    assert session.run("rank", timeout=5) == {0: 0, 1: 1}
    # pull and the stop button (interrupt()) likewise.
    timer = threading.Timer(0.5, session.interrupt)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        session.pull("stuck_value")
    timer.join()
    assert session.run(ALL_REDUCE, timeout=5) == {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_a_timeout_says_which_ranks_did_not_stop():
    from mpify_nb.session.calls import _timed_out

    assert _timed_out(3, [0, 1], []).endswith("they were interrupted, their state is kept")
    assert "ranks [1] did not stop" in _timed_out(3, [0, 1], [1]) and "restart([1])" in _timed_out(3, [0, 1], [1])


def test_template_shutdown_spares_an_open_sessions_ranks():
    # Before: template.shutdown() (which the README suggests to free ~220 MB) killed every rank
    # of an open Session: they are forked from it and die with it.
    from mpify_nb.start import template

    with Session(2) as s:
        before = identities(s)
        template_pid = template.current_pid()
        with pytest.warns(RuntimeWarning, match="still has 2 live ranks"):
            assert template.shutdown() is False
        assert s.run(ALL_REDUCE) == {0: [3.0, 3.0], 1: [3.0, 3.0]}
        assert identities(s) == before and start_time(template_pid) is not None
    deadline = time.monotonic() + 10
    while start_time(template_pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert start_time(template_pid) is None, "the retired template outlived the Session's ranks"
    assert template.shutdown() is True
    assert mpify_nb.ranch(2, lambda: 1) == [1, 1]


def test_a_rank_killed_as_the_group_is_rebuilt_is_named(monkeypatch):
    # Before: CollectiveError "... the process group is broken", which did not say rank 1 died.
    rebuild = Session._rebuild

    def kill_rank_1_then_rebuild(self: Session) -> bool:
        victim = self._members[1]
        if victim.alive:
            os.kill(victim.pid, signal.SIGKILL)
        return rebuild(self)

    with Session(2) as s:
        s.run("t = torch.ones(1)")
        monkeypatch.setattr(Session, "_rebuild", kill_rank_1_then_rebuild)
        with pytest.raises(RankExitedError) as info:
            s.run("dist.all_reduce(t)", ranks=[0])  # rank 1 never joins: the group is aborted, rebuilt
        assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
        assert s.status()[1].state == "dead"


def press_during(obj, name: str) -> threading.Thread:
    """Make ``obj.name()`` a step at which the stop button is pressed: a SIGINT to the main thread,
    sent from another thread once the step has begun, and delivered before the step's caller goes
    on (it lands in the step, a wait of it included, or right after it)."""
    step = getattr(obj, name)
    begun = threading.Event()
    presser = threading.Thread(target=lambda: (begun.wait(), signal.pthread_kill(
        threading.main_thread().ident, signal.SIGINT)))

    def pressed_step(*args, **kwargs):
        if presser.ident is None:  # the first call of the step
            presser.start()
            begun.set()
            try:
                return step(*args, **kwargs)
            finally:
                presser.join()
        return step(*args, **kwargs)

    setattr(obj, name, pressed_step)
    return presser


def test_the_stop_button_during_close_leaves_nothing_open(sigint_handler):
    # Before: an interrupt inside close() (while it waited for a rank to be gone) left the rank's
    # channels, pipes and pidfd, and the session's own, open for good: close() again did nothing.
    # Each press lands at a known step of close() (a timer fired from 0.5 ms on could press before
    # close() began, or before the test's try on a loaded machine: issue 35).
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    Session(1, ddp=False).close()  # the template started, its reader thread's fds counted
    before = open_fds()
    steps = {"kill a rank": lambda s: (s._members[1].process, "kill"),
             "wait for a rank to be gone": lambda s: (s._engine, "bury"),
             "close the engine": lambda s: (s._engine, "close"),
             "close the relay": lambda s: (s._engine.relay, "close")}
    for step, where in steps.items():
        s = Session(2)
        idents = identities(s)
        presser = press_during(*where(s))
        with pytest.raises(KeyboardInterrupt, match="interrupted, after the Session was closed"):
            s.close()
        assert presser.ident is not None and not presser.is_alive(), step  # pressed inside close(), once
        assert s.closed and gone(idents), step
        assert open_fds() == before, step
        s.close()  # idempotent, and nothing left to raise


def test_the_stop_button_just_before_close_leaves_the_session_open(sigint_handler, monkeypatch):
    # Before: close() marked the session closed, then took SIGINT: a press in between left its
    # ranks running, and every later close() waited for good for a close that never happened.
    from mpify_nb.engine import interrupts

    take_sigint = interrupts.take_sigint

    def pressed_first(*args):
        monkeypatch.setattr(interrupts, "take_sigint", take_sigint)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # lands here, at once
        return take_sigint(*args)

    s = Session(2)
    idents = identities(s)
    s.run("kept = rank")
    monkeypatch.setattr(interrupts, "take_sigint", pressed_first)
    with pytest.raises(KeyboardInterrupt):
        s.close()
    assert not s.closed and s.run("kept") == {0: 0, 1: 1}  # not begun: still open
    closing = threading.Thread(target=s.close, daemon=True)  # (before: it never returned)
    closing.start()
    closing.join(60)
    assert not closing.is_alive() and s.closed and gone(idents)


def test_a_cell_that_closes_a_ranks_stdout_leaves_the_next_cell_printing(session, capsys):
    """Issue 35: after ``os.close(1)`` on a rank, every later print there failed until a restart."""
    session.run("import os, sys")
    session.run("os.close(1)\nos.close(2)", ranks=[1])
    assert session.run("print('back', rank)\nprint('err', rank, file=sys.stderr)\nrank") == {0: 0, 1: 1}
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] back 0", "[rank 1] back 1"]
    assert sorted(err.splitlines()) == ["[rank 0] err 0", "[rank 1] err 1"]
    # Python's streams closed, or fd 1 pointed elsewhere: the next cell prints to the notebook too
    session.run("sys.stdout.close()\nsys.stderr.close()", ranks=[1])
    session.run("print('again', rank)", ranks=[1])
    session.run("os.dup2(os.open(os.devnull, os.O_WRONLY), 1)", ranks=[1])
    session.run("print('and again', rank)\nos.system('echo from a child')", ranks=[1])
    assert capsys.readouterr().out == "[rank 1] again 1\n[rank 1] and again 1\n[rank 1] from a child\n"
