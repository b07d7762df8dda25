"""Ranks on a Ray cluster: the placer behind ``set_placement("ray")``.

Ray does what a cluster manager does (which nodes, their resources, starting and
killing work there, moving big objects, authentication); everything else is the
one-machine path: the rank runs ``rank.main`` in a process forked on its node,
and the caller's launcher, payload, relay and errors see a rank like any other::

    caller (notebook = Ray driver, rank 0)                  Ray worker on a node (a task)
    --------------------------------------                  -----------------------------
    reserve(): one placement group, a bundle per rank ──>   (all bundles, or none)
      where they landed -> LOCAL_RANK, GROUP_RANK, MASTER_ADDR/PORT
    start(r): a bridge holds rank r's channel end
      launcher sends setup + call to the bridge
      memfds -> one ray.put per call ────── object store ─> ray.get (per node: one transfer); the rank
                                                             maps the object where the node's store
                                                             holds it, copy-on-write (no copy per rank);
                                                             on the caller's machine: its memfds, opened
                                                             through /proc (no transfer, no copy)
      submit _serve_rank in bundle r ─────────────────────> connects back: TCP to the caller, token first
                                                             forks the rank (rank.main, as on one machine)
      channel / stdout / stderr  <══ frames over the link ══ rank's channel, stdout, stderr
    kill(): close the link ─────────────────────────────>  SIGKILL the rank and its process group
             (no answer within 3 s: ray.cancel(force=True))  the task returns; the worker stays warm
    release(): remove the placement group

Why tasks and not actors: an actor is a new worker process for every call, which
imports torch again (7-10 s per call measured here); a task runs on one of Ray's
pooled workers, which keeps torch imported between calls (0.09 s). Nothing of
ours outlives a call: no actor, no placement group, no rank process; the idle
worker belongs to Ray's pool, as after any Ray task.

The link is a TCP connection from the worker to the caller's node address (never
0.0.0.0), on a port open only during the call; the first 32 bytes a connection
sends must be the call's random token, which travels to the worker inside Ray's
own (authenticated) task submission. Nothing is unpickled before that check.
"""

from __future__ import annotations

import fcntl
import hmac
import mmap
import os
import pickle
import secrets
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from . import payload, placement, wire

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

#: Seconds a call without a timeout waits for the cluster to find room for its ranks.
_PLACEMENT_PATIENCE = 120.0
#: Seconds a killed rank's worker has to confirm it is gone before Ray kills the worker.
_KILL_GRACE = 3.0
#: Seconds between two looks at which of the call's nodes are still in the cluster.
_NODE_CHECK = 1.0
#: A rank on the caller's machine maps the caller's memfds (opened through /proc) rather than
#: the object store's copy. False sends every rank through the object store, as on another
#: host (benchmarks/bench_ray.py measures that path with it).
LEND_MEMFDS = True


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError('set_placement("ray") needs Ray: pip install "mpify_nb[ray]"') from None
    return ray


@dataclass
class RayOptions:
    """What set_placement("ray", ...) was given, checked."""

    address: Optional[str] = None
    num_cpus: float = 1
    num_gpus: float = 0
    resources: dict[str, float] = field(default_factory=dict)
    strategy: str = "SPREAD"

    @classmethod
    def make(cls, address: Optional[str] = None, num_cpus: float = 1, num_gpus: float = 0,
             resources: Optional[dict[str, float]] = None, strategy: str = "SPREAD") -> RayOptions:
        for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"set_placement('ray'): {name} must be a number >= 0, not {value!r}")
        resources = dict(resources or {})
        for name, value in resources.items():
            if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or value < 0:
                raise ValueError(f"set_placement('ray'): resources must map names to numbers >= 0, "
                                 f"not {name!r}: {value!r}")
        if strategy not in _STRATEGIES:
            raise ValueError(f"set_placement('ray'): strategy must be one of {_STRATEGIES}, not {strategy!r}")
        options = cls(address, num_cpus, num_gpus, resources, strategy)
        connect(address)
        return options

    @property
    def client(self) -> bool:
        """Through Ray Client (``ray://``): this process is not on the cluster, and the ranks
        may not reach it."""
        return self.address is not None and self.address.startswith("ray://")

    def bundle(self) -> dict[str, float]:
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: float(v) for k, v in wanted.items() if v}


def connect(address: Optional[str]) -> None:
    """Join the cluster: the one this process already joined, else ``address``, else a
    running one (``address="auto"``), else a new local one."""
    ray = _import_ray()
    # Ray's driver replaces builtins.print by a function of its own once a worker's log line
    # arrives, and dill cannot walk that function's globals (they recurse): every later call
    # would fail to pickle a notebook function that prints. Ray's switch for it:
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address)
        return
    try:
        ray.init(address="auto")
    except ConnectionError:
        ray.init()


# -- the caller's side ----------------------------------------------------------------------

