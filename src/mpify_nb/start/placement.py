"""Where ranks are placed: the one seam between "run rank r" and a process somewhere.

``mpify_nb.placement(kind, **options)`` is also a ``with`` block: the calls inside it place their
ranks as ``set_placement(kind, **options)`` would, and the placement before it comes back after.

Example (a notebook cell):

```python
import mpify_nb

with mpify_nb.placement("local"):        # ("ray", num_cpus=2): this block's calls on a Ray cluster
    print(mpify_nb.get_placement())
print(mpify_nb.get_placement())
```

```output
local
local
```

How it works, for contributors. A placer turns (rank, channel end, stdout/stderr write ends) into a running
process and hands back a ``RankProcess``: its pid, a way to kill it, a file
descriptor that becomes readable when it dies, and its exit code. The launcher
knows nothing else about where ranks live.

Before starting anything the launcher asks the placer to ``reserve`` the whole
world: the placer answers with a ``Layout`` (which node each rank lands on, hence
``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), and ``release``
gives back what it reserved once the call is over.

Three placers:

* ``TemplatePlacer`` (default): ranks are forked from the warm template process
  (see start/template.py): tens of milliseconds per call.
* ``SpawnPlacer``: each rank is a brand-new interpreter (``python -c``): seconds
  per call, since each imports torch, but it shares nothing with anything.
* ``RayPlacer`` (ray_ranks/): ranks on the nodes of a Ray cluster, the caller
  still a rank on its own node. This module does not import it: ray_ranks/ registers
  ``"ray"`` (``register_placement``) when it is imported, and the package's ``__init__``
  tells this module how to import it the first time it is asked for (``provide_placement``).

On this machine choose with ``mpify_nb.set_start_method("template" | "spawn")`` or
the environment variable ``MPIFY_NB_START_METHOD``; across machines with
``mpify_nb.set_placement("ray", ...)``, or for one block with ``mpify_nb.placement("ray", ...)``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from .local import SpawnPlacer, TemplatePlacer
from .placer import Layout as Layout
from .placer import Placer
from .placer import RankProcess as RankProcess
from .placer import free_port as free_port

START_METHODS = ("template", "spawn")
_start_method = os.environ.get("MPIFY_NB_START_METHOD", "template")


def set_start_method(method: str) -> None:
    """Choose how ranks start: ``"template"`` (fork from a warm process, fast; the default) or
    ``"spawn"`` (every rank a fresh interpreter: seconds a call, sharing nothing). The environment
    variable ``MPIFY_NB_START_METHOD`` sets it at import.

    Example (a notebook cell):

    ```python
    import mpify_nb
    from mpify_nb import ranch

    mpify_nb.set_start_method("spawn")
    print(ranch(2, lambda: "fresh interpreter"))
    mpify_nb.set_start_method("template")     # back to the fast default
    ```

    ```output
    ['fresh interpreter', 'fresh interpreter']
    ```
    """
    global _start_method
    if method not in START_METHODS:
        raise ValueError(f"start method must be one of {START_METHODS}, not {method!r}")
    _start_method = method


def get_start_method() -> str:
    """How ranks start now: ``"template"`` or ``"spawn"`` (see :func:`set_start_method`).

    Example (a notebook cell):

    ```python
    import mpify_nb

    mpify_nb.get_start_method()
    ```

    ```output
    'template'
    ```
    """
    return _start_method


# -- where ranks go: this machine, or a cluster ------------------------------------------------

@dataclass(frozen=True)
class Elsewhere:
    """A placement beyond this machine (``"ray"``), as the module that provides it registers it
    (:func:`register_placement`): this module knows none of them by itself."""

    #: ``set_placement``'s options -> the options every later call uses (checked; may connect to a cluster)
    make_options: Callable[..., Any]
    #: those options -> the placer of one call
    make_placer: Callable[[Any], Placer]
    #: the placement ends: drop what it keeps between calls
    leave: Callable[[], None]


_placement: str = "local"
_options: Any = None  # what the placement's make_options returned, while it is not "local"
_elsewhere: dict[str, Elsewhere] = {}  # registered placements
_providers: dict[str, Callable[[], None]] = {}  # placement -> imports the module that registers it


def register_placement(kind: str, elsewhere: Elsewhere) -> None:
    """Make ``set_placement(kind, ...)`` place ranks with ``elsewhere`` (ray_ranks/ registers
    ``"ray"`` when it is imported)."""
    _elsewhere[kind] = elsewhere


def provide_placement(kind: str, load: Callable[[], None]) -> None:
    """``set_placement(kind, ...)`` calls ``load()`` first when ``kind`` is not registered yet:
    it imports the module that registers it (the package's ``__init__`` names ``"ray"`` this
    way, so ray_ranks/ is imported only once it is asked for)."""
    _providers[kind] = load


def _kinds() -> tuple[str, ...]:
    return ("local", *dict.fromkeys([*_providers, *_elsewhere]))


def set_placement(kind: str = "local", **options: Any) -> None:
    """Place every later call's ranks on this machine (``"local"``, the default) or on a Ray
    cluster (``"ray"``); the caller stays a rank, in this process.

    ``"ray"`` options: ``address`` (None: the cluster this process is connected to, else
    ``ray.init(address="auto")``, else a new local one), ``num_cpus=1``, ``num_gpus=0`` and
    ``resources`` (per rank), ``strategy="SPREAD"`` (a Ray placement-group strategy). A Ray
    Client address (``"ray://head:10001"``) works for calls with ``caller_rank=None`` and for
    a ``Session``: this process is then not on the cluster, so it cannot be a rank.
    Needs Ray: the ``ray`` extra, or ``pip install "ray[client]>=2.9"``.

    Example (a notebook cell on a node of a Ray cluster):

    <!-- test: skip: needs a Ray cluster; tests/test_ray.py runs set_placement("ray") on a 3-node cluster -->
    ```python
    import mpify_nb
    mpify_nb.set_placement("ray", num_cpus=1)   # ranch(...) now places ranks on the cluster
    ```

    Back to this machine:

    ```python
    import mpify_nb
    mpify_nb.set_placement("local")
    mpify_nb.get_placement()
    ```

    ```output
    'local'
    ```
    """
    global _placement, _options
    if kind not in _kinds():
        raise ValueError(f"placement must be one of {_kinds()}, not {kind!r}")
    if kind == "local":
        if options:
            raise TypeError(f"set_placement('local') takes no options, got {sorted(options)}")
        _leave()
        _placement, _options = "local", None
        return
    if kind not in _elsewhere:
        _providers[kind]()
    new_options = _elsewhere[kind].make_options(**options)  # checks them, connects to the cluster
    _leave()
    _placement, _options = kind, new_options


def _leave() -> None:
    """What a placement elsewhere keeps between calls (under Ray Client, the actor that carries
    the ranks' links) ends with it."""
    for elsewhere in list(_elsewhere.values()):
        elsewhere.leave()


def get_placement() -> str:
    """``"local"`` or ``"ray"``: where the next call's ranks go (see :func:`set_placement`).

    Example (a notebook cell):

    ```python
    import mpify_nb

    mpify_nb.get_placement()
    ```

    ```output
    'local'
    ```
    """
    return _placement


@contextlib.contextmanager
def _placement_block(kind: str, **options: Any) -> Iterator[None]:
    global _placement, _options
    saved = (_placement, _options)
    set_placement(kind, **options)
    try:
        yield
    finally:
        _leave()
        _placement, _options = saved


class _CallableModule(types.ModuleType):
    """``mpify_nb.placement("ray", ...)`` is a ``with`` block that places the calls inside it,
    while ``mpify_nb.placement`` stays this module: a function of that name in the package
    would shadow the module for every ``from . import placement``."""

    def __call__(self, kind: str, **options: Any) -> contextlib.AbstractContextManager[None]:
        """``with mpify_nb.placement("ray", num_cpus=2): ranch(4, train)``: the calls in the
        block place their ranks as ``set_placement`` would; the previous placement after."""
        return _placement_block(kind, **options)


sys.modules[__name__].__class__ = _CallableModule


def get_placer() -> Placer:
    if _placement != "local":
        return _elsewhere[_placement].make_placer(_options)
    if _start_method not in START_METHODS:
        raise ValueError(f"MPIFY_NB_START_METHOD must be one of {START_METHODS}, not {_start_method!r}")
    return TemplatePlacer() if _start_method == "template" else SpawnPlacer()


