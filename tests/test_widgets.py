"""Widgets on persistent ranks (issue 21), in a real kernel, with this test as the frontend:
it reads every iopub message (comm_open, comm_msg, comm_close of any parent) and sends the
widget protocol's messages on the shell channel as JupyterLab does (``comm_msg`` with an
``update`` or a ``custom`` method, to a model's comm id).

One kernel, 2 ranks (gloo); the tests run in order and share it: the last ones restart a
rank and shut the ranks down.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("ipykernel")
pytest.importorskip("jupyter_client")

import nbutil  # noqa: E402
from test_debugging import ANSI, CELL_TIMEOUT, Frontend  # noqa: E402


@dataclass
class Seen:
    """What the frontend got for one request (a cell, or a comm_msg it sent)."""

    msg_id: str
    messages: list[dict] = field(default_factory=list)  # every iopub message with this parent
    status: str = ""

    @property
    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.messages
                       if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")

    @property
    def results(self) -> list[str]:
        return [ANSI.sub("", m["content"]["data"].get("text/plain", "")) for m in self.messages
                if m["msg_type"] in ("execute_result", "display_data")]


class WidgetFrontend(Frontend):
    """A frontend that renders widgets: it keeps every comm the kernel opened, by id."""

    def __init__(self, cwd: str):
        super().__init__(cwd)
        self.models: dict[str, dict] = {}  # comm id -> its comm_open's data (state kept up to date)
        self.opened: list[str] = []  # comm ids, in the order of their comm_open
        self.closed: list[str] = []  # comm ids, in the order of their comm_close
        self.arrivals: list[tuple[float, dict]] = []  # (when, message) of every iopub message

    def _pump(self, until_idle_of: str, timeout: float) -> Seen:
        """Read iopub (every parent) until ``until_idle_of``'s status goes idle."""
        seen = Seen(until_idle_of)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.iopub_channel.get_msg(timeout=0.05)
            except queue.Empty:
                continue
            self.arrivals.append((time.monotonic(), msg))
            kind, content = msg["msg_type"], msg["content"]
            if kind == "comm_open":
                self.models[content["comm_id"]] = dict(content["data"], target_name=content["target_name"])
                self.opened.append(content["comm_id"])
            elif kind == "comm_msg" and content["comm_id"] in self.models:
                state = content["data"].get("state")
                if content["data"].get("method") in ("update", "echo_update") and state:
                    self.models[content["comm_id"]]["state"].update(state)
            elif kind == "comm_close":
                self.closed.append(content["comm_id"])
            if msg["parent_header"].get("msg_id") != until_idle_of:
                continue
            seen.messages.append(msg)
            if kind == "status" and content["execution_state"] == "idle":
                return seen
        raise AssertionError(f"no idle status for {until_idle_of} within {timeout} s: {seen.messages}")

    def cell(self, code: str, ok: bool = True) -> Seen:
        msg_id = self.kc.execute(code)
        seen = self._pump(msg_id, CELL_TIMEOUT)
        reply = self.kc.get_shell_msg(timeout=CELL_TIMEOUT)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=CELL_TIMEOUT)
        seen.status = reply["content"]["status"]
        if ok:
            assert seen.status == "ok", (reply["content"], seen.messages)
        return seen

    def comm_msg(self, comm_id: str, data: dict) -> Seen:
        """Send ``data`` to the model ``comm_id`` as a frontend does; wait until it is handled."""
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.kc.shell_channel.send(msg)
        return self._pump(msg["header"]["msg_id"], CELL_TIMEOUT)

    def update(self, comm_id: str, **state: Any) -> Seen:
        return self.comm_msg(comm_id, {"method": "update", "state": state, "buffer_paths": []})

    def views(self, seen: Seen) -> list[tuple[Optional[int], str]]:
        """(rank of the label before it, model id) of each widget view the request displayed."""
        found, rank = [], None
        for m in seen.messages:
            # lines view puts a cell's rich outputs in rank order: into places it updates
            if m["msg_type"] not in ("display_data", "update_display_data"):
                continue
            data = m["content"]["data"]
            view = data.get("application/vnd.jupyter.widget-view+json")
            if view is not None and data.get("text/plain", "").startswith("[rank "):  # labelled in place (HTML)
                found.append((int(data["text/plain"][6:].split("]")[0]), view["model_id"]))
            elif view is not None:
                found.append((rank, view["model_id"]))
            elif data.get("text/plain", "").startswith("[rank "):
                rank = int(data["text/plain"][6:].split("]")[0])
        return found

    def of_model(self, name: str, ids: Optional[list[str]] = None) -> list[str]:
        """Comm ids of the models named ``name`` (IntSliderModel...), in the order they opened."""
        return [i for i in (self.opened if ids is None else ids) if self.models[i]["state"].get("_model_name") == name]

    def open_ids(self) -> list[str]:
        return [i for i in self.opened if i not in self.closed]


