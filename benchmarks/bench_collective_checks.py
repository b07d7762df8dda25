#!/usr/bin/env python
"""Issue 35: what the collective check costs (every rank compares its call with its peers' first).

Side by side in one run, 2 ranks, gloo on CPU, the caller as rank 0 (``ranch``, as a notebook
runs it): short blocks with the check on and off alternate inside the same ranks, so a load that
comes and goes on the machine falls on both alike; each ratio is the median of the pairs' own:

1. a loop of ``dist.all_reduce`` the user calls, on 4 B, 1 MB and 64 MB tensors
   (targets: <= 2x on 4 B, <= 1.05x on 1 MB and 64 MB); blocks of a few steps, the check on
   and off by turns in pairs, each pair's ratio, and the median of the ratios;
2. a DDP training loop (forward, backward, step; its bucket all-reduces run in C++, so only
   what the user calls through torch.distributed is checked: nothing here) (target <= 1.05x);
3. a persistent trivial cell (``Session.run("1")``), the check on and off (target: within
   noise, <= 1.10x), and for information a cell with one all_reduce;
4. for information, the check's own work per call on a rank (no gloo, no waiting): what it
   costs the CPU whatever the scheduler does; and a loop of ``all_reduce(async_op=True).wait()``
   (the first rank to come hands its call to the group's lane, which issues it).

Each loop also says the median of single calls, on and off: under load a descheduled rank makes
a block's mean jump, and a single call's median shows what a typical call pays.

Run: ``.venv/bin/python benchmarks/bench_collective_checks.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import sys
import time

from _common import Result, finish, machine_line, median, parse_args

SIZES = (("4 B", 1), ("1 MB", 2**18), ("64 MB", 2**24), ("async 4 B", 1))


def _loops(plan: list, pairs: int):
    """On each rank: for each (label, elements, steps), ``pairs`` pairs of blocks of ``steps``
    all_reduces, one block with the check on and one off, in turns (on-off, off-on, ...); then a
    DDP loop likewise. Returns {label: (on, off)}, seconds per step of each block (rank 0's)."""
    import torch
    import torch.distributed as dist

    from mpify_nb.torchdist.checks import wrappers

    def blocks(step, steps: int) -> tuple[list, list, list, list]:
        on, off, on_calls, off_calls = [], [], [], []
        for i in range(pairs):
            for checked in ((True, False) if i % 2 == 0 else (False, True)):
                wrappers.set_enabled(checked)  # every rank alike, at the same point
                dist.barrier()
                calls = on_calls if checked else off_calls
                t0 = started = time.perf_counter()
                for _ in range(steps):
                    step()
                    t1 = time.perf_counter()
                    calls.append(t1 - t0)
                    t0 = t1
                (on if checked else off).append((t0 - started) / steps)
        wrappers.set_enabled(True)
        return on, off, on_calls, off_calls

    out: dict = {}
    for label, elements, steps in plan:
        x = torch.ones(elements)
        dist.all_reduce(x)  # warm: gloo's buffers for this size
        if label.startswith("async"):
            out[label] = blocks(lambda x=x: dist.all_reduce(x, async_op=True).wait(), steps)
        else:
            out[label] = blocks(lambda x=x: dist.all_reduce(x), steps)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32, 256)

    def train_step() -> None:
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()

    for _ in range(3):
        train_step()  # DDP's buckets, warm
    out["DDP step"] = blocks(train_step, 2)
    return out


def _own_work(reps: int) -> list[float]:
    """The check's own work for one all_reduce of 4 B on a rank whose peer has published already
    (describe, publish, read, compare), without gloo and without waiting: what every checked call
    costs its rank's CPU, whatever the scheduler does. In this process, a world of one gloo group
    with a table of two, the peer's slot written beforehand; seconds per call, per batch of 2000."""
    import torch
    import torch.distributed as dist

    from mpify_nb.torchdist.checks import calls, groups, table, wrappers

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        pg = dist.distributed_c10d._get_default_group()
        shared = table.ShmTable.create(2)
        group = groups.Group(pg, "0", None, (0, 1), 0, shared, frozenset({"cpu"}))
        groups._groups[pg] = group
        x = torch.ones(1)
        peer = calls.joined(calls.encode(calls.describe("all_reduce", {"tensor": x}, group.group_rank)),
                              calls.encode(("<peer>", 1)), 1 << 20)
        params = ["tensor", "op", "group", "async_op"]
        times = []
        for _ in range(reps):  # CPU time of this thread: what the check costs, whoever else runs
            t0 = time.thread_time()
            for _ in range(2000):
                shared.put(("c", 1), group.calls, peer)
                wrappers._check("all_reduce", params, (x,), {}, True, None)
            spent = time.thread_time() - t0
            t0 = time.thread_time()
            for _ in range(2000):
                shared.put(("c", 1), group.calls, peer)  # the peer's publishing, not this rank's work
            times.append((spent - (time.thread_time() - t0)) / 2000)
        return times
    finally:
        groups._groups.pop(pg, None)
        dist.destroy_process_group()


