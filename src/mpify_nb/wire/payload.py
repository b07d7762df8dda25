"""Packing a call for the ranks, and packing a rank's answer for the caller.

This module does one hard job: turn what a notebook user wrote into bytes
another process can run, and back.

* Functions, lambdas, closures and classes defined in the notebook (module
  ``__main__``) travel *by value*, each function with the globals its code names:
  a function that uses ``np`` or a helper from another cell works on a rank without
  ``need=``/``imports=``. What an importable module holds (its functions, classes,
  methods; the module itself) travels *by reference* and is imported on the rank;
  no library's globals are ever walked (wire/ship.py decides which is which).
* Before a rank loads a call, it imports what the notebook had imported that the
  call can depend on (wire/modules.py): a module that patches classes when it is
  imported (fastai's ``@patch``) has done so on the rank too, whether or not the
  template process had preloaded it.
* Big CPU tensors (>= ``SHARED_TENSOR_MIN_BYTES``) are not pickled: their bytes
  are copied once into an anonymous shared-memory file (memfd) whose descriptor
  rides beside the message. A rank maps it copy-on-write, so N ranks read one
  copy and cannot see each other's writes; results come back the same way, and
  the caller's tensor *is* the mapping (no second copy).
* Notebook classes in a result come back as the caller's own class object (so
  ``isinstance(result, MyClass)`` holds), not as a look-alike copy.
* When something cannot be pickled, the error names the path to it, from the
  function, argument, context manager or return value down to the culprit:
  ``train -> global 'cb' (Logger) -> attribute .fh: an open file``.
"""

from __future__ import annotations

import builtins
import io
import linecache
import os
import pickle
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any, Callable, Optional

import dill

from . import failpath, modules, ship, shm
from .errors import PayloadError
from .shm import close_fds

SHARED_TENSOR_MIN_BYTES = 1 << 20
#: Extra memfds one payload may spend on pieces (every rank receives them all at once).
_PIECE_BUDGET = 64

_TENSOR_TAG = "mpify_nb.tensor"
_ARRAY_TAG = "mpify_nb.array"
_MAIN_CLASS_TAG = "mpify_nb.main_class"


# -- pickling with shared tensors and arrays ----------------------------------------------
#
# What goes to shared memory, and how it comes back:
#
#   big tensor, covering most of its storage  ->  the whole storage, once per payload; every
#                                                 tensor on it (the tensor, its views) is an
#                                                 (offset, shape, stride) on that one mapping,
#                                                 so aliasing survives the trip
#   big view of a much bigger storage         ->  its own bytes only (a compact copy)
#   small view of a big storage               ->  pickled as a compact copy (torch would
#                                                 pickle the whole storage)
#   big numpy array (no Python objects)       ->  its bytes, C or Fortran order kept (any dtype:
#                                                 datetime64 too, viewed as bytes and back)
#   anything else                             ->  plain pickle

