#!/usr/bin/env python
"""Record torch's flight recorder dumps into files, for tests/test_mismatch.py's unit tests.

The collective watch reads each rank's recorder (torchdist/recorder.py). Its tests read dumps
recorded by this script, so the parsing and the verdicts are checked on what torch really
writes, for gloo (recorded here, on CPU) and for NCCL (recorded on a GPU machine)::

    python tests/scripts/record_flight_recorder.py --backend gloo --out tests/data/flight_recorder
    python tests/scripts/record_flight_recorder.py --backend nccl --out tests/data/flight_recorder
    python tests/scripts/record_flight_recorder.py --backend nccl --ranks 2 --out ...   # 2 GPUs

Each scenario writes ``<backend>-<scenario>-rank<k>.pkl``: the pickled bytes that
``torch._C._distributed_c10d._dump_fr_trace`` (gloo) or ``_dump_nccl_trace`` (NCCL) returned
(``includeCollectives=True, includeStackTraces=False, onlyActive=False``), taken while the
scenario's last collective waits (a thread of the rank dumps, then the rank exits), and
``<backend>-<scenario>.json``: what the scenario did on each rank and what the verdict must be.

Scenarios:

* gloo, 2 ranks (CPU): ``mismatch`` (all_reduce vs broadcast), ``sizes`` (all_reduce of 2 and
  3 floats: rank 0 returns), ``subgroup`` (all_reduce vs broadcast on a new_group), ``healthy``.
* nccl, 1 rank (one GPU: a world of one): ``healthy`` (every collective kind, a subgroup, a
  send to itself), ``pending`` (an all_reduce held behind ``torch.cuda._sleep`` on the current
  stream, dumped before it ran: its state is "scheduled"), ``p2p`` (a batch_isend_irecv to
  itself, held the same way).
* nccl, 2 ranks (two GPUs): ``mismatch``, ``sizes``, ``recv_recv`` (both ranks receive from
  each other: NCCL records both recvs, pending), ``healthy``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
import threading
import time

SCENARIOS = {
    "gloo": {2: ["mismatch", "sizes", "subgroup", "healthy"]},
    "nccl": {1: ["healthy", "pending", "p2p"], 2: ["mismatch", "sizes", "recv_recv", "healthy"]},
}

#: What each scenario expects the verdict to be (engine/verdict.py's kind), for the tests.
EXPECTED = {"mismatch": "mismatch", "sizes": "wrong value", "subgroup": "mismatch", "recv_recv": "deadlock",
            "healthy": None, "pending": None, "p2p": None}


def _dump(backend: str) -> bytes:
    from torch._C import _distributed_c10d as c10d

    dump = c10d._dump_nccl_trace if backend == "nccl" else c10d._dump_fr_trace
    return dump(True, False, False)


def _write(out: str, backend: str, scenario: str, rank: int) -> None:
    with open(os.path.join(out, f"{backend}-{scenario}-rank{rank}.pkl"), "wb") as f:
        f.write(_dump(backend))


def _dump_later(out: str, backend: str, scenario: str, rank: int, after: float) -> None:
    """While the scenario's last collective waits: dump from a thread, then leave."""

    def later() -> None:
        time.sleep(after)
        _write(out, backend, scenario, rank)
        sys.stdout.flush()
        os._exit(0)

    threading.Thread(target=later, daemon=True).start()


