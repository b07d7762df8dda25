"""Preloading (issue 9 point 5): the template comes to hold the installed modules ranks need.

Calls run with ``caller_rank=None`` where a module must reach the template only through what
a *rank* imported (the caller's own imports count as the notebook's). Each test starts and
ends with a fresh template and a blank preload memory.
"""

from __future__ import annotations

import importlib.machinery
import sys
import uuid

import pytest

import helpers_ranks as hr
import mpify_nb
from mpify_nb.rank import code_cache, imports_news
from mpify_nb.start import preload, template
from mpify_nb.wire import modules as rank_modules

# Standard-library modules that neither torch, numpy nor torch._dynamo import (the base template lacks them).
POOL = ["wave", "netrc", "tabnanny", "sched", "pyclbr", "filecmp", "graphlib", "poplib", "ftplib", "imaplib",
        "smtplib", "mailbox"]


def unused(k: int) -> list[str]:
    """``k`` of them this process has not imported either (so only a rank's import can teach them)."""
    names = [name for name in POOL if name not in sys.modules][:k]
    assert len(names) == k, "this process imported most of the pool: add more names"
    return names


@pytest.fixture(autouse=True)
def fresh(rank_imports_from_here):
    def reset(enabled: bool):
        template.wait_preloaded(timeout=120)  # what the last call set going in the background
        template.shutdown()
        preload._learned.clear()
        preload._failed.clear()
        preload._named.clear()
        preload._sources.clear()
        preload._enabled = enabled

    was = preload.enabled()  # off for the rest of the suite (conftest): leave it so
    reset(True)
    yield
    reset(was)


def held_at_start(names: list) -> list[dict]:
    return mpify_nb.ranch(2, hr.modules_then_import, names, caller_rank=None)


def test_base_template_lacks_the_pool():
    # Only those this process has not imported: the ranks import the caller's modules before fn
    # runs (as in a notebook), and earlier tests in the suite import some of the pool (matplotlib
    # imports colorsys).
    names = unused(3)
    assert held_at_start(names) == [dict.fromkeys(names, False)] * 2


def test_a_module_a_rank_imported_in_call_1_is_in_the_rank_of_call_3():
    [mod] = unused(1)
    assert held_at_start([mod]) == [{mod: False}] * 2  # call 1: imported by the ranks
    assert template.wait_preloaded(timeout=120)
    held_at_start([])  # call 2
    assert held_at_start([mod]) == [{mod: True}] * 2  # call 3: there before fn began
    assert mod in template.get_template().holds()


def test_working_directory_modules_are_never_preloaded(tmp_path, monkeypatch):
    name = f"mpify_cwd_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)  # the notebook imported it too
    [mod] = unused(1)
    try:
        held_at_start([name, mod])
        assert template.wait_preloaded(timeout=120)
        held_at_start([])
        # The stdlib module was preloaded (so a preloading template did come), the user's own was not:
        # the ranks hold it because they import what the notebook imported before each call.
        assert held_at_start([name, mod]) == [{name: True, mod: True}] * 2
        assert mod in template.get_template().holds()
        assert template.get_template().lacks([name]) == [name]
    finally:
        sys.modules.pop(name, None)


def test_the_notebooks_own_modules_are_compiled_by_the_template_once_an_edit_is_seen(tmp_path, monkeypatch):
    """Where Python keeps no compiled code (PYTHONDONTWRITEBYTECODE), every rank compiled the
    notebook's own modules again on every call: the template compiles each version of their files
    once (never imports them), and a rank takes that code for the very source it reads."""
    name = f"mpify_own_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text("VALUE = 1\n\n\ndef f():\n    return VALUE\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    __import__(name)  # the notebook imported it: every rank imports it before its call
    try:
        assert mpify_nb.ranch(2, hr.held_code_of, name, caller_rank=None) == [(1, True)] * 2
        path.write_text("VALUE = 22  # edited\n\n\ndef f():\n    return VALUE\n")
        assert mpify_nb.ranch(2, hr.held_code_of, name, caller_rank=None) == [(22, True)] * 2
        assert template.get_template().lacks([name]) == [name]  # compiled there, never imported
    finally:
        sys.modules.pop(name, None)


