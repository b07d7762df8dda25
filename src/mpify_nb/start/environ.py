"""The environment our new interpreters start with (the template, a spawned rank), and which
variables of it decide whether a template can still serve.

While a call plays a rank in this process, ``os.environ`` holds that rank's variables
(``OMP_NUM_THREADS=1``, ``RANK``...): a template is made, and judged, with the notebook's own
environment instead (``set_caller_environ``).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

#: Environment variables read when torch & co are imported: a change means a new template.
IMPORT_TIME_ENV = (
    "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "OMP_NUM_THREADS",
    "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCH_HOME", "VIRTUAL_ENV",
)



#: The notebook's own environment while a call plays a rank in this process (see set_caller_environ).
_caller_environ: Optional[dict[str, str]] = None


def set_caller_environ(environ: Optional[dict[str, str]]) -> None:
    """While a call plays a rank here, ``os.environ`` holds that rank's variables: templates are
    made, and judged, with ``environ`` (this process's own, from before the call) instead.
    None: the call is over, os.environ is the process's own again."""
    global _caller_environ
    _caller_environ = None if environ is None else dict(environ)


def _environ() -> dict[str, str]:
    """This process's own environment (a copy)."""
    environ = _caller_environ
    return dict(os.environ if environ is None else environ)


def _env_signature() -> tuple:
    environ = _environ()
    return (sys.executable,) + tuple(environ.get(k) for k in IMPORT_TIME_ENV)


def own_process_group() -> dict:
    """Popen arguments that put the child in a process group of its own, in the caller's
    session: the SIGINT a kernel interrupt sends to the caller's group does not reach it
    (the caller alone decides when ranks stop), and the scheduler still treats it as part
    of the caller's session (a new session is a separate autogroup, which cost DDP ranks
    ~15% of their steps under load)."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


def bootstrap_env() -> dict:
    """The environment a new interpreter needs to import this very copy of mpify_nb."""
    env = _environ()
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # src/, above mpify_nb/start/
    paths = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = here + (os.pathsep + paths if paths else "")
    env["MPIFY_NB_CHILD"] = "1"  # no template of its own
    return env
