"""What travels by reference and what by value.

The payload's pickler (wire/payload.py) asks this module about every function it meets::

    function f
      |- f.__module__ is an importable module and f is found there by f.__qualname__
      |      -> by reference: (module, qualname); the rank imports the module
      |         (a library's function, a method, a @patch-ed method, a function of the
      |          notebook's own .py files: anything ``import`` can reach)
      |- f lives in an importable module but is not reachable by name (a closure or a lambda
      |  made inside a library function, a decorator's wrapper)
      |      -> by value: its code, defaults and closure; its globals are the module's own
      |         dict on the rank (imported there), never copied
      '- f lives in the notebook (``__main__``), or in a module the rank cannot import (one
         made with exec/types.ModuleType in a cell)
             -> by value: its code, defaults, closure, and the globals its code names
                (LOAD_GLOBAL and friends in its bytecode and its nested code, nothing more),
                each pickled in turn by the same rules

So the pickler walks the notebook's own functions and never a library's globals: a fastai
metric used by a notebook function is one reference (``fastai.metrics.accuracy``), however
its module's functions call each other. Functions shipped by value from one globals dict share
one dict on the rank, as they share ``__main__`` in the notebook.

Classes follow the same rule: by name when importable; by value when defined in the notebook,
made on the rank from what their metaclass must see at creation (functions, properties,
constants), everything else set on them once they exist (it may name the class: a registry,
a dispatch table); enums from their members' values, then their methods.

When pickling fails, wire/failpath.py names the path to the culprit the way the user wrote it::

    train -> global 'cb' (Logger) -> attribute .conn: a socket (socket)
"""

from __future__ import annotations

import dis
import enum
import importlib
import linecache
import os
import sys
import types
from typing import Any, Optional

# -- where a function lives ----------------------------------------------------------------

_MAIN_NAMES = ("__main__", "__mp_main__")
#: module name -> may a rank import it by that name? (kept for the process: modules don't move)
_importable: dict[str, bool] = {}


def importable(module_name: Optional[str]) -> bool:
    """A module the rank can import by name: loaded here from a file or by an import system
    loader (site-packages, the standard library, the notebook's own .py files, an editable
    install), not the notebook itself nor a module made at run time (exec, types.ModuleType)."""
    if not module_name or module_name in _MAIN_NAMES:
        return False
    known = _importable.get(module_name)
    if known is not None:
        return known
    module = sys.modules.get(module_name)
    if module is None:
        return False  # not loaded here: the name in __module__ may be a lie; don't cache
    spec = getattr(module, "__spec__", None)
    verdict = spec is not None and spec.loader is not None and spec.name == module_name
    _importable[module_name] = verdict
    return verdict


def by_reference(obj: Any) -> bool:
    """Can ``obj`` (a function or class) travel as (module, qualname)?"""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str) or "<locals>" in qualname or not importable(module_name):
        return False
    found: Any = sys.modules[module_name]  # type: ignore[index]
    for part in qualname.split("."):
        try:
            found = getattr(found, part, None)
        except Exception:  # a module __getattr__ that raises something else (ImportError...)
            return False
        if found is None:
            return False
    return found is obj


def is_notebooks(f: types.FunctionType) -> bool:
    """Does ``f`` take its globals from the notebook (or another module no rank can import)?"""
    return not importable(f.__module__) or _module_dict(f.__module__) is not f.__globals__


def _module_dict(name: str) -> Any:
    module = sys.modules.get(name)
    return getattr(module, "__dict__", None)


# -- an object a module holds -----------------------------------------------------------------
#
# An instance that lives in an importable module as one of its globals (plum's ``dispatch``,
# fastai's ``defaults``, a library's registry or config object) travels as (module, name), like a
# function: the rank's own, as its library made it. Found through an index of the globals of the
# modules loaded here, built a module at a time as modules appear (~10 ms per 1000 modules).

_SCALARS = (type(None), bool, int, float, complex, str, bytes, types.ModuleType, types.FunctionType,
            types.BuiltinFunctionType, types.MethodType, type)
_held: dict[int, tuple[str, str]] = {}  # id(object) -> (module, name), the first module that holds it
_indexed: set[str] = set()
_indexed_at = [0]  # len(sys.modules) when last indexed


