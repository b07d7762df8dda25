"""Shared memory for big tensors and arrays: memfds written once (in parallel), mapped copy-on-write.

wire/payload.py decides what goes to shared memory; here its bytes are copied into memfds and
mapped back, whole or as pieces back to back, without keeping a descriptor open per mapping.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from typing import Any, Optional

#: A shared tensor at least this big is copied by several threads at once, into one memfd
#: per thread (writes into one memfd take its inode lock, so they would not overlap); the
#: ranks map the pieces back to back, as one tensor.
PARALLEL_COPY_MIN_BYTES = 16 << 20
#: At most this many threads (and memfds) for one tensor; 1 turns parallel copies off.
COPY_THREADS = 4
#: Pieces are multiples of this (a page multiple everywhere, a huge page on x86).
_PIECE_ALIGN = 2 << 20


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def address_view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def memfd_of(view: memoryview) -> int:
    """Copy ``view`` into a new memfd: the one copy a shared tensor or array costs.

    write(2) rather than a copy into a mapping: the kernel allocates each shmem page
    and fills it in one pass, where a mapping would take a page fault per 4 KiB
    (about 1.4x slower here)."""
    try:
        return _write_memfd(view)
    finally:
        view.release()


def _write_memfd(view: memoryview) -> int:
    fd = os.memfd_create("mpify_nb-tensor", os.MFD_CLOEXEC)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    except BaseException:
        os.close(fd)
        raise
    return fd


def copy_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(COPY_THREADS, cpus))


def memfds_of(view: memoryview, max_pieces: int = COPY_THREADS) -> list[int]:
    """Copy ``view`` into one memfd, or, when it is big and cores are free, into a few
    memfds written by as many threads at once (for 64 MiB on 2 cores: ~30 ms instead of
    ~40 ms; most of the time is the kernel allocating the shmem pages, which one memfd
    does under its inode lock). Every piece but the last is a multiple of ``_PIECE_ALIGN``."""
    n = len(view)
    pieces = min(copy_threads(), max_pieces, n // (PARALLEL_COPY_MIN_BYTES // 2)) \
        if n >= PARALLEL_COPY_MIN_BYTES else 1
    if pieces <= 1:
        return [memfd_of(view)]
    step = -(-n // pieces // _PIECE_ALIGN) * _PIECE_ALIGN
    bounds = [(start, min(start + step, n)) for start in range(0, n, step)]
    fds: list[Optional[int]] = [None] * len(bounds)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            start, end = bounds[i]
            fds[i] = _write_memfd(view[start:end])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,), name="mpify_nb-copy", daemon=True)
               for i in range(1, len(bounds))]
    try:
        for th in threads:
            th.start()
        write(0)
    finally:
        interrupted = None
        for th in threads:
            while th.is_alive():  # they read the caller's buffer: never leave before they are done
                try:
                    th.join()
                except KeyboardInterrupt as e:
                    interrupted = e
        view.release()
        done = [fd for fd in fds if fd is not None]
        if errors or interrupted is not None or len(done) < len(bounds):
            close_fds(done)
    if interrupted is not None:
        raise interrupted
    if errors:
        raise errors[0]
    return done


def loaded(name: str) -> Any:
    """Module ``name`` if this process has imported it (None if not), whole: while another thread
    is still importing it (background work's first ``import torch``), wait for that import to end
    rather than use a module half made."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
        import importlib

        module = importlib.import_module(name)  # waits on the module's import lock
    return module


def map_memfd(fd: int, private: bool):
    """Map a whole memfd as a flat uint8 tensor (numpy array when torch is not loaded here)."""
    size = os.fstat(fd).st_size
    torch = loaded("torch")
    if torch is not None:
        # torch maps the file itself and keeps no descriptor open (Python's mmap would keep
        # one per mapping for its whole life). shared=False is MAP_PRIVATE.
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(f"/proc/self/fd/{fd}", shared=not private, size=size, dtype=torch.uint8)
    import mmap

    import numpy

    if size == 0:
        return numpy.empty(0, dtype=numpy.uint8)
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    return numpy.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=numpy.uint8)


_PROT_NONE, _MAP_FIXED = 0, 0x10


def _libc_mmap():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_libc: Any = None


def _munmap(address: int, size: int) -> None:
    _libc.munmap(address, size)


def _libc_loaded():
    global _libc
    if _libc is None:
        _libc = _libc_mmap()
    return _libc


