#!/usr/bin/env python
"""Issue 10: ranks on a Ray cluster, side by side with Ray Train, on a 3-node local cluster.

The cluster is started here with ``ray.cluster_utils.Cluster`` (and shut down by it, by
pid): a head with no CPUs (the caller's node, 127.0.0.4) and two worker nodes of 2 CPUs
(127.0.0.2, 127.0.0.3), all on this machine.

* warm call: ``ranch(3, fn, ctx=in_torchddp())``, the caller plus 2 ranks on the two worker
  nodes, one ``all_reduce`` (target <= 1 s), against Ray Train's
  ``TorchTrainer(fn, scaling_config=ScalingConfig(num_workers=3)).fit()`` with the same
  function body (target: >= 5x faster). Needs ``pip install "ray[train]"`` for the comparison;
  without it that figure is skipped.
* persistent ranks: ``Session(2)`` start, a trivial ``run`` and one ``all_reduce`` (for
  information).
* a 256 MB tensor to 2 ranks on one node (``strategy="STRICT_PACK"``), the caller playing no
  rank, against one local copy of it (``clone()``) (target <= 2x). Every node of this cluster
  is this machine, so the ranks map the caller's memfds (the path for ranks on the caller's
  machine). Then the same call as from another host (``ray_ranks.placer.LEND_MEMFDS = False``): one
  object put, fetched once to the node, mapped in place by both ranks; beside it Ray's own
  floor for that path, a ``ray.put`` and one fetch to the node (for information).

Run: ``.venv/bin/python benchmarks/bench_ray.py [--quick]``.
"""

from __future__ import annotations

import os
import time

from _common import Result, finish, fmt_list, fmt_s, machine_line, median, parse_args


def allreduce_fn(config=None):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    return t.sum().item()


