"""A rank waiting in its collective check while its peer entered the same collective from C++
(issue 35, its gaps): DDP's bucket all_reduce inside ``backward()``, a functional collective, a
``ProcessGroup`` method. The peer never publishes a call, so the check waits for it, and it
waits in gloo for this rank: before, only ``timeout=`` or the stop button ended it (or, with
other sizes, the watch after ~10 s by names gloo records). The watch ends it as a mistake."""

from __future__ import annotations

import re
import time

import pytest

import helpers_bypass as hb
from mpify_nb import Session, in_torchddp, ranch
from mpify_nb.engine import verdict as verdicts
from mpify_nb.torchdist import waits
from mpify_nb.torchdist.recorder import Op
from mpify_nb.wire.errors import CollectiveError

HEAD = ("the ranks wait for each other (rank 1 entered collective #{n} without a torch.distributed call, which the "
        "collective check cannot see: DDP's backward, a functional collective, FSDP2 or a ProcessGroup method): ")
STOPPED = "every rank was stopped"


@pytest.fixture(scope="module", autouse=True)
def template_ready():
    """The template started before the first timed call (its start is not what is timed)."""
    import mpify_nb

    mpify_nb.template.get_template().wait_ready()


@pytest.mark.parametrize("how, elements", [("ddp", 5), ("ddp", 4), ("functional", 4), ("method", 4)],
                         ids=["ddp, its bucket's size", "ddp, another size", "functional", "ProcessGroup method"])
def test_ranch_a_rank_in_its_check_while_its_peer_entered_from_cpp(how, elements):
    started = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        ranch(2, hb.checked_against_cpp, how, elements, ctx=in_torchddp(), timeout=60)
    assert time.monotonic() - started < 30  # within 2 s of the hang when the machine is not loaded
    text = str(info.value)
    n = re.findall(r"#(\d+)", text)[0]
    theirs = f"all_reduce #{n} of float32[{5 if how == 'ddp' else 4}]"
    line = hb.line_of("rank 0's checked call")
    assert text == (HEAD.format(n=n) + f'rank 0 at File "{hb.__file__}", line {line}: '
                    f"all_reduce #{n} of float32[{elements}] (in the check); rank 1 at line {_rank1_line(how)}: "
                    f"{theirs} (in gloo); {STOPPED}")
    assert info.value.kind == "mismatch"


def _rank1_line(how: str) -> int:
    lines = [i for i, line in enumerate(open(hb.__file__).read().splitlines(), 1) if "rank 1 from C++" in line]
    return lines[["ddp", "functional", "method"].index(how)]


def test_a_session_rank_in_its_check_while_its_peer_runs_a_ddp_backward():
    with Session(2) as s:
        s.run("keep = rank + 100\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))")
        with pytest.raises(CollectiveError) as info:
            s.run("if rank == 0:\n    dist.all_reduce(torch.ones(5))\nelse:\n"
                  "    model(torch.ones(2, 4)).sum().backward()", filename="<cell>", timeout=60)
        text = str(info.value)
        n = re.findall(r"#(\d+)", text)[0]
        assert text == (HEAD.format(n=n) + f'rank 0 at File "<cell>", line 2: all_reduce #{n} of float32[5] (in the '
                        f"check); rank 1 at line 4: all_reduce #{n} of float32[5] (in gloo); the process group was "
                        "rebuilt (Python state kept; re-create objects made on the old group, e.g. "
                        "DistributedDataParallel)")
        assert (info.value.kind, info.value.rebuilt) == ("mismatch", True)
        assert s.run("keep") == {0: 100, 1: 101}
        assert s.run("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()") == {0: [3.0, 3.0], 1: [3.0, 3.0]}


# -- the rule alone, on looks (no process) -----------------------------------------------------------

def _in_check(seq: int, checks: tuple) -> waits.Snapshot:
    op = Op("all_reduce", "0", None, seq, (("float32", (4,)),), called=True)
    return waits.Snapshot(0, (op,), op, "dist.all_reduce", where=("<cell>", 2), doing="waiting", checks=checks)


def test_the_rule_where_gloo_records_no_collectives():
    """torch < 2.8: rank 1's collective is not recorded; torch's own count says it entered #4, and
    its stack says where (a DDP backward seen by hidden_waits): that is what the error says."""
    rank0 = _in_check(4, (("0", 4, 3, 3),))  # published 4, judged 3: waits for call 3, collective #4
    rank1 = waits.Snapshot(1, (), None, "Tensor.backward", True, ("<cell>", 4), "waiting", checks=(("0", 3, 3, 4),))
    found = verdicts.judge({0: rank0, 1: rank1}, 2, {})
    assert found is not None and (found.kind, found.waiting) == ("mismatch", [0, 1])
    assert found.what == (HEAD.format(n=4) + 'rank 0 at File "<cell>", line 2: all_reduce #4 of float32[4] (in the '
                          "check); rank 1 at line 4: Tensor.backward #4 (which collective, gloo records from torch "
                          "2.8) (in gloo)")


@pytest.mark.parametrize("rank1_checks, rank1_ops", [
    ((("0", 4, 3, 4),), (Op("all_reduce", "0", None, 4, (("float32", (4,)),)),)),
    ((("0", 3, 3, 3),), ()),
    ((), (Op("all_reduce", "0", None, 4, (("float32", (4,)),)),)),
], ids=["it published the call first", "it has not entered #4", "no check on its side"])
def test_the_rule_gives_no_verdict_for_a_peer_on_its_way(rank1_checks, rank1_ops):
    """A peer that published the call rank 0 waits for (it entered #4 after its check passed), or
    has not entered #4 yet: rank 0 will go on; no verdict."""
    rank0 = _in_check(4, (("0", 4, 3, 3),))
    rank1 = waits.Snapshot(1, rank1_ops, doing="waiting", checks=rank1_checks)
    assert verdicts.judge({0: rank0, 1: rank1}, 2, {}) is None
