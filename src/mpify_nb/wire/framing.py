"""Framed messages, with file descriptors, over a private AF_UNIX socketpair.

Every rank talks to its caller over its own socketpair, created by the caller
before the rank exists and handed to it at birth. Nothing listens anywhere, so
only the rank this call started can ever answer on that channel.

A message is a 12-byte header (payload length, number of fds) followed by the
payload bytes. File descriptors ride as SCM_RIGHTS on the header: that is how
big tensors move as shared memory (memfd) instead of bytes. One sendmsg carries
at most 253 of them (SCM_MAX_FD), so the rest follow in batches, each on a
one-byte marker sent between the header and the payload::

    header (length, nfds) + fds[0:253] | marker + fds[253:506] | ... | payload

Threads of one process may send on the same socket (a rank's thread that calls
``display()`` while its main thread answers a call): each message is written whole
under that socket's lock, never interleaved with another. A header read back is checked
before anything is allocated for it: a length beyond this machine's memory, or more fds
than a process may hold, means the channel is corrupt (ConnectionError).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import weakref
from collections.abc import Sequence
from typing import Callable, NoReturn, Optional

_HEADER = struct.Struct("!QI")
_MAX_FDS = 253  # SCM_MAX_FD on Linux: the most fds one sendmsg can carry
_MARKER = b"+"


def socketpair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


#: One lock per socket that something sent on: a message is written whole, never interleaved.
_send_locks: weakref.WeakKeyDictionary[socket.socket, threading.Lock] = weakref.WeakKeyDictionary()
_send_locks_lock = threading.Lock()


def _send_lock(sock: socket.socket) -> threading.Lock:
    with _send_locks_lock:
        lock = _send_locks.get(sock)
        if lock is None:
            lock = _send_locks[sock] = threading.Lock()
        return lock


def _forget_locks_after_fork() -> None:
    global _send_locks, _send_locks_lock  # a lock held by another thread at fork stays held for ever
    _send_locks = weakref.WeakKeyDictionary()
    _send_locks_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_locks_after_fork)


def send(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """Send one message, whole, after any other thread's message on ``sock``; raises OSError
    (BrokenPipeError...) if the peer is gone."""
    fds = list(fds)
    header = _HEADER.pack(len(data), len(fds))
    with _send_lock(sock):
        _send_with_fds(sock, header, fds[:_MAX_FDS])
        for start in range(_MAX_FDS, len(fds), _MAX_FDS):
            _send_with_fds(sock, _MARKER, fds[start:start + _MAX_FDS])
        if data:
            sock.sendall(data)


def _send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])  # the fds went with the first byte


def recv(sock: socket.socket) -> Optional[tuple[bytes | bytearray, list[int]]]:
    """Receive one message as (payload, fds); None when the peer closed before a new one."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, _MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    if not head:
        return None
    if len(head) < _HEADER.size:
        head += _recv_exact(sock, _HEADER.size - len(head))
    length, nfds = _HEADER.unpack(head)
    if length > _max_length() or nfds > _max_fds():
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"a corrupt message header on this channel: {length} bytes with {nfds} file "
                              "descriptors (more than this machine could hold)")
    try:
        while len(fds) < nfds and len(fds) % _MAX_FDS == 0:
            marker, more, _flags, _addr = socket.recv_fds(sock, 1, _MAX_FDS, socket.MSG_CMSG_CLOEXEC)
            if marker != _MARKER:
                raise ConnectionError("a message's file descriptors were cut short")
            fds.extend(more)
            if not more:
                break
        if len(fds) != nfds:
            raise ConnectionError(f"expected {nfds} file descriptors with the message, got {len(fds)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return _recv_exact(sock, length), fds


def recv_or(sock: socket.socket, gone: Callable[[], NoReturn]) -> tuple[bytes | bytearray, list[int]]:
    """The next message on ``sock``; ``gone()`` (which does not return) once its other end has
    closed or failed: a process whose caller went away ends itself."""
    try:
        message = recv(sock)
    except (OSError, EOFError):
        message = None
    if message is None:
        gone()
    return message


def _max_length() -> int:
    """No real message is bigger than this machine's memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 1 << 40


def _max_fds() -> int:
    """No real message carries more fds than a process may hold."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return hard if 0 < hard < 1 << 31 else 1 << 20


def _recv_exact(sock: socket.socket, n: int) -> bytes | bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError(f"connection closed with {n - got} of {n} bytes of a message still to come")
        got += k
    return bytes(buf) if n < 1 << 20 else buf  # big payloads: skip the copy, bytearray unpickles alike
