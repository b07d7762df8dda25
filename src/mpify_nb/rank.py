"""Where a rank runs: the code a new rank process executes, from birth to exit.

A rank is born (spawned fresh, or forked from the template) holding one end of a
socketpair to its caller, with its stdout/stderr already pointing at pipes the
caller relays. Then::

    caller                                   rank
      | -- setup (rank, env, cwd, sys.path) -->|  apply them, fresh __main__
      | -- call (fn, args, ctx; memfds) ------>|  unpickle; run imports=
      |                                        |  ctx._mpify_rank_setup() (e.g. open the TCPStore)
      |<------------------------------ READY --|
      | -- GO (once every rank is READY) ----->|  so no rank enters a rendezvous that a
      |                                        |  rank which failed to load would never join
      |                                        |  with ctx: value = fn(*args, **kwargs)
      |<--------------- VALUE (pickle; memfds) |  or
      |<--------------- ERROR (RemoteFailure) -|
      |                                        |  flush, os._exit(0)

A watchdog thread blocks on the channel: if the caller goes away (its end closes),
the rank kills itself, so no rank outlives its caller.
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Collection
from typing import NoReturn, Optional

from . import payload, rank_stdin, wire
from .errors import RemoteFailure, safe_str

READY = b"R"
GO = b"G"
VALUE = b"V"
ERROR = b"E"
IMPORTED = b"M"  # the modules this rank imported (sent before VALUE or ERROR; see preload.py)
ASK = b"Q"  # the rank reads its stdin (rank_stdin.py): a token; the caller sends ANSWER (token, answer)
ANSWER = b"N"

#: The modules this rank was born with (the template's): what it imports beyond them is news.
_born_with: set[str] = set()


def main(channel_fd: int, expected_parent: int) -> None:
    """Run one rank to completion on the socket ``channel_fd``; never returns."""
    _die_with_parent(expected_parent)
    _born_with.update(sys.modules)
    # Whatever the user's code starts (subprocesses, DataLoader workers, daemons that fork
    # twice) stays below this process: orphans are re-parented to us, not to init, so
    # _exit() finds and kills them all. A process group of its own lets the caller kill
    # what is left if we are killed before we can.
    become_subreaper()
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    channel = socket.socket(fileno=channel_fd)
    _line_buffered_stdio()
    faulthandler.enable()  # a segfault prints the Python stack to stderr, which the caller relays
    rank = "?"
    try:
        setup = wire.recv(channel)
        if setup is None:
            os._exit(1)  # the caller gave up before sending anything
        config = pickle.loads(setup[0])
        rank = config["rank"]
        set_process_name(f"mpify_nb-rank{rank}")
        _apply(config)
        if config.get("session"):  # a persistent rank of a Session: serve requests until closed
            from .session_rank import serve

            serve(channel, config, setup[1])
        message = wire.recv(channel)
        if message is None:
            os._exit(1)
        fn, args, kwargs, ctx, needed, imports = payload.unpack_call(*message, windows=config.get("windows"))
        main_dict = sys.modules["__main__"].__dict__
        main_dict.update(needed)
        if imports:
            exec(compile(imports, "<imports>", "exec"), main_dict)
        if needed or imports:
            payload.lend_names(fn, main_dict)
        setup_hook = getattr(ctx, "_mpify_rank_setup", None)
        if setup_hook is not None:
            setup_hook()
    except BaseException as e:
        _send_failure(channel, e, f"rank {rank} could not load the call")
        _exit(0)
    wire.send(channel, READY)
    if wire.recv(channel) is None:  # no GO: the caller gave up (another rank failed to load)
        _exit(0)
    rank_stdin.install(lambda token: _send(channel, ASK + pickle.dumps(token)))
    rank_stdin.install_breakpointhook()
    threading.Thread(target=_watch_caller, args=(channel,), name="mpify_nb-watchdog", daemon=True).start()
    try:
        if ctx is None:
            value = fn(*args, **kwargs)
        else:
            with ctx:
                try:
                    value = fn(*args, **kwargs)
                except BaseException as e:
                    # Report first and leave without ctx.__exit__: tearing the group down
                    # would make the peers fail ("Connection closed by peer"), and their
                    # echo could reach the caller before this, the root cause.
                    _send_failure(channel, e)
                    _exit(0)
    except BaseException as e:
        _send_failure(channel, e)
        _exit(0)
    try:
        data, fds = payload.pack_result(value)
    except BaseException as e:
        _send_failure(channel, e, f"the value returned by rank {rank} ({type(value).__name__}) cannot be pickled")
        _exit(0)
    _flush_stdio()  # everything printed reaches the caller before the value does
    _report_imports(channel)
    try:
        _send(channel, VALUE + data, fds)
    except OSError:
        pass  # the caller is gone; nothing to report to
    _exit(0)


def _apply(config: dict) -> None:
    os.environ.clear()
    os.environ.update(config["env"])
    try:
        os.chdir(config["cwd"])
    except OSError:
        pass  # the caller's directory vanished; keep going where we are
    sys.path[:] = config["sys_path"]
    sys.argv[:] = config["argv"]
    # A clean __main__ for this call: the caller's notebook globals that fn needs
    # arrive with fn, and nothing from the template or an earlier call is visible.
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:
        try:  # the template imported torch before this env existed
            sys.modules["torch"].set_num_threads(int(threads))
        except ValueError:
            pass


def _send_failure(channel, exc: BaseException, context: str = "") -> None:
    if context:
        try:
            raise RuntimeError(f"{context}: {type(exc).__name__}: {safe_str(exc)}") from exc
        except RuntimeError as wrapped:
            exc = wrapped
    failure = RemoteFailure.capture(exc, lambda e: payload.dumps(e)[0])
    _flush_stdio()
    _report_imports(channel)
    try:
        _send(channel, ERROR + pickle.dumps(failure))
    except OSError:
        pass


def _report_imports(channel) -> None:
    """Tell the caller which modules this call imported here, so a later template can hold them."""
    try:
        news = [(name, getattr(module, "__file__", None)) for name, module in list(sys.modules.items())
                if name not in _born_with and module is not None]
        if news:
            _send(channel, IMPORTED + pickle.dumps(news))
    except Exception:
        pass  # only a speed-up is lost


#: The main thread sends the answer, any thread an ASK for input: one whole message at a time.
_send_lock = threading.Lock()


def _send(channel: socket.socket, data: bytes, fds=()) -> None:
    with _send_lock:
        wire.send(channel, data, fds)


def _watch_caller(channel: socket.socket) -> None:
    """The caller's answers to this rank's reads of stdin; a read of fd 0 itself (C code, a
    /dev/stdin opened again) is seen here and asked for."""
    try:
        while True:
            if select.select([channel], [], [], rank_stdin.RAW_READ_PERIOD)[0]:
                message = wire.recv(channel)
                if message is None:
                    break
                if message[0][:1] == ANSWER:
                    rank_stdin.deliver(*pickle.loads(message[0][1:]))
            elif rank_stdin.raw_read_waiting():
                _send(channel, ASK + pickle.dumps(rank_stdin.RAW))
    except (OSError, EOFError):
        pass
    # The caller closed its end: it is gone, or it gave up on this call.
    _flush_stdio()
    kill_descendants()
    os.kill(os.getpid(), signal.SIGKILL)


def become_subreaper() -> None:
    """Orphans below this process are re-parented to it, not to init (PR_SET_CHILD_SUBREAPER)."""
    _prctl(36, 1)


def children_of(pid: int) -> list[int]:
    """The live children of ``pid`` (zombies excluded: they hold nothing)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(int(k) for k in f.read().split())
        except OSError:
            continue
    return [k for k in kids if _state(k) not in (b"Z", b"X", None)]


