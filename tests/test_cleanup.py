"""Nothing a rank starts outlives the call, and a template restart does not wait out a grace period.

A rank may start subprocesses, fork, start daemon
multiprocessing workers, keep DataLoader workers in a global, or leave an orphan in a
session of its own. However the call ends (a value, a raise, a timeout that kills the
ranks), none of these is alive once ``ranch`` returns. (What the caller's own rank starts
belongs to the notebook, like anything a cell starts: a DataLoader it keeps keeps its workers.)
"""

# ruff: noqa: F811  (pytest fixtures imported by name)
from __future__ import annotations

import json
from pathlib import Path

import pytest

import helpers_ranks as hr
import mpify_nb
from helpers_ranch import assert_gone, method  # noqa: F401  (method: a fixture)
from mpify_nb import RankRaisedError
from mpify_nb.start import template

HOWS = ["popen", "fork", "mp_daemon", "double_fork_new_session", "dataloader"]


def _descendants(directory: Path) -> list[tuple[int, int]]:
    found = []
    for path in directory.glob("desc-*.json"):
        found.extend(tuple(i) for i in json.loads(path.read_text()))
    return found


def _call(directory: Path, how: str, end: str, ranks=(1,), timeout=None):
    if end == "return":
        return mpify_nb.ranch(2, hr.leave_descendants, str(directory), how, end, ranks, timeout=timeout)
    expected = RankRaisedError if end == "raise" else TimeoutError
    with pytest.raises(expected):
        mpify_nb.ranch(2, hr.leave_descendants, str(directory), how, end, ranks, timeout=timeout)
    return None


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("end", ["return", "raise"])
def test_rank_descendants_end_with_the_call(how, end, tmp_path):
    _call(tmp_path, how, end)
    left = _descendants(tmp_path)
    assert left, "the rank recorded no descendants"
    assert_gone(left, timeout=0.5, what="descendant", zombie_ok=True)


@pytest.mark.parametrize("how", ["popen", "double_fork_new_session", "dataloader"])
def test_descendants_of_a_killed_rank_end_with_the_call(how, tmp_path):
    # The timeout SIGKILLs the rank: it cannot clean up, its template or the caller must.
    _call(tmp_path, how, "hang", timeout=3)
    assert_gone(_descendants(tmp_path), timeout=0.5, what="descendant", zombie_ok=True)


@pytest.mark.parametrize("method", ["spawn"], indirect=True)
@pytest.mark.parametrize("end", ["return", "hang"])
def test_descendants_end_with_the_call_spawned(method, end, tmp_path):
    _call(tmp_path, "popen", end, timeout=None if end == "return" else 8)
    assert_gone(_descendants(tmp_path), timeout=0.5, what="descendant", zombie_ok=True)


def test_template_leaves_at_once_when_asked():
    mpify_nb.ranch(2, hr.rank)
    proc = template._client._proc
    template.shutdown()
    # Killed after a grace period, it would report -9.
    assert proc.returncode == 0, f"the template did not leave by itself (returncode {proc.returncode})"


def test_template_restart_on_env_change_leaves_old_template_by_itself(monkeypatch):
    mpify_nb.ranch(2, hr.rank)
    old = template._client._proc
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert mpify_nb.ranch(2, hr.rank) == [0, 1]
    code = old.wait(timeout=30)  # it is closed in the background: the call does not wait for it
    assert code == 0, f"the old template was killed (returncode {code})"
    assert template._client._proc is not old
