"""A call's rendezvous: one store per call, in a process we can stop, every rank (the notebook's too) its client.

A script brought from torchrun or ``mp.spawn`` makes its own group (``init_process_group("gloo")``, env://
or tcp://, often with a ``MASTER_PORT`` of its own). Left to torch, rank 0 hosts the TCPStore: under
``ranch`` that is the notebook, which then waits inside ``init_process_group`` in C++ (signals do not
reach it; gloo's wait is 30 minutes) for a peer that failed, and keeps the store listening after the
call. torchrun's answer is the model: its agent hosts the store, and ``TORCHELASTIC_USE_AGENT_STORE``
makes every rank, rank 0 too, a client. Here::

    notebook (launcher/call.py)        host rank (MPIFY_NB_STORE_RANK)     every rank, the caller's own too
    ---------------------------        -------------------------------     --------------------------------
    bind(127.0.0.1:0), not listening ─ fd with the setup ─> kept            init_process_group(...)
    MPIFY_NB_RENDEZVOUS, MASTER_* ──── env ─────────────────────────────>     env:// or tcp://, any MASTER_PORT
                                       its first rendezvous: listen(),      -> handler(): a client of the call's
                                       TCPStore server on it, kept until       store, keys under mpify_nb/<scope>/<n>
                                       the caller ends the call                (n: this process's n-th rendezvous)
    a rank fails, timeout=, the stop button: the ranks are killed, the host with them: a client blocked
    in the store raises at once; one still waiting for the store to open waits in Python (stoppable).
    the call ends: the host is killed; nothing listens.

* No port race: the port is the notebook's from the moment it is chosen (bound without
  ``SO_REUSEADDR``: no one else can bind it) until the host listens on that very socket. On a Ray
  node, another host, the host binds it itself as it loads the call (:func:`activate`) and says
  which (STORE, before its READY); the notebook tells every rank with GO (:func:`learn_port`).
* A call that never makes a group listens on nothing: the store opens at the first rendezvous.
* A fixed ``MASTER_PORT`` works run after run: nothing binds it; the rendezvous goes to the call's store.
* ``n`` keeps a second group of the same call (init, destroy, init) off the first one's keys.
* A world of one (the notebook alone): a ``HashStore``, nothing listens at all.
* A Session's rank (:func:`point_at`): the Session's store, hosted by its lowest rank (opened with
  the Session's group, or without one at a cell's first rendezvous), keys under
  ``mpify_nb/<cell>/<n>``; an abort frees a rank waiting in it by cutting its connections
  (rank/group.py), its own client of a store it hosts included (:func:`store_endpoint`).

Handlers are installed (:func:`install`) in every process that plays a rank, and act only while
:func:`activate` says this process plays one and ``MPIFY_NB_RENDEZVOUS`` is set; anything else
(another process forked from a rank, a ``file://`` init) goes to torch's own handlers. It imports
nothing of mpify_nb but compat and groups; torch only when torch.distributed is already imported.
"""

from __future__ import annotations

import datetime
import importlib.abc
import importlib.machinery
import os
import socket
import sys
import threading
import time
from collections.abc import MutableMapping
from typing import Any, Callable, Optional
from urllib.parse import parse_qsl, urlparse

from . import compat, groups

#: Where a call's rendezvous goes: "ADDR|PORT|WORLD|TOKEN" (WORLD 1: in-process, no address).
VARIABLE = "MPIFY_NB_RENDEZVOUS"
#: The rank that hosts the call's store, its server opened at its own first rendezvous.
HOST_VARIABLE = "MPIFY_NB_STORE_RANK"
#: How often a rank looks whether the host has opened the store yet (it opens at its first rendezvous).
_PROBE_EVERY = 0.002
#: How long one connect to an open store may retry in C++ before we look again, in Python: short
#: at first (a host that died with the store's socket open is seen within a try; a 2 s try made a
#: failing rank's call end 2-3 s after its death), then longer (a slow host, under load).
_CONNECT_TRIES = (0.25, 0.5, 1.0, 2.0)
_SCHEMES = ("env", "tcp")

