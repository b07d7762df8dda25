"""Debugging a rank from the notebook (issue 20), in a real kernel, with this test as the
frontend: it speaks the Jupyter protocol with jupyter_client, executes cells with or without
``allow_stdin``, and answers the kernel's ``input_request``s on the stdin channel as
JupyterLab does when a user types into the input box.

One kernel serves the persistent-rank tests (2 ranks, gloo); ``%%ranch`` runs in it too.
"""

from __future__ import annotations

import queue
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import pytest

pytest.importorskip("ipykernel")
jupyter_client = pytest.importorskip("jupyter_client")


import nbutil  # noqa: E402
from helpers_debugger import KernelFrontend, take_output  # noqa: E402

CELL_TIMEOUT = 120.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Cell:
    """What one executed cell did, as the frontend saw it."""

    number: int = 0  # execution_count: the prompt's number
    status: str = ""
    prompts: list[str] = field(default_factory=list)  # input_request prompts, in order
    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)  # execute_result / display_data text/plain
    ename: str = ""
    traceback: str = ""
    stdin_at: list[float] = field(default_factory=list)  # when each input_request arrived
    displays: dict[str, list[str]] = field(default_factory=dict)  # display_id -> its texts, shown and updated


# An answerer: the list of lines to type, in order, or a function of the prompt (None: interrupt).
Answers = Union[list, Callable[[str], Optional[str]]]


class Frontend(KernelFrontend):
    """A kernel (this interpreter, the private kernelspec of nbutil) and a client to it."""

    def run(self, code: str, answers: Answers = (), allow_stdin: bool = True,
            timeout: float = CELL_TIMEOUT) -> Cell:
        """Execute ``code``; answer each input request from ``answers`` (a None answer
        presses the stop button instead); return what came back."""
        pending = list(answers) if not callable(answers) else None
        msg_id = self.kc.execute(code, allow_stdin=allow_stdin)
        cell = Cell()
        deadline = time.monotonic() + timeout
        reply = None
        idle = False
        while (reply is None or not idle) and time.monotonic() < deadline:
            try:
                msg = self.kc.stdin_channel.get_msg(timeout=0.005)
            except queue.Empty:
                msg = None
            if msg is not None and msg["msg_type"] == "input_request":
                prompt = msg["content"]["prompt"]
                cell.prompts.append(prompt)
                cell.stdin_at.append(time.monotonic())
                if pending is not None:
                    answer = pending.pop(0) if pending else None
                else:
                    answer = answers(prompt)  # type: ignore[operator]
                if answer is None:
                    self.km.interrupt_kernel()
                else:
                    self.kc.input(answer)
            while True:
                try:
                    msg = self.kc.iopub_channel.get_msg(timeout=0.005)
                except queue.Empty:
                    break
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                idle = take_output(cell, msg["msg_type"], msg["content"]) or idle
                display_id = msg["content"].get("transient", {}).get("display_id")
                if msg["msg_type"] in ("display_data", "update_display_data") and display_id:
                    cell.displays.setdefault(display_id, []).append(msg["content"]["data"].get("text/plain", ""))
            if reply is None:
                try:
                    msg = self.kc.shell_channel.get_msg(timeout=0.005)
                except queue.Empty:
                    continue
                if msg["parent_header"].get("msg_id") == msg_id:
                    reply = msg
        assert reply is not None, f"the cell did not finish within {timeout} s: {cell}"
        cell.status = reply["content"]["status"]
        return cell

    def ok(self, code: str, answers: Answers = ()) -> Cell:
        cell = self.run(code, answers)
        assert cell.status == "ok", cell
        return cell



@pytest.fixture(scope="module")
def nb(tmp_path_factory):
    # A test that fails leaves the next a fresh kernel and ranks.
    yield from nbutil.shared_kernel(lambda: nbutil.ready(Frontend(str(tmp_path_factory.mktemp("debugging"))), "ok",
                                                         ["%load_ext mpify_nb", "%dist_init -n 2"]))


def pdb_prompts(n: int, rank: int = 1) -> list[str]:
    return [f"[rank {rank}] (Pdb) "] * n


# -- persistent cells ------------------------------------------------------------------------