class _Pickler(failpath.PathTracker, dill.Pickler):
    """dill's pickler, plus: functions by reference or by value as wire/ship.py decides; big CPU
    tensors and arrays go to memfds; optionally, notebook classes by name; the path to what
    failed."""

    def __init__(self, file, *, classes_by_name: bool = False):
        super().__init__(file, protocol=dill.HIGHEST_PROTOCOL, recurse=False, byref=False)
        self._track_init()
        self._globals: dict[Any, Any] = {}  # a function's globals -> what stands for them (ship.py)
        self.fds: list[int] = []
        self._objects: dict[int, tuple] = {}  # id(tensor or array) -> its persistent id
        self._kept: list[Any] = []  # keeps those ids valid while we pickle
        self._storages: dict[int, Any] = {}  # storage address -> fd index (a tuple: pieces)
        self._piece_budget = _PIECE_BUDGET
        self._classes_by_name = classes_by_name
        self._torch = shm.loaded("torch")  # no torch imported: no tensors to look for
        self._numpy = shm.loaded("numpy")

    def save_specially(self, obj, save_persistent_id: bool) -> bool:
        """A class of the notebook: made from its functions and constants, the rest set on it
        after (ship.reduce_class), dill's way of deferring steps until it exists."""
        memo: dict = self.memo  # type: ignore[attr-defined]
        if isinstance(obj, type) and id(obj) not in memo and ship.by_value_class(obj) \
                and not (save_persistent_id and self.persistent_id(obj) is not None):
            reduction, attributes = ship.reduce_class(obj)
            self.mark(attributes, "class attributes", obj)
            self.mark(reduction[1][3], "class attributes", obj)
            dill._dill._save_with_postproc(self, reduction, obj=obj,
                                            postproc_list=[(ship.set_attributes, (obj, attributes))])
            return True
        return False

    def persistent_id(self, obj):
        if self._classes_by_name and isinstance(obj, type) and obj.__module__ == "__main__":
            # By value too, in case the caller has no class of that name any more.
            return (_MAIN_CLASS_TAG, obj.__qualname__, dill.dumps(obj, recurse=True))
        known = self._objects.get(id(obj))
        if known is not None:
            return known
        torch, numpy = self._torch, self._numpy
        pid = None
        if torch is not None and isinstance(obj, torch.Tensor) and _shareable_kind(torch, obj):
            pid = self._tensor_id(torch, obj)
        elif numpy is not None and type(obj) is numpy.ndarray and _shareable_array(obj):
            pid = self._array_id(numpy, obj)
        if pid is not None:
            self._objects[id(obj)] = pid
            self._kept.append(obj)
        return pid

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is types.FunctionType:
            if ship.by_reference(obj):
                return NotImplemented  # dill saves it as (module, qualname)
            # Inside a notebook class dill is building: what may name the class is set after it.
            later = next(iter(self._postproc.values()), None) if self._postproc else None
            before = len(later) if later is not None else 0
            reduced = ship.reduce_function(obj, self._globals, later)
            for step in (later or [])[before:]:
                if step[0] is ship.set_globals:
                    self.mark(step[1][1], "globals", obj)
            return reduced
        if kind is types.CellType:
            return ship.reduce_cell(obj)
        if ship.by_value_enum(obj):
            return ship.reduce_enum(obj)
        if kind is ship.ModuleGlobals:
            return ship.reduce_module_globals(obj)
        # To the ranks, what a module holds is the rank's own; a rank's answer is its value, though.
        where = None if self._classes_by_name else ship.held_by_module(obj)
        if where is not None:
            return ship.reduce_held(where)
        builtin_name = _swapped_builtin(obj)
        if builtin_name is not None:
            return getattr, (builtins, builtin_name)
        torch = self._torch
        if torch is not None and type(obj) is torch.Tensor and _shareable_kind(torch, obj) \
                and obj.untyped_storage().nbytes() > 2 * _nbytes(obj) and obj.untyped_storage().nbytes() > 4096:
            # A small view of a big storage: torch would pickle the whole storage.
            return _same, (obj.detach().clone().requires_grad_(obj.requires_grad),)
        return NotImplemented

    def _tensor_id(self, torch, t) -> Optional[tuple]:
        storage = t.untyped_storage()
        address, storage_bytes, view_bytes = storage.data_ptr(), storage.nbytes(), _nbytes(t)
        is_param = isinstance(t, torch.nn.Parameter)
        index = self._storages.get(address) if address else None
        if index is None and view_bytes >= SHARED_TENSOR_MIN_BYTES and 2 * view_bytes >= storage_bytes:
            index = self._add_fds(self._memfds_of(shm.address_view(address, storage_bytes)))
            self._storages[address] = index
        if index is not None:
            offset_bytes = t.storage_offset() * t.element_size()
            return (_TENSOR_TAG, len(self._objects), index, t.dtype, tuple(t.shape), tuple(t.stride()),
                    offset_bytes, t.requires_grad, is_param)
        if view_bytes < SHARED_TENSOR_MIN_BYTES:
            return None
        compact = t.detach().contiguous()
        fds = self._memfds_of(shm.address_view(compact.data_ptr(), view_bytes))
        return (_TENSOR_TAG, len(self._objects), self._add_fds(fds), t.dtype, tuple(t.shape),
                tuple(compact.stride()), 0, t.requires_grad, is_param)

    def _array_id(self, numpy, a) -> tuple:
        fortran = a.flags.f_contiguous and not a.flags.c_contiguous
        source = a.T if fortran else a if a.flags.c_contiguous else numpy.ascontiguousarray(a)
        # As bytes: numpy gives no buffer of some dtypes (datetime64, timedelta64, records with them).
        fds = self._memfds_of(memoryview(source.reshape(-1).view(numpy.uint8)).cast("B"))
        return (_ARRAY_TAG, len(self._objects), self._add_fds(fds), a.dtype.str if a.dtype.names is None else a.dtype,
                a.shape, fortran)

    def _memfds_of(self, view: memoryview) -> list[int]:
        fds = shm.memfds_of(view, max_pieces=1 + self._piece_budget)
        self._piece_budget -= len(fds) - 1
        return fds

    def _add_fds(self, fds: list[int]) -> Any:
        """The index of one fd, or a tuple of indices for a tensor in pieces."""
        first = len(self.fds)
        self.fds.extend(fds)
        return first if len(fds) == 1 else tuple(range(first, len(self.fds)))