_lock = threading.Lock()
_originals: dict[str, Callable] = {}
_active_pid: Optional[int] = None  # the process that plays a rank now (a fork of it does not)
_scope: Callable[[], str] = lambda: ""
_counts: dict[str, int] = {}  # (call, scope) -> rendezvous made so far
_is_host = False  # this process hosts its call's store
_host_socket: Optional[socket.socket] = None  # the host's bound socket, until it listens on it
_hosted: Any = None  # the host's store server: kept until the process ends
_open: set[tuple[str, int]] = set()  # stores this process has seen open
_aborted = threading.Event()  # a rendezvous waiting for its store to open is to give up


def spec(address: str, port: int, world: int, token: str) -> str:
    """The value of :data:`VARIABLE` for a call's store at ``address:port``. ``port`` 0: in-process
    (a world of one); with more ranks, not known yet: the host binds one on its Ray node
    (:func:`activate`) and the caller tells the others (:func:`learn_port`)."""
    return f"{address}|{port}|{world}|{token}"


def learn_port(env: MutableMapping[str, str], port: int) -> None:
    """``env`` (a rank's ``os.environ``, the variables of the caller's own rank) names the
    store at ``port``: the one its host bound on its Ray node."""
    address, _unknown, world, token = env[VARIABLE].rsplit("|", 3)
    env[VARIABLE] = spec(address, port, int(world), token)
    env["MASTER_PORT"] = str(port)


