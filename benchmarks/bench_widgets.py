#!/usr/bin/env python
"""Issue 21's speed target: a widget update from the frontend to a rank and back.

This script is the frontend: it speaks the Jupyter protocol with jupyter_client to a kernel
(this interpreter) that runs ``%dist_init -n 2``, then a cell that makes one IntSlider per
rank whose observer echoes each new value into the slider's description. Each round sends
rank 1's slider ``{method: "update", state: {value: k}}`` on the shell channel, as a
frontend does when the user drags it, and times until rank 1's ``comm_msg`` with
``description == "got k"`` reaches this frontend on iopub (the kernel forwards the update
to rank 1, rank 1's observer runs, its state change comes back through the kernel).

Figure: median over the rounds (target <= 10 ms). For comparison, the kernel's own slider
(no rank) is measured the same way.

Run: ``.venv/bin/python benchmarks/bench_widgets.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import queue
import sys
import time

from _common import Result, finish, fmt_list, machine_line, median, parse_args
from bench_debugging import start_kernel, stop_kernel

SLIDER = ("import ipywidgets as widgets\n"
          "s = widgets.IntSlider(value=0, max=10**9)\n"
          "s.observe(lambda change: setattr(s, 'description', f\"got {change['new']}\"), 'value')\n"
          "display(s)")


def run(kc, code: str) -> list[dict]:
    """Execute ``code``; return its iopub messages once it is done (an error raises)."""
    msg_id = kc.execute(code)
    messages = []
    while True:
        msg = kc.iopub_channel.get_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages


def slider_of(messages: list[dict], rank_label: str) -> str:
    """The model id of the slider displayed after ``rank_label`` ("[rank 1]"; "" for the kernel's)."""
    label = ""
    for msg in messages:
        # lines view puts a cell's rich outputs in rank order: into places it then updates
        if msg["msg_type"] not in ("display_data", "update_display_data"):
            continue
        data = msg["content"]["data"]
        view = data.get("application/vnd.jupyter.widget-view+json")
        labelled_inside = rank_label and data.get("text/plain", "").startswith(rank_label)
        if view is not None and (label == rank_label or labelled_inside):
            return view["model_id"]
        label = data.get("text/plain", "") if view is None else label
    raise RuntimeError(f"no widget view after {rank_label!r}")


def rounds(kc, comm_id: str, n: int, first: int) -> list[float]:
    """Seconds from each update sent to the echo's arrival."""
    times = []
    for k in range(first, first + n):
        msg = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {
            "method": "update", "state": {"value": k}, "buffer_paths": []}})
        sent = time.monotonic()
        kc.shell_channel.send(msg)
        echoed = idle = False
        while not (echoed and idle):
            try:
                got = kc.iopub_channel.get_msg(timeout=30)
            except queue.Empty:
                raise RuntimeError(f"no echo of update {k}") from None
            content = got["content"]
            if (got["msg_type"] == "comm_msg" and content["comm_id"] == comm_id
                    and content["data"].get("state", {}).get("description") == f"got {k}"):
                times.append(time.monotonic() - sent)
                echoed = True
            elif (got["msg_type"] == "status" and content["execution_state"] == "idle"
                  and got["parent_header"].get("msg_id") == msg["header"]["msg_id"]):
                idle = True
    return times


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    n = 50 if args.quick else 300
    print(machine_line())
    km, kc, marker = start_kernel()
    results: list[Result] = []
    try:
        kernel_slider = slider_of(run(kc, SLIDER), "")
        rounds(kc, kernel_slider, 10, 1)  # warm-up
        local = rounds(kc, kernel_slider, n, 100)
        run(kc, "%load_ext mpify_nb")
        run(kc, "%dist_init -n 2")
        rank_slider = slider_of(run(kc, SLIDER), "[rank 1]")
        rounds(kc, rank_slider, 10, 1)  # warm-up
        ranked = rounds(kc, rank_slider, n, 100)
        values = run(kc, "s.value")
        shown = [m["content"]["data"]["text/plain"] for m in values
                 if m["msg_type"] in ("execute_result", "display_data")]
        assert shown == [f"[rank 0] 0\n[rank 1] {100 + n - 1}"], shown  # rank 1's slider moved, rank 0's not
        results += [
            Result("21", "frontend update to rank 1's slider, its echo back at the frontend (2 ranks)",
                   median(ranked) * 1000, "ms", "<= 10 ms", median(ranked) <= 0.010,
                   f"{n} rounds: {fmt_list(ranked)}"),
            Result("21", "the same with the kernel's own slider (no rank)", median(local) * 1000, "ms",
                   detail=fmt_list(local)),
        ]
        run(kc, "%dist_shutdown")
    finally:
        stop_kernel(km, kc, marker)
    return finish("widgets on ranks: a frontend update to a rank and back (issue 21)", results, args)


if __name__ == "__main__":
    sys.exit(main())
