#!/usr/bin/env python
"""Issue 20's speed targets: a rank's read of stdin, through a real kernel, to the frontend and back.

This script is the frontend: it speaks the Jupyter protocol with jupyter_client to a kernel
(this interpreter) that runs ``%dist_init -n 2``, then a cell on rank 1 that reads a line
``N`` times (``input()``), stamping ``time.monotonic()`` (one clock for every process of
the machine) just before each read and just after it returns. Figures (medians):

1. read to ``input_request``: from the rank's stamp before ``input()`` to the moment the
   input_request reaches this frontend (target <= 20 ms);
2. answer to the rank: from sending the ``input_reply`` to the rank's stamp after
   ``input()`` returned (target <= 20 ms);
3. the same two for a read of fd 0 itself (``open("/dev/stdin")``, as
   ``torch.distributed.breakpoint`` does), for information: after a prompt (pdb's ``(Pdb) ``, a
   partial line on stdout), such a read is looked for at once; without one, at the caller's next
   look at the rank (half a second into the cell, then once a second): nothing polls.

For comparison, ipykernel's own ``input()`` in the kernel (no rank) is measured the same way.

Run: ``.venv/bin/python benchmarks/bench_debugging.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import os
import queue
import re
import sys
import tempfile
import time
import uuid

from _common import Result, finish, fmt_list, machine_line, median, parse_args

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import nbutil  # noqa: E402  (the tests' kernelspec: this interpreter)

STAMP = re.compile(r"(?:\[rank 1\] )?([TR]) (\d+) ([0-9.]+)")


def start_kernel():
    """A kernel of this interpreter (the tests' private kernelspec), tagged for cleanup."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    marker = uuid.uuid4().hex
    km = KernelManager(kernel_name=nbutil.KERNEL_NAME,
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[nbutil.kernel_dir()]))
    km.start_kernel(cwd=tempfile.gettempdir(),
                    env=dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1", **{nbutil.MARKER_VAR: marker}))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc, marker


def stop_kernel(km, kc, marker: str) -> None:
    """End start_kernel()'s kernel, then whatever it left behind (by pid)."""
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    killed = nbutil.kill_leftovers(marker)
    if killed:
        print(f"    (ended {len(killed)} process(es) the kernel left, by pid)")


def run(kc, code: str, answer: str) -> tuple[str, list[float], list[float]]:
    """Execute ``code``, answering every input request with ``answer``; return the stdout,
    when each request arrived and when each answer was sent."""
    msg_id = kc.execute(code, allow_stdin=True)
    out, asked, answered = "", [], []
    done = False
    while not done:
        try:
            msg = kc.stdin_channel.get_msg(timeout=0.001)
            asked.append(time.monotonic())
            if msg["msg_type"] == "input_request":
                answered.append(time.monotonic())
                kc.input(answer)
        except queue.Empty:
            pass
        while True:
            try:
                msg = kc.iopub_channel.get_msg(timeout=0.001)
            except queue.Empty:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out += msg["content"]["text"]
            elif msg["msg_type"] == "error":
                raise RuntimeError("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                done = True
    return out, asked, answered


def figures(out: str, asked: list[float], answered: list[float]) -> tuple[list[float], list[float]]:
    stamps: dict[tuple[str, int], float] = {}
    for kind, i, t in STAMP.findall(out):
        stamps[(kind, int(i))] = float(t)
    to_request = [asked[i] - stamps[("T", i)] for i in range(len(asked)) if ("T", i) in stamps]
    to_rank = [stamps[("R", i)] - answered[i] for i in range(len(answered)) if ("R", i) in stamps]
    return to_request, to_rank


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    n = 10 if args.quick else 40
    print(machine_line())
    km, kc, marker = start_kernel()
    results: list[Result] = []
    try:
        loop = (f"import time\nfor i in range({n}):\n    print('T', i, time.monotonic(), flush=True)\n"
                "    input('? ')\n    print('R', i, time.monotonic(), flush=True)\n")
        local = figures(*run(kc, loop, "x"))
        run(kc, "%load_ext mpify_nb", "")
        run(kc, "%dist_init -n 2", "")
        run(kc, "%%rank [1]\n" + loop, "x")  # warm-up
        to_request, to_rank = figures(*run(kc, "%%rank [1]\n" + loop, "x"))
        raw_loop = loop.replace("input('? ')", "raw.readline()").replace(
            "import time\n", "import time\nraw = open('/dev/stdin')\n")
        raw_request, raw_rank = figures(*run(kc, "%%rank [1]\n" + raw_loop, "x"))
        prompt_loop = raw_loop.replace("raw.readline()", "print('(Pdb) ', end='', flush=True)\n    raw.readline()")
        prompt_request, prompt_rank = figures(*run(kc, "%%rank [1]\n" + prompt_loop, "x"))
        results += [
            Result("20.1", "rank's read to input_request at the frontend", median(to_request) * 1000, "ms",
                   "<= 20 ms", median(to_request) <= 0.020, fmt_list(to_request)),
            Result("20.2", "answer to the rank's next line", median(to_rank) * 1000, "ms", "<= 20 ms",
                   median(to_rank) <= 0.020, fmt_list(to_rank)),
            Result("20", "kernel's own input(): read to input_request", median(local[0]) * 1000, "ms"),
            Result("20", "kernel's own input(): answer to the next line", median(local[1]) * 1000, "ms"),
            Result("20", "read of fd 0 itself after a prompt (pdb on /dev/stdin) to input_request",
                   median(prompt_request) * 1000, "ms", detail="looked for after the partial line: "
                   + fmt_list(prompt_request)),
            Result("20", "read of fd 0 itself after a prompt: answer to the rank's next line",
                   median(prompt_rank) * 1000, "ms"),
            Result("20", "read of fd 0 itself, no prompt before it, to input_request", median(raw_request) * 1000,
                   "ms", detail="seen at the caller's next look: " + fmt_list(raw_request)),
            Result("20", "read of fd 0 itself, no prompt: answer to the rank's next line",
                   median(raw_rank) * 1000, "ms"),
        ]
        run(kc, "%dist_shutdown", "")
    finally:
        stop_kernel(km, kc, marker)
    return finish("debugging a rank: stdin through the frontend (issue 20)", results, args)


if __name__ == "__main__":
    sys.exit(main())