def test_breakpoint_on_rank_1_steps_and_prints_what_the_user_asks(nb):
    cell = nb.run("bp_x = 41 + rank\nif rank == 1:\n    breakpoint()\n    bp_y = bp_x + 1\n"
                  "    bp_z = bp_y * 2\nbp_x", ["p bp_x", "n", "p bp_y", "c"])
    assert cell.status == "ok", cell
    assert cell.prompts == pdb_prompts(4)
    cell_file = r"/tmp/ipykernel_\d+/\d+\.py"  # where ipykernel keeps the cell's source
    assert re.fullmatch(  # the prompt is the input box's, not a line of the cell
        rf"\[rank 1\] > {cell_file}\(4\)<module>\(\)\n\[rank 1\] -> bp_y = bp_x \+ 1\n\[rank 1\] 42\n"
        rf"\[rank 1\] > {cell_file}\(5\)<module>\(\)\n\[rank 1\] -> bp_z = bp_y \* 2\n\[rank 1\] 43\n",
        cell.stdout), cell.stdout
    assert cell.results == ["[rank 0] 41\n[rank 1] 42"]


def test_a_prompt_shown_before_its_read_is_still_the_whole_prompt(nb):
    """A rank slow between writing its prompt and reading (its ask came after the relay had shown
    the open line: under load in CI, pdb's prompt was '[rank 1] ' and '(Pdb) ' a line of the
    cell): the prompt is still the whole open line, taken back from the line that showed it."""
    cell = nb.run("import time\nslow_name = ''\nif rank == 1:\n    print('name? ', end='', flush=True)\n"
                  "    time.sleep(1.0)\n    slow_name = input()\nslow_name", ["bob"])
    assert cell.status == "ok", cell
    assert cell.prompts == ["[rank 1] name? "]
    assert list(cell.displays.values()) == [["[rank 1] name? ", ""]]  # shown while it waited, then emptied
    assert cell.results[-1] == "[rank 0] ''\n[rank 1] 'bob'"
    assert "name? " not in cell.stdout


def test_input_on_every_rank_asks_each_in_turn(nb):
    names = {"[rank 0] name? ": "alice", "[rank 1] name? ": "bob"}
    cell = nb.run("in_name = input('name? ')\n(in_name, rank)", lambda prompt: names[prompt])
    assert cell.status == "ok", cell
    assert sorted(cell.prompts) == ["[rank 0] name? ", "[rank 1] name? "]
    assert cell.results == ["[rank 0] ('alice', 0)\n[rank 1] ('bob', 1)"]


def test_two_ranks_stopping_in_one_cell_get_their_prompts_in_turn(nb):
    typed = {0: ["p rank * 10", "c"], 1: ["p rank * 10", "c"]}

    def answer(prompt: str) -> str:
        return typed[int(prompt[6])].pop(0)

    cell = nb.run("two = rank\nbreakpoint()\ntwo + 1", answer)
    assert cell.status == "ok", cell
    assert sorted(cell.prompts) == sorted(pdb_prompts(2, 0) + pdb_prompts(2, 1))
    assert "[rank 0] 0\n" in cell.stdout and "[rank 1] 10\n" in cell.stdout
    assert cell.results == ["[rank 0] 1\n[rank 1] 2"]


def test_torch_distributed_breakpoint_while_rank_0_waits_in_its_barrier(nb):
    """torch's own breakpoint reopens /dev/stdin (fd 0 itself, not sys.stdin); rank 0 waits
    in a barrier meanwhile, which is no mistake: no CollectiveError."""
    cell = nb.run("tdb_v = rank * 100\ndist.breakpoint(rank=1)\ntdb_v + 1", ["up", "p tdb_v", "c"])
    assert cell.status == "ok", cell
    assert cell.prompts == pdb_prompts(3)
    assert "[rank 1] 100\n" in cell.stdout
    assert cell.results == ["[rank 0] 1\n[rank 1] 101"]


def test_post_mortem_on_the_rank_that_raised(nb):
    failed = nb.run("def pm_f(q):\n    pm_local = q * 3\n    return 1 / (rank - 1)\npm_f(rank + 5)")
    assert failed.ename == "RankRaisedError", failed
    cell = nb.run("%dist_debug", ["p pm_local, q, rank", "q"])
    assert cell.status == "ok", cell
    assert cell.prompts == pdb_prompts(2)
    assert "[rank 1] (18, 6, 1)\n" in cell.stdout
    # IPython's own %debug, right after a rank error, does the same.
    nb.run("pm_g = 1 / (rank - 1)")
    cell = nb.run("%debug", ["p rank", "q"])
    assert cell.status == "ok" and cell.prompts == pdb_prompts(2), cell
    assert "[rank 1] 1\n" in cell.stdout
    cell = nb.run("%dist_debug --rank 0", ["q"])
    assert cell.status == "error" and cell.prompts == [], cell
    assert cell.stderr == "UsageError: %dist_debug: no cell has failed on rank 0 (since it started): there is " \
                          "nothing to debug\n"


