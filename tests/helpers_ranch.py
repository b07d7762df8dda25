"""Caller-side helpers for the ranch tests: the start-method fixture, process and leak
checks, caller scripts run as subprocesses, and a probe that no rank was started.

Import the fixtures into a test module to use them (``from helpers_ranch import method``).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import pytest

import mpify_nb
from helpers_ranks import start_time
from mpify_nb.start import template

TESTS_DIR = Path(__file__).resolve().parent
SCRIPTS_DIR = TESTS_DIR / "scripts"

#: Run a test under both start methods (spawn is ~2 s a call: use it for a representative subset).
BOTH_METHODS = pytest.mark.parametrize("method", ["template", "spawn"], indirect=True)

Ident = tuple[int, int]  # (pid, start time): a process, immune to pid reuse


@pytest.fixture
def method(request: pytest.FixtureRequest) -> Iterator[str]:
    """The start method for this test ("template" unless parametrized); restored afterwards."""
    chosen = getattr(request, "param", "template")
    previous = mpify_nb.get_start_method()
    mpify_nb.set_start_method(chosen)
    try:
        yield chosen
    finally:
        mpify_nb.set_start_method(previous)


# -- processes -----------------------------------------------------------------------------

def exists(ident: Ident, zombie_ok: bool = False) -> bool:
    """Whether that very process is still there. A zombie counts (nobody reaped it) unless
    ``zombie_ok``: for orphans whose parent was killed, only init can reap them."""
    pid, start = ident
    if start_time(pid) != start:
        return False
    if zombie_ok:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state not in ("Z", "X")
    return True


def still_there(idents, timeout: float = 0.0, zombie_ok: bool = False) -> list[Ident]:
    """The processes among ``idents`` that still exist after waiting up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = [i for i in idents if exists(tuple(i), zombie_ok)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def assert_gone(idents, timeout: float = 0.0, what: str = "rank", zombie_ok: bool = False) -> None:
    left = still_there(idents, timeout, zombie_ok)
    assert not left, f"{what} processes still there: {[describe(i) for i in left]}"


def describe(ident: Ident) -> str:
    pid = ident[0]
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} [{state}] {cmdline[:120]}"


def records(directory: Path) -> dict[int, Ident]:
    """The identities ranks wrote with helpers_ranks.record(), by rank."""
    found = {}
    for path in Path(directory).glob("*.json"):
        found[int(path.stem)] = tuple(json.loads(path.read_text()))
    return found


def wait_for_records(directory: Path, count: int, timeout: float = 60.0,
                     proc: Optional[subprocess.Popen] = None) -> dict[int, Ident]:
    """Wait until ``count`` ranks recorded themselves (they are running user code)."""
    deadline = time.monotonic() + timeout
    while True:
        found = records(directory)
        if len(found) >= count:
            return found
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the caller script exited ({proc.returncode}) early:\n{out}\n{err}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"only {sorted(found)} of {count} ranks started within {timeout} s")
        time.sleep(0.05)


def children_of(pid: int) -> set[Ident]:
    """Direct children of ``pid`` (found by scanning /proc: no psutil needed)."""
    kids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            kids.add((int(entry), int(fields[19])))
    return kids


def current_template() -> Optional[Ident]:
    """The warm template of this process, if one is running (without starting one)."""
    client = template._client
    if client is None or not client.alive():
        return None
    start = start_time(client.pid)
    return None if start is None else (client.pid, start)


def leak_snapshot() -> dict:
    """What a call could leave behind in this process: child processes (the template's
    own children are ranks), open file descriptors, threads."""
    # Garbage first: an earlier test's exception traceback can keep, say, a gloo process
    # group alive in a reference cycle; its fds are not this call's leak.
    gc.collect()
    # The short-lived thread a call starts to let the template learn what its ranks imported
    # (template.learn) is not a leak once it has ended: wait for it, as for any condition.
    from mpify_nb.start import template

    template.wait_preloaded(timeout=60)
    tmpl = current_template()
    kids = children_of(os.getpid())
    return {
        "children": sorted(kids - {tmpl}) if tmpl else sorted(kids),
        "ranks under the template": sorted(children_of(tmpl[0])) if tmpl else [],
        "fds": sorted(os.listdir("/proc/self/fd")),
        "threads": sorted(t.name for t in threading.enumerate()),
    }


# -- "no rank was started" -----------------------------------------------------------------

_spawned: list[tuple] = []
_watching_spawns = False


def _audit(event: str, args: tuple) -> None:
    if _watching_spawns and event in ("subprocess.Popen", "os.fork", "os.posix_spawn", "os.exec"):
        _spawned.append((event, args[:2]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it only records while a probe is on


@contextmanager
def no_rank_started() -> Iterator[None]:
    """Fail if a rank was started inside the block: no new process in this process
    (audit events) and no fork request to the template (its request counter)."""
    global _watching_spawns
    client = template.get_template()
    client.wait_ready()
    # White-box on purpose: the template forks ranks in another process, which no audit
    # event of ours sees; its request counter is the one witness that none was asked for.
    requests_before = client._next_id
    _spawned.clear()
    _watching_spawns = True
    try:
        yield
    finally:
        _watching_spawns = False
    assert not _spawned, f"processes were started: {_spawned}"
    assert template.get_template() is client, "the template was restarted"
    assert client._next_id == requests_before, "ranks were forked from the template"


# -- after a failure -----------------------------------------------------------------------

def assert_next_call_works(nprocs: int = 2) -> None:
    """A failed call must leave nothing that breaks the next one."""
    from helpers_ranks import rank_and_identity

    results = mpify_nb.ranch(nprocs, rank_and_identity)
    assert [r for r, _ in results] == list(range(nprocs))
    assert results[0][1][0] == os.getpid()
    assert_gone([ident for _, ident in results[1:]])


# -- caller scripts ------------------------------------------------------------------------

def start_script(name: str, *args: str, method: str = "template", env: Optional[dict] = None,
                 new_session: bool = True) -> subprocess.Popen:
    """Start tests/scripts/<name> as a caller process, in its own session (like a kernel:
    an interrupt goes to its whole process group), with text pipes."""
    full_env = dict(os.environ, MPIFY_NB_START_METHOD=method, PYTHONUNBUFFERED="1")
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS_DIR)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else []))
    if env:
        full_env.update(env)
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS_DIR / name), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=full_env, start_new_session=new_session,
    )


def finish(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[str, str]:
    """Wait for a script; kill it (by pid) if it overruns, and fail."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"script did not finish within {timeout} s:\n{out}\n{err}") from None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a script started by start_script and its process group (our own processes only)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def scripts() -> Iterator[list[subprocess.Popen]]:
    """Scripts a test starts; whatever is still running at the end is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            kill_group(proc)
            proc.communicate()