def _index() -> None:
    _indexed_at[0] = len(sys.modules)
    for module_name, module in list(sys.modules.items()):
        if module_name in _indexed:
            continue
        _indexed.add(module_name)
        if not importable(module_name):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for name, value in items:
            # type(), not isinstance(): that would read __class__, which some objects warn about
            # (torch.distributed.reduce_op) or compute.
            if not name.startswith("__") and not issubclass(type(value), _SCALARS):
                _held.setdefault(id(value), (module_name, name))


def index_modules() -> None:
    """Index the globals of the modules loaded since the last look (a call does it when it needs
    to; a warm-up does it ahead, so the first call after many imports need not)."""
    if _indexed_at[0] != len(sys.modules):
        _index()


def held_by_module(obj: Any) -> Optional[tuple[str, str]]:
    """(module, name) when ``obj`` is that global of an importable module (checked, not guessed)."""
    if issubclass(type(obj), _SCALARS):
        return None
    if _indexed_at[0] != len(sys.modules):
        _index()
    where = _held.get(id(obj))
    if where is None:
        return None
    module = sys.modules.get(where[0])
    if module is None or vars(module).get(where[1]) is not obj:
        del _held[id(obj)]  # that object is gone, and another one has its id
        return None
    return where


def reduce_held(where: tuple[str, str]) -> tuple:
    return (_global_of, where)


def _global_of(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


# -- a function by value ---------------------------------------------------------------------

#: id(code) -> (code, the global names it and its nested code use); code objects are immutable.
_names_of_code: dict[int, tuple[types.CodeType, frozenset[str]]] = {}
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME",
                         "DELETE_NAME"})


def global_names(code: types.CodeType) -> frozenset[str]:
    """The global names ``code`` reads or writes, nested functions, lambdas, comprehensions and
    class bodies included (from its bytecode: an attribute name like ``np.zeros``'s ``zeros``
    is not a global)."""
    known = _names_of_code.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    names: set[str] = set()
    todo = [code]
    while todo:
        c = todo.pop()
        for instruction in dis.get_instructions(c):
            if instruction.opname in _GLOBAL_OPS:
                names.add(instruction.argval)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    result = frozenset(names)
    if len(_names_of_code) > 4096:
        _names_of_code.clear()
    _names_of_code[id(code)] = (code, result)
    return result


class ModuleGlobals:
    """Stands for an importable module's ``__dict__`` in a pickle: the rank imports the module
    and uses its own dict (the globals of a library closure shipped by value)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _module_globals(name: str) -> dict:
    return importlib.import_module(name).__dict__


def _make_cell() -> types.CellType:
    return types.CellType()


def make_function(code: types.CodeType, globals_: dict, name: str, closure: Optional[tuple]) -> types.FunctionType:
    return types.FunctionType(code, globals_, name, None, closure)


def _set_function_state(f: types.FunctionType, state: dict) -> None:
    """Finish a function made by make_function, once everything it refers to exists."""
    for name, value in state.get("globals", {}).items():
        f.__globals__.setdefault(name, value)  # one dict for all the notebook's functions: first wins
    for cell, value in zip(f.__closure__ or (), state.get("closure", {}).values()):
        if value is not _EMPTY:
            cell.cell_contents = value
    f.__defaults__ = state.get("defaults")
    f.__kwdefaults__ = state.get("kwdefaults")
    f.__qualname__ = state.get("qualname", f.__name__)
    setattr(f, "__module__", state.get("module"))  # noqa: B010  (None is a fine value, not for pyright)
    f.__doc__ = state.get("doc")
    f.__annotations__ = state.get("annotations") or {}
    f.__dict__.update(state.get("dict") or {})


class _Empty:
    """An empty closure cell's value in a pickle (a variable the enclosing function has not set yet)."""

    def __reduce__(self) -> str:
        return "_EMPTY"


_EMPTY = _Empty()


def set_globals(globals_: dict, values: dict) -> None:
    for name, value in values.items():
        globals_.setdefault(name, value)