@pytest.fixture(scope="module")
def fe(tmp_path_factory):
    # A test that fails leaves the next a fresh kernel and ranks.
    yield from nbutil.shared_kernel(lambda: nbutil.ready(WidgetFrontend(str(tmp_path_factory.mktemp("widgets"))),
                                                         "cell", ["%load_ext mpify_nb", "%dist_init -n 2"]))


def child_ids(fe: WidgetFrontend, comm_id: str) -> list[str]:
    return [c.removeprefix("IPY_MODEL_") for c in fe.models[comm_id]["state"]["children"]]


# -- the tests, in order ---------------------------------------------------------------------

def test_a_slider_per_rank_reaches_the_frontend(fe):
    seen = fe.cell("import ipywidgets as widgets\n"
                   "s = widgets.IntSlider(value=rank, min=0, max=10, description=f'rank {rank}')\n"
                   "display(s)")
    sliders = fe.of_model("IntSliderModel", [i for i in fe.opened if i in {
        m["content"]["comm_id"] for m in seen.messages if m["msg_type"] == "comm_open"}])
    assert len(sliders) == 2
    for comm_id in sliders:
        assert fe.models[comm_id]["target_name"] == "jupyter.widget"
    views = fe.views(seen)
    assert sorted(rank for rank, _ in views) == [0, 1]
    assert sorted(model for _, model in views) == sorted(sliders)  # each view names its rank's model
    for rank, model in views:
        state = fe.models[model]["state"]
        assert (state["value"], state["description"]) == (rank, f"rank {rank}")
    fe.slider = dict(views)  # rank -> its slider's comm id, for the next tests


def test_moving_rank_1s_slider_changes_it_on_rank_1_only(fe):
    seen = fe.update(fe.slider[1], value=7)
    echoes = [m["content"]["data"] for m in seen.messages if m["msg_type"] == "comm_msg"]
    assert echoes == [{"method": "echo_update", "state": {"value": 7}, "buffer_paths": []}]
    assert fe.cell("s.value").results == ["[rank 0] 0\n[rank 1] 7"]
    fe.cell("s.value = s.value + 1")  # and the rank's changes reach the frontend
    assert [fe.models[fe.slider[r]]["state"]["value"] for r in (0, 1)] == [1, 8]


def test_custom_messages_and_button_clicks_reach_their_rank(fe):
    seen = fe.cell("got = []\n"
                   "b = widgets.Button(description=f'b{rank}')\n"
                   "b.on_click(lambda _b: got.append(('click', rank)))\n"
                   "b.on_msg(lambda _w, content, buffers: got.append(('custom', content, rank)))\n"
                   "display(b)")
    button = dict(fe.views(seen))
    fe.comm_msg(button[0], {"method": "custom", "content": {"hello": 5}})
    fe.comm_msg(button[1], {"method": "custom", "content": {"event": "click"}})
    assert fe.cell("got").results == [
        "[rank 0] [('custom', {'hello': 5}, 0)]\n[rank 1] [('click', 1), ('custom', {'event': 'click'}, 1)]"]


def test_the_stop_button_stops_a_long_handler_and_the_rank_lives_on(fe):
    seen = fe.cell("slow, slow_steps = widgets.Button(), []\n"
                   "def slow_click(_b):\n"
                   "    slow_steps.append('in')\n"
                   "    print('in', flush=True)\n"
                   "    time.sleep(30)\n"
                   "    slow_steps.append('out')\n"
                   "slow.on_click(slow_click)\n"
                   "import time\n"
                   "display(slow)")
    button = dict(fe.views(seen))
    msg = fe.kc.session.msg("comm_msg", {"comm_id": button[1], "data": {"method": "custom",
                                                                          "content": {"event": "click"}}})
    fe.kc.shell_channel.send(msg)
    while True:  # the handler runs on rank 1
        got = fe.kc.iopub_channel.get_msg(timeout=CELL_TIMEOUT)
        if got["msg_type"] == "stream" and got["content"]["text"] == "[rank 1] in\n":
            break
    pressed = time.monotonic()
    fe.km.interrupt_kernel()
    stopped = fe._pump(msg["header"]["msg_id"], CELL_TIMEOUT)
    assert time.monotonic() - pressed < 5
    assert "[mpify_nb] interrupted: rank 1's widget handler stopped" in "".join(
        m["content"]["text"] for m in stopped.messages if m["msg_type"] == "stream")
    assert fe.cell("slow_steps").results == ["[rank 0] []\n[rank 1] ['in']"]