class RayPlacer:
    """Places one call's ranks (all but the caller's) on the cluster; see the module docstring."""

    ships_environ = False  # a rank on another node keeps its node's environment

    def __init__(self, options: RayOptions):
        self._ray = _import_ray()
        self.options = options
        self._pg: Any = None
        self._pg_free_before: dict[str, float] = {}
        self._bundle_of: dict[int, int] = {}  # rank -> bundle index
        self._node_id_of: dict[int, str] = {}  # rank -> Ray node id
        self._layout: Optional[placement.Layout] = None
        self._here = ""  # the caller's node address
        self._token = secrets.token_bytes(32)
        self._listener: Optional[socket.socket] = None
        self._tunnel: Optional[_Tunnel] = None  # under Ray Client, instead of the listener
        self._ranks: dict[int, _RayRank] = {}
        self._lock = threading.Lock()
        self._puts: dict[tuple, Any] = {}  # the (st_dev, st_ino) of a call's memfds -> their ObjectRef
        self._released = False

    # -- reserve ---------------------------------------------------------------------------

    def reserve(self, nprocs: int, caller_rank: Optional[int], timeout: Optional[float]) -> placement.Layout:
        ray = self._ray
        connect(self.options.address)
        from ray.util.placement_group import placement_group, placement_group_table

        if self.options.client and caller_rank is not None:
            raise ValueError(
                f"this notebook reaches the Ray cluster through Ray Client ({self.options.address}), so it "
                f"is not on the cluster and its ranks cannot reach it: it cannot be rank {caller_rank}. "
                "Pass caller_rank=None (every rank on the cluster: ranch(..., caller_rank=None)), use a "
                "Session or %dist_init instead of %%ranch (whose rank 0 is the notebook), or run the "
                "notebook on a node of the cluster")
        others = [r for r in range(nprocs) if r != caller_rank]
        here: str = ray.util.get_node_ip_address()
        self._here = here
        nodes: dict[int, str] = {} if caller_rank is None else {caller_rank: here}
        if others:
            bundle = self.options.bundle()
            self._check_feasible(len(others), bundle)
            _wait_for_last_release(bundle)
            self._pg_free_before = {k: float(v) for k, v in ray.available_resources().items()}
            self._pg = placement_group([dict(bundle) for _ in others], strategy=self.options.strategy,
                                       name=f"mpify_nb-{os.getpid()}-{self._token[:4].hex()}")
            patience = _PLACEMENT_PATIENCE if timeout is None else timeout
            ready, _ = ray.wait([self._pg.ready()], timeout=patience)
            if not ready:
                self.release()
                raise TimeoutError(
                    f"the Ray cluster found no room for {len(others)} rank(s) of {bundle} each "
                    f"(strategy {self.options.strategy}) within {patience:g} s; free now: "
                    f"{_rounded(ray.available_resources())}")
            node_ids = placement_group_table(self._pg)["bundles_to_node_id"]
            address_of = self._node_addresses()
            landed = {b: address_of.get(node, "?") for b, node in node_ids.items()}
            # Ranks grouped by host (the caller's first), so LOCAL_RANK/GROUP_RANK mean what torchrun's do.
            order = [here] + [landed[b] for b in sorted(landed) if landed[b] != here]
            bundles = sorted(landed, key=lambda b: (order.index(landed[b]), b))
            for r, b in zip(others, bundles):
                self._bundle_of[r] = b
                self._node_id_of[r] = node_ids[b]
                nodes[r] = landed[b]
        store_rank = others[0] if others else 0
        master = nodes.get(store_rank) or here
        port = _store_port(here)
        interface = interface_of(here)
        interfaces = {caller_rank: interface} if caller_rank is not None and interface else {}
        self._layout = placement.Layout(nodes, master, port, interfaces)
        if others:
            if self.options.client:
                self._tunnel = _Tunnel(self)
            else:
                self._listen(here)
            self._spawn(self._watch_nodes, "mpify_nb-ray-nodes")
        return self._layout

    def _node_addresses(self) -> dict[str, str]:
        return {n["NodeID"]: n["NodeManagerAddress"] for n in self._ray.nodes()}

    def store_port(self) -> int:
        return _store_port(self._here)

    def _find_again(self, rank: int) -> None:
        """A rank started a second time (a Session's restart): its bundle may have moved, when
        Ray placed it anew after its node left. Wait until it is placed; update the layout."""
        from ray.util.placement_group import placement_group_table

        assert self._layout is not None
        deadline = time.monotonic() + _PLACEMENT_PATIENCE
        while True:
            table = placement_group_table(self._pg)
            node = table["bundles_to_node_id"].get(self._bundle_of[rank])
            alive = {n["NodeID"] for n in self._ray.nodes() if n.get("Alive")}
            if table.get("state") == "CREATED" and node in alive:
                break
            if time.monotonic() > deadline:
                free = _rounded(self._ray.available_resources())
                raise TimeoutError(f"Ray found no node for rank {rank} again within {_PLACEMENT_PATIENCE:g} s "
                                   f"(its node left the cluster); free now: {free}")
            time.sleep(0.2)
        self._node_id_of[rank] = node
        self._layout.nodes[rank] = self._node_addresses().get(node, "?")

    def _watch_nodes(self) -> None:
        """A node that leaves the cluster ends its ranks' part now: its link may never say so
        (a host that is switched off sends no FIN), and a task not yet started there would wait
        for Ray to find its bundle a new node, for ever."""
        while not self._released:
            time.sleep(_NODE_CHECK)
            if not self._ray.is_initialized():
                return  # ray.shutdown() by the user: asking now would join a new cluster
            try:
                alive = {n["NodeID"] for n in self._ray.nodes() if n.get("Alive")}
            except Exception:
                continue
            with self._lock:
                handles = list(self._ranks.values())
            for handle in handles:
                if not handle.ended.is_set() and self._node_id_of.get(handle.rank) not in alive:
                    handle.node_left()

    def _check_feasible(self, count: int, bundle: dict[str, float]) -> None:
        """Fail at once, naming the numbers, when the cluster could never hold the ranks."""
        ray = self._ray
        fits = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            have = node.get("Resources", {})
            fits.append(min((int(have.get(k, 0) // v) for k, v in bundle.items() if v), default=count))
        strict = self.options.strategy == "STRICT_SPREAD"
        room = sum(min(f, 1) for f in fits) if strict else sum(fits)
        if self.options.strategy == "STRICT_PACK":
            room = max(fits, default=0)
        if room < count:
            raise ValueError(
                f"the Ray cluster cannot hold {count} rank(s) of {bundle} each (strategy "
                f"{self.options.strategy}): its {len(fits)} node(s) have room for {room}. "
                f"Ask for fewer ranks or fewer resources per rank (set_placement('ray', num_cpus=...)). "
                f"Cluster total: {_rounded(ray.cluster_resources())}")

    def _listen(self, address: str) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind((address, 0))
        listener.listen(64)
        self._listener = listener
        self._spawn(_accept_links, "mpify_nb-ray-accept", listener, self._greet)

    def _spawn(self, target, name: str, *args) -> None:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()

    # -- start -----------------------------------------------------------------------------

    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> placement.RankProcess:
        assert self._layout is not None, "reserve() first"
        if rank in self._ranks:
            self._find_again(rank)
        handle = _RayRank(self, rank, self._layout.nodes[rank], channel_fd, stdout_fd, stderr_fd)
        with self._lock:
            self._ranks[rank] = handle
        self._spawn(handle.bridge, f"mpify_nb-ray-rank{rank}")
        return handle

    def submit(self, handle: _RayRank, setup: bytes | bytearray, call: bytes | bytearray, fds: list[int]) -> Any:
        """Start ``handle``'s rank on its bundle; its call's memfds go through the object store."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        objects = self._put(fds)
        # A rank on this machine maps the caller's memfds themselves (as on one machine): no
        # transfer, no copy. The object is there for a rank that cannot open them.
        lent = [(os.getpid(), fd, *_identity(fd)) if LEND_MEMFDS else None for fd in fds]
        if self._tunnel is not None:
            host, port = self._tunnel.address
        else:
            assert self._listener is not None
            host, port = self._listener.getsockname()[:2]
        task = _remote_serve_rank().options(
            num_cpus=self.options.num_cpus, num_gpus=self.options.num_gpus,
            resources=self.options.resources or None, max_retries=0, runtime_env=_WORKER_ENV,
            name=f"mpify_nb rank {handle.rank}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, self._bundle_of[handle.rank]))
        # In a list: Ray would fetch an ObjectRef passed as such before the task starts, and a
        # rank that maps the caller's memfds needs no copy on its node.
        return task.remote(host, port, self._token, handle.rank, bytes(setup), bytes(call), [objects], lent)

    def _put(self, fds: list[int]) -> Any:
        """One object holding the bytes of every memfd of the call (a list, one array each): put
        once per call, whichever rank asks first. One object keeps the pieces of a big tensor
        back to back in a node's store, where its ranks map them as one tensor."""
        if not fds:
            return None
        key = tuple(_identity(fd) for fd in fds)
        with self._lock:
            ref = self._puts.get(key)
            if ref is None:
                ref = self._ray.put([_read_memfd(fd) for fd in fds])
                self._puts[key] = ref
        return ref

    def _greet(self, sock: socket.socket) -> None:
        hello = _read_hello(sock)
        if hello is None or not hmac.compare_digest(hello[0], self._token):
            sock.close()
            return
        _token, rank, pid = hello
        with self._lock:
            handle = self._ranks.get(rank)
        if handle is None or not handle.attach(sock, pid):
            sock.close()

    # -- release ---------------------------------------------------------------------------

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for handle in list(self._ranks.values()):
            handle.kill()
            handle.ended.wait(_KILL_GRACE + 2.0)
        # Wait until each task has returned its worker to Ray's pool: a call that came before
        # that would find the worker busy, and Ray would start (and import torch in) a new one.
        tasks = [h._task for h in self._ranks.values() if h._task is not None]
        if tasks:
            self._ray.wait(tasks, num_returns=len(tasks), timeout=_KILL_GRACE)
        if self._tunnel is not None:
            self._tunnel.stop()
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)  # Ray kills whatever still runs in it
                _note_release(self._pg_free_before)
            except Exception:
                pass
            self._pg = None
        self._puts.clear()


# -- Ray Client: the links go through an actor on the cluster -------------------------------

class _Hub:
    """Under Ray Client the notebook is outside the cluster: the ranks connect to this actor
    instead (the same token check), and it carries each rank's link as bytes, to the notebook
    in answers to ``poll`` and from it through ``send``. One per Ray Client connection, made by
    its first call and reused (a new actor is a new worker process: 8 s per call here); it
    keeps nothing of a call after ``forget``, and dies with the connection."""

    def __init__(self) -> None:
        import ray

        address = ray.util.get_node_ip_address()
        self._listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((address, 0))
        self._listener.listen(64)
        self._calls: dict[bytes, list[tuple[str, int, Any]]] = {}  # token of an open call -> its events
        self._links: dict[tuple[bytes, int], socket.socket] = {}
        self._cond = threading.Condition()
        threading.Thread(target=_accept_links, args=(self._listener, self._carry), daemon=True).start()

    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def open(self, token: bytes) -> None:
        with self._cond:
            self._calls[token] = []

    def forget(self, token: bytes) -> None:
        with self._cond:
            self._calls.pop(token, None)
            links = [key for key in self._links if key[0] == token]
            for key in links:
                self.close(*key)
                self._links.pop(key).close()

    def _carry(self, sock: socket.socket) -> None:
        hello = _read_hello(sock)
        if hello is None:
            sock.close()
            return
        token, rank, pid = hello
        with self._cond:
            known = next((t for t in self._calls if hmac.compare_digest(t, token)), None)
            if known is None or (known, rank) in self._links:
                sock.close()
                return
            self._links[(known, rank)] = sock
            self._calls[known].append(("hello", rank, pid))
            self._cond.notify_all()
        while True:
            try:
                data = sock.recv(1 << 20)
            except OSError:
                data = b""
            with self._cond:
                if known in self._calls:
                    self._calls[known].append(("data", rank, data) if data else ("closed", rank, None))
                    self._cond.notify_all()
            if not data:
                return

    def poll(self, token: bytes, timeout: float) -> Optional[list[tuple[str, int, Any]]]:
        """The call's events since the last poll (None once it is forgotten)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._calls.get(token, True)), timeout)
            if token not in self._calls:
                return None
            events, self._calls[token] = self._calls[token], []
        return events

    def send(self, token: bytes, rank: int, data: bytes) -> None:
        self._links[(token, rank)].sendall(data)

    def close(self, token: bytes, rank: int) -> None:
        link = self._links.get((token, rank))
        if link is not None:
            try:
                link.shutdown(socket.SHUT_RDWR)  # its worker kills the rank
            except OSError:
                pass


#: (the Ray Client connection it serves, its handle, its address)
_hub: Optional[tuple[Any, Any, tuple[str, int]]] = None
_hub_lock = threading.Lock()


def _the_hub(ray: Any) -> tuple[Any, tuple[str, int]]:
    """This Ray Client connection's hub, made on first use."""
    global _hub
    connection = ray.get_runtime_context().get_job_id()
    with _hub_lock:
        if _hub is None or _hub[0] != connection:
            # Its own runtime env gives it its own worker: with the ranks' it would take a pooled
            # worker that has torch imported, which would be lost to the ranks.
            handle = ray.remote(_Hub).options(num_cpus=0, max_concurrency=64, runtime_env=_HUB_ENV,
                                              name=f"mpify_nb-hub-{os.getpid()}-{secrets.token_hex(3)}").remote()
            _hub = (connection, handle, tuple(ray.get(handle.address.remote())))
        return _hub[1], _hub[2]


def drop_hub() -> None:
    """End this process's hub (``set_placement`` to somewhere else); a new call makes another."""
    global _hub
    with _hub_lock:
        hub, _hub = _hub, None
    if hub is not None:
        try:
            _import_ray().kill(hub[1])
        except Exception:
            pass


class _Tunnel:
    """The notebook's side of the hub for one call: each rank's link is one end of a socketpair
    here, the rank's handle holding the other as if it were the TCP link."""

    def __init__(self, placer: RayPlacer):
        self._placer = placer
        self._ray = placer._ray
        self._token = placer._token
        self.hub, self.address = _the_hub(self._ray)
        self._ray.get(self.hub.open.remote(self._token))
        self._ends: dict[int, socket.socket] = {}
        placer._spawn(self._downstream, "mpify_nb-ray-hub")

    def _downstream(self) -> None:
        """Hub -> ranks' handles: links attached, their bytes, their ends."""
        while True:
            try:
                events = self._ray.get(self.hub.poll.remote(self._token, 0.5))
            except Exception:
                events = None  # the hub died (its node left): the ranks' links are gone with it
            if events is None:
                for end in list(self._ends.values()):
                    _shut(end)
                return
            for kind, rank, value in events:
                if kind == "hello":
                    ours, theirs = socket.socketpair()
                    with self._placer._lock:
                        handle = self._placer._ranks.get(rank)
                    if handle is None or not handle.attach(theirs, value):
                        ours.close()
                        theirs.close()
                        self.hub.close.remote(self._token, rank)
                        continue
                    self._ends[rank] = ours
                    self._placer._spawn(self._upstream, f"mpify_nb-ray-hub{rank}", rank, ours)
                elif rank in self._ends:
                    try:
                        if kind == "data":
                            self._ends[rank].sendall(value)
                        else:
                            _shut(self._ends[rank])
                    except OSError:
                        pass

    def _upstream(self, rank: int, ours: socket.socket) -> None:
        """A rank's handle -> the hub, in order; its end closing means: stop that rank."""
        try:
            while True:
                data = ours.recv(1 << 20)
                if not data:
                    break
                self._ray.get(self.hub.send.remote(self._token, rank, data))
        except Exception:
            pass
        try:
            self._ray.get(self.hub.close.remote(self._token, rank), timeout=_KILL_GRACE)
        except Exception:
            pass

    def stop(self) -> None:
        try:
            self._ray.get(self.hub.forget.remote(self._token), timeout=_KILL_GRACE)
        except Exception:
            pass
        for end in self._ends.values():
            end.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


_serve_rank_remote: Any = None


def _remote_serve_rank() -> Any:
    """``_serve_rank`` as a Ray remote function, made once: Ray exports a new one to the
    cluster on its first use, which every rank of every call would otherwise pay."""
    global _serve_rank_remote
    if _serve_rank_remote is None:
        _serve_rank_remote = _import_ray().remote(_serve_rank)
    return _serve_rank_remote


def _store_port(here: str) -> int:
    """MASTER_PORT for a store on another host, chosen without asking that host (a round trip
    to a worker per call, which Ray may have to start). A port below the kernel's ephemeral
    range is never handed out for outgoing connections, so only a service listening there
    can hold it; free here too. If the store's host has one, its rank fails at once with
    "address already in use", which names the port. Ray's own default ranges end below
    ``_STORE_PORT_LOW`` (workers 10002-19999, Ray Client's per-driver servers 23000-23999)."""
    low = _ephemeral_low()
    for _ in range(100):
        port = secrets.randbelow(low - _STORE_PORT_LOW) + _STORE_PORT_LOW
        try:
            with socket.socket(socket.AF_INET6 if ":" in here else socket.AF_INET) as s:
                s.bind((here, port))
            return port
        except OSError:
            continue
    return placement.free_port(here)


_STORE_PORT_LOW = 24000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
        if low > _STORE_PORT_LOW + 100:
            return low
    except (OSError, ValueError, IndexError):
        pass
    return 32768


#: What the last call's removed placement group gives back: (when, resources free before it).
_last_release: Optional[tuple[float, dict[str, float]]] = None


def _note_release(free_before: dict[str, float]) -> None:
    global _last_release
    _last_release = (time.monotonic(), free_before)


def _wait_for_last_release(bundle: dict[str, float]) -> None:
    """A placement group asked for before the cluster has taken back the last one's resources
    is retried by Ray after a back-off (about 0.8 s per call measured here, calls in a loop).
    Wait, briefly, until they are back: then Ray places the new one at once."""
    global _last_release
    if _last_release is None:
        return
    since, free_before = _last_release
    _last_release = None
    ray = _import_ray()
    deadline = since + 1.0
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0.0) >= free_before.get(k, 0.0) - 1e-6 for k in bundle):
            return
        time.sleep(0.005)


def _rounded(resources: dict) -> dict:
    return {k: round(v, 2) for k, v in resources.items() if not k.startswith("node:") and "memory" not in k}


class _RayRank:
    """The caller's handle on one rank placed by Ray (a ``placement.RankProcess``)."""

    #: Its link reports the death of its worker or node within this (a peer's collective may fail sooner).
    death_latency = 1.0
    shares_clock = False  # its errors' timestamps come from another host's clock

    def __init__(self, placer: RayPlacer, rank: int, node: str, channel_fd: int, stdout_fd: int, stderr_fd: int):
        self.placer = placer
        self.rank = rank
        self.node = node
        self.pid = 0  # the rank's pid on its node, once it called back
        self._channel = socket.socket(fileno=os.dup(channel_fd))
        self._out, self._err = os.dup(stdout_fd), os.dup(stderr_fd)
        self._death_r, self._death_w = os.pipe2(os.O_CLOEXEC)
        self.death_fd: Optional[int] = self._death_r
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self._link: Optional[socket.socket] = None
        self._send_lock = threading.Lock()  # the link has two writers with a Session's control channel
        self._control: Optional[socket.socket] = None  # a Session rank's second channel
        self._lent: list[int] = []  # the call's memfds
        self._task: Any = None
        self._killed = False
        self._death_signalled = False
        self._code: Optional[int] = None
        self._detail = ""

    # -- the bridge ------------------------------------------------------------------------

    def bridge(self) -> None:
        """Take the setup and the call, start the task, then carry the channel both ways."""
        try:
            setup = wire.recv(self._channel)
            if setup is None:
                return  # the launcher gave up before sending it
            if pickle.loads(setup[0]).get("session"):
                # A Session's rank: no call follows, and its setup brings the end of a second
                # channel (interrupts, collective watch), carried over the link as "c" frames.
                self._control = socket.socket(fileno=setup[1][0])
                payload.close_fds(setup[1][1:])
                call: Optional[tuple[Any, list[int]]] = (b"", [])
            else:
                payload.close_fds(setup[1])
                call = wire.recv(self._channel)
            if call is None:
                return  # the launcher gave up before sending the call
            self._lent = call[1]  # open until the rank ends: its worker may map them (see submit)
            self._task = self.placer.submit(self, setup[0], call[0], call[1])
            self.placer._spawn(self._watch_task, f"mpify_nb-ray-task{self.rank}")
            with self._cond:
                self._cond.wait_for(lambda: self._link is not None or self._killed or self.ended.is_set())
                link = self._link
            if link is None:
                return
            self.placer._spawn(self._from_rank, f"mpify_nb-ray-from{self.rank}", link)
            if self._control is not None:
                self.placer._spawn(self._control_to_rank, f"mpify_nb-ray-control{self.rank}", link, self._control)
            while True:  # launcher -> rank
                message = wire.recv(self._channel)
                if message is None:
                    break
                with self._send_lock:
                    _send_message(link, *message)
        except Exception as e:
            if not self._killed:
                self._end(f"its link to the caller broke: {type(e).__name__}: {e}")
        finally:
            if self._link is None and self._task is None:
                self._end("")

    def _control_to_rank(self, link: socket.socket, control: socket.socket) -> None:
        try:
            while True:
                message = wire.recv(control)
                if message is None:
                    return  # the Session let go of it: the rank is being buried
                with self._send_lock:
                    _send_frame(link, b"c", [message[0]])
        except (OSError, EOFError):
            pass

    def attach(self, link: socket.socket, pid: int) -> bool:
        with self._cond:
            if self._link is not None or self._killed or self.ended.is_set():
                return False
            self._link, self.pid = link, pid
            self._cond.notify_all()
        return True

    def _from_rank(self, link: socket.socket) -> None:
        """Rank -> caller: output into the relay's pipes, messages into the launcher's channel."""
        try:
            for kind, parts in _frames(link):
                if kind == b"o":
                    _write_all(self._out, parts[0])
                elif kind == b"e":
                    _write_all(self._err, parts[0])
                elif kind == b"m":
                    _deliver(self._channel, parts)
                elif kind == b"c" and self._control is not None:
                    wire.send(self._control, parts[0])
                elif kind == b"x":  # the last frame: the rank has exited
                    self._code = struct.unpack("!i", parts[0])[0]
                    break
        except (OSError, EOFError, ConnectionError):
            pass
        detail = ""
        if self._code is None and not self._killed and self._task is not None:
            self._signal_death()  # the launcher learns now; exit_code() and death_detail() wait for Ray
            detail = "its link to the caller broke: its Ray worker or its node died"
            try:  # Ray may already know which (it learns of a dead node later: not worth waiting for)
                self.placer._ray.get(self._task, timeout=0.5)
            except Exception as e:
                if type(e).__name__ != "GetTimeoutError":
                    detail = _explain(e, self.node)
        self._end(detail)

    def _watch_task(self) -> None:
        """The task's own end: how a worker or node that died, or a task that never started, is seen."""
        ray = self.placer._ray
        detail = ""
        try:
            ray.get(self._task)
        except Exception as e:
            if not self._killed:
                detail = _explain(e, self.node)
        with self._cond:
            linked = self._link is not None
        if detail or not linked:
            self._end(detail)

    def _end(self, detail: str) -> None:
        """The rank is gone: the launcher sees its channel close and its death fd turn readable."""
        with self._cond:
            if self.ended.is_set():
                return
            if detail:
                self._detail = detail
            self.ended.set()
            self._cond.notify_all()
            link = self._link
        if link is not None:
            try:
                link.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            link.close()
        closes = [self._channel.close, lambda: os.close(self._out), lambda: os.close(self._err),
                  lambda: payload.close_fds(self._lent)]
        if self._control is not None:
            closes.append(self._control.close)
        for close in closes:
            try:
                close()
            except OSError:
                pass
        self._signal_death()

    def _signal_death(self) -> None:
        with self._cond:
            if self.death_fd is not None and not self._death_signalled:
                self._death_signalled = True
                os.write(self._death_w, b"x")

    def node_left(self) -> None:
        self._end(f"its node {self.node} left the Ray cluster")  # before kill(), whose own end says less
        self.kill()

    # -- placement.RankProcess -------------------------------------------------------------

    def kill(self) -> None:
        with self._cond:
            if self._killed:
                return
            self._killed = True
            self._cond.notify_all()
            link, task = self._link, self._task
        if link is not None:
            try:
                link.shutdown(socket.SHUT_RDWR)  # the worker kills the rank and its group at once
            except OSError:
                pass
        if task is not None:
            threading.Thread(target=self._make_sure, args=(task,), name="mpify_nb-ray-kill", daemon=True).start()
        else:
            self._end("")

    def _make_sure(self, task: Any) -> None:
        ray = self.placer._ray
        done, _ = ray.wait([task], timeout=_KILL_GRACE)
        if not done:  # a worker that does not answer: Ray kills the worker process
            try:
                ray.cancel(task, force=True)
            except Exception:
                pass
            ray.wait([task], timeout=_KILL_GRACE)
        self._end("")

    def wait_gone(self, timeout: float) -> bool:
        return self.ended.wait(timeout)

    def exit_code(self, timeout: float) -> Optional[int]:
        self.ended.wait(timeout)
        return self._code

    def death_detail(self) -> str:
        where = f"on node {self.node}" + (f" (pid {self.pid})" if self.pid else "")
        return f"{where}: {self._detail}" if self._detail else where

    def kill_leftovers(self) -> None:
        pass  # its worker killed the rank's process group (on its node) before answering

    def close(self) -> None:
        with self._cond:
            if self.death_fd is None:
                return
            self.death_fd = None
            os.close(self._death_r)
            os.close(self._death_w)


def _explain(error: BaseException, node: str) -> str:
    name = type(error).__name__
    text = str(error).strip().splitlines()
    first = next((line for line in text if line.strip()), "")
    if "NodeDied" in name or "node" in first.lower() and "died" in first.lower():
        return f"its node {node} left the Ray cluster ({name})"
    if "WorkerCrashed" in name or "ActorDied" in name:
        return f"the Ray worker process hosting it on {node} died ({name}: {first[:200]})"
    # A RayTaskError's first line names only the task and worker; what went wrong is its last.
    last = next((line.strip() for line in reversed(text) if line.strip()), "")
    return f"its Ray task failed: {name}: {first[:300]}" + (f" ... {last[:300]}" if last != first.strip() else "")


# -- frames on the link ----------------------------------------------------------------------
# kind (1 byte), number of parts (4), each part's length (8 each), then the parts.
#   m: a channel message (data, then one part per memfd)  o/e: stdout/stderr bytes
#   c: a message on a Session rank's control channel      x: the rank's exit code, last

def _send_frame(sock: socket.socket, kind: bytes, parts: Sequence[Any]) -> None:
    sizes = [memoryview(p).nbytes for p in parts]
    head = kind + struct.pack(f"!I{len(parts)}Q", len(parts), *sizes)
    if sum(sizes) <= _SMALL_FRAME:  # one segment: a request or an answer is one write
        sock.sendall(b"".join([head, *(memoryview(p).cast("B") for p in parts)]))
        return
    sock.sendall(head)
    for part in parts:
        if len(part):
            sock.sendall(part)


def _accept_links(listener: socket.socket, on_link) -> None:
    """Each connection to ``listener`` to ``on_link(sock)``, on a thread of its own, until the
    listener is closed."""
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return  # closed: the call (or the hub) is over
        _no_delay(sock)
        threading.Thread(target=on_link, args=(sock,), name="mpify_nb-ray-link", daemon=True).start()


def _read_hello(sock: socket.socket) -> Optional[tuple[bytes, int, int]]:
    """The first bytes of a link: (the call's token, the rank, the rank's pid); None if the
    peer sends less within 10 s. Nothing is unpickled before the token is checked."""
    try:
        sock.settimeout(10.0)
        hello = wire._recv_exact(sock, 32 + 8)
        sock.settimeout(None)
    except (OSError, EOFError):
        return None
    rank, pid = struct.unpack("!II", hello[32:])
    return bytes(hello[:32]), rank, pid


#: Frames up to this size are sent in one write.
_SMALL_FRAME = 64 * 1024


def _no_delay(sock: socket.socket) -> None:
    """Small frames go out at once: with Nagle's algorithm, a request written in two pieces
    waited for the peer's delayed ACK (40 ms per round trip, measured: 90 ms per call)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def _send_message(link: socket.socket, data, fds: list[int]) -> None:
    """A channel message onto the link: its memfds travel as bytes (closed here)."""
    try:
        _send_frame(link, b"m", [data, *(_read_memfd(fd) for fd in fds)])
    finally:
        payload.close_fds(fds)


def _deliver(channel: socket.socket, parts: list) -> None:
    """An ``m`` frame from the link onto a channel: its parts after the first become memfds again."""
    fds = [payload._memfd_of(memoryview(p).cast("B")) for p in parts[1:]]
    try:
        wire.send(channel, parts[0], fds)
    finally:
        payload.close_fds(fds)


def _frames(sock: socket.socket) -> Iterator[tuple[bytes, list]]:
    """The frames arriving on ``sock``, until it is closed."""
    while True:
        frame = _recv_frame(sock)
        if frame is None:
            return
        yield frame


def _recv_frame(sock: socket.socket) -> Optional[tuple[bytes, list]]:
    head = sock.recv(5)
    if not head:
        return None
    if len(head) < 5:
        head += wire._recv_exact(sock, 5 - len(head))
    kind, count = head[:1], struct.unpack("!I", head[1:])[0]
    sizes = struct.unpack(f"!{count}Q", wire._recv_exact(sock, 8 * count)) if count else ()
    return kind, [wire._recv_exact(sock, n) if n else b"" for n in sizes]


def _read_memfd(fd: int):
    """A memfd's bytes as a read-only buffer (numpy when it is there: Ray stores those without a copy)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return b""
    view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        import numpy

        return numpy.frombuffer(view, dtype=numpy.uint8)
    except ImportError:
        return memoryview(view)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# -- the worker's side -------------------------------------------------------------------------

#: Our package imported in a Ray worker must not start a template of its own.
_WORKER_ENV = {"env_vars": {"MPIFY_NB_CHILD": "1", "MPIFY_NB_PREWARM": "0"}}
_HUB_ENV = {"env_vars": {"MPIFY_NB_CHILD": "1", "MPIFY_NB_PREWARM": "0", "MPIFY_NB_RAY_HUB": "1"}}


def _serve_rank(caller: str, port: int, token: bytes, rank: int, setup: bytes, call: bytes, objects: list,
                lent: list) -> int:
    """A Ray task: run rank ``rank`` in a process forked here, relaying it to the caller over one
    TCP link, until it exits or the caller drops the link. Returns the rank's exit code."""
    import ray

    try:
        import torch  # noqa: F401  (the rank is forked from here: this worker keeps torch for the next call)
    except ImportError:
        pass
    link = socket.create_connection((caller, port), timeout=30)
    link.settimeout(None)
    _no_delay(link)
    # ``held``: the object store's copy of the call's memfds, which the rank may map; held (so
    # pinned in the store) until this task returns, after the rank has exited.
    fds, windows, held = _call_memfds(objects[0], lent)
    config = pickle.loads(setup)
    _adapt(config, ray.util.get_node_ip_address())
    if windows:
        config["windows"] = windows
    ours, theirs = wire.socketpair()
    control, control_theirs = wire.socketpair() if config.get("session") else (None, None)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    me = os.getpid()
    pid = os.fork()
    if pid == 0:  # the rank
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            # The rank holds its channel and nothing of the Ray worker's: not its connections to
            # Ray (a Session's group abort shuts down the rank's TCP connections to its peers'
            # nodes; with the worker's among them, Ray lost the worker), nor the link.
            try:
                signal.set_wakeup_fd(-1)  # the worker's, closed below
            except ValueError:
                pass
            # Ray runs tasks with SIGINT blocked: a Session's interrupt (SIGINT to the rank's
            # main thread) would never arrive.
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            keep = theirs.fileno()
            os.closerange(3, keep)
            os.closerange(keep + 1, _max_fd())
            from . import rank as rank_module

            rank_module.main(theirs.detach(), me)
        finally:
            os._exit(1)
    for fd in (out_w, err_w):
        os.close(fd)
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
    theirs.close()
    child = _Child(pid)
    try:
        link.sendall(token + struct.pack("!II", rank, pid))
        try:
            if control_theirs is not None:  # a Session's rank: its setup brings its control channel
                wire.send(ours, pickle.dumps(config), [control_theirs.fileno()])
            else:
                wire.send(ours, pickle.dumps(config))
                wire.send(ours, call, fds)
        except OSError:
            pass  # it died at birth; its exit code says how
        finally:
            payload.close_fds(fds)
            if control_theirs is not None:
                control_theirs.close()
        threading.Thread(target=_to_rank, args=(link, ours, control, child), name="mpify_nb-from-caller",
                         daemon=True).start()
        return _from_rank_loop(link, ours, control, out_r, err_r, child)
    finally:
        if control is not None:
            control.close()
        child.close()
        for fd in (out_r, err_r):
            os.close(fd)
        ours.close()
        try:
            link.shutdown(socket.SHUT_RDWR)  # a close() alone sends no FIN while _to_rank blocks in recv
        except OSError:
            pass
        link.close()


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _call_memfds(objects: Any, lent: list) -> tuple[list[int], dict[int, tuple[int, int]], Any]:
    """The call's memfds, here, as the rank will map them, with the windows among them and
    what must stay alive while the rank runs. A memfd is the caller's own when this is its
    machine (opened through /proc, checked to be the same file: a pid in another pid namespace
    is another process). Else the rank maps the object Ray brought to this node where it lies
    in the object store's shared-memory file, copy-on-write: fds[i] is that file and
    ``windows[i]`` the (offset, length) of memfd i in it. Only where the store's file cannot be
    opened (see ``_StoreFiles``) does the rank get a copy."""
    import ray

    fds: list[Optional[int]] = [_open_lent(*handle) if handle else None for handle in lent]
    windows: dict[int, tuple[int, int]] = {}
    held = None
    files = _StoreFiles()
    try:
        missing = [i for i, fd in enumerate(fds) if fd is None]
        if missing:  # one get: the node fetches the call's object once, for all its ranks
            held = ray.get(objects)
            for i in missing:
                window = files.window(held[i])
                if window is not None:
                    fds[i], windows[i] = window[0], window[1:]
                else:
                    fds[i] = payload._memfd_of(memoryview(held[i]).cast("B"))
    except BaseException:
        payload.close_fds([fd for fd in fds if fd is not None])
        raise
    finally:
        files.close()
    return [fd for fd in fds if fd is not None], windows, held


class _StoreFiles:
    """Where an array that ``ray.get`` returned lies in the object store's shared-memory file.

    Ray maps the store's file (``/dev/shm/plasma...``, unlinked) into every worker and closes
    its descriptor; the raylet, this worker's parent, keeps one open. This finds the mapping
    that holds the array in /proc/self/maps, opens the same file through
    /proc/self/map_files (where this process may) or the raylet's /proc/<pid>/fd (same user),
    checked by device and inode, and gives a rank a window of it to map. Nothing found (another
    store layout, a hardened /proc): None, and the rank gets a copy."""

    def __init__(self, holder: Optional[int] = None, map_files: bool = True) -> None:
        self._holder = os.getppid() if holder is None else holder  # a process that keeps the file open
        self._map_files = map_files  # try /proc/self/map_files first (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)
        self._maps: Optional[list[tuple[int, int, int, int, int]]] = None  # start, end, offset, dev, inode
        self._opened: dict[tuple[int, int], Optional[int]] = {}  # (dev, inode) -> our fd of the file

    def window(self, array: Any) -> Optional[tuple[int, int, int]]:
        """(a new fd of the store's file, offset, length) of ``array``'s bytes, or None."""
        try:
            import numpy
        except ImportError:
            return None
        if not isinstance(array, numpy.ndarray) or not array.flags.c_contiguous or array.nbytes == 0:
            return None
        address = array.ctypes.data
        for start, end, offset, dev, inode in self._mappings():
            if start <= address and address + array.nbytes <= end:
                fd = self._open(start, end, dev, inode)
                return None if fd is None else (os.dup(fd), offset + address - start, array.nbytes)
        return None

    def _mappings(self) -> list[tuple[int, int, int, int, int]]:
        if self._maps is None:
            self._maps = []
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) < 6 or "s" not in fields[1] or fields[4] == "0":
                        continue  # only shared mappings of a file
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    self._maps.append((start, end, int(fields[2], 16), os.makedev(major, minor), int(fields[4])))
        return self._maps

    def _open(self, start: int, end: int, dev: int, inode: int) -> Optional[int]:
        key = (dev, inode)
        if key not in self._opened:
            self._opened[key] = None
            holder = f"/proc/{self._holder}/fd"
            try:
                paths = [os.path.join(holder, name) for name in os.listdir(holder)]
            except OSError:
                paths = []
            if self._map_files:
                paths.insert(0, f"/proc/self/map_files/{start:x}-{end:x}")
            for path in paths:
                try:
                    st = os.stat(path)
                    if (st.st_dev, st.st_ino) != key:
                        continue
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                if _identity(fd) == key:
                    self._opened[key] = fd
                    break
                os.close(fd)
        return self._opened[key]

    def close(self) -> None:
        payload.close_fds([fd for fd in self._opened.values() if fd is not None])
        self._opened.clear()


