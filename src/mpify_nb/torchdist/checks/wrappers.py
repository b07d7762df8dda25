"""The check installed: torch.distributed's calls wrapped, once per process, and the switch.

::

    dist.all_reduce(x)  (looked up at the call, or bound by an import made after install())
      └─ checked(): the switch off, not installed (the notebook between calls: a module imported
                    during a call keeps our name), or inside another checked call
                    (all_gather_into_tensor runs all_gather_single) ──> torch's own
                    else: describe it (calls.py), its group's check (groups.py) ──> torch's own
    dist.init_process_group(...) / dist.new_group(...): torch's own, then the group's table is
                    made while every member is there (groups.set_up)

Both names torch resolves are replaced (``torch.distributed.x`` and ``distributed_c10d.x``,
which torch's own helpers call: ``all_gather_object``'s two ``all_gather``s are checked), and
every module-level name an earlier import bound to torch's own (:func:`_rebind_imported`; the look for
them is made ahead where it can be: :func:`look_for_bound_names`).
:func:`install` runs where nothing of the user's has run yet (the template before it forks a
rank; a spawned rank at its start); in the notebook, around each call that plays a rank (rank/
checks.py). Checks are on unless ``MPIFY_NB_COLLECTIVE_CHECKS=0`` (or :func:`set_enabled`);
the caller decides for every rank alike: a rank that checks waits for peers that publish.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import weakref
from typing import Any, Callable, Optional

from .. import p2p
from ..recorder import Op
from . import calls, groups

#: The calls checked (those this torch has): every collective and point-to-point call a user makes.
CHECKED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
           "_all_gather_base", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
           "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "barrier",
           "all_reduce_coalesced", "all_gather_coalesced", "send", "recv", "isend", "irecv")
#: The calls that make a group: its table is made right after, every member being there.
MAKERS = ("init_process_group", "new_group")
VARIABLE = "MPIFY_NB_COLLECTIVE_CHECKS"

_originals: dict[str, Callable] = {}
_wrappers: dict[str, Callable] = {}
#: (a module's namespace, the key, torch's name) of each module-level name found bound to torch's
#: own call; and the modules looked at already (each is looked at once: a later import binds ours).
_bound: list[tuple[dict, str, str]] = []
_scanned: set[str] = set()
_scan_lock = threading.Lock()
_local = threading.local()


def from_environment() -> bool:
    """On unless ``MPIFY_NB_COLLECTIVE_CHECKS`` says 0, false, off or no."""
    return os.environ.get(VARIABLE, "1").strip().lower() not in ("0", "false", "off", "no")


_on = [from_environment()]


def enabled() -> bool:
    return _on[0]


def installed() -> bool:
    return bool(_wrappers)


def set_enabled(on: bool, install: bool = True) -> None:
    """Turn this process's checks on or off (``install``: wrap torch's calls, if on)."""
    _on[0] = bool(on)
    if on and install:
        install_wrappers()


def install_wrappers() -> bool:
    """Wrap torch.distributed's calls (idempotent; nothing until torch.distributed is imported,
    which this never does). False when there is nothing to wrap."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    dist = sys.modules.get("torch.distributed")
    if c10d is None or dist is None:
        return False
    p2p.install()  # inside ours: a send or recv is counted once it passed its check, as torch makes it
    for name in CHECKED + MAKERS:
        current = getattr(c10d, name, None)
        if current is None or name in _wrappers and _is_ours(current, name):
            continue
        wrapper = (_maker(current) if name in MAKERS else _checker(name, current))
        _originals[name], _wrappers[name] = current, wrapper
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is current:
            setattr(dist, name, wrapper)
    _rebind_imported()
    return True


def _rebind_imported() -> None:
    """Point at our wrappers every module-level name an import made before :func:`install` bound to
    torch's own call (DTensor's ``_collective_utils`` takes ``scatter`` from distributed_c10d, and
    ``device_mesh`` its ``init_process_group``). Every rank must check a call or none may: one
    that checks waits for its peers' calls, and a peer whose process imported the module earlier
    went straight into gloo, publishing none: both waited for good. ``__main__`` is the
    caller's (rank/checks.py swaps it around a call)."""
    look_for_bound_names()
    for namespace, key, name in _bound:
        if namespace.get(key) is _originals.get(name):
            namespace[key] = _wrappers[name]


