"""The stop button, pressed where a test means it: never before the wait it is for.

A ``threading.Timer(0.3, os.kill, (pid, SIGINT))`` started just before ``with pytest.raises(
KeyboardInterrupt)`` presses outside that block when the main thread stalls 0.3 s on a loaded
machine (two pytest workers on two cores): the KeyboardInterrupt then escapes the test and ends the
whole run. :func:`press_when_waiting_in` presses only once the main thread is inside the call.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def _main_thread_in(name: str) -> bool:
    """Is mpify_nb's function ``name`` on the main thread's stack (not pytest's own ``run``)?"""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        code = frame.f_code
        if code.co_name == name and f"{os.sep}mpify_nb{os.sep}" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def press_when_waiting_in(name: str, after: float = 0.3, timeout: float = 60.0) -> threading.Thread:
    """Start a thread that sends SIGINT to the main thread once mpify_nb's function ``name`` is on its
    stack and has stayed there ``after`` seconds (a wait in it, not its first line)."""

    def press() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _main_thread_in(name):
                time.sleep(after)
                if _main_thread_in(name):
                    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
                    return
            time.sleep(0.01)

    presser = threading.Thread(target=press, daemon=True, name="test-stop-button")
    presser.start()
    return presser
