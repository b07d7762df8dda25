"""Which modules a rank imports before it loads a call: what the notebook had imported that the
call can depend on, so a call behaves the same whatever the template process had preloaded.

A module can change what a call does without the call naming it: fastai's ``@patch`` adds
``Learner.fit_one_cycle`` when ``fastai.callback.schedule`` is imported, fastcore adds
``Path.ls``. A rank that imported only what the shipped names pull in would lack them, unless
the template it was forked from happened to hold them already. So every rank first imports
what the notebook holds, as a fork of the notebook (``notebook_launcher``) would have::

    caller: for_call()  the notebook's sys.modules, in import order, filtered (below);
      |                 cached while sys.modules is unchanged (a tuple compare per call)
      |  less what the rank's template already holds (TemplateClient.modules): usually
      |  nothing is left, and the preamble is an empty tuple
      v
    CALL / APPLY body = preamble (pickled tuple of names) + the call's pickle
      v
    rank: import_all(names) before it unpickles the call, one by one, in that order,
          output silenced (the notebook showed it when it imported them; a preloading
          template shows nothing either), CUDA availability checks answered by NVML
          without creating a context; a module that fails to import is skipped (the same
          way every time: the call fails when it needs it, naming it)

The ranks report what they imported (IMPORTED), so the template comes to preload these
modules too (start/preload.py): preloading only makes this faster.

Left out, by fixed rules (never by what happened earlier, so the list is the same whether or
not a preload has finished):

* the standard library: it patches no other library's classes, and a rank imports what it uses;
* modules with no file (builtin, frozen, namespace packages) and modules no rank can import by
  name (made in the notebook with exec or ``types.ModuleType``): their objects travel by value;
* ``__main__`` and mpify_nb itself, and what mpify_nb imported in the notebook for its own warm-up
  (``leave_out_ours``: what the first ``DistributedDataParallel`` imports, torchdist/warmup.py);
* the kernel's own machinery (IPython, ipykernel, zmq, tornado, jupyter_client, debugpy and the
  pydevd modules it puts on sys.path...): the notebook holds them because it is a kernel, not
  because a call needs them;
* modules known to create a CUDA context or start processes when imported (:data:`LEAVE_OUT`:
  every rank would make a context on GPU 0 before its device is chosen, or start helpers per
  call), and those named with :func:`set_rank_imports` (``leave_out=``) or
  ``MPIFY_NB_RANK_IMPORTS_LEAVE_OUT=a,b``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import site
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from typing import Any, Optional

#: Top-level packages that make a process a Jupyter kernel (or a test runner): never a call's business.
KERNEL = frozenset({
    "IPython", "ipykernel", "ipykernel_launcher", "jupyter_client", "jupyter_core", "zmq", "tornado", "traitlets",
    "comm", "debugpy", "prompt_toolkit", "jedi", "parso", "pygments", "pexpect", "ptyprocess",
    "matplotlib_inline", "nest_asyncio", "stack_data", "executing", "asttokens", "pure_eval", "wcwidth",
    "pickleshare", "backcall", "decorator", "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "ipympl",
    "nbformat", "nbclient", "jupyter_server", "notebook", "jupyterlab", "google.colab", "colab_kernel_launcher",
    "pytest", "_pytest", "pluggy", "xdist", "psutil", "platformdirs", "mpify_nb",
})

#: ... and top-level modules named so: the debugger's. debugpy puts its copy of pydevd on sys.path,
#: some twenty top-level modules (pydevd_file_utils, pydev_ipython, pydevconsole, _pydev_runfiles...).
KERNEL_PREFIXES = ("pydevd", "_pydevd", "pydev_", "_pydev_", "pydevconsole")

#: Modules known to create a CUDA context or start processes when imported, with why.
LEAVE_OUT: dict[str, str] = {
    "pycuda.autoinit": "creates a CUDA context on the default GPU at import",
    "pycuda.autoprimaryctx": "retains the primary CUDA context at import",
}

_enabled = os.environ.get("MPIFY_NB_RANK_IMPORTS", "1").strip().lower() not in ("0", "off", "false", "no")
_leave_out: set[str] = {n.strip() for n in os.environ.get("MPIFY_NB_RANK_IMPORTS_LEAVE_OUT", "").split(",")
                        if n.strip()}


def set_rank_imports(enabled: bool = True, *, leave_out: Sequence[str] = ()) -> None:
    """Choose what a rank imports before it loads a call, besides what the call names.

    By default every rank first imports what the notebook has imported (its installed
    libraries and its own modules, not the standard library nor the kernel's machinery), so
    a call behaves the same whether or not the template process had preloaded them: methods
    that a library adds to classes when imported (fastai's ``Learner.fit_one_cycle``,
    fastcore's ``Path.ls``) are there on every rank. The template learns to hold these
    modules, so from the next calls on they cost nothing.

    ``leave_out``: module names (a package leaves out its submodules too) never imported
    this way, e.g. one that starts a server or touches the GPU at import. ``enabled=False``:
    ranks import only what the shipped names pull in (and what ``imports=`` says).

    Example (a notebook cell): a module the notebook imported is there on every rank, though the
    function never names it:

    ```python
    import sys
    import pandas as pd                  # imported in the notebook only
    import mpify_nb

    mpify_nb.set_rank_imports(leave_out=["wandb"])   # never import wandb on the ranks this way

    def pandas_is_here():
        return "pandas" in sys.modules   # the function does not name pandas

    mpify_nb.ranch(2, pandas_is_here)
    ```

    ```output
    [True, True]
    ```
    """
    global _enabled
    if isinstance(leave_out, str):
        raise TypeError("leave_out takes a list of module names, not a string")
    _enabled = bool(enabled)
    _leave_out.update(str(n).strip() for n in leave_out if str(n).strip())
    _cache.clear()


#: Modules this library imported in the notebook for its own sake (torchdist/warmup.py: what the first
#: DDP imports): not the notebook's choice, so no rank imports them before its call for it.
_ours: set[str] = set()


def leave_out_ours(names: Iterable[str]) -> None:
    """Modules mpify_nb itself imported in the notebook (a warm-up): never in a call's preamble."""
    _ours.update(names)
    _cache.clear()


# -- the caller's side ----------------------------------------------------------------------

_cache: dict[str, Any] = {}
#: name -> (the module object, imported on the ranks?): files don't move, verdicts are kept
_verdicts: dict[str, tuple[Any, bool]] = {}


def for_call() -> tuple[str, ...]:
    """The modules every rank of a call imports before loading it, in the notebook's import order."""
    if not _enabled:
        return ()
    keys = tuple(sys.modules)
    known = _cache.get("last")  # (keys, names), set in one step: another thread may read it meanwhile
    if known is not None and known[0] == keys:
        return known[1]
    roots = Roots(None)
    names = tuple(name for name in keys if _wanted(name, sys.modules.get(name), roots))
    _cache["last"] = (keys, names)
    return names


def _wanted(name: str, module: Any, roots: Roots) -> bool:
    known = _verdicts.get(name)
    if known is not None and known[0] is module:
        verdict = known[1]
    else:
        verdict = _judge(name, module, roots)
        _verdicts[name] = (module, verdict)
    return verdict and name not in _ours and not inside(name, _leave_out)


def _judge(name: str, module: Any, roots: Roots) -> bool:
    if module is None or name in ("__main__", "__mp_main__") or name.endswith(".__main__"):
        return False
    if inside(name, KERNEL) or name.startswith(KERNEL_PREFIXES) or inside(name, LEAVE_OUT):
        return False
    spec = getattr(module, "__spec__", None)
    file = getattr(module, "__file__", None)
    if spec is None or spec.loader is None or spec.name != name or not file:
        return False  # builtin, frozen, namespace package, or made at run time: nothing to import
    return not roots.standard_library(file)


def inside(name: str, names: Iterable[str]) -> bool:
    """Is ``name`` one of ``names``, or a submodule of one of those packages?"""
    if not names:
        return False
    dot = name.find(".")
    while dot != -1:
        if name[:dot] in names:
            return True
        dot = name.find(".", dot + 1)
    return name in names


def preamble(names: Sequence[str], held: Optional[frozenset[str]] = None) -> bytes:
    """What goes before a call's pickle: the names a rank born holding ``held`` must import."""
    if held is not None:
        names = [n for n in names if n not in held]
    return pickle.dumps(tuple(names), protocol=pickle.HIGHEST_PROTOCOL)


# -- the rank's side ------------------------------------------------------------------------

def import_all(names: Sequence[str]) -> None:
    """Import ``names`` (those not imported yet), in order, before the call is loaded.

    Quietly: what a module prints or warns at import, the notebook showed when it imported it.
    ``torch.cuda.is_available()`` at a module's top answers from NVML, without a CUDA context."""
    missing = [n for n in names if n not in sys.modules]
    if not missing:
        return
    saved_env = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        for name in missing:
            if name in sys.modules:
                continue  # a module before it imported it
            try:
                importlib.import_module(name)
            except (Exception, SystemExit):
                pass  # not importable here: a call that needs it fails when it is loaded, naming it
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        for fd, saved_fd in zip((1, 2), saved):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        os.close(devnull)
        if saved_env is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved_env


# -- where modules live -----------------------------------------------------------------------

def site_paths() -> list[str]:
    """The caller's site-packages directories, for a process started with another sys.path."""
    return [p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")]


class Roots:
    """Where modules live: site-packages/dist-packages directories, the standard library, and
    the notebook's working directory."""

    def __init__(self, cwd: Optional[str]) -> None:
        if cwd is None:
            try:
                cwd = os.getcwd()
            except OSError:
                cwd = None
        self.cwd = _real_dir(cwd) if cwd else None
        sites = set(site_paths())
        try:
            sites.update(site.getsitepackages())
            sites.add(site.getusersitepackages())
        except AttributeError:  # an old virtualenv's site module
            pass
        self.sites = tuple(_real_dir(p) for p in sites if p)
        self._raw_sites = tuple(os.path.join(os.path.abspath(p), "") for p in sites if p)
        paths = sysconfig.get_paths()
        stdlib = [paths[k] for k in ("stdlib", "platstdlib") if paths.get(k)]
        self.stdlib = tuple(_real_dir(p) for p in stdlib)
        self._raw_stdlib = tuple(os.path.join(os.path.abspath(p), "") for p in stdlib)

    def installed(self, file: Optional[str]) -> bool:
        """Under site-packages or the standard library, and not the notebook's own code."""
        if not file:
            return False  # builtin, frozen or namespace package: nothing to gain
        key = (file, self.cwd)
        verdict = _installed.get(key)
        if verdict is None:
            path = os.path.realpath(file)
            if any(path.startswith(root) for root in self.sites):
                verdict = True
            elif self.cwd is not None and path.startswith(self.cwd):
                verdict = False  # the notebook's own code, even where the standard library lives
            else:
                verdict = any(path.startswith(root) for root in self.stdlib)
            _installed[key] = verdict
        return verdict

    def standard_library(self, file: str) -> bool:
        # Most files are named by their real path already: realpath() (a few syscalls each,
        # ~0.4 s for 3000 modules) only for those under neither kind of root as named.
        for path in (file, None):
            if path is None:
                path = _realpath(file)
            if any(path.startswith(root) for root in self.sites + self._raw_sites):
                return False
            if any(path.startswith(root) for root in self.stdlib + self._raw_stdlib):
                return True
        return False


#: (file, cwd) -> installed? realpath() of thousands of files costs ~0.4 s; files don't move.
_installed: dict[tuple[str, Optional[str]], bool] = {}
_realpaths: dict[str, str] = {}


def _realpath(file: str) -> str:
    path = _realpaths.get(file)
    if path is None:
        path = _realpaths[file] = os.path.realpath(file)
    return path


def _real_dir(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")