def test_the_notebooks_own_modules_are_compiled_between_cells_before_the_first_call(tmp_path, monkeypatch):
    """The template compiled them at the first call's fork (~10 ms of the caller's first DDP call, 1.54x its
    later ones): what makes it grow between cells (the warm-up, a rank's import news) has it compile them too."""
    name = f"mpify_own_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text("VALUE = 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    try:
        client = template.get_template()
        client.wait_ready(120)
        asked: list[list[str]] = []
        monkeypatch.setattr(client, "compile", lambda files: asked.append(list(files)))
        template.refresh()
        assert [str(path) in files for files in asked] == [True]
    finally:
        sys.modules.pop(name, None)


def test_held_code_serves_only_the_source_it_was_compiled_from(tmp_path, monkeypatch):
    loader = importlib.machinery.SourceFileLoader
    monkeypatch.setattr(loader, "source_to_code", loader.source_to_code)  # ours goes with the test
    monkeypatch.setattr(code_cache, "_original", None)
    monkeypatch.setattr(code_cache, "_held", {})
    monkeypatch.setattr(code_cache, "_seen", {})
    code_cache.install()
    path = tmp_path / "own.py"
    path.write_text("X = 1\n")
    code_cache.hold([str(path)])
    held = code_cache._held[(str(path), -1)][1]
    assert loader("own", str(path)).source_to_code(path.read_bytes(), str(path)) is held
    edited = loader("own", str(path)).source_to_code(b"X = 2\n", str(path))  # edited since it was held
    assert edited is not held and eval(edited, {}) is None
    # One that warns when compiled is left to the rank, which shows the warning as before.
    warns = tmp_path / "warns.py"
    warns.write_text('S = "\\d"\n')
    code_cache.hold([str(warns), str(tmp_path / "gone.py")])
    assert (str(warns), -1) not in code_cache._held


def test_a_ranks_news_are_what_it_imported_since_birth_in_import_order(monkeypatch):
    monkeypatch.setattr(imports_news, "_born_with", set())
    monkeypatch.setattr(imports_news, "_told", set())
    monkeypatch.setattr(imports_news, "_held_len", -1)
    first, second = unused(2)
    imports_news.born()
    assert imports_news.news() == []
    try:
        for name in (first, second):
            __import__(name)
        told = [name for name, _ in imports_news.news()]  # with what they imported that was new
        assert [name for name in told if name in (first, second)] == [first, second]
        assert imports_news.news() == []  # told once
    finally:
        for name in (first, second):
            sys.modules.pop(name, None)


def test_set_preload_false_turns_it_off():
    first, second = unused(2)
    held_at_start([first])
    assert template.wait_preloaded(timeout=120)
    assert held_at_start([first]) == [{first: True}] * 2
    mpify_nb.set_preload(False)  # the next call starts from a template holding torch only
    assert held_at_start([first, second]) == [{first: False, second: False}] * 2
    assert template.wait_preloaded(timeout=120)
    held_at_start([])
    assert held_at_start([first, second]) == [{first: False, second: False}] * 2


def test_named_modules_are_preloaded_before_any_rank_imports_them():
    [mod] = unused(1)
    held_at_start([])
    mpify_nb.set_preload([mod])
    assert template.wait_preloaded(timeout=120)
    assert held_at_start([mod]) == [{mod: True}] * 2


def test_a_module_that_fails_in_the_template_is_skipped_and_remembered(tmp_path, monkeypatch):
    # Installed (under a site-packages directory) and fine in a rank, but it raises where
    # RANK is not set: in the template.
    site = tmp_path / "site-packages"
    site.mkdir()
    name = f"mpify_broken_{uuid.uuid4().hex[:8]}"
    (site / f"{name}.py").write_text(
        "import os\nif 'RANK' not in os.environ:\n    raise RuntimeError('only in a rank')\n")
    monkeypatch.syspath_prepend(str(site))
    [mod] = unused(1)
    held_at_start([name, mod])
    assert template.wait_preloaded(timeout=120)
    held_at_start([])
    # The template works, holds the stdlib module, and left the broken one out.
    assert held_at_start([name, mod]) == [{name: False, mod: True}] * 2
    assert "only in a rank" in preload.failed()[name]
    template.refresh()  # remembered: the template is not asked for it again
    assert name not in template.get_template().held.queued and name in template.get_template().failed


def test_the_environment_variable_names_modules_and_turns_it_off(monkeypatch):
    monkeypatch.setenv("MPIFY_NB_PRELOAD", "colorsys, wave")
    preload._from_environment()
    assert preload.named() == ["colorsys", "wave"] and preload.enabled()
    monkeypatch.setenv("MPIFY_NB_PRELOAD", "0")
    preload._from_environment()
    assert not preload.enabled()


