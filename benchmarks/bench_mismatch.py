#!/usr/bin/env python
"""Issue 28: how fast a distributed mistake ends the call, and what a look at a rank costs.

Figures (medians, 2 ranks, gloo on CPU):

1. ``ranch``: a call whose ranks wait in all_reduce and broadcast (a mismatch), from the call
   to its ``CollectiveError`` (target <= 2 s), beside a healthy call of the same size;
2. ``ranch``: rank 1 returns while rank 0 waits in an all_reduce it never joins;
3. ``Session``: a mismatch cell to its ``CollectiveError``, group rebuilt (target <= 2 s);
4. a look at a rank (torchdist/waits.py's snapshot: a 32-entry recorder, the stack), in this
   process, and the size of the answer a rank sends (for information: one a second per rank).

Run: ``.venv/bin/python benchmarks/bench_mismatch.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

from _common import Result, finish, fmt_list, machine_line, median, parse_args


def _mismatch():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, 0)


def _returns_early():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(x)


def _healthy():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    dist.all_reduce(x)


def _timed_ranch(fn, reps: int) -> list[float]:
    from mpify_nb import in_torchddp, ranch
    from mpify_nb.wire.errors import CollectiveError

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            ranch(2, fn, ctx=in_torchddp(), timeout=60)
        except CollectiveError:
            pass
        times.append(time.perf_counter() - t0)
    return times


def _look_cost(reps: int) -> tuple[list[float], int]:
    """A world of one gloo group with a full recorder, looked at from another thread."""
    import torch
    import torch.distributed as dist

    from mpify_nb.torchdist import waits

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", **waits.recorder_env())
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        for _ in range(100):
            dist.all_reduce(torch.ones(4))
        main = threading.get_ident()
        native = threading.get_native_id()
        costs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            snap = waits.snapshot(0, main, native)
            body = pickle.dumps(snap)
            costs.append(time.perf_counter() - t0)
        return costs, len(body)
    finally:
        dist.destroy_process_group()


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    reps = 3 if args.quick else 7
    print(machine_line(), flush=True)
    import mpify_nb
    from mpify_nb import Session
    from mpify_nb.wire.errors import CollectiveError

    mpify_nb.template.get_template().wait_ready()
    _timed_ranch(_healthy, 2)  # warm-up
    healthy = _timed_ranch(_healthy, reps)
    mismatch = _timed_ranch(_mismatch, reps)
    early = _timed_ranch(_returns_early, reps)
    session_times = []
    with Session(2) as s:
        cell = "x = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(x)\nelse:\n    dist.broadcast(x, 0)"
        for _ in range(reps):
            t0 = time.perf_counter()
            try:
                s.run(cell)
            except CollectiveError:
                pass
            session_times.append(time.perf_counter() - t0)
    looks, size = _look_cost(200 if not args.quick else 50)
    results = [
        Result("28.1", "ranch: mismatch to CollectiveError", median(mismatch), "s", "<= 2 s",
               median(mismatch) <= 2.0, f"{fmt_list(mismatch)}; a healthy call: {fmt_list(healthy)}"),
        Result("28.2", "ranch: a rank returns without joining, to CollectiveError", median(early), "s", "<= 2 s",
               median(early) <= 2.0, fmt_list(early)),
        Result("28.3", "Session: mismatch cell to CollectiveError, group rebuilt", median(session_times), "s",
               "<= 2 s", median(session_times) <= 2.0, fmt_list(session_times)),
        Result("28.4", "a look at a rank (recorder of 32, stack, pickled)", median(looks) * 1000, "ms",
               detail=f"its answer: {size} bytes; one look a second per rank while a call runs"),
    ]
    return finish("distributed mistakes (issue 28)", results, args)


if __name__ == "__main__":
    sys.exit(main())
