"""Background work in a real Jupyter kernel, driven from the frontend's side (jupyter_client): each
output is filed under the request its parent header names, as JupyterLab files it, so the tests
say exactly which cell every line, bar update and figure went to while other cells ran.

The scenario a user lives through: train in the background (``%%distributed --bg``), run other
cells meanwhile (``%%local`` ones, a stop button pressed on one of them, a rank cell refused),
read live state (``%dist_pull``, ``%dist_where``, ``%dist_status``), stop it (``%dist_stop``),
restart a rank, train again to the end (``%dist_wait``), fail in the background, restart the
kernel while training runs. And ``ranch(..., wait=False)``, whose rank 0 is a thread of the kernel.
"""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

from helpers_background import Frontend, Sent  # noqa: E402

TRAIN = """\
import time
from tqdm import tqdm
import matplotlib.pyplot as plt
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
steps_done, losses = 0, []
for step in tqdm(range(STEPS), desc="train", mininterval=0.05):
    x = torch.randn(8, 4)
    loss = ((model(x) - 1) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    steps_done += 1
    if step % 25 == 0:
        print(f"step {step} loss {loss.item():.3f}", flush=True)
    if step == 5:
        plt.plot(losses)
        plt.show()
    time.sleep(0.01)
"""


def train_cell(steps: int) -> str:
    return "%%distributed --bg\n" + TRAIN.replace("STEPS", str(steps)) + "len(losses)"


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.05)


def assert_only_in(front: Frontend, owners: list[Sent], pattern: str) -> None:
    """Every output that matches ``pattern``, of every cell, belongs to one of ``owners`` (the cells
    that started the work), and none is stray (a parent that is no request of ours)."""
    assert not front.stray, f"outputs with no request of ours as their parent: {front.stray[:3]}"
    for sent in list(front.sent.values()):
        if all(sent is not owner for owner in owners):
            assert not re.search(pattern, sent.text()), f"{pattern!r} in {sent.code!r}:\n{sent.text()}"


def training_cells(front: Frontend) -> list[Sent]:
    return [sent for sent in list(front.sent.values()) if sent.code.startswith("%%distributed --bg")]


def display_ids(sent: Sent, kind: str) -> set[str]:
    return {m["content"].get("transient", {}).get("display_id") for m in sent.outputs if m["msg_type"] == kind} - {None}


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    f = Frontend(str(tmp_path_factory.mktemp("background")))
    try:
        f.ok("%load_ext mpify_nb")
        f.ok("%dist_init -n 2")
        yield f
    finally:
        f.close()  # also: no process of the kernel is left


def test_training_in_the_background_while_the_notebook_is_used(front):
    started = time.monotonic()
    train = front.ok(train_cell(100000))
    assert time.monotonic() - started < 20  # it returned before the training ended (100000 steps)
    number = train.reply["content"]["execution_count"]
    assert "[mpify_nb] running in the background on ranks 0, 1" in train.text()
    front.wait_for(train, r"\[rank 1\] step 25 loss")

    # The notebook is free: kernel cells run, and answer at once.
    local = front.ok("%%local\nprint('local', 1 + 1)")
    assert local.text() == "local 2\n"
    # The stop button ends the cell that runs now; the training goes on.
    sleeper = front.start("%%local\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)")
    front.wait_for(sleeper, "sleeping")
    front.interrupt()
    front.finish(sleeper)
    assert sleeper.status == "error" and sleeper.reply["content"]["ename"] == "KeyboardInterrupt"
    # A rank cell is refused, saying which cell holds the ranks and what to do.
    refused = front.fails("y = 1", "RanksBusyError")
    text = refused.text()
    assert f"ranks 0, 1 run the background work %%distributed started in In [{number}]" in text, text
    assert "%dist_wait waits for it, %dist_stop stops it" in text and "--after" in text
    assert "Traceback" not in text  # the message, not the library's frames

    # Live state: the ranks' variables as they are now, while they train.
    front.ok("%dist_pull steps_done")
    first = front.value("steps_done")
    until(lambda: (front.ok("%dist_pull steps_done"), front.value("steps_done"))[1] > first, what="more steps")
    front.ok("%dist_pull losses --all")
    assert front.value("[len(l) >= 1 for l in losses]") == [True, True]
    plot = front.ok("%%local\nimport matplotlib.pyplot as plt\nplt.plot(losses[0])\nplt.show()")
    assert any("image/png" in m["content"]["data"] for m in plot.outputs if m["msg_type"] == "display_data")
    where = front.ok("%dist_where").text()
    assert re.search(rf"rank 0: .*\n(.*\n)*  Cell In\[{number}\], line \d+, in <module>", where), where
    status = front.ok("%dist_status").text()
    assert f"background: %%distributed started in In [{number}], running for" in status, status
    assert re.search(r"0 +\d+ +running", status), status

    # Stopped as the stop button stops a blocking cell: every rank keeps its state.
    stop = front.ok("%dist_stop")
    assert stop.text() == f"Stopped the background work %%distributed started in In [{number}]: every rank " \
                          "stopped what it ran and keeps its state.\n"
    front.wait_for(train, rf"the background work %%distributed started in In \[{number}\] was cancelled")
    kept = front.ok("steps_done").text()
    assert re.fullmatch(r"\[rank 0\] (\d+)\n\[rank 1\] (\d+)\n", kept), kept
    front.ok("%dist_pull steps_done")
    assert front.value("steps_done") == int(re.match(r"\[rank 0\] (\d+)", kept).group(1))

    # Every line, bar and figure of the training went to its own cell, and only there.
    shown = train.text()
    assert re.search(r"\[rank 0\] step 0 loss", shown) and re.search(r"\[rank 1\] step 25 loss", shown)
    assert re.search(r"\[rank [01]\] train: +\d+%", shown), shown  # the tqdm bars, live lines of the cell
    figures = [m for m in train.outputs if m["msg_type"] in ("display_data", "update_display_data")
               and "image/png" in m["content"]["data"]]
    assert len(figures) == 2, shown  # each rank's plt.show()
    assert display_ids(train, "update_display_data") <= display_ids(train, "display_data")
    assert_only_in(front, training_cells(front), r"\[rank \d\] (step \d+|train:)")