def _swapped_builtin(obj) -> Optional[str]:
    """The builtin name ``obj`` stands for, when it must travel by that name: ipykernel swaps
    ``builtins.input`` for its kernel's method during a cell (the original then fails pickle's
    by-name check, and the method would drag the kernel along). A rank uses its own input()."""
    if obj is builtins.__dict__.get("input"):
        return "input"
    if type(obj) is types.BuiltinFunctionType and getattr(obj, "__self__", None) is builtins \
            and builtins.__dict__.get(obj.__name__) is not obj:
        return obj.__name__
    return None


def _same(x):
    return x


class _Unpickler(dill.Unpickler):
    def __init__(self, file, fds: list[int], *, private: bool, windows: Optional[dict[int, tuple[int, int]]] = None):
        super().__init__(file)
        self._fds = fds
        self._private = private
        self._windows = windows or {}  # fd index -> (offset, length): that part of the file, not all of it
        self._objects: dict[int, Any] = {}  # the object number in the pid -> what it became
        self._mappings: dict[int, Any] = {}  # fd index -> a uint8 tensor (or array) mapping it

    def persistent_load(self, pid):
        tag = pid[0]
        if tag == _TENSOR_TAG:
            _, number, index, dtype, shape, stride, offset_bytes, requires_grad, is_param = pid
            if number not in self._objects:  # the same tensor referenced twice stays one tensor
                import torch

                raw = self._mapping(index)
                typed = raw[offset_bytes:].view(dtype) if raw.numel() > offset_bytes else raw[:0].view(dtype)
                tensor = torch.as_strided(typed, shape, stride) if shape else typed[0]
                if is_param:
                    tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
                else:
                    tensor.requires_grad_(requires_grad)
                self._objects[number] = tensor
            return self._objects[number]
        if tag == _ARRAY_TAG:
            _, number, index, dtype, shape, fortran = pid
            if number not in self._objects:
                import numpy

                flat = self._mapping(index, as_array=True).view(numpy.dtype(dtype))
                self._objects[number] = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
            return self._objects[number]
        if tag == _MAIN_CLASS_TAG:
            _, qualname, by_value = pid
            here = _lookup_main(qualname)
            return here if isinstance(here, type) else dill.loads(by_value)
        raise dill.UnpicklingError(f"unknown persistent id {tag!r}")

    def _mapping(self, index: int, as_array: bool = False):
        """The memfd ``index`` mapped once: ranks map it private (copy-on-write: their writes
        stay their own), the caller shared (the result *is* the mapping, no second copy)."""
        if index not in self._mappings:
            indices = index if isinstance(index, tuple) else (index,)
            if indices[0] in self._windows:
                self._mappings[index] = shm.map_windows(
                    [(self._fds[i], *self._windows[i]) for i in indices], self._private)
            elif isinstance(index, tuple):
                self._mappings[index] = shm.map_pieces([self._fds[i] for i in index], self._private)
            else:
                self._mappings[index] = shm.map_memfd(self._fds[index], self._private)
            if not self._private:
                shm.mapped_shared()
        mapping = self._mappings[index]
        if as_array and not isinstance(mapping, _np_ndarray()):
            return mapping.numpy()
        return mapping