def reserve(address: str) -> socket.socket:
    """A socket bound to a free port of ``address`` and not listening: the port is this process's,
    and no one else's (no ``SO_REUSEADDR``: another socket cannot share it), until a host listens."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def bind_session_store(address: str, world: int, ddp: bool) -> socket.socket:
    """The socket of a Session's store on ``address``, on a free port: listening with ``ddp`` (the
    group meets there at once); without, bound only (it listens at a cell's first rendezvous)."""
    return groups.listen_on(address, 0, world * 2) if ddp else reserve(address)


# -- in a process that plays a rank ------------------------------------------------------------

def activate(scope: Optional[Callable[[], str]] = None, host: bool = False,
             host_socket: Optional[socket.socket] = None) -> Optional[int]:
    """This process plays a rank now: its rendezvous go to the call's store (``VARIABLE``).
    ``scope()`` names the unit whose rendezvous are counted together (a Session's request; a
    ranch call is one unit); ``host``: this rank hosts the store, on ``host_socket`` (bound by
    the caller) or, without one (on a Ray node: the caller is on another host), on a port it
    binds now. Returns that port, for the caller to tell the other ranks; else None."""
    global _active_pid, _scope, _host_socket, _is_host
    install()
    groups.keep_groups()
    _active_pid = os.getpid()
    _scope = scope or (lambda: "")
    _is_host = host
    bound = None
    if host and host_socket is None:
        address, port, world, _token = os.environ[VARIABLE].rsplit("|", 3)
        if int(port) == 0 and int(world) > 1:
            host_socket = reserve(address)
            bound = host_socket.getsockname()[1]
            learn_port(os.environ, bound)
    if host_socket is not None:
        _host_socket = host_socket
    return bound


def point_at(value: str, host: bool, host_socket: Optional[socket.socket] = None, store: Any = None) -> None:
    """(A Session's rank) the rendezvous of the cells from now on go to ``value``'s store: the
    Session's, hosted by its lowest rank (``host``), opened with the Session's group (``store``,
    its server) or, without one, at the first rendezvous on ``host_socket``."""
    global _is_host, _host_socket, _hosted
    os.environ[VARIABLE] = value
    _is_host = host
    _host_socket = host_socket
    _hosted = store if host else None
    _open.clear()


def store_endpoint() -> Optional[tuple[str, int]]:
    """(address, port) of the store this process's rendezvous go to now; None without one."""
    value = os.environ.get(VARIABLE)
    if not value or _active_pid != os.getpid():
        return None
    address, port, _world, _token = value.rsplit("|", 3)
    return (address, int(port)) if int(port) else None


def abort() -> None:
    """(A Session's rank, on its control thread) a rendezvous waiting for the store to open gives up now."""
    _aborted.set()


def deactivate() -> None:
    """The call this process played a rank of is over (the notebook, after its own rank ran)."""
    global _active_pid
    _active_pid = None
    _counts.clear()
    _open.clear()


def hosting() -> bool:
    """Does this process serve a call's store, or hold its port for it (its ranks may still need
    it; a port let go of could be taken by anyone)?"""
    return _hosted is not None or _host_socket is not None


def install() -> None:
    """Put our handlers in front of torch's env:// and tcp:// ones (idempotent). Before torch is
    imported, do it once it is (the notebook's function may import it during the call)."""
    module = sys.modules.get("torch.distributed.rendezvous")
    if module is None:
        _install_when_imported()
        return
    _install_into(module)


def _install_into(module: Any) -> None:
    with _lock:
        handlers = module._rendezvous_handlers  # private: there is no public way to replace one
        for scheme in _SCHEMES:
            current = handlers.get(scheme)
            if current is None or getattr(current, "_mpify_nb", False):
                continue
            _originals[scheme] = current
            handlers[scheme] = _handler(scheme, current)


def _handler(scheme: str, original: Callable) -> Callable:
    def handler(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs: Any):
        value = os.environ.get(VARIABLE)
        if not value or _active_pid != os.getpid():
            yield from original(url, timeout=timeout, **kwargs)
            return
        query = dict(parse_qsl(urlparse(url).query))
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
        world = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
        yield (_store(value, rank, world, timeout), rank, world)
        raise RuntimeError(f"Unable to perform re-rendezvous using {scheme}:// method")

    handler._mpify_nb = True  # type: ignore[attr-defined]
    return handler


def _store(value: str, rank: int, world: int, timeout: datetime.timedelta) -> Any:
    """A client of the call's store for one rendezvous, its keys apart from every other one's."""
    from torch.distributed import HashStore, PrefixStore  # pyright: ignore[reportPrivateImportUsage]

    groups.keep_groups()  # torch imported since activate(): from now on (init_process_group calls it next)
    address, port_text, world_text, _token = value.rsplit("|", 3)
    port, call_world = int(port_text), int(world_text)
    _check(rank, world, call_world)
    _aborted.clear()
    unit = _scope()  # a Session's cell; a ranch call is one (its store is its own)
    scope = f"{value}/{unit}"
    if scope not in _counts:
        _counts.clear()  # an earlier call's or cell's: never used again
    n = _counts.get(scope, 0)
    _counts[scope] = n + 1
    if port == 0:
        return HashStore()  # the caller alone: a world of one, nothing to meet
    seconds = timeout.total_seconds()
    if _is_host:
        store = _host(address, port, call_world, timeout)
    else:
        _wait_open(address, port, seconds)
        store = _client(address, port, world, timeout)
    return PrefixStore(f"mpify_nb/{unit}/{n}" if unit else f"mpify_nb/{n}", store)


def _check(rank: int, world: int, call_world: int) -> None:
    if world > call_world or world < 1:
        raise ValueError(
            f"init_process_group(world_size={world}) in a call of {call_world} ranks: the group would wait for "
            f"ranks that do not exist; leave world_size out (WORLD_SIZE is {call_world}) or start "
            f"{world} ranks")
    if not 0 <= rank < world:
        raise ValueError(f"init_process_group(rank={rank}, world_size={world}): rank must be in [0, {world}); "
                         "leave rank out (RANK is this rank's)")


def _host(address: str, port: int, world: int, timeout: datetime.timedelta) -> Any:
    """Open the call's store here (at this host's first rendezvous), on the socket bound for it
    (by the caller, or on a Ray node by :func:`activate`). Kept until the process ends."""
    global _hosted, _host_socket
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    if _hosted is None:
        sock = _host_socket
        if sock is None:
            raise RuntimeError(f"the call's rendezvous store ({address}:{port}) has no socket bound for it here")
        sock.listen(max(world * 2, 8))
        fd = sock.detach()
        _host_socket = None
        _hosted = TCPStore(address, port, world, is_master=True, wait_for_workers=False, timeout=timeout,
                           master_listen_fd=fd, **compat.listen_fd_store_options())
        _open.add((address, port))
    return _hosted


def _client(address: str, port: int, world: int, timeout: datetime.timedelta) -> Any:
    """A client of the store :func:`_wait_open` saw open, connected in short tries, then given the
    rendezvous's whole timeout for its waits. torch retries a refused connect in C++ for that whole
    timeout (30 minutes by default), where no stop reaches the thread: a host that died between our
    look and the connect (CI, under load) left the notebook there for good."""
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    deadline = time.monotonic() + timeout.total_seconds()
    tries = 0
    while True:
        left = deadline - time.monotonic()
        longest = _CONNECT_TRIES[min(tries, len(_CONNECT_TRIES) - 1)]
        tries += 1
        try:
            store = TCPStore(address, port, world, is_master=False,
                             timeout=datetime.timedelta(seconds=max(0.1, min(longest, left))))
            break
        except (RuntimeError, OSError):  # torch's DistNetworkError, DistStoreError; TimeoutError
            if _aborted.is_set() or left <= 0:
                raise
            _open.discard((address, port))  # the stop, if one comes, lands here between tries
            _wait_open(address, port, left)
    store.set_timeout(timeout)
    return store


def _wait_open(address: str, port: int, seconds: float) -> None:
    """Wait, in Python (so a stop reaches this thread), until the host has opened the store: it
    does at its own first rendezvous, maybe a moment after ours."""
    if (address, port) in _open:
        return
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((address, port), timeout=max(0.1, min(5.0, seconds))).close()
            _open.add((address, port))
            return
        except OSError:
            if _aborted.is_set():
                raise RuntimeError("init_process_group gave up: the store it waited for never opened (the rank that "
                                   f"hosts it, rank {os.environ.get(HOST_VARIABLE)}, did not come)") from None
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the call's rendezvous store ({address}:{port}) did not open within "
                                   f"{seconds:g} s: the rank that hosts it (rank {os.environ.get(HOST_VARIABLE)}) "
                                   "never reached init_process_group") from None
            time.sleep(_PROBE_EVERY)


