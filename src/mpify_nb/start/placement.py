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
import select
import signal
import socket
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from . import template

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


# -- the world a call reserves --------------------------------------------------------------

@dataclass
class Layout:
    """Where each rank of one call runs, and what torch needs to know of it."""

    nodes: dict[int, str]  # rank -> address of its node
    master_addr: str
    master_port: int
    interfaces: dict[int, str] = field(default_factory=dict)  # rank -> NIC holding its node's address

    @classmethod
    def on_this_machine(cls, nprocs: int) -> Layout:
        return cls({r: "127.0.0.1" for r in range(nprocs)}, "127.0.0.1", free_port("127.0.0.1"),
                   {r: "lo" for r in range(nprocs)})  # all on one machine: gloo/NCCL on loopback

    def order(self) -> list[str]:
        """The call's nodes, in order of their lowest rank: GROUP_RANK is the index here."""
        seen: list[str] = []
        for r in sorted(self.nodes):
            if self.nodes[r] not in seen:
                seen.append(self.nodes[r])
        return seen

    def rank_env(self, rank: int) -> dict[str, str]:
        """LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (torchrun's meaning: ranks grouped by node)."""
        node = self.nodes[rank]
        mates = sorted(r for r, n in self.nodes.items() if n == node)
        return {"LOCAL_RANK": str(mates.index(rank)), "LOCAL_WORLD_SIZE": str(len(mates)),
                "GROUP_RANK": str(self.order().index(node))}

    def world_env(self, nprocs: int) -> dict[str, str]:
        """What every rank's environment holds alike: WORLD_SIZE, MASTER_ADDR/PORT, and
        torchrun's ROLE_*, GROUP_WORLD_SIZE... unless the user set them."""
        from ..torchdist import libraries

        env = {"WORLD_SIZE": str(nprocs), "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        env.update(libraries.torchrun_env(nprocs, groups=len(self.order())))
        return env

    def env_of(self, rank: int) -> dict[str, str]:
        """Rank ``rank``'s own variables: RANK, LOCAL_RANK..., OMP_NUM_THREADS=1 when its host has
        other ranks, and gloo/NCCL on the NIC that holds its node's address (unless the user chose)."""
        from ..torchdist import libraries

        env = {"RANK": str(rank), **libraries.torchrun_rank_env(rank)}
        local = self.rank_env(rank)
        env.update({k: v for k, v in local.items() if k != "GROUP_RANK" or "GROUP_RANK" not in os.environ})
        env.update(libraries.torchrun_thread_env(int(local["LOCAL_WORLD_SIZE"])))
        interface = self.interfaces.get(rank)
        if interface:
            env.update({name: interface for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                        if name not in os.environ})
        return env


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now. Each call gets its own, so calls never collide."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class RankProcess(Protocol):
    pid: int
    death_fd: Optional[int]  # readable once the process has ended (a pidfd); None if unavailable
    death_latency: float  # seconds between its death and death_fd turning readable, at worst
    shares_clock: bool  # its time.monotonic() is ours (same host): its errors' timestamps compare

    def kill(self) -> None: ...
    def wait_gone(self, timeout: float) -> bool: ...
    def exit_code(self, timeout: float) -> Optional[int]: ...
    def death_detail(self) -> str: ...  # why it died, when its placer knows ("" otherwise)
    def kill_leftovers(self) -> None: ...  # once it is gone: what it started and left behind
    def close(self) -> None: ...


class Placer(Protocol):
    #: Ranks start with the caller's os.environ (plus the world's variables): true on this
    #: machine; on another host a rank keeps its own environment (PATH, CUDA_VISIBLE_DEVICES...).
    ships_environ: bool

    def reserve(self, nprocs: int, caller_rank: Optional[int], timeout: Optional[float]) -> Layout:
        """Reserve room for every rank (all or none) and say where each lands."""
        ...

    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        """Start ``rank``; raise TimeoutError if it cannot be started within ``timeout`` s."""
        ...

    def store_port(self) -> int:
        """A port for a new rendezvous store on the layout's master address (a Session that
        rebuilds its group needs a fresh one each time)."""
        ...

    def release(self) -> None:
        """The call is over: give back what ``reserve`` took."""
        ...


def get_placer() -> Placer:
    if _placement != "local":
        return _elsewhere[_placement].make_placer(_options)
    if _start_method not in START_METHODS:
        raise ValueError(f"MPIFY_NB_START_METHOD must be one of {START_METHODS}, not {_start_method!r}")
    return TemplatePlacer() if _start_method == "template" else SpawnPlacer()


class _OnThisMachine:
    ships_environ = True

    def reserve(self, nprocs: int, caller_rank: Optional[int], timeout: Optional[float]) -> Layout:
        return Layout.on_this_machine(nprocs)

    def store_port(self) -> int:
        return free_port("127.0.0.1")

    def release(self) -> None:
        pass


class _Pidfd:
    """Kill and watch a process by pidfd, immune to pid reuse."""

    death_latency = 0.0  # a pidfd is readable the moment the process is gone
    shares_clock = True

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.death_fd: Optional[int] = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self.death_fd = None  # already gone (ESRCH), or an old kernel

    def kill(self) -> None:
        try:
            if self.death_fd is not None:
                signal.pidfd_send_signal(self.death_fd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass

    def wait_gone(self, timeout: float) -> bool:
        """Wait until the process has ended; True if it has."""
        if self.death_fd is None:
            return True
        return bool(select.select([self.death_fd], [], [], timeout)[0])

    def close(self) -> None:
        if self.death_fd is not None:
            os.close(self.death_fd)
            self.death_fd = None

    def death_detail(self) -> str:
        return ""

    def kill_leftovers(self) -> None:
        # A rank leads its own process group; its id is not reused while a member lives.
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass


class _ForkedRank(_Pidfd):
    def __init__(self, client: template.TemplateClient, pid: int):
        super().__init__(pid)
        self._client = client
        self._code: Optional[int] = None
        #: the modules it was born holding (its template's): a call need not ask it to import them
        self.modules_held: Optional[frozenset[str]] = client.modules

    def exit_code(self, timeout: float) -> Optional[int]:
        if self._code is None:
            self._code = self._client.exit_code(self.pid, timeout)
        return self._code

    def death_detail(self) -> str:
        if self._client.alive():
            return ""
        return (f"the template process it was forked from (pid {self._client.pid}) died "
                f"({self._client.how_it_ended()}), and its ranks with it")


class TemplatePlacer(_OnThisMachine):
    def __init__(self) -> None:
        self._client = template.get_template()

    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        fds = [channel_fd, stdout_fd, stderr_fd]
        limit = _TEMPLATE_PATIENCE if timeout is None else timeout
        try:
            pid = self._fork(fds, limit)
        except template.TemplateUnresponsive as e:
            if timeout is None:
                raise
            raise TimeoutError(f"rank {rank} could not be started within the call's timeout: {e}") from None
        return _ForkedRank(self._client, pid)

    def _fork(self, fds: list[int], limit: float) -> int:
        died = False
        for _ in range(_RETIRED_TRIES):
            try:
                return self._client.fork(fds, limit)
            except template.TemplateUnresponsive:
                raise
            except template.TemplateRetired:
                pass  # replaced since this call began (a preloaded one is in): the current one forks it
            except template.TemplateDied:
                if died:
                    raise
                died = True  # died since we last used it (killed, OOM): one fresh template, then give up
            self._client = template.get_template()
        return self._client.fork(fds, limit)


#: Seconds a call without a timeout waits for the template to start (it imports torch) and fork.
_TEMPLATE_PATIENCE = 120.0
#: Templates a call asks for one rank when each retires (is replaced) under it.
_RETIRED_TRIES = 3


class _SpawnedRank(_Pidfd):
    def __init__(self, proc: subprocess.Popen):
        super().__init__(proc.pid)
        self._proc = proc

    def exit_code(self, timeout: float) -> Optional[int]:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class SpawnPlacer(_OnThisMachine):
    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        proc = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from mpify_nb.rank.loop import main; main(int(sys.argv[1]), int(sys.argv[2]))",
             str(channel_fd), str(os.getpid())],
            pass_fds=[channel_fd],
            stdin=subprocess.DEVNULL,
            stdout=stdout_fd,
            stderr=stderr_fd,
            env=template.bootstrap_env(),
            **template.own_process_group(),
        )
        return _SpawnedRank(proc)
