"""Ray Client (``ray://``): the notebook is outside the cluster, so the ranks' links go
through one actor of ours on the cluster (the hub), and from it to the notebook inside Ray
Client's own connection."""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import threading
from typing import Any, Optional

from .handle import KILL_GRACE, Host
from .link import accept_links, shut
from .worker import WORKER_ENV


class _Hub:
    """Under Ray Client the notebook is outside the cluster: the ranks connect to this actor
    instead (the same token check), and it carries each rank's link as bytes, to the notebook
    in answers to ``poll`` and from it through ``send``. One per Ray Client connection, made by
    its first call and reused (a new actor is a new worker process: 8 s per call here); it
    keeps nothing of a call after ``forget``, and dies with the connection."""

    def __init__(self) -> None:
        import ray

        address = ray.util.get_node_ip_address()
        self._listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((address, 0))
        self._listener.listen(64)
        self._calls: dict[bytes, list[tuple[str, int, Any]]] = {}  # token of an open call -> its events
        self._links: dict[tuple[bytes, int], socket.socket] = {}
        self._cond = threading.Condition()
        threading.Thread(target=accept_links, args=(self._listener, self._known, self._carry), daemon=True).start()

    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def open(self, token: bytes) -> None:
        with self._cond:
            self._calls[token] = []

    def forget(self, token: bytes) -> None:
        with self._cond:
            self._calls.pop(token, None)
            links = [key for key in self._links if key[0] == token]
            for key in links:
                self.close(*key)
                self._links.pop(key).close()

    def _known(self, token: bytes) -> bool:
        """Is ``token`` an open call's (checked before a link gets a thread)?"""
        with self._cond:
            return any(hmac.compare_digest(t, token) for t in self._calls)

    def _carry(self, sock: socket.socket, token: bytes, rank: int, pid: int) -> None:
        with self._cond:
            known = next((t for t in self._calls if hmac.compare_digest(t, token)), None)
            if known is None or (known, rank) in self._links:
                sock.close()
                return
            self._links[(known, rank)] = sock
            self._calls[known].append(("hello", rank, pid))
            self._cond.notify_all()
        while True:
            try:
                data = sock.recv(1 << 20)
            except OSError:
                data = b""
            with self._cond:
                if known in self._calls:
                    self._calls[known].append(("data", rank, data) if data else ("closed", rank, None))
                    self._cond.notify_all()
            if not data:
                return

    def poll(self, token: bytes, timeout: float) -> Optional[list[tuple[str, int, Any]]]:
        """The call's events since the last poll (None once it is forgotten)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._calls.get(token, True)), timeout)
            if token not in self._calls:
                return None
            events, self._calls[token] = self._calls[token], []
        return events

    def send(self, token: bytes, rank: int, data: bytes) -> None:
        self._links[(token, rank)].sendall(data)

    def close(self, token: bytes, rank: int) -> None:
        link = self._links.get((token, rank))
        if link is not None:
            try:
                link.shutdown(socket.SHUT_RDWR)  # its worker kills the rank
            except OSError:
                pass


#: (the Ray Client connection it serves, its handle, its address)
_hub: Optional[tuple[Any, Any, tuple[str, int]]] = None
_hub_lock = threading.Lock()


def _the_hub(ray: Any) -> tuple[Any, tuple[str, int]]:
    """This Ray Client connection's hub, made on first use."""
    global _hub
    connection = ray.get_runtime_context().get_job_id()
    with _hub_lock:
        if _hub is None or _hub[0] != connection:
            # Never one of the pooled workers that keep torch imported for the ranks (lost when the
            # hub ends): Ray gives an actor no worker that ran a task (ray-project/ray#22482, Ray 2.0).
            handle = ray.remote(_Hub).options(num_cpus=0, max_concurrency=64, runtime_env=WORKER_ENV,
                                              name=f"mpify_nb-hub-{os.getpid()}-{secrets.token_hex(3)}").remote()
            _hub = (connection, handle, tuple(ray.get(handle.address.remote())))
        return _hub[1], _hub[2]


def drop_hub() -> None:
    """End this process's hub (``set_placement`` to somewhere else); a new call makes another."""
    global _hub
    with _hub_lock:
        hub, _hub = _hub, None
    if hub is not None:
        try:
            import ray  # a hub was made: Ray is there

            ray.kill(hub[1])
        except Exception:
            pass


class Tunnel:
    """The notebook's side of the hub for one call: each rank's link is one end of a socketpair
    here, the rank's handle holding the other as if it were the TCP link."""

    def __init__(self, placer: Host):
        self._placer = placer
        self._ray = placer.ray
        self._token = placer.token
        self.hub, self.address = _the_hub(self._ray)
        self._ray.get(self.hub.open.remote(self._token))
        self._ends: dict[int, socket.socket] = {}
        placer.spawn(self._downstream, "mpify_nb-ray-hub")

    def _downstream(self) -> None:
        """Hub -> ranks' handles: links attached, their bytes, their ends."""
        while True:
            try:
                events = self._ray.get(self.hub.poll.remote(self._token, 0.5))
            except Exception:
                events = None  # the hub died (its node left): the ranks' links are gone with it
            if events is None:
                for end in list(self._ends.values()):
                    shut(end)
                return
            for kind, rank, value in events:
                if kind == "hello":
                    ours, theirs = socket.socketpair()
                    with self._placer.lock:
                        handle = self._placer.ranks.get(rank)
                    if handle is None or not handle.attach(theirs, value):
                        ours.close()
                        theirs.close()
                        self.hub.close.remote(self._token, rank)
                        continue
                    self._ends[rank] = ours
                    self._placer.spawn(self._upstream, f"mpify_nb-ray-hub{rank}", rank, ours)
                elif rank in self._ends:
                    try:
                        if kind == "data":
                            self._ends[rank].sendall(value)
                        else:
                            shut(self._ends[rank])
                    except OSError:
                        pass

    def _upstream(self, rank: int, ours: socket.socket) -> None:
        """A rank's handle -> the hub, in order; its end closing means: stop that rank."""
        try:
            while True:
                data = ours.recv(1 << 20)
                if not data:
                    break
                self._ray.get(self.hub.send.remote(self._token, rank, data))
        except Exception:
            pass
        try:
            self._ray.get(self.hub.close.remote(self._token, rank), timeout=KILL_GRACE)
        except Exception:
            pass

    def stop(self) -> None:
        try:
            self._ray.get(self.hub.forget.remote(self._token), timeout=KILL_GRACE)
        except Exception:
            pass
        for end in self._ends.values():
            end.close()
