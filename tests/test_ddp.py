"""in_torchddp / TorchDDPCtx: a real gloo group around the ranks of a call, the launcher and
the in-rank forms, a DDP training step, the caller's torch.distributed left clean; GPU
placement logic with CUDA mocked (the only mocks in this suite), and real-GPU checks
that run only where CUDA is.
"""

# Fixtures come from helpers_ranch by import; their parameters shadow the imported names.
# ruff: noqa: F811

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist

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
from mpify_nb import RankRaisedError, TorchDDPCtx, in_torchddp

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: real nccl")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: real nccl on 2 ranks")


@pytest.fixture(autouse=True)
def caller_group_clean():
    """No test starts or ends with a process group up in this (the calling) process."""
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "the call left the caller's torch.distributed group up"


# -- a gloo group ---------------------------------------------------------------------------------

@BOTH_METHODS
def test_all_reduce_sum(method):
    assert mpify_nb.ranch(2, hr.all_reduce_rank_plus_one, ctx=in_torchddp()) == [3.0, 3.0]


def test_group_is_gloo_with_the_right_ranks():
    infos = mpify_nb.ranch(3, hr.world_info, ctx=in_torchddp())
    assert infos == [{"rank": r, "world": 3, "backend": "gloo"} for r in range(3)]


def test_four_ranks():
    assert mpify_nb.ranch(4, hr.all_reduce_rank_plus_one, ctx=in_torchddp()) == [10.0] * 4


def test_four_ranks_all_new():
    assert mpify_nb.ranch(4, hr.all_reduce_rank_plus_one, ctx=in_torchddp(), caller_rank=None) == [10.0] * 4


def test_caller_rank_1_in_the_group():
    infos = mpify_nb.ranch(3, hr.world_info, ctx=in_torchddp(), caller_rank=1)
    assert [i["rank"] for i in infos] == [0, 1, 2]


def test_launcher_form_returns_rank_0_value():
    assert in_torchddp(2, hr.world_info) == {"rank": 0, "world": 2, "backend": "gloo"}
    assert in_torchddp(3, hr.all_reduce_rank_plus_one, caller_rank=None) == 6.0


def test_launcher_form_refuses_ranch_only_options():
    with pytest.raises(TypeError):
        in_torchddp(2, hr.world_info, ctx=in_torchddp())
    with pytest.raises(TypeError):
        in_torchddp(2, hr.world_info, gather=False)
    with pytest.raises(TypeError):
        in_torchddp(None, hr.world_info)


def test_with_in_torchddp_inside_a_rank():
    assert mpify_nb.ranch(2, hr.with_ddp_inside) == [(True, 3.0, False)] * 2


def test_with_in_torchddp_outside_a_call_says_why():
    with pytest.raises(RuntimeError, match="RANK"):
        with in_torchddp():
            pass


def test_caller_group_down_after_a_failure(tmp_path):
    with pytest.raises(RankRaisedError):
        mpify_nb.ranch(2, hr.ddp_raise_on, 1, str(tmp_path), ctx=in_torchddp())
    assert not dist.is_initialized()
    assert mpify_nb.ranch(2, hr.all_reduce_rank_plus_one, ctx=in_torchddp(), timeout=60) == [3.0, 3.0]


def test_ddp_training_step_equal_across_ranks():
    """One DDP step on different data per rank: every rank ends with the same parameters,
    those of one step on the average of the ranks' losses."""
    seed, world = 7, 2
    per_rank = mpify_nb.ranch(world, hr.ddp_train_step, seed, ctx=in_torchddp())
    for params in per_rank[1:]:
        for mine, theirs in zip(per_rank[0], params):
            assert torch.equal(mine, theirs)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    loss = sum(torch.nn.functional.mse_loss(model(x), y)
               for x, y in (hr.training_batch(seed, r) for r in range(world))) / world
    loss.backward()
    with torch.no_grad():
        expected = [p - 0.1 * p.grad for p in model.parameters()]
    for got, want in zip(per_rank[0], expected):
        assert torch.allclose(got, want, atol=1e-6)
    assert not torch.equal(expected[0], model.weight.detach())  # the step did move something


# -- GPU placement (CUDA mocked) ---------------------------------------------------------------------

def test_device_for_gpu_list():
    ctx = TorchDDPCtx(gpus="3,1")
    assert ctx.device_for(0) == 3
    assert ctx.device_for(1) == 1
    with pytest.raises(ValueError, match="local rank 2"):
        ctx.device_for(2)
    assert TorchDDPCtx(gpus=[2, 0]).device_for(1) == 0


