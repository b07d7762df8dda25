#!/usr/bin/env python
"""Target 4 of issue 3: no tax while running.

The same CPU DDP training loop (``_workers.train_steps``: a 256-512-512-10 MLP,
batch 64, SGD, gloo, 2 ranks, ``torch.set_num_threads(1)`` in each rank) runs
for a fixed number of steps (about 20 s; 5 s with --quick), launched two ways:

* A: ``ranch(2, train_steps, n, ctx=in_torchddp())`` from this process, which plays rank 0;
* B: ``torch.multiprocessing.start_processes(..., start_method="fork")`` from a fresh
  process that imported torch first (so ranks are forks of a torch-loaded parent).

Steps per second are measured inside the ranks, after 20 warm-up steps and a
barrier: launch costs are excluded. The number of steps comes from a short
calibration run through ranch. Runs come in A/B pairs, alternating which goes
first (A/B, B/A, A/B: 3 pairs; 1 pair with --quick), so a drift in the load of
the machine does not favour one side.

Target: A reaches >= 0.97 x the steps/s of B. Judged on the median of the
per-pair ratios (robust to one pair hit by a burst of load elsewhere); the ratio
of the means is printed too. Also printed: steps per CPU-second, and the CPU
time the rank processes spent in threads other than the main thread and
torch's/gloo's (mpify_nb's watch, relay, watchdog threads in a ranch rank): a tax
while running would show there whatever the load.

Run: ``.venv/bin/python benchmarks/bench_throughput.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import BENCH_DIR, Result, finish, machine_line, parse_args


def run_ranch(n_steps: int) -> list[dict]:
    import _workers

    from mpify_nb import in_torchddp, ranch

    return ranch(2, _workers.train_steps, n_steps, ctx=in_torchddp())


def run_tmp_fork(n_steps: int) -> list[dict]:
    code = f"import sys; sys.path.insert(0, {BENCH_DIR!r}); import _workers; _workers.tmp_fork_train_main()"
    with tempfile.TemporaryDirectory() as outdir:
        subprocess.run([sys.executable, "-c", code, str(n_steps), outdir], check=True, timeout=600)
        reports = []
        for r in range(2):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                reports.append(json.load(f))
    return reports


def rate(reports: list[dict], key: str = "steps_per_s") -> float:
    """The run's steps per second (or per CPU second): mean over its ranks."""
    return sum(r[key] for r in reports) / len(reports)


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # what ranch sets: the baseline gets the same
    print(machine_line(), flush=True)
    import mpify_nb

    mpify_nb.template.get_template().wait_ready()
    seconds = 5.0 if args.quick else 20.0
    n_pairs = 1 if args.quick else 3
    calibration = rate(run_ranch(200))
    n_steps = max(100, int(seconds * calibration))
    print(f"calibration: {calibration:.1f} steps/s -> {n_steps} steps per run (~{seconds:.0f} s)", flush=True)
    rates: dict[str, list[float]] = {"ranch": [], "tmp": []}
    cpu_rates: dict[str, list[float]] = {"ranch": [], "tmp": []}
    other_cpu: dict[str, list[float]] = {"ranch": [], "tmp": []}
    order = []
    for i in range(n_pairs):
        for side in (("ranch", "tmp") if i % 2 == 0 else ("tmp", "ranch")):
            order.append(side)
            t0 = time.perf_counter()
            reports = run_ranch(n_steps) if side == "ranch" else run_tmp_fork(n_steps)
            wall = time.perf_counter() - t0
            rates[side].append(rate(reports))
            cpu_rates[side].append(rate(reports, "steps_per_cpu_s"))
            other_cpu[side].append(max(r["other_threads_cpu"] for r in reports))
            per_rank = ", ".join(f"rank {r['rank']} {r['steps_per_s']:.1f}/s ({r['seconds']:.1f} s, "
                                 f"{r['cpu_seconds']:.1f} s CPU, of which {r['other_threads_cpu']:.2f} s in "
                                 f"other threads)" for r in reports)
            print(f"{side:5s}: {rates[side][-1]:.1f} steps/s, {cpu_rates[side][-1]:.1f} steps/CPU-s [{per_rank}], "
                  f"launch+run {wall:.1f} s", flush=True)
    a = statistics.mean(rates["ranch"])
    b = statistics.mean(rates["tmp"])
    pairs = [x / y for x, y in zip(rates["ranch"], rates["tmp"])]
    judged = statistics.median(pairs)
    a_cpu = statistics.mean(cpu_rates["ranch"])
    b_cpu = statistics.mean(cpu_rates["tmp"])
    print(f"ranch {a:.1f} steps/s vs torch.multiprocessing (fork) {b:.1f} steps/s: ratio of means {a / b:.3f}; "
          f"per pair {', '.join(f'{p:.3f}' for p in pairs)} (median {judged:.3f})", flush=True)
    print(f"per CPU second: ranch {a_cpu:.1f} vs tmp {b_cpu:.1f}: {a_cpu / b_cpu:.3f}; CPU in other threads "
          f"per run (max over ranks): ranch {other_cpu['ranch']}, tmp {other_cpu['tmp']} s", flush=True)
    results = [
        Result("4", "DDP loop steps/s, ranch / tmp (fork), median pair", judged, "x", ">= 0.97x", judged >= 0.97,
               f"pairs {', '.join(f'{p:.3f}' for p in pairs)}; means {a:.1f} vs {b:.1f} steps/s "
               f"({a / b:.3f}); {n_steps} steps per run, runs {'/'.join(order)}", {"steps_per_s": rates}),
        Result("4", "DDP loop steps per CPU-second, ranch / tmp", a_cpu / b_cpu, "x", "", None,
               f"{a_cpu:.1f} vs {b_cpu:.1f}: CPU time of each rank's whole process (information)",
               {"steps_per_cpu_s": cpu_rates}),
        Result("4", "CPU in mpify_nb threads during the loop, per rank", max(other_cpu["ranch"]), "s", "", None,
               f"max over runs and ranks of the CPU of threads other than main/torch/gloo; "
               f"tmp side: {max(other_cpu['tmp']):.2f} s (information)", {"other_threads_cpu": other_cpu}),
    ]
    return finish("throughput (target 4)", results, args)


if __name__ == "__main__":
    sys.exit(main())
