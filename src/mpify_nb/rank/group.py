"""A Session rank's process group: start it, join a new one in place, cut and destroy it.

A rank blocked in a collective that a peer never joins is unstuck here: the caller's
ABORT_GROUP makes every rank shut down its TCP connections to the others
(:func:`cut_connections`) and destroy its groups (:func:`destroy_group`); a later GROUP
request joins a fresh group on a new port, in place, the rank's Python state kept.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from typing import Optional

from ..torchdist import compat, groups, rendezvous, waits
from ..wire.protocol import STORE
from . import checks, control

#: Seconds a rank waits in the rendezvous for its peers (a peer that died meanwhile).
_RENDEZVOUS_TIMEOUT = 60.0

_group: dict = {}


def start(namespace: dict, rank: int, session: dict, listen_fd: Optional[int]) -> dict:
    import torch

    device = torch.device("cpu")
    gpu = session.get("gpu")
    if gpu == "auto":  # one GPU per rank when every rank can have one; else all on CPU (one backend)
        world = session["world_size"]
        gpu = rank if torch.cuda.is_available() and torch.cuda.device_count() >= world else None
    if gpu is not None:
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    import torch.distributed as dist

    checks.starting()  # a spawned rank imported torch.distributed just now
    namespace.update(rank=rank, world_size=session["world_size"], device=device, dist=dist, torch=torch)
    backend = session.get("backend") or ("nccl" if gpu is not None else "gloo")
    _group.update(rank=rank, world_size=session["world_size"], backend=backend, ddp=session["ddp"])
    init_group(session["rendezvous"], listen_fd)
    return {"pid": os.getpid(), "device": str(device), "backend": backend}


def init_group(where: tuple[str, int, bool], listen_fd: Optional[int]) -> None:
    """Join a new default process group at ``where`` (address, port, whether this rank hosts
    the store), the Session's store; without ddp, only learn where that store is. On one
    machine the store's rank got its socket from the caller (listening with ddp; without, bound
    only: it listens at a cell's first ``init_process_group``); on a Ray node (port 0) it binds
    one on its node's address and tells the caller (STORE), which then tells the others. A
    cell's own ``init_process_group`` meets the others there too (its keys apart:
    torchdist/rendezvous.py), so the store outlives the group a cell destroys."""
    import torch.distributed as dist
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    addr, port, hosts_store = where
    rank, world = _group["rank"], _group["world_size"]
    if hosts_store and listen_fd is None:
        bound = rendezvous.bind_session_store(addr, world, _group["ddp"])
        port, listen_fd = bound.getsockname()[1], bound.detach()
        control.to_caller(STORE, pickle.dumps(port))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    value = rendezvous.spec(addr, port, world, "session")
    if not _group["ddp"]:
        sock = socket.socket(fileno=listen_fd) if listen_fd is not None and hosts_store else None
        rendezvous.point_at(value, hosts_store, host_socket=sock)
        return
    timeout = datetime.timedelta(seconds=_RENDEZVOUS_TIMEOUT)
    if hosts_store:
        store = TCPStore(addr, port, world, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listen_fd, **compat.listen_fd_store_options())
    else:
        store = TCPStore(addr, port, world, is_master=False, timeout=timeout)
    rendezvous.point_at(value, hosts_store, store=store if hosts_store else None)
    waits.enable_recorder()  # the caller's watch reads what the group records (torchdist/waits.py)
    if not dist.is_initialized():
        groups.set_group_count(0)  # a cell's failed rendezvous counted one: the peers' keys would differ
    with compat.quiet_gloo_banner():
        dist.init_process_group(backend=_group["backend"], rank=rank, world_size=world, store=store)
    _group["pg"] = dist.group.WORLD  # the Session's own: a cell's init_process_group replaces it


def cut_connections(peers: list[tuple[int, str]]) -> None:
    """Shut down this rank's TCP connections to its peer ranks (gloo's pairs, the stores').

    Destroying a group is not enough to unstick a collective: its connections close only
    when the last reference to it goes, and the user's namespace may hold one (a subgroup
    ``g``, a DistributedDataParallel wrapper). A shut-down connection makes gloo raise at
    once, in this rank ("Read error") and in the peer ("Connection closed by peer"), even
    when both are blocked. ``peers`` are (pid, node address): a peer on this machine is
    known by its sockets (only connections to a peer's sockets are cut, the user's own are
    left alone); a peer on another host (under Ray) by its node's address."""
    here = [pid for pid, node in peers if _on_this_machine(node)]
    elsewhere = {_proc_address(node) for _pid, node in peers if not _on_this_machine(node)}
    mine = _socket_inodes("self")
    theirs: set[str] = set()
    readable = False
    for pid in here:
        found = _socket_inodes(str(pid))
        readable = readable or found is not None
        theirs |= set(found or ())
    table = _tcp_table()
    peer_ends = {table[inode][0] for inode in theirs if inode in table}
    if here and not readable:
        # The peers' fds are hidden from us (hidepid, a hardened /proc): every loopback
        # connection then counts as one to a peer on this machine.
        peer_ends |= {ends[1] for ends in table.values() if _is_loopback(ends[1])}
    peer_ends |= {ends[1] for ends in table.values() if ends[1].split(":")[0] in elsewhere}
    # The store this rank hosts itself is no peer's: its own client of it (a rendezvous of a cell
    # waiting for a peer that never came) is cut as well.
    store = rendezvous.store_endpoint()
    if store is not None:
        peer_ends |= _proc_endpoints(*store)
    # The store's connections go too: a cell's init_process_group blocked in the store (a peer
    # that never came) raises at once. (torch prints a C++ stack for each: the caller quiets them.)
    for inode, fd in (mine or {}).items():
        ends = table.get(inode)
        if ends is None or ends[1] not in peer_ends:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)  # the fd stays gloo's; only the connection ends
        except OSError:
            pass
        finally:
            sock.close()


