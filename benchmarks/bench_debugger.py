#!/usr/bin/env python
"""Issue 29: the debugger panel on 2 persistent ranks, through a real kernel, beside the kernel's own.

This script is the frontend (tests/helpers_debugger.DebugFrontend: DAP over jupyter_client, as
JupyterLab's panel). Figures (medians):

1. a trivial rank cell (``1``) with the panel off, then on (ranks traced by pydevd): the cost of
   leaving the panel on, and that turning it on costs nothing before;
2. turning the panel on (initialize + attach: debugpy imported and started in both ranks);
3. a cell to its stops at a gutter breakpoint, ``next`` to the next stops, ``continue`` to the
   cell's end: on 2 ranks, and in the kernel alone (a ``%%local`` cell) side by side.

Run: ``.venv/bin/python benchmarks/bench_debugger.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from _common import Result, finish, fmt_list, machine_line, median, parse_args

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers_debugger import DebugFrontend  # noqa: E402  (the tests' frontend)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stepping(front: DebugFrontend, code: str, stops: int, n: int) -> tuple[list[float], list[float], list[float]]:
    """n rounds of: the cell to its ``stops`` stops, next to as many, continue to its end."""
    to_stop, to_step, to_end = [], [], []
    for _ in range(n):
        front.drain_events()
        start = time.perf_counter()
        cell = front.start(code)
        thread = [front.next_event("stopped")["body"]["threadId"] for _ in range(stops)][-1]
        to_stop.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert front.dap("next", threadId=thread)["success"]
        for _ in range(stops):
            front.next_event("stopped")
        to_step.append(time.perf_counter() - start)
        front.drain_events()
        start = time.perf_counter()
        assert front.dap("continue", threadId=1)["success"]
        front.finish(cell)
        to_end.append(time.perf_counter() - start)
    return to_stop, to_step, to_end


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    n = 8 if args.quick else 30
    print(machine_line())
    front = DebugFrontend(tempfile.gettempdir())
    results: list[Result] = []
    try:
        front.ok("%load_ext mpify_nb")
        front.ok("%dist_init -n 2")
        for _ in range(3):
            front.ok("1")
        off = [timed(lambda: front.ok("1")) for _ in range(n)]
        on_time = timed(front.enable)
        for _ in range(3):
            front.ok("1")
        on = [timed(lambda: front.ok("1")) for _ in range(n)]
        ranks_code = "a = rank\nb = a + 1\nc = b + 1\nc"
        kernel_code = "%%local\na = 0\nb = a + 1\nc = b + 1\nc"
        front.breakpoints(ranks_code, [2])
        front.breakpoints(kernel_code, [3])
        stepping(front, ranks_code, 2, 1)  # warm-up
        r_stop, r_step, r_end = stepping(front, ranks_code, 2, n)
        k_stop, k_step, k_end = stepping(front, kernel_code, 1, n)
        results += [
            Result("29", "trivial rank cell, panel off", median(off) * 1000, "ms", detail=fmt_list(off)),
            Result("29", "trivial rank cell, panel on (ranks traced)", median(on) * 1000, "ms",
                   detail=f"{median(on) / median(off):.2f}x off"),
            Result("29", "turning the panel on (2 ranks start debugpy)", on_time * 1000, "ms"),
            Result("29", "cell to its stops, 2 ranks", median(r_stop) * 1000, "ms",
                   detail=f"kernel alone {median(k_stop) * 1000:.1f} ms: {median(r_stop) / median(k_stop):.2f}x"),
            Result("29", "next to the next stops, 2 ranks", median(r_step) * 1000, "ms",
                   detail=f"kernel alone {median(k_step) * 1000:.1f} ms: {median(r_step) / median(k_step):.2f}x"),
            Result("29", "continue to the cell's end, 2 ranks", median(r_end) * 1000, "ms",
                   detail=f"kernel alone {median(k_end) * 1000:.1f} ms: {median(r_end) / median(k_end):.2f}x"),
        ]
        front.clear_breakpoints()
        front.ok("%dist_shutdown")
    finally:
        front.close()
    return finish("the debugger panel on ranks (issue 29)", results, args)


if __name__ == "__main__":
    sys.exit(main())
