"""nox sessions: tests, lint, bench.

torch is installed first, pinned to the CPU wheel this project is tested with
(an unpinned torch would pull a multi-GB CUDA build); the package itself only
asks for a range, so users bring their own torch.
"""

import nox

TORCH = "torch==2.13.0"
nox.options.sessions = ["tests", "lint"]


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py")


@nox.session
def bench(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("python", "benchmarks/run_all.py", *session.posargs)
