"""What a frontend shows of a persistent cell: labelled lines (figures in rank order, partial
lines growing on their rank's own line), one tab per rank (``%dist_view tabs``), and the
``%%ranch`` caller's text bar that left a frozen copy (issue 21).

A real kernel (ipykernel), 3 ranks on CPU with gloo, driven by jupyter_client: every iopub
message of a cell is kept, and :class:`Screen` renders them as a frontend does (a stream's
``\\r`` redraws its line, ``update_display_data`` replaces every output with its display_id,
widget models take their ``comm_open`` state and then each ``update``).
"""

from __future__ import annotations

import queue
import re
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ipykernel")
pytest.importorskip("ipywidgets")

import nbutil  # noqa: E402
from mpify_nb.magics.views import tabs_unavailable  # noqa: E402
from test_debugging import ANSI, Frontend  # noqa: E402

CELL_TIMEOUT = 120


class Screen:
    """One cell's iopub messages, in order, and what a frontend renders from them."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, dict]] = []
        self.status = ""
        self.ename = ""

    def outputs(self) -> list[dict]:
        """The cell's output area: streams merged and redrawn at ``\\r``, displays updated in place."""
        outputs: list[dict] = []
        for kind, content in self.messages:
            if kind == "stream":
                if outputs and outputs[-1]["output_type"] == "stream" and outputs[-1]["name"] == content["name"]:
                    outputs[-1]["text"] += content["text"]
                else:
                    outputs.append({"output_type": "stream", "name": content["name"], "text": content["text"]})
            elif kind in ("display_data", "execute_result"):
                outputs.append({"output_type": kind, "data": dict(content["data"]),
                                "id": content.get("transient", {}).get("display_id")})
            elif kind == "update_display_data":
                for o in outputs:
                    if o.get("id") is not None and o["id"] == content["transient"]["display_id"]:
                        o["data"] = dict(content["data"])
            elif kind == "error":
                outputs.append({"output_type": "error", "ename": content["ename"],
                                "traceback": ANSI.sub("", "\n".join(content["traceback"]))})
        for o in outputs:
            if o["output_type"] == "stream":
                o["text"] = "\n".join(line.split("\r")[-1] for line in o["text"].split("\n"))
        return outputs

    def stdout(self) -> str:
        return "".join(c["text"] for k, c in self.messages if k == "stream" and c["name"] == "stdout")

    def texts(self) -> list[str]:
        """Each output as the text it shows (a display's text/plain), in order; empty ones left out."""
        shown = [o["text"] if o["output_type"] == "stream" else o.get("data", {}).get("text/plain", "")
                 for o in self.outputs() if o["output_type"] != "error"]
        return [t for t in shown if t]

    def models(self) -> dict[str, dict]:
        """Widget models: comm id -> state, after every update."""
        models: dict[str, dict] = {}
        for kind, content in self.messages:
            if kind == "comm_open":
                models[content["comm_id"]] = dict(content["data"].get("state", {}))
            elif kind == "comm_msg" and content["data"].get("method") == "update":
                models.setdefault(content["comm_id"], {}).update(content["data"]["state"])
        return models


class Client(Frontend):
    def cell(self, code: str, timeout: float = CELL_TIMEOUT) -> Screen:
        msg_id = self.kc.execute(code)
        screen = Screen()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.iopub_channel.get_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            screen.messages.append((kind, content))
        else:
            raise AssertionError(f"the cell did not finish within {timeout} s")
        reply = self.kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=30)
        screen.status = reply["content"]["status"]
        screen.ename = reply["content"].get("ename", "")
        return screen

    def good(self, code: str) -> Screen:
        screen = self.cell(code)
        assert screen.status == "ok", screen.messages
        return screen


@pytest.fixture(scope="module")
def nb(tmp_path_factory):
    # A test that fails leaves the next a fresh kernel and ranks.
    yield from nbutil.shared_kernel(lambda: nbutil.ready(Client(str(tmp_path_factory.mktemp("views"))), "good",
                                                         ["%load_ext mpify_nb", "%dist_init -n 3"]))


# -- lines view ----------------------------------------------------------------------------------

WARM = "import io, time\nimport matplotlib.pyplot as plt\nplt.plot([0, 1])\nplt.savefig(io.BytesIO())\nplt.close('all')"

FIGURES = """\
from IPython.display import HTML, display
time.sleep(0.8 * (2 - rank))  # rank 2 shows first, rank 0 last
plt.figure(figsize=(2 + rank, 2))
plt.plot([0, rank])
plt.show()
display(HTML(f"<b>html of {rank}</b>"))
"""


