"""Rank functions and baseline launchers that must live in an importable module.

``torch.multiprocessing.spawn`` pickles its function by reference, so a function
defined in ``__main__`` (a notebook, a ``python -c``) cannot be started by it:
the baselines' rank functions are here. ``train_steps`` is also what the
mpify_nb side of the throughput benchmark runs, so both sides run the very same loop.

This module does not import mpify_nb: the baselines must not start a template.

Entry points for the helper subprocesses (``python -c "import _workers; _workers.X()"``):

* ``fork_floor_serve``: the fork floor of target 1, one repetition per line on stdin.
* ``tmp_fork_train_main``: the torch.multiprocessing (fork) side of target 4, one run.
* ``tmp_fork_train_serve``: the same, a fresh job per line on stdin (target 4's many short runs).
* ``tmp_thread_pairs_main``: issue 37's control: rank 0's loop on its main thread vs on a
  ``threading.Thread``, in a plain torch.multiprocessing job.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- target 1 and 2: one all_reduce ---------------------------------------------------------

def allreduce_once() -> float:
    """The work of every launch benchmark: one all_reduce in an already initialized group."""
    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t[0])


def spawn_allreduce(index: int, world: int, port: int) -> None:
    """Rank ``index`` under torch.multiprocessing.spawn: join a gloo group, all_reduce once, leave."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    try:
        total = allreduce_once()
        if total != world:
            raise RuntimeError(f"all_reduce gave {total}, expected {world}")
    finally:
        dist.destroy_process_group()


def fork_floor_once(n: int) -> float:
    """One launch at the fork floor: this process (torch already imported) plays rank 0 and
    forks ranks 1..n-1; each joins a gloo group, all_reduces once and exits. Returns the
    seconds from the first fork until every child is reaped (store setup included)."""
    port = _free_port()
    t0 = time.perf_counter()
    # Fork first, then start the store: the TCPStore server runs a thread, and a fork taken
    # while it serves an earlier child can copy a held lock into the new child (seen: a
    # child deadlocked in a futex). The children wait on a pipe until the store is up, as a
    # client that finds no server backs off ~0.7 s.
    go_r, go_w = os.pipe()
    pids = []
    for r in range(1, n):
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                os.close(go_w)
                os.read(go_r, 1)
                client = dist.TCPStore("127.0.0.1", port, n, is_master=False)
                dist.init_process_group("gloo", store=client, rank=r, world_size=n)
                code = 0 if allreduce_once() == n else 3
                dist.destroy_process_group()
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(go_r)
    store = dist.TCPStore("127.0.0.1", port, n, is_master=True, wait_for_workers=False)
    os.write(go_w, b"g" * (n - 1))
    os.close(go_w)
    dist.init_process_group("gloo", store=store, rank=0, world_size=n)
    total = allreduce_once()
    dist.destroy_process_group()
    bad = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            bad.append((pid, os.waitstatus_to_exitcode(status)))
    elapsed = time.perf_counter() - t0
    del store
    if bad or total != n:
        raise RuntimeError(f"fork floor failed: children {bad}, all_reduce {total}")
    return elapsed


def fork_floor_serve() -> None:
    """Serve fork-floor repetitions: read a world size per stdin line, answer its time in seconds.
    A separate, clean process (torch imported, nothing else, no threads of ours), so the floor
    is not disturbed by the benchmark's own state, and can be interleaved with ranch calls."""
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            break
        out.write(f"{fork_floor_once(int(line))!r}\n")
        out.flush()


# -- target 4: the training loop --------------------------------------------------------------

