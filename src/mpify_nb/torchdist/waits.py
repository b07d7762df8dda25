"""What a rank waits on in torch.distributed, and where it is: a :class:`Snapshot` of one process.

Torch gives no signal that a rank waits for a peer that will never come, nor that two ranks
wait in collectives that cannot match: every such rank just blocks. The caller finds out by
looking at every rank (engine/watch.py decides when, engine/verdict.py what the looks mean).
A look is taken here, in the rank (on its control thread), or in the notebook itself for the
caller's own rank of a ``ranch`` call::

    torch's flight recorder   every collective a gloo or NCCL group is asked for, from any
    (torchdist/recorder.py)   thread and through any API: its op, its number on its group,
                              its tensors' sizes and dtypes, done or not. NCCL records its
                              sends and recvs too; gloo does not.
    the thread's stack        the torch.distributed call it is blocked in (a send's peer and
    (stacks.py)               tag, a broadcast's src: the recorder keeps no roots), a
                              ``Work.wait()``, a DDP forward; else the line it runs, or the
                              function it is blocked in (``sleep()``), and its user's line.
    hidden_waits.py           where gloo has no recorder (torch < 2.8): a wait deeper in
                              torch (a DTensor's, a functional collective's, DDP's backward),
                              seen from the stack and the thread's CPU time.

A look costs about 0.3 ms (a 32-entry recorder: ``RECORDER_ENTRIES``), and nothing happens
between looks: no thread of ours polls while the user's code runs.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from . import compat, hidden_waits, p2p
from .checks import groups as checked_groups
from .recorder import Op, entries_to_ops, issued, with_root
from .stacks import _doing, _in_our_loop, _is_user_file, _stack, blocked_call, user_line_in

#: Entries the recorder keeps (a ring). Only the newest matter: an unfinished collective is
#: one of the last few issued, and a small ring keeps a dump cheap (32 entries: ~0.3 ms; torch's
#: default, 2000, takes 70-90 ms). Its size is fixed by the first group a process makes.
RECORDER_ENTRIES = 32

RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


@dataclass(frozen=True)
class Snapshot:
    """One rank, looked at once: the collectives it issued (``ops``: the recorder's, of the
    groups alive now, oldest first, done or not), what its thread waits in (``blocked``, from
    its stack; ``label`` names it as the user called it), and where that thread is."""

    rank: int
    ops: tuple[Op, ...] = ()
    blocked: Optional[Op] = None
    label: str = ""  # "dist.all_reduce", "Work.wait() of a send", "DistributedDataParallel.forward"
    any_peer: bool = False  # blocked in a point-to-point wait whose peer is unknown (a Work's)
    where: Optional[tuple[str, int]] = None  # the user's line the thread is at
    doing: str = "running"  # "waiting" (in torch.distributed), "running", "in sleep()", "idle"
    stack: tuple[tuple[str, int, str], ...] = ()  # (file, line, function), outermost first (asked for)
    taken_ns: int = field(default_factory=time.time_ns)
    #: Per group with a collective check: (its name, calls published, calls judged, the number of the
    #: last collective it entered in gloo), read after its recorder (engine/verdict.py's "bypassed").
    checks: tuple[tuple[str, int, int, int], ...] = ()
    #: Its sends to and recvs from each peer since its groups began: ((kind, peer, count), ...).
    p2p: tuple[tuple[str, Optional[int], int], ...] = ()

    @property
    def pending(self) -> list[Op]:
        """What it waits on: the recorder's collectives not done, and a point-to-point call on
        its stack (gloo records none)."""
        out = [o for o in self.ops if not o.done]
        if self.blocked is not None and self.blocked.seq is None and self.blocked not in out:
            out.append(self.blocked)
        return out

    @property
    def issued(self) -> dict[str, int]:
        return issued(list(self.ops))

    def p2p_count(self, kind: str, peer: Optional[int]) -> int:
        """Its sends to (``kind`` "send") or recvs from ``peer`` so far (None: from any rank)."""
        return sum(n for k, p, n in self.p2p if k == kind and p == peer)

    def op_at(self, group: str, seq: int) -> Optional[Op]:
        for o in self.ops:
            if o.group == group and o.seq == seq:
                return o
        return None


#: Wall-clock ns when this process's current groups began (set by enable_recorder()): the
#: recorder keeps entries of groups destroyed since, whose names and numbers new groups reuse.
_groups_born_ns = 0


def recorder_env(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variable that makes the groups a process creates record their collectives in a small
    ring (unless ``env`` sets a recorder size already): for a rank's environment."""
    env = os.environ if env is None else env
    if any(env.get(name) for name in RECORDER_VARIABLES):
        return {}
    return {compat.recorder_variable(): str(RECORDER_ENTRIES)}


