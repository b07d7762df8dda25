"""Where in a payload the object that cannot be pickled sits, named the way the user wrote it.

The payload's pickler (wire/payload.py) mixes in :class:`PathTracker`: it keeps the chain of
objects being saved, and marks the containers the pickler makes on the way (a function's
globals and closure, an object's state, a class's attributes), so that on failure
:func:`explain` turns the chain into steps::

    call tuple -> train -> (function state) -> (globals) -> cb -> (state) -> conn
        =>  train -> global 'cb' (Logger) -> attribute .conn: a socket (socket): TypeError: ...
"""

from __future__ import annotations

import io
import socket
import threading
import types
from typing import Any, Optional

from .errors import PayloadError, safe_str
from .ship import make_function, set_globals


class PathTracker:
    """Mixed into a pickle.Pickler (before it): remembers the chain of objects being saved, and
    what each container is (a function's globals, an object's attributes), so a failure can
    name the path to the object that could not be pickled."""

    def _track_init(self) -> None:
        self._stack: list[Any] = []
        self._roles: dict[int, tuple[str, Any]] = {}  # id(container) -> (its role, whose)
        self._kept: list[Any] = []  # keeps the ids in _roles valid
        self.failed_path: Optional[list[Any]] = None

    def mark(self, obj: Any, role: str, whose: Any = None) -> None:
        self._roles[id(obj)] = (role, whose)
        self._kept.append(obj)

    def save_specially(self, obj: Any, save_persistent_id: bool) -> bool:
        """Save ``obj`` in a way of our own and return True, or return False (the pickler's way)."""
        return False

    def save(self, obj, save_persistent_id=True):  # type: ignore[override]
        stack = self._stack
        stack.append(obj)
        try:
            if not self.save_specially(obj, save_persistent_id):
                super().save(obj, save_persistent_id)  # type: ignore[misc]
        except BaseException:
            if self.failed_path is None:  # the deepest frame sees it first
                self.failed_path = list(stack)
            raise
        finally:
            stack.pop()
        if self.failed_path is not None and len(stack) < len(self.failed_path) - 1:
            self.failed_path = None  # someone below handled that failure and went on

    def save_reduce(self, func, args, state=None, listitems=None, dictitems=None, state_setter=None,  # type: ignore[override]
                    *, obj=None):
        if state is not None:
            if func is make_function:
                self.mark(state, "function state", obj)
                self.mark(state.get("globals"), "globals", obj)
                self.mark(state.get("closure"), "closure", obj)
            else:
                self.mark(state, "state", obj)
                if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
                    for part in state:
                        if part is not None:
                            self.mark(part, "state", obj)
        if args is not None and func is not make_function and func is not set_globals:
            self.mark(args, "arguments", obj)
        return super().save_reduce(func, args, state, listitems, dictitems, state_setter, obj=obj)  # type: ignore[misc]


def explain(path: list[Any], roles: dict[int, tuple[str, Any]], top_labels: dict[int, str],
            error: BaseException) -> tuple[list[str], str]:
    """The steps from the top object down to the one that failed (``["train", "global 'cb'
    (Logger)", "attribute .fh"]``), and what that one is and why it failed (``an open file
    (TextIOWrapper '/tmp/log'): TypeError: ...``)."""
    steps: list[str] = []
    for parent, child in zip(path, path[1:]):
        step = _step(parent, child, roles, top_labels)
        if step:
            steps.append(step)
    if steps and steps[-1].endswith(")") and " (" in steps[-1] and not steps[-1].endswith("()"):
        steps[-1] = steps[-1][:steps[-1].rindex(" (")]  # its type is told next, with what it is
    if len(steps) > 12:
        steps = steps[:5] + [f"... {len(steps) - 10} more ..."] + steps[-5:]
    culprit = path[-1] if path else None
    return steps, f"{what_it_is(culprit)}: {type(error).__name__}: {_error_text(error)}"