def reduce_function(f: types.FunctionType, shared_globals: dict[Any, Any], later: Optional[list] = None) -> tuple:
    """pickle's 6-tuple for ``f`` by value. The function exists (and is memoized) before its
    state is pickled, so a function that refers to itself, or two that refer to each other,
    come back as themselves. ``shared_globals``, one per pickle: id(globals) -> the dict that
    stands for it (so the notebook's functions share their globals on the rank, as here), and
    module name -> its ModuleGlobals.
    ``later``: dill's list of steps to run once the object it is building now (a notebook class
    whose methods these are) exists. A method's globals and closure (``super()``'s ``__class__``
    cell) may name that very class, so they are set then, as dill does for its own functions."""
    code = f.__code__
    if is_notebooks(f):
        base = shared_globals.get(id(f.__globals__))
        if base is None:
            base = shared_globals[id(f.__globals__)] = {"__name__": f.__globals__.get("__name__", f.__module__)}
        glob = f.__globals__
        own = {name: glob[name] for name in sorted(global_names(code)) if name in glob}
        builtins_ = glob.get("__builtins__")
        if builtins_ is not None and "__builtins__" not in base:
            base["__builtins__"] = sys.modules["builtins"]  # the rank's own builtins
    else:
        base = shared_globals.get(f.__module__)  # type: ignore[call-overload]
        if base is None:
            base = shared_globals[f.__module__] = ModuleGlobals(f.__module__)  # type: ignore[index]
        own = {}
    closure = f.__closure__
    values = {}
    if closure is not None:
        for name, cell in zip(code.co_freevars, closure):
            try:
                values[name] = cell.cell_contents
            except ValueError:
                values[name] = _EMPTY
    if later is not None:
        if own:
            later.append((set_globals, (base, own)))
            own = {}
        for cell, value in zip(closure or (), values.values()):
            if value is not _EMPTY:
                later.append((setattr, (cell, "cell_contents", value)))
        values = {name: _EMPTY for name in values}
    state: dict[str, Any] = {"globals": own, "closure": values}
    if f.__defaults__ is not None:
        state["defaults"] = f.__defaults__
    if f.__kwdefaults__:
        state["kwdefaults"] = f.__kwdefaults__
    if f.__qualname__ != f.__name__:
        state["qualname"] = f.__qualname__
    state["module"] = f.__module__
    if f.__doc__ is not None:
        state["doc"] = f.__doc__
    if f.__annotations__:
        state["annotations"] = f.__annotations__
    if f.__dict__:
        state["dict"] = f.__dict__
    return (make_function, (code, base, f.__name__, closure), state, None, None, _set_function_state)


def reduce_module_globals(obj: ModuleGlobals) -> tuple:
    return (_module_globals, (obj.name,))


def reduce_cell(cell: types.CellType) -> tuple:
    """A closure cell travels empty (memoized, so closures that share it still do); the
    functions that use it fill it in their state."""
    return (_make_cell, ())


# -- a class by value ---------------------------------------------------------------------------
#
# A notebook class is made on the rank from what its metaclass must see at creation (functions,
# properties, class and static methods, constants, slots, the docstring), then everything else is
# set on it (a dispatch table, a registry, a list of instances...). Those may refer to the class
# itself, which exists by then: dill puts the whole class dict in the class's constructor
# arguments and, on such a cycle, falls back to a by-name reference no rank can resolve.

_CONSTANTS = (type(None), bool, int, float, complex, str, bytes)
_NOT_COPIED = ("__dict__", "__weakref__", "_abc_impl", "__abstractmethods__")  # made again by type()/ABCMeta


def _at_creation(value: Any) -> bool:
    if isinstance(value, (types.FunctionType, property, classmethod, staticmethod)) or isinstance(value, _CONSTANTS):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(isinstance(v, _CONSTANTS) for v in value)
    return isinstance(value, type) and by_reference(value)


def by_value_class(obj: Any) -> bool:
    """A class that must travel by value here (not an enum: reduce_enum; not a namedtuple: dill)."""
    return (isinstance(obj, type) and not by_reference(obj) and not isinstance(obj, enum.EnumMeta)
            and not (issubclass(obj, tuple) and hasattr(obj, "_fields")) and obj.__module__ != "builtins")