def enable_recorder() -> None:
    """Groups made from now on record their collectives; what earlier groups recorded is
    forgotten. Call before ``init_process_group``."""
    os.environ.update(recorder_env())
    mark_groups_born()
    note_p2p()


def note_p2p() -> None:
    """isend/irecv note their peers and tags from now on (torchdist/p2p.py)."""
    p2p.install()


def mark_groups_born() -> None:
    """What the recorder holds from before now is of groups that are gone (a caller's own rank:
    of its earlier calls)."""
    global _groups_born_ns
    _groups_born_ns = time.time_ns()
    p2p.reset()


#: A dump of a recorder bigger than ours (the user chose its size, or a group was made before we
#: could choose: torch's default of 2000 entries takes 70-90 ms) is read at most once per this
#: many times its own cost; between, the last reading stands (its entries, filtered again).
_DUMP_SHARE = 50
_last_dump: dict = {"cost": 0.0, "ended": 0.0, "big": False, "entries": []}


def _recorder_entries(force: bool = False) -> list[dict]:
    """This process's recorder entries, gloo's and NCCL's, oldest first."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return []
    last = _last_dump
    if not force and last["big"] and time.monotonic() < last["ended"] + last["cost"] * _DUMP_SHARE:
        return list(last["entries"])
    started = time.monotonic()
    entries: list[dict] = []
    # torch >= 2.8 records gloo's collectives in _dump_fr_trace; NCCL's are in _dump_nccl_trace
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            entries += pickle.loads(dump(True, False, False)).get("entries", [])
        except Exception:
            continue  # no NCCL in this torch, or no group of that kind
    seen: set = set()
    fresh = []
    for e in sorted(entries, key=lambda e: e.get("time_created_ns") or 0):
        key = (e.get("pg_id"), e.get("collective_seq_id"), e.get("p2p_seq_id"), e.get("time_created_ns"))
        if key not in seen:
            seen.add(key)
            fresh.append(e)
    # Big by its size, not by one slow reading (a loaded machine makes any dump slow now and then).
    last.update(cost=time.monotonic() - started, ended=time.monotonic(),
                big=len(entries) > 4 * RECORDER_ENTRIES, entries=fresh)
    return fresh


def _dist() -> Any:
    """torch.distributed with a group up, or None (never imports torch)."""
    if "torch.distributed" not in sys.modules:
        return None
    try:
        dist = sys.modules["torch.distributed"]
        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def groups_now() -> dict[str, Optional[tuple[int, ...]]]:
    """{name: global ranks (None: the world)} of this process's groups alive now."""
    dist = _dist()
    if dist is None:
        return {}
    try:
        from torch.distributed import distributed_c10d as c10d

        world = dist.GroupMember.WORLD
        return {name: None if group is world else tuple(dist.get_process_group_ranks(group))
                for group, name in c10d._world.pg_names.items()}
    except Exception:
        return {}


def recorded_ops() -> list[Op]:
    """The recorder's ops of the groups alive now, oldest first."""
    groups = groups_now()
    if not groups:
        return []
    return entries_to_ops(_recorder_entries(), groups, _groups_born_ns)