def _open_lent(pid: int, number: int, dev: int, ino: int) -> Optional[int]:
    try:
        fd = os.open(f"/proc/{pid}/fd/{number}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # another host, another user, or a hardened /proc
    if _identity(fd) == (dev, ino):
        return fd
    os.close(fd)
    return None


def _max_fd() -> int:
    try:
        return max(os.sysconf("SC_OPEN_MAX"), 1024)
    except (ValueError, OSError):
        return 1 << 16


def _adapt(config: dict, node_address: str) -> None:
    """The caller's setup, made right for this node: this node's environment under the call's
    variables, the caller's sys.path entries that exist here, gloo on this node's NIC."""
    env = dict(os.environ)
    env.update(config["env"])
    interface = interface_of(node_address)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface and name not in config["env"]:
            env[name] = interface
    config["env"] = env
    theirs = [p for p in config["sys_path"] if p == "" or os.path.isdir(p)]
    config["sys_path"] = theirs + [p for p in sys.path if p not in theirs]
    if not os.path.isdir(config["cwd"]):
        config["cwd"] = os.getcwd()


class _Child:
    """The rank process this worker forked; killed by pidfd, so never another process that
    reuses its pid once it has been reaped (the relay thread may kill while the task reaps)."""

    def __init__(self, pid: int):
        self.pid, self.pidfd = pid, os.pidfd_open(pid)
        self.reaped = False
        self._lock = threading.Lock()

    def kill(self) -> None:
        with self._lock:
            if self.reaped:
                return
            try:
                os.killpg(self.pid, signal.SIGKILL)  # it leads its own group (rank.main) ...
            except OSError:
                pass
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)  # ... or not yet
            except OSError:
                pass

    def reap(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        with self._lock:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # what it left in its group; the id is not
            except OSError:                          # reused while a member lives
                pass
            self.reaped = True
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        with self._lock:
            self.reaped = True  # whatever it is now, it is no longer ours to signal
            os.close(self.pidfd)


def _to_rank(link: socket.socket, channel: socket.socket, control: Optional[socket.socket], child: _Child) -> None:
    """Caller -> rank. The caller closing the link means: stop now (it failed, or was interrupted)."""
    try:
        for kind, parts in _frames(link):
            if kind == b"c" and control is not None:
                wire.send(control, parts[0])
            else:
                _deliver(channel, parts)
    except (OSError, EOFError, ConnectionError):
        pass
    child.kill()


def _from_rank_loop(link: socket.socket, channel: socket.socket, control: Optional[socket.socket],
                    out_r: int, err_r: int, child: _Child) -> int:
    """Rank -> caller until the rank has exited; then its exit code, last."""
    channel_open = True
    pidfd = child.pidfd
    try:
        while True:
            watch = [out_r, err_r, pidfd] + ([channel] if channel_open else []) + ([control] if control else [])
            ready = select.select(watch, [], [])[0]
            if control is not None and control in ready:
                try:
                    message = wire.recv(control)
                except OSError:
                    message = None  # it died with an interrupt of ours unread
                if message is None:
                    control = None
                else:
                    _send_frame(link, b"c", [message[0]])
            # Output first: a rank flushes it before sending its value, so it arrives first.
            for fd, kind in ((out_r, b"o"), (err_r, b"e")):
                if fd in ready:
                    _relay_pipe(link, fd, kind)
            if channel_open and channel in ready:
                channel_open = _relay_message(link, channel)
            if pidfd in ready:
                break
        for fd, kind in ((out_r, b"o"), (err_r, b"e")):
            _relay_pipe(link, fd, kind)
        while channel_open:  # what it sent just before it exited (its value)
            channel_open = _relay_message(link, channel)
        code = child.reap()
        _send_frame(link, b"x", [struct.pack("!i", code)])
        return code
    except (OSError, EOFError, ConnectionError):
        child.kill()
        try:
            return child.reap()
        except ChildProcessError:
            return -signal.SIGKILL


def _relay_message(link: socket.socket, channel: socket.socket) -> bool:
    """One message from the rank to the caller; False when the rank closed its end."""
    try:
        message = wire.recv(channel)
    except OSError:
        return False  # ECONNRESET: it died with a request of ours unread; its exit code follows
    if message is None:
        return False
    _send_message(link, *message)
    return True


def _relay_pipe(link: socket.socket, fd: int, kind: bytes) -> None:
    """What the (non-blocking) pipe ``fd`` holds now, onto the link."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            return
        _send_frame(link, kind, [chunk])


# -- network interfaces ------------------------------------------------------------------------

def interface_of(address: str) -> Optional[str]:
    """The name of the network interface whose IPv4 network holds ``address`` (e.g. "lo" for
    127.0.0.2, "eth0" for the node's LAN address); None when none does (or for IPv6)."""
    try:
        wanted = struct.unpack("!I", socket.inet_aton(address))[0]
    except OSError:
        return None
    best: Optional[tuple[int, str]] = None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                addr = fcntl.ioctl(s.fileno(), 0x8915, request)[20:24]  # SIOCGIFADDR
                mask = fcntl.ioctl(s.fileno(), 0x891B, request)[20:24]  # SIOCGIFNETMASK
            except OSError:
                continue
            a, m = struct.unpack("!I", addr)[0], struct.unpack("!I", mask)[0]
            if a & m == wanted & m and (best is None or m > best[0]):
                best = (m, name)  # the narrowest network that holds it
    return best[1] if best else None


__all__ = ["RayOptions", "RayPlacer", "interface_of"]