def look_for_bound_names() -> None:
    """Find, in the modules not looked at yet, the names bound to torch's own calls (:data:`_bound`).
    A look at every module (~2,400 in a notebook that imported torch, 14 ms) is done ahead where it
    can be: by the notebook's warm-up between cells, by the template as it grows (its forks inherit
    it), so that a call's :func:`install` looks only at what was imported since. Any thread."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return
    own: dict[int, str] = {}
    for name in CHECKED + MAKERS:
        current = getattr(c10d, name, None)
        original = _originals.get(name) if _is_ours(current, name) else current
        if original is not None:
            own[id(original)] = name
    targets = set(own)
    with _scan_lock:
        for module_name, module in list(sys.modules.items()):
            if module_name in _scanned:
                continue
            _scanned.add(module_name)
            if module_name in ("__main__", "torch.distributed.distributed_c10d") or module_name.startswith("mpify_nb"):
                continue
            try:  # past a lazy module's own __getattribute__, which would import it now
                namespace = object.__getattribute__(module, "__dict__")
            except Exception:
                continue
            if not isinstance(namespace, dict):
                continue
            try:  # in C: most modules hold none of torch's calls
                if targets.isdisjoint(map(id, namespace.values())):
                    continue
            except RuntimeError:  # another thread imports into it now: look item by item
                pass
            for key, value in list(namespace.items()):
                name = own.get(id(value))  # both alive: the same id is the same object
                if name is not None:
                    _bound.append((namespace, key, name))


install = install_wrappers


def uninstall() -> None:
    """Put torch's own calls back where ours still stand (a wrapper added on top stays)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    dist = sys.modules.get("torch.distributed")
    for name, wrapper in list(_wrappers.items()):
        for module in (c10d, dist):
            if module is not None and getattr(module, name, None) is wrapper:
                setattr(module, name, _originals[name])
    for namespace, key, name in _bound:
        if name in _wrappers and namespace.get(key) is _wrappers[name]:
            namespace[key] = _originals[name]
    _wrappers.clear()
    _originals.clear()


def _is_ours(value: Any, name: str) -> bool:
    """``value`` is our wrapper of ``name``, or wraps it (p2p.py's note-taker on top of ours)."""
    while value is not None:
        if value is _wrappers.get(name):
            return True
        value = getattr(value, "__wrapped__", None)
    return False


def replacements() -> dict[int, Callable]:
    """{id(torch's own call): our wrapper}: for names bound to torch's own before we came."""
    return {id(original): _wrappers[name] for name, original in _originals.items() if name in _wrappers}


# -- the wrappers ---------------------------------------------------------------------------------

def _checker(name: str, original: Callable) -> Callable:
    kind = {"isend": "send", "irecv": "recv"}.get(name, name)
    blocking = name not in ("isend", "irecv")
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return original

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if not _on[0] or not _wrappers or getattr(_local, "inside", False):  # not installed: the notebook between calls
            return original(*args, **kwargs)
        handed = _check(kind, params, args, kwargs, blocking, original)
        if handed is not None:
            return handed  # an async call's Work, its check still going on (or failed)
        _local.inside = True
        try:
            return original(*args, **kwargs)
        finally:
            _local.inside = False

    return checked


def _issuing(original: Callable, args: tuple, kwargs: dict) -> Callable[[], Any]:
    """The call, to be issued later by its group's lane (deferred.py), on the lane's thread."""
    def issue() -> Any:
        _local.inside = True  # torch's own helpers it runs are not checked again
        try:
            return original(*args, **kwargs)
        finally:
            _local.inside = False

    return issue


