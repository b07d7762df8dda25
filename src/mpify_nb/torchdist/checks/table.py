"""Where the ranks of a group on one host publish their calls: a shared-memory table, mapped by each.

One table per process group whose ranks share a host (torchdist/checks/groups.py makes it, and
falls back to the group's store, store.py, where they do not). Its first rank makes it (a
memfd: no name in any file system, nothing left behind by a rank that is killed); the others
open it through ``/proc/<pid>/fd/<fd>`` while the group is being made, and it lives as long
as their mappings. Each rank writes only its own rings; everyone reads everyone's::

    header   magic, group size, a random token (the others check they opened this one);
             the bell (a futex word)
    attached one byte per rank: it mapped the table
    calls    rank i's ring of RING slots for its collectives, call k in slot k % RING
    p2p      per (writer, peer, direction): its sends to / recvs from that peer, a ring each

    slot     [stamp u64: k + 1, written last][length u32][crc32 u32][the bytes]

A rank waits for its peers' slots asleep on the bell: each write ends by adding one to it and
waking every sleeper in a single atomic futex call (FUTEX_WAKE_OP), so a sleeper that read the
bell before looking cannot miss a write made after its look. Collectives cannot lap their ring:
a rank publishes call k only once it has judged call k - 1 - AHEAD (deferred.py: async calls run
ahead of their check by at most AHEAD), so every peer has published k - 1 - AHEAD, and judged, so
read, every call up to k - 2 - 2 * AHEAD, and slot k % RING held one of those (RING >= 2 * AHEAD
+ 2). An isend may run ahead of its peer's irecv by more than a ring, and a reader then finds a
newer stamp: :data:`LAPPED`, that call goes unjudged.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import secrets
import stat
import struct
import time
import zlib
from typing import Any, Union

MAGIC = b"mpifychk"
RING = 8  # a collective ring's slots (see the docstring: at least 2 * deferred.AHEAD + 2)
_HEADER = 64
_TOKEN = 16  # offset of the 16-byte token
_BELL = 48  # offset of the futex word and the sleepers' count beside it (4-byte aligned)
_SLOT_HEAD = 16
_SLOT, _STAMP, _SIZE_CRC = struct.Struct("<QII"), struct.Struct("<Q"), struct.Struct("<II")  # a slot's head

#: A slot that holds a newer call than the one asked for: it was overwritten (its reader lagged).
LAPPED = object()

Ring = tuple  # ("c", rank) | ("p", writer, peer, direction)


def p2p_ring(size: int) -> int:
    return 16 if size <= 16 else 4


def call_slot(size: int) -> int:
    """Bytes of a collective's slot: room for an all_to_all's lists of ``size`` tensors."""
    return (512 + 96 * size + 63) // 64 * 64


P2P_SLOT = 512


class ShmTable:
    """A group's table, mapped; see the module's docstring."""

    def __init__(self, mm: mmap.mmap, size: int, fd: int = -1) -> None:
        self.mm = mm
        self.size = size
        self.fd = fd  # the creator's memfd, kept until every rank has opened it
        self.slot_c = call_slot(size)
        self.ring_p = p2p_ring(size)
        self.base_c = _HEADER + (size + 63) // 64 * 64
        self.base_p = self.base_c + size * RING * self.slot_c
        self.rings_c = [self.base_c + rank * RING * self.slot_c for rank in range(size)]  # each rank's ring
        self.bell = _Bell(mm, _BELL)

    @staticmethod
    def bytes_for(size: int) -> int:
        return _HEADER + (size + 63) // 64 * 64 + size * RING * call_slot(size) \
            + size * size * 2 * p2p_ring(size) * P2P_SLOT

    @classmethod
    def create(cls, size: int) -> ShmTable:
        """A new table for a group of ``size`` ranks."""
        fd = os.memfd_create("mpify_nb-check", os.MFD_CLOEXEC)
        try:
            length = cls.bytes_for(size)
            os.ftruncate(fd, length)
            mm = mmap.mmap(fd, length)
        except BaseException:
            os.close(fd)
            raise
        mm[:8] = MAGIC
        struct.pack_into("<I", mm, 8, size)
        mm[_TOKEN:_TOKEN + 16] = secrets.token_bytes(16)
        return cls(mm, size, fd)

    def address(self) -> str:
        """How another rank of this host opens it: "pid:fd:token"."""
        return f"{os.getpid()}:{self.fd}:{self.mm[_TOKEN:_TOKEN + 16].hex()}"

    @classmethod
    def attach(cls, address: str, size: int) -> ShmTable:
        """The table another rank of the group made (this user's, of this size, with its token)."""
        pid, fd_number, token = address.split(":")
        fd = os.open(f"/proc/{int(pid)}/fd/{int(fd_number)}", os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            length = cls.bytes_for(size)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink or st.st_size != length:
                raise OSError(f"pid {pid}'s fd {fd_number} is not this group's table")
            mm = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        if mm[:8] != MAGIC or struct.unpack_from("<I", mm, 8)[0] != size or mm[_TOKEN:_TOKEN + 16].hex() != token:
            mm.close()
            raise OSError(f"pid {pid}'s fd {fd_number} is not this group's table")
        return cls(mm, size)

    # -- slots ----------------------------------------------------------------------------------

    def _offset(self, ring: Ring, index: int, salt: int) -> int:
        if ring[0] == "c":
            return self.rings_c[ring[1]] + index % RING * self.slot_c
        _, writer, peer, direction = ring
        n = self.size
        slot = (index + (salt & 0xFFFF) * 7919) % self.ring_p  # each tag counts its own calls
        return self.base_p + (((writer * n + peer) * 2 + direction) * self.ring_p + slot) * P2P_SLOT

    def room(self, ring: Ring) -> int:
        """The most bytes a slot of ``ring`` holds."""
        return (self.slot_c if ring[0] == "c" else P2P_SLOT) - _SLOT_HEAD

    def put(self, ring: Ring, index: int, data: bytes, salt: int = 0) -> None:
        """Publish call ``index`` of ``ring`` (this rank's own; ``salt``: a p2p call's tag) and ring the bell."""
        at = self._offset(ring, index, salt)
        mm = self.mm
        _STAMP.pack_into(mm, at, 0)
        mm[at + _SLOT_HEAD:at + _SLOT_HEAD + len(data)] = data
        _SIZE_CRC.pack_into(mm, at + 8, len(data), zlib.crc32(data))
        _STAMP.pack_into(mm, at, index + 1)
        self.bell.ring()  # an atomic add: also orders the writes above before any later read

    def get(self, ring: Ring, index: int, salt: int = 0) -> Union[bytes, None, object]:
        """Call ``index`` of ``ring`` once published (None: not yet; LAPPED: overwritten; a p2p
        slot may hold another tag's call of the same index: the reader compares tags)."""
        at = self._offset(ring, index, salt)
        mm = self.mm
        stamp, length, crc = _SLOT.unpack_from(mm, at)
        if stamp != index + 1:
            return LAPPED if stamp > index + 1 else None
        data = mm[at + _SLOT_HEAD:at + _SLOT_HEAD + length]
        if zlib.crc32(data) != crc or _STAMP.unpack_from(mm, at)[0] != stamp:
            return None  # being written now: read again after the bell
        return data

    # -- waiting ---------------------------------------------------------------------------------

    def token(self) -> int:
        """The bell now: read before looking at slots, slept on after (nothing is missed)."""
        return self.bell.value()

    def sleep(self, token: int, wanted: list, timeout: float, first: bool = False) -> None:
        self.bell.wait(token, timeout, first)

    def wake(self) -> None:
        self.bell.ring()

    # -- its life ---------------------------------------------------------------------------------

    def mark_attached(self, rank: int) -> None:
        self.mm[_HEADER + rank] = 1

    def opened(self) -> None:
        """Every rank has mapped it: the creator's fd goes (the memory lives on in the mappings)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.opened()
        self.bell.release()
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass


_host: list[str] = []


def host_identity() -> str:
    """What ranks that can share a table have alike: this boot of this machine, the same pid
    namespace (``/proc/<pid>`` of a peer must be this one's) and the same user."""
    if not _host:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            pid_ns = os.stat("/proc/self/ns/pid").st_ino
            _host.append(f"{boot}/{pid_ns}/{os.getuid()}")
        except OSError:
            _host.append(f"unknown-{os.getpid()}-{secrets.token_hex(4)}")  # shares with no one
    return _host[0]


# -- the bell: a futex word ------------------------------------------------------------------------

_FUTEX_WAIT, _FUTEX_WAKE_OP = 0, 5
_ALL = 0x7FFFFFFF
_ADD_ONE = (1 << 28) | (1 << 12)  # FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0)
_SUB_ONE = (1 << 28) | (0xFFF << 12)  # FUTEX_OP(FUTEX_OP_ADD, -1, ...): oparg is 12 bits, signed
_SYSCALL_NUMBERS = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238, "riscv64": 98}
#: A first sleep this short: a writer that saw no sleeper just before this one registered (a
#: window of nanoseconds) wakes no one, and the sleeper looks again this soon.
FIRST_SLEEP = 0.001


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> Any:
    number = _SYSCALL_NUMBERS.get(platform.machine())
    if number is None or not hasattr(os, "sched_getaffinity"):  # Linux only
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int]
    return functools.partial(fn, number)


_futex = _syscall()


class _Bell:
    """A 32-bit counter in the table that sleepers wait on (a futex shared between processes), and
    beside it how many sleep: a write wakes them (a system call) only when some do; ranks in step
    see each other's writes while they yield, and never sleep."""

    def __init__(self, mm: mmap.mmap, offset: int) -> None:
        self.mm = mm
        self.offset = offset
        self._words: Any = (ctypes.c_int32 * 2).from_buffer(mm, offset) if _futex is not None else None
        self.address = ctypes.addressof(self._words) if self._words is not None else 0
        self.sleepers = self.address + 4
        self.first = True  # this wait has not slept yet

    def value(self) -> int:
        words = self._words
        return words[0] if words is not None else struct.unpack_from("<i", self.mm, self.offset)[0]

    def ring(self) -> None:
        words = self._words
        if words is None:  # no futex here (or the table closed: the mapping says so)
            mm, offset = self.mm, self.offset
            struct.pack_into("<i", mm, offset, (struct.unpack_from("<i", mm, offset)[0] + 1) & 0x7FFFFFFF)
        elif words[1] > 0:
            _futex(self.address, _FUTEX_WAKE_OP, _ALL, None, self.address, _ADD_ONE)
        else:  # no one sleeps: a plain add (two writers at once may make it one: it still moved)
            words[0] = (words[0] + 1) & 0x7FFFFFFF

    def wait(self, token: int, timeout: float, first: bool) -> None:
        """Sleep until the bell rings after ``token`` was read, or ``timeout`` (FIRST_SLEEP on a
        wait's first sleep; a signal ends it too)."""
        if _futex is None:
            time.sleep(min(timeout, 0.0005))
            return
        if first:
            timeout = min(timeout, FIRST_SLEEP)
        whole = int(timeout)
        ts = _Timespec(whole, int((timeout - whole) * 1e9))
        _futex(self.sleepers, _FUTEX_WAKE_OP, 0, None, self.sleepers, _ADD_ONE)
        try:
            _futex(self.address, _FUTEX_WAIT, token, ctypes.addressof(ts), None, 0)
        finally:
            _futex(self.sleepers, _FUTEX_WAKE_OP, 0, None, self.sleepers, _SUB_ONE)

    def release(self) -> None:
        self._words = None  # the mapping may close once no ctypes object points into it
