"""The compiled code of the notebook's own modules, held by the template for the ranks it forks.

Every rank imports the notebook's own modules (those of its working directory, not installed:
wire/modules.py) afresh on every call, so that it runs their current source. Python reads their
compiled code from ``__pycache__``; where it writes none (``PYTHONDONTWRITEBYTECODE``, as many
container images set, or a read-only directory), every rank compiled each of them again on every
call (~3 ms for a module of 200 lines, before the rank could answer READY). The template compiles
them instead, once per version of the file, and a rank forked from it takes that code when the
source it reads is, byte for byte, the source that was compiled::

    caller: ready_for_call() ── ("compile", files) ──> template: hold(files): each file whose size
                                                       or mtime changed is read and compiled (one
                                                       that warns when compiled is left out: its
                                                       rank shows the warning, as before)
    rank: import x ── SourceFileLoader.source_to_code(source, path): the held code if that path's
                      held source is this very source; else compiled here, as Python does

A rank never runs other code than it would have: a file edited since the template compiled it
reads differently and is compiled afresh by the rank.
"""

from __future__ import annotations

import importlib.machinery
import os
import warnings
from collections.abc import Iterable
from types import CodeType
from typing import Any

#: Files bigger than this are left to the ranks (a generated module of megabytes).
_LARGEST = 4 << 20

#: (path, optimize) -> (the source, its code)
_held: dict[tuple[str, int], tuple[bytes, CodeType]] = {}
#: path -> (mtime_ns, size) of the version held (or left out)
_seen: dict[str, tuple[int, int]] = {}
_original: Any = None


def install() -> None:
    """(The template) its ranks' imports look for held code first (idempotent)."""
    global _original
    loader = importlib.machinery.SourceFileLoader
    if _original is not None:
        return
    _original = loader.source_to_code

    def source_to_code(self: Any, data: Any, path: Any, *, _optimize: int = -1) -> Any:
        held = _held.get((path, _optimize))
        if held is not None and held[0] == data:
            return held[1]
        return _original(self, data, path, _optimize=_optimize)

    loader.source_to_code = source_to_code  # type: ignore[method-assign]


def hold(files: Iterable[str]) -> None:
    """(The template) compile those of ``files`` (Python sources) it does not hold as they are now."""
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            continue
        version = (st.st_mtime_ns, st.st_size)
        if _seen.get(path) == version:
            continue
        _seen[path] = version
        _held.pop((path, -1), None)
        if st.st_size > _LARGEST:
            continue
        try:
            with open(path, "rb") as f:
                data = f.read()
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                code = compile(data, path, "exec", dont_inherit=True, optimize=-1)
        except Exception:  # SyntaxError, RecursionError...: the rank's own import says what is wrong
            continue
        if not warned:
            _held[(path, -1)] = (data, code)
