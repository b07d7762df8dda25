"""The floor on a GPU (issue 31): what the CPU tests cannot show, NCCL on the oldest torch we support.

Run on a machine with CUDA GPUs, in a venv with the floor's torch (tests/scripts/floor_gpu.sh makes one)::

    PYTHONPATH=$PWD/src:$PWD/tests python tests/scripts/floor_gpu.py

Each check prints one line ``CHECK name: ok (details)`` or ``CHECK name: FAILED (why)``; the last
line is ``floor_gpu: N ok, M failed, K skipped on torch V, G GPUs``; the exit status is the number
failed. Checks that need 2 GPUs are skipped, and say so, on one.

1. ``nccl_loop``: 20 ``ranch`` calls with an NCCL group, each made and destroyed (torch < 2.8's
   destroy could deadlock with gloo; here NCCL's, through compat.destroy_process_group).
2. ``session_nccl``: a Session with NCCL runs an all_reduce on its GPUs, closes, nothing left.
3. ``absent_peer`` (2 GPUs): rank 0 alone in an all_reduce ends with CollectiveError, the
   communicators are aborted (torch < 2.6 has no ``_abort_process_group``: compat destroys the
   groups instead) and the group works again.
4. ``mismatch`` (2 GPUs): all_reduce against broadcast is told apart from NCCL's recorder
   (``_dump_nccl_trace``, which torch 2.4 has), and the group works again.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import torch

from mpify_nb import Session, in_torchddp, ranch
from mpify_nb.wire.errors import CollectiveError

results: dict[str, str] = {}
checks: list = []


def check(name: str, gpus_needed: int = 1):
    """Register a check, run in order by main()."""
    def register(fn):
        checks.append((name, gpus_needed, fn))
        return fn
    return register


def run_check(name: str, gpus_needed: int, fn) -> None:
    if torch.cuda.device_count() < gpus_needed:
        results[name] = "skipped"
        print(f"CHECK {name}: skipped (needs {gpus_needed} GPUs, {torch.cuda.device_count()} here)", flush=True)
        return
    started = time.monotonic()
    try:
        details = fn()
        results[name] = "ok"
        print(f"CHECK {name}: ok ({details}; {time.monotonic() - started:.1f} s)", flush=True)
    except Exception as e:  # every failure is reported, and the next check runs
        results[name] = "failed"
        print(f"CHECK {name}: FAILED ({type(e).__name__}: {e})", flush=True)
        traceback.print_exc()


def gpu_all_reduce() -> float:
    import torch.distributed as dist

    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    return t.item()


@check("nccl_loop")
def nccl_loop() -> str:
    n = min(2, torch.cuda.device_count())
    for i in range(20):
        values = ranch(n, gpu_all_reduce, ctx=in_torchddp(), timeout=120)
        assert values == [float(n)] * n, (i, values)
    return f"20 calls on {n} GPU(s)"


@check("session_nccl")
def session_nccl() -> str:
    n = min(2, torch.cuda.device_count())
    with Session(n, backend="nccl", timeout=120) as s:
        got = s.run("t = torch.ones(1, device='cuda') * (rank + 1)\ndist.all_reduce(t)\n"
                    "(t.item(), dist.get_backend(), torch.cuda.current_device())")
    assert [v[0] for v in got.values()] == [float(sum(range(1, n + 1)))] * n and \
        {v[1] for v in got.values()} == {"nccl"}, got
    return f"{got}"


@check("absent_peer", gpus_needed=2)
def absent_peer() -> str:
    with Session(2, backend="nccl", timeout=120) as s:
        s.run("t = torch.ones(1, device='cuda')\ndist.all_reduce(t)\ntorch.cuda.synchronize()")
        started = time.monotonic()
        try:
            s.run("t = torch.ones(1, device='cuda')\ndist.all_reduce(t)\ntorch.cuda.synchronize()", ranks=[0],
                  timeout=60)
        except CollectiveError as e:
            took = time.monotonic() - started
            text = str(e)
        else:
            raise AssertionError("rank 0 alone in an all_reduce returned")
        again = s.run("t = torch.ones(1, device='cuda')\ndist.all_reduce(t)\nt.item()")
        assert again == {0: 2.0, 1: 2.0}, again
    return f"CollectiveError after {took:.1f} s: {text[:200]!r}; the group works again"


@check("mismatch", gpus_needed=2)
def mismatch() -> str:
    with Session(2, backend="nccl", timeout=120) as s:
        started = time.monotonic()
        try:
            s.run("x = torch.ones(4, device='cuda')\nif rank == 0:\n    dist.all_reduce(x)\nelse:\n"
                  "    dist.broadcast(x, 0)\ntorch.cuda.synchronize()", timeout=60)
        except CollectiveError as e:
            took = time.monotonic() - started
            text = str(e)
        else:
            raise AssertionError("all_reduce against broadcast returned")
        assert "cannot match" in text, text
        again = s.run("t = torch.ones(1, device='cuda')\ndist.all_reduce(t)\nt.item()")
        assert again == {0: 2.0, 1: 2.0}, again
    return f"CollectiveError after {took:.1f} s: {text[:200]!r}; the group works again"


def main() -> int:
    signal.alarm(int(os.environ.get("FLOOR_GPU_LIMIT", "480")))  # nothing may hang: SIGALRM ends the run
    for name, gpus_needed, fn in checks:
        run_check(name, gpus_needed, fn)
    counts = {k: list(results.values()).count(k) for k in ("ok", "failed", "skipped")}
    print(f"floor_gpu: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped on torch "
          f"{torch.__version__}, {torch.cuda.device_count()} GPUs", flush=True)
    return counts["failed"]


if __name__ == "__main__":
    sys.exit(main())
