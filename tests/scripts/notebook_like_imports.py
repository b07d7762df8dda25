"""A __main__ whose function relies on names that only need=, imports= and import_star provide
on the ranks (the caller itself never defines them), as an mpify user would write it."""

import mpify_nb
from mpify_nb import import_star, ranch

SCALE = 3


def helper(x):
    return np.float64(x) * SCALE  # noqa: F821  (np comes from imports=)


def work():
    import_star(["math"])
    return [helper(2).item(), sqrt(16), EXTRA]  # noqa: F821  (sqrt: import_star; EXTRA: need=)


if __name__ == "__main__":
    EXTRA = "given by need="
    print(ranch(2, work, caller_rank=None, need="EXTRA", imports="import numpy as np"))
    mpify_nb.start.template.shutdown()
