"""A caller process for the interrupt and caller-death tests: a stand-in for a kernel.

    python caller.py MODE RECORD_DIR

MODE ``sleep``: 3 ranks (this process is rank 0) record their pid and sleep 60 s.
MODE ``allreduce``: 2 ranks in a gloo group; rank 0 (this process) blocks in
all_reduce while rank 1 sleeps 60 s.

On KeyboardInterrupt it prints a marker, makes a second (successful) call and
exits 0. The start method comes from MPIFY_NB_START_METHOD.
"""

import signal
import sys
import time

import helpers_ranks
import mpify_nb
from mpify_nb.start import template

# A kernel runs its cells with this handler; a test run started with SIGINT ignored (nohup,
# some CI runners) passes that on to us, and mpify_nb keeps a process's SIG_IGN.
signal.signal(signal.SIGINT, signal.default_int_handler)
mode, directory = sys.argv[1], sys.argv[2]
if mpify_nb.get_start_method() == "template":
    client = template.get_template()
    client.wait_ready()
    print("TEMPLATE", client.pid, helpers_ranks.start_time(client.pid), flush=True)
try:
    if mode == "sleep":
        mpify_nb.ranch(3, helpers_ranks.sleep_and_record, directory, 60)
    elif mode == "allreduce":
        mpify_nb.ranch(2, helpers_ranks.ddp_sleep_on, 1, directory, 60, ctx=mpify_nb.in_torchddp())
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("FIRST-CALL-RETURNED", flush=True)
except KeyboardInterrupt:
    print("KEYBOARD-INTERRUPT", repr(time.time()), flush=True)
result = mpify_nb.ranch(2, helpers_ranks.rank_and_identity)
print("SECOND-CALL", [r for r, _ in result], flush=True)
