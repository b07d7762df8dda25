"""A process group's check: every rank publishes its call, waits for its peers', and compares.

::

    rank i: dist.all_reduce(x)  ──> wrappers.py: its description (calls.py) and line
        Group.collective:  put ("c", i)[k] ─────────────────> the group's table (table.py: shared
                           wait for ("c", j)[k] of each peer <── memory on one host; store.py: its
                           (asleep on the bell; a look sees      store across hosts)
                           "waiting in all_reduce #n")
        alike: gloo runs it.  apart: every rank raises the same CollectiveError, none entered
        gloo, and the next call on the group is numbered as if this one never was
    point to point: put ("p", i, peer, dir)[k]; the peer's half of the same pairing, if it is
        there already, is compared; a rank never waits for it (the peer may receive from any
        rank, or post its irecv after an isend of its own): of two that disagree, the second
        to arrive raises, and the first, left waiting in gloo, is the collective watch's.

A group's table is made while the group is made (wrappers.py wraps ``init_process_group`` and
``new_group``: every member is there), or at its first checked collective (groups made before the
check was installed); point-to-point calls on a group without one go unchecked. Every member
publishes its host; when all share one, rank 0 makes a shared-memory table and the others open
it, else the check goes through the group's store (collectives only).
"""

from __future__ import annotations

import os
import struct
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from ..recorder import Op
from . import calls
from .store import StoreTable
from .table import LAPPED, Ring, ShmTable, host_identity

#: Seconds a waiting rank sleeps at most before it looks again (a stop, an abort, a lost bell).
SLICE = 0.05
#: Seconds a rank looks again, yielding its core between looks, before it sleeps: a peer in step
#: comes within microseconds, and a sleep and its wake cost more than that (measured on 2 loaded
#: cores: 50 us did best of 0, 50 and 300 us; a longer spin takes the core from the peer's gloo).
SPIN = 50e-6
_SETUP_KEYS = "mpify_nb.check/setup/"


class CheckAborted(RuntimeError):
    """The group was aborted under a rank waiting in its check (a Session unsticking it)."""


@dataclass
class Mismatch:
    """Ranks' calls that cannot be one: ``why``, and each rank's (global rank, call, line)."""

    why: str
    calls: list[tuple[int, Op, Optional[tuple[str, int]]]] = field(default_factory=list)
    p2p: bool = False

    def text(self, location: Callable[[tuple[str, int]], str] = lambda w: f'File "{w[0]}", line {w[1]}') -> str:
        """"the ranks called collectives that cannot match (different dtypes): rank 0 at File "x",
        line 3: all_reduce #1 of float32[4]; rank 1 at line 3: all_reduce #1 of float64[4]"."""
        from ..recorder import op_text

        parts = []
        last = None
        for rank, op, where in self.calls:
            at = ""
            if where is not None:
                at = f" at line {where[1]}" if where[0] == last else f" at {location(where)}"
                last = where[0]
            parts.append(f"rank {rank}{at}: {op_text(op)}")
        head = "a send and its recv cannot match" if self.p2p else "the ranks called collectives that cannot match"
        return f"{head} ({self.why}): " + "; ".join(parts)


class CollectivesApart(RuntimeError):
    """What a rank raises where nothing better was installed (rank/checks.py installs CollectiveError)."""

    def __init__(self, mismatch: Mismatch) -> None:
        super().__init__(mismatch.text())
        self.mismatch = mismatch


#: Makes the exception a mismatch raises (rank/checks.py: the caller's CollectiveError).
raise_as: list[Callable[[Mismatch], BaseException]] = []
#: What torchdist/waits.py hands over as it is imported (it looks at us; we never import it): the
#: recorder's ops of the live groups, and whether a file is the user's.
RECORDED: list[Callable[[], list]] = []
USER_FILE: list[Callable[[str], bool]] = []
#: A rank that outlives its call (a Session's): the stop button while it waits in its check is
#: held until the check is over (a peer may be entering gloo on its word; one that never comes is
#: unstuck by the group's abort, as a wait in gloo is). A ranch call's ranks end with the call.
HOLD_INTERRUPTS = [False]


def error_for(mismatch: Mismatch) -> BaseException:
    return raise_as[0](mismatch) if raise_as else CollectivesApart(mismatch)


