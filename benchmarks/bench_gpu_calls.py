#!/usr/bin/env python
"""Issue 36: the second call is warm, on CPU and on a GPU. Every route a user takes to run one
DDP training job (a 64-256-1 MLP, 20 steps, ``--nprocs`` ranks, one per GPU with ``--device cuda``
and NCCL, gloo on CPU), each measured in fresh processes:

* fresh: a new ``python`` per job (what torchrun or ``mp.spawn`` pay): import torch, join the
  group, train, leave; the process's wall time;
* spawned 1-3: a fresh notebook-like process (torch and mpify_nb imported, the template started),
  then ``ranch(n, train, caller_rank=None, ctx=in_torchddp())`` three times back to back;
* preloaded: the same call in that process once ``template.wait_preloaded()`` returned and the
  spare ranks are ready (a notebook between cells), median of ``--reps``;
* caller as rank 0: ``ranch(n, train, ctx=in_torchddp())`` after its first DDP, median;
* the caller's first DDP call: a fresh notebook-like process, as in a kernel once the import cell
  has finished (the warm-up of torchdist/warmup.py started, and waited for, as the user writes
  the next cell), then its first ``ranch(n, train, ctx=in_torchddp())`` with the caller as rank 0,
  against its later ones; also made at once after the imports (a script: information);
* a spawned no-op with ``in_torchddp()``, and a spawned call with one all_reduce, medians;
* the preloaded spawned call with spare ranks (``set_spare_ranks(n)``) against none, alternating
  (spare ranks are on by default on a GPU only).

Targets (issue 36): spawned calls 2-3 <= 1.2x preloaded; on a GPU the spawned call <= 1.3x the
caller-as-rank-0 call (information on CPU); the caller's first DDP call <= 1.5x its later ones.
On a GPU it also prints what a spare rank holds there (the device's used memory with spares
waiting, against none) and how long it took to get ready.

Run: ``.venv/bin/python benchmarks/bench_gpu_calls.py [--quick] [--device cuda] [--nprocs N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import BENCH_DIR, Result, finish, fmt_list, fmt_s, machine_line, median

SRC = os.path.join(os.path.dirname(BENCH_DIR), "src")


def train(steps: int = 20) -> float:
    """The job: DDP over a 64-256-1 MLP, ``steps`` SGD steps, on this rank's GPU (in_torchddp set it)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if on_gpu else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, 64, device=device), torch.randn(32, 1, device=device)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if on_gpu:
        torch.cuda.synchronize()
    return loss.item()


def noop() -> int:
    return 0


