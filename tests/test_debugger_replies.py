"""The debugger panel never wedges (issue 35): every request the frontends send is answered within
5 s, with a result or a failure that says why, whatever is stopped: nothing, the kernel at a
``%%local`` breakpoint, a rank, or both at once; and the panel works on afterwards (steps stop
where they should, continue lets the cell finish, disconnect then enable starts over).

The frontend is a real client on the Jupyter protocol (helpers_debugger): VS Code's panel asks
for ``threads`` after every stop, JupyterLab's for the stopped thread's stack, scopes and
variables; both send every request one at a time and wait for its reply, so one unanswered
request wedges the panel until the kernel restarts. (Before this fix: with a Session and the kernel
stopped at a breakpoint, ``threads`` got no reply in 30 s, and nothing after it did: the hub waited
for the ranks on a pool thread that the kernel's debugpy suspended with the kernel.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("ipykernel")
pytest.importorskip("debugpy")
pytest.importorskip("jupyter_client")

import nbutil  # noqa: E402
from helpers_debugger import DebugFrontend, VSCodePanel  # noqa: E402

#: What the issue asks of every reply.
REPLY_WITHIN = 5.0
#: How long the test waits for a reply before it calls it lost (longer, to tell slow from never).
LOST_AFTER = 20.0

#: The code: stopped at ``b = grow(a)`` (line 5 of the body), stepped into ``grow`` (2), over its
#: line (3) and out of it; lines counted from the cell's first (a magic's header included).
BODY = "def grow(v):\n    w = v + 1\n    return w\na = {base}\nb = grow(a)\nc = b * 2\n"
RANK_BODY = BODY.format(base="rank + 1") + "c"
KERNEL_CELL = "%%local\n" + BODY.format(base="10") + "c"
RANK_CELL = "%%rank [1]\n" + RANK_BODY
#: The kernel stopped while rank 1 is: a call on a thread of the kernel stops at rank 1's
#: breakpoint, then the kernel at its own (the body starts at line 11).
BOTH_CELL = ("%%local\nimport threading, time\nfrom mpify_nb.magics.session import session\n"
             "from mpify_nb.debugger.kernel import hub\nout = {{}}\n"
             "th = threading.Thread(target=lambda: out.update(\n"
             "    r=session().run({body!r}, ranks=[1], filename={path!r})))\n"
             "th.start()\nwhile not hub().threads.stopped():\n    time.sleep(0.02)\n"
             + BODY.format(base="10") + "th.join()\n(c, out['r'])")
#: Where each step leaves a thread, from the line of ``b = grow(a)``.
STEPS = (("stepIn", -3), ("next", -2), ("stepOut", 0))


@dataclass
class Stop:
    """What is stopped: thread id -> the line it shows; its ``a``; the cell's result."""

    cell: object = None
    threads: dict[int, int] = field(default_factory=dict)  # thread -> the line its top frame shows
    values: dict[int, int] = field(default_factory=dict)  # thread -> its `a` (nothing stopped: any thread)
    result: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    def make() -> DebugFrontend:
        f = nbutil.ready(DebugFrontend(str(tmp_path_factory.mktemp("replies"))), "ok",
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
    front.replies.clear()
    yield front
    front.clear_breakpoints()


def rank1_thread(nb: DebugFrontend) -> int:
    names = {t["id"]: t["name"] for t in nb.dap("threads")["body"]["threads"]}
    return next(tid for tid, name in names.items() if name == "rank 1 / MainThread")


def reach(nb: DebugFrontend, panel: VSCodePanel, state: str) -> Stop:
    """Run the cell of ``state`` to its breakpoint(s); the panel handles each stop as VS Code."""
    rank1 = rank1_thread(nb)
    if state == "nothing":
        return Stop(values={1: 10, rank1: 2})
    if state == "kernel":
        nb.breakpoints(KERNEL_CELL, [6])
        stop = Stop(nb.start(KERNEL_CELL), {1: 6}, {1: 10}, ["22"])
    elif state == "rank":
        nb.breakpoints(RANK_CELL, [6])
        stop = Stop(nb.start(RANK_CELL), {rank1: 6}, {rank1: 2}, ["[rank 1] 6"])
    else:
        rank_path = nb.breakpoints(RANK_BODY, [5])
        cell = BOTH_CELL.format(body=RANK_BODY, path=rank_path)
        nb.breakpoints(cell, [15])
        stop = Stop(nb.start(cell), {rank1: 5, 1: 15}, {rank1: 2, 1: 10}, ["(22, {1: 6})"])
    take_stops(nb, panel, set(stop.threads))
    return stop


def take_stops(nb: DebugFrontend, panel: VSCodePanel, threads: set[int]) -> None:
    """Until each of ``threads`` stopped (the panel handles every event meanwhile)."""
    seen: set[int] = set()
    while not threads <= seen:
        event = nb.next_event("stopped")
        panel.handle(event)
        seen.add(event["body"]["threadId"])


def top_line(nb: DebugFrontend, thread: int) -> int:
    stack = nb.dap("stackTrace", threadId=thread)
    assert stack["success"], stack
    return stack["body"]["stackFrames"][0]["line"]


def assert_answered(nb: DebugFrontend) -> None:
    """Every request so far got a reply within REPLY_WITHIN, a success or a failure that says why."""
    slow = [(command, round(seconds, 2)) for command, seconds, _ in nb.replies if seconds > REPLY_WITHIN]
    assert not slow, slow
    unexplained = [(command, reply) for command, _, reply in nb.replies
                   if not (reply.get("success") is True or (reply.get("success") is False and reply.get("message")))]
    assert not unexplained, unexplained
    nb.replies.clear()


def ask_everything(nb: DebugFrontend, stop: Stop, threads: dict[int, int]) -> None:
    """Every request that leaves the threads where they are, about each thread concerned;
    ``threads``: where the stopped ones are now."""
    for thread, a in stop.values.items():
        nb.dap("threads", timeout=LOST_AFTER)
        stack = nb.dap("stackTrace", timeout=LOST_AFTER, threadId=thread)
        frames = (stack.get("body") or {}).get("stackFrames") or []
        frame = frames[-1]["id"] if frames else 1  # the cell's own frame (a step may be in grow)
        scopes = nb.dap("scopes", timeout=LOST_AFTER, frameId=frame)
        references = [s["variablesReference"] for s in (scopes.get("body") or {}).get("scopes") or []] or [1]
        variables = nb.dap("variables", timeout=LOST_AFTER, variablesReference=references[0])
        value = nb.dap("evaluate", timeout=LOST_AFTER, expression="a + 5", frameId=frame, context="repl")
        nb.dap("evaluate", timeout=LOST_AFTER, expression="2 + 2", context="repl")
        rich = nb.dap("richInspectVariables", timeout=LOST_AFTER, variableName="a", frameId=frame)
        nb.dap("copyToGlobals", timeout=LOST_AFTER, dstVariableName="copied", srcVariableName="a", srcFrameId=frame)
        if thread in threads:  # what a stopped thread shows: exact
            assert frames[0]["line"] == threads[thread], frames
            assert variables["success"], variables
            assert {v["name"]: v["value"] for v in variables["body"]["variables"]}["a"] == str(a)
            assert value["success"] and value["body"]["result"] == str(a + 5), value
            assert rich["success"] and rich["body"]["data"]["text/plain"] == str(a), rich
        info = nb.dap("debugInfo", timeout=LOST_AFTER)
        stopped = set(info["body"]["stoppedThreads"])
        # the kernel's debugpy stops all its threads at once, and ipykernel lists them all
        assert info["success"] and stopped >= set(threads) and {t for t in stopped if t > 1 << 40} == \
            {t for t in threads if t > 1 << 40} and (1 in stopped) == (1 in threads), info
        nb.dap("inspectVariables", timeout=LOST_AFTER)
        code = "zz = 1\nzz"
        path = nb.dap("dumpCell", timeout=LOST_AFTER, code=code)["body"]["sourcePath"]
        nb.dap("setBreakpoints", timeout=LOST_AFTER, source={"path": path}, breakpoints=[{"line": 2}], lines=[2])
        nb.paths.add(path)
        nb.dap("configurationDone", timeout=LOST_AFTER)
        nb.dap("initialize", timeout=LOST_AFTER, clientID="vscode", adapterID="python", pathFormat="path",
               linesStartAt1=True, columnsStartAt1=True)
        nb.dap("attach", timeout=LOST_AFTER)
    assert_answered(nb)


STATES = ["nothing", "kernel", "rank", "both"]


@pytest.mark.parametrize("state", STATES)
def test_every_request_is_answered_within_5_s_and_steps_and_continue_work_after(nb, state):
    panel = VSCodePanel(nb)
    stop = reach(nb, panel, state)
    ask_everything(nb, stop, stop.threads)
    if not stop.threads:  # nothing stopped: a step is refused, a continue has nothing to do
        for thread in stop.values:
            for command in ("next", "stepIn", "stepOut"):
                answer = nb.dap(command, timeout=LOST_AFTER, threadId=thread)
                assert not answer["success"] and "not stopped" in answer["message"], answer
            answer = nb.dap("continue", timeout=LOST_AFTER, threadId=thread)
            assert answer["success"] and answer["body"] == {"allThreadsContinued": False}, answer
        assert_answered(nb)
        assert nb.ok("%%rank [1]\nrank").results == ["[rank 1] 1"]
        return
    focus = max(stop.threads)  # a rank's, when one is stopped (the kernel's thread is 1)
    for command, offset in STEPS:  # every stopped thread steps
        answer = nb.dap(command, timeout=LOST_AFTER, threadId=focus)
        assert answer["success"], answer
        take_stops(nb, panel, set(stop.threads))
        now = {t: line + offset for t, line in stop.threads.items()}
        assert {t: top_line(nb, t) for t in stop.threads} == now
        ask_everything(nb, stop, now)
    answer = nb.dap("continue", timeout=LOST_AFTER, threadId=1)  # as JupyterLab: thread 1, whatever stopped
    assert answer["success"] and answer["body"] == {"allThreadsContinued": True}, answer
    assert_answered(nb)
    cell = nb.finish(stop.cell)
    assert cell.status == "ok" and cell.results == stop.result, cell


@pytest.mark.parametrize("state", STATES)
def test_disconnect_lets_go_and_the_panel_starts_over(nb, state):
    panel = VSCodePanel(nb)
    stop = reach(nb, panel, state)
    answer = nb.dap("disconnect", timeout=LOST_AFTER, restart=False, terminateDebuggee=False)
    assert answer["success"], answer
    nb.paths.clear()  # the kernel and the ranks forgot every breakpoint
    if stop.cell is not None:
        cell = nb.finish(stop.cell)
        assert cell.status == "ok" and cell.results == stop.result, cell
    nb.enable()
    assert_answered(nb)
    nb.breakpoints(RANK_CELL, [6])
    cell = nb.start(RANK_CELL)
    take_stops(nb, panel, {rank1_thread(nb)})
    assert nb.dap("continue", threadId=1)["success"]
    assert nb.finish(cell).results == ["[rank 1] 6"]
    assert_answered(nb)
