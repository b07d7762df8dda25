"""Asking the notebook's user for the lines ranks read (``input()``, pdb), one at a time.

The caller's loop (ranch's watch thread, a Session's wait loop) hands each ASK from a
rank to a :class:`Prompter`; its thread asks the user through the frontend, the way
ipykernel's own ``input()`` does (an ``input_request`` on the stdin channel, answered by
an ``input_reply``), and gives the answer back to the loop, which sends it to the rank::

    loop ── ask(rank, prompt, reply) ──> Prompter thread ── input_request "[rank 1] (Pdb) " ──> frontend
    loop <── wake(); take_answers() ───  Prompter thread <── input_reply "p x" ────────────── frontend
    loop ── reply(answer) ──> rank

Prompts of several ranks come one after the other, so answers never mix. The loop never
blocks on the user: output, deaths and other ranks are handled meanwhile. When the call
ends (done, failed, stopped), ``close()`` withdraws the open prompt and answers every ask
left (the rank's read raises KeyboardInterrupt). Time spent waiting for the user does not
count against ``timeout=`` (``waited()``).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Any, Callable, Optional

from ..rank.stdin import INTERRUPTED, UNAVAILABLE, Answer

Reply = Callable[[Answer], None]


class _KernelFrontend:
    """ipykernel's frontend, captured on the thread running the cell (ipykernel keeps the
    cell's parent message per thread context)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.parent = kernel.get_parent("shell")
        getter = getattr(kernel, "_get_shell_context_var", None)
        if getter is not None and hasattr(kernel, "_shell_parent_ident"):  # ipykernel >= 7
            self.ident = getter(kernel._shell_parent_ident)
        else:
            self.ident = getattr(kernel, "_parent_ident", {}).get("shell")
        self.allowed = bool(getattr(kernel, "_allow_stdin", False))

    def ask(self, prompt: str, cancelled: threading.Event) -> Optional[str]:
        """The user's line, or None when ``cancelled`` first."""
        import zmq

        kernel = self.kernel
        socket = kernel.stdin_socket
        while True:  # stale replies (a prompt withdrawn earlier) are not this one's answer
            try:
                socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
        kernel.session.send(socket, "input_request", {"prompt": prompt, "password": False},
                            self.parent, ident=self.ident)
        while not cancelled.is_set():
            readable, _, failed = zmq.select([socket], [], [socket], 0.01)
            if readable or failed:
                _ident, reply = kernel.session.recv(socket)
                if reply is not None:
                    return str(reply["content"].get("value", ""))
        return None


class _TerminalFrontend:
    """A script's terminal: the process's own stdin."""

    allowed = True

    def ask(self, prompt: str, cancelled: threading.Event) -> Optional[str]:
        try:
            return input(prompt)
        except EOFError:
            return None


def _frontend() -> Any:
    # A kernel has imported ipykernel long before; a script has not, and importing it here to ask
    # would cost the first call ~0.1 s and put jupyter_client's modules in every rank's imports.
    kernelbase = sys.modules.get("ipykernel.kernelbase")
    try:
        if kernelbase is not None and kernelbase.Kernel.initialized():
            return _KernelFrontend(kernelbase.Kernel.instance())
    except Exception:
        pass
    stdin = sys.__stdin__
    if stdin is not None and stdin.isatty():
        return _TerminalFrontend()
    return None


class Prompter:
    """One call's prompts. Make it on the thread that runs the cell; ``wake`` tells the
    caller's loop that answers wait in :meth:`take_answers`."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._frontend = _frontend()
        self._lock = threading.Lock()
        self._asks: collections.deque = collections.deque()  # (rank, prompt, reply)
        self._answers: list[tuple[Reply, Answer]] = []
        self._asking = False  # the thread is waiting for the user now
        self._since: Optional[float] = None
        self._waited = 0.0
        self._cancelled = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def ask(self, rank: int, prompt: str, reply: Reply) -> None:
        """Rank ``rank`` reads a line; ``reply(answer)`` will be called by the loop."""
        frontend = self._frontend
        if self._cancelled.is_set():  # the call is being stopped: pdb asks again after an interrupt
            with self._lock:
                self._answers.append((reply, None))
            self._wake()
            return
        if frontend is None or not frontend.allowed:
            why = (f"rank {rank} asked for input, but this frontend cannot answer "
                   f"(it does not allow input requests: allow_stdin is off)")
            with self._lock:
                self._answers.append((reply, (UNAVAILABLE, why)))
            self._wake()
            return
        with self._lock:
            self._asks.append((rank, prompt, reply))
            if self._since is None:
                self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpify_nb-prompts", daemon=True)
                self._thread.start()
        self._wake()

    def take_answers(self) -> list[tuple[Reply, Answer]]:
        with self._lock:
            answers, self._answers = self._answers, []
        return answers

    @property
    def waiting(self) -> bool:
        """Does some rank wait for the user now?"""
        with self._lock:
            return self._since is not None

    def asking(self) -> set[int]:
        """The ranks that wait for the user's answer now."""
        with self._lock:
            return {rank for rank, _prompt, _reply in self._asks}

    def waited(self) -> float:
        """Seconds ranks have waited for the user during this call."""
        with self._lock:
            return self._waited + (time.monotonic() - self._since if self._since is not None else 0.0)

    def close(self) -> list[tuple[Reply, Answer]]:
        """The call is over: withdraw the open prompt; every ask left is answered as
        interrupted. Returns the answers the loop has not sent yet."""
        self._cancelled.set()
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            left = self._answers + [(reply, (INTERRUPTED, "")) for _rank, _prompt, reply in self._asks]
            self._answers, self._asks = [], collections.deque()
        return left

    def _run(self) -> None:
        while not self._cancelled.is_set():
            with self._lock:
                if not self._asks:
                    self._waited += time.monotonic() - self._since if self._since is not None else 0.0
                    self._since = None
                    self._thread = None
                    return
                rank, prompt, reply = self._asks[0]
            try:
                line = self._frontend.ask(f"[rank {rank}] {prompt}", self._cancelled)
            except Exception as e:  # the frontend went away mid-prompt
                line = None
                print(f"mpify_nb: could not ask for rank {rank}'s input: {e}", file=sys.stderr)
            if self._cancelled.is_set():
                return
            with self._lock:
                self._asks.popleft()
                self._answers.append((reply, line))
            self._wake()
