#!/usr/bin/env python
"""Issue 35: the stop button at a ``(Pdb)`` prompt keeps the rank, every time, also under load.

Through a real kernel (this script is the frontend, jupyter_client): ``%dist_init -n 2``, then
``N`` times a ``%%rank [1]`` cell that calls ``breakpoint()``; the stop button is pressed as soon
as the ``(Pdb)`` prompt arrives, and the next cell checks that rank 1 still holds its state. Run
once on a quiet machine and once beside busy loops (``while True: pass``, one process each).
Before the fix, the interrupt could land while rank 1 sent pdb's next prompt, cutting that
frame in half: once in 7 runs under load, rank 1 was lost.

Run: ``.venv/bin/python benchmarks/bench_pdb_interrupt.py [--quick] [--runs N] [--busy K]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_debugging import Frontend  # noqa: E402  (the tests' frontend: answers input requests)


def kept(front: Frontend, runs: int) -> tuple[int, list[str]]:
    """How many of ``runs`` interrupts at the prompt kept rank 1's state; what went wrong."""
    good, wrong = 0, []
    for i in range(runs):
        cell = front.run("%%rank [1]\nbreakpoint()\nkept = -1\nkept", [None])
        after = front.run("%%rank [1]\nkept")
        if cell.ename == "KeyboardInterrupt" and after.results == ["[rank 1] 7"]:
            good += 1
            continue
        wrong.append(f"run {i}: {cell.ename or cell.status} then {after.ename or after.results}")
        front.ok("%dist_restart")
        front.ok("%%rank [1]\nkept = 7")
    return good, wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--quick", action="store_true", help="10 runs instead of 50")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--busy", type=int, default=6, help="busy loops beside the second round")
    args = parser.parse_args()
    runs = 10 if args.quick else args.runs
    front = Frontend(tempfile.mkdtemp(prefix="bench_pdb_"))
    failed = False
    try:
        front.ok("%load_ext mpify_nb")
        front.ok("%dist_init -n 2")
        front.ok("%%rank [1]\nkept = 7")
        for busy in (0, args.busy):
            burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                started = time.monotonic()
                good, wrong = kept(front, runs)
            finally:
                for p in burners:
                    p.kill()
                    p.wait()
            print(f"{busy} busy loops beside: rank 1 kept its state {good}/{runs} "
                  f"({time.monotonic() - started:.1f} s){'; ' + '; '.join(wrong) if wrong else ''}", flush=True)
            failed = failed or good != runs
    finally:
        front.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
