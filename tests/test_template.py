"""The template while it is replaced: a rank it is forking lives, it forks nothing more, and a
call that must start a template never waits for a preload beside it (issue 27, items 5 and 6).

Under load, a candidate template became ready while a call's rank was being forked from the old
one; the old one retired before it had counted that rank, closed, and took the rank with it
(``RankExitedError: ... the template process it was forked from (pid N) died``). A loaded
machine delays the caller's reader thread between the template's FORKED answer and its
counting; here the test holds the reader's lock instead, so the moment is the same every run.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import uuid

import pytest

import helpers_ranks as hr
import mpify_nb
from helpers_ranch import assert_next_call_works
from mpify_nb.start import preload, template
from mpify_nb.wire import modules as rank_modules
from test_preload import fresh, unused  # noqa: F401  (fresh: a fixture)

NO_HANG = 120.0


def _wait_until(condition, what: str, timeout: float = NO_HANG) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.01)


def _has_read_an_answer(client: template.TemplateClient) -> bool:
    """Its reader thread took a message off the socket, and waits for the client's lock to count it
    (past framing's recv: waiting to enter ``with self._cond`` in _read_replies)."""
    frame = sys._current_frames().get(client._reader.ident or 0)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names[:2] == ["__enter__", "_read_replies"]


def test_a_template_replaced_while_it_forks_a_rank_keeps_that_rank_and_forks_no_more(monkeypatch):
    # The call must not first ask the template which of this process's modules it holds (an
    # answer that would come before FORKED): the moment held below is FORKED's.
    monkeypatch.setattr(rank_modules, "_enabled", False)
    assert_next_call_works()
    old = template.get_template()
    old.wait_ready()
    os.kill(old.pid, signal.SIGSTOP)  # it cannot answer the FORK the call is about to send
    outcome: list = []

    def call() -> None:
        try:
            outcome.append(mpify_nb.ranch(2, hr.parent_pid, caller_rank=None, timeout=NO_HANG))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=call)
    try:
        thread.start()
        _wait_until(lambda: bool(old._in_flight), "the call asked the template for a rank")
        with old._cond:  # the reader cannot count the rank it forks until we let go
            os.kill(old.pid, signal.SIGCONT)
            _wait_until(lambda: _has_read_an_answer(old), "the template answered FORKED")
            monkeypatch.setenv("OMP_NUM_THREADS", "7")  # read at import time: the template is replaced
            new = template.get_template()
        thread.join(NO_HANG)
    finally:
        try:
            os.kill(old.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # it died
    assert not thread.is_alive(), "the call hung"
    # Rank 0 from the old template, which lived on for it; rank 1 from the new one (the old one
    # was retiring: it forked nothing more).
    assert outcome == [[old.pid, new.pid]], outcome
    assert new is not old and old.retiring
    assert old._proc.wait(timeout=NO_HANG) == 0  # it left by itself once its rank had exited
    assert_next_call_works()


def test_a_rank_whose_template_is_killed_says_how_it_died(tmp_path):
    assert_next_call_works()
    client = template.get_template()

    def kill_template_once_ranks_run() -> None:
        hr.wait_for_file(str(tmp_path / "1.json"))
        os.kill(client.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_template_once_ranks_run)
    killer.start()
    try:
        with pytest.raises(mpify_nb.RankExitedError) as info:
            mpify_nb.ranch(2, hr.sleep_and_record, str(tmp_path), 60, timeout=NO_HANG)
    finally:
        killer.join()
    assert info.value.rank == 1
    assert (f"the template process it was forked from (pid {client.pid}) died (killed by SIGKILL (kill -9, "
            "or the kernel's out-of-memory killer: see dmesg)), and its ranks with it") in str(info.value)
    assert_next_call_works()


def _site_module(tmp_path, monkeypatch, prefix: str, template_only: str) -> str:
    """A module installed under a site-packages directory that runs ``template_only`` where RANK is
    not set: in the template, never in a rank."""
    site = tmp_path / "site-packages"
    site.mkdir(exist_ok=True)
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    (site / f"{name}.py").write_text("import os\nif 'RANK' not in os.environ:\n" +
                                     "".join("    " + line + "\n" for line in template_only.splitlines()))
    monkeypatch.syspath_prepend(str(site))
    return name


def test_a_module_whose_import_hangs_in_the_template_is_left_out(tmp_path, monkeypatch):
    """The template imports what the ranks import between forks, so a fork waits for the import in
    progress: one that never ends (a network wait) would hold every later call. After
    STEP_PATIENCE on one module the call gives that template up, the module is left out, and a new
    template (which never tries it) forks the ranks; the stuck one, which held no rank, is killed."""
    monkeypatch.setattr(template, "STEP_PATIENCE", 3.0)
    name = _site_module(tmp_path, monkeypatch, "mpify_hangs", "import time\ntime.sleep(3600)")
    assert mpify_nb.ranch(2, hr.modules_then_import, [name], caller_rank=None) == [{name: False}] * 2
    stuck = template.get_template()
    _wait_until(lambda: stuck.trying == name, "the template began importing it")
    t0 = time.monotonic()
    assert mpify_nb.ranch(2, hr.modules_then_import, [name], caller_rank=None) == [{name: False}] * 2
    assert time.monotonic() - t0 < NO_HANG
    assert preload.failed()[name] == "its import took over 3 s in the template"
    assert template.get_template() is not stuck and stuck.retiring
    assert stuck._proc.wait(timeout=NO_HANG) == -signal.SIGKILL
    assert name not in template.get_template().held.queued
    assert mpify_nb.ranch(2, hr.modules_then_import, [name], caller_rank=None) == [{name: False}] * 2


def test_a_call_that_must_start_a_template_does_not_wait_for_the_old_ones_import(tmp_path, monkeypatch):
    """A variable read at import time changed while the template was in a long import: the call
    starts a template as a cold start does, and the old one (no ranks live in it) is killed, not
    waited for."""
    name = _site_module(tmp_path, monkeypatch, "mpify_slow", "import time\ntime.sleep(3600)")
    assert mpify_nb.ranch(2, hr.modules_then_import, [name], caller_rank=None) == [{name: False}] * 2
    old = template.get_template()
    _wait_until(lambda: old.trying == name, "the template began importing it")
    mpify_nb.set_preload(False)  # the next template imports nothing more: the call is a cold start
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert mpify_nb.ranch(2, hr.rank) == [0, 1]
    assert old._proc.wait(timeout=NO_HANG) == -signal.SIGKILL
    assert old.how_it_ended().startswith("killed by SIGKILL: this process closed it")


def test_a_calls_timeout_does_not_count_the_templates_start(tmp_path):
    """A fresh kernel's first call waits for the template to import torch (seconds): that one-time
    start is not the call's time, so a short timeout holds for the call itself. (Before: ``ranch(2,
    os.getpid, timeout=2)`` failed after 3.2 s, "the template ... is still starting ... after 0 s".)"""
    template.shutdown()
    client = template.get_template()
    os.kill(client.pid, signal.SIGSTOP)  # its start takes 4 s at least, whatever the machine
    resume = threading.Timer(4.0, os.kill, (client.pid, signal.SIGCONT))
    resume.start()
    t0 = time.monotonic()
    try:
        assert mpify_nb.ranch(2, hr.rank, timeout=3) == [0, 1]
    finally:
        resume.join()
    assert time.monotonic() - t0 >= 4.0
    with pytest.raises(TimeoutError, match=r"^ranch: the call did not finish within 3 s"):
        mpify_nb.ranch(2, hr.sleep_in_python, str(tmp_path), 30, timeout=3)  # its own time still counts


def test_a_call_ends_when_its_ranks_do_while_their_template_cannot_tell(tmp_path):
    """The ranks' template is busy (here: stopped) once it forked them, as it is in a long import of
    its preload: their exits are seen on their own pidfds, not waited for from it. Before: the call
    ended after 5 s (each rank's grace, then its burial, waited for the template's word)."""
    assert mpify_nb.ranch(2, hr.rank, caller_rank=None) == [0, 1]  # a template started and ready
    client = template.get_template()
    stop = threading.Timer(0.3, os.kill, (client.pid, signal.SIGSTOP))  # the ranks are forked by then
    stop.start()
    t0 = time.monotonic()
    try:
        assert mpify_nb.ranch(2, hr.sleep_in_python, str(tmp_path), 1.0, caller_rank=None) == [0, 1]
        took = time.monotonic() - t0
    finally:
        stop.join()
        os.kill(client.pid, signal.SIGCONT)
    assert took < 4.0, f"{took:.1f} s"
    assert mpify_nb.ranch(2, hr.rank) == [0, 1]


def test_a_template_that_does_not_start_says_how_long_it_was_waited_for(monkeypatch):
    monkeypatch.setattr(template, "START_PATIENCE", 1.0)
    template.shutdown()
    client = template.get_template()
    os.kill(client.pid, signal.SIGSTOP)  # it never gets through its imports
    with pytest.raises(template.TemplateUnresponsive) as info:
        mpify_nb.ranch(2, hr.rank, timeout=60)
    message = str(info.value)
    found = re.fullmatch(rf"the template process \(pid {client.pid}\) is still starting \(it imports torch\) "
                         r"(\d+\.\d) s after it was started: it is stopped \(SIGSTOP\?\), so it was replaced", message)
    assert found, message
    assert 1.0 <= float(found.group(1)) < NO_HANG
    assert client._proc.wait(timeout=NO_HANG) == -signal.SIGKILL
    monkeypatch.setattr(template, "START_PATIENCE", NO_HANG)
    assert mpify_nb.ranch(2, hr.rank) == [0, 1]  # a fresh one


# -- nothing left to be reaped by PID 1 (issue 35) -----------------------------------------------

#: Stands in for a container's PID 1 that never reaps: a subreaper, so whatever the notebook process
#: leaves behind is re-parented to it; it reports (without reaping) every child it got besides the
#: notebook, once nothing has come for a second.
_REAPER = r"""
import ctypes, os, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
notebook = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
notebook.wait()
assert notebook.returncode == 0, notebook.returncode

def adopted():
    found = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            found += [int(p) for p in f.read().split()]
    out = []
    for pid in found:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        out.append((stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]))
    return sorted(out)

last, quiet_since = None, time.monotonic()
while time.monotonic() - quiet_since < 1.0:
    now = adopted()
    if now != last:
        last, quiet_since = now, time.monotonic()
    time.sleep(0.05)
print("ADOPTED", last)
"""

#: A notebook that ends with its template warm, a Session's ranks alive in it, a ranch call done.
_NOTEBOOK = r"""
import mpify_nb
from mpify_nb import Session, ranch

def rank():
    import os
    return int(os.environ["RANK"])

assert ranch(2, rank) == [0, 1]
session = Session(2)
assert session.run("rank") == {0: 0, 1: 1}
"""


def test_a_notebook_that_ends_leaves_nothing_for_pid_1_to_reap(tmp_path):
    """Issue 35: ``[mpify_nb-tmpl] <defunct>`` was left behind after the test suite, adopted by
    PID 1 (which, in a container, may never reap it): the notebook process ended without waiting
    for its template, which ended after it; the template itself left the ranks it killed to PID 1."""
    import subprocess

    env = dict(os.environ, MPIFY_NB_PREWARM="1")
    out = subprocess.run([sys.executable, "-c", _REAPER, _NOTEBOOK], capture_output=True, text=True, env=env,
                         timeout=NO_HANG, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ADOPTED []", out.stdout + out.stderr[-3000:]
