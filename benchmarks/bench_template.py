#!/usr/bin/env python
"""Issue 27 (item 5): no call waits for a preload. A template replaced after a variable read at
import time changed serves the call as soon as a cold template would.

This process plays the notebook (rank 0 of each call, as ``ranch`` does by default). Preloading
is on, and the ranks have imported heavy libraries (lightning, transformers, accelerate: those
installed), so the template comes to hold them. Each repetition, in one run:

* replaced: a call teaches the template one more module (it imports it, in place, beside the
  call); at once ``OMP_NUM_THREADS`` changes, and the next call (timed) must start a template with
  the new environment, which imports what the ranks need before it forks them;
* cold: ``template.shutdown()`` (nothing left, nothing preloading), then a call (timed) that
  starts a template from nothing.

The sides alternate which comes first. Printed: every time, the medians and replaced/cold.
Target: replaced <= 1.5x cold (before issue 27: the preload of the old environment went on beside
the new template, and the call took about twice as long; since issue 36 a template that must be
replaced is retired, and killed when no rank lives in it).

Run: ``.venv/bin/python benchmarks/bench_template.py [--quick]``; two trees side by side:
``PYTHONPATH=/path/to/tree/src .venv/bin/python benchmarks/bench_template.py --quick`` for each.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from _common import Result, finish, fmt_list, fmt_s, machine_line, median, parse_args

HEAVY = [name for name in ("lightning", "transformers", "accelerate") if importlib.util.find_spec(name)]

def _new_modules(count: int) -> list[str]:
    """``count`` tiny modules nothing has imported, installed (a site-packages directory on sys.path,
    which the ranks get too): each repetition teaches the template one more."""
    import tempfile
    import uuid

    site = os.path.join(tempfile.mkdtemp(prefix="bench_template_"), "site-packages")
    os.mkdir(site)
    names = [f"bench_template_{uuid.uuid4().hex[:8]}" for _ in range(count)]
    for name in names:
        with open(os.path.join(site, f"{name}.py"), "w") as f:
            f.write("VALUE = 1\n")
    sys.path.insert(0, site)
    return names


def rank_imports(names: list) -> int:
    """On rank 1: import ``names`` (rank 0 is this process: what it imports is not taught)."""
    import importlib

    for name in names:
        importlib.import_module(name)
    return int(os.environ["RANK"])


def trivial() -> int:
    return int(os.environ["RANK"])


def _timed_call(ranch) -> float:
    t0 = time.perf_counter()
    assert ranch(2, trivial) == [0, 1]
    return time.perf_counter() - t0


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    import mpify_nb
    from mpify_nb import ranch, template

    reps = 3 if args.quick else 5
    print(machine_line())
    print(f"heavy modules the ranks import: {HEAVY or 'none installed'}", flush=True)
    mpify_nb.set_preload(True)
    taught = _new_modules(reps)
    ranch(2, rank_imports, HEAVY, caller_rank=None)  # the ranks import the heavy libraries
    template.wait_preloaded(600)
    saved = os.environ.get("OMP_NUM_THREADS")
    replaced: list[float] = []
    cold: list[float] = []
    try:
        for i in range(reps):
            for side in (("replaced", "cold") if i % 2 == 0 else ("cold", "replaced")):
                template.wait_preloaded(600)
                if side == "replaced":
                    ranch(2, rank_imports, HEAVY + [taught[i]], caller_rank=None)  # the template imports it
                    os.environ["OMP_NUM_THREADS"] = str(2 + i)
                    replaced.append(_timed_call(ranch))
                else:
                    template.shutdown()
                    cold.append(_timed_call(ranch))
                print(f"rep {i}: {side} {fmt_s((replaced if side == 'replaced' else cold)[-1])}", flush=True)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
        template.wait_preloaded(600)
    r, c = median(replaced), median(cold)
    print(f"replaced: median {fmt_s(r)} (all {fmt_list(replaced)})")
    print(f"cold:     median {fmt_s(c)} (all {fmt_list(cold)})")
    print(f"replaced/cold = {r / c:.2f}x", flush=True)
    results = [Result("27.5", "template replaced (env changed, preload on its way) / cold start", r / c, "x",
                      "<= 1.5x", r / c <= 1.5, f"replaced {fmt_s(r)} vs cold {fmt_s(c)} (medians of {reps})",
                      {"replaced": replaced, "cold": cold})]
    return finish("Issue 27, item 5: a replaced template vs a cold start", results, args)


if __name__ == "__main__":
    sys.exit(main())