def test_figures_and_displays_come_in_rank_order_under_their_labels(nb):
    nb.good(WARM)  # the first figure a rank draws takes long (fonts): not in the cell measured
    screen = nb.good(FIGURES)
    shown = [(o["data"].get("text/plain"), o["data"].get("text/html"), "image/png" in o["data"])
             for o in screen.outputs() if o["output_type"] == "display_data"]
    assert shown == [
        ("[rank 0]", None, False), ("<Figure size 200x200 with 1 Axes>", None, True),
        ("[rank 1]", None, False), ("<Figure size 300x200 with 1 Axes>", None, True),
        ("[rank 2]", None, False), ("<Figure size 400x200 with 1 Axes>", None, True),
        ("[rank 0] <IPython.core.display.HTML object>", "<div><code>[rank 0]</code></div><b>html of 0</b>", False),
        ("[rank 1] <IPython.core.display.HTML object>", "<div><code>[rank 1]</code></div><b>html of 1</b>", False),
        ("[rank 2] <IPython.core.display.HTML object>", "<div><code>[rank 2]</code></div><b>html of 2</b>", False),
    ], screen.messages
    # They arrived the other way round: rank 2's figure filled its place first.
    filled = [c["data"]["text/plain"] for k, c in screen.messages
              if k == "update_display_data" and re.fullmatch(r"\[rank \d\]", c["data"]["text/plain"])]
    assert filled == ["[rank 2]", "[rank 1]", "[rank 0]"], filled


def test_values_come_in_rank_order(nb):
    screen = nb.good("import time\ntime.sleep(0.2 * (2 - rank))\nprint('v', rank)\nrank * 10")
    assert screen.texts()[-1] == "[rank 0] 0\n[rank 1] 10\n[rank 2] 20"
    assert sorted(screen.texts()[:-1]) == ["[rank 0] v 0\n", "[rank 1] v 1\n", "[rank 2] v 2\n"] or \
        sorted("".join(screen.texts()[:-1]).splitlines()) == ["[rank 0] v 0", "[rank 1] v 1", "[rank 2] v 2"]


PARTIAL = """\
%%rank [0,1]
import sys, time
for part in ("a", "b", "c"):
    print(f"{part}{rank}", end="", flush=True)
    time.sleep(0.4)
print(" end")
print("next", rank)
"""


def test_two_ranks_partial_lines_each_grow_on_their_own_line(nb):
    screen = nb.good(PARTIAL)
    texts = screen.texts()
    assert "[rank 0] a0b0c0 end" in texts and "[rank 1] a1b1c1 end" in texts, texts
    assert sorted("".join(t for t in texts if "next" in t).splitlines()) == ["[rank 0] next 0", "[rank 1] next 1"]
    # Live: each line grew in place, one piece at a time (never one labelled line per flush).
    for r in (0, 1):
        states = [c["data"].get("text/plain", "") for k, c in screen.messages
                  if k in ("display_data", "update_display_data")]
        states = [t for t in states if t.startswith(f"[rank {r}] a")]
        assert states == [f"[rank {r}] a{r}", f"[rank {r}] a{r}b{r}", f"[rank {r}] a{r}b{r}c{r}",
                          f"[rank {r}] a{r}b{r}c{r} end"], states
    assert not any(o["output_type"] == "stream" and "a0" in o["text"] for o in screen.outputs()), texts


# -- a cell that leaves a line unfinished -----------------------------------------------------------

BAR_LEFT_OPEN = """\
%%rank [1]
import time
for i in range(3):
    print(f"\\rstep {i}", end="", flush=True)  # a console bar's redraws, never ended
    time.sleep(0.3)
"""
NEXT_CELL = '%%rank [1]\nprint("next cell")'


def _shown_per_cell(screens: list[Screen]) -> list[list[str]]:
    """What a frontend shows in each cell: an update_display_data of any cell changes the output
    with that display_id wherever it is (in an earlier cell too)."""
    cells = [[dict(o) for o in screen.outputs()] for screen in screens]
    for screen in screens:
        for kind, content in screen.messages:
            if kind == "update_display_data":
                for outputs in cells:
                    for o in outputs:
                        if o.get("id") == content["transient"]["display_id"]:
                            o["data"] = dict(content["data"])
    return [[o["text"] if o["output_type"] == "stream" else o["data"].get("text/plain", "") for o in outputs
             if o["output_type"] != "error"] for outputs in cells]


