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

A rank of a Session (its setup says ``session``) goes on in ``session_rank.serve``
instead. What every process of ours does for itself (its name, the orphans it adopts,
leaving with nothing it started left behind) is in process.py.
"""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import select
import signal
import socket
import sys
import threading
import types

from . import payload, process, rank_stdin, wire
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
    process.die_with_parent(expected_parent)
    _born_with.update(sys.modules)
    # Whatever the user's code starts (subprocesses, DataLoader workers, daemons that fork
    # twice) stays below this process: orphans are re-parented to us, not to init, so
    # process.end() finds and kills them all. A process group of its own lets the caller kill
    # what is left if we are killed before we can.
    process.become_subreaper()
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
        process.set_process_name(f"mpify_nb-rank{rank}")
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
        process.end(0)
    wire.send(channel, READY)
    if wire.recv(channel) is None:  # no GO: the caller gave up (another rank failed to load)
        process.end(0)
    rank_stdin.install(lambda token: wire.send(channel, ASK + pickle.dumps(token)))
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
                    process.end(0)
    except BaseException as e:
        _send_failure(channel, e)
        process.end(0)
    try:
        data, fds = payload.pack_result(value)
    except BaseException as e:
        _send_failure(channel, e, f"the value returned by rank {rank} ({type(value).__name__}) cannot be pickled")
        process.end(0)
    process.flush_stdio()  # everything printed reaches the caller before the value does
    _report_imports(channel)
    try:
        wire.send(channel, VALUE + data, fds)
    except OSError:
        pass  # the caller is gone; nothing to report to
    process.end(0)


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
    process.flush_stdio()
    _report_imports(channel)
    try:
        wire.send(channel, ERROR + pickle.dumps(failure))
    except OSError:
        pass


def _report_imports(channel) -> None:
    """Tell the caller which modules this call imported here, so a later template can hold them."""
    try:
        news = [(name, getattr(module, "__file__", None)) for name, module in list(sys.modules.items())
                if name not in _born_with and module is not None]
        if news:
            wire.send(channel, IMPORTED + pickle.dumps(news))
    except Exception:
        pass  # only a speed-up is lost


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
                wire.send(channel, ASK + pickle.dumps(rank_stdin.RAW))
    except (OSError, EOFError):
        pass
    # The caller closed its end: it is gone, or it gave up on this call.
    process.flush_stdio()
    process.kill_descendants()
    os.kill(os.getpid(), signal.SIGKILL)


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


if __name__ == "__main__":  # the spawn path: python -c "...main(fd, ppid)"
    main(int(sys.argv[1]), int(sys.argv[2]))
