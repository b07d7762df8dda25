"""Shared pytest setup.

Notebook tests run their cells in a real Jupyter kernel through :mod:`nbutil` (nbclient
+ ipykernel, on this interpreter). The ``notebook`` fixture gives them ``run_cells``;
each call starts its own kernel and shuts it down, checking nothing it started is left.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable

import pytest

# Preloading (a template started in the background after a call) would show up in the tests that
# check a call leaves no process or thread behind. Off by default here, and in the kernels tests
# start (they inherit this environment); test_preload.py and test_libraries.py turn it on.
os.environ.setdefault("MPIFY_NB_PRELOAD", "0")
# The warm-up between cells (torch._dynamo imported by each kernel and its template, 1-2 CPU-s each,
# whenever a kernel is idle for a second: 27% of the CPU time of the kernel-heavy modules) is what
# test_warmup.py tests; elsewhere kernels start their template at import, as by default, and warm
# nothing up. test_notebook.py's example notebook and test_warmup.py run with the default, "1".
os.environ.setdefault("MPIFY_NB_PREWARM", "template")

# nbutil sits next to this file; make it importable as a plain module from any test.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def notebook() -> Callable:
    """``run_cells(cells, timeout=120, allow_errors=False)`` -> executed cells, in a fresh kernel.

    Skips the test when the notebook stack (nbclient, ipykernel) is not installed.
    """
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    import nbutil

    return nbutil.run_cells


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Remember on the test item whether its call failed (for _recover_shared_kernels)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        item.mpify_nb_failed = True


@pytest.fixture(autouse=True)
def _recover_shared_kernels(request):
    """After a test that failed, each module-scoped kernel it used (nbutil.SharedKernel) is
    replaced by a fresh one: the next test does not inherit a stuck or dead rank."""
    yield
    if not getattr(request.node, "mpify_nb_failed", False):
        return
    import nbutil

    for value in list(getattr(request.node, "funcargs", {}).values()):
        if isinstance(value, nbutil.SharedKernel):
            value.recover()


@pytest.fixture
def rank_imports_from_here():
    """Ranks import what the notebook imported (wire/modules.py), as by default, where "the notebook"
    is the test from here on: what the pytest process had imported before it (every collected test
    module's libraries: Ray, fastai, Lightning, transformers...) is left out, as for a notebook that
    never imported them. Otherwise every rank of every call imports them all, and a preloading template
    too (a minute per test in the full suite, seconds alone), and what a test checks would depend on
    which other tests were collected. For the tests of rank imports and preloading (pytest_configure
    turns rank imports off in this process for the rest)."""
    from mpify_nb.wire import modules

    enabled, left_out = modules._enabled, set(modules._leave_out)
    modules._leave_out.update({name.partition(".")[0] for name in list(sys.modules)})
    modules.set_rank_imports(True)
    yield
    modules._leave_out.clear()
    modules._leave_out.update(left_out)
    modules._enabled = enabled
    modules._cache.clear()


@pytest.fixture
def checks_off(monkeypatch):
    """The check off, as ``MPIFY_NB_COLLECTIVE_CHECKS=0`` says, for this process and the ranks it starts."""
    from mpify_nb.torchdist.checks import wrappers

    monkeypatch.setenv(wrappers.VARIABLE, "0")
    previous = wrappers.enabled()
    wrappers.set_enabled(False, install=False)
    yield
    wrappers.set_enabled(previous, install=False)


@pytest.fixture
def sigint_handler():
    """Python's own SIGINT handler (KeyboardInterrupt), with mpify_nb's in front of it as
    ``import mpify_nb`` puts it (engine/interrupts.py), for a test that interrupts this process.

    A run started with SIGINT ignored (``nohup ... &``, ``cmd &`` in a script, some CI runners)
    has none, and mpify_nb keeps a process's ``SIG_IGN`` (a call never turns the user's SIGINT
    into KeyboardInterrupt there): such a test sets the handler it needs, and puts the old one back.
    """
    from mpify_nb.engine import interrupts

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupts.install()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def pytest_configure(config: pytest.Config) -> None:
    """Ranks import what the caller imported before each call (wire/modules.py). The pytest process is no
    notebook: it holds the test tooling and every library a test module imports at collection (ray, fastai,
    sklearn...), so each rank of every in-process call would import them all again. Off in this process
    only; the kernels and scripts the tests start keep the default, as a user's notebook has it
    (test_shipping and test_preload turn it on here where they test it)."""
    from mpify_nb.wire import modules

    modules.set_rank_imports(False)
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):  # once, in the controller
        _compile_once()


def _compile_once() -> None:
    """Where PYTHONDONTWRITEBYTECODE is set (this machine, many containers), no process caches what it
    compiles: pip compiled site-packages at install, but not the package's source (an editable install)
    nor the tests' helpers, so each of the suite's processes that imports them (every kernel, template,
    script, the floor's too) compiled them again (~0.1 CPU-s a kernel, on a CPU-bound CI). Compiled
    once here, before any test runs; the files do not change during a run, and nothing writes any
    later (the variable stays set: a test's own modules are compiled as the user's would be)."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for folder in (root / "src", root / "tests"):
        compileall.compile_dir(str(folder), quiet=2)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` (pyproject.toml's addopts), with the longest units first and test_docs.py cut
    per page: tests/scheduling.py."""
    if config.getvalue("dist") != "loadfile":
        return None
    from scheduling import LongestFirst

    return LongestFirst(config, log)