@pytest.mark.parametrize("view", ["lines", "tabs"])
def test_each_cells_output_lands_in_that_cell_after_a_bar_left_unfinished(nb, view):
    # Before (lines): the next cell's line went into the previous cell's bar display (an
    # update_display_data of its display_id), and the new cell showed nothing of rank 1.
    nb.good(f"%dist_view {view}")
    try:
        first, second = nb.good(BAR_LEFT_OPEN), nb.good(NEXT_CELL)
    finally:
        nb.good("%dist_view lines")
    if view == "lines":
        assert _shown_per_cell([first, second]) == [["[rank 1] step 2"], ["[rank 1] next cell\n"]]
        made_first = {c["transient"]["display_id"] for k, c in first.messages if k == "display_data"}
        assert [c["data"]["text/plain"] for k, c in first.messages if k in ("display_data", "update_display_data")] \
            == ["[rank 1] step 0", "[rank 1] step 1", "[rank 1] step 2"]
        assert [m for m in second.messages if m[0] not in ("status", "execute_input")] == [
            ("stream", {"name": "stdout", "text": "[rank 1] next cell\n"})]
        assert not made_first & {c.get("transient", {}).get("display_id") for k, c in second.messages}
    else:
        assert _tab(first, [1]) == [[{"output_type": "stream", "name": "stdout", "text": "step 2"}]]
        assert _tab(second, [1]) == [[{"output_type": "stream", "name": "stdout", "text": "next cell\n"}]]
        opened_second = {c["comm_id"] for k, c in second.messages if k == "comm_open"}
        assert {c["comm_id"] for k, c in second.messages if k == "comm_msg"} <= opened_second
        assert not [m for m in second.messages if m[0] == "stream"]


# -- %%ranch: the caller's text bar ---------------------------------------------------------------

RANCH_BAR = """\
%%ranch 2
import os, time
from tqdm import tqdm
if os.environ["RANK"] == "1":
    time.sleep(0.5)  # rank 0's bar is drawn before rank 1's appears
for i in tqdm(range(40), desc="text bar"):
    time.sleep(0.03)
"""


def test_ranch_caller_text_bar_leaves_no_frozen_copy(nb):
    # Before: rank 0's redraws went to the cell's stderr stream; rank 1's bar (a display)
    # came between two of them, and a stream's \r cannot reach back over it: the frozen
    # "text bar:   0%|          | 0/40" stayed above rank 1's bar, the live one below.
    screen = nb.good(RANCH_BAR)
    bars = [t for t in screen.texts() if "text bar" in t]
    assert len(bars) == 2, screen.texts()
    assert re.fullmatch(r"text bar: 100%\|█+\| 40/40 \[[^\]]+\]", bars[0]), bars
    assert re.fullmatch(r"\[rank 1\] text bar: 100%\|█+\| 40/40 \[[^\]]+\]", bars[1]), bars


# -- tabs view ------------------------------------------------------------------------------------

TAB_CELL = """\
import time
import matplotlib.pyplot as plt
print("out", rank)
print("part", end="", flush=True)
time.sleep(0.3)  # shown before its end
print("ial")
print("\\r10%", end="", flush=True)
time.sleep(0.3)
print("\\r100%")  # a redraw: the tab shows its last state
plt.figure(figsize=(2 + rank, 2))
plt.plot([0, 1])
plt.show()
rank * 10
"""


