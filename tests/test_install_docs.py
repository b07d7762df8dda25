"""A newcomer's path (issue 39): the README says what the project is before its two commands, and those are
the commands CI runs; the install page gives one line for CPU (PyTorch's CPU index), one for CUDA and one for
fastai, each a command pip itself parses, Jupyter included; no page installs mpify_nb from PyPI, where it is
not; a page that runs nox says how to get it.

The walk itself (a fresh venv, these lines, a kernel running the quickstart's first 2-rank cell) is timed by
hand for each docs change that touches it: tests/scripts/newcomer.py.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import tomllib

import docblocks

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INSTALL = ROOT / "docs" / "install.md"


def _torch_pin() -> str:
    found = re.search(r'^TORCH = "(torch==[^"]+)"$', (ROOT / "noxfile.py").read_text(), re.M)
    assert found, "noxfile.py's TORCH pin"
    return found.group(1)


def _commands(block: docblocks.Block) -> list[str]:
    """The shell commands of a bash block: one per line (comments dropped), cut at && and ||."""
    found = []
    for line in block.code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        found += [part.strip() for part in re.split(r"&&|\|\||[;{}]", line) if part.strip()]
    return found


def pip_install(command: str):
    """``(requirements, editables, options)`` of a ``pip install`` command, read by pip's own parser (so a
    wrong option or a misplaced quote fails here as it would for the reader)."""
    commands = pytest.importorskip("pip._internal.commands")
    words = shlex.split(command)
    at = words.index("install")
    # the command alone, as on a machine without pip configuration (this one's adds indexes)
    saved = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    for name in saved:
        del os.environ[name]
    os.environ["PIP_CONFIG_FILE"] = os.devnull
    try:
        options, args = commands.create_command("install").parse_args(words[at + 1:])
    finally:
        del os.environ["PIP_CONFIG_FILE"]
        os.environ.update(saved)
    return args, options.editables, options


def _bash_blocks(page: Path) -> list[docblocks.Block]:
    return [b for b in docblocks.page_blocks(page) if b.lang == "bash"]


def _section(page: Path, title: str) -> str:
    text = page.read_text()
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"{page.relative_to(ROOT)} has no section '## {title}'"
    return found.group(1)


def _installs_in(markdown: str) -> list[str]:
    blocks = docblocks.blocks_of(markdown, "section")
    return [c for b in blocks if b.lang == "bash" for c in _commands(b) if re.search(r"\bpip install\b", c)]


# -- the README --------------------------------------------------------------------------------------

def test_the_readme_says_what_the_project_is_before_its_two_commands():
    text = (ROOT / "README.md").read_text()
    before_first_block = text[:text.index("```")]
    assert "runs PyTorch code on many processes" in before_first_block
    assert "Jupyter" in before_first_block and "not on PyPI" in before_first_block.replace("Not on PyPI", "not on PyPI")
    demo, suite = _bash_blocks(ROOT / "README.md")[:2]
    assert demo.code.endswith("examples/demo.py")
    assert suite.code.endswith("-m pytest -q")


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run installs what the README's `pip install` does (``readme_install``), with uv into the venv the
    suite runs in, and has pip check it (a dry run of the same install), then runs the same steps."""
    suite = _bash_blocks(ROOT / "README.md")[1]
    ci = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    ci_lines = [line for line in ci.splitlines() if not line.lstrip().startswith("#")]
    arguments = next(re.fullmatch(r"readme_install=\((.*)\)(\s+#.*)?", line.strip()) for line in ci_lines
                     if line.startswith("readme_install="))
    assert arguments, "no readme_install=(...) in .ci/run"
    readme_install = next(c for c in _commands(suite) if "pip install" in c)
    readme_reqs, readme_editables, _ = pip_install(readme_install)
    ci_reqs, ci_editables, _ = pip_install("pip install " + arguments.group(1))
    assert _torch_pin() in readme_reqs, "the README pins noxfile.py's TORCH"
    assert set(readme_reqs) <= set(ci_reqs) and readme_editables == ci_editables, (readme_install, arguments)
    uses = [line for line in ci_lines if '"${readme_install[@]}"' in line]
    assert any(".venv/bin/uv pip install" in line for line in uses), uses
    assert any(".venv/bin/pip install -q --dry-run" in line for line in uses), uses
    for step in ("python3 -m venv .venv", '.venv/bin/python -c "import torchvision" 2>/dev/null || .venv/bin/pip '
                 "uninstall", ".venv/bin/python -m pytest -q"):
        assert step in suite.code, f"the README's test command lacks {step!r}"
        assert step.split(" -q")[0] in "\n".join(ci_lines), f".ci/run lacks the README's {step!r}"