@pytest.mark.parametrize("spec", ["", "a,b", "1,1", "-1", []])
def test_bad_gpu_lists(spec):
    with pytest.raises(ValueError):
        TorchDDPCtx(gpus=spec)


def test_device_for_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert TorchDDPCtx().device_for(1) == 1
    assert TorchDDPCtx(backend="gloo").device_for(1) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert TorchDDPCtx().device_for(1) is None


def test_device_for_a_rank_given_its_own_gpu(monkeypatch):
    """On Ray each rank sees only the GPU it was given (CUDA_VISIBLE_DEVICES): device 0, whatever
    its local rank."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert TorchDDPCtx().device_for(1) == 0
    assert TorchDDPCtx().device_for(0) == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert TorchDDPCtx().device_for(1) == 1


def test_fewer_gpus_than_ranks_here_puts_every_rank_on_cpu(monkeypatch):
    """One GPU and two ranks on this machine (found on an H100 machine: both ranks took GPU 0
    with NCCL, and a CPU tensor's all_reduce failed): all ranks on CPU with gloo, and ranch's
    ctx says so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert TorchDDPCtx().device_for(0) is None and TorchDDPCtx().device_for(1) is None
    ctx = TorchDDPCtx()
    with pytest.warns(UserWarning, match="2 ranks and 1 GPU\\(s\\) here: every rank runs on CPU with gloo"):
        ctx._mpify_prepare(2, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # a rank alone here: it has the GPU
    assert TorchDDPCtx().device_for(0) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="mocks CUDA on a machine without it")
def test_nccl_chosen_when_a_gpu_is_assigned(scripts):
    """Local rank 1 with gpus="2,3" is put on GPU 3, and the group asked for is nccl (on a CPU
    build of torch init_process_group says it has no NCCL: that is the proof)."""
    from mpify_nb.start.placement import free_port

    proc = start_script("gpu_mock.py", env={"PORT": str(free_port("127.0.0.1")), "MPIFY_NB_PREWARM": "0"})
    scripts.append(proc)
    out, err = finish(proc, timeout=120)
    assert proc.returncode == 0, f"{out}\n{err}"
    report = json.loads(out.strip().splitlines()[-1])
    assert report["set_device"] == [3]
    assert report["backend"] == "nccl" or "NCCL" in (report["error"] or ""), report
    assert report["initialized"] is False


def test_fewer_gpus_than_ranks():
    with no_rank_started(), pytest.raises(ValueError, match="3 ranks"):
        mpify_nb.ranch(3, hr.rank, ctx=in_torchddp(gpus="0,1"))


def test_gpu_ids_that_do_not_exist(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with no_rank_started(), pytest.raises(ValueError) as info:
        mpify_nb.ranch(2, hr.rank, ctx=in_torchddp(gpus="3,1"))
    assert "[3]" in str(info.value) and "2 GPU" in str(info.value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    TorchDDPCtx(gpus="3,1")._mpify_prepare(2, 0)  # four GPUs: accepted


def test_default_nccl_needs_one_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with no_rank_started(), pytest.raises(ValueError, match="2 ranks need 2 GPUs"):
        mpify_nb.ranch(2, hr.rank, ctx=in_torchddp(backend="nccl"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no GPU is")
def test_nccl_without_gpu():
    with no_rank_started(), pytest.raises(RuntimeError) as info:
        mpify_nb.ranch(2, hr.rank, ctx=in_torchddp(backend="nccl"))
    assert re.search(r"needs CUDA GPUs", str(info.value))
    assert "gloo" in str(info.value)  # it says what to do instead


# -- real GPUs -------------------------------------------------------------------------------------

def _gpu_all_reduce():
    import os

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(int(os.environ["RANK"]) + 1)], device="cuda")
    dist.all_reduce(t)
    return t.item(), torch.cuda.current_device(), dist.get_backend()


@needs_cuda
def test_nccl_one_gpu():
    assert mpify_nb.ranch(1, _gpu_all_reduce, ctx=in_torchddp()) == [(1.0, 0, "nccl")]


@needs_2_gpus
def test_nccl_two_gpus_in_chosen_order():
    before = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    results = mpify_nb.ranch(2, _gpu_all_reduce, ctx=in_torchddp(gpus="1,0"))
    assert results == [(3.0, 1, "nccl"), (3.0, 0, "nccl")]
    if before is not None:
        assert torch.cuda.current_device() == before  # the caller's device is its own again
    assert_next_call_works()