def test_interact_output_goes_to_its_output_widget(fe):
    seen = fe.cell("@widgets.interact(x=(0, 10))\n"
                   "def shown(x=5):\n"
                   "    print(f'x={x} on {rank}')")
    box = dict(fe.views(seen))
    slider_id, output_id = child_ids(fe, box[1])
    assert fe.models[output_id]["state"]["_model_name"] == "OutputModel"
    # The first run, in the cell: rank 1's print inside its Output, under the cell's id.
    assert "[rank 1] x=5 on 1\n" in seen.stdout
    moved = fe.update(slider_id, value=3)

    def what(m: dict):
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == output_id:
            return ("capture", m["content"]["data"]["state"]["msg_id"])
        if m["msg_type"] == "clear_output":
            return ("clear", m["content"]["wait"])
        if m["msg_type"] == "stream":
            return ("stream", m["content"]["text"])
        return None

    steps = [w for w in map(what, moved.messages) if w is not None]
    assert steps == [("capture", moved.msg_id), ("clear", True), ("stream", "[rank 1] x=3 on 1\n"),
                     ("capture", "")]


def test_tqdm_auto_gives_a_widget_bar_per_rank_live(fe):
    start = len(fe.opened)
    seen = fe.cell("from tqdm.auto import tqdm\nimport time\n"
                   "for i in tqdm(range(10), desc=f'bar{rank}'):\n"
                   "    time.sleep(0.06)")
    new = fe.opened[start:]
    bars = fe.of_model("FloatProgressModel", new)
    assert len(fe.of_model("HBoxModel", new)) == 2 and len(bars) == 2
    assert sorted(child_ids(fe, b)[1] for b in fe.of_model("HBoxModel", new)) == sorted(bars)
    assert [fe.models[b]["state"]["value"] for b in bars] == [10, 10]
    idle = next(t for t, m in fe.arrivals if m["parent_header"].get("msg_id") == seen.msg_id
                and m["msg_type"] == "status" and m["content"]["execution_state"] == "idle")
    for bar in bars:  # a value from the middle of the loop, while the cell still ran
        mid = [t for t, m in fe.arrivals if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == bar
               and 0 < m["content"]["data"].get("state", {}).get("value", 0) < 10]
        assert mid and idle - mid[0] > 0.15, (mid, idle)
    texts = {fe.models[child_ids(fe, hbox)[0]]["state"]["value"] for hbox in fe.of_model("HBoxModel", new)}
    assert texts == {"bar0:\u2007100%", "bar1:\u2007100%"}  # tqdm's figure space


def test_the_kernels_own_widget_still_works(fe):
    start = len(fe.opened)
    seen = fe.cell("%%local\nimport ipywidgets\nkernel_slider = ipywidgets.IntSlider(value=3)\n"
                   "display(kernel_slider)")
    (view,) = fe.views(seen)
    fe.update(view[1], value=9)
    assert fe.cell("%%local\nprint(kernel_slider.value)").stdout == "9\n"
    assert fe.cell("s.value").results == ["[rank 0] 1\n[rank 1] 8"]
    fe.kernel_ids = fe.opened[start:]  # its slider, layout and style


def test_an_ipympl_figure_per_rank_draws_for_the_frontend(fe):
    pytest.importorskip("ipympl")
    seen = fe.cell("import matplotlib\nmatplotlib.use('module://ipympl.backend_nbagg')\n"
                   "import matplotlib.pyplot as plt\nfig = plt.figure()\nplt.plot([1, rank + 2])\n"
                   "display(fig.canvas)")
    canvas = dict(fe.views(seen))
    assert sorted(canvas) == [0, 1]
    assert {fe.models[c]["state"]["_model_name"] for c in canvas.values()} == {"MPLCanvasModel"}
    fe.comm_msg(canvas[1], {"method": "custom", "content": {"type": "refresh"}})  # it asks for a "draw"
    drawn = fe.comm_msg(canvas[1], {"method": "custom", "content": {"type": "draw"}})
    images = [bytes(b) for m in drawn.messages if m["msg_type"] == "comm_msg" for b in m["buffers"]]
    assert {m["content"]["comm_id"] for m in drawn.messages if m["msg_type"] == "comm_msg"} == {canvas[1]}
    urls = [m["content"]["data"]["state"]["_data_url"] for m in drawn.messages if m["msg_type"] == "comm_msg"
            and "_data_url" in m["content"]["data"].get("state", {})]
    assert len(urls) == 1 and urls[0].startswith("iVBORw0KGgo")  # base64 of a PNG's signature
    assert len(images) == 1 and len(images[0]) > 0  # the image's pixels, as a binary buffer
    fe.cell("plt.close('all')")