class Group:
    """One process group's check, in one rank."""

    def __init__(self, pg: Any, name: str, ranks: Optional[tuple[int, ...]], members: tuple[int, ...],
                 me: int, table: Union[ShmTable, StoreTable], devices: frozenset, pure: bool = True) -> None:
        self.pg = weakref.ref(pg)
        self.name = name
        self.ranks = ranks  # None: the world
        self.members = members  # global ranks, by group rank
        self.index_of = {g: i for i, g in enumerate(members)}
        self.me = me
        self.size = len(members)
        self.table = table
        self.devices = devices  # device types gloo runs for this group ("cpu", "cuda")
        self.pure = pure  # gloo is its only backend (a barrier runs there)
        self.peers = [i for i in range(self.size) if i != me]
        self.rings = [("c", i) for i in self.peers]
        self.ring = ("c", me)
        self.room = table.room(self.ring)
        self.calls = 0  # collectives checked (and numbered alike) on every rank
        self.p2p_calls: dict[tuple[int, int], int] = {}
        self.p2p_seen = 0  # point-to-point calls (they take a number of torch's sequence too)
        self.any_source = False  # it received from any rank: its recvs pair as only gloo knows
        self.aborted = False
        self.held: Optional[BaseException] = None  # a KeyboardInterrupt held during a wait
        self.shared = isinstance(table, ShmTable)
        weakref.finalize(self, table.close)

    def group_rank(self, global_rank: Any, group_rank: Any) -> Optional[int]:
        if isinstance(global_rank, int) and not isinstance(global_rank, bool):
            return self.index_of.get(global_rank)
        if isinstance(group_rank, int) and not isinstance(group_rank, bool) and 0 <= group_rank < self.size:
            return group_rank
        return None

    # -- a collective ------------------------------------------------------------------------

    def collective(self, description: bytes, line: bytes, op: Callable[[], Op]) -> None:
        """Publish this rank's call, wait for every peer's, raise if they cannot be one."""
        index = self.calls
        self.calls += 1
        self.table.put(self.ring, index, _joined(description, line, self.room))
        got = self._await(self.rings, index, op)
        if all(_description(data) == description for data in got.values()):
            self._raise_held()
            return
        mine = calls.decode(description)
        theirs = {ring[1]: data for ring, data in got.items()}
        descriptions = [mine if i == self.me else calls.decode(_description(theirs[i])) for i in range(self.size)]
        why = calls.apart(descriptions, self.size)
        if why is None:
            self._raise_held()
            return
        self.held = None  # the mismatch is the news: every rank raises it
        lines = [_line(line) if i == self.me else _line(_rest(theirs[i])) for i in range(self.size)]
        number = self.number()
        raise error_for(Mismatch(why, [(self.members[i], self.op_of(descriptions[i], number), lines[i])
                                       for i in range(self.size)]))

    def _raise_held(self) -> None:
        """The stop button pressed while this rank waited: now, instead of entering gloo (a peer
        that did waits there, and the Session's stop unsticks it)."""
        held, self.held = self.held, None
        if held is not None:
            raise held

    def _await(self, rings: list[Ring], index: int, checking: Callable[[], Op]) -> dict[Ring, bytes]:
        """Every ring's call ``index``, waited for. ``checking`` says what this rank waits in, to a
        look from the control thread (torchdist/waits.py reads this frame's locals)."""
        got: dict[Ring, Any] = {}
        spin_until = time.perf_counter() + SPIN
        first = True
        while True:
            try:
                if self._look(rings, index, got, spin_until, first, checking):
                    return got
            except KeyboardInterrupt as e:
                if not HOLD_INTERRUPTS[0]:
                    raise
                self.held = e  # raised once the check is over (collective())
            first = False

    def _look(self, rings: list[Ring], index: int, got: dict, spin_until: float, first: bool,
              checking: Callable[[], Op]) -> bool:
        """One look at the peers' slots (and a yield, or a sleep on the bell): all there?"""
        table = self.table
        token = table.token()
        for ring in rings:
            if ring not in got:
                data = table.get(ring, index)
                if data is not None:  # (a collective's slot is never lapped: were it, unjudged)
                    got[ring] = data if data is not LAPPED else _joined(calls.UNCHECKED, b"", 1 << 20)
        if len(got) == len(rings):
            return True
        if self.aborted:
            raise CheckAborted(f"the process group was aborted while this rank waited in {checking().kind}")
        if time.perf_counter() < spin_until:
            os.sched_yield()  # a peer in step is microseconds away; one on this core runs first
            return False
        table.sleep(token, [(ring, index) for ring in rings if ring not in got], SLICE, first)
        return False

    # -- point to point ----------------------------------------------------------------------

    def p2p(self, kind: str, peer: int, tag: int, description: bytes, line: bytes, op: Callable[[], Op]) -> None:
        """Publish a send or recv; if the peer's half is there, compare (never wait for it)."""
        self.p2p_seen += 1
        if not self.shared or kind == "recv" and self.any_source:
            return
        direction = 0 if kind == "send" else 1
        key = (peer, direction, tag)
        index = self.p2p_calls.get(key, 0)
        self.p2p_calls[key] = index + 1
        mine: Ring = ("p", self.me, peer, direction)
        self.table.put(mine, index, _joined(description, line, self.table.room(mine)), tag)
        # the put's atomic bell is a full barrier: of two ranks that publish, one sees the other
        data = self.table.get(("p", peer, self.me, 1 - direction), index, tag)
        if data is None or data is LAPPED:
            return  # the peer checks when it comes (or lagged a ring behind: unjudged)
        assert isinstance(data, bytes)
        theirs = calls.decode(_description(data))
        ours = calls.decode(description)
        send, recv = (ours, theirs) if kind == "send" else (theirs, ours)
        why = calls.p2p_apart(send, recv)
        if why is None:
            return
        pair = sorted([(self.me, ours, _line(line)), (peer, theirs, _line(_rest(data)))], key=lambda item: item[0])
        found = [(self.members[i], self.op_of(d, None), where) for i, d, where in pair]
        raise error_for(Mismatch(why, found, p2p=True))

    def p2p_unpaired(self, kind: str) -> None:
        """A point-to-point call that names no peer (a recv from any rank): after it, this rank's
        recvs on the group pair with senders in an order only gloo knows, and go unchecked."""
        self.p2p_seen += 1
        if kind == "recv":
            self.any_source = True

    # -- in words ----------------------------------------------------------------------------

    def op_of(self, d: calls.Description, number: Optional[int]) -> Op:
        """A description as the collective watch's ops are (its root and peer as global ranks)."""
        kind = d[0]
        root = self.members[d[2]] if isinstance(d[2], int) and 0 <= d[2] < self.size else None
        seq = None if kind in calls.P2P else number
        return Op(kind, self.name, self.ranks, seq, tuple(d[4]), tuple(d[5]), root, d[3], called=True)

    def number(self) -> Optional[int]:
        """The number the recorder gives this group's next collective (torch's own sequence,
        less the point-to-point calls it also counts, where gloo records nothing: torch < 2.8)."""
        try:
            recorded = RECORDED[0]() if RECORDED else []
            numbered = [o.seq for o in recorded if o.group == self.name and o.seq is not None]
            if numbered:
                return max(numbered) + 1
            pg = self.pg()
            return pg._get_sequence_number_for_group() - self.p2p_seen + 1 if pg is not None else None
        except Exception:
            return None

    def abort(self) -> None:
        self.aborted = True
        self.table.wake()


