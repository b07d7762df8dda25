#!/usr/bin/env python
"""Two source trees side by side in one run: warm ranch launch, Session cells and push, before and after.

Each measurement runs in a fresh process (its own template, its own kernel) with
``PYTHONPATH`` set to one tree's ``src``; the trees take turns, round after round, so
load from elsewhere on the machine falls on both alike. Figures (medians over the rounds'
samples):

* warm ``ranch(2, all_reduce, ctx=in_torchddp())`` and the fork floor (bench_launch.py);
* a trivial persistent cell's overhead over a local one, an all_reduce cell and
  ``%dist_push`` of 64 MB (bench_session_magics.py's mpify_nb measurements).

Run: ``.venv/bin/python benchmarks/compare_trees.py --before /work/main/src --after src [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import BENCH_DIR, fmt_s, machine_line, median


def child_launch(reps: int) -> dict:
    import bench_launch

    import mpify_nb
    from mpify_nb import in_torchddp, ranch

    mpify_nb.template.get_template().wait_ready()
    floor = bench_launch.FloorServer()
    out: dict = {"ranch": [], "floor": []}
    try:
        for _ in range(2):  # warm-up
            ranch(2, bench_launch.allreduce_fn, ctx=in_torchddp())
            floor.once(2)
        for i in range(reps):
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                if side == 0:
                    t0 = time.perf_counter()
                    assert ranch(2, bench_launch.allreduce_fn, ctx=in_torchddp()) == [2.0, 2.0]
                    out["ranch"].append(time.perf_counter() - t0)
                else:
                    out["floor"].append(floor.once(2))
    finally:
        floor.close()
    return out


def child_session(reps: int) -> dict:
    import bench_session_magics

    return bench_session_magics.measure_mpify(reps, quick=True)


def run_child(which: str, src: str, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmpdir:
        out = os.path.join(tmpdir, "out.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
        subprocess.run([sys.executable, __file__, "--child", which, "--reps", str(reps), "--json", out],
                       env=env, check=True)
        with open(out) as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="/work/main/src")
    parser.add_argument("--after", default=os.path.join(os.path.dirname(BENCH_DIR), "src"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--child", choices=("launch", "session"))
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, BENCH_DIR)
        data = child_launch(args.reps) if args.child == "launch" else child_session(args.reps)
        with open(args.json, "w") as f:
            json.dump(data, f)
        return 0

    print(f"compare_trees: {machine_line()}; before={args.before} after={args.after}", flush=True)
    trees = {"before": args.before, "after": args.after}
    samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for round_ in range(args.rounds):
        order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
        for which in ("launch", "session"):
            for side in order:
                print(f"round {round_ + 1}: {which} on {side} ...", flush=True)
                for key, xs in run_child(which, trees[side], args.reps).items():
                    samples[side].setdefault(key, []).extend(xs)

    def figure(side: str, key: str, minus: str = "", of=median) -> float:
        d = samples[side]
        return of(d[key]) - (of(d[minus]) if minus else 0.0)

    rows = [
        ("warm ranch(2), all_reduce in in_torchddp()", "ranch", ""),
        ("fork floor, 2 ranks", "floor", ""),
        ("Session: trivial cell over a local cell", "trivial", "local"),
        ("Session: all_reduce cell", "all_reduce", ""),
        ("Session: %dist_push 64 MB to 2 ranks", "push", ""),
        ("Session: %dist_init -n 2", "init", ""),
        ("Session: interrupt to the next usable cell", "interrupt", ""),
    ]
    print()
    print(f"{'figure (median; min)':46s}  {'before':>20s}  {'after':>20s}")
    print(f"{'-' * 46}  {'-' * 20}  {'-' * 20}")
    for name, key, minus in rows:
        cells = [f"{fmt_s(figure(side, key, minus))}; {fmt_s(figure(side, key, minus, min))}" for side in trees]
        print(f"{name:46s}  {cells[0]:>20s}  {cells[1]:>20s}")
    for side in trees:
        ratio = figure(side, "ranch") / figure(side, "floor")
        print(f"{side}: warm ranch / fork floor = {ratio:.2f}x (medians), "
              f"{figure(side, 'ranch', of=min) / figure(side, 'floor', of=min):.2f}x (minima)")
    for side in trees:
        print(f"{side} samples: " + ", ".join(f"{k} n={len(v)}" for k, v in samples[side].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
