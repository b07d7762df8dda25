"""The collective check and ``async_op=True`` collectives (issue 35, its gaps).

An async collective returns at once with the check on, as torch's does: when its peers' calls are
not all there yet, its check goes on in the group's lane (torchdist/checks/deferred.py), which
issues it to gloo later, in the order the rank made its collectives. Each test here deadlocked,
or raised elsewhere, before the lane: the async call waited for its peers at the call.
"""

from __future__ import annotations

import re
import time

import pytest

import helpers_async_checks as ha
from mpify_nb import Session, in_torchddp, ranch, set_collective_checks
from mpify_nb.wire.errors import CollectiveError

NONE_ENTERED = "none of them entered it"
REBUILT = ("the process group was rebuilt (Python state kept; re-create objects made on the old group, "
           "e.g. DistributedDataParallel)")


@pytest.mark.parametrize("caller_rank", [0, None], ids=["caller is rank 0", "caller plays no rank"])
def test_an_async_collective_returns_before_its_peer_calls_it(caller_rank):
    """The issue's program: rank 0's all_reduce(async_op=True), then a send rank 1 receives before it
    calls the all_reduce. With the check waiting at the call it was a deadlock."""
    values = ranch(2, ha.interleaved, ctx=in_torchddp(), caller_rank=caller_rank, timeout=60)
    assert values == [([3.0] * 4, [0.0] * 3, False, True, [[3.0] * 4]),
                      ([3.0] * 4, [0.0, 1.0, 2.0], False, True, [[3.0] * 4])]


def test_get_future_chains_on_an_async_collective_still_in_its_check():
    assert ranch(2, ha.chained, ctx=in_torchddp(), timeout=60) == [[30.0, 30.0]] * 2


@pytest.mark.parametrize("later", ["sync", "async"])
def test_a_later_collective_reaches_gloo_after_the_async_one_still_in_its_check(later):
    """Rank 0's later collective (a broadcast, or an all_reduce of another size it waits on first)
    goes behind its all_reduce still in the lane: gloo pairs each with the same one on rank 1."""
    expected_b = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] if later == "sync" else [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    assert ranch(2, ha.in_order, later, ctx=in_torchddp(), timeout=60) == [([3.0] * 4, expected_b, 3.0)] * 2


@pytest.mark.parametrize("when", ["later", "at once"])
def test_an_async_mismatch_raises_the_same_error_from_wait_on_every_rank(when):
    """Found by rank 0's lane after the call returned, or at the call by the last to come: either
    way each rank raises it from ``wait()``, none entered gloo, and the next collective adds up."""
    line = ha.line_of("mismatched async call")
    text = (f'the ranks called collectives that cannot match (different dtypes): rank 0 at File "{ha.__file__}", '
            f"line {line}: all_reduce #{{n}} of float32[4]; rank 1 at line {line}: all_reduce #{{n}} of float64[4]; "
            f"{NONE_ENTERED}")
    values = ranch(2, ha.mismatched, when, ctx=in_torchddp(), timeout=60)
    n = re.findall(r"#(\d+)", values[0][0])[0]
    assert values == [(text.format(n=n), ha.line_of("mismatched async wait"), [3.0, 3.0])] * 2


def test_async_calls_more_than_a_ring_ahead_are_each_checked():
    """12 async calls before the peer makes any: more than the table's ring; those past it wait
    unpublished in the lane. The 8th is float64 on rank 1: found, on both ranks, from its wait()."""
    values = ranch(2, ha.many_ahead, 7, ctx=in_torchddp(), timeout=60)
    apart = "the ranks called collectives that cannot match (different dtypes)"
    assert values == [[2.0 * i + 1 if i != 7 else apart for i in range(12)]] * 2


def test_a_ddp_communication_hooks_all_reduce_returns_at_once():
    """torch's allreduce hook: rank 0's returns before rank 1 (late) calls its own, and the weights
    are those of the same training with the check off."""
    was = set_collective_checks(False)
    try:
        expected = ranch(2, ha.hook_returns_at_once, ctx=in_torchddp(), timeout=120)
    finally:
        set_collective_checks(was)
    values = ranch(2, ha.hook_returns_at_once, ctx=in_torchddp(), timeout=120)
    (weights0, times0), (weights1, times1) = values
    assert weights0 == weights1 == expected[0][0] == expected[1][0]
    assert len(times0) == len(times1) == 3
    assert [returned < called for (_, returned), (called, _) in zip(times0, times1)] == [True] * 3


# -- a Session: the watch, the stop, the lane's thread ------------------------------------------------

@pytest.fixture(scope="module")
def session():
    with Session(2) as s:
        s.run("keep = rank + 100\nimport threading")
        yield s


def _lanes(session) -> dict:
    """Each rank's lane threads, once none is left or after 10 s (one ends right after its last call)."""
    deadline = time.monotonic() + 10
    while True:
        lanes = session.run("sorted(t.name for t in threading.enumerate() if t.name.startswith('mpify_nb-check-lane'))")
        if not any(lanes.values()) or time.monotonic() > deadline:
            return lanes
        time.sleep(0.05)


def test_a_session_async_call_whose_peer_never_comes_returns_then_waits_in_wait(session):
    """Rank 0's async all_reduce returns (the next line runs); its ``wait()`` is seen waiting in it, at
    the call's line; the watch ends it, the group is rebuilt, the lane's thread is gone."""
    with pytest.raises(CollectiveError) as info:
        session.run("w = torch.ones(2)\nwork = dist.all_reduce(w, async_op=True)\nreturned = True\nwork.wait()",
                    ranks=[0], filename="<cell>", timeout=60)
    assert str(info.value) == ('rank 0 was left waiting in dist.all_reduce (rank 0 at File "<cell>", line 2), '
                               f"which rank 1 never joined; {REBUILT}")
    assert session.run("returned", ranks=[0]) == {0: True}
    assert _lanes(session) == {0: [], 1: []}
    assert session.run("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()") == \
        {0: [3.0, 3.0], 1: [3.0, 3.0]}
    assert session.run("keep") == {0: 100, 1: 101}


def test_a_session_cell_with_the_interleaved_program_and_an_async_mismatch(session):
    cell = ("t = torch.ones(4) * (rank + 1)\nif rank == 0:\n    w = dist.all_reduce(t, async_op=True)\n"
            "    dist.send(torch.ones(1), 1)\nelse:\n    dist.recv(torch.zeros(1), 0)\n"
            "    w = dist.all_reduce(t, async_op=True)\nw.wait()\nt.tolist()")
    assert session.run(cell) == {0: [3.0] * 4, 1: [3.0] * 4}
    with pytest.raises(CollectiveError) as info:
        session.run(cell.replace("torch.ones(4) * (rank + 1)", "torch.ones(4 + rank)"), filename="<cell>")
    assert re.fullmatch(r'the ranks called collectives that cannot match \(different sizes\): rank 0 at File "<cell>", '
                        r"line 3: all_reduce #(\d+) of float32\[4\]; rank 1 at line 7: all_reduce #\1 of "
                        r"float32\[5\]; no rank entered it: the process group is as it was \(Python state kept\)",
                        str(info.value)), str(info.value)
    assert _lanes(session) == {0: [], 1: []}
    assert session.run("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()") == \
        {0: [3.0, 3.0], 1: [3.0, 3.0]}
