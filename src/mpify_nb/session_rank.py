"""A persistent rank: the serve loop of a rank that lives across calls (see session.py).

A rank of a :class:`~mpify_nb.Session` is born like a ``ranch`` rank (forked from the
template, channel and stdout/stderr pipes made by the caller before it exists, see
rank.py), but its setup message says ``session`` and carries the end of a second
socketpair. It then never exits on its own::

    caller (Session)                                  rank k
    ----------------                                  ------
    work channel ── RUN/APPLY/PUSH/PULL/MISSING/GROUP ─> main thread: one request at a time,
                 <── DONE / FAIL / DISPLAY ────────────   in its persistent __main__ namespace
    control      ── INTERRUPT req / ABORT_GROUP ──────> control thread: SIGINT to the main
    channel      <── ABORTED ──────────────────────────  thread (only while it runs req);
                                                          cut the connections to the peers and
                                                          destroy the group (unsticks them);
                 ── WATCH req ─────────────────────────> read torch's recorder too, while req runs
                 <── COLLECTIVE (req, waits) ──────────  what the main thread waits on (waits.py)
                 ── PEEK req / <── ISSUED ─────────────  this rank's count of each group's collectives
                  (control channel closes) ───────────> the caller is gone: kill self

The main thread starts the process group (a TCPStore whose listening socket the caller
made and passed to the store's rank; under Ray, where the caller is on another node, the
store's rank binds it on its own node's address) and reports READY only once the group is
up, so the caller's first request can never be lost. SIGINT raises KeyboardInterrupt only inside the
user's code: an interrupt that lands between requests is ignored, and the rank, with its
state, lives on.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import datetime
import linecache
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, NoReturn, Optional

from . import groups, payload, process, rank_comms, rank_display, rank_stdin, waits, wire
from .errors import PayloadError, RemoteFailure, safe_str

# -- the protocol (both directions: a kind byte, a request id, a body) ----------------------

RUN, APPLY, PUSH, PULL, MISSING, GROUP = b"r", b"a", b"p", b"l", b"m", b"g"  # work channel, to the rank
INTERRUPT, ABORT_GROUP, WATCH, PEEK, ANSWER = b"i", b"x", b"w", b"k", b"n"  # control channel, to the rank
READY, DONE, FAIL, DISPLAY, ASK = b"R", b"D", b"F", b"P", b"Q"  # work channel, from the rank (ASK: control too)
COLLECTIVE, ABORTED, ISSUED = b"C", b"A", b"I"  # control channel, from the rank
COMM, COMM_OUT, COMM_ACK = b"c", b"W", b"o"  # widgets (rank_comms.py): a frontend's comm message to the rank
# (work), the rank's to the frontend (work), the caller passed on a frame marked "sync" (control)

_ID = struct.Struct("!Q")
NO_REQUEST = 0


def pack(kind: bytes, req_id: int, body: bytes = b"") -> bytes:
    return kind + _ID.pack(req_id) + body


def unpack(data) -> tuple[bytes, int, Any]:
    """(kind, request id, body as a memoryview: no copy of a big payload)."""
    view = memoryview(data)
    return bytes(view[:1]), _ID.unpack(view[1:9])[0], view[9:]


#: Seconds a rank waits in the rendezvous for its peers (a peer that died meanwhile).
_RENDEZVOUS_TIMEOUT = 60.0
#: How often the control thread looks at what the main thread is doing while it runs a request.
_WATCH_PERIOD = 0.05


class _State:
    """What the main thread is doing, shared with the control thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.request = NO_REQUEST  # the request the main thread runs now
        self.in_user_code = False  # SIGINT raises KeyboardInterrupt only then
        self.deferring = False  # the user's code sends a message: an interrupt waits for its end
        self.deferred = False  # an interrupt came meanwhile
        self.main_ident = threading.get_ident()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)