def _joined(description: bytes, line: bytes, room: int) -> bytes:
    data = struct.pack("<I", len(description)) + description + line
    if len(data) <= room:
        return data
    data = struct.pack("<I", len(calls.UNCHECKED)) + calls.UNCHECKED + line  # too big to judge here
    return data if len(data) <= room else struct.pack("<I", len(calls.UNCHECKED)) + calls.UNCHECKED


def _description(data: bytes) -> bytes:
    (length,) = struct.unpack_from("<I", data)
    return data[4:4 + length]


def _rest(data: bytes) -> bytes:
    (length,) = struct.unpack_from("<I", data)
    return data[4 + length:]


def _line(data: bytes) -> Optional[tuple[str, int]]:
    if not data:
        return None
    try:
        filename, lineno = calls.decode(data)
        return str(filename), int(lineno)
    except Exception:
        return None


# -- making a group's table ---------------------------------------------------------------------

#: {process group: its Group (or None: not checked)}, for as long as the group lives.
_groups: weakref.WeakKeyDictionary[Any, Optional[Group]] = weakref.WeakKeyDictionary()
_made: weakref.WeakSet[Group] = weakref.WeakSet()  # every Group alive, its table open or closed


def known(pg: Any) -> tuple[bool, Optional[Group]]:
    """(whether ``pg``'s check was set up, its Group)."""
    try:
        found = _groups.get(pg, _groups)
    except TypeError:
        return True, None
    return (False, None) if found is _groups else (True, found)