# -- torch imported during the call --------------------------------------------------------------

#: What runs once torch.distributed is imported, in a process that plays a rank (when_imported).
_waiting: list[Callable[[], object]] = []


def when_imported(callback: Callable[[], object]) -> None:
    """Run ``callback`` once ``torch.distributed`` is imported: now if it is; else right after
    its import (a spawned rank, or the notebook, whose function imports torch during the call).
    What a rank installs there (these handlers, the collective check, the p2p notes) must be in
    place before the function's first ``init_process_group``."""
    if "torch.distributed" in sys.modules and "torch.distributed.distributed_c10d" in sys.modules:
        callback()
        return
    with _lock:
        _waiting.append(callback)
    _install_when_imported()


def _imported() -> None:
    """torch.distributed's package has just run: our handlers, the groups kept, what waited."""
    module = sys.modules.get("torch.distributed.rendezvous")
    if module is not None:
        _install_into(module)
    groups.keep_groups()
    with _lock:
        waiting, _waiting[:] = list(_waiting), []
    for callback in waiting:
        try:
            callback()
        except Exception:
            pass  # what it guards is lost, the call goes on


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run :func:`_imported` right after the package ``torch.distributed`` is first imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.distributed":
            return None
        _remove_finder()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: Any) -> None:
            original_exec(module)  # distributed_c10d, rendezvous and the rest are imported now
            try:
                _imported()
            except Exception:
                pass  # torch renamed what we patch: torch's own stays

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finder: Optional[_AfterImport] = None


def _install_when_imported() -> None:
    global _finder
    with _lock:
        if _finder is None:
            _finder = _AfterImport()
            sys.meta_path.insert(0, _finder)


def _remove_finder() -> None:
    global _finder
    with _lock:
        if _finder is not None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None
