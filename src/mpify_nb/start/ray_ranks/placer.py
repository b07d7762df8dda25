"""The caller's side: ``RayPlacer`` reserves a call's ranks on the cluster (one placement
group), starts each as a Ray task in its bundle, and gives the launcher a handle per rank."""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import placement
from .client import Tunnel
from .handle import KILL_GRACE, RayRank
from .link import accept_links, identity, interface_of, read_memfd
from .worker import WORKER_ENV, serve_rank

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

#: Seconds a call without a timeout waits for the cluster to find room for its ranks.
_PLACEMENT_PATIENCE = 120.0
#: Seconds between two looks at which of the call's nodes are still in the cluster.
_NODE_CHECK = 1.0
#: A rank on the caller's machine maps the caller's memfds (opened through /proc) rather than
#: the object store's copy. False sends every rank through the object store, as on another
#: host (benchmarks/bench_ray.py measures that path with it).
LEND_MEMFDS = True


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError('set_placement("ray") needs Ray: pip install "ray[client]>=2.9" (the ray extra)') from None
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
    ray = import_ray()
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


class RayPlacer:
    """Places one call's ranks (all but the caller's) on the cluster; see the module docstring."""

    ships_environ = False  # a rank on another node keeps its node's environment

    def __init__(self, options: RayOptions):
        self.ray = import_ray()
        self.options = options
        self._pg: Any = None
        self._pg_free_before: dict[str, float] = {}
        self._bundle_of: dict[int, int] = {}  # rank -> bundle index
        self._node_id_of: dict[int, str] = {}  # rank -> Ray node id
        self._layout: Optional[placement.Layout] = None
        self.token = secrets.token_bytes(32)
        self._listener: Optional[socket.socket] = None
        self._tunnel: Optional[Tunnel] = None  # under Ray Client, instead of the listener
        self.ranks: dict[int, RayRank] = {}
        self.lock = threading.Lock()
        self._puts: dict[tuple, Any] = {}  # the (st_dev, st_ino) of a call's memfds -> their ObjectRef
        self._released = False

    # -- reserve ---------------------------------------------------------------------------

    def ready(self, timeout: Optional[float]) -> float:
        return 0.0  # the cluster's own start is reserve()'s wait, and counts

    def reserve(self, nprocs: int, caller_rank: Optional[int], timeout: Optional[float]) -> placement.Layout:
        ray = self.ray
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
        nodes: dict[int, str] = {} if caller_rank is None else {caller_rank: here}
        if others:
            bundle = self.options.bundle()
            self._check_feasible(len(others), bundle)
            _wait_for_last_release(bundle)
            self._pg_free_before = {k: float(v) for k, v in ray.available_resources().items()}
            self._pg = placement_group([dict(bundle) for _ in others], strategy=self.options.strategy,
                                       name=f"mpify_nb-{os.getpid()}-{self.token[:4].hex()}")
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
        interface = interface_of(here)
        interfaces = {caller_rank: interface} if caller_rank is not None and interface else {}
        # Port 0: the store's host binds one on its node and says which (a port chosen here, for
        # another host, could be taken there before the host binds it); the others learn it from
        # the caller: ranch's GO, a Session's start (torchdist/rendezvous.py).
        self._layout = placement.Layout(nodes, master, 0, interfaces)
        if others:
            if self.options.client:
                self._tunnel = Tunnel(self)
            else:
                self._listen(here)
            self.spawn(self._watch_nodes, "mpify_nb-ray-nodes")
        return self._layout

    def _node_addresses(self) -> dict[str, str]:
        return {n["NodeID"]: n["NodeManagerAddress"] for n in self.ray.nodes()}

    def _find_again(self, rank: int) -> None:
        """A rank started a second time (a Session's restart): its bundle may have moved, when
        Ray placed it anew after its node left. Wait until it is placed; update the layout."""
        from ray.util.placement_group import placement_group_table

        assert self._layout is not None
        deadline = time.monotonic() + _PLACEMENT_PATIENCE
        while True:
            table = placement_group_table(self._pg)
            node = table["bundles_to_node_id"].get(self._bundle_of[rank])
            alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
            if table.get("state") == "CREATED" and node in alive:
                break
            if time.monotonic() > deadline:
                free = _rounded(self.ray.available_resources())
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
            if not self.ray.is_initialized():
                return  # ray.shutdown() by the user: asking now would join a new cluster
            try:
                alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
            except Exception:
                continue
            with self.lock:
                handles = list(self.ranks.values())
            for handle in handles:
                if not handle.ended.is_set() and self._node_id_of.get(handle.rank) not in alive:
                    handle.node_left()

    def _check_feasible(self, count: int, bundle: dict[str, float]) -> None:
        """Fail at once, naming the numbers, when the cluster could never hold the ranks."""
        ray = self.ray
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
        self.spawn(accept_links, "mpify_nb-ray-accept", listener,
                   lambda token: hmac.compare_digest(token, self.token), self._greet)

    def spawn(self, target: Callable[..., Any], name: str, *args: Any) -> None:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()

    # -- start -----------------------------------------------------------------------------

    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> placement.RankProcess:
        assert self._layout is not None, "reserve() first"
        if rank in self.ranks:
            self._find_again(rank)
        handle = RayRank(self, rank, self._layout.nodes[rank], channel_fd, stdout_fd, stderr_fd)
        with self.lock:
            self.ranks[rank] = handle
        self.spawn(handle.bridge, f"mpify_nb-ray-rank{rank}")
        return handle

    def submit(self, handle: RayRank, setup: bytes | bytearray, call: bytes | bytearray, fds: list[int]) -> Any:
        """Start ``handle``'s rank on its bundle; its call's memfds go through the object store."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        objects = self._put(fds)
        # A rank on this machine maps the caller's memfds themselves (as on one machine): no
        # transfer, no copy. The object is there for a rank that cannot open them.
        lent = [(os.getpid(), fd, *identity(fd)) if LEND_MEMFDS else None for fd in fds]
        if self._tunnel is not None:
            host, port = self._tunnel.address
        else:
            assert self._listener is not None
            host, port = self._listener.getsockname()[:2]
        task = _remote_serve_rank().options(
            num_cpus=self.options.num_cpus, num_gpus=self.options.num_gpus,
            resources=self.options.resources or None, max_retries=0, runtime_env=WORKER_ENV,
            name=f"mpify_nb rank {handle.rank}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, self._bundle_of[handle.rank]))
        # In a list: Ray would fetch an ObjectRef passed as such before the task starts, and a
        # rank that maps the caller's memfds needs no copy on its node.
        return task.remote(host, port, self.token, handle.rank, bytes(setup), bytes(call), [objects], lent)

    def _put(self, fds: list[int]) -> Any:
        """One object holding the bytes of every memfd of the call (a list, one array each): put
        once per call, whichever rank asks first. One object keeps the pieces of a big tensor
        back to back in a node's store, where its ranks map them as one tensor."""
        if not fds:
            return None
        key = tuple(identity(fd) for fd in fds)
        with self.lock:
            ref = self._puts.get(key)
            if ref is None:
                ref = self.ray.put([read_memfd(fd) for fd in fds])
                self._puts[key] = ref
        return ref

    def _greet(self, sock: socket.socket, _token: bytes, rank: int, pid: int) -> None:
        """A rank's worker connected, with this call's token."""
        with self.lock:
            handle = self.ranks.get(rank)
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
        for handle in list(self.ranks.values()):
            handle.kill()
            handle.ended.wait(KILL_GRACE + 2.0)
        # Wait until each task has returned its worker to Ray's pool: a call that came before
        # that would find the worker busy, and Ray would start (and import torch in) a new one.
        tasks = [h._task for h in self.ranks.values() if h._task is not None]
        if tasks:
            self.ray.wait(tasks, num_returns=len(tasks), timeout=KILL_GRACE)
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


_serve_rank_remote: Any = None


def _remote_serve_rank() -> Any:
    """``serve_rank`` as a Ray remote function, made once: Ray exports a new one to the
    cluster on its first use, which every rank of every call would otherwise pay."""
    global _serve_rank_remote
    if _serve_rank_remote is None:
        _serve_rank_remote = import_ray().remote(serve_rank)
    return _serve_rank_remote


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
    ray = import_ray()
    deadline = since + 1.0
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0.0) >= free_before.get(k, 0.0) - 1e-6 for k in bundle):
            return
        time.sleep(0.005)


def _rounded(resources: dict) -> dict:
    return {k: round(v, 2) for k, v in resources.items() if not k.startswith("node:") and "memory" not in k}
