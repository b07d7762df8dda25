#!/usr/bin/env python
"""Target 3 of issue 3: what a big tensor costs, as an argument and as a result.

Arguments: ``ranch(4, read_arg, t)`` with ``t`` one 256 MiB float32 tensor,
minus the same call with a 16-byte tensor. ``read_arg`` proves the tensor
arrived by reading three elements (first, middle, last) and its shape, checked
against the caller's; it does not sum it (that would time the sum, not the
transfer). Target: the difference <= 2x one ``t.clone()`` timed in the same run.

Results: ``ranch(4, make_result, True)``: ranks 1..3 (rank 0 is the caller and
returns None) each build a 256 MiB float32 tensor with ``torch.full`` and return
it; minus ``ranch(4, make_result, False)`` where they build the same tensor but
return only its shape and first element. So the building cancels out and what
remains is the transfer. The caller checks the first and last element of each
tensor. Target: the difference <= 2x the time to clone 3 x 256 MiB (three
clones of 256 MiB, timed in the same run).

Tiny and big calls alternate. Run: ``.venv/bin/python benchmarks/bench_tensors.py [--quick]``.
"""

from __future__ import annotations

import gc
import os
import sys
import time

from _common import Result, finish, fmt_list, fmt_s, machine_line, median, parse_args

NUMEL = 64 * 2**20  # float32 elements: 256 MiB


def read_arg(t):
    """Touch the tensor where it arrived: its shape and three elements."""
    return tuple(t.shape), float(t[0]), float(t[t.numel() // 2]), float(t[-1])


def make_result(big: bool):
    """Ranks 1..: build a 256 MiB tensor; return it (big) or only its shape and first element."""
    import torch

    rank = int(os.environ["RANK"])
    if rank == 0:
        return None
    t = torch.full((NUMEL,), float(rank))
    return t if big else (tuple(t.shape), float(t[0]))


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0])
    print(machine_line(), flush=True)
    import torch

    import mpify_nb
    from mpify_nb import ranch
    from mpify_nb.wire import payload

    reps = 3 if args.quick else 7
    mpify_nb.template.get_template().wait_ready()
    big = torch.rand(NUMEL)
    tiny = torch.rand(4)
    expected = read_arg(big)

    def time_clone() -> float:
        t0 = time.perf_counter()
        c = big.clone()
        elapsed = time.perf_counter() - t0
        del c
        return elapsed

    def time_memfd_pack() -> float:  # information: the caller's copy of the argument into shared memory
        t0 = time.perf_counter()
        _, fds = payload.dumps(((big,), {}))
        elapsed = time.perf_counter() - t0
        payload.close_fds(fds)
        return elapsed

    def call_args(arg) -> float:
        t0 = time.perf_counter()
        values = ranch(4, read_arg, arg)
        elapsed = time.perf_counter() - t0
        want = expected if arg is big else read_arg(tiny)
        assert values == [want] * 4, values
        return elapsed

    def call_results(big_result: bool) -> float:
        t0 = time.perf_counter()
        values = ranch(4, make_result, big_result)
        elapsed = time.perf_counter() - t0
        for r in (1, 2, 3):
            v = values[r]
            if big_result:
                assert v.shape == (NUMEL,) and float(v[0]) == r and float(v[-1]) == r, (r, v)
            else:
                assert v == ((NUMEL,), float(r)), v
        del values
        gc.collect()
        return elapsed

    # Warm-up: one of each, so no side pays for first use.
    time_clone(), call_args(tiny), call_args(big), call_results(False), call_results(True)
    clones, packs, arg_tiny, arg_big, res_tiny, res_big = [], [], [], [], [], []
    for i in range(reps):
        clones.append(time_clone())
        packs.append(time_memfd_pack())
        first_big = i % 2 == 1
        for is_big in ((True, False) if first_big else (False, True)):
            (arg_big if is_big else arg_tiny).append(call_args(big if is_big else tiny))
        for is_big in ((True, False) if first_big else (False, True)):
            (res_big if is_big else res_tiny).append(call_results(is_big))
    clone = median(clones)
    print(f"clone of 256 MiB: median {fmt_s(clone)} (all {fmt_list(clones)})")
    print(f"caller packing 256 MiB into a memfd (payload.dumps): median {fmt_s(median(packs))} "
          f"(all {fmt_list(packs)})")
    print(f"args, 4 ranks: tiny {fmt_s(median(arg_tiny))} (all {fmt_list(arg_tiny)}), "
          f"256 MiB {fmt_s(median(arg_big))} (all {fmt_list(arg_big)})")
    print(f"results, ranks 1-3: tiny {fmt_s(median(res_tiny))} (all {fmt_list(res_tiny)}), "
          f"3 x 256 MiB {fmt_s(median(res_big))} (all {fmt_list(res_big)})")
    arg_cost = median(arg_big) - median(arg_tiny)
    res_cost = median(res_big) - median(res_tiny)
    print(f"argument cost {fmt_s(arg_cost)} = {arg_cost / clone:.2f}x clone; "
          f"result cost {fmt_s(res_cost)} = {res_cost / (3 * clone):.2f}x (3 x clone)", flush=True)
    results = [
        Result("3", "256 MiB argument to 4 ranks, extra cost / clone", arg_cost / clone, "x", "<= 2x",
               arg_cost / clone <= 2,
               f"{fmt_s(median(arg_big))} - {fmt_s(median(arg_tiny))} = {fmt_s(arg_cost)} vs clone "
               f"{fmt_s(clone)} (medians of {reps}); the caller's memfd copy alone: {fmt_s(median(packs))}",
               {"clone": clones, "pack": packs, "arg_tiny": arg_tiny, "arg_big": arg_big}),
        Result("3", "3 ranks return 256 MiB each, extra cost / 3 clones", res_cost / (3 * clone), "x", "<= 2x",
               res_cost / (3 * clone) <= 2,
               f"{fmt_s(median(res_big))} - {fmt_s(median(res_tiny))} = {fmt_s(res_cost)} vs 3 x clone "
               f"{fmt_s(3 * clone)} (medians of {reps})",
               {"res_tiny": res_tiny, "res_big": res_big}),
    ]
    return finish("big tensors (target 3)", results, args)


if __name__ == "__main__":
    sys.exit(main())