def test_restart_a_rank_after_stopping_and_train_again_to_the_end(front):
    front.ok("%%distributed\nkept = rank * 10")
    restart = front.ok("%dist_restart 1")
    assert re.fullmatch(r"Restarted rank 1 \(pid \d+\); the group is rebuilt, the other ranks kept their state.\n",
                        restart.text()), restart.text()
    assert front.ok("globals().get('kept', 'lost')").text() == "[rank 0] 0\n[rank 1] 'lost'\n"
    train = front.ok(train_cell(60))
    number = train.reply["content"]["execution_count"]
    after = front.ok("%%distributed --after\nlen(losses)")  # waits for the ranks, then runs
    assert after.text() == f"[mpify_nb] waiting for the background work %%distributed started in In [{number}] " \
        f"to end (running for {after.text().split('running for ')[1].split(')')[0]})\n[rank 0] 60\n[rank 1] 60\n"
    front.wait_for(train, r"\[rank 0\] 60\n\[rank 1\] 60")  # its values, in its own cell, at its end
    wait = front.ok("%dist_wait")
    assert re.fullmatch(rf"The background work %%distributed started in In \[{number}\] finished after [\d.]+ s\.\n",
                        wait.text()), wait.text()
    assert front.ok("%dist_wait").text() == "Nothing runs in the background.\n"
    assert_only_in(front, training_cells(front), r"\[rank \d\] (step \d+|train:)")


def test_an_error_in_the_background_shows_in_its_cell_and_fails_dist_wait(front):
    bg = front.ok("%%rank [1] --bg\nimport time\ntime.sleep(0.5)\nraise ValueError('rank 1 gave up')")
    number = bg.reply["content"]["execution_count"]
    wait = front.fails("%dist_wait", "RankRaisedError")
    assert f"the background work %%rank [1] started in In [{number}] failed: rank 1 raised ValueError: rank 1 " \
           "gave up (its traceback is in that cell)" in wait.text(), wait.text()
    until(lambda: bool(bg.errors()), what="the error in its cell")
    error = bg.errors()[0]
    assert error["ename"] == "RankRaisedError"
    traceback = "\n".join(error["traceback"])
    assert f"Cell In[{number}], line 4" in traceback and "raise ValueError('rank 1 gave up')" in traceback
    # A cell that needs input is refused in the background, clearly.
    asks = front.ok("%%rank [0] --bg\nanswer = input('your name? ')")
    front.fails("%dist_wait", "RankRaisedError")
    until(lambda: bool(asks.errors()), what="the error in its cell")
    assert "StdinUnavailableError: rank 0 read its stdin (input(), pdb) in background work" in \
        "\n".join(asks.errors()[0]["traceback"])
    assert front.ok("%%rank [0]\n'free'").text() == "[rank 0] 'free'\n"


