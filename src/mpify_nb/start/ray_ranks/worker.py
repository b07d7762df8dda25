"""The worker's side: a Ray task that forks the rank on its node and relays it to the caller."""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
from typing import Any, Optional

from ...wire import framing, modules, payload, shm
from ...wire.protocol import CALL, unpack
from .link import deliver, frames, identity, interface_of, no_delay, send_frame, send_message

#: Our package imported in a Ray worker must not start a template of its own.
WORKER_ENV = {"env_vars": {"MPIFY_NB_CHILD": "1", "MPIFY_NB_PREWARM": "0"}}


def serve_rank(caller: str, port: int, token: bytes, rank: int, setup: bytes, call: bytes, objects: list,
               lent: list) -> int:
    """A Ray task: run rank ``rank`` in a process forked here, relaying it to the caller over one
    TCP link, until it exits or the caller drops the link. Returns the rank's exit code."""
    import ray

    try:
        import torch  # noqa: F401  (the rank is forked from here: this worker keeps torch for the next call)
    except ImportError:
        pass
    _import_ahead(call)
    link = socket.create_connection((caller, port), timeout=30)
    link.settimeout(None)
    no_delay(link)
    # ``held``: the object store's copy of the call's memfds, which the rank may map; held (so
    # pinned in the store) until this task returns, after the rank has exited.
    fds, windows, held = _call_memfds(objects[0], lent)
    config = pickle.loads(setup)
    _adapt(config, ray.util.get_node_ip_address())
    if windows:
        config["windows"] = windows
    ours, theirs = framing.socketpair()
    control, control_theirs = framing.socketpair() if config.get("session") else (None, None)
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
            from ...rank import loop as rank_module

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
                framing.send(ours, pickle.dumps(config), [control_theirs.fileno()])
            else:
                framing.send(ours, pickle.dumps(config))
                framing.send(ours, call, fds)
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


def _call_memfds(objects: Any, lent: list) -> tuple[list[int], dict[int, tuple[int, int]], Any]:
    """The call's memfds, here, as the rank will map them, with the windows among them and
    what must stay alive while the rank runs. A memfd is the caller's own when this is its
    machine (opened through /proc, checked to be the same file: a pid in another pid namespace
    is another process). Else the rank maps the object Ray brought to this node where it lies
    in the object store's shared-memory file, copy-on-write: fds[i] is that file and
    ``windows[i]`` the (offset, length) of memfd i in it. Only where the store's file cannot be
    opened (see ``StoreFiles``) does the rank get a copy."""
    import ray

    fds: list[Optional[int]] = [_open_lent(*handle) if handle else None for handle in lent]
    windows: dict[int, tuple[int, int]] = {}
    held = None
    files = StoreFiles()
    try:
        missing = [i for i, fd in enumerate(fds) if fd is None]
        if missing:  # one get: the node fetches the call's object once, for all its ranks
            held = ray.get(objects)
            for i in missing:
                window = files.window(held[i])
                if window is not None:
                    fds[i], windows[i] = window[0], window[1:]
                else:
                    fds[i] = shm.memfd_of(memoryview(held[i]).cast("B"))
    except BaseException:
        payload.close_fds([fd for fd in fds if fd is not None])
        raise
    finally:
        files.close()
    return [fd for fd in fds if fd is not None], windows, held


class StoreFiles:
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
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) != key:
                    continue  # most of the raylet's fds: not worth an open
                self._opened[key] = _open_same(path, key)
                if self._opened[key] is not None:
                    break
        return self._opened[key]

    def close(self) -> None:
        payload.close_fds([fd for fd in self._opened.values() if fd is not None])
        self._opened.clear()


def _open_lent(pid: int, number: int, dev: int, ino: int) -> Optional[int]:
    return _open_same(f"/proc/{pid}/fd/{number}", (dev, ino))


def _open_same(path: str, key: tuple[int, int]) -> Optional[int]:
    """``path`` opened read-only if it is the file ``key`` names (st_dev, st_ino), else None:
    a /proc path may name another process's file by now, or none (another host, another user,
    a hardened /proc)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    if identity(fd) == key:
        return fd
    os.close(fd)
    return None


def _import_ahead(call: bytes) -> None:
    """Import here the installed modules the call's rank will import first (wire/modules.py): the rank
    is forked from this worker, which Ray reuses, so later calls' ranks hold them already (as a
    template's do). Not the notebook's own modules: a rank must import their current version."""
    try:
        import importlib.util

        kind, _req, body = unpack(call)
        if kind != CALL or not len(body):
            return
        roots = modules.Roots(None)
        for name in pickle.loads(body):  # parents before their submodules (import order)
            parent = name.rpartition(".")[0]
            if name in sys.modules or (parent and parent not in sys.modules):
                continue  # (find_spec would import a parent that is not installed)
            spec = importlib.util.find_spec(name)
            if spec is not None and roots.installed(spec.origin):
                modules.import_all([name])
    except Exception:
        pass  # only a speed-up is lost: the rank imports them itself


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
                os.killpg(self.pid, signal.SIGKILL)  # it leads its own group (rank.loop.main) ...
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
        for kind, parts in frames(link):
            if kind == b"c" and control is not None:
                framing.send(control, parts[0])
            else:
                deliver(channel, parts)
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
                    message = framing.recv(control)
                except OSError:
                    message = None  # it died with an interrupt of ours unread
                if message is None:
                    control = None
                else:
                    send_frame(link, b"c", [message[0]])
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
        send_frame(link, b"x", [struct.pack("!i", code)])
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
        message = framing.recv(channel)
    except OSError:
        return False  # ECONNRESET: it died with a request of ours unread; its exit code follows
    if message is None:
        return False
    send_message(link, *message)
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
        send_frame(link, kind, [chunk])
