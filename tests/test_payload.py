"""What travels to the ranks and back: tensors small and big (shared memory), parameters,
nested containers; and what cannot travel is refused with an error that names it
(arguments and globals before any rank starts, results with the rank that made them).
"""

# Fixtures come from helpers_ranch by import; their parameters shadow the imported names.
# ruff: noqa: F811

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

import helpers_ranks as hr
import mpify_nb
from helpers_ranch import (  # noqa: F401  (method, scripts: fixtures)
    BOTH_METHODS,
    assert_next_call_works,
    finish,
    method,
    no_rank_started,
    scripts,
    start_script,
)
from mpify_nb import PayloadError, RankError, RankRaisedError, in_torchddp

BIG = 1 << 19  # float32 elements: 2 MiB, over the 1 MiB shared-memory threshold


def big_tensor() -> torch.Tensor:
    return torch.arange(BIG, dtype=torch.float32)


# -- tensors ------------------------------------------------------------------------------------

@BOTH_METHODS
def test_small_tensor_in_and_out(method):
    t = torch.arange(6.0).reshape(2, 3)
    results = mpify_nb.ranch(3, hr.tensor_plus_rank, t, caller_rank=None)
    for r, (out, _, total) in enumerate(results):
        assert torch.equal(out, t + r)
        assert total == 15.0


@BOTH_METHODS
def test_big_tensor_in_and_out_through_shared_memory(method):
    t = big_tensor()
    expected_sum = float(t.sum())
    results = mpify_nb.ranch(3, hr.tensor_plus_rank, t)
    for r, (out, where, total) in enumerate(results):
        assert out.shape == (BIG,) and out.dtype == torch.float32
        assert torch.equal(out, t + r)
        assert total == expected_sum
        if r != 0:  # rank 0 is the caller: it has the caller's own tensor
            assert where is not None and where.startswith("/memfd:"), f"rank {r}: input in {where!r}"
            # what came back is the rank's shared mapping, not a copy in the caller's heap
            back = hr.mapping_of(out.data_ptr())
            assert back is not None and back.startswith("/memfd:"), f"rank {r}: result in {back!r}"
    assert torch.equal(t, big_tensor())


def test_result_tensor_outlives_the_ranks():
    """A big result stays valid (and writable) after its rank is gone."""
    out = mpify_nb.ranch(2, hr.tensor_plus_rank, big_tensor(), caller_rank=None)[1][0]
    out += 1
    assert float(out[-1]) == BIG - 1 + 1 + 1


@pytest.mark.parametrize("size", [16, BIG], ids=["small", "big"])
def test_rank_writes_stay_private(size):
    """Ranks write into the tensor they were given: the caller's tensor does not change, and no
    rank sees another's writes (rank 0, the caller, writes nothing and must see only zeros)."""
    t = torch.zeros(size)
    seen = mpify_nb.ranch(3, hr.write_then_read, t, (1, 2), ctx=in_torchddp())
    assert seen == [(0.0, 0.0), (2.0, 2.0), (3.0, 3.0)]
    assert float(t.abs().max()) == 0.0


def test_rank_writes_stay_private_all_ranks_new():
    t = torch.zeros(BIG)
    seen = mpify_nb.ranch(3, hr.write_then_read, t, (0, 1, 2), ctx=in_torchddp(), caller_rank=None)
    assert seen == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]
    assert float(t.abs().max()) == 0.0


@pytest.mark.parametrize("size", [4, BIG], ids=["small", "big"])
def test_parameter(size):
    p = torch.nn.Parameter(torch.ones(size))
    described = mpify_nb.ranch(2, hr.describe_tensor, p, caller_rank=None)
    assert described == [("Parameter", True, (size,), "torch.float32", float(size))] * 2
    back = mpify_nb.ranch(2, hr.as_is, p, caller_rank=None)
    for q in back:
        assert isinstance(q, torch.nn.Parameter) and q.requires_grad
        assert torch.equal(q.detach(), p.detach())
    frozen = torch.nn.Parameter(torch.ones(size), requires_grad=False)
    assert mpify_nb.ranch(1, hr.describe_tensor, frozen, caller_rank=None)[0][:2] == ("Parameter", False)