def _step(parent: Any, child: Any, roles: dict[int, tuple[str, Any]], top_labels: dict[int, str]) -> str:
    label = top_labels.get(id(child))
    if label is not None:
        return label
    role = roles.get(id(parent), (None, None))[0]
    child_role, whose = roles.get(id(child), (None, None))
    if child_role == "globals" and isinstance(whose, types.FunctionType) and isinstance(parent, tuple):
        return f"{whose.__qualname__}()"  # a method's globals, set once its class was made
    if child_role in ("function state", "globals", "closure", "state", "arguments", "class attributes"):
        return ""  # a container the pickler made for its parent: the next step names the content
    if isinstance(parent, dict):
        key = next((k for k, v in parent.items() if v is child), None)
        if key is None:
            return f"key {_short(child)}" if child in parent else ""
        if role == "globals":
            return f"global {key!r} ({_type_name(child)})"
        if role == "closure":
            return f"closure variable {key!r} ({_type_name(child)})"
        if role in ("state", "class attributes"):
            return f"attribute .{key} ({_type_name(child)})" if isinstance(key, str) else f"[{key!r}]"
        if role == "function state":
            return {"defaults": "defaults", "kwdefaults": "keyword defaults", "dict": "attributes",
                    "annotations": "annotations"}.get(key, "")
        return f"[{key!r}] ({_type_name(child)})"
    if isinstance(parent, (list, tuple)):
        index = next((i for i, v in enumerate(parent) if v is child), None)
        if index is None:
            return ""
        if role == "arguments":
            return f"argument {index} of {_type_name(roles[id(parent)][1])}'s reconstruction"
        return f"[{index}] ({_type_name(child)})"
    if isinstance(parent, (set, frozenset)):
        return f"an element ({_type_name(child)})"
    if isinstance(child, types.FunctionType):
        return f"{child.__qualname__}()"
    return ""


def _type_name(obj: Any) -> str:
    return "class" if isinstance(obj, type) else type(obj).__qualname__


def _short(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{_type_name(obj)}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _error_text(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:
        text = "<unprintable>"
    return text if len(text) <= 300 else text[:297] + "..."


def what_it_is(obj: Any) -> str:
    """In words, with its type: ``an open file (TextIOWrapper '/tmp/log')``."""
    kind = _type_name(obj)
    if isinstance(obj, io.IOBase):
        name = getattr(obj, "name", None)
        return f"an open file ({kind}{f' {name!r}' if name is not None else ''})"
    if isinstance(obj, socket.socket):
        return f"a socket ({kind})"
    if isinstance(obj, types.GeneratorType):
        return f"a generator ({obj.__qualname__})"
    if isinstance(obj, (types.CoroutineType, types.AsyncGeneratorType)):
        return f"a coroutine ({kind})"
    if isinstance(obj, threading.Thread):
        return f"a thread ({obj.name})"
    if isinstance(obj, types.FrameType):
        return "a stack frame"
    module = type(obj).__module__
    if module == "sqlite3":
        return f"a database connection ({kind})"
    if isinstance(obj, types.FunctionType):
        return f"the function {obj.__qualname__}"
    return f"a {kind}" if module == "builtins" else f"a {module}.{kind}"


def unshippable(error: BaseException, what: str) -> PayloadError:
    """The PayloadError for ``error`` raised by dumps(): ``cannot send WHAT to the ranks: the
    path -> to it: what it is: why``. A path that starts at a labelled part (an argument, ctx,
    a need= global) names that part instead of ``what``."""
    where = getattr(error, "mpify_where", None)
    if where is None:
        return PayloadError(f"cannot send {what} to the ranks: {type(error).__name__}: {safe_str(error)}")
    steps, tail = where
    if steps and not steps[0].endswith("()"):
        what, steps = steps[0], steps[1:]  # an argument, ctx, a need= global
    path = " -> ".join(step.replace("()", "") if i == 0 else step for i, step in enumerate(steps))
    return PayloadError(f"cannot send {what} to the ranks: {path + ': ' if path else ''}{tail}")
