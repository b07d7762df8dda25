"""Training libraries in the caller's rank: what they change in the notebook process, put back.

The caller (the notebook) plays a rank itself, so whatever a library does to its own
process during ``fn`` stays in the kernel after the call: accelerate's ``PartialState`` /
``AcceleratorState`` / ``GradientState`` singletons (the next call, or accelerate's own
``notebook_launcher``, then finds a state whose process group is gone), its
``torch.set_num_threads(1)``, a ``logging.basicConfig`` whose handler writes to the
call's relay stream. And the kernel looks interactive to Lightning, which then refuses
``strategy="ddp"`` on rank 0 although every other rank was launched externally.

::

    CallerState.snapshot()   ->  LibraryState.snapshot()    threads, loggers, warnings,
                                                            known library singletons, excepthook
    _run_own_rank            ->  with launched_externally():  Lightning sees a torchrun rank
    CallerState.restore()    ->  LibraryState.restore()     all of the above as before (the
                                                            excepthook: torch's wrappers gone)

The singletons are a small registry (:data:`SINGLETONS`): a library is only looked at when
it is already in ``sys.modules``, never imported here. Its state is copied before the call
and put back after, so a state the user built in the notebook before the call survives it.

Also here: the environment torchrun gives its workers (:func:`torchrun_env`), so a library
launched by ``ranch`` finds what it would find under torchrun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Optional, cast

from . import compat

#: Process-wide singletons of training libraries: (module, class, attribute holding the shared
#: state dict). Each is copied before a call and restored after it, in the caller only.
SINGLETONS: list[tuple[str, str, str]] = [
    ("accelerate.state", "PartialState", "_shared_state"),
    ("accelerate.state", "AcceleratorState", "_shared_state"),
    ("accelerate.state", "GradientState", "_shared_state"),
]

#: Packages whose ``_IS_INTERACTIVE`` flag (computed at import from ``sys.ps1``) makes them
#: refuse launchers that are not notebook-compatible.
_INTERACTIVE_FLAG_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")


# -- torchrun's environment ---------------------------------------------------------------

def torchrun_env(nprocs: int, environ: Optional[Mapping[str, str]] = None, groups: int = 1) -> dict:
    """Variables torchrun sets for its workers (besides RANK, WORLD_SIZE, MASTER_*), the same
    for every rank, minus those the user set; ``groups``: the hosts the ranks run on. Per-rank
    ones: :func:`torchrun_rank_env` (and GROUP_RANK, from where the rank landed).

    ``OMP_NUM_THREADS`` is per host: see :func:`torchrun_thread_env`."""
    if environ is None:
        environ = os.environ
    env = {
        "GROUP_RANK": "0",  # on one host; the launcher gives each rank its own
        "GROUP_WORLD_SIZE": str(groups),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(nprocs),
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex[:12],
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    return {k: v for k, v in env.items() if k not in environ}


def torchrun_thread_env(ranks_on_host: int, environ: Optional[Mapping[str, str]] = None) -> dict:
    """As torchrun does, ``OMP_NUM_THREADS=1`` when it is unset and several ranks share the
    rank's host (each would otherwise use every core); a rank alone on its host (a Ray node)
    keeps them all."""
    if environ is None:
        environ = os.environ
    return {"OMP_NUM_THREADS": "1"} if ranks_on_host > 1 and "OMP_NUM_THREADS" not in environ else {}


def apply_thread_env(env: dict) -> None:
    """In the caller's rank: use the thread count ``env`` sets (OMP_NUM_THREADS, as a
    torchrun rank would at its start). The snapshot puts the notebook's count back after."""
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS")
    if torch is not None and threads:
        try:
            torch.set_num_threads(int(threads))
        except ValueError:
            pass


def torchrun_rank_env(rank: int, environ: Optional[Mapping[str, str]] = None) -> dict:
    if environ is None:
        environ = os.environ
    return {} if "ROLE_RANK" in environ else {"ROLE_RANK": str(rank)}


# -- the caller's rank looks launched externally ------------------------------------------