def rank_ids(fe: WidgetFrontend, rank: int) -> list[str]:
    """The comm ids of ``rank``'s models that the kernel holds open now."""
    return eval(fe.cell(f"%%local\nfrom mpify_nb.magics.session import session\n"
                        f"print(session()._comms.open_ids({rank}))").stdout)


def test_a_restart_or_a_death_closes_the_ranks_models_and_shutdown_closes_the_rest(fe):
    rank_1 = rank_ids(fe, 1)
    assert fe.slider[1] in rank_1 and fe.slider[0] not in rank_1
    closed = len(fe.closed)
    fe.cell("%dist_restart 1")
    assert sorted(fe.closed[closed:]) == sorted(rank_1)
    fe.cell("import ipywidgets as widgets\ns = widgets.IntSlider(value=rank)\ndisplay(s)")  # the new rank 1 too
    rank_1 = rank_ids(fe, 1)
    assert len(rank_1) == 3  # its slider, the slider's layout and style
    closed = len(fe.closed)
    died = fe.cell("%%rank [1]\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)", ok=False)
    assert died.status == "error"
    assert sorted(fe.closed[closed:]) == sorted(rank_1)  # closed as the cell learned of its death
    fe.cell("%dist_restart")
    fe.cell("%%rank [1]\nimport ipywidgets as widgets\ns = widgets.IntSlider(value=rank)\ndisplay(s)")
    ranks = [i for i in fe.open_ids() if i not in fe.kernel_ids]
    closed = len(fe.closed)
    fe.cell("%dist_shutdown")
    assert sorted(fe.closed[closed:]) == sorted(ranks)  # every rank model the frontend still had
    assert fe.open_ids() == fe.kernel_ids


def test_ranch_ranks_show_widgets_as_text(fe):
    """%%ranch: rank 0 is the notebook itself (a widget of the kernel's own); rank 1 is gone
    when the cell ends, so its widget falls back to its text."""
    start = len(fe.opened)
    seen = fe.cell("%%ranch 2\nimport os, ipywidgets as widgets\n"
                   "display(widgets.IntSlider(value=int(os.environ['RANK'])))")
    assert seen.stdout == "[rank 1] IntSlider(value=1)\n"
    sliders = fe.of_model("IntSliderModel", fe.opened[start:])
    assert [fe.models[i]["state"]["value"] for i in sliders] == [0]


def test_without_a_kernel_rank_widgets_are_text(capsys):
    """A Session from plain Python has no frontend: its ranks make no comms, and a widget
    shows as its text."""
    from mpify_nb import Session

    with Session(2, ddp=False) as s:
        s.run("import ipywidgets as widgets\nw = widgets.IntSlider(value=rank)\ndisplay(w)")
        assert s.run("type(w.comm).__name__") == {0: "DummyComm", 1: "DummyComm"}
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank 0] IntSlider(value=0)",
                                                           "[rank 1] IntSlider(value=1)"]


def test_ranks_forked_from_a_template_that_preloaded_widgets_and_tqdm_get_them_right(fe):
    """The template imported tqdm.auto where no kernel shell is loaded (text bars, right for
    %%ranch): a persistent rank forked from it chooses again."""
    fe.cell("%%local\nimport mpify_nb, mpify_nb.template\nmpify_nb.set_preload(['tqdm.autonotebook', 'ipywidgets'])")
    for _ in range(2):  # the first call starts the new template, the next one is forked from it
        fe.cell("%%ranch 2\nfrom tqdm.auto import tqdm")
        fe.cell("%%local\nassert mpify_nb.template.wait_preloaded(120)")
    fe.cell("%dist_init -n 2")
    seen = fe.cell("import sys\npreloaded = 'tqdm.autonotebook' in sys.modules\nfrom tqdm.auto import tqdm\n"
                   "preloaded, tqdm.__mro__[1].__module__")
    assert seen.results == ["[rank 0] (True, 'tqdm.notebook')\n[rank 1] (True, 'tqdm.notebook')"]
    # interact and Output, preloaded too, show and clear through the rank's display and clear_output
    seen = fe.cell("import ipywidgets.widgets.interaction as interaction, IPython.display\n"
                   "[f.__module__ for f in (interaction.display, interaction.clear_output, IPython.display.display)]")
    modules = "['mpify_nb.rank.display', 'mpify_nb.rank.comms', 'mpify_nb.rank.display']"
    assert seen.results == [f"[rank 0] {modules}\n[rank 1] {modules}"]
    fe.cell("%dist_shutdown")
    fe.cell("%%local\nmpify_nb.set_preload(False)")
