"""A process group's check: every rank publishes its call, waits for its peers', and compares.

::

    rank i: dist.all_reduce(x)  ──> wrappers.py: its description (calls.py) and line
        Group.collective:  put ("c", i)[k] ─────────────────> the group's table (table.py: shared
                           wait for ("c", j)[k] of each peer <── memory on one host; store.py: its
                           (asleep on the bell; a look sees      store across hosts)
                           "waiting in all_reduce #n")
        alike: gloo runs it.  apart: every rank raises the same CollectiveError, none entered
        gloo, and the next call on the group is numbered as if this one never was
    async_op=True: looks for SPIN (50 us); peers not all there: the call goes to the group's lane and a Work
        comes back at once (deferred.py: the lane finishes the check, issues it, in order)
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
import sys
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from ..recorder import Op
from . import calls
from .mismatch import HOLD_INTERRUPTS, CheckAborted, Mismatch, error_for
from .store import StoreTable
from .table import LAPPED, Ring, ShmTable, host_identity

if TYPE_CHECKING:
    from .deferred import Lane

#: Seconds a waiting rank sleeps at most before it looks again (a stop, an abort, a lost bell).
SLICE = 0.05
#: Seconds a rank looks again, yielding its core between looks, before it sleeps: a peer in step
#: comes within microseconds, and a sleep and its wake cost more than that (measured on 2 loaded
#: cores: 50 us did best of 0, 50 and 300 us; a longer spin takes the core from the peer's gloo).
SPIN = 50e-6
_SETUP_KEYS = "mpify_nb.check/setup/"


#: What torchdist/waits.py hands over as it is imported (it looks at us; we never import it): the
#: recorder's ops of the live groups, and whether a file is the user's.
RECORDED: list[Callable[[], list]] = []
USER_FILE: list[Callable[[str], bool]] = []


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
        self.p2p_calls: dict[tuple[int, int, Any], int] = {}  # (peer, send 0 / recv 1, tag)
        self.p2p_seen = 0  # point-to-point calls (they take a number of torch's sequence too)
        self.any_source = False  # it received from any rank: its recvs pair as only gloo knows
        self.published = 0  # collectives this rank has published
        self.judged = 0  # collectives whose peers' calls this rank has read and compared
        self.lane: Optional[Lane] = None  # async calls handed back before their check was over
        self.aborted = False
        self.closing = False
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
        """Publish this rank's call, wait for every peer's, raise if they cannot be one (after the
        async calls still in the lane: collectives reach gloo in the order the rank made them)."""
        if self.lane is not None and self.lane.items:
            self.lane.drain()
        index = self.calls
        self.calls += 1
        self.publish(index, description, line)
        got = self.wait_for_peers(index, op)
        error = self.judge(index, description, line, got)
        if error is not None:
            raise error
        self.raise_held()

    def collective_async(self, description: bytes, line: bytes, issue: Callable[[], Any]) -> Optional[Any]:
        """An ``async_op=True`` collective: None when every peer's call is there and alike (the
        caller issues it now); else a Work handed back at once: its check goes on in the lane
        (deferred.py), or it failed (a mismatch, raised from its ``wait()``)."""
        from . import deferred

        index = self.calls
        self.calls += 1
        if self.lane is not None and self.lane.items:
            return self.lane.add(index, description, line, issue, published=False)
        self.publish(index, description, line)
        got: dict[Ring, Any] = {}
        if not self._arrived(index, got):
            if self.lane is None:
                self.lane = deferred.Lane(self)
            return self.lane.add(index, description, line, issue, published=True)
        error = self.judge(index, description, line, got)
        return None if error is None else deferred.failed(error)

    def _arrived(self, index: int, got: dict) -> bool:
        """Every peer's call ``index`` read into ``got`` within SPIN (yielding between looks): a
        peer in step comes in microseconds, and a call judged here skips the lane's two thread
        handoffs. Never sleeps: an async call returns at once."""
        spin_until = time.perf_counter() + SPIN
        while not self._gather(self.rings, index, got):
            if time.perf_counter() >= spin_until:
                return False
            try:
                os.sched_yield()
            except KeyboardInterrupt as e:  # published: the lane must still issue or fail it
                if not HOLD_INTERRUPTS[0]:
                    raise
                self.held = e
                return False
        return True

    def publish(self, index: int, description: bytes, line: bytes) -> None:
        self.table.put(self.ring, index, calls.joined(description, line, self.room))
        self.published = index + 1

    def judge(self, index: int, description: bytes, line: bytes, got: dict[Ring, bytes]) -> Optional[BaseException]:
        """None when every peer's call ``index`` (``got``) is this one; else the error every rank raises."""
        self.judged = index + 1
        if all(calls.description_of(data) == description for data in got.values()):
            return None
        mine = calls.decode(description)
        theirs = {ring[1]: data for ring, data in got.items()}
        descriptions = [mine if i == self.me else calls.decode(calls.description_of(theirs[i]))
                        for i in range(self.size)]
        why = calls.apart(descriptions, self.size)
        if why is None:
            return None
        self.held = None  # the mismatch is the news: every rank raises it
        lines = [calls.where(line) if i == self.me else calls.line_of(theirs[i]) for i in range(self.size)]
        number = self.number()
        return error_for(Mismatch(why, [(self.members[i], self.op_of(descriptions[i], number), lines[i])
                                        for i in range(self.size)]))

    def raise_held(self) -> None:
        """The stop button pressed while this rank waited: now, instead of entering gloo (a peer
        that did waits there, and the Session's stop unsticks it)."""
        held, self.held = self.held, None
        if held is not None:
            raise held

    def wait_for_peers(self, index: int, checking: Callable[[], Any],
                       stop: Optional[Callable[[], Optional[BaseException]]] = None) -> dict[Ring, bytes]:
        return self._await(self.rings, index, checking, stop)

    def _await(self, rings: list[Ring], index: int, checking: Callable[[], Any],
               stop: Optional[Callable[[], Optional[BaseException]]] = None) -> dict[Ring, bytes]:
        """Every ring's call ``index``, waited for. ``checking`` says what this rank waits in, to a
        look from the control thread (torchdist/waits.py reads this frame's locals); ``stop``: why
        to give up (the lane's thread: its group destroyed), checked before each sleep."""
        got: dict[Ring, Any] = {}
        spin_until = time.perf_counter() + SPIN
        first = True
        while True:
            try:
                if self._look(rings, index, got, spin_until, first, checking, stop):
                    return got
            except KeyboardInterrupt as e:
                if not HOLD_INTERRUPTS[0]:
                    raise
                self.held = e  # raised once the check is over (collective())
            first = False

    def _look(self, rings: list[Ring], index: int, got: dict, spin_until: float, first: bool,
              checking: Callable[[], Any], stop: Optional[Callable[[], Optional[BaseException]]] = None) -> bool:
        """One look at the peers' slots (and a yield, or a sleep on the bell): all there?"""
        table = self.table
        token = table.token()
        if self._gather(rings, index, got):
            return True
        if self.aborted:
            raise CheckAborted(f"the process group was aborted while this rank waited in {_kind(checking())}")
        if time.perf_counter() < spin_until:
            os.sched_yield()  # a peer in step is microseconds away; one on this core runs first
            return False
        if stop is not None:
            reason = stop()
            if reason is not None:
                raise reason
        table.sleep(token, [(ring, index) for ring in rings if ring not in got], SLICE, first)
        return False

    def _gather(self, rings: list[Ring], index: int, got: dict) -> bool:
        """Read the peers' calls ``index`` published since the last look into ``got``: all there?"""
        table = self.table
        for ring in rings:
            if ring not in got:
                data = table.get(ring, index)
                if data is not None:  # (a collective's slot is never lapped: were it, unjudged)
                    got[ring] = data if data is not LAPPED else calls.joined(calls.UNCHECKED, b"", 1 << 20)
        return len(got) == len(rings)

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
        self.table.put(mine, index, calls.joined(description, line, self.table.room(mine)), tag)
        # the put's atomic bell is a full barrier: of two ranks that publish, one sees the other
        data = self.table.get(("p", peer, self.me, 1 - direction), index, tag)
        if data is None or data is LAPPED:
            return  # the peer checks when it comes (or lagged a ring behind: unjudged)
        assert isinstance(data, bytes)
        theirs = calls.decode(calls.description_of(data))
        ours = calls.decode(description)
        send, recv = (ours, theirs) if kind == "send" else (theirs, ours)
        why = calls.p2p_apart(send, recv)
        if why is None:
            return
        pair = sorted([(self.me, ours, calls.where(line)), (peer, theirs, calls.line_of(data))],
                      key=lambda item: item[0])
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

    def pending(self) -> list[tuple[Op, int]]:
        """(op, index) of the async calls still in the lane (not yet in gloo), in order."""
        lane = self.lane
        return lane.ops() if lane is not None and lane.items else []

    def abort(self) -> None:
        self.aborted = True
        self.table.wake()

    def close(self) -> None:
        """The group is gone: the lane's calls fail, its thread ends, the table is unmapped."""
        if self.closing:
            return
        self.closing = True
        lane = self.lane
        if lane is not None and lane.thread is not None:
            self.table.wake()
            lane.join(2 * SLICE + 1.0)
        self.table.close()


