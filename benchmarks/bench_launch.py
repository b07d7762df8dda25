#!/usr/bin/env python
"""Targets 1 and 2 of issue 3: how long a launch takes.

Target 1, warm launch. In this process (torch imported, template warm), time
``ranch(n, f, ctx=in_torchddp())`` for n = 2 and 4, where ``f`` (defined here, in
``__main__``, so it travels by value like a notebook function) does one
all_reduce. Compared, in the same run, with:

* the fork floor: a separate clean process that already imported torch plays
  rank 0 and forks ranks 1..n-1; each joins a gloo group, all_reduces once and
  exits; timed from the first fork until every child is reaped (the parent plays
  rank 0, like the caller of ``ranch`` does). Floor and ranch calls alternate.
* ``torch.multiprocessing.spawn`` of n ranks doing the same work (the parent
  plays no rank: spawn cannot make it one).

Target: median ranch <= 1.5x median floor, and >= 20x faster than median spawn.

Target 2, first call in a fresh process. A fresh ``python -c`` that imports
torch, then mpify_nb (which starts the template in the background), then at once
calls ``ranch(2, f, ctx=in_torchddp())``; against a fresh ``python -c`` that
imports torch and runs one ``torch.multiprocessing.spawn`` of the same work.
Compared: "import mpify_nb + first call" vs "the spawn call", and the whole
process's wall time (interpreter start to exit) vs the same for spawn.
Target: neither is slower than the spawn side.

Run: ``.venv/bin/python benchmarks/bench_launch.py [--quick]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from _common import BENCH_DIR, Result, finish, fmt_list, fmt_s, free_port, machine_line, median, parse_args


def allreduce_fn() -> float:
    """One all_reduce; defined in __main__, so ranch ships it by value (as from a notebook)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t[0])


class FloorServer:
    """The fork-floor process (see _workers.fork_floor_serve): one repetition per request."""

    def __init__(self) -> None:
        code = f"import sys; sys.path.insert(0, {BENCH_DIR!r}); import _workers; _workers.fork_floor_serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the fork-floor process did not start")

    def once(self, n: int) -> float:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork-floor process died")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def warm_launch(quick: bool) -> list[Result]:
    import _workers
    import torch.multiprocessing as tmp

    import mpify_nb
    from mpify_nb import in_torchddp, ranch

    reps = 10 if quick else 20
    spawn_reps = 3 if quick else 5
    mpify_nb.template.get_template().wait_ready()
    floor = FloorServer()
    results: list[Result] = []
    try:
        for n in (2, 4):
            for _ in range(2):  # warm-up: first gloo use, page cache, dill pickler caches
                ranch(n, allreduce_fn, ctx=in_torchddp())
                floor.once(n)
            ranch_times, floor_times = [], []
            for i in range(reps):
                # Alternate the order, so a burst of load elsewhere does not favour one side.
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    if side == 0:
                        t0 = time.perf_counter()
                        values = ranch(n, allreduce_fn, ctx=in_torchddp())
                        ranch_times.append(time.perf_counter() - t0)
                        assert values == [float(n)] * n, values
                    else:
                        floor_times.append(floor.once(n))
            spawn_times = []
            for _ in range(spawn_reps):
                t0 = time.perf_counter()
                tmp.spawn(_workers.spawn_allreduce, args=(n, free_port()), nprocs=n, join=True)
                spawn_times.append(time.perf_counter() - t0)
            r, f, s = median(ranch_times), median(floor_times), median(spawn_times)
            print(f"n={n}: ranch median {fmt_s(r)} (min {fmt_s(min(ranch_times))}, all {fmt_list(ranch_times)})")
            print(f"n={n}: fork floor median {fmt_s(f)} (min {fmt_s(min(floor_times))}, all {fmt_list(floor_times)})")
            print(f"n={n}: tmp.spawn median {fmt_s(s)} (all {fmt_list(spawn_times)})")
            print(f"n={n}: ranch/floor = {r / f:.2f}x, spawn/ranch = {s / r:.1f}x", flush=True)
            times = {"ranch": ranch_times, "floor": floor_times, "spawn": spawn_times}
            results.append(Result("1", f"warm ranch n={n} / fork floor", r / f, "x", "<= 1.5x", r / f <= 1.5,
                                  f"ranch {fmt_s(r)} vs floor {fmt_s(f)} (medians of {reps}; floor: parent "
                                  "plays rank 0)", times))
            results.append(Result("1", f"tmp.spawn n={n} / warm ranch", s / r, "x", ">= 20x", s / r >= 20,
                                  f"spawn {fmt_s(s)} (median of {spawn_reps}) vs ranch {fmt_s(r)}"))
    finally:
        floor.close()
    return results


# A fresh process: two imports (torch and mpify_nb, in either order; importing mpify_nb starts
# the template in the background), then the first call at once. {first}/{second} are the imports.
_FRESH_RANCH = """
import time
T0 = time.perf_counter()
import json, sys
import {first}
T1 = time.perf_counter()
import {second}
T2 = time.perf_counter()
import mpify_nb
from mpify_nb import in_torchddp, ranch
def f():
    import torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t[0])
values = ranch(2, f, ctx=in_torchddp())
T3 = time.perf_counter()
assert values == [2.0, 2.0], values
json.dump({{"import_{first}": T1 - T0, "import_{second}": T2 - T1, "call": T3 - T2,
           "template_pid": mpify_nb.template.get_template().pid}}, open(sys.argv[1], "w"))
"""

