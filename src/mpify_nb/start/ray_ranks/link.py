"""The link between the notebook and one rank's Ray worker: one TCP connection (through the
Ray Client hub when the notebook is outside the cluster) that carries the rank's channel,
control channel, stdout and stderr as frames. Nothing is unpickled before the token check."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from ...wire import framing, payload, shm

# -- frames on the link ----------------------------------------------------------------------
# kind (1 byte), number of parts (4), each part's length (8 each), then the parts.
#   m: a channel message (data, then one part per memfd)  o/e: stdout/stderr bytes
#   c: a message on a Session rank's control channel      x: the rank's exit code, last

def send_frame(sock: socket.socket, kind: bytes, parts: Sequence[Any]) -> None:
    sizes = [memoryview(p).nbytes for p in parts]
    head = kind + struct.pack(f"!I{len(parts)}Q", len(parts), *sizes)
    if sum(sizes) <= _SMALL_FRAME:  # one segment: a request or an answer is one write
        sock.sendall(b"".join([head, *(memoryview(p).cast("B") for p in parts)]))
        return
    sock.sendall(head)
    for part in parts:
        if len(part):
            sock.sendall(part)


def accept_links(listener: socket.socket, on_link) -> None:
    """Each connection to ``listener`` to ``on_link(sock)``, on a thread of its own, until the
    listener is closed."""
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return  # closed: the call (or the hub) is over
        no_delay(sock)
        threading.Thread(target=on_link, args=(sock,), name="mpify_nb-ray-link", daemon=True).start()


def read_hello(sock: socket.socket) -> Optional[tuple[bytes, int, int]]:
    """The first bytes of a link: (the call's token, the rank, the rank's pid); None if the
    peer sends less within 10 s. Nothing is unpickled before the token is checked."""
    try:
        sock.settimeout(10.0)
        hello = framing._recv_exact(sock, 32 + 8)
        sock.settimeout(None)
    except (OSError, EOFError):
        return None
    rank, pid = struct.unpack("!II", hello[32:])
    return bytes(hello[:32]), rank, pid


#: Frames up to this size are sent in one write.
_SMALL_FRAME = 64 * 1024


def no_delay(sock: socket.socket) -> None:
    """Small frames go out at once: with Nagle's algorithm, a request written in two pieces
    waited for the peer's delayed ACK (40 ms per round trip, measured: 90 ms per call)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def send_message(link: socket.socket, data, fds: list[int]) -> None:
    """A channel message onto the link: its memfds travel as bytes (closed here)."""
    try:
        send_frame(link, b"m", [data, *(read_memfd(fd) for fd in fds)])
    finally:
        payload.close_fds(fds)


def deliver(channel: socket.socket, parts: list) -> None:
    """An ``m`` frame from the link onto a channel: its parts after the first become memfds again."""
    fds = [shm.memfd_of(memoryview(p).cast("B")) for p in parts[1:]]
    try:
        framing.send(channel, parts[0], fds)
    finally:
        payload.close_fds(fds)


def frames(sock: socket.socket) -> Iterator[tuple[bytes, list]]:
    """The frames arriving on ``sock``, until it is closed."""
    while True:
        frame = recv_frame(sock)
        if frame is None:
            return
        yield frame


def recv_frame(sock: socket.socket) -> Optional[tuple[bytes, list]]:
    head = sock.recv(5)
    if not head:
        return None
    if len(head) < 5:
        head += framing._recv_exact(sock, 5 - len(head))
    kind, count = head[:1], struct.unpack("!I", head[1:])[0]
    sizes = struct.unpack(f"!{count}Q", framing._recv_exact(sock, 8 * count)) if count else ()
    return kind, [framing._recv_exact(sock, n) if n else b"" for n in sizes]


def read_memfd(fd: int):
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


def write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def shut(sock: socket.socket) -> None:
    """End both directions now: a close() alone sends no FIN while another thread reads."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino): the same pair is the same file, whoever opened it."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


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
