"""Framed messages, with file descriptors, over a private AF_UNIX socketpair.

Every rank talks to its caller over its own socketpair, created by the caller
before the rank exists and handed to it at birth. Nothing listens anywhere, so
only the rank this call started can ever answer on that channel.

A message is a 12-byte header (payload length, number of fds) followed by the
payload bytes. File descriptors ride as SCM_RIGHTS on the header: that is how
big tensors move as shared memory (memfd) instead of bytes.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Optional

_HEADER = struct.Struct("!QI")
_MAX_FDS = 253  # SCM_MAX_FD on Linux


def socketpair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def send(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """Send one message; raises OSError (BrokenPipeError...) if the peer is gone."""
    if len(fds) > _MAX_FDS:
        raise ValueError(f"at most {_MAX_FDS} file descriptors fit in one message, not {len(fds)}")
    header = _HEADER.pack(len(data), len(fds))
    sent = socket.send_fds(sock, [header], list(fds)) if fds else sock.send(header)
    if sent < len(header):
        sock.sendall(header[sent:])
    if data:
        sock.sendall(data)


def recv(sock: socket.socket) -> Optional[tuple[bytes, list[int]]]:
    """Receive one message as (payload, fds); None when the peer closed before a new one."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, _MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    if not head:
        return None
    if len(head) < _HEADER.size:
        head += _recv_exact(sock, _HEADER.size - len(head))
    length, nfds = _HEADER.unpack(head)
    if len(fds) != nfds:
        raise ConnectionError(f"expected {nfds} file descriptors with the message, got {len(fds)}")
    return _recv_exact(sock, length), fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError(f"connection closed with {n - got} of {n} bytes of a message still to come")
        got += k
    return bytes(buf) if n < 1 << 20 else buf  # big payloads: skip the copy, bytearray unpickles alike
