"""nox sessions: tests, lint, typecheck, package, docs, floor, bench.

torch is pinned in each install (one pip call) to the CPU wheel this project is tested with
(an unpinned torch would pull a multi-GB CUDA build); the package itself only
asks for a range, so users bring their own torch. ``floor`` runs the
version-sensitive tests on the oldest torch of that range.

``.ci/run`` runs the README's test command, then ``nox -s lint typecheck package docs floor``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import nox

TORCH = "torch==2.13.0"
#: The oldest torch we support (pyproject.toml: torch>=2.4; src/mpify_nb/torchdist/compat.py: FLOOR).
FLOOR_TORCH = "torch==2.4.1"
#: The test modules whose behaviour depends on torch's version: process groups made, destroyed,
#: aborted and rebuilt, stuck and mismatched collectives, DDP/FSDP/DTensor, gloo's output, debugging
#: on ranks. (test_ranch, calls and their payloads, is left to the main run: ~20 s saved.)
FLOOR_TESTS = [
    "tests/test_torch_versions.py",
    "tests/test_ddp.py",
    "tests/test_failures.py",
    "tests/test_session.py",
    "tests/test_session_magics.py",
    "tests/test_magics.py",
    "tests/test_debugging.py",
    "tests/test_mismatch.py",
    "tests/test_collective_checks.py",
]
#: What FLOOR_TESTS need of the test extra (kernels, notebooks, the timeout and xdist plugins; matplotlib and tqdm
#: in ranks' cells, ipywidgets for tqdm's widget bar).
FLOOR_PACKAGES = ["pytest", "pytest-timeout", "pytest-xdist", "ipykernel", "nbclient", "nbformat", "matplotlib", "tqdm",
                  "ipywidgets"]
nox.options.sessions = ["tests", "lint", "typecheck", "package", "docs", "floor"]
#: For the venvs whose packages are read (pyright), built or imported by a process or two: pip compiles every
#: module it installs to bytecode by default, half of such an install's CPU time (torch alone is thousands
#: of files). Not for the venvs tests run in: where PYTHONDONTWRITEBYTECODE is set (this machine), every
#: process would compile every module it imports, each time (the suite's CPU time doubled).
NO_COMPILE = "--no-compile"


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[test]")
    # fastai pulls PyPI's torchvision, which fails to import beside the CPU torch wheel and then breaks
    # `import lightning` (torchmetrics imports it when installed): remove it then (see .ci/run).
    session.run("sh", "-c", 'python -c "import torchvision" 2>/dev/null || python -m pip uninstall -q -y torchvision',
                external=True)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(NO_COMPILE, "ruff==0.17.6")  # pinned: a new ruff brings new rules
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py", "mkdocs_hooks.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """pyright over src/ with the settings in pyproject.toml ([tool.pyright])."""
    # matplotlib: optional at run time (a Session rank shows figures with it), checked here all the same;
    # ipykernel (and its pyzmq): the frontend a rank's stdin asks through (prompts.py), when there is one;
    # ipywidgets (the widgets extra): the tabs view (magics/views.py) and ranks' widgets.
    session.install(NO_COMPILE, TORCH, "-e", ".[ray,widgets]", "pyright==1.1.414", "matplotlib", "ipykernel")
    session.run("pyright", *session.posargs)


@nox.session
def package(session: nox.Session) -> None:
    """Build the sdist and wheel, check them, install the wheel (not the tree) and run the demo."""
    session.install(NO_COMPILE, "build", "twine")
    tmp = os.path.abspath(session.create_tmp())
    # A fresh venv of its own, holding torch only: the wheel alone must carry what else the demo needs.
    # Made in the install step (``--install-only``: .ci/run makes it while the suite runs).
    venv = os.path.join(tmp, "wheel-venv")
    python = os.path.join(venv, "bin", "python")
    session.run_install("python", "-m", "venv", "--clear", venv)
    session.run_install(python, "-m", "pip", "install", "-q", NO_COMPILE, TORCH, external=True)
    dist = os.path.join(tmp, "dist")
    shutil.rmtree(dist, ignore_errors=True)  # a wheel of an earlier run would be picked up
    if session.run("python", "-m", "build", "--outdir", dist) is None:
        return  # --install-only: the venvs are made, and nothing is built
    built = sorted(glob.glob(os.path.join(dist, "*")))
    session.run("twine", "check", "--strict", *built)
    wheel = next(path for path in built if path.endswith(".whl"))
    # (the wheel of an earlier ``nox -R`` run out first: same version, pip would keep it)
    session.run(python, "-m", "pip", "uninstall", "-q", "-y", "mpify_nb", external=True)
    session.run(python, "-m", "pip", "install", "-q", wheel, external=True)
    demo = os.path.abspath("examples/demo.py")
    # Run from outside the checkout, so `import mpify_nb` can only find the installed wheel.
    with session.chdir(tmp):
        session.run(python, "-c", "import mpify_nb, importlib.metadata as m; "
                    "assert mpify_nb.__version__ == m.version('mpify_nb'), 'version mismatch'; "
                    "print('installed', mpify_nb.__file__, mpify_nb.__version__)", external=True)
        session.run(python, demo, external=True)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site into site/ with ``mkdocs build --strict``: a broken link, anchor or API reference, a
    missing snippet or an example notebook that fails (the build runs them, mkdocs_hooks.py) fails it.
    Then tests/site_links.py crawls site/: every internal link and anchor of every page, the notebook
    pages included, must resolve. Every code block of the pages themselves is run by tests/test_docs.py."""
    session.install(NO_COMPILE, TORCH, "-e", ".[docs]")
    session.env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner about its successor, on every build
    session.run("mkdocs", "build", "--strict", *session.posargs)
    # --strict checks the Markdown pages' links, not the notebook pages' (mkdocs-jupyter renders them
    # later) nor the anchors the pages end up with: crawl what was built (a second or two).
    session.run("python", "tests/site_links.py", "site")


