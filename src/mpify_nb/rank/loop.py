"""Where a rank runs: the code a new rank process executes, from birth to exit.

A rank is born (spawned fresh, or forked from the template) holding one end of a
socketpair to its caller, with its stdout/stderr already pointing at pipes the
caller relays. Its first message is its setup (rank, env, cwd, sys.path). Then every rank
serves requests in one loop (:func:`serve`, frames of wire/protocol.py), one at a time on its
main thread, while its control thread (rank/control.py) takes what the caller says meanwhile.
A ``ranch`` rank gets one request, CALL, in the message right after its setup, and exits
after it::

    caller                                   rank
      | -- setup (rank, env, cwd, sys.path) -->|  apply them, fresh __main__
      | -- CALL (fn, args, ctx; memfds) ------>|  unpickle; run imports=
      |                                        |  ctx._mpify_rank_setup(); every rendezvous
      |                                        |  to the call's store (torchdist/rendezvous.py)
      |<------------------------------ STORE --|  (the store's host on a Ray node: the port it bound)
      |<------------------------------ READY --|
      | -- GO (once every rank is READY) ----->|  so no rank enters a rendezvous that a
      |    (with that port, to every rank)     |  rank which failed to load would never join
      |                                        |  control thread on the channel (stdin, LOOK, caller death)
      |                                        |  with ctx: value = fn(*args, **kwargs)
      |<------------- RETURNED (its Snapshot) -|  (with a group: before ctx.__exit__ tears it down)
      |<--------------- DONE (pickle; memfds) -|  or
      |<--------- FAIL (RemoteFailure, ...) ---|
      |                                        |  flush, os._exit(0) (the store's host, once
      |                                        |  it opened the store: when the caller ends it)

A Session's rank (its setup says ``session``) starts its group and gets the requests of
rank/session.py instead, for as long as the caller keeps it. Either way, if the caller goes
away (its end closes), the control thread kills the rank, so no rank outlives its caller.
What every process of ours does for itself (its name, the orphans it adopts, leaving with
nothing it started left behind) is in rank/process.py.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import sys
import threading
import types
from typing import Any, NoReturn, Optional

from ..torchdist import p2p, rendezvous, waits
from ..wire import framing, payload
from ..wire.errors import RemoteFailure, safe_str
from ..wire.protocol import CALL, DONE, FAIL, IMPORTED, NO_REQUEST, READY, RETURNED, STORE, pack, unpack
from . import checks, control, imports_news, process, session
from .control import RankState


def main(channel_fd: int, expected_parent: int) -> None:
    """Run one rank to completion on the socket ``channel_fd``; never returns."""
    process.die_with_parent(expected_parent)
    imports_news.born()
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
    process.line_buffered_stdio()
    process.keep_stdio()
    faulthandler.enable()  # a segfault prints the Python stack to stderr, which the caller relays
    rank = "?"
    try:
        setup = framing.recv(channel)
        if setup is None:
            os._exit(1)  # the caller gave up before sending anything
        config = pickle.loads(setup[0])
        rank = config["rank"]
        process.set_process_name(f"mpify_nb-rank{rank}")
        _apply(config)
        checks.starting()  # on or off as the caller's environment says
    except BaseException as e:
        _send_failure(channel, NO_REQUEST, e, f"rank {rank} could not start")
        process.end(0)
    state = RankState(int(rank))
    control.connect(channel, state)
    requests: dict[bytes, control.Request]
    if config.get("session"):  # a persistent rank of a Session: serve requests until closed
        requests = session.start(channel, config, setup[1], state)
    else:
        windows = config.get("windows")  # of the call's memfds in a Ray node's object store file
        store = socket.socket(fileno=setup[1][0]) if setup[1] else None  # we host the call's store
        requests = {CALL: lambda channel, state, req, body, fds: _one_call(channel, state, req, body, fds,
                                                                           windows, store)}
    serve(channel, state, requests)


def serve(channel: socket.socket, state: RankState, requests: dict[bytes, control.Request]) -> NoReturn:
    """Every rank's loop: run the caller's requests one at a time, answer each; never returns."""
    while True:
        message = framing.recv(channel)
        if message is None:
            process.end(0)  # the caller closed the session
        data, fds = message
        kind, req_id, body = unpack(data)
        process.restore_stdio()  # the last request's code may have closed its stdout
        state.begin(req_id)
        request = requests.get(kind)
        if request is None:
            payload.close_fds(fds)
            reply, reply_fds = _failure(RuntimeError(f"unknown request {kind!r}"), req_id), []
        else:
            reply, reply_fds = request(channel, state, req_id, body, fds)
        state.begin(NO_REQUEST)
        process.flush_stdio()  # what the request printed reaches the caller before its answer
        _flush_c_stdio()
        control.send(channel, reply, reply_fds)
        payload.close_fds(reply_fds)
        session.free_replaced()


def _one_call(channel: socket.socket, state: RankState, req: int, body: Any, fds: list, windows: Any,
              store: Optional[socket.socket] = None) -> NoReturn:
    """A ranch call: load it, READY, wait for GO, run it, answer, exit (the host of the call's
    store once the caller says the call is over: the others may still use it)."""
    rank = os.environ.get("RANK", "?")
    # Every init_process_group of the call goes to its store (torchdist/rendezvous.py); every group
    # made is held against a deadlock in torch (torchdist/groups.py: keep_groups).
    bound = rendezvous.activate(host=os.environ.get(rendezvous.HOST_VARIABLE) == rank, host_socket=store)
    if bound is not None:  # we host the store on a Ray node: the caller tells the others at GO
        control.send(channel, pack(STORE, req, pickle.dumps(bound)))
    imports_news.watch(lambda news: control.to_caller(IMPORTED, news))  # the template imports them too, meanwhile
    try:
        fn, args, kwargs, ctx, needed, imports = payload.unpack_call(body, fds, windows=windows)
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
        _send_failure(channel, req, e, f"rank {rank} could not load the call")
        process.end(0)
    checks.starting()  # on or off as the caller says (a template's rank: installed already)
    # isend/irecv note their peers for the caller's looks; a spawned rank's check installed now,
    # or once the function imports torch.distributed (before its first group)
    rendezvous.when_imported(lambda: (p2p.install(), checks.starting()))
    control.send(channel, pack(READY, req))
    go = framing.recv(channel)
    if go is None:  # no GO: the caller gave up (another rank failed to load)
        process.end(0)
    told = unpack(go[0])[2]
    if len(told):  # the port the store's host bound on its Ray node
        rendezvous.learn_port(os.environ, pickle.loads(told))
    control.install_stdin(channel, state)
    control.start(channel, state)  # from now on the channel is the control thread's
    try:
        if ctx is None:
            value = fn(*args, **kwargs)
            _returned(channel, state, req)
        else:
            with ctx:
                try:
                    value = fn(*args, **kwargs)
                except BaseException as e:
                    # Report first and leave without ctx.__exit__: tearing the group down
                    # would make the peers fail ("Connection closed by peer"), and their
                    # echo could reach the caller before this, the root cause.
                    _send_failure(channel, req, e, state=state)
                    process.end(0)
                _returned(channel, state, req)
    except BaseException as e:
        _send_failure(channel, req, e, state=state)
        process.end(0)
    try:
        data, out_fds = payload.pack_result(value)
    except BaseException as e:
        _send_failure(channel, req, e,
                      f"the value returned by rank {rank} ({type(value).__name__}) cannot be pickled")
        process.end(0)
    process.flush_stdio()  # everything printed reaches the caller before the value does
    imports_news.report(channel, req)
    control.send(channel, pack(DONE, req, data), out_fds)
    if rendezvous.hosting():
        threading.Event().wait()  # the caller ends us (or our control thread, when it goes)
    process.end(0)


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


def _returned(channel: socket.socket, state: RankState, req: int) -> None:
    """fn returned on a rank that made a group: what it issued goes to the caller before the
    group is torn down, so a peer left waiting in a collective it never joined is told that,
    not gloo's "Connection closed by peer" (engine/watch.py)."""
    try:
        snap = waits.snapshot_of_return(state.rank)
        if snap is not None:
            control.send(channel, pack(RETURNED, req, pickle.dumps(snap)))
    except Exception:
        pass  # only a clearer error is lost


def _failure(exc: BaseException, req: int, rank: int = -1) -> bytes:
    failure = RemoteFailure.capture(exc, lambda e: payload.dumps(e)[0])
    try:
        failure.context = waits.snapshot_of_failure(rank, exc)  # raised in a collective: which one
    except Exception:
        pass
    return pack(FAIL, req, pickle.dumps((failure, False, {})))


def _send_failure(channel, req: int, exc: BaseException, context: str = "",
                  state: Optional[RankState] = None) -> None:
    if context:
        try:
            raise RuntimeError(f"{context}: {type(exc).__name__}: {safe_str(exc)}") from exc
        except RuntimeError as wrapped:
            exc = wrapped
    reply = _failure(exc, req, state.rank if state is not None else -1)
    process.flush_stdio()
    imports_news.report(channel, req)
    control.send(channel, reply)


if __name__ == "__main__":  # the spawn path: python -c "...main(fd, ppid)"
    main(int(sys.argv[1]), int(sys.argv[2]))