def snapshot(rank: int, thread_id: int, native_id: Optional[int] = None, stack: bool = False) -> Snapshot:
    """Look at this process: its recorder, and the thread ``thread_id`` (its main thread, or
    the thread that runs a caller's own rank). ``stack``: its Python stack too."""
    ops = recorded_ops()
    checks = _check_counts(ops)  # after the recorder: a call it shows was published before (verdict.py)
    frame = sys._current_frames().get(thread_id)
    blocked, label, any_peer = blocked_call(frame)
    checking = checked_groups.waiting_in(frame)
    called_at = None
    if checking is not None:  # in the collective check, before the collective (torchdist/checks/)
        blocked, frame, called_at = _checked(checking[0], ops), checking[1], checking[2]
        label, any_peer = f"dist.{blocked.kind}", blocked.is_p2p and blocked.root is None
    elif blocked is not None and blocked.seq is None and not blocked.is_p2p:
        # A collective on the stack: the recorder's newest unfinished one on its group is it (by
        # the name torch recorded: all_gather_object waits in an all_gather); the stack knows
        # its root (a broadcast's src), the recorder its number and sizes.
        for i in range(len(ops) - 1, -1, -1):
            o = ops[i]
            if not o.done and not o.is_p2p and (blocked.group is None or o.group == blocked.group):
                ops[i] = blocked = with_root(o, blocked.root if o.kind == blocked.kind else None)
                break
    if blocked is None and not label and not ops and _unrecorded_group():
        # gloo before torch 2.8 records nothing: a wait deeper in torch is seen another way
        hidden = hidden_waits.look(thread_id)
        if hidden is not None:
            label, any_peer = hidden, True  # its collective, and so its peers, unknown
    _add_pending(ops)
    # What it does, then where: a blocked thread stays on its line, so the line read after agrees
    # with it (read before, a thread that went on into sleep() was said to sleep on the line before).
    state = None if blocked is not None or label else _doing(frame, native_id)
    frames = _stack(frame)
    where = called_at or user_line_in(frames)
    if state is None:
        doing = "waiting"
    elif where is None and frame is not None and _in_our_loop(frame):
        doing = "idle"
    else:
        doing = state
    return Snapshot(rank, tuple(ops), blocked, label, any_peer, where, doing, frames if stack else (),
                    checks=checks, p2p=p2p.counts())


def _check_counts(ops: list[Op]) -> tuple[tuple[str, int, int, int], ...]:
    """Each checked group's (name, published, judged, last collective entered in gloo): the last
    entered from the recorder (``ops``), where gloo has none (torch < 2.8) from torch's own count."""
    counts = checked_groups.counts()
    if not counts:
        # No group checked yet: nothing to import. A spawned rank may be importing torch for the
        # first time on its main thread (the function's own import): a second import of torch here,
        # on the control thread, broke both (importlib's _DeadlockError there, KeyError here).
        return ()
    recorded = issued(ops) if compat.has_gloo_recorder() else None
    out = []
    for name, counted, published, judged in counts:
        entered = counted if recorded is None else recorded.get(name, 0)
        if entered is not None:
            out.append((name, published, judged, entered))
    return tuple(out)


def _checked(op: Op, ops: list[Op]) -> Op:
    """A call a rank's collective check holds: numbered after what its group's recorder holds
    (the check's own number counts torch's sequence, point-to-point calls included, where gloo
    records nothing), and added to the ops as issued, not done (its peers' looks compare it)."""
    if op.is_p2p:
        return op
    numbered = issued(ops).get(op.group) if op.group is not None else None
    op = replace(op, seq=numbered + 1, called=True) if numbered is not None else replace(op, called=True)
    ops.append(op)
    return op


def _add_pending(ops: list[Op]) -> None:
    """The async collectives this rank made that wait in their check (a group's lane), not yet in
    gloo: among its ops, not done (the verdicts compare them with the peers')."""
    held = {(o.group, o.seq) for o in ops if o.seq is not None}
    for op, _index in checked_groups.pending_ops():
        if (op.group, op.seq) not in held:
            ops.append(replace(op, called=True))