_FRESH_SPAWN = f"""
import time
T0 = time.perf_counter()
import json, sys
import torch
T1 = time.perf_counter()
import torch.multiprocessing as tmp
sys.path.insert(0, {BENCH_DIR!r})
import _workers
T2 = time.perf_counter()
tmp.spawn(_workers.spawn_allreduce, args=(2, _workers._free_port()), nprocs=2, join=True)
T3 = time.perf_counter()
json.dump({{"import_torch": T1 - T0, "call": T3 - T2}}, open(sys.argv[1], "w"))
"""


def _run_fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; return its JSON report plus the process's wall time."""
    import json

    with tempfile.TemporaryDirectory() as tmpdir:
        out = os.path.join(tmpdir, "out.json")
        log = os.path.join(tmpdir, "log.txt")
        with open(log, "w") as logf:
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-c", code, out], stdout=logf, stderr=subprocess.STDOUT)
            code_ = proc.wait(timeout=300)
            total = time.perf_counter() - t0
        if code_ != 0 or not os.path.exists(out):
            with open(log) as f:
                raise RuntimeError(f"fresh process failed (exit {code_}):\n{f.read()}")
        with open(out) as f:
            report = json.load(f)
    report["total"] = total
    pid = report.get("template_pid")
    if pid is not None:  # the template must go with its caller; check it does not linger
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        report["template_lingered"] = os.path.exists(f"/proc/{pid}")
        if report["template_lingered"]:
            os.kill(pid, 9)
    return report


def first_call(quick: bool) -> list[Result]:
    reps = 2 if quick else 3
    torch_first = _FRESH_RANCH.format(first="torch", second="mpify_nb")
    mpify_first = _FRESH_RANCH.format(first="mpify_nb", second="torch")
    runs: dict[str, list[dict]] = {"ranch": [], "spawn": [], "ranch_mpify_first": []}
    for i in range(reps):
        order = ("ranch", "spawn") if i % 2 == 0 else ("spawn", "ranch")
        for side in order:
            runs[side].append(_run_fresh(torch_first if side == "ranch" else _FRESH_SPAWN))
        if not quick:
            runs["ranch_mpify_first"].append(_run_fresh(mpify_first))
    for rep in runs["ranch"]:  # from `import mpify_nb` to the result
        rep["mpify_and_call"] = rep["import_mpify_nb"] + rep["call"]
    for rep in runs["ranch_mpify_first"]:  # here `import torch` sits between the two
        rep["mpify_and_call"] = rep["import_mpify_nb"] + rep["import_torch"] + rep["call"]
    for side, reports in runs.items():
        for rep in reports:
            print(f"fresh {side}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in rep.items()))

    def med(side: str, key: str) -> float:
        return median([rep[key] for rep in runs[side]])

    first = med("ranch", "mpify_and_call")
    call_only = med("ranch", "call")
    spawn_call = med("spawn", "call")
    total_r, total_s = med("ranch", "total"), med("spawn", "total")
    lingered = any(rep.get("template_lingered") for reps_ in runs.values() for rep in reps_)
    print(f"fresh: import mpify_nb + first ranch {fmt_s(first)} (call alone {fmt_s(call_only)}) vs tmp.spawn "
          f"call {fmt_s(spawn_call)}: {first / spawn_call:.2f}x; whole process {fmt_s(total_r)} vs "
          f"{fmt_s(total_s)}: {total_r / total_s:.2f}x; template lingered after exit: {lingered}", flush=True)
    results = [
        Result("2", "fresh: import mpify_nb + 1st ranch(2) / tmp.spawn(2) call", first / spawn_call, "x",
               "<= 1.0x", first / spawn_call <= 1.0,
               f"{fmt_s(first)} vs {fmt_s(spawn_call)} (medians of {reps}; both after `import torch`); "
               f"the ranch call alone: {fmt_s(call_only)}"),
        Result("2", "fresh: whole process, ranch / tmp.spawn", total_r / total_s, "x", "<= 1.0x",
               total_r / total_s <= 1.0 and not lingered,
               f"{fmt_s(total_r)} vs {fmt_s(total_s)} (python start to exit; "
               f"template left running after exit: {lingered})"),
    ]
    if runs["ranch_mpify_first"]:
        m = med("ranch_mpify_first", "mpify_and_call")
        results.append(Result("2", "fresh, mpify_nb imported before torch: imports + 1st call", m, "s", "",
                              None, f"whole process {fmt_s(med('ranch_mpify_first', 'total'))} (information)"))
    return results


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # what ranch sets: the baselines get the same
    print(machine_line(), flush=True)
    results = warm_launch(args.quick)
    results += first_call(args.quick)
    return finish("launch (targets 1, 2)", results, args)


if __name__ == "__main__":
    sys.exit(main())
