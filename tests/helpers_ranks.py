"""Functions the tests run *on ranks*, and the process identities they report.

Ranks import this module by name (the caller's ``sys.path`` travels with each
call), so it must stay cheap to import: no pytest, torch only inside functions.
Test modules import pytest (~0.3 s per rank per call), which is why rank code
lives here and not next to the tests.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from mpify_nb import TorchDDPCtx

#: A global that functions set on a rank, to show it does not survive into the next call.
LEAKY: Optional[str] = None


# -- who am I ------------------------------------------------------------------------------

def rank() -> int:
    return int(os.environ["RANK"])


def start_time(pid: int) -> Optional[int]:
    """The process's start time (clock ticks since boot), or None if there is no such process.
    With the pid it names a process for good: pids are reused, (pid, start) pairs are not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the name, in parentheses, may hold spaces
    return int(fields[19])


def identity() -> tuple[int, int]:
    """(pid, start time) of this process."""
    pid = os.getpid()
    start = start_time(pid)
    assert start is not None
    return pid, start


def record(directory: str) -> tuple[int, int]:
    """Write this rank's identity to ``directory/<rank>.json`` (atomically) and return it,
    so the test knows every rank's pid even when the rank never answers."""
    ident = identity()
    path = Path(directory) / f"{rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(list(ident)))
    os.replace(tmp, path)
    return ident