def _session_figures(mpify_nb, reps: int, results: list[Result]) -> None:
    """Persistent ranks on the cluster (for information: the issue sets no target for them)."""
    starts, trivial, reduces = [], [], []
    for _ in range(max(2, reps // 2)):
        t0 = time.perf_counter()
        s = mpify_nb.Session(2)
        starts.append(time.perf_counter() - t0)
        try:
            for _ in range(reps * 4):
                t0 = time.perf_counter()
                s.run("1")
                trivial.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert s.run("t = torch.ones(4)\ndist.all_reduce(t)\nt.sum().item()") == {0: 8.0, 1: 8.0}
                reduces.append(time.perf_counter() - t0)
        finally:
            s.close()
    print(f"Session(2) on Ray: start {fmt_list(starts)}; run('1') {fmt_s(median(trivial))}; "
          f"run(all_reduce) {fmt_s(median(reduces))}", flush=True)
    results.append(Result("10.4", "Session(2) on Ray: start, ranks on the two worker nodes", median(starts), "s",
                          detail=fmt_list(starts)))
    results.append(Result("10.5", "Session(2) on Ray: run('1'), caller -> both nodes -> caller", median(trivial),
                          "s"))
    results.append(Result("10.6", "Session(2) on Ray: run(all_reduce of 4 floats)", median(reduces), "s"))


def _object_store_figures(ray, ranch, big, touch, clone_s: float, reps: int, results: list[Result]) -> None:
    """The 256 MB call as from another host, and Ray's floor for it (put + one fetch to a node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from mpify_nb.start.ray_ranks import placer

    @ray.remote(num_cpus=0)
    def fetch(objects):
        return len(ray.get(objects[0]))

    workers = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    placer.LEND_MEMFDS = False
    try:
        # STRICT_PACK picks either node, and a node's first calls start workers (import torch, 2-3 s).
        warm: list[float] = []
        while len(warm) < 15 and not (len(warm) >= 5 and max(warm[-5:]) < 1.0):
            t0 = time.perf_counter()
            ranch(2, touch, big, caller_rank=None)
            warm.append(time.perf_counter() - t0)
        calls = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert ranch(2, touch, big, caller_rank=None) == [float(big[-1])] * 2
            calls.append(time.perf_counter() - t0)
    finally:
        placer.LEND_MEMFDS = True
    # Measured after the calls, so that its own workers (a first task on each node starts one)
    # do not compete with the ranks' warm ones; the first round on each node is not counted.
    floors = []
    for i in range(reps + len(workers)):
        t0 = time.perf_counter()
        ref = ray.put(big.numpy())
        on = NodeAffinitySchedulingStrategy(workers[i % len(workers)], soft=False)
        assert ray.get(fetch.options(scheduling_strategy=on).remote([ref])) == big.numel()
        if i >= len(workers):
            floors.append(time.perf_counter() - t0)
        del ref
    print(f"256 MB through the object store: warm-up {fmt_list(warm)}; calls {fmt_list(calls)}; "
          f"Ray's put + fetch to a node: {fmt_list(floors)}", flush=True)
    ratio = median(calls) / clone_s
    results.append(Result("10.3b", "256 MB to 2 ranks on one node through the object store (as from another "
                          "host) / one local clone()", ratio, "x",
                          detail=f"call {fmt_s(median(calls))}; Ray's own put + one fetch to the node "
                                 f"{fmt_s(median(floors))} = {median(floors) / clone_s:.1f}x"))


def main() -> int:
    args = parse_args(__doc__.splitlines()[1])
    import ray
    import torch
    from ray.cluster_utils import Cluster

    import mpify_nb
    from mpify_nb import in_torchddp, ranch

    print(machine_line())
    reps = 5 if args.quick else 10
    results: list[Result] = []
    t0 = time.perf_counter()
    store = 1 << 30  # cluster_utils gives a node 150 MB of object store by default: less than one 256 MB tensor
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.4", "include_dashboard": False,
                                      "object_store_memory": store})
    for address in ("127.0.0.2", "127.0.0.3"):
        cluster.add_node(num_cpus=2, node_ip_address=address, object_store_memory=store)
    print(f"cluster up in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        mpify_nb.set_placement("ray", address=cluster.address)
        t0 = time.perf_counter()
        ranch(3, allreduce_fn, ctx=in_torchddp())
        print(f"first call (workers start, import torch): {time.perf_counter() - t0:.1f} s", flush=True)
        ranch(3, allreduce_fn, ctx=in_torchddp())
        ours = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert ranch(3, allreduce_fn, ctx=in_torchddp()) == [12.0] * 3
            ours.append(time.perf_counter() - t0)
        print(f"ranch on Ray, DDP + all_reduce: {fmt_list(ours)}", flush=True)
        ours_median = median(ours)
        results.append(Result("10.1", "warm ranch(3) on Ray: DDP + all_reduce, caller + 2 nodes", ours_median, "s",
                              "<= 1 s", ours_median <= 1.0, fmt_list(ours)))

        try:
            if os.environ.get("BENCH_RAY_TRAIN", "1") == "0":
                raise ImportError
            from ray.train import ScalingConfig
            from ray.train.torch import TorchTrainer
        except ImportError:
            print("Ray Train not installed (pip install 'ray[train]'): comparison skipped", flush=True)
        else:
            theirs = []
            storage = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mpify_nb-bench-ray-{os.getpid()}")
            for i in range(max(2, reps // 2)):
                trainer = TorchTrainer(allreduce_fn, scaling_config=ScalingConfig(num_workers=3),
                                       run_config=ray.train.RunConfig(storage_path=storage, name=f"run{i}"))
                t0 = time.perf_counter()
                trainer.fit()
                theirs.append(time.perf_counter() - t0)
            print(f"TorchTrainer.fit(): {fmt_list(theirs)}", flush=True)
            ratio = median(theirs) / ours_median
            results.append(Result("10.2", "TorchTrainer.fit() / warm ranch on Ray (same function, same cluster)",
                                  ratio, "x", ">= 5x", ratio >= 5,
                                  f"TorchTrainer {fmt_s(median(theirs))} vs ranch {fmt_s(ours_median)}"))

        _session_figures(mpify_nb, reps, results)

        mpify_nb.set_placement("ray", address=cluster.address, strategy="STRICT_PACK")
        big = torch.randn(256 * 1024 * 1024 // 4)

        def touch(t):
            return float(t[-1])

        # Warm: two workers with torch imported on the node the call lands on; STRICT_PACK may pick
        # either node, and the first call on a node starts its workers (10-15 s each time).
        warm = []
        for _ in range(10):
            t0 = time.perf_counter()
            ranch(2, touch, big, caller_rank=None)
            warm.append(time.perf_counter() - t0)
            if len(warm) >= 3 and max(warm[-3:]) < 2.0:  # STRICT_PACK picks either node: both warm
                break
        print(f"256 MB warm-up calls: {fmt_list(warm)}", flush=True)
        copies, sends = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            big.clone()
            copies.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert ranch(2, touch, big, caller_rank=None) == [float(big[-1])] * 2
            sends.append(time.perf_counter() - t0)
        ratio = median(sends) / median(copies)
        print(f"256 MB to 2 ranks on one node: {fmt_list(sends)}; clone(): {fmt_list(copies)}", flush=True)
        results.append(Result("10.3", "256 MB tensor to 2 Ray ranks on one node / one local clone()", ratio, "x",
                              "<= 2x", ratio <= 2, f"call {fmt_s(median(sends))} vs clone {fmt_s(median(copies))}"))
        _object_store_figures(ray, ranch, big, touch, median(copies), reps, results)
    finally:
        mpify_nb.set_placement("local")
        ray.shutdown()
        cluster.shutdown()
    return finish("Issue 10: ranks on a Ray cluster", results, args)


if __name__ == "__main__":
    raise SystemExit(main())