def _tab(screen: Screen, ranks: list[int]) -> list[list[dict]]:
    """The cell's one Tab: its titles checked, each rank's Output's outputs."""
    models = screen.models()
    tabs = [(i, m) for i, m in models.items() if m.get("_model_name") == "TabModel"]
    assert len(tabs) == 1, models
    tab_id, tab = tabs[0]
    assert tab["titles"] == [f"rank {r}" for r in ranks], tab
    views = [o for o in screen.outputs() if o["output_type"] == "display_data"]
    assert [v["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for v in views] == [tab_id]
    children = [c.removeprefix("IPY_MODEL_") for c in tab["children"]]
    assert all(models[c]["_model_name"] == "OutputModel" for c in children)
    return [list(models[c]["outputs"]) for c in children]


def test_tabs_view_one_tab_per_rank_with_streams_figures_values_and_errors(nb):
    assert "View: tabs" in nb.good("%dist_view tabs").stdout()
    try:
        screen = nb.good(TAB_CELL)
        per_rank = _tab(screen, [0, 1, 2])
        for r, outputs in enumerate(per_rank):
            assert [o["output_type"] for o in outputs] == ["stream", "display_data", "execute_result"], outputs
            assert outputs[0]["name"] == "stdout" and outputs[0]["text"] == f"out {r}\npartial\n100%\n"
            assert outputs[1]["data"]["text/plain"] == f"<Figure size {200 + 100 * r}x200 with 1 Axes>"
            assert outputs[1]["data"]["image/png"].startswith("iVBORw0KGgo")  # a PNG, base64
            assert outputs[2]["data"] == {"text/plain": str(10 * r)}
        assert [o for o in screen.outputs() if o["output_type"] == "stream"] == []  # nothing outside the tabs

        failed = nb.cell("print('before', rank)\nif rank == 1:\n    raise ValueError('boom on 1')\n")
        assert failed.status == "error" and failed.ename == "RankRaisedError"
        errors = [o for o in failed.outputs() if o["output_type"] == "error"]
        assert len(errors) == 1 and "rank 1 raised ValueError: boom on 1" in errors[0]["traceback"]
        per_rank = _tab(failed, [0, 1, 2])
        assert per_rank[0] == [{"output_type": "stream", "name": "stdout", "text": "before 0\n"}]
        assert per_rank[2] == [{"output_type": "stream", "name": "stdout", "text": "before 2\n"}]
        assert [o["output_type"] for o in per_rank[1]] == ["stream", "error"], per_rank[1]
        assert per_rank[1][1]["ename"] == "ValueError" and per_rank[1][1]["evalue"] == "boom on 1"
        assert "rank 1 raised ValueError: boom on 1" in "\n".join(per_rank[1][1]["traceback"])

        ranked = nb.good("%%rank [2]\nprint('only', rank)")
        assert _tab(ranked, [2]) == [[{"output_type": "stream", "name": "stdout", "text": "only 2\n"}]]
        assert nb.good("%dist_view").stdout() == "View: tabs (one tab per rank)\n"
    finally:
        back = nb.good("%dist_view lines")
    assert back.stdout() == "View: lines (each line labelled [rank k])\n"
    lines = nb.good("print('lines again', rank)")
    assert lines.models() == {}
    assert sorted("".join(lines.texts()).splitlines()) == [f"[rank {r}] lines again {r}" for r in range(3)]


def test_dist_view_rejects_a_bad_argument(nb):
    screen = nb.cell("%dist_view grid")
    assert screen.status == "error" and screen.ename == "UsageError"
    error = "".join(c["text"] for k, c in screen.messages if k == "stream" and c["name"] == "stderr")
    assert error == ("UsageError: %dist_view: expected one of lines, tabs, not 'grid'\n"
                     "usage: %dist_view [lines|tabs]\n(see %dist_view? for help)\n"), error


def test_tabs_without_ipywidgets_fall_back_to_lines_with_a_note(nb):
    nb.good("%%local\nimport sys\n_ipywidgets = sys.modules.get('ipywidgets')\nsys.modules['ipywidgets'] = None")
    try:
        assert nb.good("%dist_view tabs").stdout() == "View: tabs, shown as lines here (ipywidgets is not installed)\n"
        lines = nb.good("print('no widgets', rank)")
        assert lines.models() == {}
        assert sorted("".join(lines.texts()).splitlines()) == [f"[rank {r}] no widgets {r}" for r in range(3)]
    finally:
        nb.good("%%local\nif _ipywidgets is None:\n    del sys.modules['ipywidgets']\n"
                "else:\n    sys.modules['ipywidgets'] = _ipywidgets")
        nb.good("%dist_view lines")


def test_tabs_need_a_jupyter_kernel():
    assert tabs_unavailable(SimpleNamespace()) == "this frontend has no Jupyter kernel with comms"
    assert tabs_unavailable(SimpleNamespace(kernel=object())) is None


def test_dist_init_view_tabs(nb):
    nb.good("%dist_shutdown")
    init = nb.good("%dist_init -n 2 --view tabs")
    assert "View: tabs (one tab per rank, from the next cell)\n" in init.stdout()
    per_rank = _tab(nb.good("print('hi', rank)"), [0, 1])
    assert per_rank == [[{"output_type": "stream", "name": "stdout", "text": f"hi {r}\n"}] for r in (0, 1)]
    nb.good("%dist_reset")
    assert nb.good("%dist_view").stdout().startswith("View: lines")