def test_the_stop_button_at_a_prompt_ends_the_cell_and_keeps_state(nb):
    nb.ok("stop_keep = rank + 1")
    cell = nb.run("if rank == 1:\n    breakpoint()\n    stop_keep = -1\nstop_keep", [None])
    assert cell.ename == "KeyboardInterrupt", cell
    assert cell.prompts == pdb_prompts(1)
    assert nb.ok("stop_keep").results == ["[rank 0] 1\n[rank 1] 2"]
    assert "running" not in nb.ok("%dist_status").results[0]


def test_the_stop_button_at_a_pdb_prompt_keeps_rank_1_every_time(nb):
    """Issue 35: once in 7 runs under load, rank 1 was lost ("ended without returning a result").
    benchmarks/bench_pdb_interrupt.py repeats it 50 times beside 6 busy loops."""
    nb.ok("%%rank [1]\nkept = 7")
    for _ in range(10):
        cell = nb.run("%%rank [1]\nbreakpoint()\nkept = -1\nkept", [None])
        assert cell.ename == "KeyboardInterrupt" and cell.prompts == pdb_prompts(1), cell
        assert nb.ok("%%rank [1]\nkept").results == ["[rank 1] 7"]


def test_an_interrupt_never_cuts_a_frame_the_rank_sends_in_half(nb):
    """The race above, made certain: pdb's next prompt (an ASK) goes out as the stop button's
    interrupt lands; here each frame rank 1 sends pauses 0.2 s between its header and its body.
    An interrupt there left the caller a corrupt channel, and rank 1 was lost with its state
    (4 runs of 5 before the fix)."""
    nb.ok("%%rank [1]\nimport time as _time, mpify_nb.wire.framing as _framing\n_whole = _framing._send_with_fds\n"
          "def _slowly(sock, data, fds):\n    _whole(sock, data, fds)\n    _time.sleep(0.2)\n"
          "_framing._send_with_fds = _slowly\nkept = 7")
    try:
        for _ in range(3):
            cell = nb.run("%%rank [1]\nbreakpoint()\nkept = -1\nkept", [None])
            assert cell.ename == "KeyboardInterrupt", cell
            assert nb.ok("%%rank [1]\nkept").results == ["[rank 1] 7"]
    finally:
        nb.ok("%%rank [1]\n_framing._send_with_fds = _whole")


def test_a_frontend_without_stdin_gets_a_clear_error_at_the_read(nb):
    cell = nb.run("if rank == 1:\n    input('never? ')\n1", allow_stdin=False)
    assert cell.ename == "RankRaisedError", cell
    assert "rank 1 raised mpify_nb.wire.errors.StdinUnavailableError: rank 1 asked for input, but this frontend " \
           "cannot answer" in cell.traceback
    assert cell.prompts == []
    assert nb.ok("1").results == ["[rank 0] 1\n[rank 1] 1"]


def test_a_prompt_does_not_count_against_the_timeout(nb):
    """timeout=1, and the user takes 2.5 s to answer: the call is not timed out."""
    def slow(prompt: str) -> str:
        time.sleep(2.5)
        return "c"

    cell = nb.run("%%local\nfrom mpify_nb.magics.session import session\n"
                  "session().run('to_v = 5\\nbreakpoint()\\nto_v', ranks=[1], timeout=1)", slow)
    assert cell.status == "ok", cell
    assert cell.prompts == pdb_prompts(1) and cell.results == ["{1: 5}"]


# -- %%ranch and ranch() -------------------------------------------------------------------

def test_ranch_rank_1_breakpoint(nb):
    nb.ok("%dist_mode off")
    try:
        cell = nb.run("%%ranch 2\nimport os\nrv = int(os.environ['RANK']) * 7\n"
                      "if int(os.environ['RANK']) == 1:\n    breakpoint()\nrv", ["p rv", "c"])
        assert cell.status == "ok", cell
        assert cell.prompts == pdb_prompts(2)
        assert "[rank 1] 7\n" in cell.stdout
        cell = nb.run("from mpify_nb import ranch\n"
                      "def rf():\n    import os\n    v = os.environ['RANK']\n    return input('v? ') + v\n"
                      "ranch(2, rf, caller_rank=None)", {"[rank 0] v? ": "a", "[rank 1] v? ": "b"}.get)
        assert cell.status == "ok", cell
        assert cell.results == ["['a0', 'b1']"]
    finally:
        nb.ok("%dist_mode on")