def serve(channel: socket.socket, config: dict, fds: list[int]) -> NoReturn:
    """Serve requests on ``channel`` until the caller goes away; never returns."""
    control = socket.socket(fileno=fds[0])
    listen_fd = fds[1] if len(fds) > 1 else None
    session = config["session"]
    state = _State()
    namespace = sys.modules["__main__"].__dict__
    signal.signal(signal.SIGINT, lambda signum, frame: _on_sigint(state))
    threading.Thread(target=_control_loop, args=(control, state), name="mpify_nb-control", daemon=True).start()
    ready: dict = {}
    rank_display.install(lambda bundle: _send_display(channel, state, bundle))
    rank_stdin.install(lambda token: _send(channel, pack(ASK, state.request, pickle.dumps(token))))
    rank_stdin.install_breakpointhook()
    namespace["display"] = rank_display.display
    if session.get("comms"):  # widgets: comms to the caller's kernel, from any thread (rank_comms.py)
        rank_comms.install(lambda frame: _send_display(channel, state, frame, COMM_OUT))
    try:
        ready = _start(namespace, config["rank"], session, listen_fd)
        reply = pack(READY, NO_REQUEST, pickle.dumps(ready))
    except BaseException as e:
        reply = pack(FAIL, NO_REQUEST, pickle.dumps((_capture(e), False, {})))
    _send(channel, reply)
    if not ready:
        process.end(1)
    while True:
        message = wire.recv(channel)
        if message is None:
            process.end(0)  # the caller closed the session
        data, message_fds = message
        kind, req_id, body = unpack(data)
        with state.lock:
            state.request = req_id
        os.write(state.wake_w, b"w")  # the control thread starts watching the stack
        reply, reply_fds = _handle(kind, req_id, body, message_fds, namespace, state, channel)
        with state.lock:
            state.request = NO_REQUEST
        process.flush_stdio()  # what the request printed reaches the caller before its answer
        _flush_c_stdio()
        _send(channel, reply, reply_fds)
        payload.close_fds(reply_fds)
        _replaced.clear()


_libc: Any = None


def _flush_c_stdio() -> None:
    """C extensions print through C's stdio, which buffers a pipe fully: flush it, or their
    output would surface in some later cell."""
    global _libc
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None)
        _libc.fflush(None)
    except (OSError, AttributeError):
        pass


def _send(channel: socket.socket, data: bytes, fds=()) -> None:
    try:
        wire.send(channel, data, fds)  # whole, whichever thread sends (a display, an ASK for input)
    except OSError:
        pass  # the caller is gone; the control thread ends us


def _on_sigint(state: _State) -> None:
    if state.in_user_code:
        raise KeyboardInterrupt
    if state.deferring:
        state.deferred = True


def _send_display(channel: socket.socket, state: _State, bundle: dict, kind: bytes = DISPLAY) -> None:
    """``display()`` in the user's code, from any thread: one DISPLAY message (or a widget's
    COMM_OUT), sent whole (wire.send serializes the threads). On the main thread an interrupt
    would cut it in half, leaving the caller a corrupt channel: it is raised once the message is out."""
    data = pack(kind, state.request, pickle.dumps(bundle))
    if threading.get_ident() != state.main_ident or not state.in_user_code:
        _send(channel, data)
        return
    state.in_user_code, state.deferring, state.deferred = False, True, False
    try:
        _send(channel, data)
    finally:
        state.in_user_code, state.deferring = True, False
    if state.deferred:
        state.deferred = False
        raise KeyboardInterrupt


# -- starting: namespace and process group ---------------------------------------------

#: Values a push replaced, kept until its answer is sent.
_replaced: list = []

#: This rank's group settings, fixed at start (a rebuild only changes the port).
_group: dict = {}


def _start(namespace: dict, rank: int, session: dict, listen_fd: Optional[int]) -> dict:
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

    namespace.update(rank=rank, world_size=session["world_size"], device=device, dist=dist, torch=torch)
    backend = session.get("backend") or ("nccl" if gpu is not None else "gloo")
    _group.update(rank=rank, world_size=session["world_size"], backend=backend)
    if session["ddp"]:
        _init_group(session["rendezvous"], listen_fd)
    return {"pid": os.getpid(), "device": str(device), "backend": backend}


def _init_group(rendezvous: tuple[str, int, bool], listen_fd: Optional[int]) -> None:
    """Join a new default process group at ``rendezvous`` (address, port, whether this rank
    hosts the store). On one machine the store's rank got the listening socket from the
    caller; on a Ray node it binds one on its node's address. Either way it listens before
    it tells anyone the port, so no rank has to retry."""
    import torch.distributed as dist
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    addr, port, hosts_store = rendezvous
    rank, world = _group["rank"], _group["world_size"]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    timeout = datetime.timedelta(seconds=_RENDEZVOUS_TIMEOUT)
    if hosts_store:
        if listen_fd is None:
            listen_fd = groups.listen_on(addr, port, world * 2).detach()
        store = TCPStore(addr, port, world, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listen_fd)
    else:
        store = TCPStore(addr, port, world, is_master=False, timeout=timeout)
    waits.enable_recorder()  # the collective watch reads what the group records (waits.py)
    dist.init_process_group(backend=_group["backend"], rank=rank, world_size=world, store=store)


