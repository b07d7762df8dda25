"""A frontend for the background-work tests: a real kernel, and a client that, like JupyterLab, keeps
every IOPub message with the request it answers (its parent header's msg_id), so a test can say which
cell each output went to while several cells ran (jupyter_client)::

    front = Frontend(cwd)
    start = front.start("%%distributed --bg\\n...")       # returns at once
    front.ok("%%local\\n1 + 1")                           # another cell, while it runs
    front.wait_for(start, r"\\[rank 1\\] step 3")          # its output keeps coming to its own cell
    assert front.texts_of(other) == ...                   # and never to another one
"""

from __future__ import annotations

import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from helpers_debugger import ANSI, KernelFrontend

#: The IOPub messages that are a cell's output.
OUTPUT_KINDS = ("stream", "display_data", "update_display_data", "execute_result", "error", "clear_output")


@dataclass
class Sent:
    """One execute request and what came back for it."""

    msg_id: str
    code: str
    reply: Optional[dict] = None
    idle: bool = False
    outputs: list[dict] = field(default_factory=list)  # the IOPub messages whose parent is this request

    @property
    def status(self) -> str:
        return self.reply["content"]["status"] if self.reply is not None else ""

    def text(self) -> str:
        """Everything it shows as text: streams, the text/plain of displays (their updates too), errors."""
        parts = []
        for msg in list(self.outputs):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                parts.append(content["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                parts.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                parts.append(ANSI.sub("", "\n".join(content["traceback"])) + "\n")
        return "".join(parts)

    def errors(self) -> list[dict]:
        return [m["content"] for m in list(self.outputs) if m["msg_type"] == "error"]


class Frontend(KernelFrontend):
    """A kernel (nbutil's kernelspec, tagged for the leftover check) and a client that reads IOPub on
    a thread of its own, filing each output under the request it names as its parent."""

    def __init__(self, cwd: str):
        super().__init__(cwd)
        self.sent: dict[str, Sent] = {}
        self.stray: list[dict] = []  # outputs whose parent is no request of ours
        self._lock = threading.Lock()
        self._closing = False
        self._replies: dict[str, dict] = {}
        self._reader = threading.Thread(target=self._read_iopub, daemon=True)
        self._reader.start()

    def _read_iopub(self) -> None:
        while not self._closing:
            try:
                msg = self.kc.iopub_channel.get_msg(timeout=0.05)
            except queue.Empty:
                continue
            except Exception:
                return
            parent = msg["parent_header"].get("msg_id", "")
            with self._lock:
                sent = self.sent.get(parent)
                if msg["msg_type"] == "status" and sent is not None:
                    if msg["content"]["execution_state"] == "idle":
                        sent.idle = True
                elif msg["msg_type"] in OUTPUT_KINDS:
                    (sent.outputs if sent is not None else self.stray).append(msg)

    def start(self, code: str, allow_stdin: bool = False) -> Sent:
        """Send a cell; return at once."""
        with self._lock:
            msg_id = self.kc.execute(code, allow_stdin=allow_stdin)
            sent = self.sent[msg_id] = Sent(msg_id, code)
        return sent

    def finish(self, sent: Sent, timeout: float = 120.0) -> Sent:
        """Wait for ``sent``'s execute_reply and for the kernel to go idle after it."""
        deadline = time.monotonic() + timeout
        while sent.msg_id not in self._replies:
            left = deadline - time.monotonic()
            assert left > 0, f"the cell did not finish within {timeout} s: {sent.code!r}\n{sent.text()}"
            try:
                msg = self.kc.shell_channel.get_msg(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            self._replies[msg["parent_header"].get("msg_id", "")] = msg
        sent.reply = self._replies[sent.msg_id]
        while not sent.idle and time.monotonic() < deadline:
            time.sleep(0.005)
        return sent

    def run(self, code: str, timeout: float = 120.0) -> Sent:
        return self.finish(self.start(code), timeout)

    def ok(self, code: str, timeout: float = 120.0) -> Sent:
        sent = self.run(code, timeout)
        assert sent.status == "ok", f"cell failed: {code!r}\n{sent.text()}"
        return sent

    def fails(self, code: str, ename: str, timeout: float = 120.0) -> Sent:
        sent = self.run(code, timeout)
        assert sent.status == "error", f"cell should have failed: {code!r}\n{sent.text()}"
        assert sent.reply is not None and sent.reply["content"]["ename"] == ename, sent.text()
        return sent

    def wait_for(self, sent: Sent, pattern: str, timeout: float = 60.0) -> re.Match:
        """Wait until ``sent``'s outputs so far match ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, sent.text(), re.S)
            if match:
                return match
            time.sleep(0.02)
        raise AssertionError(f"no output matching {pattern!r} within {timeout} s in {sent.code!r}:\n{sent.text()}")

    def value(self, expression: str) -> Any:
        """The kernel's own value of ``expression`` (a %%local cell), as Python."""
        import ast

        sent = self.ok(f"%%local\nprint(repr({expression}))")
        return ast.literal_eval("".join(m["content"]["text"] for m in sent.outputs if m["msg_type"] == "stream"))

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def close(self) -> None:
        self._closing = True
        self._reader.join(2.0)
        super().close()