def _kind(checking: Any) -> str:
    return (checking[0] if isinstance(checking, tuple) else checking).kind


# -- making a group's table ---------------------------------------------------------------------

#: {process group: its Group (or None: not checked)}, for as long as the group lives.
_groups: weakref.WeakKeyDictionary[Any, Optional[Group]] = weakref.WeakKeyDictionary()
_made: weakref.WeakSet[Group] = weakref.WeakSet()  # every Group alive, its table open or closed


def known(pg: Any) -> tuple[bool, Optional[Group]]:
    """(whether ``pg``'s check was set up, its Group)."""
    try:
        if pg not in _groups:
            return False, None
        return True, _groups[pg]
    except (TypeError, KeyError):  # not weakly referenceable; or collected between the two looks
        return True, None


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
            group.close()


def pending_ops() -> list[tuple[Op, int]]:
    """(op, index) of every async call of this process still in its group's lane."""
    out: list[tuple[Op, int]] = []
    for group in list(_made):
        if group.lane is not None and group.lane.items:
            out += group.pending()
    return out


def counts() -> list[tuple[str, Optional[int], int, int]]:
    """(name, torch's count of its collectives less point-to-point calls (None: unknown), calls
    published, calls judged) of each checked group alive; torch's count is read first."""
    out = []
    for pg, group in list(_groups.items()):
        if group is None or group.closing:
            continue
        try:
            counted: Optional[int] = pg._get_sequence_number_for_group() - group.p2p_seen
        except Exception:
            counted = None
        out.append((group.name, counted, group.published, group.judged))
    return out


def abort_all() -> None:
    """Every check waiting in this process raises CheckAborted (the Session aborts its groups)."""
    _aborts[0] += 1
    for group in list(_groups.values()):
        if group is not None:
            group.abort()


def waiting_in(frame: Any) -> Optional[tuple[Op, Any, Optional[tuple[str, int]]]]:
    """(the call a thread at ``frame`` waits in its check for, the user's frame that made it, the
    line of that call where it was made elsewhere: an async one waited for in its lane), or None:
    the check's own frames, innermost, hold ``checking``."""
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
    if found is None:
        return None
    op, where = found if isinstance(found, tuple) else (found, None)
    return op, frame, where


_WAITING = {"_await", "_await_keys", "_await_settled"}
