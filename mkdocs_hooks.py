"""MkDocs hooks (mkdocs.yml ``hooks:``): the example notebooks, executed, as pages of the site.

``examples/*.ipynb`` are committed with their outputs cleared (the tests check that), so the build
runs each in a fresh kernel of the interpreter that builds the site (tests/nbutil.py: a private
kernelspec, nothing left running afterwards) and hands the executed copy to mkdocs-jupyter as
``examples/<name>.ipynb``. A notebook that fails fails the build. ``mkdocs serve`` runs a notebook
again only when its source changed. ``MPIFY_NB_DOCS_EXECUTE=0`` renders them without outputs
(quick edits of the pages).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

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
    if os.environ.get("MPIFY_NB_DOCS_EXECUTE", "1") != "0":
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
