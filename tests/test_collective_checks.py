"""No collective mistake aborts a process (issue 35): the collective check.

Every rank compares each torch.distributed call it makes with its peers' before any of them enters
gloo (torchdist/checks/). The table of mistakes is tests/helpers_checks.py's ``CASES``: for each,

* what it did before the check (the check off is that code): ``test_the_table_today``;
* what it gives now, ``ranch`` with the caller as rank 0 and without, and a Session: the cell
  ends with a ``CollectiveError`` naming each rank's op, its number on the group, dtype and
  shape, and line; every rank keeps its state; the next collective on the group works;

then the rules alone (no process), the shared-memory table, the watch seeing a rank wait in the
check, workloads that must pass it, the switch, NCCL's verdicts on recorded dumps, and a real
Jupyter kernel under ``ranch`` (the notebook is rank 0) and with persistent ranks.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import threading
import time
from pathlib import Path

import pytest

import helpers_checks as hc
import helpers_mismatch as hm
import nbutil
from mpify_nb import RankExitedError, Session, in_torchddp, ranch, set_collective_checks
from mpify_nb.engine import checked
from mpify_nb.engine import verdict as verdicts
from mpify_nb.torchdist import recorder, waits
from mpify_nb.torchdist.checks import calls, wrappers
from mpify_nb.torchdist.checks.table import LAPPED, ShmTable
from mpify_nb.wire.errors import CollectiveError
from test_session_magics import Kernel
from versions import GLOO_RECORDER, needs_fsdp2_on_cpu, needs_gloo_recorder, needs_torch

IDS = [c.name for c in hc.CASES]
STOPPED = "every rank was stopped"
REBUILT = ("the process group was rebuilt (Python state kept; re-create objects made on the old group, "
           "e.g. DistributedDataParallel)")
NONE_ENTERED = "none of them entered it"
FLIGHT_RECORDER = Path(__file__).resolve().parent / "data" / "flight_recorder"


# -- the table: what each mistake did before the check -----------------------------------------

def _today_marks(case: hc.Case) -> list:
    # Before torch 2.8 gloo records no collectives: the watch cannot tell a mismatch or a wrong value.
    marks = [needs_gloo_recorder] if case.today in (hc.WRONG, hc.HANGS) else []
    if case.name == "all_to_all sizes":  # before, gloo raises "does not support alltoall" on every rank
        marks.append(needs_torch((2, 12), "gloo's all_to_all of lists, pytorch#165435"))
    return marks


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_today_marks(c)) for c in hc.CASES])
def test_the_table_today(case, checks_off):
    """Each case as it was before the check (which is this code with the check off): gloo aborts a
    rank, or the watch tells a wrong value or a hang, or nothing is said at all."""
    try:
        values = ranch(2, hc.run_case, case.source, ctx=in_torchddp(), caller_rank=None, timeout=60)
    except RankExitedError as e:
        assert case.today == hc.ABORTS and e.signal_name == "SIGABRT", e
        return
    except CollectiveError as e:
        assert (case.today, e.kind) in ((hc.WRONG, "wrong value"), (hc.HANGS, "mismatch"), (hc.HANGS, "deadlock")), e
        return
    assert case.today == hc.SILENT and values == ["no error", "no error"], values


# -- ranch: the caller as rank 0 (the notebook) and not --------------------------------------------

@pytest.mark.parametrize("caller_rank", [0, None], ids=["caller is rank 0", "caller plays no rank"])
@pytest.mark.parametrize("case", hc.CASES, ids=IDS)
def test_a_ranch_mistake_ends_with_the_checks_error_and_the_group_works(case, caller_rank):
    keep = {"state": list(range(3))}
    started = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        ranch(2, hc.run_case, case.source, ctx=in_torchddp(), caller_rank=caller_rank, timeout=60)
    assert time.monotonic() - started < 30  # within 2 s when the machine is not loaded
    assert str(info.value) in [f"{text}; {STOPPED}" for text in case.texts()]
    assert (info.value.kind, info.value.rebuilt) == ("mismatch", None) and info.value.mismatch is not None
    assert keep == {"state": [0, 1, 2]}  # this process (rank 0, or the caller) lives on with its state
    assert ranch(2, hc.working_collective, ctx=in_torchddp(), caller_rank=caller_rank) == [[3.0, 3.0], [3.0, 3.0]]


@pytest.mark.parametrize("case", [c for c in hc.CASES if not c.p2p], ids=[c.name for c in hc.CASES if not c.p2p])
def test_every_rank_raises_the_same_error_and_the_next_collective_works_in_the_same_call(case):
    """Caught on the ranks: both raised the same CollectiveError (no rank entered gloo), and the next
    all_reduce on the same group, in the same call, adds up."""
    values = ranch(2, hc.run_case, case.source, True, ctx=in_torchddp())
    assert values == [(f"{case.texts()[0]}; {NONE_ENTERED}", [3.0, 3.0])] * 2


def test_a_rank_that_returns_while_rank_0_waits_in_the_check_is_named():
    """The watch sees a rank waiting in the check as waiting in the collective (its number too)."""
    with pytest.raises(CollectiveError) as info:
        ranch(2, hm.returns_early, ctx=in_torchddp(), timeout=60)
    assert str(info.value) == (
        f'rank 1 returned from fn without joining all_reduce #3, which rank 0 waits in at File "{hm.__file__}", '
        f"line {hm.line_of('returns_early rank 0')}; {STOPPED}")


def test_ranks_on_different_hosts_are_checked_through_the_groups_store():
    line = hc.line_of("through_the_store mismatch")
    caught = (f'the ranks called collectives that cannot match (different dtypes): rank 0 at File "{hc.__file__}", '
              f"line {line}: all_reduce #1 on group [0, 1] of float32[4]; rank 1 at line {line}: all_reduce #1 on "
              f"group [0, 1] of float64[4]; {NONE_ENTERED}")
    assert ranch(2, hc.through_the_store, ctx=in_torchddp(), caller_rank=None) == \
        [("StoreTable", caught, [12.0, 12.0])] * 2


# -- a Session -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def session():
    with Session(2) as s:
        s.run("keep = rank + 100")
        yield s


def _numbers_as_one(text: str) -> str:
    return re.sub(r"#\d+", "#1", text)  # a persistent group's numbers go on from cell to cell


@pytest.mark.parametrize("case", hc.CASES, ids=IDS)
def test_a_session_mistake_ends_with_the_checks_error_state_kept_and_the_group_works(session, case):
    started = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        session.run(case.source, filename="<cell>", timeout=60)
    assert time.monotonic() - started < 30  # within 2 s when the machine is not loaded
    error = info.value
    numbers = re.findall(r"#(\d+)", str(error))
    assert len(set(numbers)) <= 1  # both ranks at the same collective of the group
    # A send and a recv that disagree: the rank that saw the other's half first raised; when the other
    # had entered gloo already, it is unstuck and the group rebuilt. Collectives: no rank entered.
    afters = [checked.KEPT, REBUILT] if case.p2p else [checked.KEPT]
    assert _numbers_as_one(str(error)) in [f"{text}; {after}" for text in case.texts("<cell>") for after in afters]
    assert error.kind == "mismatch" and (error.rebuilt is False or case.p2p)
    assert session.run("keep") == {0: 100, 1: 101}
    assert session.run("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()") == \
        {0: [3.0, 3.0], 1: [3.0, 3.0]}


@needs_gloo_recorder
def test_a_session_with_the_check_off_says_which_rank_got_a_wrong_value_every_rank_returned_from(session, checks_off):
    """gloo lets a broadcast into a bigger tensor pass, and both ranks return: with the check off, the
    ranks' recorders (read after a cell that issued collectives) tell it, as under ranch."""
    with pytest.raises(CollectiveError) as info:
        session.run(hc.case("broadcast into a bigger tensor").source, filename="<cell>")
    assert _numbers_as_one(str(info.value)) == (
        "rank 1 got a wrong value from broadcast #1 (the ranks passed different sizes, and every rank returned): "
        "rank 0: broadcast #1 of float32[4] (returned); rank 1: broadcast #1 of float32[5] (returned); "
        "every rank keeps its state, rank 1's with the wrong value")
    assert (info.value.kind, info.value.culprit) == ("wrong value", 1)
    assert session.run("y.tolist()") == {0: [0.0, 1.0, 2.0, 3.0], 1: [0.0, 1.0, 2.0, 3.0, 0.0]}
    assert session.run("t = torch.ones(2)\ndist.all_reduce(t)\nt.tolist()") == {0: [2.0, 2.0], 1: [2.0, 2.0]}


