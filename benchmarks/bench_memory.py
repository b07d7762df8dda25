#!/usr/bin/env python
"""Target 5 of issue 3: memory over many calls.

This process (the caller, rank 0) makes 200 consecutive calls (50 with --quick)
``ranch(2, report, ctx=in_torchddp())``; ``report`` does one all_reduce and
returns the rank's own VmRSS and PSS (from /proc/self). Reported:

* the caller's VmRSS before the first call, after one warm-up call, every 25
  calls, and at the end (after ``gc.collect()``). Target: the 200 calls after
  the warm-up raise it by at most 20 MB (the rise from before the warm-up call,
  which includes the first use of gloo, is shown too and must also stay under
  20 MB to pass);
* the template's VmRSS (pid ``mpify_nb.template.get_template().pid``) before and after;
* each rank's VmRSS and PSS in the first and the last call (a forked rank shares
  the template's pages, so its RSS counts pages it does not own; PSS splits them);
* the caller's open file descriptors, threads and child processes, before and after
  (a leak of any of them shows here).

MB = 2**20 bytes. Run: ``.venv/bin/python benchmarks/bench_memory.py [--quick]``.
"""

from __future__ import annotations

import gc
import os
import sys

from _common import Result, count_fds, count_threads, finish, machine_line, parse_args, rss_mb


def report() -> dict:
    """One all_reduce, then this rank's memory: defined here, so it travels by value."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    out = {"rank": dist.get_rank(), "pid": os.getpid()}
    with open("/proc/self/status") as f:
        out["rss_mb"] = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    with open("/proc/self/smaps_rollup") as f:
        out["pss_mb"] = next(int(line.split()[1]) / 1024 for line in f if line.startswith("Pss:"))
    return out


def children() -> list[int]:
    """Pids whose parent is this process."""
    me = str(os.getpid())
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if ppid == me:
            found.append(int(pid))
    return found


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0])
    print(machine_line(), flush=True)
    import torch  # noqa: F401  (the caller of a DDP job has torch loaded)

    import mpify_nb
    from mpify_nb import in_torchddp, ranch

    calls = 50 if args.quick else 200
    template = mpify_nb.template.get_template()
    template.wait_ready()
    gc.collect()
    rss_start = rss_mb()
    template_start = rss_mb(template.pid)
    fds_start, threads_start, children_start = count_fds(), count_threads(), children()

    def call() -> list[dict]:
        values = ranch(2, report, ctx=in_torchddp())
        assert [v["rank"] for v in values] == [0, 1], values
        return values

    first = call()  # warm-up: first use of gloo and of the call machinery in this process
    gc.collect()
    rss_warm = rss_mb()
    samples = [(0, rss_start), (1, rss_warm)]
    last = first
    for i in range(1, calls + 1):
        last = call()
        if i % 25 == 0 or i == calls:
            gc.collect()
            samples.append((i + 1, rss_mb()))
    gc.collect()
    rss_end = rss_mb()
    # The template may have been replaced meanwhile by one that preloads what the calls
    # imported (issue 9, in the background): let that settle, then the current template
    # stands where the first one stood.
    mpify_nb.template.wait_preloaded(120)
    template_pid = mpify_nb.template.current_pid() or template.pid
    template_end = rss_mb(template_pid)
    fds_end, threads_end, children_end = count_fds(), count_threads(), children()
    children_end = [template.pid if pid == template_pid else pid for pid in children_end]

    print("caller VmRSS by number of calls made: "
          + ", ".join(f"{n}: {mb:.1f}" for n, mb in samples) + " MB")
    print(f"caller: {rss_start:.1f} MB before any call, {rss_warm:.1f} MB after the warm-up call, "
          f"{rss_end:.1f} MB after {calls} more: +{rss_end - rss_warm:.1f} MB over the {calls} calls, "
          f"+{rss_end - rss_start:.1f} MB in all")
    print(f"template (pid {template.pid}, pid {template_pid} at the end): VmRSS {template_start:.1f} MB "
          f"before, {template_end:.1f} MB after")
    for label, values in (("first call", first), (f"call {calls + 1}", last)):
        print(f"ranks, {label}: " + "; ".join(
            f"rank {v['rank']} (pid {v['pid']}): VmRSS {v['rss_mb']:.1f} MB, PSS {v['pss_mb']:.1f} MB"
            for v in values))
    print(f"caller fds {fds_start} -> {fds_end}, threads {threads_start} -> {threads_end}, "
          f"child processes {children_start} -> {children_end} (the template is pid {template.pid}; "
          f"a preloading one that replaced it is counted under that pid)", flush=True)

    growth, total = rss_end - rss_warm, rss_end - rss_start
    leaks = {"fds": fds_end - fds_start, "threads": threads_end - threads_start,
             "children": sorted(set(children_end) - set(children_start))}
    ranks_last = ", ".join(f"rank {v['rank']} RSS {v['rss_mb']:.0f} / PSS {v['pss_mb']:.0f} MB" for v in last)
    results = [
        Result("5", f"caller VmRSS rise over {calls} calls (after 1 warm-up)", growth, "MB", "<= 20 MB",
               growth <= 20 and total <= 20,
               f"{rss_warm:.1f} -> {rss_end:.1f} MB; from before the warm-up call: +{total:.1f} MB",
               {"samples": samples}),
        Result("5", "template VmRSS after the calls", template_end, "MB", "", None,
               f"{template_start:.1f} MB before"),
        Result("5", "rank 1 VmRSS / PSS, last call", last[1]["rss_mb"], "MB", "", None,
               f"{ranks_last} (first call: rank 1 RSS {first[1]['rss_mb']:.0f} / PSS {first[1]['pss_mb']:.0f} MB)"),
        Result("5", "caller fds + threads + children leaked", leaks["fds"] + leaks["threads"] + len(leaks["children"]),
               "", "0", leaks["fds"] <= 0 and leaks["threads"] <= 0 and not leaks["children"],
               f"fds {fds_start} -> {fds_end}, threads {threads_start} -> {threads_end}, "
               f"new child processes {leaks['children']}"),
    ]
    return finish("memory (target 5)", results, args)


if __name__ == "__main__":
    sys.exit(main())
