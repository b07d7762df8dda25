"""A plain script that calls ranch at top level, without ``if __name__ == "__main__":``.

Its top level must run once, in the caller only: ranks get the function, not a
re-run of this file. The start method comes from MPIFY_NB_START_METHOD.
"""

import os

import mpify_nb

print(f"TOP-LEVEL-RAN pid={os.getpid()}", flush=True)

OFFSET = 10  # a global of the script, used by the function on every rank


def square_plus_rank(x):
    return x * x + OFFSET + int(os.environ["RANK"])


print("RESULT", mpify_nb.ranch(3, square_plus_rank, 4), flush=True)
