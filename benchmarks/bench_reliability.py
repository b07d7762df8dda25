#!/usr/bin/env python
"""Figures for issue 7 (nothing outlives a call, nothing hangs), side by side in one run.

- a call whose rank 1 leaves a child (``sleep 300``, holding the rank's stdout) against
  the same call without it: the child must be gone and the call must not wait for it;
- ``template.shutdown()``, and the first call after an import-time variable changed
  (``OMP_NUM_THREADS``: a new template) against a warm call;
- 1 GiB returned by rank 1 as a numpy array and as a torch tensor (shared memory both),
  and the same numpy array pickled (what the payload did before).

Run: ``.venv/bin/python benchmarks/bench_reliability.py [--quick]``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import time

from _common import fmt_list, fmt_s, median, parse_args


def plain() -> int:
    return int(os.environ["RANK"])


def leave_child() -> int:
    if os.environ["RANK"] == "1":
        return subprocess.Popen(["sleep", "300"]).pid  # inherits the rank's stdout pipe
    return 0


def big_numpy():
    import numpy as np

    return np.ones(2**30 // 8) if os.environ["RANK"] == "1" else None


def big_tensor():
    import torch

    return torch.ones(2**30 // 8, dtype=torch.float64) if os.environ["RANK"] == "1" else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def timed(fn, *args) -> tuple[float, object]:
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    reps = 3 if args.quick else 7
    import numpy as np

    from mpify_nb import ranch, template

    ranch(2, plain)  # warm

    plain_t, child_t, left = [], [], []
    for _ in range(reps):
        plain_t.append(timed(ranch, 2, plain)[0])
        t, pids = timed(ranch, 2, leave_child)
        child_t.append(t)
        left.append(alive(pids[1]))
    print(f"call, plain:                  {fmt_s(median(plain_t))} {fmt_list(plain_t)}")
    print(f"call, rank 1 leaves a child:  {fmt_s(median(child_t))} {fmt_list(child_t)}  "
          f"(x{median(child_t) / median(plain_t):.2f}); child alive after the call: {sum(left)} of {reps}")

    shutdown_t, restart_t, warm_t = [], [], []
    for i in range(reps):
        ranch(2, plain)
        shutdown_t.append(timed(template.shutdown)[0])
        ranch(2, plain)  # a new template, warmed
        warm_t.append(timed(ranch, 2, plain)[0])
        os.environ["OMP_NUM_THREADS"] = str(1 + i % 2)
        restart_t.append(timed(ranch, 2, plain)[0])
    print(f"template.shutdown():          {fmt_s(median(shutdown_t))} {fmt_list(shutdown_t)}")
    print(f"warm call:                    {fmt_s(median(warm_t))} {fmt_list(warm_t)}")
    print(f"call after OMP_NUM_THREADS changed (new template): {fmt_s(median(restart_t))} {fmt_list(restart_t)}")

    gib = []
    for fn in (big_numpy, big_tensor):
        times = []
        for _ in range(max(2, reps // 2)):
            t, out = timed(ranch, 2, fn)
            assert out[1].nbytes == 2**30 if hasattr(out[1], "nbytes") else out[1].numel() * 8 == 2**30
            del out
            times.append(t)
        gib.append(times)
        print(f"1 GiB from rank 1, {fn.__name__[4:]:6}:    {fmt_s(median(times))} {fmt_list(times)}")
    array = np.ones(2**30 // 8)
    started = time.perf_counter()
    pickle.loads(pickle.dumps(array, protocol=5))
    print(f"1 GiB numpy pickled and unpickled here (the old path's floor, no pipe): "
          f"{fmt_s(time.perf_counter() - started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