def wait_for_peers(directory: str, timeout: float = 30.0) -> None:
    """Wait until every rank of the call recorded itself: then the others are surely
    running user code (sleeping, in a collective) when this one fails."""
    deadline = time.monotonic() + timeout
    world = int(os.environ["WORLD_SIZE"])
    while len(list(Path(directory).glob("*.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.02)


# -- plain functions -----------------------------------------------------------------------

def rank_and_identity() -> tuple[int, tuple[int, int]]:
    return rank(), identity()


def echo(*args: Any, **kwargs: Any) -> tuple[int, tuple, dict]:
    return rank(), args, kwargs


WORLD_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def world_env() -> dict:
    return {name: os.environ.get(name) for name in WORLD_VARS}


def main_globals(*names: str) -> dict:
    """Which of ``names`` exist in this rank's ``__main__`` (their repr)."""
    main = vars(sys.modules["__main__"])
    return {n: repr(main[n]) for n in names if n in main}


def leave_traces(token: str) -> None:
    """Change what a careless launcher would carry into the next call."""
    global LEAKY
    LEAKY = token
    vars(sys.modules["__main__"])["LEAKY_MAIN"] = token
    os.environ["MPIFY_TEST_LEAKY"] = token
    sys.modules["json"].LEAKY_ATTR = token  # type: ignore[attr-defined]


def find_traces() -> dict:
    import json as json_module

    return {
        "module global": LEAKY,
        "__main__ global": vars(sys.modules["__main__"]).get("LEAKY_MAIN"),
        "environ": os.environ.get("MPIFY_TEST_LEAKY"),
        "module attribute": getattr(json_module, "LEAKY_ATTR", None),
    }


def wander(directory: str, fail: bool) -> str:
    """Change this process's cwd and environment (as user code may), then return or raise."""
    os.chdir(directory)
    os.environ["MPIFY_TEST_SET_BY_FN"] = str(rank())
    if fail:
        raise RuntimeError("wandered off and failed")
    return os.getcwd()


def probe_callers_world(module: str) -> tuple[Optional[str], str, str]:
    """What a rank sees of its caller: an env variable, the cwd, a module on the caller's sys.path."""
    mod = __import__(module)
    return os.environ.get("MPIFY_TEST_FROM_CALLER"), os.getcwd(), mod.hello()


def use_import_star() -> tuple[bool, str]:
    """import_star into the calling function's globals (here: this module's) and into a given namespace."""
    from mpify_nb import import_star

    import_star("json")
    in_main = "dumps" in globals() and "JSONDecoder" in globals()
    ns: dict = {}
    import_star(["json", "os.path"], ns)
    return in_main, ns["dumps"]({"joined": ns["join"]("a", "b")})


# -- failing functions ---------------------------------------------------------------------

def sleep_and_record(directory: str, seconds: float) -> tuple[int, int]:
    ident = record(directory)
    time.sleep(seconds)
    return ident


def raise_on(target: int, directory: str, seconds: float) -> int:
    """Rank ``target`` raises ValueError; every other rank sleeps ``seconds``."""
    record(directory)
    if rank() == target:
        wait_for_peers(directory)
        raise ValueError(f"boom from rank {target}")  # the source line the error must show
    time.sleep(seconds)
    return rank()


def exit_at_once_on(target: int, seconds: float) -> int:
    """Rank ``target`` exits with code 3 as soon as it starts; every other rank sleeps ``seconds``."""
    if rank() == target:
        os._exit(3)
    time.sleep(seconds)
    return rank()


def die_on(target: int, how: str, directory: str, seconds: float) -> int:
    """Rank ``target`` dies without answering (``how``: sigkill, segfault, exit3); the others sleep."""
    record(directory)
    if rank() == target:
        wait_for_peers(directory)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            ctypes.string_at(0)
        elif how == "exit3":
            os._exit(3)
        raise AssertionError(f"still alive after {how}")
    time.sleep(seconds)
    return rank()


def sleep_in_python(directory: str, seconds: float) -> int:
    """Every rank sleeps in short steps (a thread can be interrupted between them)."""
    record(directory)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
    return rank()


def sleep_on(target: int, directory: str, seconds: float) -> int:
    """Only rank ``target`` sleeps; the others return at once."""
    record(directory)
    if rank() == target:
        time.sleep(seconds)
    return rank()


def return_unpicklable_on(target: int) -> Any:
    if rank() == target:
        return (i for i in range(3))  # a generator cannot be pickled
    return rank()


# -- torch.distributed ---------------------------------------------------------------------

def all_reduce_rank_plus_one() -> float:
    """Sum of (rank + 1) over the group, by all_reduce."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def world_info() -> dict:
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend()}


def with_ddp_inside() -> tuple[bool, float, bool]:
    """Use ``with in_torchddp():`` in the rank itself; report the group state inside and after."""
    import torch.distributed as dist

    from mpify_nb import in_torchddp

    with in_torchddp():
        inside = dist.is_initialized()
        total = all_reduce_rank_plus_one()
    return inside, total, dist.is_initialized()


def ddp_raise_on(target: int, directory: str) -> float:
    """Rank ``target`` raises (a moment later); the others block in all_reduce waiting for it."""
    record(directory)
    if rank() == target:
        wait_for_peers(directory)
        time.sleep(0.3)  # the others are in all_reduce by now
        raise ValueError(f"rank {target} gives up")
    return all_reduce_rank_plus_one()


def ddp_sleep_on(target: int, directory: str, seconds: float) -> float:
    """Rank ``target`` sleeps; the others block in all_reduce waiting for it."""
    record(directory)
    if rank() == target:
        time.sleep(seconds)
    return all_reduce_rank_plus_one()


def ddp_train_step(seed: int) -> list:
    """One DDP step of a small linear model on this rank's own data; return the parameters."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)  # same seed on every rank: same start
    ddp = DDP(model)
    x, y = training_batch(seed, rank())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def training_batch(seed: int, r: int):
    import torch

    g = torch.Generator().manual_seed(seed * 100 + r)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def own_tcp_sockets() -> list[tuple[str, str, str]]:
    """This process's TCP sockets as (inode, local address, state) from /proc/net/tcp{,6}
    (state "0A": listening)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                parts = line.split()
                local, state, inode = parts[1], parts[3], parts[9]
                if inode in inodes:
                    found.append((inode, _decode_address(local), state))
    return found


def listening_sockets() -> list[str]:
    """After a barrier (so every rank's sockets are open): the local addresses of the TCP
    sockets this process listens on."""
    import torch.distributed as dist

    dist.barrier()
    found = listening_now()
    dist.barrier()  # nobody closes its sockets before everyone looked
    return found


def _decode_address(hex_address: str) -> str:
    """'0100007F:1F90' -> '127.0.0.1:8080' (and the same for IPv6), as the kernel writes them."""
    import ipaddress

    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{ipaddress.ip_address(raw)}:{int(port, 16)}"


# -- tensors -------------------------------------------------------------------------------

def mapping_of(address: int) -> Optional[str]:
    """The name of the memory mapping of this process that holds ``address`` ("" if anonymous)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return parts[5].strip() if len(parts) > 5 else ""
    return None


def tensor_plus_rank(t):
    """``t + rank``, and where ``t`` lives on this rank."""
    return t + rank(), mapping_of(t.data_ptr()), float(t.sum())


def describe_tensor(t) -> tuple:
    return type(t).__name__, t.requires_grad, tuple(t.shape), str(t.dtype), float(t.detach().sum())


def as_is(x: Any) -> Any:
    return x


def write_then_read(t, writer_ranks: tuple) -> tuple[float, float]:
    """Ranks in ``writer_ranks`` fill ``t`` in place with rank+1; after a barrier every rank
    reports the min and max it sees."""
    import torch.distributed as dist

    if rank() in writer_ranks:
        t.fill_(rank() + 1)
    dist.barrier()
    seen = float(t.min()), float(t.max())
    dist.barrier()  # nobody leaves (and unmaps) before everyone looked
    return seen


def nested_identity(tree: dict) -> tuple[bool, dict]:
    """Is the tensor that appears twice in ``tree`` still one object here? And the tree back."""
    return tree["list"][1] is tree["list"][2]["again"][0], tree


# -- payloads that fail only on a rank -----------------------------------------------------

class FailsToLoad:
    """An argument that unpickles fine everywhere except on rank ``target`` of a call made
    by process ``caller_pid``: there it raises (``how="raise"``) or kills its process (``"kill"``).
    Models a rank that dies before it can join the group."""

    def __init__(self, target: int, how: str):
        self.caller_pid = os.getpid()
        self.target = target
        self.how = how

    def __reduce__(self):
        return _load_or_fail, (self.caller_pid, self.target, self.how)


def _load_or_fail(caller_pid: int, target: int, how: str) -> FailsToLoad:
    if os.getpid() != caller_pid and os.environ.get("RANK") == str(target):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"this payload refuses to load on rank {target}")
    obj = FailsToLoad.__new__(FailsToLoad)
    obj.caller_pid, obj.target, obj.how = caller_pid, target, how
    return obj


def takes_payload(payload: Any, directory: str) -> int:
    record(directory)
    return rank()


class DiesBeforeJoining(TorchDDPCtx):
    """An ``in_torchddp()`` whose rank ``target`` kills itself instead of joining the group,
    while the other ranks, the caller included, are in the rendezvous."""

    def __init__(self, target: int = -1, **kwargs: Any):
        super().__init__(**kwargs)
        self.target = target

    def __getstate__(self) -> dict:
        return dict(super().__getstate__(), target=self.target)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.target = state["target"]

    def __enter__(self) -> TorchDDPCtx:
        if rank() == self.target:
            time.sleep(0.5)  # the others are in the rendezvous by now
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__enter__()


# -- processes a rank starts (for the cleanup tests) ---------------------------------------

#: DataLoaders a rank keeps in a global, so their workers outlive the function.
KEPT_LOADERS: list = []


def start_descendant(how: str) -> list[tuple[int, int]]:
    """Start a process the way ``how`` says, from this rank; return the identities of what
    now runs (the descendant that should be gone after the call)."""
    import subprocess

    if how == "popen":
        return [identity_of(subprocess.Popen(["sleep", "300"]).pid)]
    if how == "fork":
        pid = os.fork()
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        return [identity_of(pid)]
    if how == "mp_daemon":
        import multiprocessing

        proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,), daemon=True)
        proc.start()
        return [identity_of(proc.pid)]
    if how == "double_fork_new_session":
        # The shell exits at once: its sleep is an orphan in a session of its own.
        out = subprocess.run(["setsid", "sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True).stdout
        return [identity_of(int(out.split()[0]))]
    if how == "dataloader":
        import torch

        data = torch.utils.data.TensorDataset(torch.arange(16.0))
        loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
        iterator = iter(loader)
        next(iterator)
        KEPT_LOADERS.append((loader, iterator))
        return [identity_of(w.pid) for w in iterator._workers]
    raise ValueError(how)


def identity_of(pid: int) -> tuple[int, int]:
    start = start_time(pid)
    assert start is not None, f"process {pid} is already gone"
    return pid, start


def leave_descendants(directory: str, how: str, end: str, ranks: tuple = (1,)):
    """On ``ranks``: start descendants, write their identities to ``directory/desc-<rank>.json``,
    then end as ``end`` says: "return", "raise", or "hang" (until the call's timeout)."""
    if rank() not in ranks:
        return None
    idents = start_descendant(how)
    path = Path(directory) / f"desc-{rank()}.json"
    path.write_text(json.dumps(idents))
    if end == "raise":
        raise RuntimeError("failing on purpose, with descendants running")
    if end == "hang":
        time.sleep(300)
    return idents


def many_big_tensors(count: int) -> dict:
    """A state_dict-like mapping of ``count`` tensors of 1 MiB each (shared memory, one fd each)."""
    import torch

    return {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(count)}


def checksum_tensors(tensors: dict) -> float:
    return sum(float(t[0]) + float(t[-1]) for t in tensors.values())


class StrExplodes(Exception):
    """An exception whose message cannot be had: its __str__ raises."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ exploded")


def raise_str_exploding(ranks: tuple) -> int:
    if rank() in ranks:
        raise StrExplodes("the payload")
    return rank()


def fork_printers_while_rank_1_prints(seconds: float) -> int:
    """Rank 1 prints for ``seconds`` (the caller's relay thread writes all the while); rank 0
    (the caller) forks children meanwhile, each of which prints once and exits. Returns, on
    rank 0, how many children blocked in that print (killed after 3 s), 0 on rank 1."""
    if os.environ["RANK"] == "1":
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            print("rank 1 line", "x" * 40)
        return 0
    hung = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and not hung:
        pid = os.fork()
        if pid == 0:
            print("child", os.getpid(), flush=True)  # blocks for ever on a lock inherited held
            os._exit(0)
        deadline = time.monotonic() + 3
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                hung += 1
                break
            time.sleep(0.001)
    return hung


#: The caller's captured output, for partial_line_then_wait's rank 0 (set by the test, read in the caller).
watched: Optional[Any] = None


def watched_text() -> str:
    """What the caller captured so far (:data:`watched`). Passed to the ranks instead of the capture's own
    method: the capture is ``sys.stdout`` during the call, and whether a rank got a copy of it or its own
    ``sys.stdout`` depended on when this process first indexed the ``sys`` module's globals (wire/ship.py:
    an object a module holds travels by name), i.e. on the modules that ran before in this process."""
    assert watched is not None, "set helpers_ranks.watched first"
    return watched.getvalue()


def partial_line_then_wait(flag: str, seen_in) -> str:
    """Rank 1 prints a partial line and waits (up to 30 s) for ``flag`` to exist; rank 0
    watches ``seen_in()`` (the caller's captured output) for that line and creates ``flag``.
    Returns how rank 1's wait ended."""
    if rank() == 1:
        print("working...", end="", flush=True)
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(" done")
        return "seen" if os.path.exists(flag) else "not seen"
    deadline = time.monotonic() + 30
    while "[rank 1] working..." not in seen_in() and time.monotonic() < deadline:
        time.sleep(0.01)
    if "[rank 1] working..." in seen_in():
        Path(flag).touch()
    return "watched"


def describe_arrays(arrays: dict) -> dict:
    """What each numpy array is on this rank: type, dtype, shape, order, writable, sum, backed by a memfd."""
    import numpy as np

    out = {}
    for name, a in arrays.items():
        base = a
        while getattr(base, "base", None) is not None:
            base = base.base
        out[name] = (type(a).__name__, a.dtype.str, a.shape, bool(a.flags.f_contiguous), bool(a.flags.writeable),
                     float(np.asarray(a, dtype=np.float64).sum()), type(base).__name__)
    return out


def big_arrays(n: int) -> dict:
    import numpy as np

    c = np.arange(n, dtype=np.float32).reshape(-1, 64)
    return {"c": c, "f": np.asfortranarray(c), "strided": c[::2], "ints": np.arange(n, dtype=np.int64)}


def aliasing(base, view) -> tuple:
    """Do ``base`` and ``view`` still share memory here? (Write through the view, read the base.)"""
    view.view(-1)[0] = -7.0
    return bool(base.reshape(-1)[view.storage_offset()] == -7.0), view.untyped_storage().data_ptr() == \
        base.untyped_storage().data_ptr()


def listening_now() -> list[str]:
    """The local addresses of the TCP sockets this process listens on now (no barrier)."""
    return [address for _, address, state in own_tcp_sockets() if state == "0A"]


def master_port() -> int:
    return int(os.environ["MASTER_PORT"])


def tqdm_bar(n: int, pause: float) -> int:
    """A plain tqdm bar over ``n`` steps of ``pause`` seconds, redrawn at every step."""
    from tqdm import tqdm

    done = 0
    for _ in tqdm(range(n), desc="bar", mininterval=0):
        time.sleep(pause)
        done += 1
    return done


def modules_then_import(names: list) -> dict:
    """Which of ``names`` this rank already held when ``fn`` began; then import them all."""
    import importlib

    held = {name: name in sys.modules for name in names}
    for name in names:
        importlib.import_module(name)
    return held


def held_code_of(name: str) -> tuple:
    """The module ``name``'s ``VALUE``, and whether this rank runs the code its template compiled for
    it (rank/code_cache.py): its function ``f``'s code is a constant of that very code object."""
    import importlib

    from mpify_nb.rank import code_cache

    module = importlib.import_module(name)
    held = code_cache._held.get((module.__file__, -1))
    return module.VALUE, held is not None and any(c is module.f.__code__ for c in held[1].co_consts)


def long_line_then_sleep(size: int, seconds: float) -> int:
    """Rank 1 writes ``size`` characters of JSON with no newline (``json.dump`` to stdout), then
    every rank sleeps ``seconds``."""
    if rank() == 1:
        json.dump("x" * (size - 2), sys.stdout)
        sys.stdout.flush()
    time.sleep(seconds)
    return rank()


def time_arrays(rows: int) -> dict:
    """Arrays of datetime64 and timedelta64 (numpy gives no buffer of them), a record array with a
    datetime field, and a Fortran-ordered one: each of ``rows`` rows, over 1 MiB when rows >= 2**17."""
    import numpy as np

    stamps = np.datetime64("2026-01-01T00:00:00", "ns") + np.arange(rows) * np.timedelta64(1, "h")
    records = np.zeros(rows, dtype=[("when", "M8[s]"), ("value", "f4")])
    records["when"] = stamps.astype("M8[s]")
    records["value"] = np.arange(rows)
    return {"stamps": stamps, "gaps": np.diff(stamps), "records": records,
            "grid": np.asfortranarray(stamps.reshape(-1, 4))}


def describe_time_arrays(arrays: dict) -> dict:
    """Each array's dtype, shape, Fortran order, and first and last values as text, on this rank."""
    return {name: (a.dtype.str, a.shape, bool(a.flags.f_contiguous and not a.flags.c_contiguous),
                   str(a.flat[0]), str(a.flat[-1])) for name, a in arrays.items()}


# -- the caller's rank stopped while it imports (test_stopping.py) ---------------------------

def until_the_stop_is_under_way() -> None:
    """Wait (in Python, where a stop can land) until the caller's rank is being stopped (a thread
    "mpify_nb-stop" runs), and a little more."""
    import threading

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(t.name == "mpify_nb-stop" for t in threading.enumerate()):
        time.sleep(0.01)
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        time.sleep(0.01)


#: A package whose import, when ``SLOW_PACKAGE_WAIT`` names a directory, lasts until the caller's
#: rank is being stopped: a stop raised into its top level would drop it from sys.modules and
#: keep ``.first``, the submodule it had finished.
SLOW_PACKAGE_INIT = '''\
import os
from . import first
_wait = os.environ.get("SLOW_PACKAGE_WAIT")
if _wait:
    import helpers_ranks
    open(os.path.join(_wait, "importing"), "w").close()
    helpers_ranks.until_the_stop_is_under_way()
from . import second
done = True
'''


def write_slow_package(directory: str, name: str) -> None:
    """``directory/name``: the package above, with submodules ``first`` and ``second``."""
    package = Path(directory) / name
    package.mkdir()
    (package / "__init__.py").write_text(SLOW_PACKAGE_INIT)
    (package / "first.py").write_text("VALUE = 'first'\n")
    (package / "second.py").write_text("VALUE = 'second'\n")


def wait_for_file(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def import_slowly_while_rank_1_fails(name: str, directory: str) -> str:
    """Rank 0 imports the slow package (then loops in Python, where it can be stopped); rank 1
    raises once rank 0 is inside that import."""
    if rank() == 1:
        wait_for_file(os.path.join(directory, "importing"))
        raise ValueError("rank 1 fails while rank 0 imports")
    os.environ["SLOW_PACKAGE_WAIT"] = directory
    __import__(name)  # what an import statement does
    end = time.monotonic() + 120
    while time.monotonic() < end:
        time.sleep(0.01)
    return "not stopped"


def import_slowly_then_sleep(name: str, directory: str) -> str:
    """Rank 0 imports the slow package (the stop button comes meanwhile); the others sleep."""
    if rank() != 0:
        time.sleep(120)
        return "slept"
    os.environ["SLOW_PACKAGE_WAIT"] = directory
    __import__(name)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        time.sleep(0.01)
    return "not stopped"


def slow_package_values(name: str) -> tuple:
    """Import the package as any later call would (no waiting), and read both submodules
    through it, as attributes."""
    import importlib

    package = importlib.import_module(name)
    return package.first.VALUE, package.second.VALUE, package.done


def interrupt_caller_then_return(caller_pid: int, directory: str) -> str:
    """Rank 1 sends SIGINT to the caller, then returns; rank 0 (the caller) waits until it did."""
    sent = os.path.join(directory, "sent")
    if rank() == 1:
        os.kill(caller_pid, signal.SIGINT)
        time.sleep(0.5)  # the signal is handled (or ignored) before rank 0 hears
        open(sent, "w").close()
        return "sent"
    wait_for_file(sent)
    time.sleep(0.2)
    return "finished"


def parent_pid() -> int:
    """The process this rank was forked from (its template)."""
    return os.getppid()


def stopped_in_a_finalizer(directory: str, kind: str) -> str:
    """Rank 0 runs a finalizer (``kind``: a ``__del__``, or a weakref callback) that lasts until its
    stop is under way; rank 1 raises meanwhile. Rank 0 writes ``finalized`` when the finalizer ran
    to its end, and ``not_stopped`` if nothing stopped it within 20 s after."""
    import weakref

    if rank() == 1:
        wait_for_file(os.path.join(directory, "finalizing"))
        raise ValueError("rank 1 fails while rank 0 finalizes")

    def finalize(*_args: Any) -> None:
        open(os.path.join(directory, "finalizing"), "w").close()
        until_the_stop_is_under_way()
        open(os.path.join(directory, "finalized"), "w").close()

    class Finalized:
        def __del__(self) -> None:
            finalize()

    thing: Any = Finalized() if kind == "__del__" else type("Plain", (), {})()
    keep = weakref.ref(thing, finalize) if kind == "weakref callback" else None
    del thing  # the finalizer runs here, called by the interpreter (a callback: from C)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        time.sleep(0.01)
    open(os.path.join(directory, "not_stopped"), "w").close()
    return str(keep)


def replace_sigint_handler_then_loop(directory: str) -> str:
    """Rank 0 (the caller) puts its own SIGINT handler in place, as accelerate's notebook_launcher
    does, then loops in Python; rank 1 raises after that. ``not_stopped``: nothing stopped rank 0."""
    if rank() == 1:
        wait_for_file(os.path.join(directory, "replaced"))
        raise ValueError("rank 1 fails after rank 0 replaced its SIGINT handler")
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    open(os.path.join(directory, "replaced"), "w").close()
    end = time.monotonic() + 20
    while time.monotonic() < end:
        time.sleep(0.01)
    open(os.path.join(directory, "not_stopped"), "w").close()
    return "not stopped"


# -- background work (test_background.py) ----------------------------------------------------------

def steps(n: int, pause: float = 0.05, fail_on: Optional[int] = None) -> dict:
    """``n`` steps, each printed; rank ``fail_on`` raises after them. Returns the rank, its pid and
    the thread that ran it (the caller's rank of ``ranch(..., wait=False)`` runs on a thread of its own)."""
    import threading

    for i in range(n):
        print(f"step {i} of rank {rank()}", flush=True)
        time.sleep(pause)
    if rank() == fail_on:
        raise ValueError(f"rank {rank()} fails after {n} steps")
    return {"rank": rank(), "pid": os.getpid(), "thread": threading.current_thread().name}


def steps_until_file(path: str, pid_dir: Optional[str] = None) -> int:
    """Step until ``path`` exists (at most 60 s); returns how many steps were made. ``pid_dir``: write
    this rank's pid there first (file ``pid<rank>``), for a test that kills it."""
    if pid_dir is not None:
        with open(os.path.join(pid_dir, f"pid{rank()}.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(pid_dir, f"pid{rank()}.tmp"), os.path.join(pid_dir, f"pid{rank()}"))
    end = time.monotonic() + 60
    n = 0
    while not os.path.exists(path) and time.monotonic() < end:
        n += 1
        time.sleep(0.02)
    return n


def import_then_report(names: list) -> list:
    """Import ``names``; return every module this rank imported since it was born (its template's
    were there already), sorted."""
    import importlib

    from mpify_nb.rank import imports_news

    for name in names:
        importlib.import_module(name)
    return sorted(name for name in sys.modules if name not in imports_news._born_with)
