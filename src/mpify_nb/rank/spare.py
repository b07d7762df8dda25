"""A spare rank: forked from the template before a call, made ready for the GPU its rank will
use, then waiting to become one call's rank (the caller's pool of them: start/spares.py)::

    pool (caller)                                 spare (forked from the template)
      ── PREPARE {env, device} ─────────────────>  the rank's environment; on a GPU: its device
                                                   set, its CUDA context made, NCCL's and cuBLAS's
                                                   libraries loaded (then every cache emptied)
      <── PREPARED {cuda, seconds, error} ───────
      ── ADOPT + fds [channel, stdout, stderr] ──> from now on a rank like any other:
                                                   rank.loop.main(channel)
      (its pool end closes before ADOPT) ────────> exit

It runs no user code before ADOPT: what it does is the library's own start-up, the same in
every rank that uses a GPU. Its stdout and stderr go nowhere until it is adopted. It dies with
its template (PDEATHSIG), and so with the notebook, whose death ends the template.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
from typing import Any, NoReturn, Optional

from ..wire import framing
from . import process

PREPARE, PREPARED, ADOPT = "prepare", "prepared", "adopt"


def main(pool_fd: int, parent: int) -> NoReturn:
    """Run a spare from its birth to its adoption (then it is a rank: rank.loop.main)."""
    process.die_with_parent(parent)
    process.set_process_name("mpify_nb-spare")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    pool = socket.socket(fileno=pool_fd)
    message = framing.recv(pool)
    if message is None:
        os._exit(0)
    _kind, spec = pickle.loads(message[0])
    report = prepare(spec)
    try:
        framing.send(pool, pickle.dumps((PREPARED, report)))
    except OSError:
        os._exit(0)
    message = framing.recv(pool)  # until a call takes it, or the pool lets it go
    if message is None or len(message[1]) != 3:
        os._exit(0)
    channel, out, err = message[1]
    pool.close()
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    from .loop import main as rank_main

    rank_main(channel, parent)
    os._exit(1)  # not reached


def prepare(spec: dict) -> dict[str, Any]:
    """Apply the rank's environment; on a GPU, make its CUDA context and load the libraries
    its first steps load. Returns what was done, and how long each step took."""
    os.environ.clear()
    os.environ.update(spec["env"])  # before CUDA starts: CUDA_VISIBLE_DEVICES, NCCL_*...
    device: Optional[int] = spec.get("device")
    report: dict[str, Any] = {"cuda": False, "device": device, "seconds": {}, "error": ""}
    if device is None:
        return report
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    steps = (("context", _context), ("nccl", _nccl), ("cublas", _cublas))
    for name, step in steps:
        t0 = time.perf_counter()
        try:
            step(torch, device)
        except Exception as e:
            report["error"] = f"{name}: {type(e).__name__}: {e}"[:300]
            return report
        report["seconds"][name] = time.perf_counter() - t0
    report["cuda"] = True
    return report


def _context(torch: Any, device: int) -> None:
    torch.cuda.set_device(device)
    torch.cuda.synchronize(device)  # the primary context exists now (no memory allocated)


def _nccl(torch: Any, device: int) -> None:
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        torch.cuda.nccl.version()  # its library loaded and bound; a communicator is each call's own


def _cublas(torch: Any, device: int) -> None:
    torch.cuda.current_blas_handle()  # cuBLAS loaded and its handle made, as a first matmul would
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()  # the workspace it took goes back: the rank starts with nothing allocated
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.reset_accumulated_memory_stats(device)