def test_requires_grad_survives_on_a_plain_tensor():
    t = torch.ones(BIG, requires_grad=True)
    assert mpify_nb.ranch(1, hr.describe_tensor, t, caller_rank=None)[0][:2] == ("Tensor", True)


def test_nested_containers():
    small, big = torch.ones(3), big_tensor()
    tree = {"list": [small, big, {"again": (big, 3)}], "text": "x", "none": None, "ints": {1, 2}}
    results = mpify_nb.ranch(2, hr.nested_identity, tree, caller_rank=None)
    for _, back in results:
        assert torch.equal(back["list"][0], small)
        assert torch.equal(back["list"][1], big)
        assert torch.equal(back["list"][2]["again"][0], big)
        assert back["list"][2]["again"][1] == 3
        assert (back["text"], back["none"], back["ints"]) == ("x", None, {1, 2})


def test_small_tensor_passed_twice_stays_one_tensor():
    small = torch.ones(3)
    tree = {"list": [None, small, {"again": (small, 3)}]}
    assert [same for same, _ in mpify_nb.ranch(2, hr.nested_identity, tree, caller_rank=None)] == [True, True]


def test_big_tensor_passed_twice_stays_one_tensor():
    big = big_tensor()
    tree = {"list": [None, big, {"again": (big, 3)}]}
    assert [same for same, _ in mpify_nb.ranch(2, hr.nested_identity, tree, caller_rank=None)] == [True, True]


@pytest.mark.parametrize("count", [260, 600])
def test_any_number_of_big_tensors_both_ways(count):
    # One sendmsg carries at most 253 fds: 260 failed both ways before they went in batches.
    returned = mpify_nb.ranch(2, hr.many_big_tensors, count)[1]
    assert len(returned) == count and float(returned[f"w{count - 1}"][0]) == count - 1
    expected = 2.0 * sum(range(count))
    assert mpify_nb.ranch(2, hr.checksum_tensors, returned) == [expected, expected]


# -- numpy arrays and views ---------------------------------------------------------------------

def test_big_numpy_arrays_travel_through_shared_memory_both_ways():
    import numpy as np

    arrays = hr.big_arrays(1 << 19)  # 2 MiB float32, 4 MiB int64: over the shared-memory threshold
    data, fds = mpify_nb.wire.payload.dumps(arrays)
    try:
        assert len(fds) == 4 and len(data) < 4096, "the arrays' bytes were pickled"
    finally:
        mpify_nb.wire.payload.close_fds(fds)
    expected = {name: (np.float32(0).dtype.str if name != "ints" else np.int64(0).dtype.str) for name in arrays}
    for described in mpify_nb.ranch(2, hr.describe_arrays, arrays):
        for name, (kind, dtype, shape, fortran, writable, total, _base) in described.items():
            a = arrays[name]
            assert (kind, dtype, shape, writable) == ("ndarray", expected[name], a.shape, True), name
            assert fortran == bool(a.flags.f_contiguous) and total == float(a.astype(np.float64).sum()), name
    returned = mpify_nb.ranch(2, hr.big_arrays, 1 << 19)[1]
    for name, a in returned.items():
        assert isinstance(a, np.ndarray) and np.array_equal(a, arrays[name]) and a.flags.writeable, name
    assert returned["f"].flags.f_contiguous


def test_small_view_of_a_big_tensor_ships_only_its_bytes():
    big = torch.arange(float(1 << 20))  # 4 MiB
    view = big[10:20]
    data, fds = mpify_nb.wire.payload.dumps(view)
    assert not fds and len(data) < 4096, f"{len(data)} bytes pickled for a 40-byte view"
    assert torch.equal(mpify_nb.wire.payload.loads(data, fds), view)
    assert mpify_nb.ranch(2, hr.as_is, view, caller_rank=None)[0].tolist() == view.tolist()


@pytest.fixture
def four_copy_threads(monkeypatch):
    """Big tensors copied in 4 pieces (by 4 threads), however many cores this machine has."""
    monkeypatch.setattr(mpify_nb.wire.shm, "copy_threads", lambda: 4)


