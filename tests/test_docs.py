"""Every code block of the docs site, the README and the public docstrings runs, and shows what it says.

Each page's python blocks run in order as the cells of one real Jupyter kernel (tests/nbutil.py), in a
scratch folder; each block's ``output`` block is compared with what its cell showed. How to write and
mark a block: tests/docblocks.py. Blocks marked ``skip`` are listed as skipped tests, with the reason.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import docblocks
import mpify_nb
from docblocks import Block

nbutil = pytest.importorskip("nbutil")  # the notebook stack (nbclient, ipykernel)

#: The public names, and the error classes users catch that live in mpify_nb.errors.
PUBLIC = [*mpify_nb.__all__, "errors.CollectiveError", "errors.StdinUnavailableError", "errors.SessionClosedError"]
CELL_TIMEOUT = 300


def _public(name: str) -> Any:
    obj: Any = mpify_nb
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def docstring_blocks(name: str) -> list[Block]:
    return docblocks.blocks_of(inspect.getdoc(_public(name)) or "", f"docstring of mpify_nb.{name}")


def _all_blocks() -> list[Block]:
    found = [b for page in docblocks.pages() for b in docblocks.page_blocks(page)]
    return found + [b for name in PUBLIC for b in docstring_blocks(name)]


def _page_id(path: Path) -> str:
    return str(path.relative_to(docblocks.ROOT))


# -- the blocks are written so they can be tested (no kernel: fast) ------------------------------------

def test_every_block_is_run_compared_or_marked() -> None:
    problems = []
    for block in _all_blocks():
        if block.lang == docblocks.OUTPUT:
            problems.append(f"{block.where}: an output block must come right after a python block")
        elif block.lang not in (docblocks.RUN, docblocks.NOT_CODE) and "skip" not in block.marks:
            problems.append(f"{block.where}: a {block.lang or 'bare'!r} block is neither run nor marked "
                            "'<!-- test: skip: why -->'")
        if "skip" in block.marks and not block.marks["skip"]:
            problems.append(f"{block.where}: 'skip' needs a reason ('<!-- test: skip: needs a GPU -->')")
        if block.runs and re.search(r"#\s*->", block.code):
            problems.append(f"{block.where}: shows a value in a '# ->' comment: put it in an output block, "
                            "where it is checked")
        if "any-order" in block.marks:
            problems.append(f"{block.where}: 'any-order' belongs on the output block")
        if block.output is not None and set(block.output.marks) - {"any-order"}:
            problems.append(f"{block.output.where}: an output block takes only 'any-order'")
    assert not problems, "\n".join(problems)


def test_every_public_name_has_a_docstring_with_an_example_that_runs() -> None:
    missing = [name for name in PUBLIC if not any(b.runs for b in docstring_blocks(name))]
    assert not missing, f"public names whose docstring has no runnable ```python example: {missing}"


def test_the_harness_catches_a_wrong_output_and_reads_marks() -> None:
    """The comparison is strict where the page is, and the parser keeps marks and outputs together."""
    assert docblocks.matches("a\n...\nd", "a\nb\nc\nd\n")
    assert docblocks.matches("rank ... of 2", "rank 1 of 2")
    assert not docblocks.matches("a\nb", "a\nc")
    assert not docblocks.matches("a", "a\nb")  # nothing unshown may be left over
    assert docblocks.matches("x\ny", "y\nx", any_order=True)
    assert not docblocks.matches("x\ny", "y\ny", any_order=True)
    page = ("<!-- test: skip: needs a GPU -->\n```python\nimport torch\n```\n\n```python\nprint(1)\n```\n"
            "<!-- test: any-order -->\n```output\n1\n```\n")
    skipped, run = docblocks.blocks_of(page, "page.md")
    assert (skipped.marks, skipped.runs) == ({"skip": "needs a GPU"}, False)
    assert run.runs and run.output is not None and run.output.code == "1"
    assert run.output.marks == {"any-order": ""}
    with pytest.raises(ValueError, match="unknown test mark 'skipp'"):
        docblocks.blocks_of("<!-- test: skipp -->\n```python\n```\n", "page.md")


# -- running them ----------------------------------------------------------------------------------

def _shown(cell: Any) -> str:
    """What a reader sees of a cell: stdout, the text of displays and values, and the error's last line."""
    parts: list[str] = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream" and out.get("name") == "stdout":
            parts.append(out.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", "") + "\n")
        elif kind == "error":
            parts.append(f"{out['ename']}: {out['evalue']}\n")
    return "".join(parts)


def _gpus_needed(block: Block) -> int:
    if "gpu" not in block.marks:
        return 0
    return int(block.marks["gpu"] or 1)


def _gpus_here() -> int:
    import torch

    return torch.cuda.device_count()


#: Libraries that install on any torch but turn their torch side off below a version.
TORCH_FOR = {"transformers": (2, 6)}


def _absent(block: Block) -> list[str]:
    """The modules a block's 'needs' names that are not installed here (or not usable with this torch)."""
    from versions import TORCH

    named = [m.strip() for m in block.marks.get("needs", "").split(",") if m.strip()]
    return [m for m in named if importlib.util.find_spec(m) is None or TORCH < TORCH_FOR.get(m, (0, 0))]


def kernel_groups(blocks: list[Block]) -> list[list[Block]]:
    """The runnable blocks, cut into one list per kernel (a new one at each 'new-kernel'). A group is left
    out when one of its blocks needs a module that is not installed, or more GPUs than torch sees here."""
    groups: list[list[Block]] = []
    for block in blocks:
        if block.runs:
            if not groups or "new-kernel" in block.marks:
                groups.append([])
            groups[-1].append(block)
    return [g for g in groups if not any(_absent(b) or _gpus_needed(b) > _gpus_here() for b in g)]


def run_blocks(blocks: list[Block], cwd: Path) -> None:
    """Run each kernel group of the blocks in a fresh kernel; fail with every mismatch."""
    groups = kernel_groups(blocks)
    if not groups:
        pytest.skip("nothing to run here (see the skipped blocks)")
    failures = []
    for group in groups:
        nb = nbutil.new_notebook([b.code for b in group])
        nbutil.execute_notebook(nb, timeout=CELL_TIMEOUT, allow_errors=True, cwd=cwd)
        for block, cell in zip(group, nb.cells):
            failures += _check(block, cell)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


def _check(block: Block, cell: Any) -> list[str]:
    errors = nbutil.errors(cell)
    raises = block.marks.get("raises")
    shown = _shown(cell)
    if raises is not None and not any(e["ename"] == raises for e in errors):
        return [f"{block.where}: should raise {raises}, but it showed:\n{shown}"]
    if raises is None and errors:
        return [f"{block.where}: raised\n{nbutil.error_text(errors[0])}"]
    if block.output is not None:
        any_order = "any-order" in block.output.marks
        if not docblocks.matches(block.output.code, shown, any_order=any_order):
            order = " (in any order)" if any_order else ""
            return [f"{block.where}: the page shows{order}\n{block.output.code}\n--- but the cell showed\n{shown}"]
    return []


@pytest.mark.parametrize("page", [p for p in docblocks.pages() if any(b.runs for b in docblocks.page_blocks(p))],
                         ids=_page_id)
def test_page_blocks_run_and_show_what_the_page_says(page: Path, tmp_path: Path) -> None:
    run_blocks(docblocks.page_blocks(page), tmp_path)


def test_docstring_examples_run_and_show_what_they_say(tmp_path: Path) -> None:
    """One kernel for every public docstring, in __all__'s order: an example puts back what it changes."""
    run_blocks([b for name in PUBLIC for b in docstring_blocks(name)], tmp_path)


def _skipped() -> list[Block]:
    """Blocks marked skip, and the blocks marked needs or gpu in kernel groups this machine cannot run."""
    found = [b for b in _all_blocks() if "skip" in b.marks]
    for blocks in [docblocks.page_blocks(p) for p in docblocks.pages()] + [docstring_blocks(n) for n in PUBLIC]:
        runnable = {id(b) for g in kernel_groups(blocks) for b in g}
        found += [b for b in blocks if b.runs and id(b) not in runnable and (_absent(b) or _gpus_needed(b))]
    return found


@pytest.mark.parametrize("block", _skipped(), ids=lambda b: b.where)
def test_skipped_block(block: Block) -> None:
    """Listed so that `pytest -ra` shows every block that is not run, and why."""
    if "skip" in block.marks:
        pytest.skip(f"{block.where}: {block.marks['skip']}")
    if _absent(block):
        pytest.skip(f"{block.where}: needs {', '.join(_absent(block))} (not installed, or not usable with this "
                    f"torch: {TORCH_FOR})")
    pytest.skip(f"{block.where}: needs {_gpus_needed(block)} CUDA GPU(s); {_gpus_here()} here")
