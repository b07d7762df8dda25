"""The frontend's visual debugger on persistent ranks (issue 29), in a real kernel, with this test as
JupyterLab's debugger panel: it speaks DAP over the Jupyter protocol (debug_request on the control
channel, debug_event on IOPub) with jupyter_client, as helpers_debugger.DebugFrontend does.

One kernel with 2 ranks (gloo) serves most tests, in order; each leaves no breakpoint behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

pytest.importorskip("ipykernel")
pytest.importorskip("debugpy")
pytest.importorskip("jupyter_client")

import nbutil  # noqa: E402
from helpers_debugger import DAP_TIMEOUT, DebugFrontend, LabPanel  # noqa: E402
from mpify_nb.debugger.ids import BASE  # noqa: E402
from versions import needs_gloo_recorder  # noqa: E402


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    # A test that fails leaves the next a fresh kernel and ranks, the debugger on.
    def make() -> DebugFrontend:
        f = nbutil.ready(DebugFrontend(str(tmp_path_factory.mktemp("debugger"))), "ok",
                         ["%load_ext mpify_nb", "%dist_init -n 2"])
        try:
            f.enable()
        except BaseException:
            f.close()
            raise
        return f

    yield from nbutil.shared_kernel(make)


@pytest.fixture
def nb(front):
    front.drain_events()
    yield front
    front.clear_breakpoints()


def rank_threads(nb: DebugFrontend) -> dict[int, int]:
    """{rank: its main thread's id}, from the threads request."""
    names = nb.thread_names()
    return {int(name.split()[1]): tid for tid, name in names.items()
            if name.startswith("rank ") and name.endswith(" / MainThread")}


def stops(nb: DebugFrontend, n: int) -> dict[int, dict]:
    """The next ``n`` stopped events, by thread id."""
    found = {}
    for _ in range(n):
        event = nb.next_event("stopped")
        found[event["body"]["threadId"]] = event["body"]
    return found


def pid_of(nb: DebugFrontend, rank: int) -> int:
    cell = nb.ok(f"%%rank [{rank}]\nimport os\nos.getpid()")
    return int(cell.results[0].split()[-1])


# -- turning it on ------------------------------------------------------------------------------

def test_debug_info_and_threads_name_every_rank_and_the_kernel(nb):
    info = nb.dap("debugInfo")
    assert info["success"] and info["body"]["isStarted"] is True
    body = info["body"]
    assert (body["hashMethod"], body["hashSeed"], body["tmpFileSuffix"]) == ("Murmur2", 0xC70F6907, ".py")
    assert body["tmpFilePrefix"] == f"/tmp/ipykernel_{nb.km.provisioner.pid}/"
    assert body["stoppedThreads"] == []
    names = nb.thread_names()
    ranks = rank_threads(nb)
    assert sorted(ranks) == [0, 1] and all(tid >= BASE for tid in ranks.values())
    assert names[1] == "kernel / MainThread"  # the kernel's own debugpy numbers it 1
    assert [n for n in names.values() if n.startswith("rank ")] == ["rank 0 / MainThread", "rank 1 / MainThread"]


# -- a gutter breakpoint ------------------------------------------------------------------------

CELL = "a = rank * 10\nb = a + 1\nc = b * 2\nc"


def test_a_gutter_breakpoint_stops_both_ranks_at_that_line(nb):
    path = nb.breakpoints(CELL, [2])
    threads = rank_threads(nb)
    cell = nb.start(CELL)
    stopped = stops(nb, 2)
    assert sorted(stopped) == sorted(threads.values())
    assert {b["reason"] for b in stopped.values()} == {"breakpoint"}
    assert nb.dap("debugInfo")["body"]["stoppedThreads"] == sorted(threads.values())
    for rank, tid in threads.items():
        panel = nb.panel(tid)
        # the cell's frame only: none of mpify_nb's, nor the rank process's own
        assert [(f["name"], f["line"], f["source"]["path"]) for f in panel["frames"]] == [("<module>", 2, path)]
        assert panel["locals"]["a"] == str(rank * 10) and "b" not in panel["locals"]
        assert panel["globals"]["rank"] == str(rank) and panel["globals"]["world_size"] == "2"
        assert "__builtins__" not in panel["globals"]
        answer = nb.dap("evaluate", expression="a + 5", frameId=panel["frame"], context="repl")
        assert answer["success"] and answer["body"]["result"] == str(rank * 10 + 5)
    # next on rank 1 steps every stopped rank; one continued for both, then rank 1 stops last
    nb.drain_events()
    assert nb.dap("next", threadId=threads[1])["success"]
    assert nb.next_event("continued")["body"] == {"threadId": threads[1], "allThreadsContinued": True}
    stepped = [nb.next_event("stopped")["body"] for _ in range(2)]
    if stepped[-1]["threadId"] != threads[1]:  # rank 0 stopped last: rank 1's is shown again
        stepped.append(nb.next_event("stopped")["body"])
    assert {b["threadId"] for b in stepped} == set(threads.values())
    assert stepped[-1]["threadId"] == threads[1]  # the panel stays on rank 1
    assert {b["reason"] for b in stepped} == {"step"}
    panel = nb.panel(threads[1])
    assert panel["frames"][0]["line"] == 3 and panel["locals"]["b"] == "11"
    assert nb.dap("continue", threadId=threads[1])["body"] == {"allThreadsContinued": True}
    cell = nb.finish(cell)
    assert cell.status == "ok" and cell.results == ["[rank 0] 2\n[rank 1] 22"]
    # the ranks' own continued events were merged into the one each request gave
    continued = [e["body"] for e in nb.drain_events() if e["event"] == "continued"]
    assert continued == [{"threadId": threads[1], "allThreadsContinued": True}]


def test_a_rank_1_cell_stops_rank_1_only(nb):
    code = "%%rank [1]\nr1 = rank + 100\nr2 = r1 + 1\nr2"
    path = nb.breakpoints(code, [3])
    threads = rank_threads(nb)
    cell = nb.start(code)
    stop = nb.next_event("stopped")["body"]
    assert stop["threadId"] == threads[1]
    panel = nb.panel(threads[1])
    assert panel["frames"][0]["line"] == 3 and panel["frames"][0]["source"]["path"] == path
    assert panel["locals"]["r1"] == "101"
    assert nb.dap("continue", threadId=threads[1])["success"]
    cell = nb.finish(cell)
    assert cell.status == "ok" and cell.results == ["[rank 1] 102"]
    assert [e for e in nb.drain_events() if e["event"] == "stopped"] == []


def test_line_1_of_a_rank_cell_stops_the_ranks_never_the_kernel_in_the_magic(nb):
    code = "first = rank + 1\nsecond = first * 3\nsecond"
    nb.breakpoints(code, [1])
    threads = rank_threads(nb)
    cell = nb.start(code)
    stopped = stops(nb, 2)
    assert sorted(stopped) == sorted(threads.values())  # not the kernel's thread 1
    assert nb.panel(threads[0])["frames"][0]["line"] == 1
    assert nb.dap("continue", threadId=threads[0])["success"]
    cell = nb.finish(cell)
    assert cell.status == "ok" and cell.results == ["[rank 0] 3\n[rank 1] 6"]
    assert [e for e in nb.drain_events() if e["event"] == "stopped"] == []


def test_local_and_to_both_cells_stop_the_kernel_where_they_run_there(nb):
    code = "%%local\nk1 = 5\nk2 = k1 + 1\nk2"
    path = nb.breakpoints(code, [3])
    cell = nb.start(code)
    stop = nb.next_event("stopped")["body"]
    assert stop["threadId"] == 1  # the kernel's MainThread
    panel = nb.panel(1)
    assert (panel["frames"][0]["line"], panel["frames"][0]["source"]["path"]) == (3, path)
    assert panel["locals"]["k1"] == "5"
    assert nb.dap("continue", threadId=1)["success"]
    cell = nb.finish(cell)
    assert cell.status == "ok" and cell.results == ["6"]

    code = "%%distributed --to both\nv1 = 7\nv2 = v1 + 1\nv2"
    nb.breakpoints(code, [3])
    threads = rank_threads(nb)
    cell = nb.start(code)
    assert nb.next_event("stopped")["body"]["threadId"] == 1  # the kernel runs it first
    assert nb.panel(1)["locals"]["v1"] == "7"
    assert nb.dap("continue", threadId=1)["success"]
    assert sorted(stops(nb, 2)) == sorted(threads.values())  # then the ranks
    assert nb.dap("continue", threadId=threads[0])["success"]
    cell = nb.finish(cell)
    assert cell.status == "ok" and cell.results == ["[kernel] 8", "[rank 0] 8\n[rank 1] 8"]


# -- one rank at a time, and requests that must not hang ---------------------------------------

def test_continue_one_rank_with_single_thread(nb):
    code = "s1 = rank\ns2 = s1 + 1\ns2"
    nb.breakpoints(code, [2])
    threads = rank_threads(nb)
    cell = nb.start(code)
    stops(nb, 2)
    nb.drain_events()
    answer = nb.dap("continue", threadId=threads[0], singleThread=True)
    assert answer["success"] and answer["body"] == {"allThreadsContinued": False}
    assert nb.next_event("continued")["body"] == {"threadId": threads[0], "allThreadsContinued": False}
    # JupyterLab cleared its panel: the rank still stopped is shown again
    assert nb.next_event("stopped")["body"]["threadId"] == threads[1]
    assert nb.dap("debugInfo")["body"]["stoppedThreads"] == [threads[1]]
    running = nb.dap("stackTrace", threadId=threads[0])
    assert not running["success"] and "running" in running["message"]
    # a continue of one thread that runs is answered here (debugpy would never answer it)
    assert nb.dap("continue", threadId=threads[0], singleThread=True)["body"] == {"allThreadsContinued": False}
    assert not nb.dap("next", threadId=threads[0])["success"]
    assert nb.panel(threads[1])["locals"]["s1"] == "1"
    # JupyterLab's continue names thread 1 (the kernel's) whichever stopped: every stopped thread goes on
    assert nb.dap("continue", threadId=1)["body"] == {"allThreadsContinued": True}
    assert nb.next_event("continued")["body"] == {"threadId": threads[1], "allThreadsContinued": True}
    cell = nb.finish(cell)
    assert cell.status == "ok" and cell.results == ["[rank 0] 1\n[rank 1] 2"]


def test_rich_inspect_and_copy_to_globals_on_the_chosen_rank(nb):
    code = "import collections\nrv = collections.Counter(x=rank + 4)\nrw = 1"
    nb.breakpoints(code, [3])
    threads = rank_threads(nb)
    cell = nb.start(code)
    stops(nb, 2)
    frame = nb.panel(threads[1])["frame"]
    rich = nb.dap("richInspectVariables", variableName="rv", frameId=frame)
    assert rich["success"] and rich["body"]["data"]["text/plain"] == "Counter({'x': 5})"
    assert nb.dap("copyToGlobals", dstVariableName="rv_copy", srcVariableName="rv", srcFrameId=frame)["success"]
    assert nb.dap("continue", threadId=threads[1])["success"]
    assert nb.finish(cell).status == "ok"
    assert nb.ok("%%rank [1]\nrv_copy").results == ["[rank 1] Counter({'x': 5})"]
    assert nb.run("%%rank [0]\nrv_copy").ename == "RankRaisedError"  # rank 1's only


def test_a_rank_that_does_not_answer_gets_an_error_not_a_wedge(nb):
    threads = rank_threads(nb)
    pid = pid_of(nb, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        names = nb.thread_names()  # answered without rank 1, after its time
        assert threads[0] in names and threads[1] not in names and names[1] == "kernel / MainThread"
        code = "nw = rank\nnw"
        answer = nb.dap("setBreakpoints", source={"path": nb.cell_path(code)}, breakpoints=[{"line": 2}])
        assert answer["success"] and answer["body"]["breakpoints"][0]["line"] == 2  # the kernel's own
        assert answer["message"] == "rank 1 did not answer 'setBreakpoints' in time (busy in C code holding the GIL?)"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert nb.dap("continue", threadId=threads[1])["success"]  # it runs: nothing to do
    assert sorted(rank_threads(nb)) == [0, 1]
    nb.paths.add(nb.cell_path(code))


# -- while ranks are stopped ---------------------------------------------------------------------

def test_a_peer_waiting_on_a_stopped_rank_is_no_error_and_timeout_does_not_run(nb):
    nb.ok("%%local\nfrom mpify_nb.magics.session import session\nsession().timeout = 1")
    try:
        code = "t = torch.ones(1)\nif rank == 1:\n    held = 1\ndist.all_reduce(t)\nt"
        nb.breakpoints(code, [3])
        threads = rank_threads(nb)
        cell = nb.start(code)
        assert nb.next_event("stopped")["body"]["threadId"] == threads[1]
        # rank 0 waits in all_reduce for rank 1 meanwhile: past the collective watch's grace and
        # the call's 1 s limit, as at a pdb prompt
        time.sleep(2.5)
        went_on = nb.dap("continue", threadId=threads[1])
        assert went_on["success"], went_on
        cell = nb.finish(cell)
        assert cell.status == "ok", cell
        assert cell.results == ["[rank 0] tensor([2.])\n[rank 1] tensor([2.])"]
    finally:
        nb.ok("%%local\nsession().timeout = None")


@needs_gloo_recorder
def test_a_mismatch_waits_while_a_rank_is_stopped_and_is_reported_once_it_goes_on(nb):
    """Rank 1 issued a broadcast that rank 0's all_reduce can never match, then stops at a
    breakpoint: no verdict while the user debugs it (it waits for the user, as at a prompt);
    the CollectiveError comes once it goes on, and the group works again. That is the collective
    watch's verdict, with the collective check off. On (the default), the check finds it: rank 0's
    all_reduce raises at once; rank 1's async broadcast returns at once, as torch's does, and its
    error is raised from ``w.wait()``, after the breakpoint, with the check's own words."""
    code = ("t = torch.ones(1)\nif rank == 1:\n    w = dist.broadcast(t, 0, async_op=True)\n    held = 1\n"
            "    w.wait()\nelse:\n    dist.all_reduce(t)")
    nb.breakpoints(code, [4])
    threads = rank_threads(nb)
    cell = nb.start(code)
    assert nb.next_event("stopped")["body"]["threadId"] == threads[1]
    assert nb.dap("continue", threadId=threads[1])["success"]
    checked = nb.finish(cell)
    assert checked.ename == "CollectiveError", checked
    assert re.search(r"the ranks called collectives that cannot match \(a different op\): rank 0 at Cell "
                     rf"In\[{checked.number}\], line 7: all_reduce #(\d+) of float32\[1\]; rank 1 at line 3: broadcast "
                     r"#\1 of float32\[1\] from rank 0; no rank entered it",
                     checked.traceback), checked.traceback
    nb.ok("%%local\nfrom mpify_nb import set_collective_checks\nset_collective_checks(False)")
    try:
        _a_mismatch_waits_for_a_stopped_rank(nb, code)
    finally:
        nb.ok("%%local\nset_collective_checks(True)")


def _a_mismatch_waits_for_a_stopped_rank(nb, code):
    threads = rank_threads(nb)
    cell = nb.start(code)
    assert nb.next_event("stopped")["body"]["threadId"] == threads[1]
    time.sleep(3.0)  # several of the watch's looks, each seeing the mismatch
    assert not cell.idle, cell
    assert nb.dap("continue", threadId=threads[1])["success"]
    cell = nb.finish(cell)
    assert cell.ename == "CollectiveError", cell
    # rank 1 may be looked at on its way from line 4 (the breakpoint) to line 5 (w.wait())
    assert re.search(r"the ranks wait in collectives that cannot match \(a different op\): rank 0 at Cell "
                     rf"In\[{cell.number}\], line 7: all_reduce #(\d+) of float32\[1\]; rank 1 at line [45]: broadcast "
                     r"#\1 of float32\[1\]", cell.traceback), cell.traceback  # numbered on the module's group
    nb.clear_breakpoints()
    assert nb.ok("t = torch.ones(1)\ndist.all_reduce(t)\nt").results == ["[rank 0] tensor([2.])\n[rank 1] tensor([2.])"]


def stop_button_while_both_stop(nb: DebugFrontend, code: str, continued_within: float = DAP_TIMEOUT) -> dict[int, int]:
    """Run ``code`` (a breakpoint set at its line 2) until both ranks stop, press the stop button:
    the cell ends with KeyboardInterrupt and each rank's thread is said to continue within
    ``continued_within`` s, with no request from the frontend meanwhile. {rank: thread id}."""
    nb.breakpoints(code, [2])
    threads = rank_threads(nb)
    cell = nb.start(code)
    stops(nb, 2)
    nb.drain_events()
    nb.km.interrupt_kernel()
    cell = nb.finish(cell)
    assert cell.ename == "KeyboardInterrupt", cell
    resumed = set()
    while resumed != set(threads.values()):
        resumed.add(nb.next_event("continued", timeout=continued_within)["body"]["threadId"])
    assert nb.dap("debugInfo")["body"]["stoppedThreads"] == []
    return threads


def test_the_stop_button_releases_stopped_ranks_and_keeps_the_session(nb):
    code = "sb = rank + 1\nsb2 = sb * 2\nsb2"
    threads = stop_button_while_both_stop(nb, code)
    assert nb.ok("sb").results == ["[rank 0] 1\n[rank 1] 2"]
    # the breakpoint still holds
    cell = nb.start(code)
    stops(nb, 2)
    assert nb.dap("continue", threadId=threads[0])["success"]
    assert nb.finish(cell).results == ["[rank 0] 2\n[rank 1] 4"]


@pytest.mark.parametrize("late", [1.0, 4.0])
def test_a_ranks_continued_that_comes_after_the_stopped_cell_ended_still_reaches_the_panel(nb, late):
    """CI (stop 48): after the stop button, rank 1's continued left it just as the cell ended, on
    a channel nobody read between cells: the panel showed rank 1 stopped until the next request.
    Here rank 1's bridge holds its first continued back ``late`` s: read after the cell (1 s), or told
    by the kernel once CONTINUED_WAIT is over (4 s), with no request from the frontend meanwhile."""
    nb.ok("import mpify_nb.rank.debugger as late_dbg, time as late_time\n"
          "late_forward = late_dbg._forward\n"
          "def late_continued(control, body, rank=rank, forward=late_forward, once=[1]):\n"
          "    if rank == 1 and b'\"continued\"' in body and once:\n"
          "        once.pop()\n"
          f"        late_time.sleep({late})\n"
          "    forward(control, body)\n"
          "late_dbg._forward = late_continued")
    try:
        code = "lc = rank + 1\nlc2 = lc * 2\nlc2"
        threads = stop_button_while_both_stop(nb, code, continued_within=10.0)
        cell = nb.start(code)  # the late continued, read now, does not hide the new stops
        assert sorted(stops(nb, 2)) == sorted(threads.values())
        assert nb.dap("debugInfo")["body"]["stoppedThreads"] != []
        reply = nb.dap("continue", threadId=threads[0])
        assert reply["success"], json.dumps(reply)
        assert nb.finish(cell).results == ["[rank 0] 2\n[rank 1] 4"]
    finally:
        nb.ok("late_dbg._forward = late_forward")


def test_a_rank_that_dies_while_stopped_exits_and_restart_debugs_again(nb):
    code = "d1 = torch.ones(1) * rank\nif rank == 1:\n    d2 = 1\ndist.all_reduce(d1)\nd1"
    nb.breakpoints(code, [3])
    threads = rank_threads(nb)
    pid = pid_of(nb, 1)
    cell = nb.start(code)
    assert nb.next_event("stopped")["body"]["threadId"] == threads[1]
    nb.drain_events()
    os.kill(pid, signal.SIGKILL)
    cell = nb.finish(cell)
    assert cell.ename == "RankExitedError" and "rank 1" in cell.traceback, cell
    assert nb.next_event("thread", reason="exited", threadId=threads[1])
    assert nb.dap("debugInfo")["body"]["stoppedThreads"] == []
    nb.ok("%dist_restart")
    fresh = rank_threads(nb)
    assert fresh[0] == threads[0] and fresh[1] != threads[1]  # a new process, a new thread
    cell = nb.start(code)
    assert nb.next_event("stopped")["body"]["threadId"] == fresh[1]
    assert nb.panel(fresh[1])["locals"]["d1"] == "tensor([1.])"
    assert nb.dap("continue", threadId=fresh[1])["success"]
    cell = nb.finish(cell)
    assert cell.status == "ok" and cell.results == ["[rank 0] tensor([1.])\n[rank 1] tensor([1.])"]


# -- turning it on and off, before and after %dist_init --------------------------------------------

def test_turned_on_after_and_before_dist_init_off_again_and_ranks_pay_nothing_until_then(tmp_path):
    f = DebugFrontend(str(tmp_path))
    try:
        f.ok("%load_ext mpify_nb")
        f.ok("%dist_init -n 2")
        # nothing of the debugger in the ranks until the frontend turns it on
        assert f.ok("import sys\n'debugpy' in sys.modules").results == ["[rank 0] False\n[rank 1] False"]
        code = "on1 = rank + 1\non2 = on1 + 1\non2"
        f.enable()
        f.breakpoints(code, [2])
        cell = f.start(code)
        threads = stops(f, 2)
        assert f.dap("continue", threadId=min(threads))["success"]
        assert f.finish(cell).results == ["[rank 0] 2\n[rank 1] 3"]
        # off: breakpoints gone, cells untraced again
        assert f.dap("disconnect", restart=False, terminateDebuggee=False)["success"]
        assert f.ok(code).results == ["[rank 0] 2\n[rank 1] 3"]
        assert f.ok("sys.gettrace() is None").results == ["[rank 0] True\n[rank 1] True"]
        assert [e for e in f.drain_events() if e["event"] == "stopped"] == []
        # on again, the same ranks: their breakpoints come back with the panel
        f.enable()
        f.breakpoints(code, [2])
        cell = f.start(code)
        assert sorted(stops(f, 2)) == sorted(threads)
        assert f.dap("continue", threadId=1)["success"]
        assert f.finish(cell).results == ["[rank 0] 2\n[rank 1] 3"]
        assert f.dap("disconnect", restart=False, terminateDebuggee=False)["success"]
        f.ok("%dist_shutdown")
        # on again before the ranks exist: they are attached before their first cell
        f.enable()
        f.breakpoints(code, [2])
        f.ok("%dist_init -n 2")
        cell = f.start(code)
        threads = stops(f, 2)
        assert sorted(rank_threads(f).values()) == sorted(threads)
        assert f.dap("continue", threadId=min(threads))["success"]
        assert f.finish(cell).results == ["[rank 0] 2\n[rank 1] 3"]
        f.ok("%dist_shutdown")
        exited = {f.next_event("thread", reason="exited")["body"]["threadId"] for _ in range(2)}
        assert exited == set(threads)
        assert [name for name in f.thread_names().values() if name.startswith("rank")] == []
    finally:
        f.close()


def test_jupyterlabs_panel_through_a_stop_a_step_and_a_continue(nb):
    """The panel as JupyterLab's DebuggerService drives it (helpers_debugger.LabPanel): it shows
    the thread of the last stop, and its continue names thread 1 whatever stopped."""
    panel = LabPanel(nb)
    code = "lp = rank * 3\nlq = lp + 1\nlr = lq * 2\nlr"
    nb.breakpoints(code, [2])
    threads = rank_threads(nb)
    ranks = {tid: rank for rank, tid in threads.items()}
    cell = nb.start(code)
    panel.take(2)
    shown = ranks[panel.current()]
    assert panel.frames[0]["line"] == 2 and panel.scopes["Locals"]["lp"] == str(shown * 3)
    assert panel.press("next")["success"]
    panel.take(2)
    if ranks[panel.current()] != shown:  # the stepped rank stopped first: its stop comes again, last
        panel.take(1)
    assert ranks[panel.current()] == shown  # the panel stays on the rank it showed
    assert panel.frames[0]["line"] == 3 and panel.scopes["Locals"]["lq"] == str(shown * 3 + 1)
    answer = panel.press("continue")  # names thread 1, the kernel's: every stopped rank goes on
    assert answer["success"] and answer["body"] == {"allThreadsContinued": True}
    cell = nb.finish(cell)
    assert cell.status == "ok" and cell.results == ["[rank 0] 2\n[rank 1] 8"]
