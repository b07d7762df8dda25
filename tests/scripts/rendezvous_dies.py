"""A caller whose rank dies during the rendezvous, then makes one more DDP call.

    python rendezvous_dies.py [--then-ddp]

Rank 2 kills itself instead of joining the group while this process (rank 0) and
rank 1 wait for it inside init_process_group (C++). Prints the first call's error,
then, with --then-ddp, tries a second in_torchddp() call (with a timeout, so a hang
shows as one).
Run as a separate process: a caller left in a bad torch.distributed state must
not poison the test process. The start method comes from MPIFY_NB_START_METHOD.
"""

import sys
import time

import torch.distributed as dist

import helpers_ranks
import mpify_nb

started = time.monotonic()
try:
    mpify_nb.ranch(3, helpers_ranks.takes_payload, None, "/nonexistent",
                   ctx=helpers_ranks.DiesBeforeJoining(2))
    print("FIRST-CALL-RETURNED", flush=True)
except mpify_nb.RankError as e:
    print(f"FIRST-ERROR {type(e).__name__} rank={e.rank} signal={getattr(e, 'signal_name', None)} "
          f"seconds={time.monotonic() - started:.1f}", flush=True)
print("DIST-INITIALIZED", dist.is_initialized(), flush=True)
if "--then-ddp" not in sys.argv[1:]:
    raise SystemExit(0)
try:
    result = mpify_nb.ranch(2, helpers_ranks.all_reduce_rank_plus_one, ctx=mpify_nb.in_torchddp(), timeout=10)
    print("SECOND-CALL", result, flush=True)
except TimeoutError as e:
    print("SECOND-CALL-HUNG", e, flush=True)