def map_pieces(fds: list[int], private: bool):
    """Map memfds back to back, as one flat uint8 tensor (numpy array without torch) that
    unmaps them all when it goes. Like ``map_memfd``, keeps no descriptor open."""
    import mmap

    libc = _libc_loaded()
    sizes = [os.fstat(fd).st_size for fd in fds]
    total = sum(sizes)
    failed = ctypes.c_void_p(-1).value
    # Reserve the whole range, then map each piece over its part of it.
    base = libc.mmap(None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, failed):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot reserve {total} bytes for a shared tensor: {os.strerror(err)}")
    flags = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED) | _MAP_FIXED
    offset = 0
    try:
        for fd, size in zip(fds, sizes):
            if size % mmap.PAGESIZE and offset + size != total:
                raise ValueError("a piece of a shared tensor is not a whole number of pages")
            got = libc.mmap(base + offset, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
            if got != base + offset:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot map a piece of a shared tensor: {os.strerror(err)}")
            offset += size
    except BaseException:
        libc.munmap(base, total)
        raise
    return _flat_view(base, total, base, total)


def map_windows(windows: list[tuple[int, int, int]], private: bool):
    """Map windows (fd, offset, length) of a file as one flat uint8 tensor (numpy array without
    torch), like ``map_pieces``: the pieces of one tensor lying back to back in a bigger file
    (Ray's object store, see start/ray_ranks/worker.py: StoreFiles). Windows that are not back to back in one
    file are copied into one buffer instead."""
    import mmap

    fd, start, _ = windows[0]
    total = sum(length for _, _, length in windows)
    if total == 0:
        return _flat_view(0, 0, 0, 0)
    here = os.fstat(fd)
    for (_, start_a, length_a), (fd_b, start_b, _) in zip(windows, windows[1:]):
        other = os.fstat(fd_b)
        if start_b != start_a + length_a or (other.st_dev, other.st_ino) != (here.st_dev, here.st_ino):
            return _copied([map_windows([window], private) for window in windows])
    libc = _libc_loaded()
    aligned = start - start % mmap.PAGESIZE
    length = start - aligned + total
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if private else 0)  # the file is open read-only
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    base = libc.mmap(None, length, prot, flags, fd, aligned)
    if base in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {total} bytes of a shared tensor: {os.strerror(err)}")
    return _flat_view(base + start - aligned, total, base, length)


def _copied(parts: list):
    torch = loaded("torch")
    if torch is not None:
        return torch.cat(parts)
    import numpy

    return numpy.concatenate(parts)


def _flat_view(address: int, nbytes: int, base: int, length: int):
    """``nbytes`` at ``address`` as a flat uint8 tensor (numpy array without torch) that unmaps
    ``length`` bytes at ``base`` when the last tensor or array on it goes."""
    torch = loaded("torch")
    if nbytes == 0:
        if torch is not None:
            return torch.empty(0, dtype=torch.uint8)
        import numpy

        return numpy.empty(0, dtype=numpy.uint8)
    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    unmap = weakref.finalize(buffer, _munmap, base, length)
    unmap.atexit = False  # at exit something may still read it
    if torch is not None:
        return torch.frombuffer(buffer, dtype=torch.uint8)  # holds ``buffer`` while it lives
    import numpy

    return numpy.frombuffer(memoryview(buffer), dtype=numpy.uint8)


# -- what keeps a result's memory alive ----------------------------------------------------

#: How many memfds this process has mapped shared (results: the caller's side).
_shared_maps = 0


def mapped_shared() -> None:
    """A memfd was mapped shared: a result's memory is this process's now (payload's unpickler)."""
    global _shared_maps
    _shared_maps += 1


def garbage_mark() -> tuple[int, int]:
    """Where a call starts, for ``drop_import_garbage`` at its end."""
    return len(sys.modules), _shared_maps


def drop_import_garbage(mark: tuple[int, int]) -> None:
    """At the end of a call, its results in hand: when it imported modules (the first call, a
    result of a new type, the caller's own rank) and its results came in shared memory, collect
    the cyclic garbage now. Imports often leave some that holds a frame (a frame kept in a local
    of itself, a caught exception's traceback), and a frame holds its callers: this call's frames,
    whose locals hold the results, and so their shared memory, until the cyclic collector runs
    (2 GB kept through six more cells; never, with it off). A full collection costs 0.2-0.4 s
    with torch loaded: paid only then."""
    if len(sys.modules) != mark[0] and _shared_maps != mark[1]:
        import gc

        gc.collect()
