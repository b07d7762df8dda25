"""The code blocks of the docs (docs/**/*.md, README.md) and of the public docstrings, read for tests/test_docs.py.

How a page is written so its blocks are tested:

* A ```` ```python ```` block runs, as a cell of a real Jupyter kernel. The blocks of one page (or one
  docstring) share that kernel, in order, so a later block uses what an earlier one defined, and a
  magic (``%%ranch``, ``%dist_init``) works as in a notebook.
* A ```` ```output ```` block right after it is what that cell shows: its stdout, the text of what it
  displays or returns, and, for a cell that raises, ``ExcType: message``. It is compared line by line
  (trailing spaces ignored). ``...`` inside a line matches any text on that line; a line that is only
  ``...`` matches any number of lines.
* A ```` ```text ```` block is not code (a diagram, a traceback shown as prose). Any other language
  (``bash``, ...) must be marked ``skip`` with the reason.
* Marks go in an HTML comment on the line just before the block (invisible on the site), several at
  once separated by ``;`` (``skip: why`` last: the reason is the rest of the comment):

  - ``<!-- test: skip: needs a GPU -->``: not run; the reason is required and shown in the test's output.
  - ``<!-- test: raises RankRaisedError -->``: the cell must fail with that exception.
  - ``<!-- test: any-order -->`` (on an output block): the lines may come in any order (ranks print
    concurrently); the page must say so to the reader.
  - ``<!-- test: needs accelerate, lightning -->``: the blocks of this kernel (the page's, or those since
    the last ``new-kernel``) are skipped when one of these modules is not installed.
  - ``<!-- test: new-kernel -->``: from this block on, the page runs in a fresh kernel.
  - ``<!-- test: gpu 2 -->``: runs only where torch sees at least that many CUDA GPUs (1 when no number
    is given); elsewhere its kernel's blocks are listed as skipped. On a GPU machine,
    ``pytest tests/test_docs.py -k quickstart-gpu`` runs docs/quickstart-gpu.md.

A shown value goes into an output block, never a ``# -> value`` comment, so that it is checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
#: Languages a block may have without a skip mark: run, compared, or not code at all.
RUN, OUTPUT, NOT_CODE = "python", "output", "text"
MARKS = ("skip", "raises", "any-order", "needs", "new-kernel", "gpu")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_MARK = re.compile(r"^[ \t]*<!--\s*test:(?P<body>.*?)-->[ \t]*$")


@dataclass
class Block:
    where: str  # "docs/guide/ranch.md:12" or "docstring of mpify_nb.ranch:3"
    lang: str
    code: str
    marks: dict[str, str] = field(default_factory=dict)  # mark -> its argument ("" when it has none)
    output: Optional[Block] = None  # the output block that follows a python block

    @property
    def runs(self) -> bool:
        return self.lang == RUN and "skip" not in self.marks


def parse_marks(body: str, where: str) -> dict[str, str]:
    """``raises X; any-order`` -> {"raises": "X", "any-order": ""}. ``skip: why`` comes last: its reason
    is the rest of the comment, ``;`` included."""
    marks: dict[str, str] = {}
    body, skip, reason = body.partition("skip:")
    if skip:
        marks["skip"] = reason.strip()
    for part in filter(None, (p.strip() for p in body.split(";"))):
        name, _, arg = part.partition(" ")
        if name not in MARKS:
            raise ValueError(f"{where}: unknown test mark {name!r} (known: {', '.join(MARKS)})")
        marks[name] = arg.strip()
    return marks


def blocks_of(text: str, source: str) -> list[Block]:
    """The fenced blocks of a Markdown text, each with its marks; output blocks hang off their python block."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening or not opening["info"].strip():
            if opening:  # a bare fence opens a block too: skip to its end so its lines aren't read as fences
                found.append(Block(f"{source}:{i + 1}", "", ""))
                i = _closing(lines, i, opening) + 1
                continue
            i += 1
            continue
        lang = opening["info"].split()[0].lstrip(".").lower()
        end = _closing(lines, i, opening)
        indent = len(opening["indent"])
        code = "\n".join(line[indent:] if line[:indent].strip() == "" else line.lstrip()
                         for line in lines[i + 1:end])
        where = f"{source}:{i + 1}"
        mark = _MARK.match(lines[i - 1]) if i > 0 else None
        block = Block(where, lang, code, parse_marks(mark["body"], where) if mark else {})
        if lang == OUTPUT and found and found[-1].lang == RUN and found[-1].output is None:
            found[-1].output = block
        else:
            found.append(block)
        i = end + 1
    return found


def _closing(lines: list[str], start: int, opening: re.Match) -> int:
    fence = opening["fence"]
    for j in range(start + 1, len(lines)):
        if lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0]):
            return j
    raise ValueError(f"line {start + 1}: a code block that never ends")


def pages() -> list[Path]:
    """README.md and every page of the site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_blocks(path: Path) -> list[Block]:
    return blocks_of(path.read_text(), str(path.relative_to(ROOT)))


# -- comparing what a cell showed with its output block ----------------------------------------------

def _line_pattern(line: str) -> str:
    return ".*?".join(re.escape(part) for part in line.split("..."))


def _normal(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def matches(expected: str, seen: str, any_order: bool = False) -> bool:
    want, got = _normal(expected), _normal(seen)
    if any_order:
        left = list(got)
        for line in want:
            hit = next((k for k, g in enumerate(left) if re.fullmatch(_line_pattern(line), g)), None)
            if hit is None:
                return False
            left.pop(hit)
        return not left
    pattern = "".join(r"(?:[^\n]*\n)*?" if line.strip() == "..." else _line_pattern(line) + r"\n" for line in want)
    return re.fullmatch(pattern, "".join(line + "\n" for line in got)) is not None