def train_steps(n_steps: int, warmup: int = 20) -> dict:
    """A CPU DDP training loop on a small MLP, in an already initialized gloo group.

    One intra-op thread per rank (2 ranks on 2 cores must not oversubscribe).
    Returns this rank's steps per second over ``n_steps`` steps, timed inside the
    rank after ``warmup`` steps and a barrier: launch costs are excluded.
    """
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256)
    y = torch.randint(0, 10, (64,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    dist.barrier()
    threads0 = _thread_cpu()
    c0, t0, own0 = time.process_time(), time.perf_counter(), time.thread_time()
    for _ in range(n_steps):
        step()
    elapsed = time.perf_counter() - t0
    # CPU time of the whole process (every thread: gloo's, and in a ranch caller the watch and
    # relay threads): less sensitive to other load on the machine than wall time.
    cpu = time.process_time() - c0
    # CPU time of the thread that runs the loop alone: what a step costs it, waits excluded.
    own = time.thread_time() - own0
    threads1 = _thread_cpu()
    # CPU of the threads that are neither the loop's (the main thread, or the caller's background
    # work thread) nor torch/gloo's own: in a ranch rank, mpify_nb's watch, relay and watchdog
    # threads. A tax while running would show here.
    loop_tid = str(threading.get_native_id())
    other = sum(cpu_s - threads0.get(key, (name, 0.0))[1] for key, (name, cpu_s) in threads1.items()
                if key != loop_tid and not name.startswith(("gloo", "pt_")))
    return {"rank": dist.get_rank(), "steps": n_steps, "seconds": elapsed, "steps_per_s": n_steps / elapsed,
            "cpu_seconds": cpu, "steps_per_cpu_s": n_steps / cpu, "other_threads_cpu": other,
            "loop_thread_cpu": own, "steps_per_loop_cpu_s": n_steps / own if own > 0 else float("inf"),
            "on_main_thread": threading.current_thread() is threading.main_thread(),
            "threads": torch.get_num_threads()}


def _thread_cpu() -> dict[str, tuple[str, float]]:
    """CPU seconds (user + system) of each thread of this process: tid -> (name, seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _tmp_train_entry(index: int, world: int, port: int, n_steps: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    try:
        result = train_steps(n_steps)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{index}.json"), "w") as f:
        json.dump(result, f)


def tmp_fork_train_main() -> None:
    """The baseline of target 4, run as its own process (torch already imported here):
    torch.multiprocessing with start method fork runs ``train_steps`` on 2 ranks.
    argv: n_steps outdir. Each rank writes rank<i>.json into outdir."""
    import torch.multiprocessing as tmp

    n_steps, outdir = int(sys.argv[1]), sys.argv[2]
    world = 2
    tmp.start_processes(_tmp_train_entry, args=(world, _free_port(), n_steps, outdir), nprocs=world,
                        join=True, start_method="fork")


def tmp_fork_train_serve() -> None:
    """The baseline of target 4 as a server: this process imports torch once, then for each
    number of steps read from stdin starts a fresh torch.multiprocessing job (start method fork,
    2 ranks, a new port) that runs ``train_steps`` and ends, and answers one JSON line: the
    ranks' reports. Each run's ranks are new forks of this torch-loaded process, as in
    ``tmp_fork_train_main``; what a run no longer pays is this process's own start (python and
    torch's import) nor, in each rank, DDP's first import of ``torch._dynamo``: 2-10 s on a
    loaded 2-core machine, outside the timed steps either way, so that many short runs stay
    cheap (as a ranch call's ranks, forked from a template that holds what earlier ones imported)."""
    import tempfile

    import torch._dynamo  # noqa: F401  what DDP's constructor imports (2-5 s): each run's forks inherit it
    import torch.multiprocessing as tmp
    import torch.nn.parallel  # noqa: F401

    world = 2
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        with tempfile.TemporaryDirectory() as outdir:
            tmp.start_processes(_tmp_train_entry, args=(world, _free_port(), int(line), outdir), nprocs=world,
                                join=True, start_method="fork")
            reports = []
            for r in range(world):
                with open(os.path.join(outdir, f"rank{r}.json")) as f:
                    reports.append(json.load(f))
        out.write(json.dumps(reports) + "\n")
        out.flush()


def _on_a_thread(fn, *args):
    """``fn(*args)`` on a new thread, this one blocked in join() meanwhile (as a notebook's main
    thread waits in a BackgroundWork's result())."""
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("value", fn(*args)))
    worker.start()
    worker.join()
    return box["value"]


def _tmp_thread_pairs_entry(index: int, world: int, port: int, n_steps: int, pairs: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    runs = []
    try:
        for i in range(pairs):
            got = {}
            for where in (("main", "thread") if i % 2 == 0 else ("thread", "main")):
                if where == "thread" and index == 0:
                    got[where] = _on_a_thread(train_steps, n_steps)
                else:
                    got[where] = train_steps(n_steps)
            runs.append(got)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{index}.json"), "w") as f:
        json.dump(runs, f)


def tmp_thread_pairs_main() -> None:
    """Issue 37's control, without mpify_nb: what running a rank's loop on a thread other than
    the main one costs in torch itself. torch.multiprocessing (fork), 2 ranks; in each pair rank 0
    runs ``train_steps`` once on its main thread and once on a ``threading.Thread`` (alternating
    which goes first), rank 1 always on its main thread. argv: n_steps pairs outdir. Each rank
    writes rank<i>.json: a list, per pair, of {"main": report, "thread": report}."""
    import torch.multiprocessing as tmp

    n_steps, pairs, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    world = 2
    tmp.start_processes(_tmp_thread_pairs_entry, args=(world, _free_port(), n_steps, pairs, outdir),
                        nprocs=world, join=True, start_method="fork")