def _np_ndarray():
    numpy = sys.modules.get("numpy")
    return numpy.ndarray if numpy is not None else ()


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _shareable_kind(torch, t) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and (t.is_leaf or not t.requires_grad)
        and not t.is_neg() and not t.is_conj()
    )


def _shareable_array(a) -> bool:
    return not a.dtype.hasobject and a.nbytes >= SHARED_TENSOR_MIN_BYTES


def _lookup_main(qualname: str) -> Any:
    obj: Any = sys.modules.get("__main__")
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def dumps(obj: Any, *, classes_by_name: bool = False,
          labels: Optional[dict[int, str]] = None) -> tuple[bytes, list[int]]:
    """Pickle ``obj``; return the bytes and the memfds that carry its big tensors.
    The caller owns the fds and must close them once sent. On failure the exception gets
    ``mpify_where``: (the steps down to what failed, what it is and why; see ship.explain),
    the steps named from ``labels`` (id(part of obj) -> its name) down."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, classes_by_name=classes_by_name)
    try:
        pickler.dump(obj)
    except BaseException as e:
        close_fds(pickler.fds)
        if pickler.failed_path is not None:
            try:
                e.mpify_where = failpath.explain(pickler.failed_path, pickler._roles, labels or {}, e)  # type: ignore[attr-defined]
            except Exception:
                pass  # the error itself still says what went wrong
        raise
    return buf.getvalue(), pickler.fds


def loads(data, fds: Sequence[int] = (), *, private: bool = False,
          windows: Optional[dict[int, tuple[int, int]]] = None) -> Any:
    """Unpickle what ``dumps`` made (bytes, or a stream positioned at it). Closes ``fds``
    (mappings stay valid without them). ``windows``: fd index -> (offset, length), for an fd
    whose tensor is only that part of its file (see ``shm.map_windows``)."""
    stream = data if isinstance(data, io.BytesIO) else io.BytesIO(data)
    try:
        return _Unpickler(stream, list(fds), private=private, windows=windows).load()
    finally:
        close_fds(fds)


# -- the call -----------------------------------------------------------------------------

class PackedCall:
    """A call ready to send: the same bytes and memfds go to every rank; ``modules``: what a rank
    imports before loading it (wire/modules.py), sent ahead of the bytes by :meth:`body`."""

    def __init__(self, data: bytes, fds: list[int], modules: tuple[str, ...] = ()):
        self.data = data
        self.fds = fds
        self.modules = modules
        self._bodies: dict[Optional[frozenset], bytes] = {}

    def body(self, held: Optional[frozenset[str]] = None) -> bytes:
        """The bytes for a rank born holding the modules ``held`` (None: unknown, all of them)."""
        body = self._bodies.get(held)
        if body is None:
            body = self._bodies[held] = modules.preamble(self.modules, held) + self.data
        return body

    def close(self) -> None:
        close_fds(self.fds)
        self.fds = []

    def close_later(self) -> None:
        """Close, off the caller's path: the last close of a big memfd frees its pages
        (~40 ms for 256 MiB), which the call need not wait for."""
        if self.fds:
            fds, self.fds = self.fds, []
            threading.Thread(target=close_fds, args=(fds,), name="mpify_nb-free", daemon=True).start()


class RankFirst:
    """``func(rank, *args, **kwargs)`` on every rank, ``rank`` its RANK: the way ``mp.spawn`` calls
    ``fn(i, *args)`` (``ranch(..., pass_rank=True)``). Shipped with ``func`` inside it, by value
    when the notebook defined it, like any function."""

    def __init__(self, func: Callable) -> None:
        self.func = func  # ship.cell_sources follows .func, as for a partial
        self.__qualname__ = getattr(func, "__qualname__", type(func).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(int(os.environ["RANK"]), *args, **kwargs)


def pack_call(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    ctx: Any = None,
    need: str = "",
    imports: str = "",
) -> PackedCall:
    """Pickle everything a rank needs to run ``fn(*args, **kwargs)`` inside ``ctx``.

    Raises PayloadError naming the first part that cannot be pickled.
    """
    if imports:
        try:
            compile(imports, "<imports>", "exec")
        except SyntaxError as e:
            raise PayloadError(f"imports= is not valid Python: {e}") from None
    needed = _needed_globals(need)
    call = (fn, args, kwargs, ctx, needed, imports, ship.cell_sources(fn))
    name = f"{getattr(fn, '__qualname__', None) or type(fn).__name__}()"
    labels = {id(fn): name, id(args): "", id(kwargs): "", id(needed): ""}
    labels.update((id(a), f"argument {i}") for i, a in enumerate(args))
    labels.update((id(v), f"keyword argument {k!r}") for k, v in kwargs.items())
    labels.update((id(v), f"need= global {k!r}") for k, v in needed.items())
    if ctx is not None:
        labels[id(ctx)] = f"ctx ({type(ctx).__name__})"
    try:
        data, fds = dumps(call, labels=labels)
    except Exception as e:
        raise failpath.unshippable(e, name) from e
    return PackedCall(data, fds, modules.for_call())


def pack_values(values: dict) -> PackedCall:
    """Variables for a Session's ranks (push), like a call: PayloadError names the path to what
    cannot be pickled; the notebook's modules go ahead of them."""
    labels = {id(v): f"variable {k!r}" for k, v in values.items()}
    try:
        data, fds = dumps(values, labels=labels)
    except Exception as e:
        raise failpath.unshippable(e, f"{sorted(values)}") from e
    return PackedCall(data, fds, modules.for_call())


