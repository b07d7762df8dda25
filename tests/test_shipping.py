"""How a call travels (issue 27): by value what the notebook defined, by reference what an
importable module holds, never through a library's globals; what the notebook imported is
imported on every rank before the call is loaded, whatever the template holds; and what
cannot travel is named by the path to it.

A "notebook" here is code run with exec in a namespace named ``__main__`` (a cell's globals);
"libraries" are modules written to a temporary directory on sys.path.
"""

from __future__ import annotations

import pickle
import socket
import sys
import textwrap
import uuid

import pytest

import mpify_nb
from helpers_ranch import no_rank_started
from mpify_nb import PayloadError
from mpify_nb.wire import modules, payload


@pytest.fixture(autouse=True)
def rank_imports(rank_imports_from_here):
    """On, as by default (conftest turns it off in the pytest process for the rest of the suite)."""


def notebook(source: str) -> dict:
    """Run ``source`` as a notebook cell would (globals named __main__); return its namespace."""
    namespace = {"__name__": "__main__"}
    exec(textwrap.dedent(source), namespace)
    return namespace


@pytest.fixture
def library(tmp_path, monkeypatch):
    """``library(source) -> module name``: an importable module (on sys.path, as an installed
    library is), imported here, gone after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(source: str) -> str:
        name = f"lib_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        __import__(name)
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)
    modules._cache.clear()


# -- by reference, by value ---------------------------------------------------------------------

def test_a_library_function_whose_helpers_call_each_other_travels_by_name(library):
    """fastai's ``accuracy`` -> flatten_check -> test_eq -> equals <-> all_equal: dill's walk through
    the library's globals never ended (RecursionError). A library function is one reference."""
    name = library("""
        def equals(a, b):
            return all_equal(a, b) if isinstance(a, list) else a == b
        def all_equal(a, b):
            return len(a) == len(b) and all(equals(x, y) for x, y in zip(a, b))
        def accuracy(pred, targ):
            return sum(equals(p, t) for p, t in zip(pred, targ)) / len(targ)
        """)
    nb = notebook(f"""
        from {name} import accuracy
        def train():
            return accuracy([[1], 2, 3], [[1], 2, 4])
        """)
    data, fds = payload.dumps(nb["train"])
    assert not fds and name.encode() in data and b"all_equal" not in data  # a name, not the code
    assert mpify_nb.ranch(2, nb["train"], caller_rank=None) == [2 / 3, 2 / 3]


def test_a_closure_made_in_a_library_keeps_its_module_globals(library):
    """Not reachable by name, so by value: but its globals are its module's, imported on the rank."""
    name = library("""
        import os
        OFFSET = 100
        def make(k):
            return lambda x: x + k + OFFSET + int(os.environ["RANK"])
        """)
    nb = notebook(f"""
        import {name}
        add = {name}.make(3)
        def run():
            return add(1), add.__globals__ is __import__("sys").modules[{name!r}].__dict__
        """)
    assert mpify_nb.ranch(2, nb["run"], caller_rank=None) == [(104, True), (105, True)]


def test_notebook_functions_share_their_globals_on_the_rank():
    nb = notebook("""
        COUNT = 0
        def bump():
            global COUNT
            COUNT += 1
        def run():
            bump(); bump()
            return COUNT, bump.__globals__ is run.__globals__
        """)
    assert mpify_nb.ranch(2, nb["run"], caller_rank=None) == [(2, True), (2, True)]


def test_notebook_classes_that_refer_to_themselves_travel_by_value():
    """super()'s __class__ cell, a method naming its class, a class attribute holding instances of
    the class (made after use, like fasttransform's dispatch tables), an enum with methods."""
    nb = notebook("""
        import enum
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(2, 1)
            def twin(self):
                return Net()
        class Node:
            registry = []
            def __init__(self, v):
                self.v = v
                Node.registry.append(self)
        Node(1), Node(2)
        Node.first = Node.registry[0]
        class Mode(str, enum.Enum):
            FAST = "fast"
            SLOW = "slow"
            QUICK = "fast"
            def louder(self):
                return self.value.upper()
        def run():
            return (type(Net().twin()).__name__, [n.v for n in Node.registry], Node.first is Node.registry[0],
                    Mode.QUICK is Mode.FAST, Mode("slow").louder(), isinstance(Mode.FAST, str))
        """)
    expected = ("Net", [1, 2], True, True, "SLOW", True)
    assert nb["run"]() == expected
    assert mpify_nb.ranch(2, nb["run"], caller_rank=None) == [expected, expected]


# -- what cannot travel: the path to it -------------------------------------------------------------

def test_the_error_names_the_path_to_what_cannot_travel():
    conn = socket.socket()
    try:
        nb = notebook("""
            class Logger:
                def __init__(self, conn):
                    self.conn = conn
            def train():
                return cb.conn
            """)
        nb["cb"] = nb["Logger"](conn)
        with no_rank_started(), pytest.raises(PayloadError) as info:
            mpify_nb.ranch(2, nb["train"])
        assert str(info.value) == (
            "cannot send train() to the ranks: train -> global 'cb' (Logger) -> attribute .conn: "
            "a socket (socket): TypeError: cannot pickle 'socket' object")
        nb["helper"] = lambda: {"sockets": [conn]}
        nb2 = notebook("def outer():\n    return helper()\n")
        nb2["helper"] = nb["helper"]
        with pytest.raises(PayloadError, match=r"outer -> global 'helper' \(function\) -> "
                                               r"closure variable 'conn': a socket"):
            mpify_nb.ranch(2, nb2["outer"])
    finally:
        conn.close()


