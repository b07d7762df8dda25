"""What a placer is: the seam's vocabulary (start/placement.py chooses the placer of a call).

A placer reserves the whole world of a call before anything starts and answers with a
``Layout`` (which node each rank lands on, hence ``LOCAL_RANK``, ``GROUP_RANK``,
``MASTER_ADDR``/``MASTER_PORT``); it then starts each rank and hands back a ``RankProcess``
(its pid, a way to kill it, a file descriptor that becomes readable when it dies, its exit
code); ``release`` gives back what it reserved once the call is over. The placers: this
machine's (start/local.py) and Ray's (start/ray_ranks/).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Optional, Protocol


@dataclass
class Layout:
    """Where each rank of one call runs, and what torch needs to know of it."""

    nodes: dict[int, str]  # rank -> address of its node
    master_addr: str
    master_port: int  # 0 on another host (Ray): the store's host binds one there and says which
    interfaces: dict[int, str] = field(default_factory=dict)  # rank -> NIC holding its node's address
    #: the call's store's port, bound here and not listening (torchdist/rendezvous.py), handed to
    #: the rank that hosts the store; None where that rank binds it (on a Ray node)
    store_socket: Optional[socket.socket] = None

    @classmethod
    def on_this_machine(cls, nprocs: int, reserve_store: bool = True) -> Layout:
        """Every rank on this machine (gloo/NCCL on loopback); with ``reserve_store``, the store's
        port is bound now and held until the rank that hosts the store takes the socket: no one
        can take it between (``free_port`` would close it before a rank binds it again)."""
        from ..torchdist import rendezvous

        sock = rendezvous.reserve("127.0.0.1") if reserve_store else None
        port = sock.getsockname()[1] if sock is not None else 0
        return cls({r: "127.0.0.1" for r in range(nprocs)}, "127.0.0.1", port,
                   {r: "lo" for r in range(nprocs)}, sock)

    def let_go_of_store(self) -> None:
        """Close this process's copy of the store's socket (its host holds its own, or no one needs it)."""
        if self.store_socket is not None:
            self.store_socket.close()
            self.store_socket = None

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
    def sigkill_cause(self) -> str: ...  # killed by SIGKILL: the OOM killer or a signal, when known
    def kill_leftovers(self) -> None: ...  # once it is gone: what it started and left behind
    def close(self) -> None: ...


class Placer(Protocol):
    #: Ranks start with the caller's os.environ (plus the world's variables): true on this
    #: machine; on another host a rank keeps its own environment (PATH, CUDA_VISIBLE_DEVICES...).
    ships_environ: bool

    def ready(self, timeout: Optional[float]) -> float:
        """Wait until ranks can be started (the template has started, and holds what they need);
        return the seconds that took: a one-time preparation, which no call's timeout counts."""
        ...

    def reserve(self, nprocs: int, caller_rank: Optional[int], timeout: Optional[float]) -> Layout:
        """Reserve room for every rank (all or none) and say where each lands."""
        ...

    def start(self, rank: int, channel_fd: int, stdout_fd: int, stderr_fd: int,
              timeout: Optional[float] = None) -> RankProcess:
        """Start ``rank``; raise TimeoutError if it cannot be started within ``timeout`` s."""
        ...

    def release(self) -> None:
        """The call is over: give back what ``reserve`` took."""
        ...
