"""MkDocs hooks (mkdocs.yml ``hooks:``): the example notebooks, executed, as pages of the site; their
tables of contents; the version.

``examples/*.ipynb`` are committed with their outputs cleared (the tests check that), so the build
runs each in a fresh kernel of the interpreter that builds the site (tests/nbutil.py: a private
kernelspec, nothing left running afterwards) and hands the executed copy to mkdocs-jupyter as
``examples/<name>.ipynb``. A notebook that fails fails the build. ``mkdocs serve`` runs a notebook
again only when its source changed. ``MPIFY_NB_DOCS_EXECUTE=0`` renders them without outputs
(quick edits of the pages). ``MPIFY_NB_EXECUTED_EXAMPLES=<folder>``: where the test run left the
notebooks it executed (tests/nbutil.py ``keep_executed_example``, named by the digest of their
source); the build renders such a copy instead of running the notebook again (.ci/run).

mkdocs-jupyter builds a notebook page's table of contents from a Markdown copy of the notebook with
every inline code span removed, so a heading such as ``## Moving data: `%dist_push` `` showed as "Moving
data:" and linked to an anchor the page does not have. :func:`on_page_content` rebuilds it from the
headings of the rendered page itself: their ids and their whole text.

The site's name carries the package's version (``mpify_nb.__version__``, read from the source), shown at
the top of every page, and ``{{ version }}`` in a page's Markdown is replaced by it.
"""

from __future__ import annotations

import atexit
import hashlib
import html
import logging
import os
import re
import shutil
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import nbformat
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.structure.toc import get_toc

ROOT = Path(__file__).resolve().parent
EXAMPLES = ROOT / "examples"
log = logging.getLogger("mkdocs.hooks.examples")

_out_dir = Path(tempfile.mkdtemp(prefix="mpify_nb_docs_nb_"))
atexit.register(shutil.rmtree, _out_dir, ignore_errors=True)
_done: dict[str, Path] = {}  # source digest -> the folder of its executed copy, for mkdocs serve's rebuilds


def _executed(source: Path) -> Path:
    data = source.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest in _done:
        return _done[digest]
    nb = nbformat.reads(data.decode(), as_version=4)
    kept = Path(os.environ.get("MPIFY_NB_EXECUTED_EXAMPLES") or os.devnull) / f"{digest}.ipynb"
    if kept.is_file():  # this very source, executed by the test run before (.ci/run): not run twice
        log.info("%s: the copy the tests executed", source.relative_to(ROOT))
        nb = nbformat.read(kept, as_version=4)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    elif os.environ.get("MPIFY_NB_DOCS_EXECUTE", "1") != "0":
        sys.path.insert(0, str(ROOT / "tests"))
        try:
            import nbutil  # the tests' kernel runner: this interpreter, leftovers checked
        finally:
            sys.path.remove(str(ROOT / "tests"))
        nb.metadata["kernelspec"] = {"name": nbutil.KERNEL_NAME, "display_name": "Python 3", "language": "python"}
        log.info("executing %s", source.relative_to(ROOT))
        try:
            nbutil.execute_notebook(nb, timeout=300, cwd=source.parent)
        except Exception as exc:  # the notebook is part of the docs: its failure fails the build
            raise PluginError(f"{source.relative_to(ROOT)} failed while the docs were built: {exc}") from exc
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    # <digest>/examples/<name>: mkdocs-jupyter finds the file from its src_dir and src_uri
    src_dir = _out_dir / digest
    (src_dir / "examples").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, src_dir / "examples" / source.name)
    _done[digest] = src_dir
    return src_dir


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into its pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    for source in sorted(EXAMPLES.glob("*.ipynb")):
        files.append(File(f"examples/{source.name}", src_dir=str(_executed(source)), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files


# -- the notebook pages' tables of contents -------------------------------------------------------

class _Headings(HTMLParser):
    """The ``<h1>``..``<h6>`` of a page that have an id: (level, id, text), in order. The text leaves out
    the heading's permalink (nbconvert's ``<a class="anchor-link">``, Markdown's ``headerlink``)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[int, str, str]] = []
        self._open: tuple[int, str, list[str]] | None = None
        self._in_permalink = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if re.fullmatch(r"h[1-6]", tag) and named.get("id"):
            self._open = (int(tag[1]), named["id"] or "", [])
        elif tag == "a" and self._open and set((named.get("class") or "").split()) & {"anchor-link", "headerlink"}:
            self._in_permalink += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._in_permalink:
            self._in_permalink -= 1
        elif self._open and tag == f"h{self._open[0]}":
            level, anchor, parts = self._open
            self.found.append((level, anchor, " ".join("".join(parts).split())))
            self._open = None

    def handle_data(self, data: str) -> None:
        if self._open and not self._in_permalink:
            self._open[2].append(data)


def toc_tokens(page_html: str) -> list[dict[str, Any]]:
    """The tokens of a table of contents (Python-Markdown's shape, nested by level) for the headings of
    a rendered page."""
    parser = _Headings()
    parser.feed(page_html)
    roots: list[dict[str, Any]] = []
    stack: list[dict[str, Any]] = []
    for level, anchor, text in parser.found:
        token = {"level": level, "id": anchor, "name": html.escape(text), "children": []}
        while stack and stack[-1]["level"] >= level:
            stack.pop()
        (stack[-1]["children"] if stack else roots).append(token)
        stack.append(token)
    return roots


def on_page_content(page_html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri.endswith(".ipynb"):
        page.toc = get_toc(toc_tokens(page_html))  # type: ignore[arg-type]
    return page_html


# -- the version -----------------------------------------------------------------------------------

def package_version() -> str:
    """``__version__`` of src/mpify_nb/__init__.py, read without importing the package."""
    found = re.search(r'^__version__ = "([^"]+)"', (ROOT / "src" / "mpify_nb" / "__init__.py").read_text(), re.M)
    if not found:
        raise PluginError("src/mpify_nb/__init__.py has no __version__ = \"...\" line")
    return found.group(1)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.site_name = f"{config.site_name} {package_version()}"
    return config


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return markdown.replace("{{ version }}", package_version())
