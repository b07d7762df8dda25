#!/usr/bin/env python
"""Run every benchmark of issue 3 and print one summary table: each figure, its target, PASS/FAIL.

Each benchmark runs as its own process (a fresh caller, its own template), one
after the other, its output shown as it goes. Exit status 1 if any target failed
or a benchmark crashed.

Run: ``.venv/bin/python benchmarks/run_all.py [--quick] [--only launch,tensors,...]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from _common import BENCH_DIR, Result, load_results, machine_line, print_table

BENCHMARKS = {
    "launch": "bench_launch.py",  # targets 1, 2
    "tensors": "bench_tensors.py",  # target 3
    "throughput": "bench_throughput.py",  # target 4
    "memory": "bench_memory.py",  # target 5
    "session": "bench_session_magics.py",  # issue 8: persistent ranks, beside ipyparallel/nbdistributed
    "debugging": "bench_debugging.py",  # issue 20: a rank's stdin through the frontend
    "widgets": "bench_widgets.py",  # issue 21: a widget update from the frontend to a rank and back
    "mismatch": "bench_mismatch.py",  # issue 28: a distributed mistake to its error; a look's cost
    "checks": "bench_collective_checks.py",  # issue 35: the collective check on and off, side by side
    "debugger": "bench_debugger.py",  # issue 29: the debugger panel on ranks, beside the kernel's own
    "background": "bench_background.py",  # issue 37: background work, beside the same call in the foreground
    "gpu_calls": "bench_gpu_calls.py",  # issue 36: every route to a DDP job, warm calls (CPU here; --device cuda alone)
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, shorter runs (noisier figures)")
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")

    print(f"run_all: {machine_line()}{' (quick)' if args.quick else ''}", flush=True)
    results: list[Result] = []
    crashed: list[str] = []
    durations: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        for name in names:
            out = os.path.join(tmpdir, f"{name}.json")
            cmd = [sys.executable, os.path.join(BENCH_DIR, BENCHMARKS[name]), "--json", out]
            if args.quick:
                cmd.append("--quick")
            print(f"\n######## {name}: {' '.join(cmd[1:2] + cmd[4:])}", flush=True)
            t0 = time.perf_counter()
            code = subprocess.call(cmd)
            durations[name] = time.perf_counter() - t0
            if os.path.exists(out):
                results += load_results(out)
            if code not in (0, 1) or not os.path.exists(out):  # 1 = a target failed, reported in the table
                crashed.append(f"{name} (exit {code})")

    print("\n" + "=" * 100)
    print(f"SUMMARY ({'quick' if args.quick else 'full'} run; {machine_line()})")
    print_table(results)
    print("durations: " + ", ".join(f"{n} {s:.0f} s" for n, s in durations.items()))
    failed = [r for r in results if r.passed is False]
    if crashed:
        print(f"CRASHED: {', '.join(crashed)}")
    print(f"{sum(r.passed is True for r in results)} PASS, {len(failed)} FAIL"
          + (f": {'; '.join(f'[{r.target_id}] {r.name}' for r in failed)}" if failed else ""))
    return 1 if failed or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