def floor_requirements() -> list[str]:
    """The test extra's requirements (pyproject.toml, with their version ranges) that FLOOR_TESTS use:
    the floor job installs only these, not Ray, Lightning, transformers, fastai or JupyterLab."""
    import tomllib

    with open("pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    found = [spec for spec in extra if re.split(r"[\[<>=!~ ;]", spec, maxsplit=1)[0] in FLOOR_PACKAGES]
    names = {re.split(r"[\[<>=!~ ;]", spec, maxsplit=1)[0] for spec in found}
    if names != set(FLOOR_PACKAGES):
        raise ValueError(f"FLOOR_PACKAGES not in pyproject.toml's test extra: {sorted(set(FLOOR_PACKAGES) - names)}")
    return found


@nox.session
def floor(session: nox.Session) -> None:
    """The version-sensitive tests (FLOOR_TESTS; or the ``tests/...`` named after ``--``, where
    pytest's other arguments, such as ``-n 3``, are passed on) on the floor, FLOOR_TORCH, as the
    package index builds it: a CUDA build (~3 GB of wheels) that runs on CPU. One install, torch
    pinned so nothing may upgrade it. .ci/run makes its venv beside the main install and the suite
    (``--install-only``, 5.2 GB), and runs its tests (``-R``) once the suite is done, beside the docs."""
    session.install(FLOOR_TORCH, "-e", ".", *floor_requirements())
    session.run("python", "-c", f"import torch; assert torch.__version__.split('+')[0] == "
                f"{FLOOR_TORCH.split('==')[1]!r}, torch.__version__; print('torch', torch.__version__)")
    tests = [arg for arg in session.posargs if arg.startswith("tests")]
    options = [arg for arg in session.posargs if arg not in tests]
    session.run("python", "-m", "pytest", *options, *(tests or FLOOR_TESTS))


@nox.session
def bench(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[test]")
    session.run("python", "benchmarks/run_all.py", *session.posargs)