# -- the install page ----------------------------------------------------------------------------------

def test_the_cpu_line_takes_torch_from_pytorchs_cpu_index_with_jupyter():
    installs = _installs_in(_section(INSTALL, "On CPU"))
    assert len(installs) == 1, installs
    requirements, editables, options = pip_install(installs[0])
    assert CPU_INDEX in [*options.extra_index_urls, options.index_url]
    assert _torch_pin() in requirements
    assert editables == [".[jupyter]"]


def test_the_cuda_line_takes_pypis_torch_with_jupyter():
    installs = _installs_in(_section(INSTALL, "On GPUs (CUDA)"))
    assert len(installs) == 1, installs
    requirements, editables, options = pip_install(installs[0])
    assert not options.extra_index_urls and options.index_url == "https://pypi.org/simple"
    assert _torch_pin() in requirements and editables == [".[jupyter]"]


def test_the_fastai_line_keeps_torch_and_brings_accelerate():
    section = _section(INSTALL, "With fastai")
    installs = _installs_in(section)
    assert len(installs) == 1, installs
    requirements, _, options = pip_install(installs[0])
    assert {_torch_pin(), "fastai", "accelerate"} <= set(requirements), "torch pinned in the same command"
    assert CPU_INDEX in options.extra_index_urls
    assert "NameError: name 'Accelerator' is not defined" in section
    assert "torchvision::nms" in section


def test_the_jupyter_extra_brings_jupyterlab_and_ipykernel():
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {re.split(r"[\[<>=!~ ;]", spec, maxsplit=1)[0] for spec in extras["jupyter"]}
    assert {"jupyterlab", "ipykernel"} <= names


def test_the_quickstart_says_where_jupyter_comes_from():
    text = (ROOT / "docs" / "quickstart.md").read_text()
    assert "](install.md" in text and "jupyter lab" in text


# -- every page --------------------------------------------------------------------------------------

def _every_command() -> list[tuple[str, str]]:
    found = []
    for page in docblocks.pages():
        where = str(page.relative_to(ROOT))
        for block in _bash_blocks(page):
            found += [(f"{block.where}", c) for c in _commands(block)]
        # commands quoted in the prose too: `pip install ...`
        found += [(where, m.group(1)) for m in re.finditer(r"`(pip install [^`]+)`", page.read_text())]
    return found


def test_every_pip_install_parses_and_none_takes_mpify_nb_from_the_index():
    problems = []
    for where, command in _every_command():
        if not re.search(r"\bpip install\b", command):
            continue
        try:
            requirements, editables, _ = pip_install(command)
        except (SystemExit, ValueError) as e:
            problems.append(f"{where}: pip cannot parse {command!r}: {e}")
            continue
        for req in requirements:
            if re.match(r"mpify_nb\b", req) and "@" not in req:
                problems.append(f"{where}: {command!r} installs mpify_nb from the package index, where it is not: "
                                "use a clone (pip install -e \".[extra]\") or \"mpify_nb @ git+<URL ...>\"")
    assert not problems, "\n".join(problems)


def test_a_page_that_runs_nox_says_how_to_install_it():
    problems = []
    for page in docblocks.pages():
        commands = [c for b in _bash_blocks(page) for c in _commands(b)]
        runs = [c for c in commands if re.match(r"(\.venv/bin/)?nox\b", c)]
        if runs and not any(re.search(r"pip install (-\w+ )*nox\b", c) for c in commands):
            problems.append(f"{page.relative_to(ROOT)} runs {runs[0]!r} but never installs nox (pip install nox)")
    assert not problems, "\n".join(problems)