def _session(pairs: int) -> dict:
    """A Session's trivial cell and one-all_reduce cell: pairs of blocks, the check on and off in
    turns (the ranks learn each change before the next cell, an untimed one)."""
    from mpify_nb import Session, set_collective_checks

    out: dict = {"trivial": ([], []), "all_reduce": ([], [])}
    with Session(2) as s:
        s.run("t = torch.ones(4)")
        for _ in range(5):
            s.run("1")
            s.run("dist.all_reduce(t)")
        for i in range(pairs):
            for checked in ((True, False) if i % 2 == 0 else (False, True)):
                set_collective_checks(checked)
                s.run("1")
                for cell, key in (("1", "trivial"), ("dist.all_reduce(t)", "all_reduce")):
                    times = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        s.run(cell)
                        times.append(time.perf_counter() - t0)
                    out[key][0 if checked else 1].append(median(times))
        set_collective_checks(True)
    return out


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    pairs = 12 if args.quick else 40
    steps = {"4 B": 20, "1 MB": 4, "64 MB": 1, "async 4 B": 20}
    print(machine_line(), flush=True)
    import mpify_nb
    from mpify_nb import in_torchddp, ranch

    mpify_nb.template.get_template().wait_ready()
    plan = [(label, elements, steps[label]) for label, elements in SIZES]
    loops = ranch(2, _loops, plan, pairs, ctx=in_torchddp(), timeout=1800)[0]
    cells = _session(pairs)
    own = _own_work(5 if args.quick else 15)

    def ratio(pair) -> tuple[float, float, float]:
        """Medians of each kind, and the median of each pair's ratio (a load that comes and goes
        falls on the two blocks of a pair alike)."""
        on, off = pair[:2]
        return median(on), median(off), median([a / b for a, b in zip(on, off)])

    results = []
    targets = {"4 B": 2.0, "1 MB": 1.05, "64 MB": 1.05, "DDP step": 1.05}
    for n, label in enumerate(["4 B", "1 MB", "64 MB", "DDP step"], 1):
        on, off, r = ratio(loops[label])
        name = f"all_reduce of {label}, check on / off" if label != "DDP step" else "DDP training step, on / off"
        results.append(Result(f"35.{n}", name, r, "x", f"<= {targets[label]:g}x", r <= targets[label],
                              f"on {on * 1e6:.1f} us, off {off * 1e6:.1f} us per step (medians of {pairs} "
                              f"blocks each; the ratio: the median of the {pairs} pairs'); {_per_call(loops[label])}"))
    on, off, r = ratio(cells["trivial"])
    results.append(Result("35.5", "Session trivial cell, check on / off", r, "x", "<= 1.10x (noise)", r <= 1.10,
                          f"on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms"))
    on, off, r = ratio(cells["all_reduce"])
    results.append(Result("35.6", "Session cell with one all_reduce, on / off", r, "x",
                          detail=f"on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms"))
    results.append(Result("35.7", "the check's own work per call (a rank, no waiting)", median(own) * 1e6, "us",
                          detail=f"CPU time per batch: {', '.join(f'{t * 1e6:.1f}' for t in own)} us; DDP's ratio "
                                 "above, which the check does not touch, shows this machine's noise"))
    on, off, r = ratio(loops["async 4 B"])
    results.append(Result("35.8", "all_reduce(async_op=True).wait() of 4 B, on / off", r, "x",
                          detail=f"on {on * 1e6:.1f} us, off {off * 1e6:.1f} us per step; "
                                 f"{_per_call(loops['async 4 B'])}"
                                 " (the first rank to come hands its call to the group's lane)"))
    return finish("the collective check's cost (issue 35)", results, args)


def _per_call(blocks: tuple) -> str:
    """The medians of single calls (a descheduled call weighs one sample, not a block's mean)."""
    on, off = median(blocks[2]), median(blocks[3])
    return f"per call: on {on * 1e6:.1f} us, off {off * 1e6:.1f} us ({on / off:.3f}x)"


if __name__ == "__main__":
    sys.exit(main())