@pytest.mark.parametrize("what, source, why", [
    # CUDA mocked (a CPU machine): what torch.cuda.is_initialized() reads after a real cuInit.
    ("cuda", "import torch\ntorch.cuda._initialized = True\n", "initializes CUDA"),
    ("thread", "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n",
     "starts a thread"),
    # A helper process every rank would hold the Popen of, while the template's reaper kills it.
    ("process", "import subprocess, sys\n"
                "helper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n",
     "starts a process"),
])
def test_a_module_that_would_make_forks_unsafe_is_left_out(tmp_path, monkeypatch, what, source, why):
    # Such a module makes its template unusable: it is dropped, and a template without it takes over.
    site = tmp_path / "site-packages"
    site.mkdir()
    name = f"mpify_{what}_{uuid.uuid4().hex[:8]}"
    (site / f"{name}.py").write_text("import os\nif 'RANK' not in os.environ:\n" +
                                     "".join("    " + line + "\n" for line in source.splitlines()))
    monkeypatch.syspath_prepend(str(site))
    [mod] = unused(1)
    held_at_start([name, mod])
    assert template.wait_preloaded(timeout=120)
    held_at_start([])
    assert held_at_start([name, mod]) == [{name: False, mod: True}] * 2
    assert why in preload.failed()[name]


def test_a_module_only_the_notebook_imported_is_on_every_rank_imported_once_by_the_template(tmp_path, monkeypatch):
    """Issue 27: a call behaves the same whether or not the template holds a module, so every rank
    holds what the notebook imported before it loads the call. Issue 36: the template imports it
    (once, before the first call's forks), instead of every rank of every call."""
    site = tmp_path / "site-packages"
    site.mkdir()
    log = tmp_path / "imports.log"
    name = f"mpify_noisy_{uuid.uuid4().hex[:8]}"
    (site / f"{name}.py").write_text(f"with open({str(log)!r}, 'a') as f:\n    f.write('imported\\n')\n")
    monkeypatch.syspath_prepend(str(site))
    __import__(name)  # the notebook's own import
    try:
        mpify_nb.set_preload(False)
        assert held_at_start([name]) == [{name: True}] * 2  # imported before the call began...
        assert log.read_text() == "imported\n" * 3  # ...by each rank: the notebook, then ranks 0 and 1
        mpify_nb.set_preload(True)
        for _ in range(3):
            assert held_at_start([name]) == [{name: True}] * 2  # the same...
        assert name in template.get_template().holds()
        assert log.read_text() == "imported\n" * 4  # ...but imported once more in all: by the template
    finally:
        sys.modules.pop(name, None)


def test_the_submodules_of_a_module_left_out_are_left_out_too():
    """Ranks import every module the notebook imported, so the template learns whole packages: once a
    package is left out (it started a thread), its submodules must not cost a candidate each."""
    preload._learned.update(dict.fromkeys(["pkgx", "pkgx.sub", "pkgx.sub.deep", "pkgxy", "other"]))
    preload.mark_failed("pkgx", "it starts a thread at import")
    assert preload.wanted() == ["pkgxy", "other"]


def test_from_the_second_call_on_back_to_back_no_rank_imports_what_an_earlier_call_or_the_caller_did(
        tmp_path, monkeypatch):
    """Issue 36: calls 2-4 right after call 1 (no wait for the template): their ranks are born holding
    what call 1's ranks imported (the template imported it beside call 1, as the ranks reported it)
    and what the caller imported meanwhile, so they import nothing at all."""
    names = unused(2)
    first = mpify_nb.ranch(2, hr.import_then_report, names, caller_rank=None)
    assert all(set(names) <= set(imported) for imported in first)  # call 1 paid for them
    site = tmp_path / "site-packages"
    site.mkdir()
    mine = f"mpify_caller_{uuid.uuid4().hex[:8]}"
    (site / f"{mine}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(site))
    __import__(mine)  # the caller imports a library between two calls
    roots = rank_modules.Roots(None)
    try:
        for _ in range(3):
            imported = mpify_nb.ranch(2, hr.import_then_report, names + [mine], caller_rank=None)
            # Only the caller's own code, which a rank imports afresh every call (the user edits it).
            assert [[n for n in each if roots.installed(sys.modules[n].__file__)] for each in imported] == [[], []]
            assert [mine in each for each in imported] == [False, False]
    finally:
        sys.modules.pop(mine, None)