def test_the_error_names_the_method_of_a_notebook_class():
    conn = socket.socket()
    try:
        nb = notebook("""
            class Callback:
                def __init__(self):
                    self.log = [link]
            def train():
                return Callback()
            """)
        nb["link"] = conn
        with pytest.raises(PayloadError) as info:
            mpify_nb.ranch(2, nb["train"])
        assert ("train -> global 'Callback' (class) -> Callback.__init__() -> global 'link': a socket"
                in str(info.value)), str(info.value)
    finally:
        conn.close()


# -- what the notebook imported is imported on every rank first ------------------------------------

@pytest.fixture
def patched(library):
    """A class, and a module that adds a method to it when imported (fastai's @patch, fastcore's
    Path.ls); the notebook imported both; the shipped function names only the class."""
    base = library("""
        class Thing:
            pass
        """)
    patch = library(f"""
        import {base}
        print("patching at import")
        {base}.Thing.extra = lambda self: 42
        """)
    nb = notebook(f"""
        from {base} import Thing
        def use():
            return Thing().extra()
        """)
    return base, patch, nb["use"]


def test_a_class_patched_by_an_import_has_the_patch_on_every_rank(patched, capfd):
    base, patch, use = patched
    assert mpify_nb.ranch(2, use, caller_rank=None) == [42, 42]
    assert mpify_nb.ranch(2, use) == [42, 42]  # the notebook as rank 0 too
    assert "patching at import" not in capfd.readouterr().out  # the notebook showed it when it imported it


def test_the_list_is_the_notebooks_modules_less_the_standard_library_and_the_kernel(patched):
    base, patch, _ = patched
    names = modules.for_call()
    assert names.index(base) < names.index(patch)  # in import order
    assert "json" not in names and "pytest" not in names and "mpify_nb" not in names
    assert not any(n == "IPython" or n.startswith("IPython.") for n in names)
    held = frozenset(names) - {patch}
    assert pickle.loads(modules.preamble(names, held)) == (patch,)  # what the rank's template lacks only


def test_the_debuggers_top_level_modules_are_the_kernels(monkeypatch):
    """debugpy puts its copy of pydevd on sys.path: once the frontend's debugger ran, the notebook
    holds some twenty top-level modules of it (pydevd_file_utils, pydev_ipython, pydevconsole...),
    which are the kernel's, never a call's. Each one debugpy ships, as the import system would
    hold it (not run here: it patches the process)."""
    import importlib.util
    from pathlib import Path

    debugpy = pytest.importorskip("debugpy")
    root = Path(debugpy.__file__).parent / "_vendored" / "pydevd"
    files = {p.stem: p for p in root.glob("*.py")} | {p.parent.name: p for p in root.glob("*/__init__.py")}
    files.pop("setup_pydevd_cython")  # its build script, never imported
    assert {"pydevd_file_utils", "pydev_ipython", "pydevconsole", "pydevd_tracing", "_pydev_runfiles"} <= set(files)
    for name, file in files.items():
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, file)
            assert spec is not None
            monkeypatch.setitem(sys.modules, name, importlib.util.module_from_spec(spec))
    assert sorted(set(files) & set(modules.for_call())) == []


def test_leave_out_and_off(patched):
    base, patch, use = patched
    try:
        mpify_nb.set_rank_imports(leave_out=[patch])
        with pytest.raises(mpify_nb.RankError, match="extra"):
            mpify_nb.ranch(2, use, caller_rank=None)
        modules._leave_out.discard(patch)
        mpify_nb.set_rank_imports(False)
        with pytest.raises(mpify_nb.RankError, match="extra"):
            mpify_nb.ranch(2, use, caller_rank=None)
    finally:
        modules._leave_out.discard(patch)
        mpify_nb.set_rank_imports(True)
    assert mpify_nb.ranch(2, use, caller_rank=None) == [42, 42]


def test_a_session_rank_gets_the_notebooks_modules_before_apply_and_push(patched):
    base, patch, use = patched
    with mpify_nb.Session(2, ddp=False) as s:
        assert s.apply(use) == {0: 42, 1: 42}
        s.push(thing=sys.modules[base].Thing())
        s.run("value = thing.extra()")
        assert s.pull("value", rank=None) == [42, 42]


def test_an_object_a_library_module_holds_travels_by_name(library):
    """An instance that is a global of an importable module (plum's ``dispatch``, fastai's ``defaults``)
    is the rank's own, as its module made it, not a copy of the notebook's."""
    name = library("""
        import os
        class Registry:
            def __init__(self):
                self.pid = os.getpid()
        REGISTRY = Registry()
        """)
    nb = notebook(f"""
        import os
        from {name} import REGISTRY
        def whose():
            return REGISTRY.pid == os.getpid(), REGISTRY is __import__({name!r}).REGISTRY
        """)
    data, fds = payload.dumps(nb["whose"])
    assert b"Registry" not in data  # a name, not its class and state
    assert mpify_nb.ranch(2, nb["whose"], caller_rank=None) == [(True, True), (True, True)]
    # Back from a rank, it is that rank's value (its pid), not the notebook's object of that name.
    nb2 = notebook(f"from {name} import REGISTRY\ndef give():\n    return REGISTRY\n")
    pids = [r.pid for r in mpify_nb.ranch(2, nb2["give"], caller_rank=None)]
    assert len(set(pids)) == 2 and sys.modules[name].REGISTRY.pid not in pids