def _wait_for_ready_after_restart(front, timeout: float = 60.0) -> None:
    """``kc.wait_for_ready`` that reads past a broken IOPub message: in CI once, a lone topic frame
    (``kernel.<id>.status``) reached the client while the old kernel shut down with output still
    relayed, and jupyter_client raised ValueError ('<IDS|MSG>' is not in list) instead of waiting
    for the new kernel. Read once, it is gone; the test is about what is left after the restart."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            front.kc.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
            return
        except ValueError:
            if time.monotonic() >= deadline:
                raise


def test_a_kernel_restarted_while_training_runs_leaves_no_process(front):
    train = front.ok(train_cell(100000))
    front.wait_for(train, r"\[rank 1\] step 0 loss")
    pids = front.value("[r.pid for r in __import__('mpify_nb.magics.session').magics.session.session().status()]")
    kernel_pid = front.value("__import__('os').getpid()")
    front.km.restart_kernel(now=False)
    _wait_for_ready_after_restart(front)
    until(lambda: not pids_alive(pids + [kernel_pid]), what="the old kernel and its ranks gone")
    front.ok("%load_ext mpify_nb")
    assert front.value("1 + 1") == 2
    front.ok("%dist_init -n 2")  # for the tests after this one


# -- ranch(..., wait=False): rank 0 is a thread of the kernel -------------------------------------

def test_ranch_in_the_background_in_a_kernel(tmp_path):
    f = Frontend(str(tmp_path))
    try:
        f.ok("import os, time, mpify_nb\n"
             "def train(n, fail=False):\n"
             "    import os, time\n"
             "    for i in range(n):\n"
             "        print('step', i, 'of rank', os.environ['RANK'], flush=True)\n"
             "        time.sleep(0.05)\n"
             "    if fail and os.environ['RANK'] == '1':\n"
             "        raise ValueError('rank 1 gave up')\n"
             "    return int(os.environ['RANK'])")
        start = f.ok("work = mpify_nb.ranch(2, train, 40, wait=False)\nwork")
        assert re.fullmatch(r"<BackgroundWork ranch\(train\) from In \[\d+\] on ranks \[0, 1\]: running for .*>\n",
                            start.text()), start.text()
        other = f.ok("time.sleep(1)\nprint('the notebook is free')")
        assert other.text() == "the notebook is free\n"
        result = f.ok("work.result()")
        assert result.text() == "[0, 1]\n"
        shown = start.text()
        assert "step 39 of rank 0" in shown and "[rank 1] step 39 of rank 1" in shown
        assert_only_in(f, [start], r"step \d+ of rank")

        failing = f.ok("failing = mpify_nb.ranch(2, train, 3, True, wait=False)")
        raised = f.fails("failing.result()", "RankRaisedError")
        assert "rank 1 raised ValueError: rank 1 gave up" in raised.text()
        until(lambda: bool(failing.errors()), what="the error in its cell")
        assert failing.errors()[0]["ename"] == "RankRaisedError"
        # The kernel shut down while background work runs: nothing is left (close() checks).
        f.ok("mpify_nb.ranch(2, train, 100000, wait=False);")
        f.wait_for(f.sent[list(f.sent)[-1]], r"\[rank 1\] step 1 of rank 1")
    finally:
        f.close()


# -- the frontend's debugger panel on background work ------------------------------------------------

def test_the_debugger_panel_stops_background_work_and_the_notebook_stays_usable(tmp_path):
    pytest.importorskip("debugpy")
    from helpers_debugger import DebugFrontend

    f = DebugFrontend(str(tmp_path))
    try:
        f.ok("%load_ext mpify_nb")
        f.ok("%dist_init -n 2")
        f.enable()
        cell = "%%distributed --bg\na = rank * 10\nb = a + 1\nc = b * 2\nc"
        f.breakpoints(cell, [3])
        started = f.ok(cell)  # returns at once: the ranks stop at line 3 behind it
        stops = {f.next_event("stopped")["body"]["threadId"] for _ in range(2)}
        assert len(stops) == 2
        thread = sorted(stops)[0]
        frames = f.dap("stackTrace", threadId=thread)["body"]["stackFrames"]
        assert [(frame["name"], frame["line"]) for frame in frames] == [("<module>", 3)]
        assert f.ok("%%local\n1 + 1").results == ["2"]  # the kernel answers while the ranks are held
        assert f.dap("continue", threadId=thread)["success"]
        deadline = time.monotonic() + 60
        while "[rank 1] 22" not in "".join(started.results):  # its values, in its own cell
            assert time.monotonic() < deadline, started
            time.sleep(0.05)
        assert started.results[-1] == "[rank 0] 2\n[rank 1] 22"
        assert f.ok("%dist_wait").stdout.startswith("The background work %%distributed started in In [")
        f.clear_breakpoints()
    finally:
        f.close()
