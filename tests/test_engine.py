"""The engine's plug-in point: a capability's frames, registered once, reach every kind of rank.

A capability claims kind bytes (protocol.claim), registers its caller-side handler on every
engine (engine.add_capability) and its rank-side one on the rank's control thread
(rank_control.on); a rank sends with rank_control.to_caller. The same few lines then serve a
ranch rank (one request, then it exits) and a Session's rank (many requests, it stays).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mpify_nb import Session, ranch
from mpify_nb.engine import capabilities, members
from mpify_nb.engine import core as engine
from mpify_nb.wire import protocol

PING = protocol.claim(b"y", "test_engine")  # to a rank
PONG = protocol.claim(b"Y", "test_engine")  # from a rank


def rank_side_echo() -> bytes:
    """On a rank: register for PING, send PONG, return what PING brought back."""
    import os
    import queue

    from mpify_nb.rank import control as rank_control

    got: queue.Queue = queue.Queue()
    rank_control.on(b"y", lambda state, control, req, body: got.put(bytes(body)))
    rank_control.to_caller(b"Y", f"hello from {os.environ['RANK']}".encode())
    return got.get(timeout=30)


@pytest.fixture
def echo_capability() -> Iterator[list]:
    """Caller side: each PONG is recorded and answered with a PING of its body, reversed."""
    heard: list = []

    def install(e: engine.Engine) -> None:
        def on_pong(m: members.Member, req: int, body, fds: list) -> None:
            heard.append((m.rank, bytes(body)))
            e.send_control(m, PING, req, bytes(body)[::-1])

        e.on(PONG, on_pong)

    capabilities.add_capability(install)
    yield heard
    capabilities.remove_capability(install)


def test_claim_refuses_a_taken_kind():
    with pytest.raises(ValueError, match="taken by DONE"):
        protocol.claim(b"D", "another capability")
    assert protocol.claim(b"y", "test_engine") == b"y"  # its own claim again is fine


def test_a_capability_reaches_ranch_ranks(echo_capability):
    assert ranch(2, rank_side_echo, caller_rank=None) == [b"0 morf olleh", b"1 morf olleh"]
    assert sorted(echo_capability) == [(0, b"hello from 0"), (1, b"hello from 1")]


def test_a_capability_reaches_session_ranks(echo_capability):
    with Session(2, ddp=False) as s:
        assert s.apply(rank_side_echo) == {0: b"0 morf olleh", 1: b"1 morf olleh"}
        assert s.apply(rank_side_echo, ranks=[1]) == {1: b"1 morf olleh"}  # the ranks stay: again
    assert sorted(echo_capability) == [(0, b"hello from 0"), (1, b"hello from 1"), (1, b"hello from 1")]


def test_a_rank_paused_at_a_breakpoint_waits_for_the_user_and_its_time_is_not_the_calls():
    """What the debugger tells the engine (engine.user_waits.pause/unpause), read as text pdb's prompts are:
    the call's time limit stops running, and a peer waiting on that rank is no error."""
    import sys
    import time

    from mpify_nb.relay.pipes import OutputRelay

    e = engine.Engine(OutputRelay(sys.stdout, sys.stderr), pump_output=True, persistent=True)
    try:
        deadline = time.monotonic() + 100.0
        assert not e.user_waits.waiting()
        e.user_waits.pause(1)
        assert e.user_waits.waiting() and e.user_waits.waiting(1) and not e.user_waits.waiting(0)
        assert e.user_waits.time_left(deadline) is None
        time.sleep(0.2)
        e.user_waits.unpause(1)
        assert not e.user_waits.waiting(1)
        left = e.user_waits.time_left(deadline)
        assert left is not None and left > deadline - time.monotonic() + 0.2  # the pause is given back
        e.starting_call([])  # a new call starts with nothing paused and nothing given back
        before = time.monotonic()
        left = e.user_waits.time_left(deadline)
        assert left is not None and left <= deadline - before
    finally:
        e.close()
