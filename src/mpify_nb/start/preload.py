"""What the template holds: the installed modules the ranks need, learned call after call.

A rank forked from a template that holds only torch imports everything else ``fn`` uses
on every call: ~0.1 s for accelerate, ~1 s for transformers, ~3 s for lightning, ~1.5-4 s for
``torch._dynamo`` (what ``DistributedDataParallel(...)`` imports the first time). A
fork-based launcher (``notebook_launcher``, ``ddp_notebook``) inherits those modules from
the notebook for free. So the template comes to hold them too, and grows in place
(start/template.py)::

    before a call: the notebook's installed modules (installed_for_call: every rank imports
        them before its call, wire/modules.py), and wanted(): the named ones and those
        earlier calls' ranks imported
    during a call: a rank reports what it imports (IMPORTED, every ~0.1 s) -> learn()
          |  what the template lacks, less what failed before
          v
    GROW: the template imports them one at a time between forks (a module that fails is
        skipped and remembered; one that initializes CUDA, starts a Python thread or leaves a
        child process running makes that template fork no more: it is remembered and left
        out of the next template)

Only modules installed under a ``site-packages`` (or ``dist-packages``) directory or in the
standard library are ever imported there, never a module from the notebook's working directory
(the user edits those; a rank must import their current version): those it only compiles, for
ranks that find no compiled code on disk (``own_sources``, rank/code_cache.py). Names given with
``set_preload`` (start/template.py) are preloaded too.

Only what the ranks import anyway: a module's import runs its side effects (a log line, a helper
process, a file written) once more, in the template, and that is harmless only for a module
every rank imports anyway. Ranks import what the notebook imported before they load a call
(wire/modules.py), and the template holding it only makes calls faster.

Turn it off with ``set_preload(False)`` or ``MPIFY_NB_PRELOAD=0``; name modules with
``set_preload(["transformers.trainer"])`` or ``MPIFY_NB_PRELOAD=transformers.trainer,lightning``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

from ..wire import modules as rank_imports
from ..wire.modules import Roots, inside, site_paths  # noqa: F401  (site_paths: template.py asks us)

_lock = threading.Lock()
_enabled = True
_named: list[str] = []           # given by set_preload([...]) or MPIFY_NB_PRELOAD
_learned: dict[str, None] = {}   # imported by ranks in earlier calls, in import order
_failed: dict[str, str] = {}     # name -> why it was left out (import error, CUDA, threads)


def choose(modules: Union[bool, Sequence[str]] = True) -> bool:
    """Record what :func:`~mpify_nb.set_preload` was given (on, off, or names to add);
    True when preloading is on."""
    global _enabled
    if isinstance(modules, bool):
        with _lock:
            _enabled = modules
    else:
        if isinstance(modules, str):
            raise TypeError("set_preload takes a list of module names, or True/False, not a string")
        names = [str(m).strip() for m in modules if str(m).strip()]
        with _lock:
            _enabled = True
            for name in names:
                if name not in _named:
                    _named.append(name)
    return _enabled


def enabled() -> bool:
    return _enabled


def named() -> list[str]:
    """The modules named with set_preload() or MPIFY_NB_PRELOAD."""
    with _lock:
        return [n for n in _named if n not in _failed]


def failed() -> dict[str, str]:
    """Modules left out of the template, with the reason (``{name: why}``)."""
    with _lock:
        return dict(_failed)


def mark_failed(name: str, why: str) -> None:
    with _lock:
        _failed.setdefault(name, why)


def learn(modules: Iterable[tuple[str, Optional[str]]], cwd: Optional[str] = None) -> None:
    """Remember the modules a rank imported during a call ((name, file) pairs, in import order):
    the installed ones for the template to import, the notebook's own for it to compile."""
    roots = Roots(cwd)
    with _lock:
        for name, file in modules:
            if name in _learned or not _wanted_name(name):
                continue
            if roots.installed(file):
                _learned[name] = None
            elif file and file.endswith(".py") and len(_sources) < _MOST_SOURCES:
                _sources[file] = None


def wanted(cwd: Optional[str] = None) -> list[str]:
    """Every module the next template should hold (in a good import order), or [] when off."""
    if not _enabled:
        return []
    with _lock:
        learned = list(_learned)
        named = list(_named)
        failed_now = set(_failed)
    names = dict.fromkeys(named + learned)
    # Nor the submodules of a package left out: importing one imports the package again, and each
    # would cost a whole new candidate template to find out (ranks import all the notebook's modules).
    return [n for n in names if not inside(n, failed_now)]


_for_call: dict[str, Any] = {}  # the last split of the notebook's modules, and what it was made from


def _split_for_call(cwd: Optional[str]) -> tuple[list[str], list[str]]:
    """The modules every rank imports before its call (the notebook's: wire/modules.py), split into
    the installed ones (names) and the notebook's own (their Python files)."""
    names = rank_imports.for_call()  # the same tuple while the notebook's modules are unchanged
    known = _for_call.get("last")  # (key, answer), set in one step: another thread may read it meanwhile
    if known is not None and known[0] == (names, cwd):
        return known[1]
    roots = Roots(cwd)
    installed, own = [], []
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if roots.installed(file):
            installed.append(name)
        elif file and file.endswith(".py"):
            own.append(file)
    _for_call["last"] = ((names, cwd), (installed, own))
    return installed, own


def installed_for_call(cwd: Optional[str] = None) -> list[str]:
    """The installed modules every rank imports before its call (the notebook's: wire/modules.py),
    less those that failed in a template; [] when preloading is off."""
    if not _enabled:
        return []
    with _lock:
        failed_now = set(_failed)
    installed = _split_for_call(cwd)[0]
    known = _for_call.get("installed")  # (the split's list, failures, answer)
    if known is not None and known[0] is installed and known[1] == len(failed_now):
        return known[2]
    answer = [n for n in installed if not inside(n, failed_now)]
    _for_call["installed"] = (installed, len(failed_now), answer)
    return answer


#: The Python files of the notebook's own modules that earlier calls' ranks imported, in order.
_sources: dict[str, None] = {}
_MOST_SOURCES = 500


def own_sources(cwd: Optional[str] = None) -> list[str]:
    """The Python files of the notebook's own modules (not installed) that ranks import: those every
    rank imports before its call (wire/modules.py) and those earlier calls' ranks imported. The
    template compiles them for its ranks (rank/code_cache.py), never imports them; [] when off."""
    if not _enabled:
        return []
    own = _split_for_call(cwd)[1]
    with _lock:
        if not _sources:
            return own[:_MOST_SOURCES]
        learned = list(_sources)
    return list(dict.fromkeys(own + learned))[:_MOST_SOURCES]


def _wanted_name(name: str) -> bool:
    return name not in ("__main__", "__mp_main__") and not name.endswith(".__main__")


def _from_environment() -> None:
    value = os.environ.get("MPIFY_NB_PRELOAD", "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        global _enabled
        _enabled = False
    elif value and value.lower() not in ("1", "on", "true", "yes", "auto"):
        _named.extend(n.strip() for n in value.split(",") if n.strip())


_from_environment()
