"""Through Ray Client (``ray://``, address in argv[1]): this process is outside the cluster.
A call that would make it a rank is refused with a clear error; with caller_rank=None a DDP
call and a Session work, their output labelled here; the one actor of ours (the hub that
carries the ranks' links, kept between calls) ends with the placement. Prints what it saw."""

import sys
import time

import ray
import torch

import mpify_nb
from mpify_nb import RankRaisedError, in_torchddp, ranch


def connect(address: str) -> None:
    """set_placement through Ray Client, tried three times when Ray's own per-client server did
    not start. Ray's proxy says "Initialization failure from server": "Starting Ray client server
    failed", or a psutil.ZombieProcess when the server it forked died at once (each seen in CI on
    a loaded machine, before anything of ours ran). A third failure fails the test, which then
    shows the end of Ray's client-server logs."""
    for attempt in (1, 2, 3):
        try:
            mpify_nb.set_placement("ray", address=address)
            return
        except ConnectionAbortedError as e:
            if attempt == 3 or "Initialization failure from server" not in str(e):
                raise
            print(f"Ray Client's server did not start; trying once more: {e}", file=sys.stderr, flush=True)


connect(sys.argv[1])
print("client", ray.util.client.ray.is_connected(), flush=True)


def reduce_ones():
    import torch.distributed as dist

    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"reduced {t.item()}", flush=True)
    return t.item()


try:
    ranch(2, reduce_ones, ctx=in_torchddp())
except ValueError as e:
    print("refused:", e, flush=True)
print("values", ranch(2, reduce_ones, ctx=in_torchddp(), caller_rank=None), flush=True)
big = torch.arange(3_000_000, dtype=torch.float64)
print("big", ranch(2, lambda t: float(t.sum()), big, caller_rank=None) == [float(big.sum())] * 2, flush=True)


def fails():
    raise KeyError("no such key on a cluster rank")


try:
    ranch(2, fails, caller_rank=None)
except RankRaisedError as e:
    print("raised", e.rank, type(e.__cause__).__name__, flush=True)
with mpify_nb.Session(2) as s:
    s.run("t = torch.ones(1) * (rank + 1)")
    print("session", s.run("dist.all_reduce(t)\nt.item()"), flush=True)
print("between calls", [a for a in ray.util.list_named_actors() if "mpify_nb-hub" in str(a)] != [], flush=True)
mpify_nb.set_placement("local")  # ends the actor that carried the links
time.sleep(1)
print("left", [a for a in ray.util.list_named_actors() if "mpify_nb" in str(a)], flush=True)
ray.shutdown()