def _state(pid: int) -> Optional[bytes]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split(b" ", 1)[0]


def kill_descendants(pid: Optional[int] = None, spare: Collection[int] = (), reap: bool = True) -> list[int]:
    """SIGKILL every live process below ``pid`` (default: this one), at any depth, except
    the subtrees rooted at ``spare``; return the pids killed. Looks again until nothing is
    left, since a process may fork while we look. ``reap``: also reap this process's
    zombie children (only where no one else waits for them: a rank about to exit)."""
    root = os.getpid() if pid is None else pid
    killed: list[int] = []
    for _ in range(50):
        found, stack = [], [k for k in children_of(root) if k not in spare]
        while stack:
            p = stack.pop()
            found.append(p)
            stack.extend(children_of(p))
        if not found:
            break
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed.extend(p for p in found if p not in killed)
        time.sleep(0.001)  # let the kills land before looking again
    if reap:
        _reap_orphans()
    return killed


def _reap_orphans() -> None:
    # Killed descendants re-parented to us (we are a subreaper) are our zombies now.
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _prctl(option: int, arg) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg) == 0
    except (OSError, AttributeError):
        return False


def _die_with_parent(expected_parent: int) -> None:
    """Ask Linux to SIGKILL us when our parent (caller or template) dies."""
    if _prctl(1, signal.SIGKILL) and os.getppid() != expected_parent:  # PR_SET_PDEATHSIG
        os._exit(1)  # it died before prctl took effect


def set_process_name(name: str) -> None:
    """Name this process in ps/top (comm, 15 bytes), so ranks are easy to tell apart."""
    _prctl(15, ctypes.c_char_p(name.encode()[:15]))  # PR_SET_NAME


def _line_buffered_stdio() -> None:
    # Each write goes straight to the pipe, so output is live and partial lines
    # (print(..., end="")) are not held back until exit.
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
            write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _exit(code: int) -> NoReturn:
    _flush_stdio()
    kill_descendants()  # nothing this rank started outlives it
    os._exit(code)


if __name__ == "__main__":  # the spawn path: python -c "...main(fd, ppid)"
    main(int(sys.argv[1]), int(sys.argv[2]))