def _cut_connections(peers: list[tuple[int, str]]) -> None:
    """Shut down this rank's TCP connections to its peer ranks (gloo's pairs, the store's).

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
    # The store's connections stay: cut, torch prints a C++ stack for each; the group's
    # destruction ends them anyway.
    store = f":{int(os.environ.get('MASTER_PORT', '0') or 0):04X}"
    for inode, fd in (mine or {}).items():
        ends = table.get(inode)
        if ends is None or ends[1] not in peer_ends or ends[0].endswith(store) or ends[1].endswith(store):
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


def _destroy_group(abort: bool = False) -> None:
    """Tear down every process group of this rank (the user's subgroups too). ``abort``: to
    unstick a collective; NCCL needs its communicators aborted (its traffic is not ours to
    cut), gloo's are unstuck by :func:`_cut_connections`."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if abort and _group.get("backend") == "nccl":
            from torch.distributed import distributed_c10d

            distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception:
        pass  # a group torn down by its peers may fail to say goodbye; it is gone either way


# -- requests ----------------------------------------------------------------------------

def _handle(kind: bytes, req_id: int, body, fds: list[int], namespace: dict, state: _State,
            channel: socket.socket) -> tuple[bytes, list[int]]:
    try:
        if kind == RUN:
            source, filename, want_value = pickle.loads(body)
            value = _run_source(source, filename, want_value, namespace, state)
        elif kind == APPLY:
            fn, args, kwargs, _ctx, _needed, _imports = payload.unpack_call(body, fds)
            fds = []
            payload.lend_names(fn, namespace)
            value = _in_user_code(state, fn, *args, **kwargs)
        elif kind == PUSH:
            values = payload.loads(body, fds, private=True)
            fds = []
            # What the push replaces is freed after the answer (unmapping 64 MB takes ~10 ms).
            _replaced.extend(namespace[k] for k in values if k in namespace)
            namespace.update(values)
            value = None
        elif kind == PULL:
            name = pickle.loads(body)
            if name not in namespace:
                raise NameError(f"name {name!r} is not defined on rank {namespace.get('rank')}")
            value = namespace[name]
        elif kind == MISSING:
            names = pickle.loads(body)
            value = sorted(n for n in names if n not in namespace and not hasattr(builtins, n))
        elif kind == COMM:  # a frontend's message to a widget here: its handlers are user code
            value = _in_user_code(state, rank_comms.deliver, pickle.loads(body))
        elif kind == GROUP:
            _destroy_group()
            _init_group(pickle.loads(body), fds[0] if fds else None)
            fds = []
            value = None
        else:
            raise RuntimeError(f"unknown request {kind!r}")
        meta = _meta()
        if value is None and meta["gpu_memory"] is None:
            payload.close_fds(fds)
            return pack(DONE, req_id), []  # the common case, without pickling anything
        # Pickling runs the value's own code (__reduce__, __getstate__), which may block: it is
        # interrupted like the user's code, by the stop button and by timeout=.
        try:
            data, out_fds = _in_user_code(state, payload.pack_result, (value, meta))
        except Exception as e:
            if kind != RUN:  # pull, apply: the real value or an error, never a stand-in
                raise PayloadError(f"rank {namespace.get('rank')} cannot send back "
                                   f"{_what(kind, body)} ({type(value).__name__}): "
                                   f"{type(e).__name__}: {safe_str(e)}") from None
            # A cell's value, to be shown (a generator, an open file...): its repr tells what it is.
            data, out_fds = payload.pack_result((RemoteRepr(_safe_repr(value)), meta))
    except BaseException as e:
        payload.close_fds(fds)
        interrupted = isinstance(e, KeyboardInterrupt)
        if kind in (RUN, APPLY):  # as Python does for an uncaught error: pdb.pm() and Session.debug() find it
            sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
            if sys.version_info >= (3, 12):
                sys.last_exc = e
        return pack(FAIL, req_id, pickle.dumps((_capture(e), interrupted, _meta()))), []
    payload.close_fds(fds)
    return pack(DONE, req_id, data), out_fds


def _what(kind: bytes, body) -> str:
    """What a request's value is, for an error: ``'x'`` for a pull of x."""
    if kind == PULL:
        try:
            return repr(pickle.loads(body))
        except Exception:
            pass
    return "the value"


def _in_user_code(state: _State, fn, *args, **kwargs):
    state.in_user_code = True
    try:
        return fn(*args, **kwargs)
    finally:
        state.in_user_code = False


def _run_source(source: str, filename: str, want_value: bool, namespace: dict, state: _State) -> Any:
    """Run a cell as IPython does: every statement, then the last one's value if it is an
    expression. Its source goes to linecache, so tracebacks show the cell's own lines."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename, "exec")
    last = None
    if want_value and tree.body and isinstance(tree.body[-1], ast.Expr):
        expr = tree.body.pop()
        assert isinstance(expr, ast.Expr)
        last = ast.Expression(expr.value)
    body = compile(tree, filename, "exec")
    tail = compile(last, filename, "eval") if last is not None else None
    state.in_user_code = True
    try:
        exec(body, namespace)
        value = eval(tail, namespace) if tail is not None else None
        rank_display.flush_figures()  # as the inline backend: what the cell drew, shown at its end
        return value
    finally:
        state.in_user_code = False


class RemoteRepr:
    """Stands for a value that could not be sent back from a rank: shows the rank's repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as e:
        return f"<{type(value).__name__} (repr failed: {safe_str(e)})>"


def _capture(exc: BaseException) -> RemoteFailure:
    return RemoteFailure.capture(exc, lambda e: payload.dumps(e)[0])


def _meta() -> dict:
    """What the caller's status() shows and only the rank knows."""
    torch = sys.modules.get("torch")
    gpu = None
    try:
        if torch is not None and torch.cuda.is_initialized():
            gpu = int(torch.cuda.memory_allocated())
    except Exception:
        pass
    return {"gpu_memory": gpu}


# -- the control thread ------------------------------------------------------------------

def _control_loop(control: socket.socket, state: _State) -> None:
    """Interrupts and group aborts from the caller, and the watch on what the main thread
    waits for in torch.distributed (waits.py); if the caller goes away (its end closes),
    end this rank and everything it started."""
    watched = NO_REQUEST
    recorder_for = NO_REQUEST  # the request for which the caller asked us to read the recorder
    reported: list[waits.Wait] = []
    next_raw = next_watch = 0.0
    while True:
        busy = state.request != NO_REQUEST
        wait = max(0.0, min(next_raw, next_watch) - time.monotonic()) if busy else None
        ready = select.select([control, state.wake_r], [], [], wait)[0]
        if state.wake_r in ready:
            try:
                os.read(state.wake_r, 4096)
            except BlockingIOError:
                pass
        if control in ready:
            try:
                message = wire.recv(control)
            except (OSError, EOFError):
                message = None
            if message is None:
                _caller_gone()
            kind, req_id, _body = unpack(message[0])
            if kind == INTERRUPT:
                with state.lock:
                    if state.request == req_id:
                        signal.pthread_kill(state.main_ident, signal.SIGINT)
            elif kind == ABORT_GROUP:
                _cut_connections(pickle.loads(_body))
                _destroy_group(abort=True)
                _send(control, pack(ABORTED, req_id))  # the caller rebuilds only after every ack
            elif kind == WATCH:
                recorder_for = req_id
            elif kind == PEEK:
                _send(control, pack(ISSUED, req_id, pickle.dumps(waits.issued_counts())))
            elif kind == ANSWER:
                rank_stdin.deliver(*pickle.loads(_body))
            elif kind == COMM_ACK:  # widgets (rank_comms.py)
                rank_comms.acked(pickle.loads(_body))
        request = state.request
        now = time.monotonic()
        if request != watched:
            # A request has just begun: no look until it has run a while (most end within a
            # millisecond, and a look takes the GIL from them).
            watched, reported = request, []
            next_raw, next_watch = now + rank_stdin.RAW_READ_PERIOD, now + _WATCH_PERIOD
        if request == NO_REQUEST:
            continue
        if now >= next_raw:
            next_raw = now + rank_stdin.RAW_READ_PERIOD
            if rank_stdin.raw_read_waiting():  # C code, or /dev/stdin opened again, reads fd 0
                _send(control, pack(ASK, request, pickle.dumps(rank_stdin.RAW)))
        if now < next_watch:
            continue
        next_watch = now + _WATCH_PERIOD
        found = waits.waits_of(state.main_ident, recorder=recorder_for == request)
        # Where it waits is the line it blocks on now (an async collective is issued on one
        # line and waited for on a later one).
        where = waits.user_line(state.main_ident) if found else None
        found = [dataclasses.replace(w, where=where) for w in found]
        if found != reported:
            reported = found
            _send(control, pack(COLLECTIVE, request, pickle.dumps(reported)))


def _caller_gone() -> NoReturn:
    process.flush_stdio()
    process.kill_descendants()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit  # not reached