def all_reduce_once() -> float:
    import torch
    import torch.distributed as dist

    on_gpu = dist.get_backend() == "nccl"
    t = torch.ones(4, device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
    dist.all_reduce(t)
    return float(t[0])


# -- the routes, each in a fresh process ---------------------------------------------------------

def _timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def _wait_spares(count: int, timeout: float = 60.0) -> None:
    try:
        from mpify_nb.start import spares
    except ImportError:  # a tree from before issue 36
        return

    deadline = time.monotonic() + timeout
    while sum(s["ready"] for s in spares.pool.status()) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def _device_memory_mb() -> float:
    import torch

    used = getattr(torch.cuda, "device_memory_used", None)  # NVML: every process's use, no context made here
    if used is None:
        return float("nan")
    return sum(used(d) for d in range(torch.cuda.device_count())) / 2**20


def route_spawned(args) -> dict:
    import torch  # noqa: F401  (a notebook has torch imported)

    import mpify_nb
    from mpify_nb import in_torchddp, ranch, template

    n, reps, gpu = args.nprocs, args.reps, args.device == "cuda"
    template.get_template().wait_ready()
    template.wait_preloaded(600)
    out: dict = {"calls": [_timed(ranch, n, train, caller_rank=None, ctx=in_torchddp()) for _ in range(3)]}
    template.wait_preloaded(600)
    preloaded = []
    for _ in range(reps):
        template.wait_preloaded(600)
        if gpu:
            _wait_spares(n)
        preloaded.append(_timed(ranch, n, train, caller_rank=None, ctx=in_torchddp()))
    out["preloaded"] = preloaded
    if hasattr(mpify_nb, "set_spare_ranks"):  # a tree from before issue 36 has none
        from mpify_nb.start import spares

        if gpu:
            _wait_spares(n)
            out["spares"] = spares.pool.status()
            with_spares = _device_memory_mb()
            mpify_nb.set_spare_ranks(0)
            time.sleep(1.0)
            out["spare_memory_mb"] = (with_spares - _device_memory_mb()) / max(1, len(out["spares"]))
        # Do spares help (on CPU: they are off unless asked)? Alternating, with and without.
        out["with_spares"], out["without_spares"] = [], []
        for _ in range(reps):
            mpify_nb.set_spare_ranks(0)
            out["without_spares"].append(_timed(ranch, n, train, caller_rank=None, ctx=in_torchddp()))
            mpify_nb.set_spare_ranks(n)
            ranch(n, noop, caller_rank=None)  # the spares of its ranks start after it
            _wait_spares(n)
            out["with_spares"].append(_timed(ranch, n, train, caller_rank=None, ctx=in_torchddp()))
        mpify_nb.set_spare_ranks("auto")
    out["noop"] = [_timed(ranch, n, noop, caller_rank=None, ctx=in_torchddp()) for _ in range(reps)]
    out["all_reduce"] = [_timed(ranch, n, all_reduce_once, caller_rank=None, ctx=in_torchddp())
                         for _ in range(reps)]
    out["caller_first"] = _timed(ranch, n, train, ctx=in_torchddp())
    out["caller"] = [_timed(ranch, n, train, ctx=in_torchddp()) for _ in range(reps)]
    return out


def route_first_ddp(args) -> dict:
    import torch  # noqa: F401

    from mpify_nb import in_torchddp, ranch, template

    try:
        from mpify_nb.torchdist import warmup
    except ImportError:  # a tree from before issue 36
        warmup = None
    template.get_template().wait_ready()
    if not args.at_once:  # as a kernel does once the import cell has finished; the user's next cell comes after
        if warmup is not None:
            warmup.start(after=template.wait_started)
            warmup.wait(600)
        template.wait_preloaded(600)
    first = _timed(ranch, args.nprocs, train, ctx=in_torchddp())
    later = [_timed(ranch, args.nprocs, train, ctx=in_torchddp()) for _ in range(args.reps)]
    return {"first": first, "later": later, "warmup": warmup.outcome if warmup is not None else "none"}


def route_fresh_job(args) -> dict:
    """One job in this brand-new process: import torch, join the group, train, leave."""
    import torch
    import torch.distributed as dist

    gpu = args.device == "cuda"
    if gpu:
        torch.cuda.set_device(0)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("nccl" if gpu else "gloo")
    train()
    dist.destroy_process_group()
    return {}


ROUTES = {"spawned": route_spawned, "first_ddp": route_first_ddp, "fresh_job": route_fresh_job}


def _run(route: str, args, *extra: str) -> tuple[dict, float]:
    """Run ``route`` in a fresh interpreter; its report and the process's wall time."""
    with tempfile.TemporaryDirectory() as tmpdir:
        out = os.path.join(tmpdir, "out.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--route", route, "--out", out, "--device", args.device,
               "--nprocs", str(args.nprocs), "--reps", str(args.reps), *extra]
        # A tree named by PYTHONPATH comes first (two trees side by side), else this one's.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), SRC) if p))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"route {route} failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (noisier figures)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nprocs", type=int, default=1, help="ranks per job (one per GPU with --device cuda)")
    parser.add_argument("--route", choices=list(ROUTES), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--at-once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.route:
        report = ROUTES[args.route](args)
        with open(args.out, "w") as f:
            json.dump(report, f)
        return 0
    args.reps = args.reps or (3 if args.quick else 5)
    gpu = args.device == "cuda"
    print(f"{machine_line()} device={args.device} nprocs={args.nprocs} reps={args.reps}", flush=True)

    from _common import free_port

    rounds = 2 if args.quick else 3  # each route in that many fresh processes, sides alternating
    fresh: list[float] = []
    runs: list[dict] = []
    firsts: list[dict] = []
    at_once: list[dict] = []
    for i in range(rounds):
        fresh += [_run("fresh_job", args, "--port", str(free_port()))[1] for _ in range(2)]
        runs.append(_run("spawned", args)[0])
        firsts.append(_run("first_ddp", args)[0])
        at_once.append(_run("first_ddp", args, "--at-once")[0])
        print(f"round {i + 1}: fresh {fmt_list(fresh[-2:])}; spawned "
              f"{json.dumps({k: v for k, v in runs[-1].items() if k != 'spares'})}; caller's first DDP call "
              f"{json.dumps(firsts[-1])}; at once after the imports {json.dumps(at_once[-1])}", flush=True)

    def every(key: str) -> list[float]:
        return [x for run in runs for x in run[key]]

    calls = [median([run["calls"][k] for run in runs]) for k in range(3)]
    pre, caller = median(every("preloaded")), median(every("caller"))
    spawned_vs_caller = pre / caller
    first_vs_later = median([f["first"] / median(f["later"]) for f in firsts])
    results = [
        Result("36.0", "fresh python process per job", median(fresh), "s", detail=f"all {fmt_list(fresh)}"),
        Result("36.0", "ranch spawned, call 1", calls[0], "s",
               detail=f"a fresh notebook-like process; all {fmt_list([run['calls'][0] for run in runs])}"),
        Result("36.1", "ranch spawned, calls 2-3 back to back / preloaded", max(calls[1:]) / pre, "x", "<= 1.2x",
               max(calls[1:]) / pre <= 1.2, f"calls 1-3 (medians of {rounds} processes) {fmt_list(calls)} s; "
               f"preloaded {fmt_s(pre)} (all {fmt_list(every('preloaded'))})"),
        Result("36.2", "ranch spawned / caller as rank 0", spawned_vs_caller, "x", "<= 1.3x" if gpu else "",
               spawned_vs_caller <= 1.3 if gpu else None,
               f"spawned {fmt_s(pre)} vs caller as rank 0 {fmt_s(caller)} (all {fmt_list(every('caller'))})"
               + ("" if gpu else "; a target on a GPU only (spare ranks)")),
        Result("36.3", "the caller's first DDP call / its later ones", first_vs_later, "x", "<= 1.5x",
               first_vs_later <= 1.5, f"first {fmt_list([f['first'] for f in firsts])} vs later "
               f"{fmt_list([x for f in firsts for x in f['later']])} (warm-up: {firsts[0]['warmup']}); made at "
               f"once after the imports (a script, information): {fmt_list([f['first'] for f in at_once])} vs "
               f"{fmt_list([median(f['later']) for f in at_once])}"),
        Result("36.0", "spawned no-op with in_torchddp()", median(every("noop")), "s"),
        Result("36.0", "spawned call with one all_reduce", median(every("all_reduce")), "s"),
        Result("36.0", "caller as rank 0, its first DDP call in that process",
               median([r["caller_first"] for r in runs]), "s",
               detail="a script, after its spawned calls: no warm-up (no kernel), so it imports what DDP needs"),
    ]
    if gpu and runs[0].get("spares") is not None:
        prep = [s["report"].get("seconds", {}) for run in runs for s in run.get("spares", [])]
        results.append(Result("36.0", "GPU memory one spare rank holds", median([r["spare_memory_mb"] for r in runs]),
                              "MB", detail=f"getting ready took {prep}"))
    if "with_spares" in runs[0]:
        on, off = median(every("with_spares")), median(every("without_spares"))
        results.append(Result("36.0", f"{args.device}: spawned call with spare ranks / without", on / off, "x",
                              detail=f"{fmt_s(on)} vs {fmt_s(off)}, alternating"
                              + ("" if gpu else ": spare ranks are off on CPU unless set_spare_ranks(n) asks")))
    return finish(f"Issue 36: the second call is warm ({args.device})", results, args)


if __name__ == "__main__":
    sys.exit(main())