def reduce_class(cls: type) -> tuple[tuple, dict]:
    """(the reduction that makes ``cls``, the attributes to set on it once it exists)."""
    namespace = dict(vars(cls))
    slots = namespace.get("__slots__", ())
    for name in (*_NOT_COPIED, *((slots,) if isinstance(slots, str) else slots)):
        namespace.pop(name, None)
    now = {k: v for k, v in namespace.items() if _at_creation(v)}
    later = {k: v for k, v in namespace.items() if k not in now}
    bases = namespace.pop("__orig_bases__", None) or cls.__bases__
    now.pop("__orig_bases__", None)
    later.pop("__orig_bases__", None)
    return (_make_class, (type(cls), cls.__name__, tuple(bases), now)), later


def _make_class(metaclass: type, name: str, bases: tuple, namespace: dict) -> type:
    return types.new_class(name, bases, {"metaclass": metaclass}, lambda ns: ns.update(namespace))


# -- an enum class by value ---------------------------------------------------------------------
#
# dill cannot rebuild an Enum defined in the notebook (its members refer to the class; it falls
# back to a by-name reference the rank cannot resolve). Here the class is made first from its
# members' values, then its methods are set on it (they may name the class itself).

def by_value_enum(obj: Any) -> bool:
    """An enum class defined in the notebook (or anywhere not importable)."""
    return isinstance(obj, enum.EnumMeta) and not by_reference(obj)


def reduce_enum(cls: type) -> tuple:
    # Aliases too: given the same value again, Enum makes them aliases again.
    members = {name: member._value_ for name, member in cls.__members__.items()}  # type: ignore[attr-defined]
    inherited = [vars(base) for base in cls.__mro__[1:]]
    methods = {name: value for name, value in vars(cls).items()
               if name not in cls.__members__  # type: ignore[attr-defined]
               and isinstance(value, (types.FunctionType, property, classmethod, staticmethod))
               and not any(base.get(name) is value for base in inherited)}
    return (_make_enum, (type(cls), cls.__bases__, cls.__name__, cls.__qualname__, cls.__module__, members),
            methods, None, None, set_attributes)


def _make_enum(metaclass: type, bases: tuple, name: str, qualname: str, module: str, members: dict) -> type:
    namespace = metaclass.__prepare__(name, bases)  # type: ignore[attr-defined]
    for member, value in members.items():
        namespace[member] = value
    namespace["__module__"] = module
    namespace["__qualname__"] = qualname
    return metaclass(name, bases, namespace)


def set_attributes(obj: Any, attributes: dict) -> None:
    for name, value in attributes.items():
        setattr(obj, name, value)


# -- the notebook's cell sources a shipped function came from -------------------------------------

def cell_sources(fn: Any) -> dict[str, list[str]]:
    """The source lines of the notebook cells ``fn`` (and the notebook functions and classes it
    reaches) was defined in. They exist only in this process's linecache (no file on disk), so a
    rank's warnings and tracebacks would otherwise show no source line."""
    files: set[str] = set()
    seen: set[int] = set()
    stack: list[Any] = [fn]
    while stack and len(seen) < 1000:
        obj = stack.pop()
        obj = getattr(obj, "__func__", getattr(obj, "func", obj))  # bound methods, partials
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            if obj.__module__ == "__main__":
                stack.extend(vars(obj).values())
            continue
        code = getattr(obj, "__code__", None)
        if not isinstance(code, types.CodeType):
            continue
        codes = [code]
        while codes:
            c = codes.pop()
            files.add(c.co_filename)
            codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        if getattr(obj, "__module__", None) == "__main__":
            glob = getattr(obj, "__globals__", {})
            stack.extend(glob[name] for name in code.co_names if name in glob)
            stack.extend(cell.cell_contents for cell in (getattr(obj, "__closure__", None) or ())
                         if _filled(cell))
    sources = {}
    for filename in files:
        entry = linecache.cache.get(filename)
        if entry is not None and len(entry) == 4 and entry[1] is None and not os.path.exists(filename):
            sources[filename] = list(entry[2])
    return sources


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True