def test_a_big_tensor_in_pieces_is_one_tensor_again(four_copy_threads):
    import numpy as np

    n = (32 << 20) // 4 + 3  # 32 MiB and 12 bytes: 4 pieces, the last one not a whole page
    t = torch.arange(n, dtype=torch.float32)
    arr = np.arange(3 << 20, dtype=np.float64)  # 24 MiB: 3 pieces
    value = {"t": t, "view": t[5:], "arr": arr}
    data, fds = mpify_nb.wire.payload.dumps(value)
    assert len(fds) == 7 and len(data) < 4096
    back = mpify_nb.wire.payload.loads(data, fds, private=True)
    assert torch.equal(back["t"], t) and torch.equal(back["view"], t[5:]) and np.array_equal(back["arr"], arr)
    assert back["view"].data_ptr() == back["t"].data_ptr() + 20, "the view lost its aliasing"
    assert hr.mapping_of(back["t"].data_ptr() + (20 << 20)).startswith("/memfd:mpify_nb-tensor")
    back["t"] += 1  # copy-on-write: a private mapping's writes stay its own
    assert float(back["t"][-1]) == n and float(t[-1]) == n - 1
    del back


def test_a_big_tensor_in_pieces_travels_both_ways(four_copy_threads):
    t = (torch.arange((32 << 20) // 4) % 3).float()  # 32 MiB: 4 pieces; sums exact in float32
    expected_sum = float(t.sum())
    for r, (out, where, total) in enumerate(mpify_nb.ranch(2, hr.tensor_plus_rank, t, caller_rank=None)):
        assert torch.equal(out, t + r) and total == expected_sum
        assert where is not None and where.startswith("/memfd:"), f"rank {r}: input in {where!r}"
    assert torch.equal(t, (torch.arange((32 << 20) // 4) % 3).float())


def test_pieces_stop_at_the_budget(four_copy_threads, monkeypatch):
    monkeypatch.setattr(mpify_nb.wire.payload, "_PIECE_BUDGET", 5)  # 5 fds more than one per tensor
    tensors = [torch.full(((32 << 20) // 4,), float(i)) for i in range(4)]  # 32 MiB: 4 pieces each
    data, fds = mpify_nb.wire.payload.dumps(tensors)
    assert len(fds) == 4 + 3 + 1 + 1  # 3 extra, then the last 2, then none
    back = mpify_nb.wire.payload.loads(data, fds)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


@pytest.mark.parametrize("gap", [0, 4096], ids=["back to back", "apart"])
def test_windows_of_one_file_are_the_tensors(four_copy_threads, gap):
    """What a rank on a Ray node maps (ray_ranks.worker.StoreFiles): the call's memfds as windows of
    one bigger file, at any offset. Back to back, a big tensor's pieces map as one tensor, in
    place and copy-on-write; apart, they are copied into one."""
    import os

    import numpy as np

    t = torch.arange((32 << 20) // 4 + 3, dtype=torch.float32)  # 4 pieces, the last not a whole page
    arr = np.arange(300_000, dtype=np.float64)  # one memfd
    data, fds = mpify_nb.wire.payload.dumps({"t": t, "view": t[5:], "arr": arr})
    store = os.memfd_create("store", os.MFD_CLOEXEC)
    windows, offset = {}, 256  # an object's bytes start past its header, not on a page
    try:
        os.pwrite(store, b"header", 0)
        for i, fd in enumerate(fds):
            size = os.fstat(fd).st_size
            os.pwrite(store, os.pread(fd, size, 0), offset)
            windows[i] = (offset, size)
            offset += size + gap
        back = mpify_nb.wire.payload.loads(data, [os.dup(store) for _ in fds], private=True, windows=windows)
        assert torch.equal(back["t"], t) and torch.equal(back["view"], t[5:]) and np.array_equal(back["arr"], arr)
        assert back["view"].data_ptr() == back["t"].data_ptr() + 20, "the view lost its aliasing"
        in_store = hr.mapping_of(back["t"].data_ptr() + (20 << 20)).startswith("/memfd:store")
        assert in_store == (gap == 0)
        before = os.pread(store, 8, windows[0][0])
        back["t"] += 1  # copy-on-write: the store keeps its bytes
        assert float(back["t"][0]) == 1.0 and os.pread(store, 8, windows[0][0]) == before
    finally:
        mpify_nb.wire.payload.close_fds(fds + [store])


@pytest.mark.parametrize("view", ["big", "small"])
def test_a_tensor_and_its_view_keep_their_aliasing(view):
    base = torch.zeros(1 << 20)  # 4 MiB
    part = base[100:] if view == "big" else base[100:110]
    assert mpify_nb.ranch(2, hr.aliasing, base, part, caller_rank=None) == [(True, True), (True, True)]


# -- what cannot travel -------------------------------------------------------------------------

def test_unpicklable_argument():
    with socket.socket() as conn:
        with no_rank_started(), pytest.raises(PayloadError) as info:
            mpify_nb.ranch(2, hr.echo, 1, conn)
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert "argument 1" in message and "socket" in message


def test_unpicklable_keyword_argument():
    gen = (i for i in range(3))
    with no_rank_started(), pytest.raises(PayloadError) as info:
        mpify_nb.ranch(2, hr.echo, 1, stream=gen)
    assert "keyword argument 'stream'" in str(info.value)
    assert "generator" in str(info.value)


def test_unpicklable_global_in_a_test_function():
    """A function defined here (shipped by value, like a notebook's) using a global that cannot
    be pickled: the error names the global."""
    namespace = {"__name__": "__main__"}
    exec(  # a notebook cell: its globals are __main__'s
        "import socket\n"
        "NOTEBOOK_CONN = socket.socket()\n"
        "def ping():\n"
        "    return NOTEBOOK_CONN.fileno()\n",
        namespace,
    )
    try:
        with no_rank_started(), pytest.raises(PayloadError) as info:
            mpify_nb.ranch(2, namespace["ping"])
        assert "'NOTEBOOK_CONN'" in str(info.value)
    finally:
        namespace["NOTEBOOK_CONN"].close()


def test_unpicklable_global_in_a_real_main(scripts):
    proc = start_script("unpicklable_global.py", env={"MPIFY_NB_PREWARM": "0"})
    scripts.append(proc)
    out, err = finish(proc)
    assert proc.returncode == 0, f"{out}\n{err}"
    assert "PAYLOAD-ERROR" in out, out
    error_line = next(line for line in out.splitlines() if line.startswith("PAYLOAD-ERROR"))
    assert "'CONNECTION'" in error_line and "send_hello" in error_line
    assert "PROCESSES-STARTED 0" in out
    assert "TEMPLATE False" in out


def test_a_lock_is_fine():
    """dill pickles locks (as new locks): not an error."""
    assert mpify_nb.ranch(2, hr.as_is, threading.Lock(), caller_rank=None)[1].acquire(blocking=False)


@pytest.mark.parametrize("caller_rank, target", [(0, 1), (None, 0)])
def test_unpicklable_result(caller_rank, target):
    with pytest.raises(RankError) as info:
        mpify_nb.ranch(2, hr.return_unpicklable_on, target, caller_rank=caller_rank)
    err = info.value
    assert isinstance(err, RankRaisedError)
    assert err.rank == target
    assert f"rank {target}" in str(err)
    assert "cannot be pickled" in str(err) and "generator" in str(err)
    assert_next_call_works()


def test_unpicklable_result_on_the_caller_is_fine():
    """The caller's own value is not pickled at all."""
    results = mpify_nb.ranch(2, hr.return_unpicklable_on, 0)
    assert list(results[0]) == [0, 1, 2] and results[1] == 1


def test_unpicklable_ctx():
    class Ctx:
        def __init__(self):
            self.conn = socket.socket()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    ctx = Ctx()
    try:
        with no_rank_started(), pytest.raises(PayloadError, match="ctx"):
            mpify_nb.ranch(2, hr.rank, ctx=ctx)
    finally:
        ctx.conn.close()



def test_datetime64_and_timedelta64_arrays_travel_both_ways_through_shared_memory():
    # Before: numpy refuses a buffer of dtypes M and m, so an argument failed (PayloadError) and
    # a result failed (RankRaisedError) once it reached the 1 MiB shared-memory threshold.
    import numpy as np

    arrays = hr.time_arrays(200_000)  # 1.6 MB of datetime64[ns], as a DataFrame's date_range column
    data, fds = mpify_nb.wire.payload.dumps(arrays)
    try:
        assert len(fds) == 4 and len(data) < 4096, "the arrays' bytes were pickled"
    finally:
        mpify_nb.wire.payload.close_fds(fds)
    expected = {name: (a.dtype.str, a.shape, name == "grid", str(a.flat[0]), str(a.flat[-1]))
                for name, a in arrays.items()}
    assert mpify_nb.ranch(2, hr.describe_time_arrays, arrays) == [expected, expected]
    returned = mpify_nb.ranch(2, hr.time_arrays, 200_000)[1]
    for name, a in returned.items():
        assert a.dtype == arrays[name].dtype and np.array_equal(a, arrays[name]), name
    assert returned["grid"].flags.f_contiguous
    assert str(returned["stamps"][-1]) == "2048-10-25T07:00:00.000000000"


# -- a result's shared memory goes with the result (issue 35) -----------------------------------

#: A module whose import leaves cyclic garbage holding a frame, as many libraries' imports do (a
#: frame kept in a local of itself); imported first by the unpickling of a result, that frame's
#: callers (the unpickler, the call, the value) stayed alive with it until the collector ran.
_FRAMEFUL = """
import sys


class Box:
    def __init__(self, value):
        self.value = value


def _look():
    here = sys._getframe()  # refers to itself through its locals: garbage with a cycle, once returned


_look()
"""

#: A fresh process, its cyclic collector off: a result's memfd must be unmapped the moment the user
#: drops it. Before: ranch's result stayed in a cycle (the call, its engine, their bound handlers),
#: and a value whose unpickling imported a module stayed held by that import's garbage.
_RELEASED = r"""
import gc, os, sys
gc.disable()

def mapped():
    with open("/proc/self/maps") as f:
        return sum("mpify_nb-tensor" in line for line in f)

def held():
    return sum("mpify_nb-tensor" in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))

def big():
    import os, torch
    return torch.full((4 << 20,), float(os.environ["RANK"])) if os.environ["RANK"] == "1" else None

from mpify_nb import Session, ranch
seen = []
value = ranch(2, big)
seen.append(("ranch", float(value[1][0]), mapped() > 0))
del value
seen.append(("ranch, dropped", mapped(), held()))
with Session(2) as s:
    s.run("import frameful, torch\nb = frameful.Box(torch.full((4 << 20,), 1.5))\nt = torch.full((4 << 20,), 2.5)")
    assert "frameful" not in sys.modules  # the first unpickling here imports it
    for what in ("b", "t"):
        value = s.pull(what, rank=1)
        seen.append((what, float((value.value if what == "b" else value)[0]), mapped() > 0))
        del value
        seen.append((what + ", dropped", mapped(), held()))
    value = s.run("t", ranks=[0, 1])
    del value
    seen.append(("run, dropped", mapped(), held()))
value = ranch(2, big)  # a warm call: nothing imported
del value
seen.append(("ranch again, dropped", mapped(), held()))
print(seen)
"""


def test_a_results_shared_memory_is_released_when_the_user_drops_it_gc_off(tmp_path):
    import subprocess
    import sys

    (tmp_path / "frameful.py").write_text(_FRAMEFUL)
    env = dict(os.environ, MPIFY_NB_PREWARM="1")
    out = subprocess.run([sys.executable, "-c", _RELEASED], capture_output=True, text=True, env=env, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str([
        ("ranch", 1.0, True), ("ranch, dropped", 0, 0), ("b", 1.5, True), ("b, dropped", 0, 0),
        ("t", 2.5, True), ("t, dropped", 0, 0), ("run, dropped", 0, 0), ("ranch again, dropped", 0, 0)]), \
        out.stdout + out.stderr[-2000:]