def _after_imports(data, fds) -> io.BytesIO:
    """Read what PackedCall.body() put ahead of the pickle and import those modules; the stream
    is then at the pickle."""
    stream = io.BytesIO(data)
    try:
        modules.import_all(pickle.load(stream))
    except BaseException:
        close_fds(fds)
        raise
    return stream


def unpack_values(data, fds) -> Any:
    """Load what pack_values() made (and PackedCall.body() sent)."""
    return loads(_after_imports(data, fds), fds, private=True)


def unpack_call(data, fds, windows: Optional[dict[int, tuple[int, int]]] = None
                ) -> tuple[Callable, tuple, dict, Any, dict, str]:
    """Load what pack_call() made (and PackedCall.body() sent)."""
    *call, sources = loads(_after_imports(data, fds), fds, private=True, windows=windows)
    for filename, lines in sources.items():  # a warning's or traceback's source line, as in the notebook
        linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
    return tuple(call)  # type: ignore[return-value]


def _needed_globals(need: str) -> dict:
    names = need.replace(",", " ").split()
    if not names:
        return {}
    main = sys.modules["__main__"].__dict__
    missing = [n for n in names if n not in main]
    if missing:
        raise PayloadError(f"need= names {', '.join(map(repr, missing))}, not defined in __main__")
    return {n: main[n] for n in names}


# -- the answer ---------------------------------------------------------------------------

def pack_result(value: Any) -> tuple[bytes, list[int]]:
    """A rank's answer. Raises PayloadError naming the path to what cannot be pickled."""
    try:
        return dumps(value, classes_by_name=True)
    except Exception as e:
        where = getattr(e, "mpify_where", None)
        if where is None:
            raise
        steps, tail = where
        raise PayloadError(" -> ".join(["the value", *steps]) + f": {tail}") from e


def unpack_result(data, fds) -> Any:
    return loads(data, fds, private=False)


def lend_names(fn: Any, names: dict) -> None:
    """A function shipped by value brings a globals dict of its own (the names it used where
    it was defined). Let it, and the shipped functions it reaches, also see ``names`` (a
    rank's ``__main__`` after need=/imports=, a Session rank's namespace) for the names it
    did not bring, never overriding one it did. Functions of real modules (imported on the
    rank by name) are left alone: their module is not ours to change."""
    import types

    seen: set[int] = set()
    stack = [fn]
    while stack:
        f = stack.pop()
        f = getattr(f, "__func__", getattr(f, "func", f))  # bound methods, functools.partial
        glob = getattr(f, "__globals__", None)
        if glob is None or glob is names or id(glob) in seen:
            continue
        module = sys.modules.get(getattr(f, "__module__", None) or "")
        if module is not None and getattr(module, "__dict__", None) is glob:
            continue
        seen.add(id(glob))
        for name, value in names.items():
            glob.setdefault(name, value)
        stack.extend(v for v in list(glob.values()) if isinstance(v, types.FunctionType))