def set_up(pg: Any, checking: Callable[[], Op]) -> Optional[Group]:
    """Make ``pg``'s check (every member of it does this at once: while the group is made, or at its
    first collective); None for a group that is not gloo's, has one rank, or no store."""
    group = _make(pg, checking)
    if group is not None:
        _made.add(group)
    try:
        _groups[pg] = group
    except TypeError:
        pass
    return group


def _make(pg: Any, checking: Callable[[], Op]) -> Optional[Group]:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    from torch.distributed import distributed_c10d as c10d

    if pg is None or pg is c10d.GroupMember.NON_GROUP_MEMBER:
        return None
    try:
        size, me = pg.size(), pg.rank()
        devices = frozenset(d for d in ("cpu", "cuda") if _is_gloo(pg, torch.device(d)))
        store = c10d._world.pg_map[pg][1]
        name = c10d._world.pg_names[pg]
        world = pg is c10d.GroupMember.WORLD
        members = tuple(range(size)) if world else tuple(c10d.get_process_group_ranks(pg))
        pure = str(c10d.get_backend(pg)) == "gloo"
    except Exception:
        return None
    if size < 2 or not devices or store is None:
        return None
    table = _open_table(store, me, size, checking)
    return Group(pg, name, None if world else members, members, me, table, devices, pure)


def _is_gloo(pg: Any, device: Any) -> bool:
    try:
        return type(pg._get_backend(device)).__name__ == "ProcessGroupGloo"
    except Exception:
        return False


def _open_table(store: Any, me: int, size: int, checking: Callable[[], Op]) -> Union[ShmTable, StoreTable]:
    """Shared memory when every member is on this host (and could open it), else the store."""
    keys = _SETUP_KEYS
    store.set(f"{keys}host/{me}", host_identity())
    hosts = _await_keys(store, [f"{keys}host/{i}" for i in range(size)], checking)
    table: Optional[ShmTable] = None
    if len(set(hosts)) == 1:
        try:
            if me == 0:
                table = ShmTable.create(size)
                store.set(f"{keys}table", table.address())
            else:
                (address,) = _await_keys(store, [f"{keys}table"], checking)
                table = ShmTable.attach(address, size) if address else None
        except OSError:
            if me == 0:
                store.set(f"{keys}table", "")
        if table is not None:
            table.mark_attached(me)
    store.set(f"{keys}ok/{me}", "1" if table is not None else "0")
    oks = _await_keys(store, [f"{keys}ok/{i}" for i in range(size)], checking)
    if table is not None and all(ok == "1" for ok in oks):
        table.opened()
        return table
    if table is not None:
        table.close()
    return StoreTable(store, size)


def _await_keys(store: Any, keys: list[str], checking: Callable[[], Op]) -> list[str]:
    """The store's values of ``keys``, waited for (asleep between asks, so a stop or an abort gets
    through; the store's own wait would print a C++ warning at each slice)."""
    aborts = _aborts[0]
    pause = 1e-4
    while not store.check(keys):
        if _aborts[0] != aborts:
            raise CheckAborted(f"the process group was aborted while this rank waited in {checking().kind}")
        time.sleep(pause)
        pause = min(pause * 2, SLICE)
    return [bytes(store.get(key)).decode() for key in keys]


# -- the whole process -------------------------------------------------------------------------

_aborts = [0]


def sweep() -> None:
    """Close the tables of groups torch no longer holds (the notebook, after each call: each
    table's mapping holds a file descriptor until it is closed)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    alive = set(getattr(getattr(c10d, "_world", None), "pg_names", {}) or ()) if c10d is not None else set()
    for pg in list(_groups.keys()):
        if pg not in alive:
            _groups.pop(pg, None)
    for group in list(_made):  # one a traceback still holds (its pg gone) too
        pg = group.pg()
        if pg is None or pg not in alive:
            group.table.close()


def abort_all() -> None:
    """Every check waiting in this process raises CheckAborted (the Session aborts its groups)."""
    _aborts[0] += 1
    for group in list(_groups.values()):
        if group is not None:
            group.abort()


def waiting_in(frame: Any) -> Optional[tuple[Op, Any]]:
    """(the call a thread at ``frame`` waits in its check for, the user's frame that made it), or
    None: the check's own frames, innermost, hold ``checking``."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = None
    while frame is not None and frame.f_code.co_filename.startswith(here):
        if found is None:
            checking = frame.f_locals.get("checking") if frame.f_code.co_name in _WAITING else None
            if checking is not None:
                try:
                    found = checking()
                except Exception:
                    return None
        frame = frame.f_back
    return (found, frame) if found is not None else None


_WAITING = {"_await", "_await_keys"}