def test_a_session_rank_waiting_in_the_check_for_an_idle_peer_is_seen_and_unstuck(session):
    """Rank 0 alone calls all_reduce: it waits in the check; where() says so, and the watch ends it."""
    calls_made: list = []
    thread = threading.Thread(target=lambda: calls_made.append(
        pytest.raises(CollectiveError, session.run, "w = torch.ones(3)\ndist.all_reduce(w)", ranks=[0],
                      filename="<cell>", timeout=60)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        where = session.where()
        while not where[0].doing.startswith("waits in all_reduce") and time.monotonic() < deadline:
            time.sleep(0.05)
            where = session.where()
    finally:
        thread.join(60)
    assert re.fullmatch(r"waits in all_reduce #\d+ of float32\[3\]( \(\d+ s\))?", where[0].doing), where
    assert where[0].line == ("<cell>", 2) and where[0].stack[-1] == 'File "<cell>", line 2, in <module>'
    error = calls_made[0].value
    assert (error.kind, error.waiting, error.missing, error.rebuilt) == ("absent", [0], [1], True), error
    assert str(error) == ('rank 0 was left waiting in dist.all_reduce (rank 0 at File "<cell>", line 2), which '
                          f"rank 1 never joined; {REBUILT}")
    assert session.run("keep") == {0: 100, 1: 101}


# Without gloo's recorder (torch < 2.8) a functional collective is named by what the stack shows:
# the wait_tensor that blocks at the line using the result (docs/install.md, hidden_waits.py).
@pytest.mark.parametrize("cell, doing, line", [
    ("w = torch.ones(2)\nwork = dist.all_reduce(w, async_op=True)\nwork.wait()", "dist.all_reduce", 2),  # at call
    ("import torch.distributed._functional_collectives as funcol\n"
     "f = funcol.all_reduce(torch.ones(2), 'sum', dist.group.WORLD)\nf.sum().item()",  # gloo's: a dist call
     *(("dist.all_reduce", 2) if GLOO_RECORDER else ("torch.distributed._functional_collectives.wait_tensor", 3))),
], ids=["async_op", "functional"])
def test_an_async_call_for_an_idle_peer_waits_in_the_check_at_the_call(session, cell, doing, line):
    with pytest.raises(CollectiveError) as info:
        session.run(cell, ranks=[0], filename="<cell>", timeout=60)
    assert str(info.value) == (f'rank 0 was left waiting in {doing} (rank 0 at File "<cell>", line {line}), '
                               f"which rank 1 never joined; {REBUILT}")
    assert session.run("keep") == {0: 100, 1: 101}


def test_a_timeout_while_a_rank_waits_in_the_check_says_where_each_rank_is(session):
    source = ("import time\nt = torch.ones(1)\nif rank == 1:\n    end = time.monotonic() + 60\n"
              "    while time.monotonic() < end:\n        pass\ndist.all_reduce(t)")
    with pytest.raises(TimeoutError) as info:
        session.run(source, filename="<cell>", timeout=3)
    assert re.fullmatch(r'the call did not finish within 3 s \(ranks still running: \[0, 1\]; where they were: '
                        r'rank 0 at File "<cell>", line 7: waits in all_reduce #\d+ of float32\[1\]( \(\d+ s\))?; '
                        r'rank 1 at line [56]: running\); they were interrupted, their state is kept',
                        str(info.value)), str(info.value)
    assert session.run("t.item()") == {0: 1.0, 1: 1.0}


def test_a_session_learns_the_switch_before_its_next_cell(session):
    ours = "dist.all_reduce.__code__.co_filename.endswith(('checks/wrappers.py', 'checks\\\\wrappers.py'))"
    assert session.run(ours) == {0: True, 1: True}
    was = set_collective_checks(False)
    try:
        assert was is True
        # off: torch's own calls run, and a mismatch that aborts nothing passes (SUM on one rank, MAX on the other)
        assert session.run(ours) == {0: False, 1: False}
        assert session.run("x = torch.ones(2)\ndist.all_reduce(x, op=dist.ReduceOp.SUM if rank == 0 "
                           "else dist.ReduceOp.MAX)\nx.tolist()") == {0: [2.0, 2.0], 1: [2.0, 2.0]}
    finally:
        set_collective_checks(was)
    with pytest.raises(CollectiveError):
        session.run("x = torch.ones(2)\ndist.all_reduce(x, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)")
    assert os.environ[wrappers.VARIABLE] == "1"


def test_the_docs_table_is_the_tests_table():
    """docs/guide/troubleshooting.md's table of mistakes has a row for each case, saying what it did and does."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "troubleshooting.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.count("|") == 4]
    for case in hc.CASES:
        today = hc.IN_THE_DOCS[case.today] + (" (a Session: nothing said)" if case.session_today else "")
        assert f"| {case.name} | {today} | `({case.why})`: `{case.ops[0]}`; `{case.ops[1]}` |" in rows, case.name
    assert "caller_rank=None` for" not in text and "run code that may do this with" not in text


# -- workloads that must pass, the switch --------------------------------------------------------

@pytest.mark.parametrize("workload, expected", [
    ("shapes", [12.0, 12.0]),
    ("uneven all_to_all_single", [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]]),
    ("gather and scatter", [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]),
    ("objects", [([0, 1], 7)] * 2),
    ("tags out of order", [(2.0, 5.0), (2.0, 5.0)]),
    ("recv from any rank", [None, (3.0, 5.0)]),
    ("ring", [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
    ("many isends ahead", [None, float(sum(range(40)))]),
])
def test_calls_that_match_pass_the_check(workload, expected):
    assert ranch(2, hc.healthy, workload, ctx=in_torchddp(), timeout=120) == expected


@pytest.mark.parametrize("workload", ["ddp", pytest.param("fsdp2", marks=needs_fsdp2_on_cpu), "dtensor", "pipeline",
                                      "async", "long"])
def test_training_workloads_raise_no_alarm_with_the_check_on(workload):
    values = ranch(2, hm.healthy, workload, ctx=in_torchddp(), timeout=300)
    expected = {"dtensor": [28.0, 28.0], "pipeline": [None, (4, 4)], "long": [2.0, 2.0], "fsdp2": ["ok", "ok"],
                "async": [([2.0] * 4, [{"rank": 0}, {"rank": 1}])] * 2}
    assert values[0] == values[1] if workload == "ddp" else values == expected[workload]


def _ours() -> tuple[bool, bool]:
    import torch.distributed as dist

    return (dist.all_reduce.__code__.co_filename.endswith(os.path.join("checks", "wrappers.py")),
            dist.distributed_c10d.all_reduce is dist.all_reduce)


def test_off_the_ranks_run_torchs_own_calls_and_the_notebook_always_does_between_calls(checks_off):
    assert ranch(2, _ours, caller_rank=None) == [(False, True)] * 2
    assert ranch(2, _ours) == [(False, True)] * 2  # the caller's own rank too


def test_on_every_rank_runs_the_checked_calls_and_the_caller_puts_torchs_back_after():
    assert ranch(2, _ours) == [(True, True)] * 2
    assert _ours() == (False, True)  # between calls the notebook's torch.distributed is torch's own


def test_set_collective_checks_says_the_previous_setting_and_sets_the_environment(monkeypatch):
    monkeypatch.setenv(wrappers.VARIABLE, "1")
    assert set_collective_checks(False) is True
    try:
        assert os.environ[wrappers.VARIABLE] == "0" and not wrappers.enabled()
        assert set_collective_checks(False) is False
    finally:
        assert set_collective_checks(True) is False
    assert os.environ[wrappers.VARIABLE] == "1" and wrappers.enabled()


def _switch_in_a_rank():
    from mpify_nb import set_collective_checks as switch

    try:
        switch(False)
    except RuntimeError as e:
        return str(e)
    return "switched"


def test_set_collective_checks_in_a_rank_is_refused():
    assert ranch(1, _switch_in_a_rank, caller_rank=None) == [
        "set_collective_checks() is the notebook's to call: the ranks of a group must agree on it "
        "(a rank that checks waits for peers that publish)"]


# -- the rules, the table (no process) ---------------------------------------------------------

def _d(kind, inputs=(), outputs=(), root=None, redop=None, tag=None, extra=None):
    return (kind, redop, root, tag, tuple(inputs), tuple(outputs), extra)


F4, F6, D4 = ("float32", (4,)), ("float32", (2, 3)), ("float64", (4,))


@pytest.mark.parametrize("descriptions, why", [
    ([_d("all_reduce", [F6], redop="SUM"), _d("all_reduce", [("float32", (6,))], redop="SUM")], None),
    ([_d("all_reduce", [F4], redop="SUM"), _d("all_reduce", [D4], redop="SUM")], "different dtypes"),
    ([_d("all_reduce", [F4], redop="SUM"), _d("all_reduce", [F4], redop="MAX")], "a different reduce op: SUM, MAX"),
    ([_d("all_reduce", [F4], redop="SUM"), _d("broadcast", [F4], root=0)], "a different op"),
    ([_d("broadcast", [F4], root=0), _d("broadcast", [F4], root=1)], "a different src"),
    ([_d("gather", [F4], [F4, F4], root=0), _d("gather", [F4], root=0)], None),
    ([_d("gather", [F4], [F4, ("float32", (3,))], root=0), _d("gather", [F4], root=0)], "different sizes"),
    ([_d("scatter", [F4, F4], [F4], root=0), _d("scatter", [], [F4], root=0)], None),
    ([_d("all_to_all_single", [("float32", (3, 2))], [("float32", (3, 2))], extra=((1, 2), (1, 2))),
      _d("all_to_all_single", [("float32", (3, 2))], [("float32", (3, 2))], extra=((2, 1), (2, 1)))], None),
    ([_d("all_to_all_single", [("float32", (4,))], [("float32", (4,))]),
      _d("all_to_all_single", [("float32", (6,))], [("float32", (6,))])], "different sizes"),
    ([_d("all_to_all", [F4, F6], [F4, F4]), _d("all_to_all", [F4, F4], [F6, F4])], None),
    ([_d("barrier"), calls.decode(calls.UNCHECKED)], None),
])
def test_the_rules(descriptions, why):
    assert calls.apart(descriptions, len(descriptions)) == why


def test_the_rules_for_a_send_and_its_recv():
    send, recv = _d("send", [F4], root=1, tag=0, extra=True), _d("recv", [], [F4], root=0, tag=0, extra=True)
    assert calls.p2p_apart(send, recv) is None
    assert calls.p2p_apart(send, _d("recv", [], [D4], root=0, tag=0, extra=True)) == "different dtypes"
    assert calls.p2p_apart(send, _d("recv", [], [F6], root=0, tag=0, extra=False)) == "different sizes"
    assert calls.p2p_apart(send, _d("recv", [], [F6], root=0, tag=3, extra=True)) is None  # another tag's pair


def test_the_table_publishes_wakes_a_sleeper_and_says_when_a_slot_was_overwritten():
    mine = ShmTable.create(2)
    theirs = ShmTable.attach(mine.address(), 2)
    try:
        assert theirs.get(("c", 0), 0) is None
        woke: list[float] = []

        def sleep() -> None:
            token = theirs.token()
            started = time.monotonic()
            while theirs.get(("c", 0), 0) is None:
                theirs.sleep(token, [], 10.0)
                token = theirs.token()
            woke.append(time.monotonic() - started)

        sleeper = threading.Thread(target=sleep)
        sleeper.start()
        time.sleep(0.2)  # asleep on the bell by now (its first sleep is 1 ms, its next ones 10 s)
        mine.put(("c", 0), 0, b"all_reduce")
        sleeper.join(10)
        assert woke and woke[0] < 5.0 and theirs.get(("c", 0), 0) == b"all_reduce"
        for index in range(40):  # a p2p ring lapped: the old call is gone, and says so
            mine.put(("p", 0, 1, 0), index, b"send %d" % index)
        assert theirs.get(("p", 0, 1, 0), 39) == b"send 39" and theirs.get(("p", 0, 1, 0), 0) is LAPPED
    finally:
        theirs.close()
        mine.close()
    with pytest.raises(OSError):
        ShmTable.attach(f"{os.getpid()}:0:{'0' * 32}", 2)  # not a table (fd 0)


# -- NCCL: nothing aborts, the watch's verdict on its recorder (dumps recorded on an H200) ----------

#: The collective cases as NCCL records them: (its profiling name, sizes, dtype) on rank 1 where rank 0
#: recorded all_reduce of float32[4] (nccl-pending's entry #2), and the verdict's reason.
NCCL_CASES = {
    "all_reduce dtypes": (("nccl:all_reduce", [[4]], "Double"), "different dtypes", "all_reduce #2 of float64[4]"),
    "all_reduce sizes": (("nccl:all_reduce", [[3]], "Float"), "different sizes", "all_reduce #2 of float32[3]"),
    "all_reduce vs broadcast": (("nccl:broadcast", [[4]], "Float"), "a different op", "broadcast #2 of float32[4]"),
    "reduce_scatter_tensor": (("nccl:_reduce_scatter_base", [[8]], "Float"), "a different op",
                              "reduce_scatter_tensor #2 of float32[8]"),
}


@pytest.mark.parametrize("name", sorted(NCCL_CASES))
def test_nccl_mismatches_are_the_watchs_collective_error_on_recorded_dumps(name):
    dump = recorder.read_dump((FLIGHT_RECORDER / "nccl-pending-rank0.pkl").read_bytes())
    config = {"0": dict(dump["pg_config"]["0"], ranks="[0, 1]")}
    (profiling, sizes, dtype), why, theirs = NCCL_CASES[name]
    peer = [dict(e) for e in dump["entries"]]
    peer[-1].update(profiling_name=profiling, input_sizes=sizes, output_sizes=sizes, input_dtypes=[dtype],
                    output_dtypes=[dtype], state="started")
    snaps = {r: waits.Snapshot(r, tuple(recorder.entries_to_ops(entries, None, pg_config=config)))
             for r, entries in ((0, dump["entries"]), (1, peer))}
    found = verdicts.judge(snaps, 2, {}, previous=snaps)
    assert found is not None and found.kind == "mismatch", found
    assert found.what == (f"the ranks wait in collectives that cannot match ({why}): rank 0: all_reduce #2 of "
                          f"float32[4]; rank 1: {theirs}")
    error = CollectiveError(found.waiting, found.missing, what=found.what, kind=found.kind)
    assert pickle.loads(pickle.dumps(error)).mismatch is None and str(pickle.loads(pickle.dumps(error))) == str(error)


def test_a_group_without_gloo_is_not_checked(monkeypatch):
    """NCCL's groups (and any not gloo's) are the watch's: the check sets nothing up for them."""
    from mpify_nb.torchdist.checks import groups

    monkeypatch.setattr(groups, "_is_gloo", lambda pg, device: False)

    class Group:  # what _make reads of a process group
        def size(self):
            return 2

        def rank(self):
            return 0

    assert groups._make(Group(), lambda: recorder.Op("all_reduce")) is None


# -- a real Jupyter kernel: the notebook is rank 0 ----------------------------------------------------

@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    yield from nbutil.shared_kernel(lambda: nbutil.ready(Kernel(tmp_path_factory.mktemp("checks")), "ok",
                                                         ["import mpify_nb"]))


def test_kernel_ranch_dtype_mismatch_keeps_the_kernel_and_its_variables(kernel):
    kernel.ok("import torch, torch.distributed as dist\nfrom torch.distributed import all_reduce\n"
              "from mpify_nb import ranch, in_torchddp\nweights = torch.arange(3.0)\nnotes = ['kept']")
    defined = kernel.ok("def mixed():\n    x = torch.ones(4, dtype=torch.float32 if dist.get_rank() == 0 "
                        "else torch.float64)\n    all_reduce(x)  # bound before any call: torch's own\n"
                        "    return x.tolist()")
    ran = kernel.fails("ranch(2, mixed, ctx=in_torchddp())", "CollectiveError")
    n = defined.cell.execution_count
    assert ran.error_text() == (
        f"CollectiveError: the ranks called collectives that cannot match (different dtypes): rank 0 at "
        f"Cell In[{n}], line 3: all_reduce #1 of float32[4]; rank 1 at line 3: all_reduce #1 of float64[4]; "
        f"{STOPPED}")
    assert kernel.ok("print(weights.tolist(), notes, all_reduce is dist.distributed_c10d.all_reduce)").stream() == \
        "[0.0, 1.0, 2.0] ['kept'] True\n"
    kernel.ok("def summed():\n    x = torch.ones(2) * (dist.get_rank() + 1)\n    all_reduce(x)\n    return x.tolist()")
    assert kernel.ok("ranch(2, summed, ctx=in_torchddp())").shown() == ["[[3.0, 3.0], [3.0, 3.0]]"]


def test_kernel_persistent_cells_mismatch_keeps_every_ranks_state(kernel):
    kernel.ok("%load_ext mpify_nb")
    kernel.ok("%dist_init -n 2")
    try:
        kernel.ok("model_state = {'step': 10 + rank}")
        ran = kernel.fails("x = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)\n"
                           "dist.all_reduce(x)", "CollectiveError")
        n = ran.cell.execution_count
        assert ran.error_text() == (
            f"CollectiveError: the ranks called collectives that cannot match (different dtypes): rank 0 at "
            f"Cell In[{n}], line 2: all_reduce #1 of float32[4]; rank 1 at line 2: all_reduce #1 of float64[4]; "
            f"{checked.KEPT}")
        assert kernel.ok("model_state['step']").shown() == ["[rank 0] 10\n[rank 1] 11"]
        assert kernel.ok("y = torch.ones(1) * (rank + 1)\ndist.all_reduce(y)\ny.item()").shown() == \
            ["[rank 0] 3.0\n[rank 1] 3.0"]
    finally:
        kernel.ok("%dist_shutdown")


BOUND_EARLY = """
import torch
from torch.distributed import all_reduce
from torch.distributed.distributed_c10d import init_process_group as make_group

def total(dtype):
    x = torch.ones(1, dtype=dtype)
    all_reduce(x)
    return x.item()
"""


def _through_a_module_bound_early(mismatch: bool):
    import bound_early
    import torch
    import torch.distributed as dist

    bound_early.make_group("gloo")
    try:
        dtype = torch.float64 if mismatch and dist.get_rank() == 1 else torch.float32
        return bound_early.total(dtype)
    finally:
        dist.destroy_process_group()


def test_names_an_earlier_import_bound_to_torchs_own_are_checked_on_every_rank(tmp_path, monkeypatch):
    """A module the caller imported before the call took ``all_reduce`` (and ``init_process_group``)
    by name from torch, as DTensor's ``_collective_utils`` takes ``scatter``; a rank importing it
    during the call got ours. The caller went straight into gloo while rank 1 waited in the check
    for its call: the tensor-parallel cell's hang (it waited 120 s, in scatter). Now every name
    bound to torch's own is ours during a call, in every process, and torch's again after."""
    (tmp_path / "bound_early.py").write_text(BOUND_EARLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import bound_early
    import torch.distributed as dist

    try:
        assert ranch(2, _through_a_module_bound_early, False, timeout=60) == [2.0, 2.0]
        with pytest.raises(CollectiveError) as info:
            ranch(2, _through_a_module_bound_early, True, timeout=60)
        assert "float32[1]" in str(info.value) and "float64[1]" in str(info.value)
        assert bound_early.all_reduce is dist.distributed_c10d.all_reduce  # torch's own between calls
        assert bound_early.make_group is dist.distributed_c10d.init_process_group
        assert not bound_early.all_reduce.__code__.co_filename.endswith(os.path.join("checks", "wrappers.py"))
    finally:
        del sys.modules["bound_early"]


def _import_during_the_call():
    import bound_during  # noqa: F401  (binds our wrapper: the check is installed during the call)

    return True


def test_a_wrapper_a_module_kept_from_a_call_is_torchs_own_between_calls(tmp_path, monkeypatch):
    """A module the notebook imported during a call keeps our wrapper after it; between calls that
    wrapper is torch's own (a group the notebook makes itself is not ours to check)."""
    (tmp_path / "bound_during.py").write_text("from torch.distributed import all_reduce\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        assert ranch(2, _import_during_the_call) == [True, True]
        import bound_during

        assert bound_during.all_reduce.__code__.co_filename.endswith(os.path.join("checks", "wrappers.py"))

        def not_between_calls(*args, **kwargs):
            raise AssertionError("checked between calls")

        monkeypatch.setattr(wrappers, "_check", not_between_calls)
        import torch

        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            bound_during.all_reduce(torch.ones(1))
    finally:
        sys.modules.pop("bound_during", None)