@contextlib.contextmanager
def launched_externally() -> Iterator[None]:
    """For the duration: the process does not look interactive to Lightning, so it treats
    the caller like the other ranks (launched externally, ``LOCAL_RANK`` set) instead of
    refusing ``strategy="ddp"``. Covers Lightning already imported (its module-level
    ``_IS_INTERACTIVE`` flags) and Lightning first imported inside ``fn`` (``sys.ps1``,
    which that flag is computed from). Restored after: in the notebook itself Lightning
    must still pick its notebook launcher."""
    had_ps1 = hasattr(sys, "ps1")
    ps1 = getattr(sys, "ps1", None)
    patched = []
    for module in _flag_modules():
        if getattr(module, "_IS_INTERACTIVE", None) is True:
            module._IS_INTERACTIVE = False
            patched.append(module)
    if had_ps1:
        del sys.ps1
    try:
        yield
    finally:
        if had_ps1:
            sys.ps1 = ps1
        interactive = had_ps1 or bool(sys.flags.interactive)
        for module in _flag_modules():  # also those first imported during the call
            if isinstance(getattr(module, "_IS_INTERACTIVE", None), bool):
                module._IS_INTERACTIVE = interactive


def _flag_modules() -> list:
    return [m for name, m in list(sys.modules.items())
            if m is not None and name.split(".", 1)[0] in _INTERACTIVE_FLAG_PACKAGES
            and "_IS_INTERACTIVE" in getattr(m, "__dict__", {})]


# -- snapshot / restore -------------------------------------------------------------------

class _LoggerState:
    def __init__(self, logger: logging.Logger):
        self.handlers = list(logger.handlers)
        self.level = logger.level
        self.propagate = logger.propagate
        self.disabled = logger.disabled
        self.filters = list(logger.filters)

    def restore(self, logger: logging.Logger) -> None:
        logger.handlers[:] = self.handlers
        logger.level = self.level
        logger.propagate = self.propagate
        logger.disabled = self.disabled
        logger.filters[:] = self.filters


class LibraryState:
    """What training libraries change in the caller's process during a call."""

    def __init__(self) -> None:
        self.threads: Optional[int] = None
        self.loggers: dict[Optional[str], _LoggerState] = {}
        self.logging_disable = logging.root.manager.disable
        self.warning_filters = list(warnings.filters)
        self.singletons: dict[tuple[str, str, str], dict] = {}
        #: init_process_group wraps sys.excepthook in one that prefixes "[rankN]: " (torch's c10d),
        #: once per group: the notebook's would keep the wrapper of a group long gone
        self.excepthook = sys.excepthook

    @classmethod
    def snapshot(cls) -> LibraryState:
        self = cls()
        torch = sys.modules.get("torch")
        if torch is not None:
            self.threads = torch.get_num_threads()
        self.loggers[None] = _LoggerState(logging.root)
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger):
                self.loggers[name] = _LoggerState(logger)
        for key in SINGLETONS:
            shared = _singleton(key)
            if shared is not None:
                self.singletons[key] = dict(shared)
        return self

    def restore(self) -> None:
        for key in SINGLETONS:
            shared = _singleton(key)
            if shared is not None:  # a library first imported during the call starts empty
                saved = self.singletons.get(key, {})
                if shared != saved:
                    shared.clear()
                    shared.update(saved)
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if not isinstance(logger, logging.Logger):
                continue
            before = self.loggers.get(name)
            if before is not None:
                before.restore(logger)
            else:  # a library's logger born during the call stays, writing where the notebook does
                for handler in logger.handlers:
                    _unbind_from_call(handler)
        self.loggers[None].restore(logging.root)
        logging.root.manager.disable = self.logging_disable
        logging.Logger.manager._clear_cache()  # type: ignore[attr-defined]  # levels are cached per logger
        cast(list, warnings.filters)[:] = self.warning_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
        # Unwrapped, not set back: IPython swaps sys.excepthook around each cell, and a call in the
        # background may end after the cell that took this snapshot.
        sys.excepthook = compat.without_rank_excepthooks(sys.excepthook, self.excepthook)
        torch = sys.modules.get("torch")
        if torch is not None and self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def _singleton(key: tuple[str, str, str]) -> Optional[dict]:
    module_name, class_name, attribute = key
    module = sys.modules.get(module_name)
    cls = getattr(module, class_name, None) if module is not None else None
    shared: Any = getattr(cls, attribute, None) if cls is not None else None
    return shared if isinstance(shared, dict) else None


def _unbind_from_call(handler: logging.Handler) -> None:
    """A handler made during the call on sys.stdout/sys.stderr holds the call's stand-in for
    them (the relay's line tracker, which keeps its ``_stream``): point it at the real one."""
    stream = getattr(handler, "stream", None)
    inner = getattr(stream, "_stream", None)
    if inner is not None and isinstance(handler, logging.StreamHandler) and hasattr(inner, "write"):
        handler.setStream(inner)


__all__ = ["SINGLETONS", "LibraryState", "apply_thread_env", "launched_externally", "torchrun_env", "torchrun_rank_env",
           "torchrun_thread_env"]
