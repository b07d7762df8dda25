"""What a call leaves in the caller's process (threads, logging, warnings, library singletons,
Lightning's interactive flag) and torchrun's environment conventions in every rank.

Fast: no real training library is needed (accelerate's state module is used when present);
the real libraries run in tests/test_libraries.py.
"""

from __future__ import annotations

import logging
import os
import sys
import types
import warnings

import pytest
import torch

import mpify_nb
from mpify_nb.torchdist import libraries

TORCHRUN_VARS = ("GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS")


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def env_and_threads():
    return {k: os.environ.get(k) for k in TORCHRUN_VARS} | {"threads": torch.get_num_threads()}


def test_ranks_get_torchruns_variables_and_one_thread_each(no_torchrun_env):
    threads = torch.get_num_threads()
    results = mpify_nb.ranch(2, env_and_threads)
    for r, got in enumerate(results):
        assert got["GROUP_RANK"] == "0" and got["GROUP_WORLD_SIZE"] == "1"
        assert got["ROLE_RANK"] == str(r) and got["ROLE_WORLD_SIZE"] == "2" and got["ROLE_NAME"] == "default"
        assert got["TORCHELASTIC_RUN_ID"] == results[0]["TORCHELASTIC_RUN_ID"]
        assert got["TORCHELASTIC_RESTART_COUNT"] == "0"
        # torchrun's rule: several processes on one host and OMP_NUM_THREADS unset -> 1.
        assert got["OMP_NUM_THREADS"] == "1" and got["threads"] == 1, (r, got)
    assert torch.get_num_threads() == threads  # the caller's count is back
    assert not any(k in os.environ for k in TORCHRUN_VARS)
    run_ids = {mpify_nb.ranch(1, env_and_threads)[0]["TORCHELASTIC_RUN_ID"] for _ in range(2)}
    assert len(run_ids) == 2  # one per call, as one per torchrun


def test_a_single_rank_keeps_its_threads_like_torchrun(no_torchrun_env):
    got = mpify_nb.ranch(1, env_and_threads)[0]
    assert got["OMP_NUM_THREADS"] is None and got["threads"] == torch.get_num_threads()


def test_variables_the_user_set_win(no_torchrun_env, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "mine")
    monkeypatch.setenv("ROLE_RANK", "7")
    for got in mpify_nb.ranch(2, env_and_threads):
        assert got["TORCHELASTIC_RUN_ID"] == "mine" and got["ROLE_RANK"] == "7"


def configure_logging_and_threads():
    # What accelerate / HF / a user's script do on every rank, the caller included.
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.DEBUG, force=True)
    logging.getLogger("mpify_test.newlib").addHandler(logging.StreamHandler())  # on sys.stderr, now
    logging.getLogger("mpify_test.old").setLevel(logging.CRITICAL)
    warnings.simplefilter("ignore")
    return "ok"


def test_threads_logging_and_warning_filters_are_restored_in_the_caller():
    torch.set_num_threads(2)
    old = logging.getLogger("mpify_test.old")
    old.setLevel(logging.WARNING)
    root_handlers, root_level = list(logging.root.handlers), logging.root.level
    filters = list(warnings.filters)
    try:
        assert mpify_nb.ranch(2, configure_logging_and_threads) == ["ok", "ok"]
        assert torch.get_num_threads() == 2
        assert logging.root.handlers == root_handlers and logging.root.level == root_level
        assert old.level == logging.WARNING
        assert warnings.filters == filters
        # A library's logger first made during the call stays, but writes where the caller does
        # now, not to the call's stand-in for sys.stderr.
        (handler,) = logging.getLogger("mpify_test.newlib").handlers
        assert handler.stream is sys.stderr  # type: ignore[attr-defined]
    finally:
        logging.getLogger("mpify_test.newlib").handlers.clear()


def fill_accelerate_state():
    from accelerate.state import GradientState, PartialState

    PartialState._shared_state.clear()
    PartialState._shared_state.update(backend="gloo", num_processes=2)
    GradientState._shared_state["sync_gradients"] = True
    return len(PartialState._shared_state)


def test_accelerate_singletons_are_put_back_as_they_were():
    state = pytest.importorskip("accelerate.state")
    state.PartialState._shared_state.clear()
    state.PartialState._shared_state["user_made"] = 1  # something the notebook had before the call
    try:
        assert mpify_nb.ranch(2, fill_accelerate_state) == [2, 2]
        assert state.PartialState._shared_state == {"user_made": 1}
        assert state.GradientState._shared_state == {}
    finally:
        state.PartialState._shared_state.clear()


def lightning_flags():
    module = sys.modules.get("lightning._mpify_test_flags")
    return hasattr(sys, "ps1"), getattr(module, "_IS_INTERACTIVE", None)


def test_the_caller_does_not_look_interactive_to_lightning_during_the_call(monkeypatch):
    flags = types.ModuleType("lightning._mpify_test_flags")
    flags._IS_INTERACTIVE = True  # type: ignore[attr-defined]  # as lightning computes it in a kernel
    monkeypatch.setitem(sys.modules, "lightning._mpify_test_flags", flags)
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    assert mpify_nb.ranch(2, lightning_flags) == [(False, False), (False, None)]
    assert sys.ps1 == ">>> " and flags._IS_INTERACTIVE is True  # type: ignore[attr-defined]


def test_lightning_imported_during_the_call_still_sees_the_notebook_afterwards(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)

    def import_it():
        if "RANK" in os.environ and os.environ["RANK"] == "0":
            module = types.ModuleType("lightning._mpify_test_late")
            module._IS_INTERACTIVE = hasattr(sys, "ps1")  # type: ignore[attr-defined]
            sys.modules["lightning._mpify_test_late"] = module
            return module._IS_INTERACTIVE  # type: ignore[attr-defined]
        return False

    try:
        assert mpify_nb.ranch(2, import_it) == [False, False]
        assert sys.modules["lightning._mpify_test_late"]._IS_INTERACTIVE is True  # type: ignore[attr-defined]
    finally:
        sys.modules.pop("lightning._mpify_test_late", None)


def test_registry_is_only_looked_at_when_imported(monkeypatch):
    monkeypatch.setattr(libraries, "SINGLETONS", [("mpify_test_not_imported.state", "S", "_shared_state")])
    state = libraries.LibraryState.snapshot()
    state.restore()
    assert "mpify_test_not_imported.state" not in sys.modules