def _maker(original: Callable) -> Callable:
    @functools.wraps(original)
    def making(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        if _on[0] and _wrappers and not getattr(_local, "inside", False):
            _set_up_new(made, original.__name__)
        return made

    return making


def _set_up_new(made: Any, how: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    try:
        pg = made if how == "new_group" else c10d._get_default_group()
    except Exception:
        return
    if groups.known(pg)[0]:
        return
    try:
        groups.set_up(pg, lambda: Op(how))
    except groups.CheckAborted:
        raise
    except Exception:
        pass  # that group goes unchecked; its calls work as torch's own


_last: list = [None, None]  # (a weak reference to the group of the last call, its Group)


def _group_of(group: Any, kind: str) -> Optional[groups.Group]:
    if group is None:
        group = _world()
        if group is None:
            return None
    elif isinstance(group, str):
        return None  # a group's name: torch resolves it; not for us to guess
    last = _last[0]
    if last is not None and last() is group:
        return _last[1]
    set_up, found = groups.known(group)
    if not set_up:
        if kind in calls.P2P:
            return None  # a table is made where every member is: at a collective, never here
        found = groups.set_up(group, lambda: Op(kind))
    try:
        _last[:] = [weakref.ref(group), found]
    except TypeError:
        pass
    return found


def forget() -> None:
    """Drop the last call's group (a caller between calls holds none of its own)."""
    _last[:] = [None, None]


def _world() -> Any:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return c10d.GroupMember.WORLD if c10d is not None else None


def _check(kind: str, params: list, args: tuple, kwargs: dict, blocking: bool, original: Callable) -> Any:
    """Check the call; None when the caller is to issue it now, else the Work to hand back."""
    bound = dict(zip(params, args))
    if kwargs:
        bound.update(kwargs)
    group = _group_of(bound.get("group"), kind)
    if group is None or group.aborted or not (group.pure or _on_gloo(group, bound)):
        return None
    try:
        description = calls.encode(calls.describe(kind, bound, group.group_rank, blocking))
    except calls.Unchecked:
        if kind in calls.P2P:
            group.p2p_unpaired(kind)
            return None
        description = calls.UNCHECKED
    line = _user_line(sys._getframe(2))

    def checking() -> Op:  # what a look at this rank says it waits in (torchdist/waits.py)
        return group.op_of(calls.decode(description), group.number())

    if kind in calls.P2P:
        d = calls.decode(description)
        group.p2p(kind, d[2], d[3], description, line, checking)
        return None
    if bound.get("async_op") and deferrable(group.pg()):
        return group.collective_async(description, line, _issuing(original, args, kwargs))
    group.collective(description, line, checking)
    return None


def deferrable(pg: Any) -> bool:
    from .deferred import deferrable as may_defer

    return may_defer(pg)


def _on_gloo(group: groups.Group, bound: dict) -> bool:
    """Does gloo run this call (a group with another backend too: the one for its tensors' device)?"""
    for value in bound.values():
        device = getattr(value, "device", None)
        if device is None and isinstance(value, (list, tuple)) and value:
            device = getattr(value[0], "device", None)
        if device is not None:
            return getattr(device, "type", None) in group.devices
    return False  # a barrier: run by whichever backend torch picks


_user_code: dict[Any, bool] = {}
_lines: dict[tuple[Any, int], bytes] = {}


def _user_line(frame: Any) -> bytes:
    """(file, line) of the user's call, encoded: the first frame out that is neither torch's, the
    standard library's nor ours (torch's ``all_gather_object`` calls ``all_gather``)."""
    if not groups.USER_FILE:
        return b""
    is_user_file = groups.USER_FILE[0]
    while frame is not None:
        code = frame.f_code
        mine = _user_code.get(code)
        if mine is None:
            mine = is_user_file(code.co_filename)
            if not code.co_filename.startswith("<"):
                _user_code[code] = mine
        if mine:
            key = (code, frame.f_lineno)
            line = _lines.get(key)
            if line is None:
                if len(_lines) > 4096:
                    _lines.clear()
                line = _lines[key] = calls.encode((code.co_filename, frame.f_lineno))
            return line
        frame = frame.f_back
    return b""