def _on_this_machine(address: str) -> bool:
    """Is ``address`` one of this host's (a Ray node on 127.0.0.3 of this machine is)?"""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def _proc_endpoints(address: str, port: int) -> set[str]:
    """An IPv4 endpoint as /proc/net/tcp writes it (``0100007F:1F90``), and as tcp6 writes it
    mapped (``0000000000000000FFFF00000100007F:1F90``: torch's store client connects so)."""
    v4 = _proc_address(address)
    return {f"{v4}:{port:04X}", f"0000000000000000FFFF0000{v4}:{port:04X}"}


def _proc_address(address: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (hex, little-endian)."""
    try:
        return socket.inet_aton(address)[::-1].hex().upper()
    except OSError:
        return address


def _is_loopback(endpoint: str) -> bool:
    """Is this /proc/net/tcp endpoint (hex address:port) on 127.0.0.0/8 or ::1?"""
    address = endpoint.split(":")[0]
    if len(address) == 8:
        return address.endswith("7F")  # little-endian IPv4: 127.x.y.z
    return address in ("00000000000000000000000001000000",) or (
        address.startswith("0000000000000000FFFF0000") and address.endswith("7F"))


def _socket_inodes(pid: str) -> Optional[dict[str, int]]:
    """{socket inode: fd} of a process; None when its fds cannot be read."""
    found: dict[str, int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[target[8:-1]] = int(fd)
    return found


def _tcp_table() -> dict[str, tuple[str, str]]:
    """{inode: (local endpoint, remote endpoint)} of every TCP socket of this network namespace."""
    table: dict[str, tuple[str, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9:
                        table[fields[9]] = (fields[1], fields[2])
        except OSError:
            continue
    return table


def abort_nccl() -> None:
    """Abort this process's NCCL communicators (a collective waiting on them returns with an
    error); nothing without an NCCL group."""
    try:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_backend() == "nccl":
            from torch.distributed import distributed_c10d

            distributed_c10d._abort_process_group()
    except Exception:
        pass


def destroy_group(abort: bool = False) -> None:
    """Tear down every process group of this rank (the user's subgroups too). ``abort``: to
    unstick a collective; NCCL needs its communicators aborted (its traffic is not ours to
    cut), gloo's are unstuck by :func:`cut_connections`."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if abort and _group.get("backend") == "nccl":
            compat.abort_process_group()
        else:
            compat.destroy_process_group()  # torch < 2.8's gloo could deadlock in destroy_process_group
    except Exception:
        pass  # a group torn down by its peers may fail to say goodbye; it is gone either way
    checks.sweep()  # the collective check's tables of the groups gone