#: How long a returning rank waits for the collectives it returned from to be retired, and its
#: first and longest pause between two reads of its recorder. gloo retires one on its worker
#: thread a moment after ``wait()`` returned, usually well within a millisecond: a fixed 10 ms
#: pause cost a call 10 ms whenever the first read came too soon (a read costs ~0.3 ms).
_RETIRE_PATIENCE = 0.05
_RETIRE_PAUSES = (0.0002, 0.01)


def snapshot_of_return(rank: int, settle: bool = True) -> Optional[Snapshot]:
    """A rank whose function returned: the collectives it issued (None: it made no group). Its
    groups may be gone already (destroyed inside the function): their names are still those
    the peers know them by. ``settle``: wait (up to 50 ms) for those it returned from to be
    retired; else they are read as they are."""
    entries = _recorder_entries(force=True)
    sent = p2p.counts()
    if not entries:  # no collective recorded (gloo before torch 2.8): what it sent, if anything
        return Snapshot(rank, doing="returned", p2p=sent) if sent else None
    groups = groups_now() or None
    ops = entries_to_ops(entries, groups, _groups_born_ns)
    deadline = time.monotonic() + (_RETIRE_PATIENCE if settle else 0.0)
    pause, longest = _RETIRE_PAUSES
    while not all(o.done for o in ops) and time.monotonic() < deadline:
        # A collective it returned from is retired a moment after (gloo's work finishes after
        # wait() returns): read again, so it is told as done (a wrong value, not a mismatch).
        time.sleep(pause)
        pause = min(pause * 2, longest)
        ops = entries_to_ops(_recorder_entries(force=True), groups, _groups_born_ns)
    return Snapshot(rank, tuple(ops), doing="returned", p2p=sent) if ops or sent else None


def snapshot_of_failure(rank: int, exc: BaseException) -> Optional[Snapshot]:
    """A rank's error raised inside torch.distributed (a peer closed the connection: gloo's
    "Connection closed by peer"): what it was waiting in when it failed, and the user's line
    that called it; None for an error raised elsewhere."""
    tb = exc.__traceback__
    in_dist = False
    where = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "distributed" in filename.split(os.sep) or "autograd" in filename.split(os.sep):
            in_dist = True
        elif _is_user_file(filename):
            where = (filename, tb.tb_lineno)
        tb = tb.tb_next
    if not in_dist:
        try:
            text = str(exc).lower()
        except Exception:
            return None  # its __str__ raised: the error is reported without our help
        if "gloo" not in text and "nccl" not in text:
            return None
    ops = entries_to_ops(_recorder_entries(force=True), groups_now() or None, _groups_born_ns)
    if not ops:
        return None
    # The collective it failed in is its last one (it is blocked on it; gloo retired it with the error).
    last = ops[-1]
    blocked = Op(last.kind, last.group, last.ranks, last.seq, last.inputs, last.outputs, last.root, last.tag,
                 done=False, issued_ns=last.issued_ns)
    return Snapshot(rank, tuple(ops[:-1]) + (blocked,), blocked, f"dist.{last.kind}", False, where, "waiting",
                    p2p=p2p.counts())



def _unrecorded_group() -> bool:
    """Is this process's group one whose collectives the recorder misses (gloo before torch 2.8)?"""
    dist = _dist()  # first: no group, no import of torch here (see _check_counts)
    if dist is None or compat.has_gloo_recorder():
        return False
    try:
        return dist.get_backend() == "gloo"
    except Exception:
        return False


# The collective check (torchdist/checks/) numbers a call as the recorder will, and names the
# user's line of it, with what this module knows: handed over, as it never imports this one.
checked_groups.RECORDED[:] = [recorded_ops]
checked_groups.USER_FILE[:] = [_is_user_file]