def run_rank(rank: int, world: int, backend: str, scenario: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_FR_BUFFER_SIZE="64")
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            **({"device_id": device} if backend == "nccl" else {}))
    x = torch.ones(4, device=device)
    dist.all_reduce(x)  # #1 on every scenario: the group works
    if scenario == "healthy":
        dist.broadcast(x, 0)
        dist.all_gather_into_tensor(torch.empty(4 * world, device=device), x)
        dist.reduce_scatter_tensor(torch.empty(4, device=device), torch.ones(4 * world, device=device))
        dist.all_gather([torch.empty(4, device=device) for _ in range(world)], x)
        dist.reduce(x, 0)
        dist.barrier()
        dist.all_to_all_single(torch.empty(4 * world, device=device), torch.ones(4 * world, device=device))
        dist.all_reduce(x.double())
        sub = dist.new_group(list(range(world)))
        dist.all_reduce(x, group=sub)
        if world == 1 and backend == "nccl":  # a send to itself: one batch, so NCCL groups the two
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0),
                                                dist.P2POp(dist.irecv, torch.empty(4, device=device), 0)]):
                work.wait()
        if backend == "nccl":
            torch.cuda.synchronize()
        time.sleep(1.0)  # the watchdog retires what completed
        _write(out, backend, scenario, rank)
    elif scenario == "pending":
        torch.cuda._sleep(int(5e9))  # the current stream is busy for seconds: NCCL's stream waits for it
        dist.all_reduce(x)
        _write(out, backend, scenario, rank)
        torch.cuda.synchronize()
    elif scenario == "p2p":
        torch.cuda._sleep(int(5e9))
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0),
                                        dist.P2POp(dist.irecv, torch.empty(4, device=device), 0)])
        _write(out, backend, scenario, rank)
        for work in works:
            work.wait()
        torch.cuda.synchronize()
    elif scenario == "mismatch":
        _dump_later(out, backend, scenario, rank, 3.0)
        if rank == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, 0)
        if backend == "nccl":
            torch.cuda.synchronize()
    elif scenario == "sizes":
        _dump_later(out, backend, scenario, rank, 3.0)
        y = torch.ones(2 + rank, device=device)
        dist.all_reduce(y)
        if backend == "nccl":
            torch.cuda.synchronize()
        time.sleep(10)
    elif scenario == "subgroup":
        sub = dist.new_group(list(range(world)))
        _dump_later(out, backend, scenario, rank, 3.0)
        if rank == 0:
            dist.all_reduce(x, group=sub)
        else:
            dist.broadcast(x, 1, group=sub)
    elif scenario == "recv_recv":
        _dump_later(out, backend, scenario, rank, 3.0)
        dist.recv(torch.empty(4, device=device), 1 - rank)
        torch.cuda.synchronize()
    if scenario in ("mismatch", "sizes", "subgroup", "recv_recv"):
        time.sleep(30)  # a scenario that waits: the dumping thread ends the process
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--ranks", type=int, default=None, help="1 or 2 (default: 2 for gloo, 1 for nccl)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", help="scenarios to record (default: all for the world size)")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    world = args.ranks or (2 if args.backend == "gloo" else 1)
    scenarios = SCENARIOS[args.backend].get(world)
    if scenarios is None:
        parser.error(f"{args.backend} scenarios are for {sorted(SCENARIOS[args.backend])} ranks")
    if args.backend == "nccl" and torch.cuda.device_count() < world:
        parser.error(f"{world} NCCL ranks need {world} GPUs; torch sees {torch.cuda.device_count()}")
    os.makedirs(args.out, exist_ok=True)
    versions = {"torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None}
    for scenario in args.only or scenarios:
        started = time.monotonic()
        ctx = mp.start_processes(run_rank, args=(world, args.backend, scenario, _free_port(), args.out),
                                 nprocs=world, join=False, start_method="spawn")
        while not ctx.join(timeout=60):
            if time.monotonic() - started > 120:
                for p in ctx.processes:
                    p.kill()
                print(f"{scenario}: did not finish within 120 s", file=sys.stderr)
                return 1
        with open(os.path.join(args.out, f"{args.backend}-{scenario}.json"), "w") as f:
            json.dump({"scenario": scenario, "backend": args.backend, "world": world,
                       "verdict": EXPECTED[scenario], **versions}, f, indent=1)
        names = [f"{args.backend}-{scenario}-rank{r}.pkl" for r in range(world)]
        for name in names:
            entries = pickle.loads(open(os.path.join(args.out, name), "rb").read()).get("entries", [])
            print(f"{name}: {len(entries)} entries, " +
                  ", ".join(f"{e['profiling_name']}#{e['collective_seq_id']}"
                            f"{'' if e['retired'] else ' (pending)'}" for e in entries[-6:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
