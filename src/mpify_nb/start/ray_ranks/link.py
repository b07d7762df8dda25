"""The link between the notebook and one rank's Ray worker: one TCP connection (through the
Ray Client hub when the notebook is outside the cluster) that carries the rank's channel,
control channel, stdout and stderr as frames. Nothing is unpickled before the token check."""

from __future__ import annotations

import fcntl
import mmap
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

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


#: A link's first bytes: the call's token (32), the rank and its pid (4 each).
HELLO = 32 + 8
#: A connection gets this long to send its hello (a rank's worker sends it at once).
HELLO_TIMEOUT = 10.0
#: Connections whose hello is not in yet, held at most: the oldest is dropped for a new one.
PENDING_MAX = 64


def accept_links(listener: socket.socket, admit: Callable[[bytes], bool],
                 on_link: Callable[[socket.socket, bytes, int, int], None]) -> None:
    """Each connection to ``listener`` whose hello's token ``admit`` accepts goes to
    ``on_link(sock, token, rank, pid)`` on a thread of its own, until the listener is closed.

    The listener is on the node's network address, where anyone may connect: hellos are read
    here, on this one thread, without blocking, and a connection costs a thread only once its
    token checked out. One that says nothing is dropped after HELLO_TIMEOUT, and at most
    PENDING_MAX wait at once (a new one drops the oldest: a real rank's hello comes at once,
    so idle connections, however many, cannot keep it out). Nothing is unpickled before the
    token is checked."""
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    pending: dict[socket.socket, tuple[bytearray, float]] = {}  # oldest first

    def drop(sock: socket.socket) -> None:
        pending.pop(sock, None)
        try:
            selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    try:
        while listener.fileno() >= 0:
            now = time.monotonic()
            for sock in [s for s, (_buf, until) in pending.items() if until <= now]:
                drop(sock)
            wait = min([until for _buf, until in pending.values()], default=now + 1.0) - now
            for key, _ in selector.select(min(max(wait, 0.0), 1.0)):  # a closed listener is seen within 1 s
                if key.data is None:
                    if not _accept(listener, selector, pending, drop):
                        return
                    continue
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    _take_hello(sock, pending, selector, admit, on_link)
                except Exception as e:  # one connection's trouble must not end the listener (every later rank's)
                    print(f"mpify_nb: a connection to the ranks' link listener was dropped: {type(e).__name__}: {e}",
                          file=sys.__stderr__, flush=True)
                    drop(sock)
    finally:
        for sock in list(pending):
            drop(sock)
        selector.close()


def _take_hello(sock: socket.socket, pending: dict[socket.socket, tuple[bytearray, float]],
                selector: selectors.BaseSelector, admit: Callable[[bytes], bool],
                on_link: Callable[[socket.socket, bytes, int, int], None]) -> None:
    """Read what ``sock`` sent of its hello; once it is whole, admitted or closed."""
    waiting = pending.get(sock)
    if waiting is None:
        return  # dropped in this same round, for a newer connection
    hello = _read_hello(sock, waiting[0])
    if hello is None:
        return  # not all of it yet
    pending.pop(sock)
    selector.unregister(sock)
    if not hello or not admit(bytes(hello[:32])):
        sock.close()
        return
    sock.setblocking(True)
    no_delay(sock)
    rank, pid = struct.unpack("!II", hello[32:])
    threading.Thread(target=on_link, args=(sock, bytes(hello[:32]), rank, pid),
                     name="mpify_nb-ray-link", daemon=True).start()


def _accept(listener: socket.socket, selector: selectors.BaseSelector,
            pending: dict[socket.socket, tuple[bytearray, float]], drop: Callable[[socket.socket], None]) -> bool:
    """A new connection, held until its hello is in; False once the listener is closed."""
    try:
        sock, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False  # closed: the call (or the hub) is over
    if len(pending) >= PENDING_MAX:
        drop(next(iter(pending)))
    sock.setblocking(False)
    pending[sock] = (bytearray(), time.monotonic() + HELLO_TIMEOUT)
    selector.register(sock, selectors.EVENT_READ, "hello")
    return True


def _read_hello(sock: socket.socket, got: bytearray) -> Optional[bytes]:
    """What ``sock`` sent of its hello so far, added to ``got``: the whole hello, b"" if it
    closed (or failed) before, None while more is to come."""
    try:
        data = sock.recv(HELLO - len(got))
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""
    if not data:
        return b""
    got += data
    return bytes(got) if len(got) == HELLO else None


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
